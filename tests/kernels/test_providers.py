"""The op-provider switch itself (tests/kernels/providers.py, ops_plugin.py, peer_findings.py, conformance.py): the
peers' chunk metadata by its definition, findings that pin real tests, a boundary class for every test a peer runs,
the table's cells, and the errors a user gets for a bad --ops or missing peers."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels import conformance, ops_plugin, providers
from tests.kernels.peer_findings import FINDINGS

ROOT = Path(__file__).resolve().parents[2]


def test_chunk_indices_offsets_cut_at_every_chunk_and_sequence_start():
    # sequences of 5, 20, 9, 30, 7 tokens, Q = 16: cuts at 0, 5, 16, 25, 32, 34, 48, 64
    cu = torch.tensor([0, 5, 25, 34, 64, 71], dtype=torch.int32)
    indices, offsets = providers.chunk_indices_offsets(cu, 16, 71)
    assert indices.tolist() == [0, 0, 1, 1, 2, 2, 3, 4]
    assert offsets.tolist() == [0, 5, 0, 9, 0, 2, 0, 0]
    # starts on chunk edges add nothing; one sequence is the plain grid
    assert providers.chunk_indices_offsets(torch.tensor([0, 16, 48]), 16, 48)[0].tolist() == [0, 1, 2]
    assert providers.chunk_indices_offsets(torch.tensor([0, 40]), 16, 40)[1].tolist() == [0, 0, 0]


def test_initial_states_select_slots_and_never_leak_unselected_nan():
    pool = torch.full((4, 2, 3, 5), float("nan"))
    pool[2] = 1.5
    got = providers._initial_states(pool, torch.tensor([2, 0], dtype=torch.int32), torch.tensor([True, False]))
    assert torch.equal(got[0], pool[2]) and torch.equal(got[1], torch.zeros_like(got[1]))


def _collected_kernel_tests() -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/kernels"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line.strip() for line in proc.stdout.splitlines() if line.startswith("tests/kernels/")]


@pytest.fixture(scope="module")
def collected() -> list[str]:
    return _collected_kernel_tests()


def test_every_finding_pins_existing_tests_and_has_its_reproducer(collected):
    assert FINDINGS, "the registry is empty"
    for finding in FINDINGS:
        assert set(finding.providers) <= set(providers.PEER_NAMES) - {"vendored"}, finding.key
        for pattern in finding.patterns(cuda=True):
            assert any(fnmatch.fnmatchcase(node, pattern) for node in collected), \
                f"{finding.key}: {pattern} matches no test: a finding that pins nothing"
        script = finding.reproducer.split()[0]
        assert (ROOT / script).is_file(), f"{finding.key}: no reproducer {script}"
        if len(finding.reproducer.split()) > 1:
            assert finding.reproducer.split()[1] == finding.key
    assert len({f.key for f in FINDINGS}) == len(FINDINGS)


def test_every_test_a_peer_runs_has_a_boundary_class(collected):
    peer_tests = [n for n in collected if Path(n.split("::")[0]).stem in ops_plugin.PROVIDER_MODULES]
    assert len(peer_tests) > 100
    lumped = [n for n in peer_tests if conformance.boundary_class(n) == conformance.OTHER
              and "test_rejects" not in n and "launch" not in n and "tile" not in n and "logical_chunks" not in n
              and "bf16x3" not in n and "stage_4" not in n and "slot_" not in n and "chunked_torch_twin" not in n
              and "rounded_products_do_round" not in n and "out_takes" not in n]
    assert not lumped, f"tests a peer runs without a boundary class in tests/kernels/conformance.py: {lumped[:5]}"


def test_table_cells_count_outcomes_and_name_the_worst_error(tmp_path):
    rows = {"vendored": [dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[H6-G1]", outcome="passed",
                              worst=0.25),
                         dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[G4-equals-H]", outcome="failed",
                              worst=3.0)],
            "vllm": [dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[H6-G1]", outcome="xfail", worst=4e4),
                     dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[G4-equals-H]", outcome="skipped",
                          worst=None)]}
    table = conformance.tabulate(rows)
    cells = table["scan: groups, chunk sizes (8, 24, 128, 192)"]
    assert conformance.cell_text(cells["vendored"]) == "**FAIL 1**, pass 1, 3×"
    assert conformance.cell_text(cells["vllm"]) == "**finding 1**, skip 1, 4.0e+04×"
    doc = tmp_path / "doc.md"
    doc.write_text("head\n<!-- cpu-table -->\nold\n<!-- /cpu-table -->\ntail\n")
    conformance.write_doc(doc, "new\n", "cpu-table")
    assert doc.read_text() == "head\n<!-- cpu-table -->\nnew\n<!-- /cpu-table -->\ntail\n"


@pytest.mark.parametrize("ops, message", [
    ("vllm-9.9", "argument --ops: invalid choice: 'vllm-9.9'"),
    ("vllm", "peer_loader.py is missing; fetch the peers first (`make fetch-peers`"),
])
def test_bad_ops_or_missing_peers_is_a_usage_error(ops, message, tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "PEERS_VENDOR"}
    env["BAMBA_PEERS"] = str(tmp_path)                                  # an empty folder: no peers there
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "tests/kernels/test_rms_norm_gated.py", "--ops", ops], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (2, 4), proc.stdout[-1000:]
    assert message in proc.stdout + proc.stderr


def test_parallel_runs_every_provider_and_a_crashed_one_is_named(tmp_path, monkeypatch):
    # --parallel 2: both providers' runs overlap in time; one that wrote no report is a dashed column the header names
    import threading
    started, overlap = [], threading.Barrier(2, timeout=30)

    def fake_run(name, out, a):
        started.append(name)
        overlap.wait()                              # raises BrokenBarrierError unless the two runs overlap
        rows = [] if name == "mamba_ssm" else [dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[H6-G1]",
                                                    outcome="passed", worst=0.5)]
        return rows, 0.0, 0
    monkeypatch.setattr(conformance, "run_provider", fake_run)
    monkeypatch.setattr(conformance, "ROOT", tmp_path)
    status = conformance.main(["--ops", "vendored,mamba_ssm", "--parallel", "2", "--doc", "", "--out", "kc"])
    assert status == 1 and sorted(started) == ["mamba_ssm", "vendored"]
    body = (tmp_path / "kc" / "table.md").read_text()
    assert "Crashed before any test ran (no report; OUT/<provider>.log): mamba_ssm." in body
    assert "| pass 1, 0.5× | — |" in body
    with pytest.raises(SystemExit):
        conformance.parse_args(["--parallel", "0"])


def test_large_gpu_memory_tests_take_a_lock_across_processes(tmp_path, monkeypatch):
    # two pytest processes on one GPU (conformance --parallel) must not run their large tests at once
    import conftest
    lock = tmp_path / "gpu.lock"
    monkeypatch.setattr(conftest, "GPU_LOCK", str(lock))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    probe = ("import fcntl, sys\nf = open(sys.argv[1], 'a')\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")

    def other_process_can_lock() -> bool:
        rc = subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=60).returncode
        assert rc in (0, 3), rc
        return rc == 0

    class Node:
        def __init__(self, groups):
            self.groups = groups

        def iter_markers(self, name):
            return [pytest.mark.xdist_group(g).mark for g in self.groups] if name == "xdist_group" else []

    class Request:
        def __init__(self, groups):
            self.node = Node(groups)

    with conftest._large_gpu_memory_lock(Request([conftest.LARGE_GPU_MEMORY])):
        assert not other_process_can_lock()
    assert other_process_can_lock()
    with conftest._large_gpu_memory_lock(Request(["something-else"])):      # other tests take no lock
        assert other_process_can_lock()


def test_out_of_memory_and_cuda_errors_are_no_verdict():
    rows = {"vllm": [dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[a]", outcome="failed", worst=None,
                          reason="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1020.00 MiB"),
                     dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[b]", outcome="failed", worst=None,
                          reason="torch.AcceleratorError: CUDA error: an illegal memory access was encountered"),
                     dict(nodeid="tests/kernels/test_ssd_scan.py::test_groups[c]", outcome="failed", worst=3.0,
                          reason="AssertionError: out: 3 of 8 elements outside"),
                     dict(nodeid="tests/kernels/test_ssd_scan.py::test_chunk_sizes[d]", outcome="failed",
                          worst=None, reason="torch.OutOfMemoryError: CUDA out of memory.")]}
    cells = conformance.tabulate(rows)["scan: groups, chunk sizes (8, 24, 128, 192)"]
    assert conformance.cell_text(cells["vllm"]) == "**FAIL 1**, oom 2, cuda error 1, 3×"
    assert cells["vllm"]["failures"] == ["tests/kernels/test_ssd_scan.py::test_groups[c]"]
    only_oom = conformance.tabulate({"vllm": rows["vllm"][:1]})["scan: groups, chunk sizes (8, 24, 128, 192)"]
    assert conformance.cell_text(only_oom["vllm"]) == "oom 1"


class _Item:
    """What ops_plugin's isolation hook reads of a test item."""

    def __init__(self, nodeid: str, ops: str, finding):
        self.nodeid = nodeid
        self.stash = {ops_plugin._ISOLATED: finding}
        self.config = type("Config", (), {"getoption": staticmethod(lambda name: ops)})()


def test_an_isolated_finding_runs_its_test_in_a_child_process():
    finding = next(f for f in FINDINGS if f.isolate)
    # a real child: the test's own node id (without xdist's @group), --runxfail, the provider; its pass is this pass
    item = _Item("tests/kernels/test_rms_norm_gated.py::test_one_row@large-gpu-memory", "vendored", finding)
    assert ops_plugin.pytest_pyfunc_call(item) is True
    # a failing child: its first assertion line becomes this test's AssertionError (what the strict xfail expects);
    # a child that ran past its time is a failure too
    failed = subprocess.CompletedProcess([], 1, stdout="....\nE   torch.AcceleratorError: CUDA error: an illegal "
                                                       "memory access was encountered\nE   more\n", stderr="")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops_plugin.subprocess, "run", lambda command, **kw: failed)
        with pytest.raises(AssertionError, match=f"finding {finding.key}, exit 1.*illegal memory access"):
            ops_plugin.pytest_pyfunc_call(item)

        def hang(command, **kw):
            assert "--runxfail" in command and command[command.index("--ops") + 1] == "vendored"
            assert kw["env"][ops_plugin.ISOLATED_CHILD] == "tests/kernels/test_rms_norm_gated.py::test_one_row"
            raise subprocess.TimeoutExpired(command, kw["timeout"])
        mp.setattr(ops_plugin.subprocess, "run", hang)
        with pytest.raises(AssertionError, match="ran past"):
            ops_plugin.pytest_pyfunc_call(item)
    # a test with no isolated finding is left to pytest
    assert ops_plugin.pytest_pyfunc_call(_Item("tests/kernels/x.py::t", "vendored", None)) is None


def test_a_finding_holds_on_cuda_only_where_it_says():
    conv = next(f for f in FINDINGS if f.key == "vllm-conv-16bit-products")
    from tests.kernels.peer_findings import finding_for
    bf16 = "tests/kernels/test_causal_conv1d.py::test_16bit_inputs[bf16]"
    assert finding_for("vllm", bf16, cuda=True) is conv
    assert finding_for("vllm", bf16, cuda=False) is None          # the interpreter multiplies bf16 in fp32
    assert finding_for("vllm", bf16.replace("bf16", "fp16"), cuda=False) is conv
    assert finding_for("mamba_ssm", bf16, cuda=True) is None
