"""Long contexts in the vendored engine: RoPE positions past max_position_embeddings only with an explicit opt-in,
and (on a GPU) a 100,003-token prompt prefilled in 8192-token pieces, eager and with graph-replayed decodes, against
the oracle run on the same GPU."""

from __future__ import annotations

import pytest
import torch

from harness.compare import compare_runs
from harness.engine import EngineOptions, Request
from harness.runner import Oracle, check_scenario
from harness.scenarios import LONG_PROMPT_TOKENS, PromptSource, build_scenarios
from reference.config import ModelConfig
from tests.helpers import random_bamba_checkpoint
from vendored.engine import EngineError, LLMEngine

from .conftest import TINY
from .test_cudagraph import DEVICES, engine_class, needs_cuda

SHORT_LIMIT = 64              # max_position_embeddings of the small model that the CPU test goes past


def test_engine_refuses_a_length_past_max_positions_without_opt_in():
    with pytest.raises(EngineError, match="max_model_len = 5000 exceeds max_position_embeddings = 4096; pass "
                                          "allow_long_context=True"):
        LLMEngine(TINY, max_model_len=5000)


@pytest.fixture(scope="module")
def short_limit_checkpoint(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("bamba-max64"), seed=3,
                                   max_position_embeddings=SHORT_LIMIT)


@pytest.mark.parametrize("device_dtype", DEVICES)
def test_positions_past_max_positions_match_oracle_with_opt_in(device_dtype, short_limit_checkpoint):
    """A 150-token prompt on a model trained to 64 positions, prefilled in 40-token pieces, then 4 decodes through
    the padded graph step at positions 150..153: every position within the oracle's budget (the oracle opted in
    too)."""
    device, dtype = device_dtype
    source = PromptSource(ModelConfig.from_json(short_limit_checkpoint).vocab_size, seed=1)
    requests = [Request("r0-len150", source.tokens(150, 0), 5, 5, 0, True),
                Request("r1-len70", source.tokens(70, 1), 3, 5, 0, True)]
    options = EngineOptions(allow_long_context=True, cuda_graphs=True, max_num_batched_tokens=40)
    oracle = Oracle(short_limit_checkpoint)
    try:
        with engine_class(device)(short_limit_checkpoint, dtype=dtype, device=device, options=options) as engine:
            results = engine.run(requests)
            launches = dict(engine.engine.graphs.launches)
        report = compare_runs(scenario=f"long-past-{SHORT_LIMIT}-{device}", requests=requests,
                              baseline=oracle.results(requests), candidate=results,
                              budget=oracle.budget(requests, dtype))
    finally:
        oracle.close()
    assert report.passed, report.message()
    assert launches, "no decode step went through the padded graph path"


# ---- 100,003 tokens on a GPU -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_shape_random(tmp_path_factory):
    """Random weights at the bundled tiny model's shape (its config, max_position_embeddings 4096 included)."""
    cfg = ModelConfig.from_json(TINY)
    fields = {name: getattr(cfg, name) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
        "mamba_d_state", "mamba_d_conv", "mamba_chunk_size", "max_position_embeddings")}
    fields["attn_layer_indices"] = list(fields["attn_layer_indices"])
    return random_bamba_checkpoint(tmp_path_factory.mktemp("tiny-shape-random"), seed=7, **fields)


@pytest.fixture(scope="module")
def cuda_oracle(tiny_shape_random):
    oracle = Oracle(tiny_shape_random, device="cuda")
    yield oracle
    oracle.close()


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("scenario_id", ["long-100k", "long-100k-cudagraph"])
def test_100k_prompt_matches_oracle_on_gpu(scenario_id, tiny_shape_random, cuda_oracle):
    """long-100k(-cudagraph) in bf16 against the fp64 oracle on the GPU: all 100,002 prompt logprobs and the 4
    greedy steps (decodes at a 100,003-token context; replayed graphs in the -cudagraph case)."""
    cfg = ModelConfig.from_json(tiny_shape_random)
    scenario = next(s for s in build_scenarios(cfg) if s.id == scenario_id)
    assert scenario.shapes[0].prompt_len == LONG_PROMPT_TOKENS > cfg.max_position_embeddings
    report = check_scenario("vendored", scenario, oracle=cuda_oracle, source=PromptSource(cfg.vocab_size, seed=0),
                            dtype=torch.bfloat16, device="cuda")
    assert report.passed, report.message()
    assert sum(len(c.positions) for c in report.comparisons) >= LONG_PROMPT_TOKENS - 1
