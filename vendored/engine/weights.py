"""Load a Bamba checkpoint for the engine: the config through transformers (as real engines do), the tensors from
safetensors. Deliberately separate from reference/checkpoint.py: code shared with the oracle would share its bugs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class LoadError(RuntimeError):
    """The checkpoint cannot be served: a missing directory, file or tensor, or a tensor of the wrong shape."""


@dataclass(frozen=True)
class EngineModelConfig:
    """The sizes the engine needs, with the glossary's letters (docs/design.md §2)."""

    vocab_size: int            # V
    hidden_size: int           # D
    num_layers: int
    attn_layers: tuple[int, ...]
    n_heads: int               # H
    head_dim: int              # P
    n_groups: int              # G
    d_state: int               # N
    d_conv: int                # W
    chunk_size: int            # Q
    num_q_heads: int           # Hq
    num_kv_heads: int          # Hkv
    attn_head_dim: int         # Dh
    rotary_dim: int            # R
    rope_theta: float
    rms_norm_eps: float
    time_step_limit: tuple[float, float]
    tie_word_embeddings: bool
    max_position_embeddings: int
    # GraniteMoeHybrid (family "granitemoehybrid"); Bamba's values leave the arithmetic as it was.
    family: str = "bamba"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None       # None: Dh^-½
    logits_scaling: float = 1.0
    num_experts: int = 0                       # E routed experts (0: none)
    experts_per_tok: int = 0                   # top-k
    intermediate_size: int = 0                 # I: the MLP's (Bamba) or each expert's (Granite) width
    shared_intermediate_size: int = 0          # S: Granite's shared MLP width

    @property
    def granite(self) -> bool:
        return self.family == "granitemoehybrid"

    @property
    def final_norm_key(self) -> str:
        return "model.norm.weight" if self.granite else "model.final_layernorm.weight"

    @property
    def ffn_norm_suffix(self) -> str:
        return "post_attention_layernorm.weight" if self.granite else "pre_ff_layernorm.weight"

    @property
    def conv_dim(self) -> int:
        return self.n_heads * self.head_dim + 2 * self.n_groups * self.d_state

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.attn_layers)


def read_config(path: Path) -> EngineModelConfig:
    if not (path / "config.json").is_file():
        raise LoadError(f"{path}: no config.json (is this a checkpoint directory?)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "bamba")
    if model_type == "granitemoehybrid":
        return _read_granite_config(path)
    if model_type != "bamba":
        raise LoadError(f"{path}: model_type {model_type!r}: this engine serves Bamba ('bamba') and "
                        "GraniteMoeHybrid ('granitemoehybrid') checkpoints only")
    from transformers import BambaConfig

    hf = BambaConfig.from_pretrained(str(path))
    rope = hf.rope_parameters or {}
    # transformers (5.17) replaces a top-level partial_rotary_factor by 0.5; the file's own value is what it means.
    raw = json.loads((path / "config.json").read_text())
    rotary_factor = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                                 raw.get("partial_rotary_factor", 0.5)))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    limit = tuple(float(v) for v in (hf.time_step_limit or (0.0, math.inf)))
    return EngineModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        attn_layers=tuple(sorted(hf.attn_layer_indices or ())), n_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head,
        n_groups=hf.mamba_n_groups, d_state=hf.mamba_d_state, d_conv=hf.mamba_d_conv, chunk_size=hf.mamba_chunk_size,
        num_q_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, attn_head_dim=head_dim,
        rotary_dim=int(head_dim * rotary_factor), rope_theta=float(rope.get("rope_theta", 1e4)),
        rms_norm_eps=hf.rms_norm_eps, time_step_limit=limit, tie_word_embeddings=bool(hf.tie_word_embeddings),
        max_position_embeddings=hf.max_position_embeddings, intermediate_size=hf.intermediate_size,
    )


def _read_granite_config(path: Path) -> EngineModelConfig:
    """GraniteMoeHybrid through transformers' own config class. Attention layers come from layer_types, the head
    dim from hidden_size // heads; RoPE only when position_embedding_type is "rope", on the fraction of the head that
    rope_parameters.partial_rotary_factor gives (whole by default; transformers itself ignores the factor)."""
    from transformers import GraniteMoeHybridConfig

    hf = GraniteMoeHybridConfig.from_pretrained(str(path))
    raw = json.loads((path / "config.json").read_text())
    head_dim = hf.hidden_size // hf.num_attention_heads
    rope = hf.rope_parameters or {}
    factor = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor) if hf.position_embedding_type == "rope" else 0      # 0: NoPE
    limit = tuple(float(v) for v in (hf.time_step_limit or (0.0, math.inf)))
    return EngineModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        attn_layers=tuple(i for i, t in enumerate(hf.layer_types) if t in ("attention", "full_attention")),
        n_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head, n_groups=hf.mamba_n_groups, d_state=hf.mamba_d_state,
        d_conv=hf.mamba_d_conv, chunk_size=hf.mamba_chunk_size, num_q_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, attn_head_dim=head_dim, rotary_dim=rotary_dim,
        rope_theta=float(rope.get("rope_theta", 1e4)), rms_norm_eps=hf.rms_norm_eps, time_step_limit=limit,
        tie_word_embeddings=bool(hf.tie_word_embeddings), max_position_embeddings=hf.max_position_embeddings,
        family="granitemoehybrid", embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier), attention_scale=float(hf.attention_multiplier),
        logits_scaling=float(hf.logits_scaling), num_experts=int(hf.num_local_experts or 0),
        experts_per_tok=int(hf.num_experts_per_tok or 0), intermediate_size=hf.intermediate_size,
        shared_intermediate_size=hf.shared_intermediate_size,
    )


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise LoadError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for file in files:
        if not file.is_file():
            raise LoadError(f"{file}: listed in the index but missing")
        try:                                  # safetensors' errors do not name the file
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise LoadError(f"{file}: cannot read it as safetensors (truncated or corrupt?): {err}") from err
    return tensors


def load(path: str | Path) -> tuple[EngineModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if not path.is_dir():
        raise LoadError(f"{path}: checkpoint directory does not exist")
    cfg = read_config(path)
    tensors = read_tensors(path)
    if cfg.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    HP = cfg.n_heads * cfg.head_dim
    need = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "lm_head.weight": None,
            cfg.final_norm_key: (cfg.hidden_size,)}
    D, I, S, E = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size, cfg.num_experts
    for i in range(cfg.num_layers) if cfg.granite else ():
        p = f"model.layers.{i}."
        need[p + "shared_mlp.input_linear.weight"] = (2 * S, D)
        need[p + "shared_mlp.output_linear.weight"] = (D, S)
        if E:
            need[p + "block_sparse_moe.router.layer.weight"] = (E, D)
            need[p + "block_sparse_moe.input_linear.weight"] = (E, 2 * I, D)
            need[p + "block_sparse_moe.output_linear.weight"] = (E, D, I)
    for i in cfg.mamba_layers:
        need[f"model.layers.{i}.mamba.in_proj.weight"] = (HP + cfg.conv_dim + cfg.n_heads, cfg.hidden_size)
        need[f"model.layers.{i}.mamba.conv1d.weight"] = (cfg.conv_dim, 1, cfg.d_conv)
        need[f"model.layers.{i}.mamba.out_proj.weight"] = (cfg.hidden_size, HP)
        need[f"model.layers.{i}.mamba.norm.weight"] = (HP,)
        for name in ("A_log", "D", "dt_bias"):
            need[f"model.layers.{i}.mamba.{name}"] = (cfg.n_heads,)
    for i in cfg.attn_layers:
        need[f"model.layers.{i}.self_attn.q_proj.weight"] = (cfg.num_q_heads * cfg.attn_head_dim, cfg.hidden_size)
        need[f"model.layers.{i}.self_attn.k_proj.weight"] = (cfg.num_kv_heads * cfg.attn_head_dim, cfg.hidden_size)
    for key, shape in need.items():
        if tensors.get(key) is None:
            raise LoadError(f"{key}: missing from the checkpoint")
        if shape is not None and tuple(tensors[key].shape) != shape:
            raise LoadError(f"{key}: expected shape {shape}, got {tuple(tensors[key].shape)}")
    return cfg, tensors
