"""Which weights each rank of a tensor-/pipeline-parallel engine holds, and the slicing that gives them to it.

Tensor parallelism over `size` ranks (rank r of size):
- mamba heads: rank r holds the contiguous heads [r·H/size, (r+1)·H/size) with their z, x and dt rows of in_proj,
  their A_log, D, dt_bias, gated-norm weights and out_proj columns (out_proj is row-parallel: partial products are
  summed across ranks).
- B/C groups: head h reads group h // (H/G). A rank holds the groups its heads read. When size divides G these are
  G/size whole groups (sharded); otherwise one group is read by heads of several ranks and each of them holds a copy
  (replicated), which covers size > G. When a rank's heads read their groups unevenly (e.g. H = 6, G = 3, size = 2:
  rank 0's heads read groups 0, 0, 1) the rank holds one copy of the group per head, so that the kernels' interleaved
  head → group rule holds for the local heads.
- the conv weight and bias are sliced like x | B | C, the channels the rank holds.
- gated RMSNorm: its groups are the B/C groups (H·P/G channels each). A rank that holds whole groups normalises
  alone; when a group spans ranks its sum of squares is added across ranks before the norm.
- attention: the query heads are sharded; the K/V heads are sharded when size divides Hkv, and when size is a
  multiple of Hkv every rank holds the one K/V head its query heads read (replicated); o_proj is row-parallel.
- MLP: gate_proj and up_proj column-parallel, down_proj row-parallel.
- embeddings, final norm and lm_head are replicated (the ranks of the first stage embed, rank 0 of the last stage
  computes the logits).

Pipeline parallelism splits the layers into `pp` contiguous stages (the first stages take one more layer when pp does
not divide the layer count); a stage holds the weights, states and K/V of its layers only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .weights import EngineModelConfig


@dataclass(frozen=True)
class RankShard:
    """What tensor-parallel rank `rank` of `size` holds. Ids are global (the checkpoint's numbering)."""

    rank: int
    size: int
    heads: range                     # mamba heads
    bc_groups: tuple[int, ...]       # the B/C group behind each local group, in local order
    norm_groups_whole: bool          # every gated-norm group of the local channels lies on this rank alone
    q_heads: range
    kv_heads: tuple[int, ...]
    ffn: range                       # MLP intermediate channels (Granite: each routed expert's)
    shared_ffn: range = range(0)     # Granite's shared MLP channels


def parallel_problems(cfg: EngineModelConfig, intermediate_size: int, tp: int, pp: int) -> list[str]:
    """Why the model cannot be split over tp × pp ranks ([] when it can)."""
    problems = []
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name}: expected a positive integer, got {value!r}")
    if problems:
        return problems
    if cfg.n_heads % tp:
        problems.append(f"mamba_n_heads = {cfg.n_heads} is not divisible by tensor_parallel_size = {tp}")
    if intermediate_size % tp:
        problems.append(f"intermediate_size = {intermediate_size} is not divisible by tensor_parallel_size = {tp}")
    if cfg.granite and cfg.shared_intermediate_size % tp:
        problems.append(f"shared_intermediate_size = {cfg.shared_intermediate_size} is not divisible by "
                        f"tensor_parallel_size = {tp}")
    if cfg.attn_layers:
        if cfg.num_q_heads % tp:
            problems.append(f"num_attention_heads = {cfg.num_q_heads} is not divisible by tensor_parallel_size = {tp}")
        elif cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            problems.append(f"num_key_value_heads = {cfg.num_kv_heads}: tensor_parallel_size = {tp} neither divides "
                            "it nor is a multiple of it")
    if pp > cfg.num_layers:
        problems.append(f"pipeline_parallel_size = {pp} exceeds num_hidden_layers = {cfg.num_layers} (every stage "
                        "needs a layer)")
    return problems


def plan_shard(cfg: EngineModelConfig, intermediate_size: int, size: int, rank: int) -> RankShard:
    """The part of every layer that tensor-parallel rank `rank` of `size` holds (see the module docstring)."""
    problems = parallel_problems(cfg, intermediate_size, size, 1)
    if problems:
        raise ValueError("; ".join(problems))
    per_rank = cfg.n_heads // size
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    heads_per_group = cfg.n_heads // cfg.n_groups
    head_groups = [h // heads_per_group for h in heads]
    groups = sorted(set(head_groups))
    counts = {head_groups.count(g) for g in groups}
    bc_groups = tuple(groups) if len(counts) == 1 else tuple(head_groups)
    norm_whole = counts == {heads_per_group}
    q_per_rank = cfg.num_q_heads // size
    q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
    if cfg.num_kv_heads % size == 0:
        kv_per_rank = cfg.num_kv_heads // size
        kv_heads = tuple(range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    else:                                             # size is a multiple of Hkv: one K/V head, replicated
        kv_heads = (q_heads.start // (cfg.num_q_heads // cfg.num_kv_heads),)
    ffn_per_rank, shared_per_rank = intermediate_size // size, cfg.shared_intermediate_size // size
    return RankShard(rank, size, heads, bc_groups, norm_whole, q_heads, kv_heads,
                     range(rank * ffn_per_rank, (rank + 1) * ffn_per_rank),
                     range(rank * shared_per_rank, (rank + 1) * shared_per_rank))


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The contiguous layers of pipeline stage `stage` of `pp`; the first num_layers % pp stages get one more."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def local_config(cfg: EngineModelConfig, shard: RankShard) -> EngineModelConfig:
    """The sizes as the rank's kernels and caches see them (local heads and groups)."""
    return replace(cfg, n_heads=len(shard.heads), n_groups=len(shard.bc_groups), num_q_heads=len(shard.q_heads),
                   num_kv_heads=len(shard.kv_heads))


def _blocks(ids, width: int, offset: int = 0) -> list[int]:
    """Indices of blocks `ids` of `width` consecutive rows each, shifted by `offset`."""
    return [offset + i * width + j for i in ids for j in range(width)]


def _slices(cfg: EngineModelConfig, shard: RankShard) -> dict[str, dict[str, tuple[int, list[int]] | None]]:
    """For each mixer kind and for every layer (MLP, norms): parameter suffix -> (dim, indices) of the rank's
    slice, or None (held whole)."""
    H, P, G, N = cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
    HP, GN, Dh = H * P, G * N, cfg.attn_head_dim
    x_rows = _blocks(shard.heads, P)                                     # the rank's channels of z, x, y
    bc_rows = _blocks(shard.bc_groups, N)                                # the rank's channels of B (and of C)
    # in_proj rows: [z (HP) | x (HP) | B (GN) | C (GN) | dt (H)]; conv channels: [x | B | C].
    in_rows = (x_rows + [HP + r for r in x_rows] + [2 * HP + r for r in bc_rows] + [2 * HP + GN + r for r in bc_rows]
               + [2 * HP + 2 * GN + h for h in shard.heads])
    conv_rows = x_rows + [HP + r for r in bc_rows] + [HP + GN + r for r in bc_rows]
    q_rows, kv_rows, ffn = _blocks(shard.q_heads, Dh), _blocks(shard.kv_heads, Dh), list(shard.ffn)
    # Granite stacks gate rows over up rows: the rank takes its channels of each half. Experts are split by their
    # channels like the MLP (every rank holds every expert, a slice of each); the router is held whole.
    S, I = cfg.shared_intermediate_size, cfg.intermediate_size
    shared = list(shard.shared_ffn)
    granite = {"shared_mlp.input_linear.weight": (0, shared + [S + c for c in shared]),
               "shared_mlp.output_linear.weight": (1, shared),
               "block_sparse_moe.input_linear.weight": (1, ffn + [I + c for c in ffn]),
               "block_sparse_moe.output_linear.weight": (2, ffn),
               "block_sparse_moe.router.layer.weight": None, "post_attention_layernorm.weight": None}
    # A row-parallel layer's bias is added once, after the partial products are summed: it stays whole (None).
    return {
        "mamba": {"mamba.in_proj.weight": (0, in_rows), "mamba.in_proj.bias": (0, in_rows),
                  "mamba.conv1d.weight": (0, conv_rows), "mamba.conv1d.bias": (0, conv_rows),
                  "mamba.A_log": (0, list(shard.heads)), "mamba.D": (0, list(shard.heads)),
                  "mamba.dt_bias": (0, list(shard.heads)), "mamba.norm.weight": (0, x_rows),
                  "mamba.out_proj.weight": (1, x_rows), "mamba.out_proj.bias": None},
        "attention": {"self_attn.q_proj.weight": (0, q_rows), "self_attn.q_proj.bias": (0, q_rows),
                      "self_attn.k_proj.weight": (0, kv_rows), "self_attn.k_proj.bias": (0, kv_rows),
                      "self_attn.v_proj.weight": (0, kv_rows), "self_attn.v_proj.bias": (0, kv_rows),
                      "self_attn.o_proj.weight": (1, q_rows), "self_attn.o_proj.bias": None},
        "every layer": {"feed_forward.gate_proj.weight": (0, ffn), "feed_forward.gate_proj.bias": (0, ffn),
                "feed_forward.up_proj.weight": (0, ffn), "feed_forward.up_proj.bias": (0, ffn),
                "feed_forward.down_proj.weight": (1, ffn), "feed_forward.down_proj.bias": None,
                "input_layernorm.weight": None, "pre_ff_layernorm.weight": None,
                **(granite if cfg.granite else {})},
    }


def shard_tensors(cfg: EngineModelConfig, get: Callable[[str], torch.Tensor | None], shard: RankShard,
                  layers: range) -> dict[str, torch.Tensor]:
    """The rank's slices of the checkpoint tensors of `layers`, plus the embeddings (first stage) and the final norm
    and lm_head (last stage). get(key) returns a checkpoint tensor, or None where the checkpoint has none (biases)."""
    slices = _slices(cfg, shard)
    out: dict[str, torch.Tensor] = {}
    for i in layers:
        mixer = "attention" if i in cfg.attn_layers else "mamba"
        for suffix, spec in {**slices[mixer], **slices["every layer"]}.items():
            key = f"model.layers.{i}.{suffix}"
            tensor = get(key)
            if tensor is None:
                continue
            out[key] = tensor if spec is None else tensor.index_select(spec[0], torch.tensor(spec[1]))
    if layers.start == 0:
        out["model.embed_tokens.weight"] = get("model.embed_tokens.weight")
    if layers.stop == cfg.num_layers:
        out[cfg.final_norm_key] = get(cfg.final_norm_key)
        out["lm_head.weight"] = get("lm_head.weight")
    return out
