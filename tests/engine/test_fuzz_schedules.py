"""Fuzz: hypothesis draws a seed; the seed draws a schedule (request lengths, tokens to generate, arrival steps,
token budget, max_num_seqs, K/V cache size); the vendored engine must match the fp64 oracle on it.

A failure prints the seed (the assertion message says it; hypothesis reports `shard` and `drawn`, the seed being
drawn·2 + shard); replay it alone with
`BAMBA_FUZZ_SEED=N pytest tests/engine/test_fuzz_schedules.py -k replay`.
200 examples in CI (`make test-slow`), in two shards of 100 (odd and even seeds) that pytest-xdist runs side by
side; BAMBA_FUZZ_EXAMPLES overrides the total.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.adapters.vendored import VendoredEngine
from harness.compare import compare_runs
from harness.engine import EngineOptions, Request
from harness.runner import Oracle
from harness.scenarios import PromptSource
from tests.helpers import random_bamba_checkpoint

# A 2-layer model (mamba, attention), G = 2, chunk size 8: every schedule crosses chunk and conv-window edges cheaply.
FUZZ_MODEL = dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2,
                  mamba_chunk_size=8, vocab_size=97)
EXAMPLES = int(os.environ.get("BAMBA_FUZZ_EXAMPLES", "200"))
SHARDS = 2             # one fuzz run is ~8 minutes of one core: in shards, xdist's workers share it
REPLAY_SEEDS = [0, 1, 2] + ([int(os.environ["BAMBA_FUZZ_SEED"])] if os.environ.get("BAMBA_FUZZ_SEED") else [])


@pytest.fixture(scope="module")
def fuzz_oracle(tmp_path_factory):
    oracle = Oracle(random_bamba_checkpoint(tmp_path_factory.mktemp("fuzz"), seed=7, **FUZZ_MODEL))
    yield oracle
    oracle.close()


def draw_schedule(seed: int) -> tuple[list[Request], EngineOptions]:
    rng = random.Random(seed)
    source = PromptSource(97, seed=seed)
    requests = []
    for i in range(rng.randint(1, 4)):
        length = rng.choice([1, 2, 3, 7, 8, 9, rng.randint(1, 27)])
        requests.append(Request(f"s{seed}-r{i}-len{length}", source.tokens(length, i), rng.randint(0, 3), 5,
                                rng.choice([0, 0, 1, 3]), True))
    block_size = rng.choice([2, 4, 16])
    need = max(-(-(len(r.prompt) + r.max_new_tokens) // block_size) for r in requests)
    options = EngineOptions(max_num_batched_tokens=rng.choice([1, 2, 3, 5, 8, 9, 17, 64]),
                            max_num_seqs=rng.randint(1, 4),
                            kv_block_size=block_size, num_kv_blocks=need + rng.randint(0, 4))
    return requests, options


def check_schedule(seed: int, oracle: Oracle) -> None:
    requests, options = draw_schedule(seed)
    with VendoredEngine(oracle.checkpoint, dtype=torch.float32, device="cpu", options=options) as engine:
        results = engine.run(requests)
    report = compare_runs(scenario=f"fuzz-seed{seed} {options.non_default()}", requests=requests,
                          baseline=oracle.results(requests), candidate=results,
                          budget=oracle.budget(requests, torch.float32))
    assert report.passed, f"replay with seed {seed}: {report.message()}"


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
@settings(max_examples=-(-EXAMPLES // SHARDS), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=st.integers(min_value=0, max_value=2**31 // SHARDS - 1))
def test_fuzz_schedule_matches_oracle(shard, drawn, fuzz_oracle):
    check_schedule(drawn * SHARDS + shard, fuzz_oracle)          # the shards' seeds are disjoint


@pytest.mark.parametrize("seed", REPLAY_SEEDS)
def test_fuzz_replay_seeds(seed, fuzz_oracle):
    """Three fixed schedules in the fast suite (so the machinery stays exercised), plus $BAMBA_FUZZ_SEED if set."""
    check_schedule(seed, fuzz_oracle)
