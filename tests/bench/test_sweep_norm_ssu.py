"""bench/sweep_norm_ssu.py: its CPU smoke run end to end (candidates launched through the ops' `_block_sizes`,
checked against the default launch, JSON written), how it judges a candidate's outputs, and the candidate lists."""

from __future__ import annotations

import json

import pytest
import torch

from bench.sweep_norm_ssu import compare, main, norm_candidates, ssu_candidates

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for the CPU interpreter")
def test_smoke_run_checks_every_candidate_and_recommends_one(tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["--smoke", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["rms_norm_gated", "selective_state_update", "selective_state_update"]
    for r in rows:
        assert r["candidates"] and all(c["status"] == "exact" and c["ms"] > 0 for c in r["candidates"]), r["case"]
        assert sum(c["default"] for c in r["candidates"] if c["stage"] == 2) == 1
        assert r["best"]["stage"] == 2
    ssu_launches = {tuple(c["launch"].values()) for c in rows[1]["candidates"]}
    assert len(ssu_launches) > 2, "the smoke run must launch more than the default"


def test_compare_tells_exact_from_reduction_order_from_wrong():
    y = torch.tensor([1.0, -2.0, 0.5])
    state = torch.arange(6.0)
    assert compare((y, state), (y.clone(), state.clone())) == ("exact", 0.0)
    one_ulp = torch.finfo(torch.float32).eps * 2.0
    assert compare((y, state), (y + torch.tensor([0.0, one_ulp, 0.0]), state.clone()))[0] == "y rounding"
    assert compare((y, state), (y + torch.tensor([0.0, 1e-3, 0.0]), state.clone()))[0] == "WRONG"
    assert compare((y, state), (y.clone(), state + torch.tensor([0.0] * 5 + [1e-6])))[0] == "WRONG"


def test_candidates_cover_tiles_warps_and_heads_at_bamba_9b():
    ssu = ssu_candidates(64, 128)
    assert {c.block_p for c in ssu} == {1, 2, 4, 8, 16, 32, 64}
    assert {c.num_warps for c in ssu} == {1, 2, 4, 8}
    assert {c.block_h for c in ssu} == {1, 2, 4}
    norm = norm_candidates(8192)
    assert {(c.block_rows, c.block_d) for c in norm} >= {(1, 8192), (2, 8192), (1, 4096), (4, 2048)}
    assert {c.num_warps for c in norm} == {4, 8, 16, 32}
