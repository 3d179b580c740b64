"""Bamba → GraniteMoeHybrid conversion (harness/adapters/granite_convert.py), judged against the oracle.

transformers' GraniteMoeHybridForCausalLM runs the converted checkpoint and the harness compares it with the fp64
oracle on the original one. transformers' Granite, like its Bamba, normalises the gated RMSNorm over all H·P
channels, so with two groups the oracle is the full-width one (the grouped norm that vLLM computes is judged by
make test-vllm). Everything else (the stacked MLP, renamed norms, attention multiplier) must be exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.adapters.granite_convert import ConversionError, conversion_problems, convert_checkpoint, \
    granite_tensors
from harness.adapters.transformers import TransformersEngine
from harness.runner import Oracle, check_scenario
from harness.scenarios import PromptSource, build_scenarios
from reference.checkpoint import load_checkpoint
from reference.config import ModelConfig
from tests.helpers import TINY_CONFIG, random_bamba_checkpoint

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"


class ConvertedGranite(TransformersEngine):
    """transformers' GraniteMoeHybridForCausalLM on the converted form of the checkpoint it is given."""

    name = "transformers-granite"

    def _load(self) -> None:
        from transformers import GraniteMoeHybridForCausalLM

        converted = convert_checkpoint(self.checkpoint, self.checkpoint.parent / (self.checkpoint.name + "-granite"))
        self.model = GraniteMoeHybridForCausalLM.from_pretrained(converted, dtype=self.dtype).to(self.device).eval()


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory):
    """The bundled tiny model in a scratch directory (the converted copy is written beside it)."""
    directory = tmp_path_factory.mktemp("tiny") / "tiny-bamba"
    directory.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (directory / name).write_bytes((TINY / name).read_bytes())
    return directory


@pytest.mark.parametrize("groups, gated_norm, tied", [(1, "grouped", False), (2, "full", False), (1, "grouped", True)],
                         ids=["G1", "G2-full_norm_oracle", "G1-tied"])
def test_converted_model_matches_the_oracle(tmp_path, groups, gated_norm, tied):
    """Random checkpoints with partial_rotary_factor 1: transformers' Granite rotates every head dim whatever the
    config says (its RoPE ignores partial_rotary_factor), so only a full-rotary Bamba is a fair test of the rest.
    Partial RoPE through the converted config is judged with vLLM (make test-vllm), whose get_rope honours it."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    checkpoint = random_bamba_checkpoint(tmp_path / "bamba", seed=3, mamba_n_groups=groups, rope_parameters=rope,
                                         tie_word_embeddings=tied)
    cfg = ModelConfig.from_json(checkpoint)
    assert cfg.partial_rotary_factor == 1.0 and cfg.mamba_n_groups == groups
    oracle = Oracle(checkpoint, gated_norm=gated_norm)
    try:
        for scenario in build_scenarios(cfg):
            if scenario.id in ("batching-together", "batching-shuffled"):
                report = check_scenario(ConvertedGranite, scenario, oracle=oracle, dtype=torch.float32,
                                        source=PromptSource(cfg.vocab_size, seed=1))
                assert report.passed, report.message()
                assert sum(len(c.positions) for c in report.comparisons) > 50
    finally:
        oracle.close()


def test_every_tensor_is_carried_over_once(tiny_copy):
    cfg, tensors = load_checkpoint(tiny_copy)
    out = granite_tensors(cfg, tensors)
    I = cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        stacked = out.pop(p + "shared_mlp.input_linear.weight")
        assert torch.equal(stacked[:I], tensors.pop(p + "feed_forward.gate_proj.weight"))
        assert torch.equal(stacked[I:], tensors.pop(p + "feed_forward.up_proj.weight"))
        assert torch.equal(out.pop(p + "shared_mlp.output_linear.weight"), tensors.pop(p + "feed_forward.down_proj.weight"))
        assert torch.equal(out.pop(p + "post_attention_layernorm.weight"), tensors.pop(p + "pre_ff_layernorm.weight"))
    assert torch.equal(out.pop("model.norm.weight"), tensors.pop("model.final_layernorm.weight"))
    assert sorted(out) == sorted(tensors)
    assert all(torch.equal(out[k], tensors[k]) for k in out)


def test_converted_config_fields(tiny_copy, tmp_path):
    import json

    raw = json.loads((convert_checkpoint(tiny_copy, tmp_path / "g") / "config.json").read_text())
    cfg = ModelConfig.from_json(tiny_copy)
    assert raw["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert raw["layer_types"] == ["full_attention" if i in cfg.attn_layer_indices else "linear_attention"
                                  for i in range(cfg.num_hidden_layers)]
    assert raw["attention_multiplier"] == cfg.attn_head_dim ** -0.5
    assert raw["num_local_experts"] == 0 and raw["shared_intermediate_size"] == cfg.intermediate_size
    assert raw["rope_parameters"]["partial_rotary_factor"] == cfg.partial_rotary_factor
    assert (tmp_path / "g" / "tokenizer.json").read_bytes() == (tiny_copy / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("override, problem", [
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"head_dim": 16}, "head_dim = 16 with 4 heads and hidden_size = 32"),
    ({"time_step_limit": (0.0, 0.5)}, "time_step_limit = (0.0, 0.5)"),
], ids=["mlp_bias", "head_dim", "time_step_limit"])
def test_what_granite_cannot_express_is_named(override, problem):
    cfg = ModelConfig.from_dict({**TINY_CONFIG, **override})
    problems = conversion_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_conversion_refuses_a_clamped_time_step(tmp_path):
    src = random_bamba_checkpoint(tmp_path / "src", seed=0, time_step_limit=(0.0, 0.5))
    with pytest.raises(ConversionError, match=r"time_step_limit = \(0.0, 0.5\)"):
        convert_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_the_oracle_computes_the_same_model_from_both_forms(tiny_copy, tmp_path):
    """The oracle reads the converted checkpoint as GraniteMoeHybrid (shared MLP, no experts, the attention
    multiplier, partial RoPE as the converted config states it, renamed norms) and must compute the Bamba it came
    from, to rounding: the conversion and the oracle's Granite path check each other, partial rotary included, on the
    trained tiny model (G = 2, grouped norm on both sides)."""
    import json

    from reference.model import BambaReference

    converted = convert_checkpoint(tiny_copy, tmp_path / "g")
    bamba, granite = BambaReference.from_pretrained(tiny_copy), BambaReference.from_pretrained(converted)
    assert granite.cfg.granite and granite.cfg.num_local_experts == 0 and granite.cfg.partial_rotary_factor == 0.5
    prompts = [json.loads(line) for line in (TINY.parent / "prompts.jsonl").read_text().splitlines()]
    ids = torch.tensor(next(p["token_ids"] for p in prompts if p["n_tokens"] > 32))
    ours, theirs = bamba.forward(ids)[0], granite.forward(ids)[0]
    assert ids.numel() > 16 and (ours - theirs).abs().max() <= 1e-10
