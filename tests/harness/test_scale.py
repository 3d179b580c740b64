"""The real-width scale models (harness/scale.py): what they are written as, and that their SSM scalars do what the
module says. Real widths need a GPU (tests/engine/test_scale_gpu.py); here each entry is shrunk to a few hundred
parameters a layer through config overrides, which keeps every drawing rule and the file layout."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness import cli, scale
from reference.checkpoint import expected_shapes, load_checkpoint
from reference.config import ModelConfig
from reference.model import BambaReference
from tests.helpers import unclamped_delta
from vendored.engine.weights import read_tensors

SHRUNK = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
# Granite entries shrink further: half the experts with the published share of them per token (Tiny 6 of 64, Small
# 10 of 72), expert and shared widths of 16 and 32. Layer pattern and multipliers stay as published.
GRANITE_SHRUNK = {
    "granite4h-tiny": dict(SHRUNK, num_local_experts=32, num_experts_per_tok=3, intermediate_size=16,
                           shared_intermediate_size=32),
    "granite4h-small": dict(SHRUNK, num_local_experts=36, num_experts_per_tok=5, intermediate_size=16,
                            shared_intermediate_size=32),
}

# Each entry's layers and where its attention is.
LAYOUT = {
    "bamba9b-2layer": (2, (1,)),
    "bamba9b-4layer": (4, (1,)),
    "bamba9b-32layer": (32, (9, 18, 27)),
    "granite4h-tiny-2layer": (2, (1,)),
    "granite4h-small-2layer": (2, (1,)),
    "granite4h-small-full": (40, (5, 15, 25, 35)),
}


def shrunk(name: str) -> dict:
    return next((fields for prefix, fields in GRANITE_SHRUNK.items() if name.startswith(prefix + "-")), SHRUNK)


def test_every_entry_has_a_layout_and_a_base():
    assert set(LAYOUT) == set(scale.SCALE) == set(scale.BASE_OF)


@pytest.mark.parametrize("name", list(scale.SCALE))
def test_an_entry_loads_everywhere_in_one_shard_per_layer(name, tmp_path):
    path = scale.write_checkpoint(name, tmp_path / name, progress=False, **shrunk(name))
    cfg, weights = load_checkpoint(path)
    base = scale.BASE_OF[name]
    assert (cfg.num_hidden_layers, cfg.attn_layer_indices) == LAYOUT[name]
    assert cfg.model_type == base["model_type"]
    assert cfg.time_step_limit == tuple(base.get("time_step_limit", (0.0, math.inf)))
    if cfg.granite:                       # the published multipliers and expert share survive the shrinking
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == (
            base["embedding_multiplier"], base["residual_multiplier"], base["attention_multiplier"],
            base["logits_scaling"])
        share = base["num_experts_per_tok"] / base["num_local_experts"]
        assert cfg.num_experts_per_tok / cfg.num_local_experts == share
        assert not cfg.rope and cfg.tie_word_embeddings
    written = set(expected_shapes(cfg))                                  # a tied head is not written
    assert set(weights) == written | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == written
    assert len(set(index.values())) == cfg.num_hidden_layers + 1
    assert set(read_tensors(path)) == written                            # the vendored engine's own loader


def test_an_entry_is_the_same_bytes_every_time(tmp_path):
    a = scale.write_checkpoint("bamba9b-2layer", tmp_path / "a", progress=False, **SHRUNK)
    b = scale.write_checkpoint("bamba9b-2layer", tmp_path / "b", progress=False, **SHRUNK)
    c = scale.write_checkpoint("bamba9b-2layer", tmp_path / "c", seed=1, progress=False, **SHRUNK)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert all((a / s).read_bytes() == (b / s).read_bytes() for s in shards)
    assert any((a / s).read_bytes() != (c / s).read_bytes() for s in shards)


def test_the_real_width_config_is_bamba_9b():
    raw = scale.config_dict("bamba9b-32layer")
    assert (raw["hidden_size"], raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_d_state"], raw["vocab_size"],
            raw["mamba_chunk_size"], raw["num_attention_heads"], raw["num_key_value_heads"]) == (
        4096, 128, 64, 128, 128256, 256, 32, 8)
    with pytest.raises(KeyError, match="expected one of"):
        scale.config_dict("bamba9b-3layer")


# The published config.json fields of Granite 4.0-H (harness/scale.py's docstring names where each was read).
GRANITE_4H_PUBLISHED = {
    "granite4h-tiny": dict(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6,
        intermediate_size=512, shared_intermediate_size=1024, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, vocab_size=100352,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000,
        embedding_multiplier=12, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6),
    "granite4h-small": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_local_experts=72, num_experts_per_tok=10,
        intermediate_size=768, shared_intermediate_size=1536, mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, vocab_size=100352,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000,
        embedding_multiplier=12, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16,
        position_embedding_type="nope", hidden_act="silu", attention_bias=False, mamba_conv_bias=True,
        mamba_proj_bias=False),
}
ATTENTION_40 = [5, 15, 25, 35]              # both: 36 mamba layers and 4 attention layers


@pytest.mark.parametrize("entry, base", [("granite4h-tiny-2layer", "granite4h-tiny"),
                                         ("granite4h-small-2layer", "granite4h-small"),
                                         ("granite4h-small-full", "granite4h-small")])
def test_the_granite_configs_have_the_published_widths(entry, base):
    raw = scale.config_dict(entry)
    assert {field: raw[field] for field in GRANITE_4H_PUBLISHED[base]} == GRANITE_4H_PUBLISHED[base]
    assert raw["model_type"] == "granitemoehybrid" and raw["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert [i for i, kind in enumerate(scale.BASE_OF[entry]["layer_types"]) if kind == "attention"] == ATTENTION_40
    cfg = ModelConfig.from_dict(raw)                # what the reader makes of it: NoPE, head dim 128, no Δ clamp
    assert cfg.granite and not cfg.rope and cfg.attn_head_dim == 128 and cfg.mamba_inner == 2 * cfg.hidden_size
    assert cfg.mamba_conv_bias and not cfg.mamba_proj_bias and not cfg.attention_bias
    assert cfg.time_step_limit == (0.0, math.inf)


def test_the_full_small_config_is_the_published_one_and_its_size():
    """All 40 published layers; 32.2 B parameters: 59.99 GiB in bf16 (the size listed for the published
    safetensors), 257.7 GB in fp64."""
    cfg = ModelConfig.from_dict(scale.config_dict("granite4h-small-full"))
    assert cfg.layer_types == tuple(scale.GRANITE_4H_SMALL["layer_types"])
    assert cfg.mamba_layer_indices == tuple(i for i in range(40) if i not in (5, 15, 25, 35))
    n = sum(math.prod(shape) for shape in expected_shapes(cfg).values())
    assert n == 32_207_337_984
    assert round(2 * n / 2**30, 2) == 59.99 and round(8 * n / 1e9, 1) == 257.7


def test_config_dict_starts_from_each_entrys_own_base():
    assert scale.config_dict("granite4h-tiny-2layer")["hidden_size"] == 1536
    assert scale.config_dict("granite4h-small-2layer")["hidden_size"] == 4096
    assert scale.config_dict("bamba9b-2layer")["model_type"] == "bamba"
    assert "attn_layer_indices" not in scale.config_dict("granite4h-small-full")
    raw = scale.config_dict("granite4h-small-full")
    raw["layer_types"][0] = "attention"                                 # a caller's edit leaves the base alone
    assert scale.GRANITE_4H_SMALL["layer_types"][0] == "mamba"


@pytest.mark.parametrize("name", list(scale.SCALE))
def test_every_unshrunk_entry_is_a_valid_config(name):
    cfg = ModelConfig.from_dict(scale.config_dict(name))
    assert (cfg.num_hidden_layers, cfg.attn_layer_indices) == LAYOUT[name]


def test_heads_decay_at_three_rates():
    """A quarter very slow (the state outlives a chunk of 256), a quarter slow, half fast."""
    A = scale.scale_ssm_scalars("model.layers.0.mamba.A_log", (128,), torch.Generator().manual_seed(0), "cpu")
    a = A.exp()
    kind = torch.arange(128) % 4
    assert ((a[kind == 0] >= 1e-3) & (a[kind == 0] <= 1e-2)).all()
    assert ((a[kind == 1] >= 0.02) & (a[kind == 1] <= 0.2)).all()
    assert (a[kind >= 2] >= 1).all()


def test_both_time_step_bounds_clamp_a_real_share_of_delta(tmp_path, monkeypatch):
    """Δ = softplus(dt + dt_bias) before the clamp, over every mamba layer, head and token of random prompts: at
    least 7% lies below the lower bound and 7% above the upper one. dt's spread does not depend on the width (the
    projection is scaled by 1/√fan_in), so the shrunk model measures what the real one does."""
    path = scale.write_checkpoint("bamba9b-4layer", tmp_path / "m", progress=False, **SHRUNK)
    ref = BambaReference.from_pretrained(path, dtype=torch.float32)
    delta = unclamped_delta(monkeypatch, ref, torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)))
    lo, hi = ref.cfg.time_step_limit
    below, above = float((delta < lo).float().mean()), float((delta > hi).float().mean())
    print(f"Δ below {lo}: {below:.3f}, above {hi}: {above:.3f}")
    assert below >= 0.07 and above >= 0.07, f"share below {lo}: {below:.3f}, above {hi}: {above:.3f}"


def test_write_model_command(tmp_path, capsys):
    assert cli.main(["write-model", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "scale bamba9b-2layer" in listed and "zoo   pure-mamba2" in listed
    assert "zoo   granite-moe4-top2 (GraniteMoeHybrid)" in listed
    assert cli.main(["write-model", "granite-moe4-top2", str(tmp_path / "g")]) == 0
    assert '"model_type": "granitemoehybrid"' in (tmp_path / "g" / "config.json").read_text()
    assert cli.main(["write-model", "pure-mamba2", str(tmp_path / "z")]) == 0
    assert (tmp_path / "z" / "model.safetensors").is_file()
    assert cli.main(["write-model", "pure-mamba2", str(tmp_path / "z")]) == cli.EXIT_USAGE     # not empty
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert cli.main(["write-model", "bamba9b-3layer", str(tmp_path / "y")]) == cli.EXIT_USAGE
    assert "unknown model 'bamba9b-3layer'" in capsys.readouterr().err
    assert cli.main(["write-model", "pure-mamba2"]) == cli.EXIT_USAGE


def test_only_a_config_with_an_attention_multiplier_gets_a_qk_gain():
    assert all(scale.qk_gain(ModelConfig.from_dict(scale.config_dict(n))) == 1.0 for n in scale.SCALE
               if n.startswith("bamba"))
    tiny = ModelConfig.from_dict(scale.config_dict("granite4h-tiny-2layer"))
    assert scale.qk_gain(tiny) == pytest.approx((128 / 128 ** 0.5) ** 0.5)            # 1/128 at Dh 128: 3.36
    assert scale.qk_gain(tiny) ** 2 * tiny.attention_scale == pytest.approx(tiny.attn_head_dim ** -0.5)


@pytest.mark.parametrize("name", ["granite4h-tiny-2layer", "bamba9b-2layer"])
def test_q_and_k_are_the_zoo_draw_times_the_gain_every_other_tensor_the_draw_itself(name, tmp_path):
    from harness.zoo import iter_weights

    cfg, weights = load_checkpoint(scale.write_checkpoint(name, tmp_path / name, progress=False, **shrunk(name)))
    gain = scale.qk_gain(cfg)
    drawn = dict(iter_weights(cfg, 0, ssm_scalars=scale.scale_ssm_scalars, dtype=torch.float32))
    qk = [k for k in drawn if k.endswith(("q_proj.weight", "k_proj.weight"))]
    assert qk and (gain > 3) == cfg.granite
    for key, value in drawn.items():
        expected = (value * gain if key in qk else value).to(torch.bfloat16)
        assert torch.equal(weights[key], expected), key
