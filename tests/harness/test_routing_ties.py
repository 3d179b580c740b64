"""Routing near-ties (harness/routing.py): an MoE token whose last chosen expert and best one left out are closer
than the candidate's dtype computes them may go to either, and the position's budget allows what that trade moves.

Checked on the trained tiny-granite: moe_ref's trade against a routing computed by hand; the allowance against the
traded runs computed one by one, zero upstream of every tie; the natural threshold against the fp32 twin's router
error; and the judge: a candidate that made one trade at a near-tie fails without the allowance and passes with it,
while the same error at a position with no tie upstream still fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness.compare import Budget, compare_runs
from harness.engine import Request
from harness.routing import RoutingTieError, routing_ties
from harness.runner import Oracle
from reference.ops import moe_ref, swiglu_ref

GRANITE = "fixtures/tiny-granite"
FORCED_GAP = 0.02        # a threshold far above fp32's router error: a few dozen ties to check the arithmetic on


def test_the_trade_routes_to_the_best_expert_left_out():
    gen = torch.Generator().manual_seed(0)
    T, D, E, I, top_k = 6, 8, 5, 4, 2
    x = torch.randn(T, D, generator=gen, dtype=torch.float64)
    router = torch.randn(E, D, generator=gen, dtype=torch.float64)
    w_in = torch.randn(E, 2 * I, D, generator=gen, dtype=torch.float64)
    w_out = torch.randn(E, D, I, generator=gen, dtype=torch.float64)
    swap = torch.tensor([True, False, True, False, False, True])
    got = moe_ref(x, router, w_in, w_out, top_k=top_k, swap=swap)
    plain = moe_ref(x, router, w_in, w_out, top_k=top_k)
    logits = F.linear(x, router)
    for t in range(T):
        ranked = logits[t].argsort(descending=True).tolist()
        chosen = ranked[:top_k - 1] + [ranked[top_k] if swap[t] else ranked[top_k - 1]]
        weights = torch.softmax(logits[t, chosen], dim=0)
        expected = sum(w * swiglu_ref(x[t:t + 1], *w_in[e].chunk(2), w_out[e])[0] for w, e in zip(weights, chosen))
        torch.testing.assert_close(got[t], expected, rtol=1e-12, atol=1e-12)
        if not swap[t]:            # the same experts (rows batched per expert otherwise: rounding may differ)
            torch.testing.assert_close(got[t], plain[t], rtol=1e-12, atol=1e-12)
        else:
            assert not torch.allclose(got[t], plain[t])


@pytest.fixture(scope="module")
def models():
    oracle = Oracle(GRANITE)
    yield oracle, oracle.engine(torch.float64).model, oracle.engine(torch.float32).model
    oracle.close()


@pytest.fixture(scope="module")
def sequences(models):
    oracle = models[0]
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, oracle.cfg.vocab_size, (n,), generator=gen).tolist() for n in (48, 33)]


def _logprobs(model, ids, swaps=None):
    model.route_swaps = swaps or {}
    try:
        return model.prompt_logprobs(ids)
    finally:
        model.route_swaps = {}


def test_the_allowance_is_the_sum_of_what_each_trade_moves(models, sequences):
    _, m64, m32 = models
    found = routing_ties(m64, m32, sequences, k=2.0, threshold=FORCED_GAP)
    assert found.threshold == FORCED_GAP and len(found.ties) >= 4
    for s, ids in enumerate(sequences):
        base = _logprobs(m64, ids)
        expected = torch.zeros_like(base)
        ties = [(layer, token) for seq, layer, token in found.ties if seq == s]
        for layer, token in ties:
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[token] = True
            moved = (_logprobs(m64, ids, {layer: mask}) - base).abs()
            if token:               # a trade at token t moves rows t.. only (before it: fp64 rounding at most)
                assert moved[:token].max() < 1e-12
                moved[:token] = 0.0
            assert moved[token:].max() > 1e-9
            expected += moved
        torch.testing.assert_close(torch.tensor(found.allowance[s], dtype=torch.float64), expected,
                                   rtol=0, atol=1e-14)
        first = min((token for _, token in ties), default=len(ids))
        assert all(a == 0 for a in found.allowance[s][:first])


def test_the_threshold_is_k_times_the_twins_router_error(models, sequences):
    _, m64, m32 = models
    found = routing_ties(m64, m32, sequences, k=2.0)
    assert 0 < found.router_error < 1e-4 and found.threshold == 2.0 * found.router_error
    assert len(found.allowance) == 2 and [len(a) for a in found.allowance] == [47, 32]
    with pytest.raises(RoutingTieError, match="too many to judge"):
        routing_ties(m64, m32, sequences, k=2.0, threshold=FORCED_GAP, max_ties=3)


def test_the_judge_allows_a_trade_at_a_near_tie_and_nothing_else(models, sequences):
    oracle, m64, m32 = models
    ids = sequences[0]
    found = routing_ties(m64, m32, [ids], k=2.0, threshold=FORCED_GAP)
    layer, token = max(((la, t) for _, la, t in found.ties), key=lambda lt: lt[1])    # the latest tie
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[token] = True
    base_lp, traded = _logprobs(m64, ids), _logprobs(m64, ids, {layer: mask})
    request = Request("r", tuple(ids), 0)
    base = oracle.results([request])[0]
    torch.testing.assert_close(base.prompt_logprobs, base_lp, rtol=0, atol=1e-12)
    moved = (traded - base_lp).abs()
    assert moved.max() > 1e-4                                   # far past fp32 rounding
    candidate = replace(base, prompt_logprobs=traded)
    plain = Budget(2.0, 0.0, reference_error=1e-6)
    allowed = replace(plain, routing={"r": found.allowance[0]})
    judge = lambda cand, budget: compare_runs(scenario="s", requests=[request], baseline=[base],  # noqa: E731
                                              candidate=[cand], budget=budget)
    assert not judge(candidate, plain).passed
    report = judge(candidate, allowed)
    assert report.passed, report.failures[0].message() if report.failures else ""
    assert report.meta["routing_allowance"]["positions"] > 0
    # what the report says of the worst position is against its widened budget (a PASS is at most 1 of it), not
    # against the budget of a position without a tie, which the trade exceeds by far
    assert report.max_delta / report.meta["budget"] > 10
    assert 0 < report.meta["max_delta_over_position_budget"] <= 1
    # The same error before any tie (first tie at `first`): no allowance there, so it fails.
    first = min(t for _, _, t in found.ties)
    assert first >= 2
    shifted = base_lp.clone()
    shifted[first - 2] += float(moved.max())
    report = judge(replace(base, prompt_logprobs=shifted), allowed)
    assert not report.passed and report.failures[0].position == first - 1
    assert report.meta["max_delta_over_position_budget"] > 1


def test_the_oracle_allows_nothing_for_fp64_or_a_model_without_experts(models, sequences):
    oracle = models[0]
    request = Request("r", tuple(sequences[1]), 0)
    assert oracle.routing_allowance([request], torch.float64) is None
    assert oracle.routing_allowance([request], torch.bfloat16) is None      # 16-bit: the twin's error spans trades
    rows = oracle.routing_allowance([request], torch.float32)
    assert list(rows) == ["r"] and len(rows["r"]) == len(sequences[1]) - 1
    assert oracle.routing_notes[-1]["dtype"] == "float32" and oracle.describe()["routing"] == oracle.routing_notes
    bamba = Oracle("fixtures/tiny-bamba")
    assert bamba.routing_allowance([Request("r", (1, 2, 3), 0)], torch.float32) is None


def test_a_mutant_worker_reads_the_allowance_from_the_oracle_cache(models, sequences, tmp_path):
    """mutants.scale's workers judge on the seed-0 oracle's cache without loading a reference model: the fp32
    budget of a Granite workload, its routing allowance included, must come from that cache."""
    from mutants.scale import cache_only_oracle

    oracle = models[0]
    request = Request("c", tuple(sequences[0][:20]), 4)
    expected = oracle.budget([request], torch.float32)
    assert expected.routing is not None and len(expected.routing["c"]) == 23
    oracle.save_cache(tmp_path / "cache.pt")
    cached = cache_only_oracle(Oracle)(GRANITE)
    cached.load_cache(tmp_path / "cache.pt")
    assert cached.budget([request], torch.float32) == expected
    assert not cached._engines
