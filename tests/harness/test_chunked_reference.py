"""The oracle run chunked equals the oracle run whole (a relative check, on the chunked_prefill scenarios and on
random schedules), and planted state faults at piece boundaries make every chunked_prefill scenario fail with a
message naming the position."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.adapters.reference import ReferenceEngine
from harness.engine import EngineOptions
from harness.runner import check_relative, check_scenario
from harness.scenarios import Scenario, build_scenarios
from harness.schedule import RequestShape, plan_options, plan_steps
from reference.model import SequenceState

from .conftest import G1_MODEL

SCENARIOS = {s.id: s for s in build_scenarios(G1_MODEL)}
CHUNKED = [s for s in SCENARIOS.values() if s.kind == "chunked_prefill"]
# The budgets that split some prompt into pieces (budget 1000 splits none: a boundary fault cannot show there).
SPLITTING = [s for s in CHUNKED
             if any(not p.decode and p.start > 0
                    for step in plan_steps(s.shapes, **plan_options(s.options)) for p in step.pieces)]


@pytest.mark.parametrize("scenario", CHUNKED, ids=lambda s: s.id)
def test_reference_chunked_equals_reference_whole(scenario, g1_oracle, g1_prompts):
    report = check_relative("reference", scenario, baseline_options=EngineOptions(), oracle=g1_oracle,
                            source=g1_prompts, dtype=torch.float64)
    assert report.passed, report.message()
    assert report.meta["budget"] == 1e-10


def _continues_a_prompt(piece) -> bool:
    return not piece.decode and piece.start > 0


class LosesMambaStateAtPieceBoundaries(ReferenceEngine):
    """Planted fault: a prefill piece that continues a prompt starts its mamba layers from zero state (conv window
    and SSM state dropped; attention keys kept), the bug class "initial state dropped when a sequence starts inside
    a chunk"."""

    def forward_step(self, pieces, tokens, states):
        fresh = self.model.initial_state()
        states = [SequenceState(fresh.conv, fresh.ssm, s.keys, s.values, s.length) if _continues_a_prompt(p) else s
                  for p, s in zip(pieces, states)]
        return super().forward_step(pieces, tokens, states)


class DampsSsmStateAtPieceBoundaries(ReferenceEngine):
    """Planted fault: the SSM state handed over at a piece boundary is scaled by 0.999 (a decay applied once too
    often, as when the cumulative decay is taken from the wrong start)."""

    def forward_step(self, pieces, tokens, states):
        states = [SequenceState(s.conv, {i: 0.999 * v for i, v in s.ssm.items()}, s.keys, s.values, s.length)
                  if _continues_a_prompt(p) else s for p, s in zip(pieces, states)]
        return super().forward_step(pieces, tokens, states)


def _first_split(scenario) -> dict[str, int]:
    """request id -> the first position at which a later prefill piece of it starts, under the scenario's plan."""
    plan = plan_steps(scenario.shapes, **plan_options(scenario.options))
    firsts: dict[str, int] = {}
    for step in plan:
        for piece in step.pieces:
            if _continues_a_prompt(piece):
                rid = f"r{piece.request}-len{scenario.shapes[piece.request].prompt_len}"
                firsts.setdefault(rid, piece.start)
    return firsts


@pytest.mark.parametrize("scenario", SPLITTING, ids=lambda s: s.id)
def test_lost_state_fails_at_the_first_position_after_each_boundary(scenario, g1_oracle, g1_prompts):
    report = check_scenario(LosesMambaStateAtPieceBoundaries, scenario, oracle=g1_oracle, source=g1_prompts,
                            dtype=torch.float32)
    assert not report.passed
    first_failure = {}
    for failure in report.failures:
        first_failure.setdefault(failure.request_id, failure.position)
    # The first token of the piece after the boundary at position p is the first one predicted from a wrong state;
    # its row predicts position p + 1.
    assert first_failure == {rid: p + 1 for rid, p in _first_split(scenario).items()}
    message = report.failures[0].message()
    assert re.match(rf"{scenario.id}: request 'r\d+-len\d+' position \d+ \([^)]+\): token \d+: oracle logprob "
                    r"-?\d+\.\d+, candidate -?\d+\.\d+, \|Δ\| .* > budget", message), message


@pytest.mark.parametrize("scenario", SPLITTING, ids=lambda s: s.id)
def test_damped_state_fails_only_after_boundaries(scenario, g1_oracle, g1_prompts):
    report = check_scenario(DampsSsmStateAtPieceBoundaries, scenario, oracle=g1_oracle, source=g1_prompts,
                            dtype=torch.float32)
    assert not report.passed
    splits = _first_split(scenario)
    assert all(f.position > splits[f.request_id] for f in report.failures)


@pytest.mark.parametrize("fault", [LosesMambaStateAtPieceBoundaries, DampsSsmStateAtPieceBoundaries],
                         ids=["loses-state", "damps-state"])
def test_planted_faults_do_not_touch_unchunked_batching(fault, g1_oracle, g1_prompts):
    report = check_scenario(fault, SCENARIOS["batching-together"], oracle=g1_oracle, source=g1_prompts,
                            dtype=torch.float32)
    assert report.passed, report.message()


@st.composite
def random_schedules(draw) -> Scenario:
    """A few requests of random lengths, outputs and arrival steps under a random token budget and sequence cap."""
    Q = G1_MODEL.mamba_chunk_size
    n = draw(st.integers(1, 4))
    shapes = tuple(RequestShape(draw(st.integers(1, 3 * Q + 2)), draw(st.integers(0, 4)), draw(st.integers(0, 3)))
                   for _ in range(n))
    options = EngineOptions(max_num_batched_tokens=draw(st.none() | st.integers(1, 2 * Q + 1)),
                            max_num_seqs=draw(st.none() | st.integers(1, n)))
    return Scenario("fuzz", "fuzz", options, shapes, "random schedule", shuffle_seed=draw(st.integers(0, 99)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=random_schedules())
def test_reference_under_random_schedules_equals_reference_whole(scenario, g1_oracle, g1_prompts):
    """Replay a failure with the seed hypothesis prints (pytest --hypothesis-seed=N)."""
    report = check_relative("reference", scenario, baseline_options=EngineOptions(), oracle=g1_oracle,
                            source=g1_prompts, dtype=torch.float64)
    assert report.passed, report.message()
