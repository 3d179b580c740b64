"""The budget's E over a sample large enough to be a level: a workload of fewer than MIN_BUDGET_POSITIONS positions
(preemption's two requests) takes the reference's largest error over the model's batching workload too; larger
workloads keep their own maximum. Checked on the G = 1 tiny checkpoint in fp32 and bf16 on the CPU."""

from __future__ import annotations

import pytest
import torch

from harness.runner import MIN_BUDGET_POSITIONS, calibration_requests, check_scenario
from harness.scenarios import build_scenarios

from .conftest import G1_MODEL

SCENARIOS = {s.id: s for s in build_scenarios(G1_MODEL)}
SMALL = next(s for s in SCENARIOS.values() if s.kind == "preemption")
LARGE = SCENARIOS["batching-together"]
CHUNKED = next(s for s in SCENARIOS.values() if s.kind == "chunked_prefill")


def _positions(requests) -> int:
    return sum(len(r.prompt) - 1 + r.max_new_tokens for r in requests)


def _largest_error(oracle, requests, dtype) -> float:
    return max(max(rows) for rows in oracle.position_errors(requests, dtype).values() if rows)


def test_the_preemption_workload_is_below_the_minimum_and_the_others_are_not(g1_prompts):
    assert _positions(SMALL.requests(g1_prompts)) < MIN_BUDGET_POSITIONS
    for scenario in (LARGE, CHUNKED):
        assert _positions(scenario.requests(g1_prompts)) >= MIN_BUDGET_POSITIONS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_workload_takes_e_over_the_calibration_sample_too(g1_oracle, g1_prompts, dtype):
    requests = SMALL.requests(g1_prompts)
    calibration = calibration_requests(g1_oracle, g1_prompts)
    own = _largest_error(g1_oracle, requests, dtype)
    extra = _largest_error(g1_oracle, calibration, dtype)
    assert 0 < own < extra, "on this checkpoint the batching workload's error is the larger (else this checks nothing)"
    budget = g1_oracle.budget(requests, dtype, calibration=calibration)
    assert budget.reference_error == max(own, extra)
    assert g1_oracle.budget(requests, dtype).reference_error == own       # no calibration given: its own sample
    # the calibration sample is the batching workload under ids of its own: the oracle's memo (by content) serves
    # both, and no id clashes with the workload's (a reference run rejects duplicate ids)
    assert [("calibration-" + r.request_id, r.prompt) for r in SCENARIOS["batching-alone"].requests(g1_prompts)] == \
        [(r.request_id, r.prompt) for r in calibration]
    assert not {r.request_id for r in requests} & {r.request_id for r in calibration}


def test_a_large_workload_keeps_its_own_maximum(g1_oracle, g1_prompts):
    requests = CHUNKED.requests(g1_prompts)
    calibration = calibration_requests(g1_oracle, g1_prompts)
    own = _largest_error(g1_oracle, requests, torch.float32)
    assert g1_oracle.budget(requests, torch.float32, calibration=calibration).reference_error == own


def test_the_judge_uses_the_calibration_sample(g1_oracle, g1_prompts):
    report = check_scenario("reference", SMALL, oracle=g1_oracle, source=g1_prompts, dtype=torch.float32)
    calibration = calibration_requests(g1_oracle, g1_prompts)
    expected = max(_largest_error(g1_oracle, SMALL.requests(g1_prompts), torch.float32),
                   _largest_error(g1_oracle, calibration, torch.float32))
    assert report.meta["reference_error"] == expected
