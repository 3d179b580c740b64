"""Top-k with a defined tie rule (among equal values the lower index ranks first), and the engine's logprobs.

`torch.topk` leaves the order of equal values unspecified, and on CUDA which of several tied values makes the cut
at the k-th place can change from run to run. Ties are common where it matters: bf16 logits of a 128K vocabulary
hold many equal values, and a greedy choice or a returned top-k set that depends on the run makes two runs of the
same engine differ (and a router that picks experts so makes the engine disagree with the oracle's rule).

Logprobs: every logprob the engine returns (a choice's, a row's top k, a prompt token's, a kept row) is
log_softmax_at(logit, norm) = (logit - c) - log Σ exp(row - c) with the row's norm (c, log Σ) from log_softmax_norm or
ranked_log_softmax, one function per row whatever path asked, so every path gives the same bits for the same row. On
a GPU (and the CPU under the interpreter) a wide row's norm comes from row_top_k's own read of the row (no separate
log-softmax pass over a 128K vocabulary: 30 µs a step at batch 1 on an H200, 131 µs at 256); the choices are ranked by
logit, which is the order of the logprobs (log_softmax is increasing) with ties decided on the exact values.
"""

from __future__ import annotations

import torch

from vendored.ops._rounding import interpreted
from vendored.ops.row_top_k import MAX_K as KERNEL_MAX_K
from vendored.ops.row_top_k import row_top_k, row_top_k_and_norm

SORT_WIDTH = 1024    # rows at most this wide are ranked with one stable sort (router logits: no host sync, graph-safe)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x (..., V), largest first, ties by lower index.

    Rows up to SORT_WIDTH wide: a stable descending sort. Wider rows of a 16- or 32-bit float dtype: for k up to
    KERNEL_MAX_K the Triton kernel vendored/ops/row_top_k.py (one read of each row: at 256 rows of 128256, k = 8,
    on an H200, ~0.1 ms where the torch keys below took 1.6 ms), else one torch.topk over exact int64 keys (_keys:
    the value's order in the high bits, the reversed index in the low ones); both rank by the same keys, so the
    order is the rule's by construction. Neither synchronises with the host, so both are safe inside a captured
    graph and leave the host free while the device ranks. Wider float64 rows: torch.topk for k + 1, the k kept
    re-ordered by (value, index), and rows whose k-th and (k+1)-th values tie ranked again exactly (one host
    synchronisation).
    """
    width = x.shape[-1]
    if not 0 <= k <= width:
        raise ValueError(f"top_k: k={k} for rows of width {width}")
    if width <= SORT_WIDTH or k == width:
        ranked = torch.sort(x, dim=-1, descending=True, stable=True)
        return ranked.values[..., :k], ranked.indices[..., :k]
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16) and width < 1 << INDEX_BITS:
        if 0 < k <= KERNEL_MAX_K and (x.is_cuda or (x.device.type == "cpu" and interpreted())):
            indices = row_top_k(x.reshape(-1, width), k).reshape(*x.shape[:-1], k)
        else:
            indices = torch.topk(_keys(x), k, dim=-1).indices
        return x.gather(-1, indices), indices
    flat = x.reshape(-1, width)
    values, indices = torch.topk(flat, k + 1, dim=-1)
    boundary_tie = values[:, k - 1] == values[:, k] if k > 0 else torch.zeros_like(values[:, 0], dtype=torch.bool)
    values, indices = _by_value_then_index(values[:, :k], indices[:, :k])
    rows = boundary_tie.nonzero()[:, 0]
    if rows.numel():
        ranked = torch.sort(flat[rows], dim=-1, descending=True, stable=True)
        values[rows], indices[rows] = ranked.values[:, :k], ranked.indices[:, :k]
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


INDEX_BITS = 24      # the keys' low bits: rows up to 2^24 entries wide


def ranked_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, indices, norm) of each row of logits (n, V): the k largest logits by top_k's rule (largest first,
    ties by the lower index), their logprobs log_softmax_at(logits at indices, norm), and the rows' norm (n, 2)
    (log_softmax_norm). Rows the Triton kernel ranks (_kernel_norm) get indices and norm from one launch."""
    if _kernel_norm(logits) and 0 < k <= KERNEL_MAX_K:
        indices, norm = row_top_k_and_norm(logits, k)
    else:
        indices, norm = top_k(logits, k)[1], log_softmax_norm(logits)
    return log_softmax_at(logits.gather(-1, indices), norm), indices, norm


def log_softmax_norm(logits: torch.Tensor) -> torch.Tensor:
    """(n, 2) per row of logits (n, V): the shift c (the row's largest non-NaN value; 0 where that is ±inf or there
    is none) and log Σ exp(logits - c) (NaN if the row holds a NaN, +inf if +inf, -inf for a row of -inf); float32
    for 16- and 32-bit logits, float64 for float64. From the Triton kernel where it ranks the row (_kernel_norm),
    else from torch; the value of a row does not depend on the other rows."""
    if _kernel_norm(logits):
        return row_top_k_and_norm(logits, 0)[1]
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    top = x.masked_fill(torch.isnan(x), float("-inf")).amax(dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.cat([shift, _row_sums(torch.exp(x - shift)).log()], dim=-1)


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """(n, 1) sums of the rows of x (n, V) in one fixed pairwise tree (the row zero-padded to a power of two, then
    halves added element-wise until one column is left): a row's sum is the same bits whatever the other rows, the
    batch size and the device. torch's own sum chooses its reduction's layout from the whole tensor's shape (on
    CUDA the tiny model's decode steps replayed as graphs, padded to their captured sizes, gave norms one fp32 ulp
    from the eager steps' on an H100, 2026-12-06), and max needs no such care (it is exact in any order)."""
    width = x.shape[-1]
    if width == 0:
        return x.new_zeros(*x.shape[:-1], 1)
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], padded - width)], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def log_softmax_at(x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """The logprobs of logits x (n, j) (entries of rows whose norms are norm (n, 2)): (x - c) - log Σ, in norm's
    dtype. The one expression of every logprob the engine returns."""
    return (x.to(norm.dtype) - norm[:, :1]) - norm[:, 1:]


def _kernel_norm(x: torch.Tensor) -> bool:
    """Whether rows of x are ranked and normed by the Triton kernel: 2-D rows wider than SORT_WIDTH of a 16- or
    32-bit float dtype, on a GPU or the CPU under the interpreter. Depends on the dtype, width and device only,
    so one row's norm is the same whichever path asks."""
    return (x.dim() == 2 and SORT_WIDTH < x.shape[-1] < 1 << INDEX_BITS
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (x.is_cuda or (x.device.type == "cpu" and interpreted())))


def _keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of x's entries (a float dtype of at most 32 bits) whose descending order is (value descending,
    index ascending): the float32 bits made monotonic (negative values have their 31 low bits flipped, so a larger
    magnitude ranks lower; -0.0 is made +0.0 first, as the two compare equal) times 2^INDEX_BITS, plus
    2^INDEX_BITS - 1 - index. Every NaN ranks above +inf, as in torch.sort's descending order."""
    x = x.float()
    bits = (x + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, torch.bitwise_xor(bits, 0x7FFFFFFF), bits)
    ordered = torch.where(torch.isnan(x), 0x7FFFFFFF, ordered).long()      # any NaN, whatever its sign bit
    reversed_index = (1 << INDEX_BITS) - 1 - torch.arange(x.shape[-1], device=x.device)
    return ordered * (1 << INDEX_BITS) + reversed_index


def _by_value_then_index(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-order each row's k pairs: value descending, then index ascending (two stable sorts, the last key first)."""
    order = torch.sort(indices, dim=-1, stable=True).indices
    values, indices = values.gather(-1, order), indices.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), indices.gather(-1, order)
