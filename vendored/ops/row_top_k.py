"""Indices of the k largest entries of each row of a 2-D float tensor, in the engine's ranking order, k <= 16.

Twin of `torch.topk(vendored.engine.ranking._keys(x), k).indices`, element for element: value descending, -0.0 equal
to +0.0, every NaN (whatever its sign bit) above +inf, equal values by the lower index first. Each entry's order is
the int64 key that `_keys` makes, built here in integer arithmetic from the float32 bits (fp16 converted to float32,
bf16's bits shifted up by 16; both exact):
    bits      the float32 bit pattern as an int32; 0 for either zero (what `_keys` gets from x + 0.0)
    ordered   bits, with the 31 low bits flipped where negative (a larger magnitude then ranks lower);
              0x7FFFFFFF for every NaN
    key       ordered · 2^24 + (2^24 - 1 - index)
Keys are unique within a row (the index is in them), so "k times: take the largest, knock it out" ranks exactly.
No floating-point arithmetic touches x: a GPU that flushes subnormals to zero in float arithmetic would rank them
as zeros, which `_keys` (torch, no flush) does not.

Two launches, neither of which waits for the host (graph-safe):
    stage 1, grid (rows, blocks): each program keys BLOCK entries of one row and keeps its block's k largest keys
             (in a (rows, blocks·k) int64 scratch), or, when one block spans the row, writes the indices directly;
    stage 2, grid (rows,): the k largest of the row's blocks·k candidates, read PIECE at a time and merged into a
             running top k, decoded to indices.
Every key of the row's top k is among its block's k largest, so the candidates hold the answer. Lanes past the row's
end carry a key below every real one; they are never chosen, as k <= V.

Stage 1 does not take k maxima over the whole block (k passes over BLOCK int64 keys took 190 µs for 256 rows of
128256 fp32 entries, k = 8, on an H200; this takes 118 µs). It splits the block into groups of GROUP consecutive
entries and takes each group's largest key (one pass). The block's k largest keys all lie in the k groups whose
maxima are largest: a key e in any other group g has those k maxima above max(g) >= e, so k keys above it. So it
takes the k largest group maxima, reloads those k groups (k·GROUP entries, just read: from the cache) and takes the
k largest keys among them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

from ._host import cdiv, next_power_of_2

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_K = 16
INDEX_BITS = 24                                   # as vendored.engine.ranking.INDEX_BITS: rows narrower than 2^24
_INDEX_MASK = tl.constexpr((1 << INDEX_BITS) - 1)
_KEY_SCALE = tl.constexpr(1 << INDEX_BITS)
_NO_KEY = tl.constexpr(-(1 << 62))                # below every key (keys lie in [-2^55, 2^55))


@triton.jit
def _load_bits(x_row, cols, mask, stride_x_v, BF16_BITS: tl.constexpr):
    """The float32 bit patterns (int32) of x_row's entries at `cols` (0 where masked): fp16 converted to float32,
    bf16's bits shifted up by 16 (BF16_BITS: x_row points at bf16 values seen as int16; the interpreter's bf16 ->
    fp32 conversion turns subnormals into zeros, the shift is exact everywhere). Both exact."""
    raw = tl.load(x_row + cols.to(tl.int64) * stride_x_v, mask=mask, other=0)
    if BF16_BITS:
        bits = raw.to(tl.int32) << 16
    else:
        bits = raw.to(tl.float32).to(tl.int32, bitcast=True)              # fp16 -> fp32 is exact
    return bits


@triton.jit
def _order_keys(bits, cols, mask):
    """int64 order keys of entries whose float32 bits are `bits` at `cols` (the key of `_keys`, module docstring);
    _NO_KEY where masked."""
    magnitude = bits & 0x7FFFFFFF
    bits = tl.where(magnitude == 0, 0, bits)                             # -0.0 ranks as +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, ordered)      # every NaN, whatever its sign bit
    # the reversed index 2^24 - 1 - index as index ^ (2^24 - 1) (a constexpr global on the left of an operator
    # fails under the interpreter)
    keys = ordered.to(tl.int64) * _KEY_SCALE + (cols ^ _INDEX_MASK).to(tl.int64)
    return tl.where(mask, keys, _NO_KEY)


@triton.jit
def _finite_or_zero(m):
    """m where it is finite, else 0.0: the shift the exponentials are taken against (norm, module docstring)."""
    return tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)


@triton.jit
def _block_norm(bits, mask):
    """(m, s) of the entries `bits` (float32 bit patterns, 2-D) where `mask`: m the largest non-NaN value (-inf if
    none), s = sum of exp(x - shift(m)); a NaN among them makes s NaN."""
    x = bits.to(tl.float32, bitcast=True)
    m = tl.max(tl.max(tl.where(mask & (x == x), x, float("-inf")), axis=1), axis=0)
    s = tl.sum(tl.sum(tl.where(mask, tl.exp(x - _finite_or_zero(m)), 0.0), axis=1), axis=0)
    return m, s


@triton.jit
def _take_largest(keys, best, K: tl.constexpr, K_PAD: tl.constexpr):
    """The K largest of `keys` (any shape, 1-D) and `best` (K_PAD,) together, largest first, in a (K_PAD,) vector
    padded with _NO_KEY. Keys other than _NO_KEY are unique, so knocking out the one taken removes only it."""
    slots = tl.arange(0, K_PAD)
    taken = tl.full([K_PAD], _NO_KEY, tl.int64)
    for i in tl.static_range(K):
        m = tl.maximum(tl.max(keys, axis=0), tl.max(best, axis=0))
        taken = tl.where(slots == i, m, taken)
        keys = tl.where(keys == m, _NO_KEY, keys)
        best = tl.where(best == m, _NO_KEY, best)
    return taken


@triton.jit
def _block_top_k_kernel(
    x_ptr, dest_ptr, norm_ptr, width,
    stride_x_row, stride_x_v, stride_dest_row, stride_norm_row,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, DECODE: tl.constexpr,
    NORM: tl.constexpr, BF16_BITS: tl.constexpr,
):
    """Row program_id(0), entries [program_id(1)·BLOCK, +BLOCK): the K largest keys, to dest[row, block·K + j]
    (the scratch), or, DECODE (one block spans the row), their indices to dest[row, j] (the output). The K largest
    come from the K groups of GROUP entries with the largest maxima (module docstring). NORM: also the block's
    (m, s) to norm[row, 2·block + {0, 1}] (the scratch), or, DECODE, the row's (shift, log-sum) to norm[row, {0, 1}].
    K = 0: the norm only."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    x_row = x_ptr + row * stride_x_row
    in_group = tl.arange(0, GROUP)
    cols = block * BLOCK + tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + in_group[None, :]   # (groups, GROUP)
    in_row = cols < width
    bits = _load_bits(x_row, cols, in_row, stride_x_v, BF16_BITS)
    if NORM:
        m, s = _block_norm(bits, in_row)
        norm = norm_ptr + row * stride_norm_row
        if DECODE:
            tl.store(norm, _finite_or_zero(m))
            tl.store(norm + 1, tl.log(s))
        else:
            tl.store(norm + 2 * block, m)
            tl.store(norm + 2 * block + 1, s)
    if K > 0:
        no_keys = tl.full([K_PAD], _NO_KEY, tl.int64)
        group_max = tl.max(_order_keys(bits, cols, in_row), axis=1)                   # (groups,)
        top_groups = _take_largest(group_max, no_keys, K, K_PAD)     # (K_PAD,) largest first, _NO_KEY padded
        # the first entry of each chosen group, from its maximum's index; padding, and groups past the row's end
        # (a block of fewer than K groups), are masked
        first = ((top_groups & _INDEX_MASK) ^ _INDEX_MASK) // GROUP * GROUP
        cols = first[:, None] + in_group[None, :]                                      # (K_PAD, GROUP)
        mask = (top_groups != _NO_KEY)[:, None] & (cols < width)
        keys = _order_keys(_load_bits(x_row, cols, mask, stride_x_v, BF16_BITS), cols, mask)
        taken = _take_largest(tl.reshape(keys, [K_PAD * GROUP]), no_keys, K, K_PAD)
        slots = tl.arange(0, K_PAD)
        dest = dest_ptr + row * stride_dest_row + block * K + slots
        if DECODE:
            tl.store(dest, (taken & _INDEX_MASK) ^ _INDEX_MASK, mask=slots < K)
        else:
            tl.store(dest, taken, mask=slots < K)


@triton.jit
def _merge_top_k_kernel(
    cand_ptr, out_ptr, part_ptr, norm_ptr, n_cand, n_blocks,
    stride_cand_row, stride_out_row, stride_part_row, stride_norm_row,
    K: tl.constexpr, K_PAD: tl.constexpr, PIECE: tl.constexpr, NORM: tl.constexpr, NORM_PIECE: tl.constexpr,
):
    """Row program_id(0): the K largest of its n_cand candidate keys, PIECE at a time, decoded to indices; NORM:
    the row's (shift, log-sum) from its n_blocks partial (m, s), NORM_PIECE at a time (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    if K > 0:
        cand_row = cand_ptr + row * stride_cand_row
        best = tl.full([K_PAD], _NO_KEY, tl.int64)
        for start in range(0, n_cand, PIECE):
            offs = start + tl.arange(0, PIECE)
            keys = tl.load(cand_row + offs, mask=offs < n_cand, other=_NO_KEY)
            best = _take_largest(keys, best, K, K_PAD)
        slots = tl.arange(0, K_PAD)
        tl.store(out_ptr + row * stride_out_row + slots, (best & _INDEX_MASK) ^ _INDEX_MASK, mask=slots < K)
    if NORM:
        part_row = part_ptr + row * stride_part_row
        top = tl.full([NORM_PIECE], float("-inf"), tl.float32)
        for start in range(0, n_blocks, NORM_PIECE):
            offs = start + tl.arange(0, NORM_PIECE)
            top = tl.maximum(top, tl.load(part_row + 2 * offs, mask=offs < n_blocks, other=float("-inf")))
        shift = _finite_or_zero(tl.max(top, axis=0))
        total = tl.zeros([NORM_PIECE], tl.float32)
        for start in range(0, n_blocks, NORM_PIECE):
            offs = start + tl.arange(0, NORM_PIECE)
            m = tl.load(part_row + 2 * offs, mask=offs < n_blocks, other=float("-inf"))
            s = tl.load(part_row + 2 * offs + 1, mask=offs < n_blocks, other=0.0)
            # a block of no non-NaN value (m = -inf) adds its s (0, or NaN) times 0; the others their s rescaled
            # from their own shift to the row's (m <= the row's largest: the factor is at most 1, unless that is
            # +inf, where the sum is +inf anyway)
            total += s * tl.where(m == float("-inf"), 0.0, tl.exp(_finite_or_zero(m) - shift))
        norm = norm_ptr + row * stride_norm_row
        tl.store(norm, shift)
        tl.store(norm + 1, tl.log(tl.sum(total, axis=0)))


class TopKLaunch(NamedTuple):
    """Stage 1 keys `block` entries a program, in groups of `group`, with `block_warps` warps; stage 2 reads `piece`
    candidates at a time with `merge_warps` warps."""
    block: int
    group: int
    block_warps: int
    piece: int
    merge_warps: int


def _block_sizes(width: int, device: torch.device) -> TopKLaunch:
    """GPU: 4096 entries a program in groups of 32, by 4 warps (32 entries a thread); a 128256-wide vocabulary row
    is 32 programs and 32·k candidates, merged in one piece of up to 1024. Measured on an H200 on 2026-12-03 (a CUDA
    graph of 20 calls; 128256-wide log-softmax rows, k = 8; fp32 / bf16): 8.9 / 8.5 µs at 1 row, 20.7 / 18.6 µs at
    32 rows, 118 / 103 µs at 256 rows (k = 16: 243 / 212 µs), where the _keys + torch.topk path took 106, 258 and
    1629 µs (fp32). At 256 rows, fp32, k = 8: 8 warps 158 µs (groups of 16: 158, of 64: 170), blocks of 2048 by 4
    warps 154 µs, blocks of 8192 in groups of 64 by 8 warps 127 µs. The time follows k (the 2k block-wide maxima
    each program takes one after another), not the bytes read.
    Interpreter, where every program and every operation costs a fixed time: 128 entries a program in groups of 4
    (32 groups, so that k <= 16 prunes) and 32-candidate pieces, so that tests of a few hundred entries span several
    blocks, a partial last block and several merge pieces."""
    if device.type == "cuda":
        block = min(next_power_of_2(width), 4096)
        return TopKLaunch(block, min(block, 32), 4, 1024, 4)
    block = min(next_power_of_2(width), 128)
    return TopKLaunch(block, min(block, 4), 4, 32, 4)


def row_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (rows, k) int64 of the k largest entries of each row of x (rows, V), largest first, in the order of
    `vendored.engine.ranking._keys`: value descending, -0.0 == +0.0, any NaN above +inf, ties by the lower index.

    x: float32, bfloat16 or float16, any strides, V < 2^24, on a CUDA device (or the CPU under TRITON_INTERPRET=1);
    0 < k <= min(16, V). Never synchronises with the host, so it can be captured in a CUDA graph.
    """
    _check(x, k, low=1)
    return _launch(x, k, norm=False)[0]


def row_top_k_and_norm(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_top_k's indices (rows, k) (none for k = 0) and, from the same read of each row, its log-softmax norm
    (rows, 2) float32: column 0 the shift c (the row's largest non-NaN value, 0.0 where that is ±inf or there is
    none), column 1 log Σ exp(x - c) over the row. log_softmax(x)_j = (x_j - c) - log Σ, the engine's logprobs
    (vendored.engine.ranking). A NaN in the row makes the log-sum NaN; +inf makes it +inf; a row of -inf has -inf.

    x as row_top_k's; 0 <= k <= min(16, V), V >= 1.
    """
    _check(x, k, low=0)
    if x.shape[1] == 0:
        raise ValueError("x.shape[1]: expected at least 1 entry a row for a norm, got 0")
    indices, norm = _launch(x, k, norm=True)
    return indices, norm


def _check(x: torch.Tensor, k: int, *, low: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x.dim(): expected 2 (rows, V), got {x.dim()}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x.dtype: expected one of {[str(d) for d in _FLOAT_DTYPES]}, got {x.dtype}")
    width = x.shape[1]
    if width >= 1 << INDEX_BITS:
        raise ValueError(f"x.shape[1]: expected fewer than 2^{INDEX_BITS} = {1 << INDEX_BITS} entries a row, "
                         f"got {width}")
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= min(MAX_K, width):
        raise ValueError(f"k: expected an int in [{low}, min({MAX_K}, V={width})], got {k!r}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and knobs.runtime.interpret):
        raise ValueError(f"x.device: expected a CUDA device (or the CPU with TRITON_INTERPRET=1), got {x.device}")


def _launch(x: torch.Tensor, k: int, *, norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indices (rows, k) and, if `norm`, the norm (rows, 2) float32 of checked inputs: one launch where one block
    spans the row, else the blocks' launch and the merge."""
    rows, width = x.shape
    out = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    norms = torch.empty((rows, 2), dtype=torch.float32, device=x.device) if norm else None
    if rows == 0:
        return out, norms
    launch = _block_sizes(width, x.device)
    n_blocks = cdiv(width, launch.block)
    k_pad = next_power_of_2(max(k, 1))
    bf16_bits = x.dtype == torch.bfloat16
    source = x.view(torch.int16) if bf16_bits else x                   # same strides, the bits of each entry
    norm_out = norms if norm else out                                  # (an unused pointer when not norm)
    if n_blocks == 1:
        _block_top_k_kernel[(rows, 1)](
            source, out, norm_out, width, x.stride(0), x.stride(1), out.stride(0), norm_out.stride(0),
            K=k, K_PAD=k_pad, BLOCK=launch.block, GROUP=launch.group, DECODE=True, NORM=norm, BF16_BITS=bf16_bits,
            num_warps=launch.block_warps,
        )
        return out, norms
    scratch = torch.empty((rows, n_blocks * k), dtype=torch.int64, device=x.device)   # (rows, blocks·k)
    parts = torch.empty((rows, 2 * n_blocks), dtype=torch.float32, device=x.device) if norm else scratch
    _block_top_k_kernel[(rows, n_blocks)](
        source, scratch, parts, width, x.stride(0), x.stride(1), scratch.stride(0), parts.stride(0),
        K=k, K_PAD=k_pad, BLOCK=launch.block, GROUP=launch.group, DECODE=False, NORM=norm, BF16_BITS=bf16_bits,
        num_warps=launch.block_warps,
    )
    n_cand = n_blocks * k
    _merge_top_k_kernel[(rows,)](
        scratch, out, parts, norm_out, n_cand, n_blocks,
        scratch.stride(0), out.stride(0), parts.stride(0), norm_out.stride(0),
        K=k, K_PAD=k_pad, PIECE=min(next_power_of_2(max(n_cand, 1)), launch.piece), NORM=norm,
        NORM_PIECE=min(next_power_of_2(n_blocks), launch.piece), num_warps=launch.merge_warps,
    )
    return out, norms
