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


def _check_tied_head(head: torch.Tensor, embed: torch.Tensor | None) -> None:
    # Some writers store the tied head anyway; accept it only if it really is the embedding.
    if embed is not None and (head.shape != embed.shape or not torch.equal(head, embed)):
        raise CheckpointError("lm_head.weight: tie_word_embeddings is true but lm_head.weight differs from "
                              "model.embed_tokens.weight")


def _check_names(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> None:
    """The stored names, shapes and dtypes (a torch or safetensors dtype name) against what the config expects."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(shapes))
    if missing:
        first = missing[0]
        raise CheckpointError(f"{first}: missing from the checkpoint (expected shape {expected[first]}); "
                              f"{len(missing)} missing in all: {missing[:8]}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise CheckpointError(f"{unexpected[0]}: unexpected tensor, the config has no such parameter; "
                              f"{len(unexpected)} unexpected in all: {unexpected[:8]}")
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise CheckpointError(f"{key}: expected shape {shape}, got {tuple(shapes[key])}")
        if not _floating(dtypes[key]):
            raise CheckpointError(f"{key}: expected a floating-point tensor, got {dtypes[key]}")


def _floating(dtype: str) -> bool:
    """torch.float32 / torch.bfloat16 (a tensor's) or F32 / BF16 / F8_E4M3 (a safetensors header's)."""
    name = dtype.removeprefix("torch.")
    return name.startswith(("float", "bfloat", "F", "BF"))


def check_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check names and shapes against the config; resolve tied embeddings. Returns the tensors the model reads."""
    tensors = dict(tensors)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        _check_tied_head(tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight"))
    _check_names(cfg, {k: tuple(t.shape) for k, t in tensors.items()}, {k: str(t.dtype) for k, t in tensors.items()})
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


class LazyWeights:
    """A checkpoint's tensors read one at a time from its safetensors files (memory-mapped), for the layer-streamed
    oracle: the names, shapes and dtypes are checked against the config from the files' headers when it opens, as
    check_weights checks loaded tensors, and no tensor is read until `load` asks for it."""

    def __init__(self, path: str | Path, cfg: ModelConfig, *, host_copies: bool = False) -> None:
        """host_copies: keep each tensor, once read, in host memory (page-locked where CUDA is available) and hand
        that copy out again, at the cost of host memory as large as the checkpoint. Read from the memory-mapped
        files, a streamed pass over bamba9b-32layer's 32 layers took about 3 s on an H100 (19.6 GB of bf16: about
        6.5 GB/s, the speed of a copy from pageable memory; a 128-token decode makes 128 passes); from page-locked
        copies the host-to-device copy can run at the link's speed (docs/scale.md says what was measured). The
        bytes are the file's either way."""
        self.path, self.cfg = Path(path), cfg
        self.host_copies = host_copies
        self._copies: dict[str, torch.Tensor] = {}
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        self._file: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        for file in _safetensors_files(self.path):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():
                        if key in self._file:
                            raise CheckpointError(f"{key}: stored twice (again in {file.name})")
                        part = handle.get_slice(key)
                        self._file[key], shapes[key], dtypes[key] = file, tuple(part.get_shape()), part.get_dtype()
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{file}: cannot read it as safetensors (truncated or corrupt?): {err}") from err
        if cfg.tie_word_embeddings and "lm_head.weight" in shapes:
            embed = self._read("model.embed_tokens.weight") if "model.embed_tokens.weight" in shapes else None
            _check_tied_head(self._read("lm_head.weight"), embed)
            for table in (self._file, shapes, dtypes):
                del table["lm_head.weight"]
        _check_names(cfg, shapes, dtypes)
        self.shapes = dict(shapes)
        self._stored = dict(dtypes)
        if cfg.tie_word_embeddings:
            self._file["lm_head.weight"] = self._file["model.embed_tokens.weight"]
            self.shapes["lm_head.weight"] = self.shapes["model.embed_tokens.weight"]

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def keys(self):
        return self.shapes.keys()

    def _read(self, key: str) -> torch.Tensor:
        try:
            with safe_open(str(self._file[key]), framework="pt") as handle:
                return handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{self._file[key]}: cannot read {key} (truncated or corrupt?): {err}") from err

    def load(self, key: str) -> torch.Tensor:
        """The tensor as stored (the tied head: the embedding)."""
        if key not in self.shapes:
            raise KeyError(f"{key}: not a tensor of this model")
        stored = "model.embed_tokens.weight" if key == "lm_head.weight" and self.cfg.tie_word_embeddings else key
        if not self.host_copies:
            return self._read(stored)
        if stored not in self._copies:
            tensor = self._read(stored)
            self._copies[stored] = tensor.pin_memory() if torch.cuda.is_available() else tensor
        return self._copies[stored]

    @property
    def stored_bytes(self) -> int:
        """The bytes of every distinct stored tensor (what host_copies holds once every tensor was read)."""
        return sum(math.prod(self.shapes[k]) * _ITEMSIZE.get(self._stored[k], 8) for k in self._stored)

    @property
    def host_copy_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())


# safetensors' dtype names -> bytes per element (the ones a checkpoint of this model may hold)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights (as stored) of a checkpoint directory."""
    cfg = ModelConfig.from_json(Path(path) / "config.json")
    return cfg, check_weights(cfg, read_safetensors(path))
