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
    ({"model_type": "mamba2"}, "model_type: expected one of ['bamba', 'granitemoehybrid'], got 'mamba2'"),
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


# ---- GraniteMoeHybrid -------------------------------------------------------------------------------------------
GRANITE = dict(model_type="granitemoehybrid", hidden_size=64, num_attention_heads=4, mamba_n_heads=8,
               num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])


def test_granite_defaults_are_transformers_defaults(tmp_path):
    """A Granite file that leaves a field out means GraniteMoeHybridConfig's default, not Bamba's: written by
    transformers itself (only the sizes given), read back, compared field by field."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.GraniteMoeHybridConfig(**{k: v for k, v in GRANITE.items() if k != "model_type"})
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for name in ("vocab_size", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "mamba_d_state",
                 "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "attention_multiplier"):
        raw.pop(name, None)                            # absent from the file: the reader's defaults must agree
    raw.pop("position_embedding_type", None)
    raw.pop("num_key_value_heads", None)
    raw.pop("rope_parameters", None)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.model_type == "granitemoehybrid" and cfg.granite
    for name in ("vocab_size", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "mamba_d_state",
                 "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "attention_multiplier",
                 "embedding_multiplier", "residual_multiplier", "logits_scaling", "num_key_value_heads"):
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.position_embedding_type is None and not cfg.rope          # NoPE unless the file says "rope"
    assert cfg.attention_scale == 1.0                                    # Granite's default multiplier, not Dh^-½
    assert cfg.partial_rotary_factor == 1.0 and cfg.rope_theta == 10000.0
    assert cfg.layer_types == ("mamba", "attention", "mamba")


def test_granite_nope_spelling_and_rope():
    assert ModelConfig.from_dict({**GRANITE, "position_embedding_type": "nope"}).rope is False
    assert ModelConfig.from_dict({**GRANITE, "position_embedding_type": None}).rope is False
    assert ModelConfig.from_dict({**GRANITE, "position_embedding_type": "rope"}).rope is True
    assert ModelConfig.from_dict(BASE).rope is True and ModelConfig.from_dict(BASE).attention_scale == 16 ** -0.5


@pytest.mark.parametrize("fields, message", [
    ({**BASE, "embedding_multiplier": 2.0}, r"\['embedding_multiplier'\]: not bamba config fields"),
    ({**BASE, "num_local_experts": 4}, r"\['num_local_experts'\]: not bamba config fields"),
    ({**GRANITE, "mlp_bias": True}, r"\['mlp_bias'\]: not granitemoehybrid config fields"),
    ({**GRANITE, "head_dim": 8}, r"\['head_dim'\]: not granitemoehybrid config fields"),
    ({**GRANITE, "attn_layer_indices": [1]}, r"\['attn_layer_indices'\]: not granitemoehybrid config fields"),
    ({**GRANITE, "num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok = 3: expected 1..num_local_experts = 2"),
    ({**GRANITE, "num_local_experts": 2, "num_experts_per_tok": 0},
     "num_experts_per_tok = 0: expected 1..num_local_experts = 2"),
    ({**GRANITE, "position_embedding_type": "alibi"}, "position_embedding_type: expected 'rope' or none"),
    ({**GRANITE, "shared_intermediate_size": 0}, "shared_intermediate_size: expected a positive integer"),
    ({**GRANITE, "logits_scaling": 0}, "logits_scaling: the logits are divided by it"),
    ({**GRANITE, "model_type": "granitemoe"}, "model_type: expected one of"),
    ({**GRANITE, "router_jitter": 0.1}, r"unknown config fields \['router_jitter'\]: not GraniteMoeHybridConfig"),
])
def test_granite_fields_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(fields)


def test_granite_training_only_fields_are_accepted():
    cfg = ModelConfig.from_dict({**GRANITE, "output_router_logits": True, "router_aux_loss_coef": 0.01})
    assert cfg.num_local_experts == 8


def test_granite_fields_cannot_be_set_on_a_bamba_config_directly():
    with pytest.raises(ConfigError, match=r"\['logits_scaling'\]: GraniteMoeHybrid fields in a bamba config"):
        ModelConfig(logits_scaling=2.0)
