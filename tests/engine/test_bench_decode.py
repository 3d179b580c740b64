"""bench/decode.py's random Bamba-9B slice loads in the engine (at small widths here: the GPU runs the real ones)."""

from __future__ import annotations

import math

import torch

from bench.decode import BAMBA_9B_SLICE, anchor_markdown, copy_rate, markdown, weight_bytes_per_step, write_random_slice
from vendored.engine.weights import load


def test_random_slice_has_every_tensor_the_engine_checks(tmp_path):
    small = {**BAMBA_9B_SLICE, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_attention_heads": 4,
             "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8,
             "mamba_chunk_size": 16}
    cfg, tensors = load(write_random_slice(tmp_path / "slice", small, device="cpu"))
    assert (cfg.hidden_size, cfg.n_heads, cfg.head_dim, cfg.attn_layers) == (64, 8, 16, (1,))
    assert tensors["model.layers.0.mamba.in_proj.weight"].shape == (8 * 16 + (8 * 16 + 2 * 8) + 8, 64)


def test_markdown_gives_the_graph_speedup_against_the_same_batch():
    rows = [dict(model="m", batch=8, cuda_graphs=False, captured=False, engine_tokens_per_s=100.0,
                 forward_tokens_per_s=200.0, forward_ms=4.0),
            dict(model="m", batch=8, cuda_graphs=True, captured=True, engine_tokens_per_s=150.0,
                 forward_tokens_per_s=800.0, forward_ms=1.0)]
    assert markdown(rows).splitlines()[-1] == "| m | 8 | on | 150 | 800 | 1.000 | 4.00× |  |  |"
    rows[1].update(bound_ms=0.5, forward_of_bound=0.5)
    assert markdown(rows).splitlines()[-1] == "| m | 8 | on | 150 | 800 | 1.000 | 4.00× | 0.500 | 50% |"


def test_the_bound_counts_every_weight_once_and_the_embedding_by_rows(tmp_path):
    small = {**BAMBA_9B_SLICE, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_attention_heads": 4,
             "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8,
             "mamba_chunk_size": 16}
    path = write_random_slice(tmp_path / "slice", small, device="cpu")
    cfg, tensors = load(path)
    everything = sum(t.numel() for t in tensors.values())
    embed = tensors["model.embed_tokens.weight"].numel()
    assert weight_bytes_per_step(path, torch.bfloat16, 3) == 2 * (everything - embed + 3 * 64)
    assert weight_bytes_per_step(path, torch.float32, 3) == 4 * (everything - embed + 3 * 64)
    rate = copy_rate(torch.device("cpu"), n_bytes=1 << 20, repeats=3)
    assert math.isfinite(rate) and rate > 1e8


def test_the_transformers_anchor_is_set_beside_the_engines_best():
    rows = [dict(model="m", batch=8, engine_tokens_per_s=100.0), dict(model="m", batch=8, engine_tokens_per_s=300.0)]
    anchors = [dict(model="m", batch=8, hf_tokens_per_s=20.0), dict(model="m", batch=64, hf_error="out of memory: x")]
    lines = anchor_markdown(rows, anchors).splitlines()
    assert lines[2] == "| m | 8 | 20 | 300 | 15× |"
    assert lines[3] == "| m | 64 | out of memory: x |  |  |"
