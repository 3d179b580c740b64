"""Seeded sampling (vendored/engine/sampling.py): draws follow softmax(logits / T), a draw is a function of (seed,
position, logits) only, and the engine returns the model's own logprob of each drawn token."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vendored.engine import EngineError, LLMEngine, SamplingParams
from vendored.engine.sampling import gumbel_noise, sample

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * t + 2) % 500 for t in range(n)]


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_draws_follow_the_tempered_softmax(temperature):
    # 4000 draws (one seed each) from one row of 6 logits: every token's frequency within 5 standard errors of
    # softmax(logits / T), and the chi-square statistic (5 degrees of freedom) far below what a wrong law gives.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 4000
    tokens = sample(logits.expand(n, -1), torch.full((n,), temperature), torch.arange(n), torch.full((n,), 17))
    counts = torch.bincount(tokens, minlength=6).double()
    p = torch.softmax(logits.double() / temperature, dim=0)
    se = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * se + 1).all(), (counts.tolist(), (n * p).tolist())
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 25.0                                                 # p ≈ 1e-4 under the right law


def test_noise_is_a_function_of_seed_position_and_token_only():
    seeds, positions = torch.tensor([3, 3, 4, -1]), torch.tensor([10, 11, 10, 10])
    g = gumbel_noise(seeds, positions, 50)
    assert torch.equal(g, gumbel_noise(seeds, positions, 50))
    assert torch.equal(g[:, :20], gumbel_noise(seeds, positions, 20))            # whatever the width
    assert torch.equal(g[2:3], gumbel_noise(seeds[2:3], positions[2:3], 50))     # whatever the other rows
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2]) and torch.isfinite(g).all()
    assert torch.equal(gumbel_noise(torch.tensor([-1]), torch.tensor([10]), 50),
                       gumbel_noise(torch.tensor([2**32 - 1]), torch.tensor([10]), 50))   # the seed's low 32 bits


def test_nan_logits_are_never_drawn():
    logits = torch.tensor([[float("nan"), 0.0, float("nan"), -1.0]] * 64)
    tokens = sample(logits, torch.full((64,), 3.0), torch.arange(64), torch.zeros(64, dtype=torch.long))
    assert set(tokens.tolist()) <= {1, 3} and set(tokens.tolist()) == {1, 3}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_temperature_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="temperature: expected a finite number > 0"):
        SamplingParams(bad)


def _engine(**options) -> LLMEngine:
    return LLMEngine(TINY, dtype="float32", **{"max_num_seqs": 4, "max_num_batched_tokens": 24, **options})


@pytest.mark.slow      # ~100 engine steps under the interpreter, 150 s of make test's 2 cores: in CI's share of test-slow
def test_engine_draws_are_reproducible_and_carry_the_models_logprobs():
    # Three requests sampled at T = 1.5 beside a greedy one, twice (the same draws), then each alone with a larger
    # budget (other batches, other chunking: the same draws); a drawn token's logprob is the model's, as the
    # teacher-forced prompt logprob of the same sequence gives it, and its top-k is the row's.
    requests = [(f"s{i}", _prompt(i, 5 + 9 * i), 12, SamplingParams(1.5, seed=100 + i)) for i in range(3)]
    requests.append(("g", _prompt(7, 6), 12))
    engine = _engine()
    first = engine.generate(requests, top_k=3)
    again = engine.generate([(f"{r[0]}-again", *r[1:]) for r in requests], top_k=3)
    alone = [_engine(max_num_batched_tokens=64).generate([r], top_k=3)[0] for r in requests]
    greedy = engine.generate([(f"{r[0]}-greedy", *r[1:3]) for r in requests[:3]], top_k=3)
    for out, out2, solo, req in zip(first, again, alone, requests):
        assert out.output_ids == out2.output_ids == solo.output_ids
        assert out.output_logprobs == out2.output_logprobs
        forced = engine.generate([(f"{req[0]}-forced", req[1] + out.output_ids, 0)])[0]
        tail = forced.prompt_logprobs[len(req[1]) - 1:]
        assert max(abs(a - b) for a, b in zip(tail, out.output_logprobs)) < 1e-4
        for top, token, logprob in zip(out.output_top, out.output_ids, out.output_logprobs):
            ids, vals = [t for t, _ in top], [v for _, v in top]
            assert vals == sorted(vals, reverse=True) and len(ids) == 3
            assert logprob <= vals[0] + 1e-6 and (token != ids[0] or logprob == vals[0])
    assert any(o.output_ids != g.output_ids for o, g in zip(first, greedy))   # T = 1.5 leaves the greedy path
    assert first[3].output_ids == [top[0][0] for top in first[3].output_top]      # the greedy request stays greedy


def test_other_seeds_draw_other_tokens_and_a_tiny_temperature_is_greedy():
    engine = _engine()
    prompt = _prompt(3, 9)
    outs = engine.generate([(f"seed{s}", prompt, 16, SamplingParams(2.0, seed=s)) for s in range(4)]
                           + [("cold", prompt, 16, SamplingParams(1e-6, seed=5)), ("greedy", prompt, 16)])
    assert len({tuple(o.output_ids) for o in outs[:4]}) == 4
    assert outs[4].output_ids == outs[5].output_ids


def test_sampled_decodes_go_through_the_graph_runner_and_match_eager_steps():
    # With cuda_graphs on, a step holding a sampled sequence replays the graph too (padding rows and all, so that a
    # padding bug shows in sampled runs), without running ahead; draws and logprobs are those of eager steps.
    # Both prompts are prefilled in the first step; every later step is a decode step of the runner: 13 of them
    # (g's last 13 tokens), the first 5 with s beside it (2 rows), the last 8 alone.
    requests = [("s", _prompt(1, 7), 6, SamplingParams(1.2, seed=9)), ("g", _prompt(2, 5), 14)]
    plain = _engine().generate(requests)
    graphed_engine = _engine(cuda_graphs=True)
    graphed = graphed_engine.generate(requests)
    assert dict(graphed_engine.graphs.launches) == {2: 5, 1: 8}
    for a, b in zip(plain, graphed):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


def test_generate_rejects_a_malformed_request_tuple():
    engine = _engine()
    with pytest.raises(EngineError, match="expected \\(id, prompt, max_new_tokens\\[, SamplingParams or None\\]\\)"):
        engine.generate([("x", [1, 2], 3, 1.5)])
    with pytest.raises(EngineError, match="sampling: expected a SamplingParams or None, got float"):
        engine.add_request("y", [1, 2], 3, sampling=1.5)
