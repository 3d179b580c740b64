"""Bamba → GraniteMoeHybrid: the same model under the architecture that current vLLM releases still serve.

vLLM dropped BambaForCausalLM after 0.23, but its GraniteMoeHybridForCausalLM computes exactly Bamba when the
checkpoint is rewritten so: no routed experts; the shared MLP is Bamba's SwiGLU with gate and up stacked into
`shared_mlp.input_linear` (gate rows first: GraniteMoeSharedMLP splits the product in two halves and gates with the
first) and down as `shared_mlp.output_linear`; every multiplier 1 (embedding, residual, logits) except the attention
scale, which Granite takes from `attention_multiplier` and Bamba fixes at Dh^-½; RoPE with Bamba's rope parameters;
`pre_ff_layernorm` → `post_attention_layernorm` and `final_layernorm` → `norm`. Mamba and attention tensors keep
their names.

`conversion_problems` lists what cannot be carried over (Granite has no MLP bias, derives Dh from D/Hq and does not
clamp Δ); `convert_checkpoint` writes the converted directory. Only torch and safetensors are needed, so the harness
converts in its own process and vLLM only ever sees the result.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference.checkpoint import load_checkpoint
from reference.config import ModelConfig

# Tokenizer files copied next to the converted weights when present (vLLM's server needs a tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class ConversionError(ValueError):
    """A Bamba checkpoint that GraniteMoeHybrid cannot express exactly."""


def conversion_problems(cfg: ModelConfig) -> list[str]:
    """Why `cfg` cannot be converted without changing what the model computes; [] if it can."""
    problems = []
    if cfg.mlp_bias:
        problems.append("mlp_bias = True: GraniteMoeHybrid's shared MLP has no bias")
    if cfg.attn_head_dim * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"head_dim = {cfg.attn_head_dim} with {cfg.num_attention_heads} heads and hidden_size = "
                        f"{cfg.hidden_size}: GraniteMoeHybrid derives the head dim as hidden_size // heads")
    return problems + vllm_granite_problems(cfg)


def vllm_granite_problems(cfg: ModelConfig) -> list[str]:
    """Why vLLM's GraniteMoeHybridForCausalLM would compute another model than `cfg` defines ([] if none)."""
    if tuple(cfg.time_step_limit) != (0.0, math.inf):
        return [f"time_step_limit = {tuple(cfg.time_step_limit)}: vLLM's MambaMixer2 does not clamp Δ (it always "
                "uses (0, inf))"]
    return []


def granite_config(cfg: ModelConfig, raw: dict) -> dict:
    """The GraniteMoeHybrid config.json for Bamba config `cfg` (raw: the original config.json, for token ids)."""
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "shared_intermediate_size": cfg.intermediate_size,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
        "attention_multiplier": cfg.attn_head_dim ** -0.5,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "layer_types": ["full_attention" if kind == "attention" else "linear_attention" for kind in cfg.layer_types],
        "mamba_n_heads": cfg.mamba_n_heads,
        "mamba_n_groups": cfg.mamba_n_groups,
        "mamba_d_state": cfg.mamba_d_state,
        "mamba_d_head": cfg.mamba_head_dim,
        "mamba_d_conv": cfg.mamba_d_conv,
        "mamba_expand": cfg.mamba_expand,
        "mamba_chunk_size": cfg.mamba_chunk_size,
        "mamba_conv_bias": cfg.mamba_conv_bias,
        "mamba_proj_bias": cfg.mamba_proj_bias,
        **{key: raw[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype") if key in raw},
    }


def granite_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bamba's tensors under GraniteMoeHybrid's names (MLP gate and up stacked, gate first: (2I, D))."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".feed_forward." in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue                     # a tied head is the embedding: stored once, as a tied checkpoint does
        new = name.replace(".pre_ff_layernorm.", ".post_attention_layernorm.")
        new = new.replace("model.final_layernorm.", "model.norm.")
        out[new] = tensor.contiguous()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        gate, up = tensors[p + "feed_forward.gate_proj.weight"], tensors[p + "feed_forward.up_proj.weight"]
        out[p + "shared_mlp.input_linear.weight"] = torch.cat([gate, up], dim=0).contiguous()       # (2I, D)
        out[p + "shared_mlp.output_linear.weight"] = tensors[p + "feed_forward.down_proj.weight"].contiguous()
    return out


def convert_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the GraniteMoeHybrid form of Bamba checkpoint `src` into directory `dst` (created; files in it are
    overwritten): config.json, model.safetensors and the tokenizer files `src` has. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    cfg, tensors = load_checkpoint(src)
    problems = conversion_problems(cfg)
    if problems:
        raise ConversionError(f"{src}: cannot express this Bamba as GraniteMoeHybrid: " + "; ".join(problems))
    raw = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(granite_config(cfg, raw), indent=2) + "\n")
    save_file(granite_tensors(cfg, tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst
