"""Stages 2 and 4 of the SSD scan as the GPU runs them (vendored/ops/ssd_scan_kernels.py has the algorithm, and those stages'
batched forms, which the interpreter runs): one chunk and one head a program, 2-D tiles, which Triton maps onto
Hopper's wgmma, every address a scalar base plus tile offsets. The interpreter's tests run them too, with a launch
of one chunk and head a program (tests/kernels/test_ssd_scan.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ssd_scan_kernels import _state_tile
from .ssd_scan_products import _dot


@triton.jit
def _ssd_chunk_state_tile_kernel(
    x_ptr, B_ptr, delta_ptr, dA_cumsum_ptr, states_ptr, chunk_start_ptr, chunk_len_ptr,
    head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_cs_c, stride_cs_h,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    HOW_XB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Stage 2 as the GPU runs it: a (BLOCK_P, BLOCK_N) tile of one chunk's own final state, one head; 2-D tiles,
    every address a scalar base (int64) plus tile offsets. Heads vary fastest across programs, so the programs running
    together read the same chunk of B."""
    head = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    offs_p, offs_n = _state_tile(tl.program_id(2), d_state, BLOCK_P, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < d_state
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)                  # 0 for a chunk past the real count: nothing runs
    x_ptr += start * stride_x_t + head * stride_x_h
    B_ptr += start * stride_B_t + (head // heads_per_group) * stride_B_g
    dA_cumsum_ptr += chunk * stride_cs_c + head * stride_cs_h
    delta_ptr += chunk * stride_cs_c + head * stride_cs_h
    dA_last = tl.load(dA_cumsum_ptr + tl.maximum(length - 1, 0))

    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        x = tl.load(x_ptr + offs_k[None, :] * stride_x_t + offs_p[:, None] * stride_x_p,
                    mask=mask_p[:, None] & mask_k[None, :], other=0.0).to(tl.float32)   # (BLOCK_P, BLOCK_K)
        b = tl.load(B_ptr + offs_k[:, None] * stride_B_t + offs_n[None, :] * stride_B_n,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)                   # (BLOCK_K, BLOCK_N)
        # decay to the chunk's end, ·Δ (Δ is 0 past the chunk's end, and cs constant there)
        scale = tl.exp((dA_last - tl.load(dA_cumsum_ptr + offs_k)).to(tl.float32)) * tl.load(delta_ptr + offs_k)
        acc += _dot(x * scale[None, :], b, HOW_XB)
    tl.store(states_ptr + chunk * stride_st_c + head * stride_st_h + offs_p[:, None] * stride_st_p
             + offs_n[None, :] * stride_st_n, acc, mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _ssd_chunk_scan_tile_kernel(
    x_ptr, z_ptr, C_ptr, CB_ptr, D_ptr, delta_ptr, dA_cumsum_ptr, states_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cb_c, stride_cb_g, stride_cb_m,
    stride_cs_c, stride_cs_h,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_y_t, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HOW_CS: tl.constexpr, HOW_X: tl.constexpr,
    M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Stage 4 as the GPU runs it: a (BLOCK_M, BLOCK_P) tile of y, rows m0 .. m0 + BLOCK_M of one chunk, one head;
    2-D tiles throughout, every address a scalar base (int64) plus tile offsets. Heads vary fastest across programs,
    so the programs running together read the same tiles of C·Bᵀ and C.

    Every decay of the tile runs from some position k to a row m >= m0; those from k < m0 (the entering state's, k
    the chunk's start, and the column blocks before the tile) factor through e = m0 - 1 (cs_e = 0 for m0 = 0):
    exp(cs_m - cs_k) = exp(cs_m - cs_e)·exp(cs_e - cs_k), both exponents <= 0, since cs falls along a chunk. The row
    factor multiplies the accumulator once, after those products; a column's factor (with its Δ) weights C·Bᵀ's
    column. Only the diagonal block takes an exp per element."""
    head = tl.program_id(0)
    chunk = (tl.program_id(1) // M_BLOCKS).to(tl.int64)
    m0 = (tl.program_id(1) % M_BLOCKS) * BLOCK_M
    group = head // heads_per_group
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)                  # 0 for a chunk past the real count: nothing runs
    x_ptr += start * stride_x_t + head * stride_x_h
    C_ptr += start * stride_C_t + group * stride_C_g
    CB_ptr += chunk * stride_cb_c + group * stride_cb_g
    dA_cumsum_ptr += chunk * stride_cs_c + head * stride_cs_h
    delta_ptr += chunk * stride_cs_c + head * stride_cs_h
    states_ptr += chunk * stride_st_c + head * stride_st_h
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_m = offs_m < length
    mask_p = offs_p < head_dim
    dA_m = tl.load(dA_cumsum_ptr + offs_m)                   # (BLOCK_M,): written for all q positions of a chunk
    dA_e = tl.load(dA_cumsum_ptr + m0 - 1, mask=m0 > 0, other=0.0)

    # the state entering the chunk, read out by C, decayed from the chunk's (= its sequence's) start to e
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, tl.where(m0 < length, d_state, 0), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < d_state
        c = tl.load(C_ptr + offs_m[:, None] * stride_C_t + offs_n[None, :] * stride_C_n,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)                   # (BLOCK_M, BLOCK_N)
        s = tl.load(states_ptr + offs_n[:, None] * stride_st_n + offs_p[None, :] * stride_st_p,
                    mask=mask_n[:, None] & mask_p[None, :], other=0.0)                   # (BLOCK_N, BLOCK_P)
        acc += _dot(c, s, HOW_CS)
    acc *= tl.exp(dA_e.to(tl.float32))

    # inside the chunk: (C Bᵀ ∘ L)·(Δx), L[m, k] = exp(cs_m - cs_k) for k <= m; first the column blocks before m0
    # (C·Bᵀ holds zeros past the chunk's end, and Δ is 0 there)
    for k0 in range(0, tl.where(m0 < length, m0, 0), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cb = tl.load(CB_ptr + offs_m[:, None] * stride_cb_m + offs_k[None, :])          # (BLOCK_M, BLOCK_K)
        from_col = tl.exp((dA_e - tl.load(dA_cumsum_ptr + offs_k)).to(tl.float32)) * tl.load(delta_ptr + offs_k)
        x_k = tl.load(x_ptr + offs_k[:, None] * stride_x_t + offs_p[None, :] * stride_x_p,
                      mask=(offs_k < length)[:, None] & mask_p[None, :], other=0.0)     # (BLOCK_K, BLOCK_P)
        acc += _dot(cb * from_col[None, :], x_k, HOW_X)
    acc *= tl.exp(tl.minimum(dA_m - dA_e, 0.0).to(tl.float32))[:, None]

    # then the diagonal block: columns m0 up to the tile's last row (and the chunk's end)
    for k0 in range(m0, tl.minimum(length, m0 + BLOCK_M), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cb = tl.load(CB_ptr + offs_m[:, None] * stride_cb_m + offs_k[None, :])          # (BLOCK_M, BLOCK_K)
        dA_k = tl.load(dA_cumsum_ptr + offs_k)
        causal = offs_m[:, None] >= offs_k[None, :]
        decay = tl.exp(tl.where(causal, (dA_m[:, None] - dA_k[None, :]).to(tl.float32), float("-inf")))
        x_k = tl.load(x_ptr + offs_k[:, None] * stride_x_t + offs_p[None, :] * stride_x_p,
                      mask=(offs_k < length)[:, None] & mask_p[None, :], other=0.0)     # (BLOCK_K, BLOCK_P)
        acc += _dot(cb * decay * tl.load(delta_ptr + offs_k)[None, :], x_k, HOW_X)

    mask = mask_m[:, None] & mask_p[None, :]                                              # (BLOCK_M, BLOCK_P)
    if HAS_D:
        x_m = tl.load(x_ptr + offs_m[:, None] * stride_x_t + offs_p[None, :] * stride_x_p, mask=mask,
                      other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + head).to(tl.float32) * x_m
    if HAS_Z:
        z_m = tl.load(z_ptr + start * stride_z_t + head * stride_z_h + offs_m[:, None] * stride_z_t
                      + offs_p[None, :] * stride_z_p, mask=mask, other=0.0).to(tl.float32)
        acc *= z_m * tl.sigmoid(z_m)
    tl.store(y_ptr + start * stride_y_t + head * stride_y_h + offs_m[:, None] * stride_y_t
             + offs_p[None, :] * stride_y_p, acc.to(y_ptr.dtype.element_ty), mask=mask)
