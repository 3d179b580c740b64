"""Sampled scenarios (harness/runner.py, _judge_sampled): a candidate's drawn continuation is judged teacher-forced,
every position like a prompt position; engines that cannot sample skip such scenarios; bad temperatures are refused."""

from __future__ import annotations

import pytest
import torch

from harness.adapters.reference import ReferenceEngine
from harness.adapters.transformers import TransformersEngine
from harness.engine import EngineInputError, EngineOptions, Request
from harness.runner import ScenarioSkipped, as_teacher_forced, check_against, check_scenario
from harness.scenarios import build_scenarios

from .conftest import G1_MODEL

SAMPLED = next(s for s in build_scenarios(G1_MODEL) if s.id.startswith("sampled-decode"))


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True])
def test_a_bad_temperature_is_refused_naming_the_request(bad):
    with pytest.raises(EngineInputError, match=r"request 'r1': temperature = .*expected a finite number >= 0"):
        Request("r1", (1, 2), 3, temperature=bad)


def test_greedy_only_engines_refuse_sampling_requests():
    requests = [Request("a", (1, 2), 3, temperature=1.0), Request("b", (1, 2), 3),
                Request("c", (1, 2), 0, temperature=1.0)]          # nothing to generate: nothing to sample
    reasons = TransformersEngine.unsupported(EngineOptions(), dtype=torch.float32, device="cpu", requests=requests)
    assert "temperature > 0 for requests ['a']: transformers decodes greedily only" in reasons
    assert not [r for r in ReferenceEngine.unsupported(EngineOptions(), dtype=torch.float64, device="cpu",
                                                      requests=requests) if "temperature" in r]


def test_teacher_forced_form_of_a_result_keeps_every_position(g1_oracle, g1_prompts):
    requests = SAMPLED.requests(g1_prompts)[:2]
    with ReferenceEngine(g1_oracle.checkpoint) as engine:
        ran = engine.run(requests)
        for req, res in zip(requests, ran):
            forced = as_teacher_forced(res)
            assert forced.output_ids == [] and forced.output_logprobs.numel() == 0
            assert torch.equal(forced.prompt_logprobs, res.sequence_logprobs())
            assert forced.prompt_top_ids.shape == (len(req.prompt) - 1 + req.max_new_tokens, req.top_k)
            again = engine.run([req.teacher_forced(res.output_ids)])[0]
            assert torch.allclose(again.prompt_logprobs, forced.prompt_logprobs, atol=1e-12, rtol=0)


class TopLogprobReported(ReferenceEngine):
    """A classic sampling bug: the logprob returned for each generated token is the top token's, not the drawn
    one's (right wherever the draw is the top token, so greedy decoding never shows it)."""

    name = "top-logprob-reported"

    def _run(self, requests):
        results = super()._run(requests)
        for res in results:
            res.output_logprobs = res.output_top_logprobs[:, 0].clone()
        return results


def test_the_sampled_judge_passes_the_oracle_and_fails_a_wrong_drawn_logprob(g1_oracle, g1_prompts):
    clean = check_scenario(ReferenceEngine, SAMPLED, oracle=g1_oracle, source=g1_prompts, dtype=torch.float64)
    assert clean.passed, clean.message()
    drawn = [c for c in clean.comparisons]
    assert sum(len(c.positions) for c in drawn) == sum(len(r.prompt) - 1 + r.max_new_tokens
                                                     for r in SAMPLED.requests(g1_prompts))
    assert set(clean.meta["sampled"]) == {r.request_id for r in SAMPLED.requests(g1_prompts)}
    bad = check_scenario(TopLogprobReported, SAMPLED, oracle=g1_oracle, source=g1_prompts, dtype=torch.float64)
    assert not bad.passed
    decode_starts = {r.request_id: len(r.prompt) for r in SAMPLED.requests(g1_prompts)}
    assert bad.failures and all(f.position >= decode_starts[f.request_id] for f in bad.failures)


def test_a_check_against_another_engine_skips_a_sampled_scenario(g1_oracle, g1_prompts):
    with pytest.raises(ScenarioSkipped, match="sampled requests"):
        check_against(ReferenceEngine, SAMPLED, against=ReferenceEngine, oracle=g1_oracle, source=g1_prompts,
                      dtype=torch.float64)
