"""Attention over the paged K/V cache: the eager step's masked attention, and the decode attention of a CUDA graph.

`masked_attention` is the eager step's call: every sequence's context padded to the longest, a boolean mask. On a GPU
it runs on the memory-efficient backend (the keys and values repeated per query head), never cuDNN's. On an H200
with torch 2.11, where cuDNN is the default for a bf16 masked call, runs sharing the GPU with other processes gave
bf16 outputs that differed between runs and between processes, and bench/reproducibility.py --trace named this call
as the first to differ; the memory-efficient backend gave the same bits in every check (docs/engine.md, "Reproducible
on the GPU").

`paged_decode_attention` is decode attention with shapes fixed by the batch size and the block-table width only.

The eager step attends over each sequence's context padded to the longest context of the step, so its shapes change
from step to step. A CUDA graph replays fixed shapes. When the model runs its fused ops (on CUDA always, on a CPU
under vendored.engine.model.FUSED_OPS_ON_CPU) the call is the Triton op `vendored.ops.decode_attention`: one or two
launches whose grid depends on the batch, the heads and the table width only, and whose programs read each row's
keys through its block table up to its context only (programs for keys past it exit at once), so the keys read
follow the contexts. Otherwise (a CPU model, fp64) it
is the torch expression below: every row gathers the full width of its block table (max_model_len keys, rounded up
to whole blocks) and a mask keeps the keys past the row's context out, work proportional to max_model_len rather
than to the context, in some 15 launches (docs/decode-bench.md: of the ~70 small kernels of a decode step).

Capture-safe either way: no host synchronisation, no data-dependent shape, the same allocations on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vendored.ops.decode_attention import decode_attention

# Backends the eager attention may use on a GPU, in order: memory-efficient (bf16, fp16, fp32), math (fp64 and
# whatever the first does not take). Both give the same bits from run to run on the same inputs.
REPRODUCIBLE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, *,
                     scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale, masked) · v for padded sequences. q (n, Hq, Tq, Dh); keys, values (n, Hkv, L, Dh) with
    Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)); allowed (n, 1, Tq, L) bool, True where a query
    may see a key (every row needs at least one). Returns (n, Hq, Tq, Dh) in q's dtype."""
    group = q.shape[1] // keys.shape[1]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
    if group > 1:                                  # the memory-efficient kernel takes equal head counts only
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    with sdpa_kernel(REPRODUCIBLE_BACKENDS):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, *, block_size: int, scale: float,
                           fused: bool = False, batch_invariant: bool = False) -> torch.Tensor:
    """One query per row, attending over that row's cached context (the query's own key included).

    q (B, Hq, Dh), the query at position context_lens[b]-1; k_cache, v_cache (num_blocks·block_size, Hkv, Dh), the
    flat paged cache, keys after RoPE; block_tables (B, M) int, row b's blocks in order (entries past its context may
    name any block: they are masked); context_lens (B,) int, 0 for a padding row. Query head h reads kv head
    h // (Hq/Hkv). Whatever the cache holds past a row's context (stale values, NaN) never reaches the output, and a
    padding row outputs zeros. Returns (B, Hq, Dh) in q's dtype; scores and softmax in at least fp32.

    fused: run the Triton op `decode_attention` (fp32/bf16/fp16; q as it comes, a strided view of the merged q/k/v
    output, without a copy): scores, softmax and P·V in fp32, one rounding at the end, and table entries past a
    context never read. Otherwise the torch code: scores and softmax in at least fp32, the probabilities rounded to
    q's dtype before P·V.

    batch_invariant (fused only): one split per row, so that a row's output does not depend on the batch
    (decode_attention's flag).
    """
    if fused:
        return decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size=block_size, scale=scale,
                                batch_invariant=batch_invariant)
    if batch_invariant:
        raise ValueError("batch_invariant: the torch expression reduces over the table's full width; pass fused=True")
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
