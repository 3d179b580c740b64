"""bench/sweep_conv.py in its CPU smoke mode: every candidate's outputs are compared with the default's, the table and
JSON are written, and a candidate whose outputs differ is flagged and fails the run."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import bench.kernel_cases as kernel_cases
from bench.sweep_conv import main

# where causal_conv1d_update looks up _update_launch, the chooser the sweep replaces
conv_module = importlib.import_module("vendored.ops.causal_conv1d")

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for the CPU interpreter"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def run(tmp_path):
    code = main(["--smoke", "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "sweep.json").read_text()), (tmp_path / "sweep.md").read_text()


def test_smoke_sweep_times_candidates_equal_to_the_default(tmp_path):
    code, report, table = run(tmp_path)
    assert code == 0
    assert {c["op"] for c in report["cases"]} == {"causal_conv1d", "causal_conv1d_update"}
    for case in report["cases"]:
        candidates = [r for r in case["rows"] if r["candidate"] != "default"]
        assert len(candidates) >= 2 and all(r["equal"] is True and r["ms"] > 0 for r in candidates), case
        assert f"### {case['op']} {case['case']}" in table
    assert report["ranking"]["causal_conv1d_update"], "no candidate ranked"


def test_a_candidate_with_different_outputs_is_flagged(tmp_path, monkeypatch):
    chooser = conv_module._update_launch
    update = kernel_cases.causal_conv1d_update

    def off_by_one_unless_default(*args, **kwargs):
        out = update(*args, **kwargs)
        return out if conv_module._update_launch is chooser else out + 1

    monkeypatch.setattr(kernel_cases, "causal_conv1d_update", off_by_one_unless_default)
    code, report, table = run(tmp_path)
    assert code == 1
    rows = [r for c in report["cases"] if c["op"] == "causal_conv1d_update" for r in c["rows"]]
    assert [r["equal"] for r in rows if r["candidate"] != "default"] == [False, False]
    assert "**NO**" in table and not report["ranking"]["causal_conv1d_update"]
