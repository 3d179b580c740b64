"""Decode attention over a paged K/V cache: one query per row, grouped K/V heads, no host synchronisation.

Twin of `reference.ops.decode_attention_ref`. Row b has a context of n_b = context_lens[b] keys; key p of row b lies
at flat position block_tables[b, p // block_size]·block_size + p % block_size of the caches. Query head h of row b
reads kv head h // (Hq/Hkv):
    out[b, h] = Σ_p softmax_p(scale · q[b, h]·k_p) · v_p          over p < n_b
with q·k accumulated in fp32, the softmax in fp32 (a running max and sum, flash-decoding style), P·V accumulated in
fp32 and one rounding, to q's dtype, at the end. n_b = 0 is a padding row: its output is zeros.

Only the first n_b table entries of a row and the keys and values they name are read: an entry past the context
may name any block (a stale one full of NaN, a free one, an id outside the cache) and is never loaded. A key
inside the context whose flat position lies outside the cache is not read either; its row outputs NaN (as the
other decode ops output NaN for a slot outside their pool), so a broken table shows instead of reading out of bounds.

Two launches at most, neither of which waits for the host, with a grid that depends on B, the heads and the table
width M only (capturable once in a CUDA graph and replayed for any contexts):
    split, grid (B, Hkv, splits): the program of (row, kv head, split) takes the whole group of Hq/Hkv query heads
           of that kv head (each key and value is read once for the group) over the split's key range, tile by
           tile. With one split, or when the row's context lies inside the first split, the first split's program
           writes the output itself; otherwise each split that holds keys of the context writes its partial
           (running max m, sum l, unnormalised acc, fp32) and a split past the context exits without a write.
    combine, grid (B, Hkv), only when there is more than one split: merges the partials of the splits that hold
           keys of the context (each rescaled by exp(m_split − max m)) and writes the rows the first launch left.
Splits exist for long contexts at small batch: one program a (row, kv head) would leave most of a GPU idle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._rounding import interpreted, round_to

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256          # the (rows, head_dim) fp32 accumulator and the (tile, head_dim) key tile in registers
MIN_DOT = 16                # tl.dot's smallest extent on every axis: rows, head dims and tiles are padded to it


@triton.jit
def _store_rows(out_ptr, row, kv_head, values, stride_o_row, stride_o_head,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                ROUND_BY_BITS: tl.constexpr):
    """values (ROWS, BLOCK_D) fp32 -> out[row, kv_head·GROUP + g, :HEAD_DIM] for g < GROUP, rounded once."""
    g = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    dest = out_ptr + row * stride_o_row + heads[:, None].to(tl.int64) * stride_o_head + d[None, :]
    mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(dest, round_to(values, out_ptr.dtype.element_ty, ROUND_BY_BITS), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, block_size, width_keys, n_cache_slots, keys_per_split, n_splits,
    stride_q_row, stride_q_head, stride_q_d,
    stride_k_slot, stride_k_head, stride_k_d,
    stride_v_slot, stride_v_head, stride_v_d,
    stride_t_row, stride_t_col,
    stride_o_row, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
):
    """Row program_id(0), kv head program_id(1), keys [split·keys_per_split, +keys_per_split) of the context, split
    = program_id(2); query heads kv_head·GROUP + [0, GROUP) as the first GROUP of ROWS rows (the rest zeros, never
    stored). Partials, when written: part_m, part_l (B, Hkv, n_splits, GROUP), part_acc (B, Hkv, n_splits, GROUP,
    HEAD_DIM), contiguous fp32."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the context's keys, clamped to [0, width_keys] (M·block_size, the keys the table can name: a longer context
    # is the caller's error, not checkable without a sync, and never reads past the table). Here and below no
    # helper jit function (tl.cdiv, ...): under the interpreter each call of one costs ~7 ms.
    n_keys = tl.minimum(tl.maximum(tl.load(lens_ptr + row).to(tl.int32), 0), width_keys)
    start = split * keys_per_split
    end = tl.minimum(n_keys, start + keys_per_split)
    n_live = (n_keys + keys_per_split - 1) // keys_per_split     # splits holding keys of the context
    writes_output = n_live <= 1                          # then only split 0 does anything: the output itself
    if (start < end) | (writes_output & (split == 0)):
        g = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_live = g < GROUP
        d_live = d < HEAD_DIM
        heads = (kv_head * GROUP + g).to(tl.int64)
        q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :] * stride_q_d,
                    mask=g_live[:, None] & d_live[None, :], other=0.0).to(tl.float32)            # (ROWS, BLOCK_D)
        table_row = tables_ptr + row * stride_t_row
        k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
        v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for first in range(start, end, BLOCK_N):
            pos = first + offs_n
            live = pos < end                             # keys of this split inside the context
            # table entries of live keys only: an entry past the context is never loaded
            block = tl.load(table_row + (pos // block_size).to(tl.int64) * stride_t_col, mask=live, other=0)
            slot = block.to(tl.int64) * block_size + (pos % block_size)
            in_cache = (slot >= 0) & (slot < n_cache_slots)
            read = live & in_cache
            kv_mask = read[:, None] & d_live[None, :]
            k = tl.load(k_head + slot[:, None] * stride_k_slot + d[None, :] * stride_k_d, mask=kv_mask,
                        other=0.0).to(tl.float32)                                             # (BLOCK_N, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale                       # (ROWS, BLOCK_N)
            s = tl.where(live[None, :], s, float("-inf"))
            s = tl.where((live & ~in_cache)[None, :], float("nan"), s)   # a key outside the cache: NaN, unread
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)                  # 0 on the first tile (m_i = -inf; every tile has a key)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + slot[:, None] * stride_v_slot + d[None, :] * stride_v_d, mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        if writes_output:
            # n_keys == 0 (a padding row): acc and l are 0, and the row is 0
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            _store_rows(out_ptr, row, kv_head, out, stride_o_row, stride_o_head,
                        GROUP, HEAD_DIM, ROWS, BLOCK_D, ROUND_BY_BITS)
        else:
            part = ((row * tl.num_programs(1) + kv_head) * n_splits + split) * GROUP
            tl.store(part_m_ptr + part + g, m_i, mask=g_live)
            tl.store(part_l_ptr + part + g, l_i, mask=g_live)
            tl.store(part_acc_ptr + (part + g[:, None]) * HEAD_DIM + d[None, :], acc,
                     mask=g_live[:, None] & d_live[None, :])


@triton.jit
def _decode_combine_kernel(
    lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    width_keys, keys_per_split, n_splits,
    stride_o_row, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
):
    """Row program_id(0), kv head program_id(1): when the context spans more than one split, the output of the
    group's query heads from the partials of its live splits (SPLITS >= n_splits); otherwise nothing (the split
    launch wrote it)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    n_keys = tl.minimum(tl.maximum(tl.load(lens_ptr + row).to(tl.int32), 0), width_keys)   # as the split kernel
    n_live = (n_keys + keys_per_split - 1) // keys_per_split
    if n_live > 1:
        g = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        g_live = g < GROUP
        d_live = d < HEAD_DIM
        base = (row * tl.num_programs(1) + kv_head) * n_splits * GROUP
        splits = tl.arange(0, SPLITS)
        # the largest running max over the live splits (a split past the context wrote nothing: never read)
        m_all = tl.load(part_m_ptr + base + splits[:, None] * GROUP + g[None, :],
                        mask=(splits < n_live)[:, None] & g_live[None, :], other=float("-inf"))  # (SPLITS, ROWS)
        m_max = tl.max(m_all, axis=0)
        m_max = tl.where(g_live, m_max, 0.0)             # padding rows: no -inf - -inf
        l_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for split in range(0, n_live):
            part = base + split * GROUP
            m_s = tl.load(part_m_ptr + part + g, mask=g_live, other=0.0)
            weight = tl.exp(m_s - m_max)
            l_sum += weight * tl.load(part_l_ptr + part + g, mask=g_live, other=0.0)
            acc += weight[:, None] * tl.load(part_acc_ptr + (part + g[:, None]) * HEAD_DIM + d[None, :],
                                             mask=g_live[:, None] & d_live[None, :], other=0.0)
        out = acc / tl.where(g_live, l_sum, 1.0)[:, None]
        _store_rows(out_ptr, row, kv_head, out, stride_o_row, stride_o_head,
                    GROUP, HEAD_DIM, ROWS, BLOCK_D, ROUND_BY_BITS)


class DecodeLaunch(NamedTuple):
    """block_n keys a tile; keys_per_split keys a split (a whole number of tiles); splits programs along the key
    axis of every (row, kv head); num_warps for both kernels; num_stages, the split kernel's software pipelining of
    its tile loop (1: none)."""
    block_n: int
    keys_per_split: int
    splits: int
    num_warps: int
    num_stages: int


LAUNCH_CHOOSERS = ("_launch",)


def _launch(n_rows: int, n_kv_heads: int, width_keys: int, device: torch.device) -> DecodeLaunch:
    """Tiles and splits from the batch, the kv heads and the table's width in keys (M·block_size), never from the
    contexts (so one CUDA graph serves every context). Unmeasured on a GPU: sane values, to be swept.

    GPU: tiles of 32 keys, 4 warps, no software pipelining of the tile loop: what compiles for sm_90 without
    spills in bf16 and fp32 alike (vendored/ops/_compile_check.py, 2026-12-03: at Bamba-9B's head dim of 128, 64-key
    tiles spilled kilobytes in bf16 with 2 or 3 pipeline stages, 32-key tiles 0.5 KB with 2; 32 keys unpipelined
    take ~194 registers a thread in bf16, ~190 in fp32, two programs an SM). Splits so that B·Hkv·splits reaches
    about two programs an SM of an H100/H200 (132 SMs) when B·Hkv alone does not (batch 1 at Hkv = 8 is 8
    programs: 6% of the SMs), but none shorter than 256 keys (eight tiles: below that, the fixed cost of a split,
    its q load and its partials written and read back, is a large share of its work). At batch 256 and Hkv 8 there
    are 2048 programs and one split: no combine launch. The range of a split is fixed by the table's width, so at a
    context far below max_model_len most splits of a row exit at once: the price of a grid that does not depend on
    the contexts.
    Interpreter, where every program costs a fixed time: tiles of 16 keys (tl.dot's smallest), splits of at least
    two tiles and up to 64 programs in all, so that the CPU tests, with tables of a few blocks, run several tiles a
    split, several splits, partial last tiles and the combine."""
    if device.type == "cuda":
        block_n, min_split_keys, target_programs = 32, 256, 2 * 132
    else:
        block_n, min_split_keys, target_programs = 16, 32, 64
    tiles = max(1, cdiv(width_keys, block_n))
    wanted = max(1, cdiv(target_programs, max(1, n_rows * n_kv_heads)))
    splits = min(wanted, max(1, cdiv(width_keys, min_split_keys)))
    tiles_per_split = cdiv(tiles, splits)
    return DecodeLaunch(block_n, tiles_per_split * block_n, cdiv(tiles, tiles_per_split), 4, 1)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, for the output and the partials: the tests fill what it returns with NaN, so that an element
    the kernels forget to write, or a partial the combine reads without its split having written it, shows."""
    return torch.empty(shape, dtype=dtype, device=device)


def _expect(name: str, what: str, expected, got) -> None:
    if expected != got:
        raise ValueError(f"{name}: expected {what + ' ' if what else ''}{expected}, got {got}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, *, block_size: int, scale: float,
                     batch_invariant: bool = False) -> torch.Tensor:
    """One query per row, attending over that row's cached context (the query's own key included).

    q (B, Hq, Dh), the query at position context_lens[b]-1, any strides (a view of a merged q/k/v projection);
    k_cache, v_cache (num_blocks·block_size, Hkv, Dh), the flat paged cache (keys after RoPE), any strides;
    block_tables (B, M) int32 or int64, row b's blocks in order; context_lens (B,) int32 or int64, 0 for a padding
    row. q, k_cache and v_cache of one dtype: fp32, bf16 or fp16; Dh <= 256 (any value: padded with masks);
    Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv)); block_size > 0. Returns (B, Hq, Dh) in q's
    dtype, contiguous; a padding row is zeros. Scores, softmax and P·V in fp32, one rounding at the end.

    Only a row's first context_lens[b] keys are read, through its first ceil(context_lens[b] / block_size) table
    entries: entries past the context may name any block, or none (an id outside the cache), and are never loaded;
    whatever the cache holds past a context (stale values, NaN) never reaches the output. Never synchronises with
    the host (capturable in a CUDA graph), so values are not checked here: a context longer than M·block_size
    attends over the table's M·block_size keys only, a negative one is a padding row, and a key inside a context
    whose table entry lies outside the cache is not read and makes its row NaN. Whether M·block_size keys fit the
    cache, row by row, is not checked either (it would need the table's values on the host).

    batch_invariant: each row's output the same bits whatever the other rows, the batch size and the table width
    (vendored/engine's batch-invariant mode): one split per row, whose program runs the row's own context tile by
    tile in order, where the default launch splits the keys by the batch size (more splits for fewer rows) and merges
    the splits' partials in a reduction whose shape follows the table width.
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "context_lens": context_lens}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, dims, what in (("q", 3, "rows, q heads, head_dim"), ("k_cache", 3, "cache positions, kv heads, head_dim"),
                             ("v_cache", 3, "cache positions, kv heads, head_dim"), ("block_tables", 2, "rows, M"),
                             ("context_lens", 1, "rows")):
        if tensors[name].dim() != dims:
            raise ValueError(f"{name}.dim(): expected {dims} ({what}), got {tensors[name].dim()}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {q.dtype}")
    for name in ("k_cache", "v_cache"):
        if tensors[name].dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q, {q.dtype}, got {tensors[name].dtype}")
    for name in ("block_tables", "context_lens"):
        if tensors[name].dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: expected dtype torch.int32 or torch.int64, got {tensors[name].dtype}")
    n_rows, n_q_heads, head_dim = q.shape
    n_slots, n_kv_heads = k_cache.shape[0], k_cache.shape[1]
    _expect("k_cache.shape[2]", "the head_dim of q,", head_dim, k_cache.shape[2])
    _expect("v_cache.shape", "the shape of k_cache,", tuple(k_cache.shape), tuple(v_cache.shape))
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q.shape[2] (head_dim): expected 1..{MAX_HEAD_DIM}, got {head_dim}")
    if n_kv_heads == 0 or n_q_heads % n_kv_heads:
        raise ValueError(f"k_cache.shape[1] (kv heads): expected a count dividing the q heads, {n_q_heads}, "
                         f"got {n_kv_heads}")
    _expect("block_tables.shape[0]", "the rows of q,", n_rows, block_tables.shape[0])
    _expect("context_lens.shape", "(rows of q,) =", (n_rows,), tuple(context_lens.shape))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if n_slots % block_size:
        raise ValueError(f"k_cache.shape[0]: expected whole blocks, a multiple of block_size = {block_size}, "
                         f"got {n_slots}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not abs(scale) < float("inf"):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    for name, t in tensors.items():
        _expect(f"{name}.device", "the device of q,", q.device, t.device)

    out = _empty((n_rows, n_q_heads, head_dim), q.dtype, q.device)
    if n_rows == 0 or n_q_heads == 0:
        return out
    group = n_q_heads // n_kv_heads
    width_keys = block_tables.shape[1] * block_size
    launch = _launch(n_rows, n_kv_heads, width_keys, q.device)
    if batch_invariant:
        launch = launch._replace(keys_per_split=cdiv(max(width_keys, 1), launch.block_n) * launch.block_n, splits=1)
    rows_pad = max(MIN_DOT, next_power_of_2(group))
    block_d = max(MIN_DOT, next_power_of_2(head_dim))
    if launch.splits > 1:
        part_m = _empty((n_rows, n_kv_heads, launch.splits, group), torch.float32, q.device)
        part_l = _empty((n_rows, n_kv_heads, launch.splits, group), torch.float32, q.device)
        part_acc = _empty((n_rows, n_kv_heads, launch.splits, group, head_dim), torch.float32, q.device)
    else:
        part_m = part_l = part_acc = out                                 # never written: one split writes out
    common = dict(GROUP=group, HEAD_DIM=head_dim, ROWS=rows_pad, BLOCK_D=block_d, ROUND_BY_BITS=interpreted(),
                  num_warps=launch.num_warps)
    _decode_split_kernel[(n_rows, n_kv_heads, launch.splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
        float(scale), block_size, width_keys, n_slots, launch.keys_per_split, launch.splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), out.stride(0), out.stride(1),
        BLOCK_N=launch.block_n, num_stages=launch.num_stages, **common,
    )
    if launch.splits > 1:
        _decode_combine_kernel[(n_rows, n_kv_heads)](
            context_lens, out, part_m, part_l, part_acc, width_keys, launch.keys_per_split, launch.splits,
            out.stride(0), out.stride(1), SPLITS=next_power_of_2(launch.splits),
            **dict(common, ROWS=next_power_of_2(group)),                 # no tl.dot here: no padding to 16 rows
        )
    return out
