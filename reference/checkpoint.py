"""Load a Hugging Face Bamba checkpoint (single-file or sharded safetensors) and check it tensor by tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match what the config says the model has."""


def key_names(cfg: ModelConfig) -> dict[str, str]:
    """The two norms whose Hugging Face names differ between the families (everything else is named alike)."""
    if cfg.granite:
        return {"final_norm": "model.norm.weight", "ffn_norm": "post_attention_layernorm.weight"}
    return {"final_norm": "model.final_layernorm.weight", "ffn_norm": "pre_ff_layernorm.weight"}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, by its Hugging Face key, with its shape."""
    D, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    H, HP, C, W = cfg.mamba_n_heads, cfg.mamba_inner, cfg.conv_dim, cfg.mamba_d_conv
    Dh, Hq, Hkv = cfg.attn_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    names = key_names(cfg)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), names["final_norm"]: (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + names["ffn_norm"]] = (D,)
        if cfg.granite:
            S, E = cfg.shared_intermediate_size, cfg.num_local_experts
            shapes[p + "shared_mlp.input_linear.weight"] = (2 * S, D)            # gate rows, then up rows
            shapes[p + "shared_mlp.output_linear.weight"] = (D, S)
            if E:
                shapes[p + "block_sparse_moe.router.layer.weight"] = (E, D)
                shapes[p + "block_sparse_moe.input_linear.weight"] = (E, 2 * I, D)
                shapes[p + "block_sparse_moe.output_linear.weight"] = (E, D, I)
        else:
            for name, (out_f, in_f) in {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}.items():
                shapes[p + f"feed_forward.{name}.weight"] = (out_f, in_f)
                if cfg.mlp_bias:
                    shapes[p + f"feed_forward.{name}.bias"] = (out_f,)
        if kind == "mamba":
            m = p + "mamba."
            shapes[m + "in_proj.weight"] = (cfg.in_proj_dim, D)
            shapes[m + "conv1d.weight"] = (C, 1, W)
            shapes[m + "dt_bias"] = (H,)
            shapes[m + "A_log"] = (H,)
            shapes[m + "D"] = (H,)
            shapes[m + "norm.weight"] = (HP,)
            shapes[m + "out_proj.weight"] = (D, HP)
            if cfg.mamba_conv_bias:
                shapes[m + "conv1d.bias"] = (C,)
            if cfg.mamba_proj_bias:
                shapes[m + "in_proj.bias"] = (cfg.in_proj_dim,)
                shapes[m + "out_proj.bias"] = (D,)
        else:
            a = p + "self_attn."
            for name, out_f in {"q_proj": Hq * Dh, "k_proj": Hkv * Dh, "v_proj": Hkv * Dh}.items():
                shapes[a + f"{name}.weight"] = (out_f, D)
                if cfg.attention_bias:
                    shapes[a + f"{name}.bias"] = (out_f,)
            shapes[a + "o_proj.weight"] = (D, Hq * Dh)
            if cfg.attention_bias:
                shapes[a + "o_proj.bias"] = (D,)
    return shapes


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' in the index")
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files listed but absent: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def parameter_count(path: str | Path) -> int:
    """How many numbers a checkpoint directory stores, from its safetensors headers (no tensor is read)."""
    total = 0
    for file in _safetensors_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    total += math.prod(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read it as safetensors (truncated or corrupt?): {err}") from err
    return total


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory as stored (dtype unchanged), single-file or sharded."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        # safetensors' own errors ("incomplete metadata, file not fully covered") do not say which file: with
        # several shards, a truncated download would be left to guess.
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    if key in tensors:
                        raise CheckpointError(f"{key}: stored twice (again in {file.name})")
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read it as safetensors (truncated or corrupt?): {err}") from err
    return tensors


def check_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check names and shapes against the config; resolve tied embeddings. Returns the tensors the model reads."""
    expected = expected_shapes(cfg)
    tensors = dict(tensors)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some writers store the tied head anyway; accept it only if it really is the embedding.
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None and (head.shape != embed.shape or not torch.equal(head, embed)):
            raise CheckpointError("lm_head.weight: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        first = missing[0]
        raise CheckpointError(f"{first}: missing from the checkpoint (expected shape {expected[first]}); "
                              f"{len(missing)} missing in all: {missing[:8]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{unexpected[0]}: unexpected tensor, the config has no such parameter; "
                              f"{len(unexpected)} unexpected in all: {unexpected[:8]}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise CheckpointError(f"{key}: expected shape {shape}, got {tuple(tensors[key].shape)}")
        if not tensors[key].is_floating_point():
            raise CheckpointError(f"{key}: expected a floating-point tensor, got {tensors[key].dtype}")
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights (as stored) of a checkpoint directory."""
    cfg = ModelConfig.from_json(Path(path) / "config.json")
    return cfg, check_weights(cfg, read_safetensors(path))
