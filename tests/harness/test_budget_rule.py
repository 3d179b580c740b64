"""The quantile budget rule (harness/compare.py, `--budget-rule quantile`): each position's budget is k times the
reference's own error there, floored at a quantile of those errors over the workload, plus atol.

Checked against the oracle's own numbers on a random G = 1 checkpoint in bf16: the floor and the rows are the errors
the max rule takes its maximum of; the reference passes its own budget at k = 1 (the max rule's guarantee, position
by position); a planted error fails exactly where it exceeds its position's budget, including at a typical position
where the max rule lets it through (the power the rule exists for), and passes at a chaotic position up to k times
the reference's own error there. The CLI checks its options before any work.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from harness.adapters.reference import ReferenceEngine
from harness.cli import main as cli_main
from harness.compare import DEFAULT_K, Budget, compare_runs
from harness.runner import Oracle, calibration_requests, check_scenario
from harness.scenarios import build_scenarios

from .conftest import G1_MODEL

EDGE = 1e-6
QUANTILE = 0.8      # this workload holds about a hundred positions: the default 0.99 would take the largest of them
SCENARIO = next(s for s in build_scenarios(G1_MODEL) if s.kind == "chunked_prefill" and not s.slow)


def test_a_positions_budget():
    budget = Budget(2.0, 1e-5, reference_error=4.0, floor=0.5, positions={"a": [0.1, 3.0, float("nan")]})
    assert budget.rule == "quantile" and budget.value == 2.0 * 4.0 + 1e-5
    assert budget.at("a", 1) == 2.0 * 0.5 + 1e-5                  # below the floor: the floor
    assert budget.at("a", 2) == 2.0 * 3.0 + 1e-5                  # above it: its own error
    for rid, position in (("a", 3), ("a", 4), ("a", 0), ("b", 1)):  # NaN, past the row, before it, another request
        assert budget.at(rid, position) == budget.value            # the max rule's budget
    plain = Budget(2.0, 1e-5, 4.0)
    assert plain.rule == "max" and plain.at("a", 1) == plain.value


@pytest.fixture(scope="module")
def quantile_oracle(g1_checkpoint):
    oracle = Oracle(g1_checkpoint, budget_rule="quantile", budget_quantile=QUANTILE)
    yield oracle
    oracle.close()


@pytest.fixture(scope="module")
def forced(quantile_oracle, g1_prompts):
    """The scenario's requests teacher-forced on the oracle's continuations (their rows are the budget's rows), with
    the bf16 budget of each rule on them."""
    requests = SCENARIO.requests(g1_prompts)
    requests = [r.teacher_forced(b.output_ids) for r, b in zip(requests, quantile_oracle.results(requests))]
    calibration = calibration_requests(quantile_oracle, g1_prompts)
    quantile = quantile_oracle.budget(requests, torch.bfloat16, calibration=calibration)
    maxed = Oracle(quantile_oracle.checkpoint)
    maxed._results, maxed._errors = quantile_oracle._results, quantile_oracle._errors      # the same memo
    return requests, quantile, maxed.budget(requests, torch.bfloat16, calibration=calibration)


def test_the_floor_is_the_quantile_of_the_errors_the_max_is_taken_over(forced, quantile_oracle):
    requests, quantile, maxed = forced
    assert quantile.rule == "quantile" and maxed.rule == "max"
    assert (quantile.k, quantile.atol, quantile.reference_error) == (maxed.k, maxed.atol, maxed.reference_error)
    rows = quantile_oracle.position_errors(requests, torch.bfloat16)
    assert {rid: quantile.positions[rid] for rid in rows} == rows             # the rows the max rule reads
    errors = sorted(e for row in quantile.positions.values() for e in row)
    assert max(errors) == quantile.reference_error
    assert quantile.floor == errors[math.ceil(QUANTILE * len(errors)) - 1]
    assert 0 < quantile.floor < quantile.reference_error


def test_the_reference_passes_its_own_budget_at_k_1(forced, quantile_oracle):
    requests, quantile, _ = forced
    with ReferenceEngine(quantile_oracle.checkpoint, dtype=torch.bfloat16) as twin:
        results = twin.run(requests)
    at_one = Budget(1.0, quantile.atol, quantile.reference_error, floor=quantile.floor, positions=quantile.positions)
    report = compare_runs(scenario=SCENARIO.id, requests=requests, baseline=quantile_oracle.results(requests),
                          candidate=results, budget=at_one)
    assert report.passed, report.message()
    over = [p for c in report.comparisons for p, d in zip(c.positions, c.deltas) if d > quantile.floor]
    assert over, "no position of the workload errs beyond the floor: the outlier case went unchecked"


def _planted(quantile_oracle, requests, deltas):
    results = copy.deepcopy(quantile_oracle.results(requests))
    for res in results:
        for (rid, position), delta in deltas.items():
            if rid == res.request_id:
                res.prompt_logprobs[position - 1] += delta
    return results


@pytest.mark.parametrize("side", ["inside", "outside"])
def test_planted_errors_fail_exactly_where_they_exceed_their_positions_budget(side, forced, quantile_oracle):
    requests, quantile, maxed = forced
    ids = {r.request_id for r in requests}
    cells = [(rid, i + 1, e) for rid, row in quantile.positions.items() if rid in ids for i, e in enumerate(row)]
    typical = min(cells, key=lambda c: c[2])                       # the smallest error: the floor is its budget
    chaotic = max(cells, key=lambda c: c[2])                       # the largest: its own error is its budget
    assert typical[2] < quantile.floor < chaotic[2]
    scale = 1 - EDGE if side == "inside" else 1 + EDGE
    deltas = {(typical[0], typical[1]): scale * (DEFAULT_K * quantile.floor + quantile.atol),
              (chaotic[0], chaotic[1]): -scale * (DEFAULT_K * chaotic[2] + quantile.atol)}
    results = _planted(quantile_oracle, requests, deltas)
    report = compare_runs(scenario=SCENARIO.id, requests=requests, baseline=quantile_oracle.results(requests),
                          candidate=results, budget=quantile)
    failed = {(f.request_id, f.position) for f in report.failures}
    assert failed == (set() if side == "inside" else set(deltas)), report.message()
    assert report.meta["budget_rule"] == "quantile"
    assert report.meta["budget_floor"] == DEFAULT_K * quantile.floor + quantile.atol
    # the max rule lets the typical position's planted error through, inside or out: the quantile rule's power
    loose = compare_runs(scenario=SCENARIO.id, requests=requests, baseline=quantile_oracle.results(requests),
                         candidate=results, budget=maxed)
    assert (typical[0], typical[1]) not in {(f.request_id, f.position) for f in loose.failures}


@pytest.mark.parametrize("args, message", [
    (["--budget-quantile", "0.9"], "--budget-quantile 0.9: expected --budget-rule quantile"),
    (["--budget-rule", "quantile", "--budget-quantile", "1"], "--budget-quantile 1: expected a number in [0.5, 1)"),
    (["--budget-rule", "quantile", "--budget-quantile", "0.2"], "expected a number in [0.5, 1)"),
    (["--budget-rule", "quantile", "--against", "reference"], "--budget-rule quantile: not with --against"),
    (["--budget-rule", "max,median"], "--budget-rule max,median: expected max or quantile, or both"),
    (["--budget-rule", "max,max"], "--budget-rule max,max: expected max or quantile, or both"),
    (["--budget-rule", "max", "--budget-quantile", "0.9"], "expected --budget-rule quantile with it"),
])
def test_the_cli_refuses_a_quantile_it_cannot_use(args, message, g1_checkpoint, tmp_path, capsys):
    code = cli_main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint), "--scenarios",
                     "batching-alone", "--out", str(tmp_path / "out"), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_report_says_which_rule_judged(g1_checkpoint, tmp_path, capsys):
    code = cli_main(["compare", "--engine", "reference", "--dtype", "bfloat16", "--checkpoint", str(g1_checkpoint),
                     "--scenarios", "batching-alone", "--budget-rule", "quantile", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    entry = json.loads((tmp_path / "report.json").read_text())["scenarios"][0]
    assert entry["budget_rule"] == "quantile" and 0 < entry["budget_floor"] <= entry["budget"]
    assert f"{entry['budget_floor']:.3g}..{entry['budget']:.3g}" in capsys.readouterr().out


class _Planted(ReferenceEngine):
    """The fp64 reference whatever dtype it is asked for, with PLANT[request id, position] added to those logprobs."""

    name = "planted"
    PLANT: dict[tuple[str, int], float] = {}

    def __init__(self, checkpoint, *, dtype, **kwargs):
        super().__init__(checkpoint, dtype=torch.float64, **kwargs)

    def run(self, requests):
        results = super().run(requests)
        for res in results:
            for (rid, position), delta in self.PLANT.items():
                if rid == res.request_id:
                    res.prompt_logprobs[position - 1] += delta
        return results


@pytest.mark.parametrize("primary", ["max", "quantile"])
def test_one_run_judged_by_both_rules(primary, g1_checkpoint, g1_prompts, monkeypatch):
    """also_rules: the same candidate results judged by the other rule too (mutants.scale measures both rules in one
    run so). An error planted at a prompt position between its quantile budget and the max budget passes by the max
    rule and fails by the quantile rule, whichever is the report's own; the report's verdict is its rule's."""
    other = {"max": "quantile", "quantile": "max"}[primary]
    oracle = Oracle(g1_checkpoint, budget_rule=primary, budget_quantile=QUANTILE, also_rules=(other, primary))
    assert oracle.also_rules == (other,)
    scenario = next(s for s in build_scenarios(G1_MODEL) if s.id == "batching-alone")
    try:
        requests = scenario.requests(g1_prompts)
        forced = [r.teacher_forced(b.output_ids) for r, b in zip(requests, oracle.results(requests))]
        quantile = oracle.budget(forced, torch.bfloat16, calibration=calibration_requests(oracle, g1_prompts),
                                 rule="quantile")
        request = next(r for r in requests if len(r.prompt) > 3)
        rid, row = request.request_id, quantile.positions[request.request_id]
        position = min(range(1, len(request.prompt)), key=lambda p: row[p - 1])     # a prompt position at the floor
        low, high = quantile.at(rid, position), quantile.value
        assert low < high / 1.5
        monkeypatch.setattr(_Planted, "PLANT", {(rid, position): (low * high) ** 0.5})
        report = check_scenario(_Planted, scenario, oracle=oracle, source=g1_prompts, dtype=torch.bfloat16)
    finally:
        oracle.close()
    rules = report.meta["rules"]
    assert set(rules) == {"max", "quantile"}
    assert rules["max"]["passed"] and rules["max"]["checks"] == [] and rules["max"]["budget"] == high
    assert not rules["quantile"]["passed"] and rules["quantile"]["checks"] == ["logprob"]
    assert f"position {position}" in rules["quantile"]["first_failure"]
    assert 1 < rules["quantile"]["max_delta_over_position_budget"] < high / low
    assert report.passed == rules[primary]["passed"] and report.meta["budget_rule"] == primary
    with pytest.raises(ValueError, match="also_rules"):
        Oracle(g1_checkpoint, also_rules=("median",))


def test_the_report_holds_both_rules_verdicts_when_asked(g1_checkpoint, tmp_path, capsys):
    code = cli_main(["compare", "--engine", "reference", "--dtype", "bfloat16", "--checkpoint", str(g1_checkpoint),
                     "--scenarios", "batching-alone", "--budget-rule", "max,quantile", "--budget-quantile",
                     str(QUANTILE), "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    entry = json.loads((tmp_path / "report.json").read_text())["scenarios"][0]
    assert entry["budget_rule"] == "max" and set(entry["rules"]) == {"max", "quantile"}
    assert entry["rules"]["max"]["budget"] == entry["budget"] and entry["rules"]["max"]["passed"]
    assert 0 < entry["rules"]["quantile"]["budget_floor"] < entry["budget"]
