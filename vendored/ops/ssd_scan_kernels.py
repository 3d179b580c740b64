"""The SSD chunked scan: Mamba2's selective state-space recurrence over packed variable-length input, forward only.

Twin: `reference.ops.ssd_scan_ref` (same signature; see its docstring for the equations). Per head h (group
g = h // (H/G)) and token t of a sequence:
    Δ_t = clamp(softplus(dt_t + dt_bias_h), dt_limit)
    S_t = exp(Δ_t·A_h)·S_{t-1} + Δ_t·x_t ⊗ B_t        y_t = S_t·C_t + D_h·x_t,  then y_t·silu(z_t)

The chunked (state-space dual) algorithm computes the same thing in blocks of Q tokens. Here the blocks are
*logical chunks*: every sequence is cut into pieces of at most Q tokens counted from its own first token, so no
chunk ever holds two sequences, every cumulative decay starts at the sequence's start by construction, and a
sequence boundary may fall anywhere in the packed token axis. Six kernels:

  0. logical chunks Each chunk's first token and length, and each sequence's first chunk (one launch: the host
                    never reads cu_seqlens back, so it never waits for the device).
  1. chunk cumsum   Δ, cs_t = Σ_{s≤t} Δ_s·A_h within the chunk, and the decay across the chunk exp(cs_last).
  2. chunk state    The chunk's own final state from zero: Σ_t exp(cs_last - cs_t)·Δ_t·x_t ⊗ B_t.
  3. state passing  Per sequence, walk its chunks in order from its initial state (or zeros); keep the state entering
                    each chunk, S_in; write the final state to the sequence's slot.
  C·Bᵀ              Per chunk and group (not per head: every head of a group shares it), tiles on the diagonal and
                    below, for stage 4.
  4. chunk scan     y_t = exp(cs_t)·C_t·S_in + Σ_{s≤t} exp(cs_t - cs_s)·(C_t·B_s)·Δ_s·x_s + D·x_t,
                    then ·silu(z_t).
Grids (NC = T // Q + B, a bound on the number of logical chunks known without reading cu_seqlens back): stage 0
NC/256; stage 1 (NC/BLOCK_C, H/BLOCK_H); stage 2 (H/BLOCK_H, NC/BLOCK_C, P/BLOCK_P · N/BLOCK_N); stage 3
(B, H/BLOCK_H, P/BLOCK_P · N/BLOCK_N); C·Bᵀ (G/BLOCK_H, NC/BLOCK_C · (Q/BLOCK_M)²); stage 4
(H/BLOCK_H, NC/BLOCK_C · Q/BLOCK_M, P/BLOCK_P). Heads vary fastest, so programs that run together share a
chunk's B, C and C·Bᵀ in L2. On the GPU, BLOCK_C = 1 and, past stage 1, BLOCK_H = 1, and every product is a 2-D
tile, which Triton maps onto Hopper's wgmma: stages 2 and 4 then run as tile kernels of their own
(_ssd_chunk_state_tile_kernel, _ssd_chunk_scan_tile_kernel: scalar base addresses, no batch dimension, fewer
registers), stage 4's decays from before its row tile factored through the position just before it. The Triton
interpreter (CPU) takes several chunks and heads per program, as a leading batch dimension of every tile (_bdot),
because there each program costs a fixed time whatever its size; its tests run the tile kernels too (a launch with
one chunk and head a program).

Every product and sum is as accurate as fp32 whatever the input dtype (x, B, C, z: fp32, bf16 or fp16; dt any
float), so the only rounding to a 16-bit type is the final store of y and, for a bf16 state pool, of the final states.
fp32 operands take tl.dot with input_precision="ieee" (fp32 FMAs, no TF32). On the GPU, 16-bit inputs take the
tensor cores without losing that accuracy: C·Bᵀ of two 16-bit inputs directly (a product of two 16-bit floats is
exact in fp32, and the sums run in fp32); a product of an fp32 matrix (x scaled by decays and Δ, C·Bᵀ∘L·Δ, the chunk
states) with a bf16 input as three bf16 products, the fp32 matrix split into bf16 pieces hi + mid + lo whose sum is
exactly it (_bf16x3, by bit operations): three times the tensor-core work, a fraction of the time of fp32 FMAs.
(fp16 inputs keep the FMAs there: fp16's exponent range cannot hold the small pieces.) One sum runs in fp64: the
cumulative Δ·A. Over a 256-token chunk it reaches hundreds, and in fp32 each difference cs_t - cs_s (the exponent of
every decay) would carry an absolute error of ~|cs|·2^-24, some 10x the error of the sequential product of decays;
in fp64 each difference is exact to fp32 before the exp.
products="rounded" trades that accuracy for speed where the inputs are 16-bit, in the peers' way: C·Bᵀ∘L·Δ and the
entering states rounded once to the input's dtype for their products (stage 3 stores the entering states so, in a
buffer of their own), stage 2's x·decay·Δ as two bf16 pieces (the final states off by < 2^-15 of each term), and the
cumulative sums in fp32.
Return dtype: y has x's dtype, as an engine's next layer expects. (The twin returns the promoted dtype of x and the
pool, which differs for a 16-bit x with an fp32 pool, or an fp16 x with a bf16 pool.)
Slots of `ssm_states` not named in `state_indices` are neither read nor written; a named slot is read only when
its sequence has an initial state.

Where things are: this file holds the kernels of every stage (stages 2 and 4 in their batched form);
vendored/ops/ssd_scan_tiles.py the tile kernels of stages 2 and 4 that the GPU runs; vendored/ops/ssd_scan_products.py
_dot's ways of keeping a product as accurate as fp32 (_bf16x3 among them); vendored/ops/ssd_scan.py the host
side: argument checks, the launch choices (_Blocks, _block_sizes), each product's precision, grids and launches, in
the op itself, `ssd_scan`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rounding import round_to
from .ssd_scan_products import _bdot


@triton.jit
def _log1p(u):
    # log(1 + u) without losing u's low bits when u is small (Goldberg): plain log(1 + u) returns 0 for u < 6e-8.
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _state_tile(pid, d_state, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets (BLOCK_P,), (BLOCK_N,) of tile `pid` of a (P, N) state cut into P/BLOCK_P · N/BLOCK_N tiles."""
    n_blocks_n = tl.cdiv(d_state, BLOCK_N)
    return ((pid // n_blocks_n) * BLOCK_P + tl.arange(0, BLOCK_P),
            (pid % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N))


@triton.jit
def _ssd_chunk_cumsum_fwd_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, delta_ptr, dA_cumsum_ptr, chunk_decay_ptr, chunk_start_ptr, chunk_len_ptr,
    n_chunks, n_heads, dt_min, dt_max,
    stride_dt_t, stride_dt_h,
    stride_cs_c, stride_cs_h, stride_dc_c,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, CUMSUM_FP64: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Stage 1: Δ (zero past the chunk's end), the in-chunk cumulative sum of Δ·A and the decay across the chunk, for
    BLOCK_C chunks and BLOCK_H heads."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)                          # (BLOCK_C,)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                          # (BLOCK_H,)
    offs_t = tl.arange(0, BLOCK_Q)                                                        # (BLOCK_Q,)
    mask_c = offs_c < n_chunks
    mask_h = offs_h < n_heads
    start = tl.load(chunk_start_ptr + offs_c, mask=mask_c, other=0).to(tl.int64)         # (BLOCK_C,)
    length = tl.load(chunk_len_ptr + offs_c, mask=mask_c, other=0)
    mask = (offs_t[None, :] < length[:, None])[:, :, None] & mask_h[None, None, :]       # (BLOCK_C, BLOCK_Q, BLOCK_H)

    tok = start[:, None] + offs_t[None, :]                                                # (BLOCK_C, BLOCK_Q) int64
    dt = tl.load(dt_ptr + tok[:, :, None] * stride_dt_t + offs_h[None, None, :] * stride_dt_h,
                 mask=mask, other=0.0).to(tl.float32)                                     # (BLOCK_C, BLOCK_Q, BLOCK_H)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, None, :]
    if DT_SOFTPLUS:
        # torch's softplus threshold: the identity above 20 (also keeps exp from overflowing)
        dt = tl.where(dt <= 20.0, _log1p(tl.exp(tl.minimum(dt, 20.0))), dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    delta = tl.where(mask, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)                   # (BLOCK_H,)
    dA = delta * A[None, None, :]
    if CUMSUM_FP64:
        dA = dA.to(tl.float64)
    dA_cumsum = tl.cumsum(dA, axis=1)                                                     # (BLOCK_C, BLOCK_Q, BLOCK_H)

    offs = (offs_c.to(tl.int64)[:, None, None] * stride_cs_c + offs_h[None, None, :] * stride_cs_h
            + offs_t[None, :, None])
    mask_ch = mask_c[:, None, None] & mask_h[None, None, :]
    tl.store(delta_ptr + offs, delta, mask=mask_ch)
    tl.store(dA_cumsum_ptr + offs, dA_cumsum, mask=mask_ch)
    # the decay across the whole chunk, exp(cs at its last token): stage 3 then reads one number per chunk and head
    # that no other load depends on, instead of a length and then the cumsum at that length
    last = tl.sum(tl.where(offs_t[None, :, None] == length[:, None, None] - 1, dA_cumsum, 0.0), axis=1)
    tl.store(chunk_decay_ptr + offs_c.to(tl.int64)[:, None] * stride_dc_c + offs_h[None, :],
             tl.exp(last.to(tl.float32)), mask=mask_c[:, None] & mask_h[None, :])     # (BLOCK_C, BLOCK_H)


@triton.jit
def _chunk_head_pairs(pid_c, pid_h, n_chunks, n_heads, chunk_start_ptr, chunk_len_ptr,
                      BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    """The BLOCK_C · BLOCK_H (chunk, head) pairs of a program, chunk-major: chunk, head, whether the pair exists,
    and the chunk's first token (int64) and length (0 for a pair that does not exist), each (BLOCK_C · BLOCK_H,)."""
    offs_s = tl.arange(0, BLOCK_C * BLOCK_H)
    chunk = pid_c * BLOCK_C + offs_s // BLOCK_H
    head = pid_h * BLOCK_H + offs_s % BLOCK_H
    mask_s = (chunk < n_chunks) & (head < n_heads)
    start = tl.load(chunk_start_ptr + chunk, mask=mask_s, other=0).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk, mask=mask_s, other=0)
    return chunk, head, mask_s, start, length


@triton.jit
def _ssd_chunk_state_fwd_kernel(
    x_ptr, B_ptr, delta_ptr, dA_cumsum_ptr, states_ptr, chunk_start_ptr, chunk_len_ptr,
    n_chunks, n_heads, head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_cs_c, stride_cs_h,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    HOW_XB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Stage 2: each chunk's own final state from a zero start, a (BLOCK_P, BLOCK_N) tile of it, for BLOCK_C chunks
    × BLOCK_H heads: one batch entry S of the (batched) products per (chunk, head) pair. Heads vary fastest across
    programs, so the programs running together read the same chunk of B."""
    chunk, head, mask_s, start, length = _chunk_head_pairs(
        tl.program_id(1), tl.program_id(0), n_chunks, n_heads, chunk_start_ptr, chunk_len_ptr, BLOCK_C, BLOCK_H)
    offs_p, offs_n = _state_tile(tl.program_id(2), d_state, BLOCK_P, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < d_state
    group = head // heads_per_group                        # interleaved: heads [g·H/G, (g+1)·H/G) read group g
    cs_base = chunk.to(tl.int64) * stride_cs_c + head * stride_cs_h                        # (S,)
    dA_last = tl.load(dA_cumsum_ptr + cs_base + tl.maximum(length - 1, 0), mask=mask_s, other=0.0)

    acc = tl.zeros((BLOCK_C * BLOCK_H, BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.max(length, axis=0), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k[None, :] < length[:, None]                                       # (S, BLOCK_K)
        tok = start[:, None] + offs_k[None, :]                                            # (S, BLOCK_K) int64
        x = tl.load(x_ptr + tok[:, None, :] * stride_x_t + head[:, None, None] * stride_x_h
                    + offs_p[None, :, None] * stride_x_p,
                    mask=mask_p[None, :, None] & mask_k[:, None, :], other=0.0).to(tl.float32)   # (S, BLOCK_P, BLOCK_K)
        b = tl.load(B_ptr + tok[:, :, None] * stride_B_t + group[:, None, None] * stride_B_g
                    + offs_n[None, None, :] * stride_B_n,
                    mask=mask_k[:, :, None] & mask_n[None, None, :], other=0.0)                  # (S, BLOCK_K, BLOCK_N)
        dA = tl.load(dA_cumsum_ptr + cs_base[:, None] + offs_k[None, :], mask=mask_k, other=0.0)   # (S, BLOCK_K)
        delta = tl.load(delta_ptr + cs_base[:, None] + offs_k[None, :], mask=mask_k, other=0.0)
        scale = tl.where(mask_k, tl.exp((dA_last[:, None] - dA).to(tl.float32)) * delta, 0.0)   # decay to the end, ·Δ
        acc += _bdot(x * scale[:, None, :], b, HOW_XB)

    offs = (chunk.to(tl.int64)[:, None, None] * stride_st_c + head[:, None, None] * stride_st_h
            + offs_p[None, :, None] * stride_st_p + offs_n[None, None, :] * stride_st_n)
    tl.store(states_ptr + offs, acc, mask=mask_s[:, None, None] & mask_p[None, :, None] & mask_n[None, None, :])


@triton.jit
def _ssd_state_passing_fwd_kernel(
    states_ptr, states_in_ptr, chunk_decay_ptr, seq_chunks_ptr,
    ssm_states_ptr, state_indices_ptr, has_initial_state_ptr,
    n_heads, head_dim, d_state, n_slots,
    stride_dc_c,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_pool_s, stride_pool_h, stride_pool_p, stride_pool_n,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
):
    """Stage 3: for one sequence and BLOCK_H heads, a (BLOCK_P, BLOCK_N) tile of the state walked across its chunks.

    states[c] holds chunk c's own state; the state entering chunk c goes to states_in[c], in its dtype (fp32: the same
    tensor, overwritten in place, each chunk's own state read before it is; 16-bit: rounded, products="rounded").
    """
    pid_b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                          # (BLOCK_H,)
    offs_p, offs_n = _state_tile(tl.program_id(2), d_state, BLOCK_P, BLOCK_N)
    mask_h = offs_h < n_heads
    mask = (mask_h[:, None, None] & (offs_p < head_dim)[None, :, None]
            & (offs_n < d_state)[None, None, :])                                          # (BLOCK_H, BLOCK_P, BLOCK_N)
    tile_offs = offs_p[None, :, None] * stride_st_p + offs_n[None, None, :] * stride_st_n  # (1, BLOCK_P, BLOCK_N)

    slot = tl.load(state_indices_ptr + pid_b).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + pid_b) != 0
    # a slot outside the pool (a bad index, reported by the host's check) is neither read nor written
    in_pool = (slot >= 0) & (slot < n_slots)
    pool_offs = (slot * stride_pool_s + offs_h[:, None, None] * stride_pool_h
                 + offs_p[None, :, None] * stride_pool_p + offs_n[None, None, :] * stride_pool_n)
    # the slot is read only when the sequence has an initial state: otherwise it may hold anything (NaN included)
    state = tl.load(ssm_states_ptr + pool_offs, mask=mask & has_initial & in_pool, other=0.0).to(tl.float32)

    first_chunk = tl.load(seq_chunks_ptr + pid_b).to(tl.int64)
    n_chunks = tl.load(seq_chunks_ptr + pid_b + 1) - tl.load(seq_chunks_ptr + pid_b)
    # each step loads the next chunk's state and decay before it stores and updates (one step of prefetch: the loop
    # is a chain, and those loads are the only ones that do not depend on it)
    offs = first_chunk * stride_st_c + offs_h[:, None, None] * stride_st_h + tile_offs
    own = tl.load(states_ptr + offs, mask=mask & (n_chunks > 0), other=0.0)
    decay = tl.load(chunk_decay_ptr + first_chunk * stride_dc_c + offs_h, mask=mask_h & (n_chunks > 0), other=0.0)
    for i in range(0, n_chunks):
        c = first_chunk + i                                                               # int64
        has_next = i + 1 < n_chunks
        own_next = tl.load(states_ptr + offs + stride_st_c, mask=mask & has_next, other=0.0)
        decay_next = tl.load(chunk_decay_ptr + (c + 1) * stride_dc_c + offs_h, mask=mask_h & has_next, other=0.0)
        tl.store(states_in_ptr + offs, round_to(state, states_in_ptr.dtype.element_ty, ROUND_BY_BITS), mask=mask)
        state = decay[:, None, None] * state + own
        own, decay, offs = own_next, decay_next, offs + stride_st_c
    tl.store(ssm_states_ptr + pool_offs, round_to(state, ssm_states_ptr.dtype.element_ty, ROUND_BY_BITS),
             mask=mask & in_pool)


@triton.jit
def _ssd_bmm_chunk_fwd_kernel(
    B_ptr, C_ptr, CB_ptr, chunk_start_ptr, chunk_len_ptr,
    n_chunks, n_groups, d_state,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cb_c, stride_cb_g, stride_cb_m,
    HOW_CB: tl.constexpr, M_BLOCKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Stage 4's C·Bᵀ, once per chunk and group (not once per head): tile (i, j) of (BLOCK_M, BLOCK_M) of the
    chunk's (Q, Q) matrix, for BLOCK_C chunks × BLOCK_G groups. Only tiles on and below the diagonal (j <= i) are
    written, the ones stage 4 reads; rows and columns past the chunk's end are zero."""
    tile = tl.program_id(1) % (M_BLOCKS * M_BLOCKS)
    i, j = tile // M_BLOCKS, tile % M_BLOCKS
    chunk, group, mask_s, start, length = _chunk_head_pairs(
        tl.program_id(1) // (M_BLOCKS * M_BLOCKS), tl.program_id(0), n_chunks, n_groups, chunk_start_ptr,
        chunk_len_ptr, BLOCK_C, BLOCK_G)
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = j * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m[None, :] < length[:, None]                                           # (S, BLOCK_M)
    mask_k = offs_k[None, :] < length[:, None]
    tok_m = start[:, None] + offs_m[None, :]                                              # (S, BLOCK_M) int64
    tok_k = start[:, None] + offs_k[None, :]
    acc = tl.zeros((BLOCK_C * BLOCK_G, BLOCK_M, BLOCK_M), dtype=tl.float32)
    for n0 in range(0, tl.where(j <= i, d_state, 0), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < d_state
        c = tl.load(C_ptr + tok_m[:, :, None] * stride_C_t + group[:, None, None] * stride_C_g
                    + offs_n[None, None, :] * stride_C_n,
                    mask=mask_m[:, :, None] & mask_n[None, None, :], other=0.0)                  # (S, M, N)
        b = tl.load(B_ptr + tok_k[:, None, :] * stride_B_t + group[:, None, None] * stride_B_g
                    + offs_n[None, :, None] * stride_B_n,
                    mask=mask_n[None, :, None] & mask_k[:, None, :], other=0.0)                  # (S, N, K)
        acc += _bdot(c, b, HOW_CB)
    offs = (chunk.to(tl.int64)[:, None, None] * stride_cb_c + group[:, None, None] * stride_cb_g
            + offs_m[None, :, None] * stride_cb_m + offs_k[None, None, :])
    tl.store(CB_ptr + offs, acc, mask=mask_s[:, None, None] & (j <= i))


@triton.jit
def _ssd_chunk_scan_fwd_kernel(
    x_ptr, z_ptr, C_ptr, CB_ptr, D_ptr, delta_ptr, dA_cumsum_ptr, states_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    n_chunks, n_heads, head_dim, d_state, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_z_t, stride_z_h, stride_z_p,
    stride_C_t, stride_C_g, stride_C_n,
    stride_cb_c, stride_cb_g, stride_cb_m,
    stride_cs_c, stride_cs_h,
    stride_st_c, stride_st_h, stride_st_p, stride_st_n,
    stride_y_t, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HOW_CS: tl.constexpr, HOW_X: tl.constexpr,
    M_BLOCKS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Stage 4: a (BLOCK_M, BLOCK_P) tile of y for rows of one chunk and one head, for BLOCK_C chunks × BLOCK_H heads:
    one batch entry S of the (batched) products per (chunk, head) pair. Heads vary fastest across programs, so the
    programs running together read the same tiles of C·Bᵀ and C."""
    pid_m = tl.program_id(1) % M_BLOCKS
    chunk, head, mask_s, start, length = _chunk_head_pairs(
        tl.program_id(1) // M_BLOCKS, tl.program_id(0), n_chunks, n_heads, chunk_start_ptr, chunk_len_ptr,
        BLOCK_C, BLOCK_H)
    group = head // heads_per_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_m = offs_m[None, :] < length[:, None]                                           # (S, BLOCK_M)
    mask_p = offs_p < head_dim
    tok_m = start[:, None] + offs_m[None, :]                                              # (S, BLOCK_M) int64
    cs_base = chunk.to(tl.int64) * stride_cs_c + head * stride_cs_h                        # (S,)
    dA_m = tl.load(dA_cumsum_ptr + cs_base[:, None] + offs_m[None, :], mask=mask_m, other=0.0)   # (S, BLOCK_M)

    # the state entering the chunk, read out by C and decayed from the chunk's (= its sequence's) start to row m
    st_base = chunk.to(tl.int64) * stride_st_c + head * stride_st_h                        # (S,)
    acc = tl.zeros((BLOCK_C * BLOCK_H, BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, d_state, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < d_state
        c = tl.load(C_ptr + tok_m[:, :, None] * stride_C_t + group[:, None, None] * stride_C_g
                    + offs_n[None, None, :] * stride_C_n,
                    mask=mask_m[:, :, None] & mask_n[None, None, :], other=0.0)                  # (S, BLOCK_M, BLOCK_N)
        s = tl.load(states_ptr + st_base[:, None, None] + offs_n[None, :, None] * stride_st_n
                    + offs_p[None, None, :] * stride_st_p,
                    mask=mask_s[:, None, None] & mask_n[None, :, None] & mask_p[None, None, :],
                    other=0.0)                                                            # (S, BLOCK_N, BLOCK_P)
        acc += _bdot(c, s, HOW_CS)
    acc *= tl.exp(dA_m.to(tl.float32))[:, :, None]

    # inside the chunk: (C Bᵀ ∘ L)·(Δx) with L[m, k] = exp(cs_m - cs_k) for k ≤ m; columns up to the tile's last row
    cb_base = chunk.to(tl.int64) * stride_cb_c + group * stride_cb_g                       # (S,)
    for k0 in range(0, tl.minimum(tl.max(length, axis=0), (pid_m + 1) * BLOCK_M), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k[None, :] < length[:, None]                                       # (S, BLOCK_K)
        tok_k = start[:, None] + offs_k[None, :]                                          # (S, BLOCK_K) int64
        cb = tl.load(CB_ptr + cb_base[:, None, None] + offs_m[None, :, None] * stride_cb_m + offs_k[None, None, :],
                     mask=mask_s[:, None, None], other=0.0)                               # (S, BLOCK_M, BLOCK_K)
        dA_k = tl.load(dA_cumsum_ptr + cs_base[:, None] + offs_k[None, :], mask=mask_k, other=0.0)   # (S, BLOCK_K)
        delta_k = tl.load(delta_ptr + cs_base[:, None] + offs_k[None, :], mask=mask_k, other=0.0)
        if k0 + BLOCK_K <= pid_m * BLOCK_M:
            # every column comes before every row: L factors through the block's last column e as
            # exp(cs_m - cs_e)·exp(cs_e - cs_k), both exponents <= 0 (a row past the chunk's end is clamped there),
            # so two vectors of exps and a product replace an exp per element
            dA_e = tl.load(dA_cumsum_ptr + cs_base + k0 + BLOCK_K - 1, mask=mask_s, other=0.0)        # (S,)
            to_row = tl.exp(tl.minimum(dA_m - dA_e[:, None], 0.0).to(tl.float32))                    # (S, BLOCK_M)
            from_col = tl.exp((dA_e[:, None] - dA_k).to(tl.float32)) * delta_k                       # (S, BLOCK_K)
            weights = cb * to_row[:, :, None] * from_col[:, None, :]
        else:
            causal = (offs_m[:, None] >= offs_k[None, :])[None, :, :] & mask_k[:, None, :]   # (S, BLOCK_M, BLOCK_K)
            decay = tl.exp(tl.where(causal, (dA_m[:, :, None] - dA_k[:, None, :]).to(tl.float32), float("-inf")))
            weights = cb * decay * delta_k[:, None, :]
        x_k = tl.load(x_ptr + tok_k[:, :, None] * stride_x_t + head[:, None, None] * stride_x_h
                      + offs_p[None, None, :] * stride_x_p,
                      mask=mask_k[:, :, None] & mask_p[None, None, :], other=0.0)                  # (S, K, P)
        acc += _bdot(weights, x_k, HOW_X)

    mask = mask_m[:, :, None] & mask_p[None, None, :]                                     # (S, BLOCK_M, BLOCK_P)
    if HAS_D:
        x_m = tl.load(x_ptr + tok_m[:, :, None] * stride_x_t + head[:, None, None] * stride_x_h
                      + offs_p[None, None, :] * stride_x_p, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + head, mask=mask_s, other=0.0).to(tl.float32)[:, None, None] * x_m
    if HAS_Z:
        z_m = tl.load(z_ptr + tok_m[:, :, None] * stride_z_t + head[:, None, None] * stride_z_h
                      + offs_p[None, None, :] * stride_z_p, mask=mask, other=0.0).to(tl.float32)
        acc *= z_m * tl.sigmoid(z_m)
    tl.store(y_ptr + tok_m[:, :, None] * stride_y_t + head[:, None, None] * stride_y_h
             + offs_p[None, None, :] * stride_y_p, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logical_chunks_kernel(
    cu_seqlens_ptr, chunk_start_ptr, chunk_len_ptr, seq_chunks_ptr, n_seqs, n_chunks, chunk_size,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Stage 0, for BLOCK_C chunks: which sequence each belongs to, its first token and its length. Sequence b owns
    chunks [first_b, first_b + ceil(L_b / Q)), first_b the running sum of the counts before it; every program walks
    all sequences (BLOCK_B at a time), and program 0 also writes the running sums as seq_chunks (B+1,)."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)                          # (BLOCK_C,)
    start = tl.zeros((BLOCK_C,), dtype=tl.int64)
    end = tl.zeros((BLOCK_C,), dtype=tl.int64)
    owned = tl.zeros((BLOCK_C,), dtype=tl.int1)
    total = tl.zeros((), dtype=tl.int64)                       # chunks of the sequences before this block of them
    for b0 in range(0, n_seqs, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask_b = offs_b < n_seqs
        seq_start = tl.load(cu_seqlens_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)
        seq_end = tl.load(cu_seqlens_ptr + offs_b + 1, mask=mask_b, other=0).to(tl.int64)
        count = tl.where(mask_b, (seq_end - seq_start + chunk_size - 1) // chunk_size, 0)   # (BLOCK_B,)
        last = total + tl.cumsum(count, axis=0)                # one past each sequence's last chunk
        first = last - count
        if tl.program_id(0) == 0:
            tl.store(seq_chunks_ptr + offs_b, first.to(tl.int32), mask=mask_b)
        hit = (offs_c[:, None] >= first[None, :]) & (offs_c[:, None] < last[None, :])      # (BLOCK_C, BLOCK_B)
        start += tl.sum(tl.where(hit, seq_start[None, :] + (offs_c[:, None] - first[None, :]) * chunk_size, 0),
                        axis=1)
        end += tl.sum(tl.where(hit, seq_end[None, :], 0), axis=1)
        owned |= tl.max(hit.to(tl.int32), axis=1) > 0
        total += tl.sum(count, axis=0)
    if tl.program_id(0) == 0:
        tl.store(seq_chunks_ptr + n_seqs, total.to(tl.int32))
    mask_c = offs_c < n_chunks
    tl.store(chunk_start_ptr + offs_c, start.to(tl.int32), mask=mask_c)
    tl.store(chunk_len_ptr + offs_c, tl.where(owned, tl.minimum(end - start, chunk_size), 0).to(tl.int32),
             mask=mask_c)

