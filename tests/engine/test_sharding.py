"""The shard plan of a tensor-/pipeline-parallel engine, without starting any process: which heads, B/C groups,
K/V heads and channels each rank holds, and that the checkpoint slices are exactly those rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vendored.engine.sharding import parallel_problems, plan_shard, shard_tensors, stage_layers
from vendored.engine.weights import EngineModelConfig

CFG = EngineModelConfig(
    vocab_size=11, hidden_size=8, num_layers=2, attn_layers=(1,), n_heads=8, head_dim=2, n_groups=2, d_state=3,
    d_conv=4, chunk_size=8, num_q_heads=4, num_kv_heads=2, attn_head_dim=2, rotary_dim=2, rope_theta=1e4,
    rms_norm_eps=1e-5, time_step_limit=(0.0, float("inf")), tie_word_embeddings=False, max_position_embeddings=64)
FFN = 16


@pytest.mark.parametrize("G,tp,expected", [
    (2, 2, [(0,), (1,)]),                          # sharded: one whole group per rank
    (4, 2, [(0, 1), (2, 3)]),
    (2, 4, [(0,), (0,), (1,), (1,)]),              # tp > G: each group replicated on the two ranks reading it
    (1, 4, [(0,), (0,), (0,), (0,)]),
    (4, 8, [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]),
], ids=["G2-tp2", "G4-tp2", "G2-tp4", "G1-tp4", "G4-tp8"])
def test_each_rank_holds_the_groups_its_heads_read(G, tp, expected):
    cfg = replace(CFG, n_groups=G, attn_layers=())               # attention has its own test
    shards = [plan_shard(cfg, FFN, tp, r) for r in range(tp)]
    assert [s.bc_groups for s in shards] == expected
    assert all(s.norm_groups_whole == (G % tp == 0) for s in shards)
    assert [list(s.heads) for s in shards] == [list(range(r * 8 // tp, (r + 1) * 8 // tp)) for r in range(tp)]


def test_heads_that_read_their_groups_unevenly_get_one_group_copy_each():
    cfg = replace(CFG, n_heads=6, n_groups=3)          # heads 0-2 read groups 0, 0, 1; heads 3-5 read 1, 2, 2
    shards = [plan_shard(cfg, FFN, 2, r) for r in range(2)]
    assert [s.bc_groups for s in shards] == [(0, 0, 1), (1, 2, 2)]
    assert not any(s.norm_groups_whole for s in shards)


@pytest.mark.parametrize("tp,expected", [(2, [(0,), (1,)]), (4, [(0,), (0,), (1,), (1,)])])
def test_kv_heads_are_sharded_or_replicated(tp, expected):
    shards = [plan_shard(CFG, FFN, tp, r) for r in range(tp)]
    assert [s.kv_heads for s in shards] == expected
    assert [list(s.q_heads) for s in shards] == [list(range(r * 4 // tp, (r + 1) * 4 // tp)) for r in range(tp)]


def _numbered(shape) -> torch.Tensor:
    """A tensor whose rows carry their own index (dim 0) so a slice shows which rows it took."""
    rows = torch.arange(shape[0], dtype=torch.float32).reshape(-1, *([1] * (len(shape) - 1)))
    return rows.expand(shape).clone()


def test_slices_take_the_rows_of_the_ranks_heads_and_groups():
    cfg = replace(CFG, n_groups=4)                                   # 8 heads, P = 2, G = 4, N = 3
    H, P, G, N = 8, 2, 4, 3
    HP, GN = H * P, G * N
    ckpt = {"model.layers.0.mamba.in_proj.weight": _numbered((2 * HP + 2 * GN + H, 8)),
            "model.layers.0.mamba.conv1d.weight": _numbered((HP + 2 * GN, 1, 4)),
            "model.layers.0.mamba.out_proj.weight": _numbered((HP, 8)).T.contiguous(),   # columns numbered
            "model.layers.0.mamba.A_log": torch.arange(H, dtype=torch.float32)}
    shard = plan_shard(cfg, FFN, 2, 1)                               # heads 4-7, groups 2-3
    got = shard_tensors(cfg, ckpt.get, shard, range(0, 1))
    x = list(range(8, 16))                                           # channels of heads 4-7
    bc = list(range(6, 12))                                          # channels of groups 2-3
    assert got["model.layers.0.mamba.in_proj.weight"][:, 0].tolist() == (
        x + [HP + c for c in x] + [2 * HP + c for c in bc] + [2 * HP + GN + c for c in bc]
        + [2 * HP + 2 * GN + h for h in range(4, 8)])
    assert got["model.layers.0.mamba.conv1d.weight"][:, 0, 0].tolist() == x + [HP + c for c in bc] + [
        HP + GN + c for c in bc]
    assert got["model.layers.0.mamba.out_proj.weight"][0].tolist() == x
    assert got["model.layers.0.mamba.A_log"].tolist() == [4, 5, 6, 7]


def test_problems_name_the_size_that_does_not_divide():
    assert parallel_problems(CFG, FFN, 2, 2) == []
    assert parallel_problems(CFG, FFN, 3, 1) == [
        "mamba_n_heads = 8 is not divisible by tensor_parallel_size = 3",
        "intermediate_size = 16 is not divisible by tensor_parallel_size = 3",
        "num_attention_heads = 4 is not divisible by tensor_parallel_size = 3"]
    assert parallel_problems(replace(CFG, num_q_heads=6, num_kv_heads=3, n_heads=6), 6, 2, 1) == [
        "num_key_value_heads = 3: tensor_parallel_size = 2 neither divides it nor is a multiple of it"]
    assert parallel_problems(CFG, 10, 4, 1) == ["intermediate_size = 10 is not divisible by tensor_parallel_size = 4"]
    assert parallel_problems(CFG, FFN, 1, 3) == [
        "pipeline_parallel_size = 3 exceeds num_hidden_layers = 2 (every stage needs a layer)"]
    assert parallel_problems(replace(CFG, attn_layers=()), FFN, 8, 1) == []   # no attention: Hq is not split


@pytest.mark.parametrize("layers,pp,expected", [(6, 2, [(0, 3), (3, 6)]), (3, 2, [(0, 2), (2, 3)]),
                                                 (7, 3, [(0, 3), (3, 5), (5, 7)]), (2, 1, [(0, 2)])])
def test_stages_split_the_layers_contiguously(layers, pp, expected):
    assert [(r.start, r.stop) for r in (stage_layers(layers, pp, s) for s in range(pp))] == expected


def test_granite_slices_split_each_expert_and_the_shared_mlp_by_channel():
    """GraniteMoeHybrid under tp 2: the shared MLP's stacked gate|up rows and every expert's gate|up rows are cut per
    half (the rank's channels of each), the output projections by the same channels, the router and the norms
    whole; a shared width that does not divide is a named problem."""
    E, I, S, D = 3, 6, 4, 8
    cfg = replace(CFG, family="granitemoehybrid", num_experts=E, experts_per_tok=2, intermediate_size=I,
                  shared_intermediate_size=S)
    p = "model.layers.0."
    ckpt = {p + "shared_mlp.input_linear.weight": _numbered((2 * S, D)),
            p + "shared_mlp.output_linear.weight": _numbered((S, D)).T.contiguous(),            # columns numbered
            p + "block_sparse_moe.input_linear.weight": _numbered((2 * I, E, D)).transpose(0, 1).contiguous(),
            p + "block_sparse_moe.output_linear.weight": _numbered((I, E, D)).permute(1, 2, 0).contiguous(),
            p + "block_sparse_moe.router.layer.weight": _numbered((E, D)),
            p + "post_attention_layernorm.weight": torch.ones(D), "model.norm.weight": torch.ones(D)}
    shard = plan_shard(cfg, I, 2, 1)
    got = shard_tensors(cfg, ckpt.get, shard, range(0, 2))
    assert got[p + "shared_mlp.input_linear.weight"][:, 0].tolist() == [2, 3, 6, 7]         # gate 2-3, up 2-3
    assert got[p + "shared_mlp.output_linear.weight"][0].tolist() == [2, 3]
    for e in range(E):
        assert got[p + "block_sparse_moe.input_linear.weight"][e, :, 0].tolist() == [3, 4, 5, 9, 10, 11]
        assert got[p + "block_sparse_moe.output_linear.weight"][e, 0].tolist() == [3, 4, 5]
    router = p + "block_sparse_moe.router.layer.weight"
    assert torch.equal(got[router], ckpt[router])
    assert "model.norm.weight" in got and p + "post_attention_layernorm.weight" in got
    assert parallel_problems(replace(cfg, shared_intermediate_size=5), I, 2, 1) == [
        "shared_intermediate_size = 5 is not divisible by tensor_parallel_size = 2"]
