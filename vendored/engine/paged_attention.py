"""Decode attention over the paged K/V cache with shapes fixed by the batch size and the block-table width only.

The eager step attends over each sequence's context padded to the longest context of the step, so its shapes change
from step to step. A CUDA graph replays fixed shapes: here every row attends over the full width of its block table
(max_model_len keys, rounded up to whole blocks) and a mask keeps the keys past the row's context out. The work is
proportional to max_model_len rather than to the context, the price of one graph for every context length.

Capture-safe: no host synchronisation, no data-dependent shape, the same allocations on every call.
"""

from __future__ import annotations

import torch


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *, block_size: int, scale: float) -> torch.Tensor:
    """One query per row, attending over that row's cached context (the query's own key included).

    q (B, Hq, Dh), the query at position context_lens[b]-1; k_cache, v_cache (num_blocks·block_size, Hkv, Dh), the
    flat paged cache, keys after RoPE; block_tables (B, M) int, row b's blocks in order (entries past its context may
    name any block: they are masked); context_lens (B,) int, 0 for a padding row. Query head h reads kv head
    h // (Hq/Hkv). Whatever the cache holds past a row's context (stale values, NaN) never reaches the output, and a
    padding row outputs zeros. Returns (B, Hq, Dh) in q's dtype; scores and softmax in at least fp32.
    """
    n_rows, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[1]
    width = block_tables.shape[1] * block_size                                          # L
    offsets = torch.arange(block_size, device=q.device)
    flat = (block_tables.long()[:, :, None] * block_size + offsets).reshape(n_rows, width)   # (B, L)
    key_pos = torch.arange(width, device=q.device)
    valid = key_pos[None, :] < context_lens[:, None]                                    # (B, L)
    # Zero what lies past a context: a masked score still multiplies its value, and 0·NaN is NaN.
    keys = k_cache[flat].masked_fill(~valid[:, :, None, None], 0.0)                     # (B, L, Hkv, Dh)
    values = v_cache[flat].masked_fill(~valid[:, :, None, None], 0.0)
    grouped = q.reshape(n_rows, n_kv_heads, n_q_heads // n_kv_heads, head_dim)          # (B, Hkv, Hq/Hkv, Dh)
    scores = torch.einsum("bkgd,blkd->bkgl", grouped, keys)                             # (B, Hkv, Hq/Hkv, L)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    # Key 0 always counts (it is zeroed for a padding row): no row is all -inf, so no NaN is ever made.
    allowed = valid | (key_pos == 0)[None, :]                                           # (B, L)
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)                                # (B, Hkv, Hq/Hkv, Dh)
    return out.reshape(n_rows, n_q_heads, head_dim)
