"""reference/config.py: BambaConfig fields and defaults, and clear errors for what cannot be interpreted."""

import json
import math

import pytest

from reference.config import ConfigError, ModelConfig

BASE = dict(hidden_size=64, mamba_n_heads=8, mamba_n_groups=2, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, attn_layer_indices=[1])


def test_defaults_follow_bamba_config():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.partial_rotary_factor == 0.5
    assert cfg.rope_theta == 10000.0
    assert cfg.time_step_limit == (0.0, math.inf)
    assert cfg.mamba_head_dim == 2 * 64 // 8
    assert cfg.rotary_dim == (64 // 4) // 2
    assert cfg.gated_norm_group_size == 2 * 64 // 2
    assert cfg.layer_types == ("mamba", "attention", "mamba", "mamba")


def test_rope_parameters_override_top_level_fields():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 5.0, "partial_rotary_factor": 0.5,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                     "partial_rotary_factor": 1.0}})
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (500.0, 1.0)


def test_time_step_limit_infinity_as_written_by_transformers():
    cfg = ModelConfig.from_dict({**BASE, "time_step_limit": [0.001, {"__float__": "Infinity"}]})
    assert cfg.time_step_limit == (0.001, math.inf)


def test_layer_types_give_attention_layers():
    types = ["mamba", "mamba", "attention", "mamba"]
    cfg = ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "attn_layer_indices"} | {"layer_types": types})
    assert cfg.attn_layer_indices == (2,)


def test_pure_mamba2_has_no_attention_layers():
    cfg = ModelConfig.from_dict({**BASE, "attn_layer_indices": []})
    assert set(cfg.layer_types) == {"mamba"}


def test_generic_fields_written_by_transformers_are_accepted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "bamba", "architectures": ["X"],
                                                      "transformers_version": "5.17.0", "use_cache": True}))
    assert ModelConfig.from_json(tmp_path).hidden_size == 64


@pytest.mark.parametrize("fields, message", [
    ({"mamba_d_head": 12}, "must equal mamba_expand·hidden_size"),
    ({"mamba_n_heads": 8, "mamba_n_groups": 3}, "not divisible by mamba_n_groups"),
    ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads"),
    ({"mamba_chunck_size": 64}, "unknown config fields ['mamba_chunck_size']"),
    ({"layer_types": ["mamba", "mamba", "attention", "mamba"]}, "contradicts layer_types"),
    ({"layer_types": ["mamba", "mamba", "mamba"]}, "layer_types has 3 entries"),
    ({"attn_layer_indices": [4]}, "outside [0, 4)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "only 'default' RoPE"),
    ({"hidden_act": "gelu"}, "only 'silu'"),
    ({"model_type": "mamba2"}, "expected 'bamba'"),
    ({"time_step_limit": [1.0, 0.5]}, "0 <= low <= high"),
    ({"mamba_n_heads": 0}, "mamba_n_heads: expected a positive integer"),
], ids=["heads-times-headdim", "heads-vs-groups", "q-vs-kv-heads", "unknown-field", "layer-types-contradict",
        "layer-types-length", "attn-index-range", "rope-type", "activation", "model-type", "time-step-limit",
        "zero-heads"])
def test_contradictory_or_unknown_fields_raise(fields, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**BASE, **fields})
    assert message in str(err.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        ModelConfig.from_json(tmp_path)


def test_agrees_with_transformers_on_derived_sizes(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BambaConfig(**BASE, rope_parameters={"rope_type": "default", "rope_theta": 321.0,
                                                          "partial_rotary_factor": 1.0})
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_json(tmp_path)
    assert cfg.mamba_head_dim == hf.mamba_d_head
    assert list(cfg.layer_types) == ["attention" if t == "full_attention" else "mamba" for t in hf.layers_block_type]
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (321.0, 1.0)
    assert cfg.time_step_limit == tuple(hf.time_step_limit)
