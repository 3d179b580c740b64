"""The judge checks itself (harness/runner.py, harness/compare.py).

1. The budget is pinned exactly: E, the oracle's own worst error in the candidate's dtype over the same workload, is
   recomputed here from BambaReference directly (one forward per whole sequence, teacher-forced on the oracle's
   continuation, no engine, no runner), and the budget must be k·E + atol with k = 2 and the dtype's atol.
2. Planted perturbations of known size: a candidate that returns the exact fp64 results but with δ added at chosen
   positions (a prompt position, the first position after a piece boundary, a decode step) must fail at exactly the
   positions where δ exceeds the budget, and nowhere else, in every scenario kind.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.adapters.reference import ReferenceEngine
from harness.compare import ATOL, DEFAULT_K
from harness.engine import EngineOptions, Request, RequestResult, log_softmax
from harness.runner import calibration_requests, check_scenario
from harness.scenarios import KINDS, build_scenarios
from harness.schedule import plan_options, plan_steps
from reference.model import BambaReference

from .conftest import G1_MODEL

# The last scenario of each kind that runs on a CPU (the cudagraph kind by its eager baseline): for chunked prefill the
# capped one (two continuing prefills a step), for tp the one with chunked prefill.
SCENARIOS = {s.kind: s for s in build_scenarios(G1_MODEL) if not s.needs_cuda and not s.slow}
EDGE = 1e-6               # δ = budget · (1 ∓ EDGE): the fp64 candidate's own error (< 1e-13) is far below EDGE·budget


def independent_error(checkpoint, requests: list[Request], oracle: list[RequestResult], dtype) -> float:
    """max |logprob_dtype - logprob_fp64| over every position of every request, both from BambaReference directly."""
    sides = {d: BambaReference.from_pretrained(checkpoint, dtype=d) for d in (torch.float64, dtype)}
    worst = 0.0
    for req, res in zip(requests, oracle):
        ids = torch.tensor(list(req.prompt) + list(res.output_ids))
        if len(ids) < 2:
            continue
        lp = {}
        for d, model in sides.items():
            rows = log_softmax(model.forward(ids)[0]).double()                      # (T+n, V)
            lp[d] = rows[:-1].gather(1, ids[1:, None])[:, 0]                        # (T+n-1,)
        worst = max(worst, float((lp[dtype] - lp[torch.float64]).abs().max()))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_budget_is_k_times_the_oracles_own_worst_error_plus_atol(dtype, g1_oracle, g1_prompts):
    requests = SCENARIOS["chunked_prefill"].requests(g1_prompts)
    budget = g1_oracle.budget(requests, dtype)
    expected = independent_error(g1_oracle.checkpoint, requests, g1_oracle.results(requests), dtype)
    assert expected > 0
    assert budget.reference_error == pytest.approx(expected, rel=0.05), (
        f"the judge's E = {budget.reference_error:.4g}, recomputed independently {expected:.4g}")
    assert (budget.k, budget.atol) == (DEFAULT_K, ATOL[dtype])
    assert budget.value == DEFAULT_K * budget.reference_error + ATOL[dtype]


class Perturbed(ReferenceEngine):
    """The fp64 oracle dressed as a candidate in the dtype it is built with (whose budget it is judged by), with
    `deltas[(request_id, position)]` added to the logprob it returns at that position. It honours the scenario's
    scheduling knobs (the plan) and accepts tensor/pipeline parallel options without splitting anything: the judge
    sees only results, and every kind must be judged the same way."""

    name = "perturbed"
    deltas: dict[tuple[str, int], float] = {}

    @classmethod
    def _unsupported(cls, options, *, dtype, device):
        return super()._unsupported(replace(options, tensor_parallel_size=1, pipeline_parallel_size=1,
                                            ssm_state_dtype=None), dtype=torch.float64, device=device)

    def _load(self) -> None:
        self.model = BambaReference.from_pretrained(self.checkpoint, dtype=torch.float64, device=self.device,
                                                    allow_long_context=self.options.allow_long_context)
        self.ssm_state_dtype = None

    def _run(self, requests):
        results = super()._run(requests)
        for res in results:
            n_prompt = len(res.prompt_logprobs)
            for (rid, position), delta in self.deltas.items():
                if rid == res.request_id:
                    row = position - 1                                    # row i holds position i + 1
                    target = res.prompt_logprobs if row < n_prompt else res.output_logprobs
                    target[row if row < n_prompt else row - n_prompt] += delta
        return results


def _targets(scenario, requests) -> dict[str, tuple[str, int]]:
    """Per position class, a (request id, position): a prompt position, the first position computed after a piece
    boundary (where the plan continues a prompt), a decode step (the second output, fed back by a decode)."""
    by_index = {int(r.request_id.split("-")[0][1:]): r for r in requests}
    longest = max(requests, key=lambda r: len(r.prompt))
    out = {"prompt": (longest.request_id, len(longest.prompt) // 2)}
    for step in plan_steps(scenario.shapes, **plan_options(scenario.options)):
        for p in step.pieces:
            req = by_index[p.request]
            if not p.decode and 0 < p.start < len(req.prompt) - 1 and "piece boundary" not in out:
                out["piece boundary"] = (req.request_id, p.start + 1)
    decoding = next(r for r in requests if r.max_new_tokens >= 2)
    out["decode"] = (decoding.request_id, len(decoding.prompt) + 1)
    return out


def test_every_scenario_kind_is_checked():
    assert set(SCENARIOS) == set(KINDS), f"kinds without a CPU scenario here: {set(KINDS) - set(SCENARIOS)}"


@pytest.mark.parametrize("side", ["inside", "outside"])
@pytest.mark.parametrize("kind", list(SCENARIOS))
def test_planted_deltas_fail_exactly_where_they_exceed_the_budget(kind, side, g1_oracle, g1_prompts, monkeypatch):
    scenario = SCENARIOS[kind]
    requests = scenario.requests(g1_prompts)
    judged = requests
    if kind == "sampled":          # judged teacher-forced on the candidate's own draws (runner._judge_sampled)
        with ReferenceEngine(g1_oracle.checkpoint, dtype=torch.float64, options=scenario.options) as drawer:
            judged = [r.teacher_forced(out.output_ids) for r, out in zip(requests, drawer.run(requests))]
    budget = g1_oracle.budget(judged, torch.float32, ssm_state_dtype=scenario.options.ssm_state_dtype,
                              calibration=calibration_requests(g1_oracle, g1_prompts)).value
    targets = _targets(scenario, requests)
    if kind in ("chunked_prefill", "tp"):
        assert "piece boundary" in targets, f"{scenario.id}: no piece boundary to perturb"
    delta = budget * (1 - EDGE) if side == "inside" else budget * (1 + EDGE)
    monkeypatch.setattr(Perturbed, "deltas", {position: sign * delta for position, sign in
                                              zip(targets.values(), (1, -1, 1))})
    # invariance: the oracle judgement of its baseline configuration, with the reference's batch-invariant mode on so
    # that the configurations agree bit for bit (the deltas are planted by request and position); one configuration
    # beside the baseline keeps that part live (tests/harness/test_invariance.py runs them all)
    engine_args = None
    if kind == "invariance":
        engine_args, scenario = {"batch_invariant": "1"}, replace(scenario, configurations=scenario.configurations[:2])
    report = check_scenario(Perturbed, scenario, oracle=g1_oracle, source=g1_prompts, dtype=torch.float32,
                            engine_args=engine_args)
    failed = {(f.request_id, f.position) for f in report.failures}
    expected = set() if side == "inside" else set(targets.values())
    assert failed == expected, (f"{scenario.id}: budget {budget:.4g}, |δ| {delta:.6g}; expected failures at "
                                f"{sorted(expected)}, got {sorted(failed)}\n{report.message()}")
