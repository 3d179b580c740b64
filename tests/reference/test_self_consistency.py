"""The oracle against itself in fp64: pieces, batches and causality are exact by construction, so check they are."""

import random

import pytest
import torch

from reference.model import BambaReference
from tests.helpers import random_bamba_checkpoint

EXACT = 1e-12
W, Q = 4, 8
PROMPT = 3 * Q + 5


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    path = random_bamba_checkpoint(tmp_path_factory.mktemp("self"), seed=21)
    return BambaReference.from_pretrained(path)


def _ids(n, seed, vocab=97):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_states_equal(a, b, what):
    assert a.length == b.length, f"{what}: length {a.length} vs {b.length}"
    for name in ("conv", "ssm", "keys", "values"):
        for layer, tensor in getattr(a, name).items():
            other = getattr(b, name)[layer]
            assert tensor.shape == other.shape, f"{what}: {name}[{layer}] shape {tensor.shape} vs {other.shape}"
            err = (tensor - other).abs().max() if tensor.numel() else torch.tensor(0.0)
            assert err <= EXACT, f"{what}: {name}[{layer}] differs by {err:.3g}"


def _run_in_pieces(oracle, ids, sizes):
    state, logits = oracle.initial_state(), []
    start = 0
    for size in sizes:
        piece_logits, state = oracle.forward(ids[start:start + size], state)
        logits.append(piece_logits)
        start += size
    assert start == len(ids)
    return torch.cat(logits), state


def _random_split(total, rng):
    sizes = []
    while total:
        size = min(total, rng.choice([1, 2, W - 2, W - 1, Q - 1, Q, Q + 1, rng.randint(1, 2 * Q)]))
        sizes.append(size)
        total -= size
    return sizes


SPLITS = {
    "every-token-alone": [1] * PROMPT,
    "shorter-than-W-1-pieces": [W - 2] * (PROMPT // (W - 2)) + [PROMPT % (W - 2)] * (PROMPT % (W - 2) > 0),
    "chunk-edges": [Q - 1, 1, Q + 1, Q, PROMPT - (3 * Q + 1)],
    "one-then-rest": [1, PROMPT - 1],
    **{f"random-seed{s}": _random_split(PROMPT, random.Random(s)) for s in range(4)},
}


@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_any_split_gives_the_whole_prompt_result(oracle, sizes):
    ids = _ids(PROMPT, seed=1)
    whole_logits, whole_state = oracle.forward(ids)
    piece_logits, piece_state = _run_in_pieces(oracle, ids, sizes)
    err = (whole_logits - piece_logits).abs()
    assert err.max() <= EXACT, f"split {sizes}: logits differ by {err.max():.3g} at position {int(err.max(1).values.argmax())}"
    _assert_states_equal(whole_state, piece_state, f"split {sizes}")


def test_a_batch_gives_each_request_its_result_alone(oracle):
    lengths = [1, W - 1, Q - 1, Q, Q + 1, 3 * Q + 5]
    prompts = [_ids(n, seed=100 + n) for n in lengths]
    batch_logits, batch_states = oracle.forward_batch(prompts, [oracle.initial_state() for _ in prompts])
    for prompt, logits, state in zip(prompts, batch_logits, batch_states):
        alone_logits, alone_state = oracle.forward(prompt)
        assert (logits - alone_logits).abs().max() <= EXACT, f"request of length {len(prompt)} differs in a batch"
        _assert_states_equal(state, alone_state, f"request of length {len(prompt)}")


def test_a_batch_of_second_pieces_continues_each_state(oracle):
    firsts = [_ids(n, seed=200 + n) for n in (2, Q, Q + 3)]
    seconds = [_ids(n, seed=300 + n) for n in (Q + 1, 1, W - 2)]
    states = [oracle.forward(p)[1] for p in firsts]
    batch_logits, batch_states = oracle.forward_batch(seconds, states)
    for first, second, logits, state in zip(firsts, seconds, batch_logits, batch_states):
        whole_logits, whole_state = oracle.forward(torch.cat([first, second]))
        assert (logits - whole_logits[len(first):]).abs().max() <= EXACT
        _assert_states_equal(state, whole_state, f"continuation after {len(first)} tokens")


def test_forward_does_not_modify_the_given_state(oracle):
    _, state = oracle.forward(_ids(Q, seed=3))
    snapshot = {k: v.clone() for k, v in state.ssm.items()}
    oracle.forward(_ids(Q, seed=4), state)
    assert all(torch.equal(snapshot[k], state.ssm[k]) for k in snapshot)


@pytest.mark.parametrize("changed", [0, W - 1, Q, PROMPT - 1], ids=lambda t: f"t{t}")
def test_changing_token_t_changes_no_logprob_before_t(oracle, changed):
    ids = _ids(PROMPT, seed=5)
    other = ids.clone()
    other[changed] = (ids[changed] + 1) % 97
    before, after = oracle.forward(ids)[0], oracle.forward(other)[0]
    assert torch.equal(before[:changed], after[:changed]), f"a logit before position {changed} moved"
    assert (before[changed] - after[changed]).abs().max() > 1e-3, "the probe is blind: position t itself did not move"
