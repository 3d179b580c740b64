"""Requests the oracle cannot serve fail with a message naming the request, the position and the value."""

import pytest
import torch

from reference.model import BambaReference, InputError
from tests.helpers import random_bamba_checkpoint


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return BambaReference.from_pretrained(random_bamba_checkpoint(tmp_path_factory.mktemp("bad"), seed=2,
                                                                  max_position_embeddings=16))


@pytest.mark.parametrize("bad_id", [-1, 97, 10**6], ids=["negative", "vocab-size", "huge"])
def test_token_id_out_of_range(oracle, bad_id):
    with pytest.raises(InputError, match=rf"request 0: token id {bad_id} at position 2 is outside the vocabulary"):
        oracle.forward(torch.tensor([1, 2, bad_id, 3]))


def test_empty_prompt(oracle):
    with pytest.raises(InputError, match="request 1: empty prompt"):
        oracle.forward_batch([[1, 2], []], [oracle.initial_state(), oracle.initial_state()])


def test_positions_past_max_position_embeddings_need_opt_in(oracle):
    _, state = oracle.forward(torch.arange(15))
    with pytest.raises(InputError, match="positions up to 16 exceed max_position_embeddings = 16"):
        oracle.forward(torch.tensor([1, 2]), state)
    long = BambaReference(oracle.cfg, oracle.w, allow_long_context=True)
    logits, _ = long.forward(torch.arange(20) % 97)
    assert torch.isfinite(logits).all()


def test_pieces_and_states_must_pair_up(oracle):
    with pytest.raises(InputError, match="2 pieces but 1 states"):
        oracle.forward_batch([[1], [2]], [oracle.initial_state()])


def test_unknown_gated_norm_mode(oracle):
    with pytest.raises(ValueError, match="gated_norm: expected 'grouped' or 'full', got 'per-head'"):
        BambaReference(oracle.cfg, oracle.w, gated_norm="per-head")
