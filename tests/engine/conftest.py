"""The bundled tiny Bamba, its oracle and its prompts, shared by the vendored-engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.runner import Oracle
from harness.scenarios import PromptSource
from reference.config import ModelConfig

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"
PROMPTS = TINY.parent / "prompts.jsonl"
TINY_CFG = ModelConfig.from_json(TINY)


@pytest.fixture(scope="session")
def tiny_oracle():
    oracle = Oracle(TINY)
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def tiny_prompts():
    return PromptSource.from_jsonl(PROMPTS, TINY_CFG.vocab_size)
