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
