"""Checkpoints and oracles shared by the harness tests: small random Bamba models saved by transformers."""

from __future__ import annotations

import pytest

from harness.runner import Oracle
from harness.scenarios import PromptSource
from reference.config import ModelConfig
from tests.helpers import TINY_CONFIG, random_bamba_checkpoint

# G = 1: transformers and the oracle compute the same gated RMSNorm, so transformers is a fair candidate.
G1_OVERRIDES = {"mamba_n_groups": 1}
G1_MODEL = ModelConfig.from_dict({**TINY_CONFIG, **G1_OVERRIDES})


@pytest.fixture(scope="session")
def g1_checkpoint(tmp_path_factory):
    path = random_bamba_checkpoint(tmp_path_factory.mktemp("bamba-g1"), seed=0, **G1_OVERRIDES)
    assert ModelConfig.from_json(path) == G1_MODEL, "the saved config differs from the one the cases were built from"
    return path


@pytest.fixture(scope="session")
def g2_checkpoint(tmp_path_factory):
    """TINY_CONFIG as it is: n_groups = 2, like the bundled tiny model."""
    return random_bamba_checkpoint(tmp_path_factory.mktemp("bamba-g2"), seed=0)


@pytest.fixture(scope="session")
def g1_oracle(g1_checkpoint):
    oracle = Oracle(g1_checkpoint)
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def g1_cuda_oracle(g1_checkpoint):
    oracle = Oracle(g1_checkpoint, device="cuda")
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def g1_prompts():
    return PromptSource(G1_MODEL.vocab_size, seed=0)
