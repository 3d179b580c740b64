"""`compare --against ENGINE`: the candidate judged directly against another engine, within the oracle's budget of
the candidate's dtype plus that of the baseline's (harness/runner.py, check_against)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli import main
from harness.runner import ScenarioSkipped, check_against
from harness.scenarios import build_scenarios
from tests.harness.conftest import G1_MODEL

SCENARIOS = {s.id: s for s in build_scenarios(G1_MODEL)}


def test_the_budget_is_the_sum_of_both_dtypes_budgets(g1_oracle, g1_prompts):
    scenario = SCENARIOS["batching-together"]
    report = check_against("reference", scenario, against="reference", against_dtype=torch.bfloat16,
                           oracle=g1_oracle, source=g1_prompts, dtype=torch.float32)
    requests = scenario.requests(g1_prompts, top_k=5, full_distributions=True)
    own, theirs = (g1_oracle.budget(requests, d).value for d in (torch.float32, torch.bfloat16))
    assert report.meta["budget"] == pytest.approx(own + theirs, rel=1e-12)
    assert report.meta["baseline"] == "reference bfloat16" and report.passed, report.message()


def test_the_baseline_is_the_other_engine_not_the_oracle(g1_oracle, g1_prompts):
    # the same engine in the same dtype: bit-identical results, where the fp64 oracle would differ by ~1e-6
    report = check_against("reference", SCENARIOS["batching-alone"], against="reference",
                           against_dtype=torch.float32, oracle=g1_oracle, source=g1_prompts, dtype=torch.float32)
    assert report.passed and report.max_delta == 0.0
    failing = check_against("reference", SCENARIOS["batching-alone"], against="reference",
                            against_dtype=torch.float32, oracle=g1_oracle, source=g1_prompts,
                            dtype=torch.bfloat16, k=0.0)
    assert not failing.passed and "reference float32 logprob" in failing.failures[0].message()


def test_a_baseline_that_cannot_run_the_scenario_skips_it_saying_so(g1_oracle, g1_prompts):
    with pytest.raises(ScenarioSkipped, match=r"baseline reference: gated_norm: expected 'grouped' or 'full'"):
        check_against("reference", SCENARIOS["batching-alone"], against="reference", against_args={"gated_norm": "x"},
                      against_dtype=torch.bfloat16, oracle=g1_oracle, source=g1_prompts, dtype=torch.float32)


def test_compare_against_reports_the_baseline(g1_checkpoint, tmp_path, capsys):
    code = main(["compare", "--engine", "reference", "--dtype", "float32", "--against", "reference",
                 "--checkpoint", str(g1_checkpoint), "--scenarios", "batching-alone", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "baseline: reference float64 (budget: the oracle's for float32 + for float64)" in printed
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["baseline"] == {"kind": "engine", "engine": "reference", "dtype": "float64", "engine_args": {}}
    assert doc["scenarios"][0]["baseline"] == "reference float64" and doc["verdict"] == "pass"


@pytest.mark.parametrize("args, message", [
    (["--against", "nope"], "unknown engine 'nope'"),
    (["--against", "reference", "--against-dtype", "float8"], "dtype: expected one of"),
    (["--against-dtype", "float32"], "--against-dtype float32: expected --against ENGINE with it"),
])
def test_against_usage_errors(args, message, g1_checkpoint, tmp_path, capsys):
    assert main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint), *args,
                 "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
