"""bench/kernels.py in its CPU smoke mode (our ops, tiny shapes, Triton interpreter): it runs every case end to end,
writes its JSON and table, reports a failing call in its row without stopping, and counts what the issue counts."""

from __future__ import annotations

import json

import pytest
import torch

import bench.kernel_cases as kernel_cases
from bench.kernel_cases import BAMBA_9B, scan_counts, ssu_counts
from bench.kernels import OP_ORDER, main

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for the CPU interpreter"),
    # the Triton interpreter itself converts one-element arrays to loop bounds in a way numpy deprecates
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def run(tmp_path, *args):
    code = main(["--smoke", "--out", str(tmp_path), *args])
    return code, json.loads((tmp_path / "kernels.json").read_text()), (tmp_path / "kernels.md").read_text()


def test_smoke_run_times_every_op_and_writes_json_and_table(tmp_path):
    code, report, table = run(tmp_path)
    assert code == 0
    rows = report["rows"]
    assert {r["op"] for r in rows} == set(OP_ORDER)
    for r in rows:
        name = "torch" if r["op"] == "d2d_copy" else "ours"
        entry = r["impls"][name]
        assert entry["ms"] > 0 and entry["nonfinite"] == 0, (r["op"], r["case"], entry)
        assert f"| {r['op']} | {r['case']} |" in table


def test_a_failing_call_is_reported_in_its_row_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(kernel_cases, "selective_state_update", broken)
    code, report, table = run(tmp_path, "--only", "selective_state_update,rms_norm_gated")
    assert code == 1
    by_op = {}
    for r in report["rows"]:
        by_op.setdefault(r["op"], []).append(r)
    assert all(r["impls"]["ours"]["error"] == "RuntimeError: planted failure" for r in by_op["selective_state_update"])
    assert all(r["impls"]["ours"]["ms"] > 0 for r in by_op["rms_norm_gated"])
    assert "ours: RuntimeError: planted failure" in table


def test_cases_past_the_budget_are_listed_as_skipped(tmp_path):
    code, report, _ = run(tmp_path, "--budget", "0")
    assert code == 0
    assert report["rows"] and all(r["error"].startswith("skipped") and not r["impls"] for r in report["rows"])


def test_counts_at_bamba_9b_match_the_issue_figures():
    # per token: H·(4PN + 2QP) + G·2QN = 128·(32768 + 32768) + 65536 FLOPs ("~8 MFLOP per token" in issue 12);
    # bytes: x and y 2·8192·2, B and C 2·128·2, dt 128·4, plus the final state and A, D, dt_bias once
    flops_per_token, bytes_per_token = 8_454_144, 32_768 + 512 + 512
    counts = scan_counts(BAMBA_9B, 32_768, 1, 2, 4)
    assert counts.flops == 32_768 * flops_per_token
    assert counts.bytes == 32_768 * bytes_per_token + 128 * 64 * 128 * 4 + 3 * 128 * 4
    # decode, batch 256, fp32 state: the state is read and written, 4 MiB per row each way
    assert ssu_counts(BAMBA_9B, 256, 2, 4).bytes == 256 * (2 * 4 * 2**20 + 2 * 8192 * 2 + 2 * 128 * 2 + 128 * 4) \
        + 3 * 128 * 4


class _GLA:
    """fla's chunk_simple_gla as its docstring defines it, step by step in fp64 (fla itself needs a GPU: it asks
    Triton for the active driver at import): per sequence of cu_seqlens, S_t = exp(g_t)·S_{t-1} + k_tᵀ v_t and
    o_t = scale · q_t S_t, the state [K, V] per head, or [V, K] with state_v_first."""

    name = "fake-fla"

    @staticmethod
    def chunk_simple_gla(q, k, v, g, scale, output_final_state, state_v_first, cu_seqlens, initial_state=None):
        q, k, v, g = (t[0].double() for t in (q, k, v, g))                          # (T, H, K/V), g (T, H)
        o, finals = torch.zeros_like(v), []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            S = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)   # (H, K, V)
            for t in range(start, end):
                S = torch.exp(g[t])[:, None, None] * S + k[t][:, :, None] * v[t][:, None, :]
                o[t] = scale * torch.einsum("hk,hkv->hv", q[t], S)
            finals.append(S.transpose(-1, -2) if state_v_first else S)
        return o[None].float(), torch.stack(finals).float()


@pytest.mark.parametrize("n_seqs", [1, 3])
def test_the_fla_scan_peer_is_given_the_ssd_recurrence_in_its_conventions(n_seqs):
    """The scan case hands fla q = C, k = B (groups expanded to heads), v = x·Δ, g = Δ·A, adds D·x and reads its
    V-first final states: with fla's documented recurrence, its y and states equal ours to fp32 rounding."""
    from argparse import Namespace

    from bench.kernel_cases import SMOKE, Setup, scan_case
    from bench.kernels import run_case

    setup = Setup(SMOKE, torch.device("cpu"), torch.float32, 0)
    row = run_case(scan_case(setup, {"fla": _GLA()}, 40, n_seqs, torch.float32), Namespace(), False, lambda _: None)
    fla = row["impls"]["fla"]
    assert "error" not in fla and "max_abs_diff_error" not in fla, fla
    y_diff, state_diff = fla["max_abs_diff"]
    assert y_diff < 1e-4 and state_diff < 1e-4, fla["max_abs_diff"]
    assert row["impls"]["ours"]["max_abs"][0] > 0.1                # not two zero outputs


def test_a_peer_that_fails_to_load_is_named_in_the_table(tmp_path, monkeypatch):
    """A run that lost a peer says so in its table's first line (an H200 run once lost fla silently but for a log
    line, and its table compared the scan with two peers instead of three)."""
    import sys
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "peer_loader.py").write_text(
        "import types\n"
        "def load_vllm(): raise RuntimeError('planted: no vllm')\n"
        "def load_mamba_ssm(): raise RuntimeError('planted: no mamba_ssm')\n"
        "def load_fla(): raise NotImplementedError('planted: no fla')\n"
        "def patch_torch_for_interpreter(): pass\n"
        "def prune_autotune_for_interpreter(*modules): pass\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "peer_loader", raising=False)
    try:
        code, report, table = run(tmp_path / "out", "--peers", str(peers), "--only", "d2d_copy")
    finally:
        sys.modules.pop("peer_loader", None)
    assert code == 0
    assert report["meta"]["peers_failed"] == {"vllm": "RuntimeError: planted: no vllm",
                                              "mamba_ssm": "RuntimeError: planted: no mamba_ssm",
                                              "fla": "NotImplementedError: planted: no fla"}
    first = table.splitlines()[0]
    assert "fla FAILED TO LOAD (NotImplementedError: planted: no fla)" in first and "vllm FAILED TO LOAD" in first


def test_rounds_time_every_implementation_once_a_round_in_shuffled_orders():
    from argparse import Namespace

    from bench.kernels import time_in_rounds

    calls = []

    def measure(run, a):
        calls.append(run)
        if run == "uncapturable":
            raise RuntimeError("operation not permitted when stream is capturing")
        return {"ours": 1.0, "vllm": 2.0, "mamba_ssm": 3.0}[run] + len(calls) * 1e-6

    runs = {name: name for name in ("ours", "vllm", "mamba_ssm", "uncapturable")}
    rounds, failed = time_in_rounds(runs, Namespace(seed=0), measure, 6)
    assert {name: len(times) for name, times in rounds.items()} == {"ours": 6, "vllm": 6, "mamba_ssm": 6}
    assert list(failed) == ["uncapturable"] and calls.count("uncapturable") == 1, "a failed run stays in the rounds"
    timed = [c for c in calls if c != "uncapturable"]
    orders = [tuple(timed[i:i + 3]) for i in range(0, len(timed), 3)]
    assert all(sorted(order) == ["mamba_ssm", "ours", "vllm"] for order in orders), orders
    assert len(set(orders)) > 1, f"every round ran in the same order: {orders[0]}"
    assert all(abs(t - {"ours": 1.0, "vllm": 2.0, "mamba_ssm": 3.0}[name]) < 1e-3
               for name, times in rounds.items() for t in times)


def test_the_table_gives_the_range_of_the_per_round_ratio():
    from bench.kernels import table_line

    row = dict(op="selective_state_update", case="batch1-state_float32", ratio=1.02, ratio_rounds=[0.97, 1.05],
               impls=dict(ours=dict(ms=0.0035, tbps=2.4, tflops=0.0, ms_rounds=[0.0035] * 7),
                          vllm=dict(ms=0.0036, ms_rounds=[0.0036] * 7)))
    assert "peer/ours per round 0.97-1.05 (7 rounds)" in table_line(row, "", ["vllm"])


def test_device_times_give_their_own_ratio_against_the_faster_peer_and_show_in_the_notes():
    from bench.kernels import add_ratios, table_line

    row = dict(op="causal_conv1d", case="T2048-seqs8",
               impls=dict(ours=dict(ms=0.0615, device_ms=0.0314, ms_rounds=[0.0615] * 3),
                          ours_rounded=dict(ms=0.05, device_ms=0.044),
                          vllm=dict(ms=0.0579, device_ms=0.0340, ms_rounds=[0.0579] * 3),
                          mamba_ssm=dict(ms=0.09, device_ms=0.0330)))
    add_ratios(row)
    assert abs(row["ratio"] - 0.0579 / 0.0615) < 1e-12                      # do_bench: the faster peer is vllm
    assert abs(row["device_ratio"] - 0.0330 / 0.0314) < 1e-12               # device: the faster peer is mamba_ssm
    assert abs(row["device_ratio_rounded"] - 0.0330 / 0.044) < 1e-12
    notes = table_line(row, "", ["vllm", "mamba_ssm"])
    assert "device µs ours 31.4, vllm 34.0, mamba_ssm 33.0 (peer/ours 1.05)" in notes
    assert "device µs ours 44.0, vllm 34.0, mamba_ssm 33.0 (peer/ours 0.75)" in table_line(row, "_rounded",
                                                                                          ["vllm", "mamba_ssm"])
