"""mutants/scale.py's bookkeeping: which mutants it judges, how a mutant's runs become killed / survived / not live
beside the clean runs, and the table. (Its GPU runs are measured in docs/scale.md.)"""

from __future__ import annotations

import pytest

from mutants.mutant import load_all
from mutants.scale import classify_mutant, summarise, table

MUTANTS = {m.name: m for m in load_all()}


def _row(scenario, dtype, verdict, digest, *, seed=0, max_delta=0.1, excess=None, checks=()):
    return dict(scenario=scenario, dtype=dtype, seed=seed, verdict=verdict, digest=digest, max_delta=max_delta,
                budget=1.0, excess=excess or {"all": 0.95}, checks=list(checks),
                first_failure="x: positions all: ..." if verdict == "FAIL" else "")


def test_only_engine_mutants_are_judged():
    assert classify_mutant(MUTANTS["ssd-D-dropped"]) is None
    assert "not an engine mutant" in classify_mutant(MUTANTS["judge-budget-without-atol"])
    assert "not an engine mutant" in classify_mutant(MUTANTS["oracle-kv-heads-tiled"])


def test_a_mutant_is_killed_survives_or_is_not_live():
    clean = [_row("s", "bfloat16", "PASS", "aaa"), _row("s", "bfloat16", "PASS", "bbb", seed=1, excess={"all": 1.1})]
    killed = summarise("m1", [_row("s", "bfloat16", "FAIL", "ccc", excess={"all": 2.5}, checks=["excess"])], clean,
                       ["bfloat16"])
    assert killed["live"] and killed["bfloat16"]["outcome"] == "killed"
    assert killed["bfloat16"]["by"] == ["s:excess"] and killed["bfloat16"]["max_excess_ratio"] == 2.5
    assert killed["bfloat16"]["clean_max_excess_ratio"] == 1.1
    survived = summarise("m2", [_row("s", "bfloat16", "PASS", "ddd")], clean, ["bfloat16"])
    assert survived["bfloat16"]["outcome"] == "survived"
    same = summarise("m3", [_row("s", "bfloat16", "PASS", "aaa")], clean, ["bfloat16"])   # seed 0's digest
    assert not same["live"] and same["bfloat16"]["outcome"] == "not live"
    error = summarise("m4", [dict(scenario="s", dtype="bfloat16", seed=0, verdict="ERROR", checks=["error"])],
                      clean, ["bfloat16"])
    assert error["bfloat16"]["outcome"] == "killed"
    text = table(clean, [killed, survived, same], {"judge-x": "not an engine mutant"}, ["bfloat16"])
    assert "bfloat16: 1 of 2 live engine mutants killed (50%)" in text
    assert "| s | bfloat16 | 2 | 0 |" in text and "- judge-x: not an engine mutant" in text


@pytest.mark.parametrize("name", ["tp-rank-given-wrong-group"])
def test_tensor_parallel_mutants_need_two_gpus(name):
    import torch

    reason = classify_mutant(MUTANTS[name])
    if torch.cuda.device_count() < 2:
        assert reason and "needs 2 GPUs" in reason
    else:
        assert reason is None
