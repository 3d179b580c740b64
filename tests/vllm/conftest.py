"""make test-vllm: the real vLLM, from its own virtualenv, against the fp64 oracle on the bundled tiny model.

These tests start vLLM processes, so they run only when vllm is named with `--engine vllm` (make test-vllm does);
under `make test` they are skipped with that reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.runner import Oracle
from tests.engine.conftest import TINY, TINY_CFG, tiny_oracle, tiny_prompts  # noqa: F401  (shared fixtures)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    named = {n.strip() for value in config.getoption("--engine", default=None) or [] for n in value.split(",")}
    if "vllm" in named:
        return
    skip = pytest.mark.skip(reason="starts vLLM: runs with --engine vllm (make test-vllm)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cuda_oracle():
    oracle = Oracle(TINY, device="cuda")
    yield oracle
    oracle.close()
