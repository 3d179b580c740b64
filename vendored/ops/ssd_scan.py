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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._index_check import no_check, start_index_check
from ._rounding import interpreted, round_to

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
def _bf16_head(v):
    """The leading 8 significant bits of fp32 v, as an fp32 (v with its low 16 bits cleared) and as a bf16 (v's high
    16 bits), by bit operations alone: on the GPU a float conversion runs at a quarter of the rate of these."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits & -65536).to(tl.float32, bitcast=True), (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16x3(v):
    """An fp32 tensor as three bf16 tensors whose sum is exactly v (finite, normal v; a subnormal v to within bf16's
    spacing there, 2^-133): each piece is the leading 8 significant bits of what the pieces before it leave, so every
    remainder is exact and 3 · 8 bits cover v's 24."""
    hi_f, hi = _bf16_head(v)
    rest = v - hi_f                                                  # exact: the low 16 bits of v
    mid_f, mid = _bf16_head(rest)
    _, lo = _bf16_head(rest - mid_f)                                 # at most 8 significant bits are left
    return hi, mid, lo


# How _dot keeps fp32 accuracy (a host-side choice per product, see ssd_scan()):
#   0: two 16-bit operands, straight on the tensor cores (a product of two 16-bit floats is exact in fp32);
#   1: an fp32 left operand against a bf16 right one, the left as its three bf16 pieces;
#   2: a bf16 left operand against an fp32 right one, the right split;
#   3: fp32 FMAs (fp32 or fp16 operands, and every product under the interpreter);
#   4, 5: the fp32 left (4) or right (5) operand rounded to the other's 16-bit dtype, one tensor-core product, as the
#      peers' kernels do (products="rounded", GPU);
#   6, 7: the same rounding under the interpreter (by bits, see _rounding.py), then fp32 FMAs on the 16-bit values:
#      the products of two 16-bit floats are exact in fp32, so this is what 4 and 5 compute, summed in another order;
#   8, 9: the fp32 left operand as two bf16 pieces, its leading 8 significant bits and the rest rounded to bf16
#      (off by less than 2^-15 of it), against a bf16 right one: two tensor-core products (8, GPU) or fp32 FMAs on
#      the pieces (9, interpreter). products="rounded" for stage 2, whose rounding the final states keep.
@triton.jit
def _dot(a, b, HOW: tl.constexpr):
    """a @ b in fp32 for 2-D or 3-D (batched) a, b: as accurate as fp32 whatever the operands (HOW 0-3), or with the
    fp32 operand rounded once (4-7; see the table above). The split pieces run small first, so the large one adds
    last."""
    if HOW == 0:
        return tl.dot(a, b)
    elif HOW == 1:
        a_hi, a_mid, a_lo = _bf16x3(a)
        return tl.dot(a_hi, b, tl.dot(a_mid, b, tl.dot(a_lo, b)))
    elif HOW == 2:
        b_hi, b_mid, b_lo = _bf16x3(b)
        return tl.dot(a, b_hi, tl.dot(a, b_mid, tl.dot(a, b_lo)))
    elif HOW == 4:
        return tl.dot(a.to(b.dtype), b)
    elif HOW == 5:
        return tl.dot(a, b.to(a.dtype))
    elif HOW == 6:
        return tl.dot(round_to(a, b.dtype, True).to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif HOW == 7:
        return tl.dot(a.to(tl.float32), round_to(b, a.dtype, True).to(tl.float32), input_precision="ieee")
    elif HOW == 8:
        a_hi_f, a_hi = _bf16_head(a)
        return tl.dot(a_hi, b, tl.dot((a - a_hi_f).to(tl.bfloat16), b))
    elif HOW == 9:
        a_hi_f, _ = _bf16_head(a)
        a_lo = round_to(a - a_hi_f, tl.bfloat16, True).to(tl.float32)
        return tl.dot(a_hi_f, b.to(tl.float32), tl.dot(a_lo, b.to(tl.float32), input_precision="ieee"),
                      input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _bdot(a, b, HOW: tl.constexpr):
    """_dot of (S, M, K) and (S, K, N) tiles: one product per batch entry. A batch of one (the GPU path) runs as a
    2-D product, because Triton lowers a 3-D tl.dot to mma.sync and only a 2-D one to Hopper's wgmma."""
    if a.shape[0] == 1:
        r = _dot(tl.reshape(a, (a.shape[1], a.shape[2])), tl.reshape(b, (b.shape[1], b.shape[2])), HOW)
        return tl.reshape(r, (1, r.shape[0], r.shape[1]))
    return _dot(a, b, HOW)


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


def _logical_chunks(cu_seqlens: torch.Tensor, chunk_size: int, n_tokens: int):
    """Cut every sequence into chunks of at most Q tokens counted from its own first token.

    cu_seqlens (B+1,). Returns chunk_start (NC,), chunk_len (NC,) and seq_chunks (B+1,), int32 on cu_seqlens' device:
    sequence b owns chunks seq_chunks[b]:seq_chunks[b+1]. The real count Σ_b ceil(L_b / Q) is at most
    NC = T // Q + B, which is known without reading cu_seqlens back to the host (no device sync): chunks past the
    real count get length 0 (and start 0) and every stage skips them. One kernel launch: at a chunked-prefill
    budget of 2K tokens the scan's own work is a few tens of microseconds, as much as a dozen small torch ops cost
    the host.
    """
    n_seqs = cu_seqlens.numel() - 1
    n_chunks = n_tokens // chunk_size + n_seqs
    i32 = dict(dtype=torch.int32, device=cu_seqlens.device)
    chunk_start, chunk_len, seq_chunks = torch.empty(n_chunks, **i32), torch.empty(n_chunks, **i32), \
        torch.empty(n_seqs + 1, **i32)
    block_c = 256 if cu_seqlens.device.type == "cuda" else 1024
    _logical_chunks_kernel[(cdiv(n_chunks, block_c),)](
        cu_seqlens, chunk_start, chunk_len, seq_chunks, n_seqs, n_chunks, chunk_size,
        BLOCK_C=block_c, BLOCK_B=min(64, next_power_of_2(max(n_seqs, 1))),
    )
    return chunk_start, chunk_len, seq_chunks


class _Blocks(NamedTuple):
    """How the scan cuts its work. chunk: the length of its chunks (the model's chunk_size by default, though any
    length computes the same recurrence: chunks cut the work, they are not part of what is computed); q: a chunk
    padded to a power of two; m: the rows (and columns) of a stage-4 tile and of a C·Bᵀ tile; p: head-dim columns
    of a state or y tile; n_state, n_pass, n_scan: state columns of a stage-2 tile, of a stage-3 tile and of a
    stage-4 C·S step; h_cumsum: heads per stage-1 program; c, h: chunks and heads (groups, for C·Bᵀ) per program of
    every stage that has them; warps, stages: num_warps and num_stages (software pipelining depth) of the stages
    with products; tensor_cores: whether 16-bit inputs take the tensor-core products of _dot (GPU) or fp32 FMAs;
    max_registers: a cap on the registers a thread of stages 2 and 4 may use when x is bf16 (ptxas's maxnreg; 0:
    none), which sets how many of their programs an SM holds at once (65536 registers an SM, 128 threads a program);
    scan_m, scan_k, scan_p, scan_warps, scan_stages, scan_max_registers: stage 4's rows, column step, head-dim columns,
    warps, stages and register cap when not 0 (otherwise m, m, p, warps, stages and max_registers), for the sweep to
    vary stage 4 alone (scan_m may not exceed m: stage 4 reads the C·Bᵀ tiles on and below the diagonal, in m-row
    blocks)."""
    chunk: int
    q: int
    m: int
    p: int
    n_state: int
    n_pass: int
    n_scan: int
    h_cumsum: int
    c: int
    h: int
    warps: int
    stages: int
    tensor_cores: bool
    max_registers: int = 0
    scan_m: int = 0
    scan_k: int = 0
    scan_p: int = 0
    scan_warps: int = 0
    scan_stages: int = 0
    scan_max_registers: int = 0


def _block_sizes(chunk_size: int, n_heads: int, head_dim: int, d_state: int, products: str,
                 device: torch.device) -> _Blocks:
    """tl.dot needs every side >= 16, so q, m, p and n are padded up to that. GPU: one chunk and one head per program
    past stage 1 (the grid supplies the parallelism): 2-D tiles, which Triton maps onto Hopper's wgmma; a whole (64,
    128) state per stage-2 program, so x·decay is split into bf16 pieces once. Stage 1 takes 8 heads per program
    whatever H is: with 4 (a model of 4 heads), triton 3.6 fails to compile it for sm_90 ("operand does not dominate
    this use" in its layout pass; _compile_check compiles the scan at such a shape). Picked on an H200 with
    bench/sweep_scan.py (2026-11-30, Bamba-9B, 32K and 2K tokens): (64, 64) stage-3 tiles and no software pipelining
    (num_stages 1: less shared memory, more programs per SM) were the fastest of the variations tried; 8 warps, 32-
    or 128-wide C·S steps, 4 stages and chunks of 64 or 128 were slower. Registers capped at 168 a thread (stage 4
    needed 208 uncapped in its batched form, 160 as a tile kernel; stage 2 174: two 128-thread programs an SM; at 168
    three fit, with no spills, and the same results bit for bit): 14% less time at 32K tokens, 8% at 2K
    (bench/sweep_scan.py, H200); 128 (four programs, some spills) and 8 warps at 128 were slower. products="rounded"
    (2026-12-04, by device time at 2K-32K tokens): stage 4 capped at 128 registers, its C·S read-out in one 128-wide
    step; stage 2 stays at 168 (its two bf16 products spill 480 bytes at 128). Interpreter, where every program costs
    the same fixed time whatever its size: 256 rows' worth of chunks (16 chunks of Q <= 16, 4 of Q = 128) and up to 4
    heads per program, so that tests with more chunks or heads than that still cross block edges."""
    block_q = max(16, next_power_of_2(chunk_size))
    block_m = min(64, block_q)
    block_p = min(64, max(16, next_power_of_2(head_dim)))
    block_n = max(16, next_power_of_2(d_state))
    heads_cumsum = next_power_of_2(n_heads)
    if device.type == "cuda":
        rounded = products == "rounded"
        return _Blocks(chunk=chunk_size, q=block_q, m=block_m, p=block_p, n_state=min(128, block_n),
                       n_pass=min(64, block_n), n_scan=min(128 if rounded else 64, block_n), h_cumsum=8, c=1, h=1,
                       warps=4, stages=1, tensor_cores=True, max_registers=168,
                       scan_max_registers=128 if rounded else 0)
    return _Blocks(chunk=chunk_size, q=block_q, m=block_m, p=block_p, n_state=min(64, block_n),
                   n_pass=min(64, block_n), n_scan=min(64, block_n), h_cumsum=min(16, heads_cumsum),
                   c=256 // block_m, h=min(4, heads_cumsum), warps=4, stages=1, tensor_cores=False)


def _check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...], letters: str) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {letters} = {shape}, got {tuple(t.shape)}")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    check_indices: bool = True,
    products: str = "fp32",
) -> torch.Tensor:
    """The selective state-space recurrence over packed sequences, by the SSD chunked algorithm (Triton).

    x (T, H, P) fp32/bf16/fp16; dt (T, H); A (H,) negative; B, C (T, G, N) with H % G == 0; D (H,) or None;
    dt_bias (H,) or None; z (T, H, P) or None; cu_seqlens (B+1,) int; ssm_states (S, H, P, N) fp32 or bf16, updated in
    place: slot state_indices[b] receives sequence b's final state; state_indices (B,) int; has_initial_state (B,)
    bool: sequence b starts from slot state_indices[b] if set, from zeros otherwise. chunk_size Q ≥ 1 (any value;
    blocks are padded to a power of two ≥ 16). Any strides. Returns y (T, H, P) in x's dtype (see the module
    docstring for how that differs from the twin).

    The values of cu_seqlens and state_indices are checked (ValueError) by a device-to-host copy started before the
    kernels are queued and waited for after them (vendored/ops/_index_check.py); the kernels never read or write a
    slot outside the pool, so a call that raises has written only y and the slots it names. check_indices=False
    skips the copy and the wait, for a caller that built the values and vouches for them (the engine).

    products: "fp32" (default), every product and sum as accurate as fp32 (the module docstring says how); or
    "rounded", the peers' precision (vLLM's and mamba_ssm's kernels): each fp32 intermediate that meets a 16-bit input
    in a product (x·decay·Δ against B, the entering states against C, C·Bᵀ∘L·Δ against x) is rounded once to that
    input's dtype, and the cumulative sums of Δ·A run in fp32. Faster; its error against the fp64 twin is bounded in
    tests/kernels/test_ssd_scan.py by what those roundings can cost, and measured beside the peers' by bench/kernels.py.
    With an fp32 x the two are the same computation.
    """
    if products not in ("fp32", "rounded"):
        raise ValueError(f"products: expected 'fp32' or 'rounded', got {products!r}")
    if x.dim() != 3:
        raise ValueError(f"x: expected shape (T, H, P), got {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    if ssm_states.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ssm_states: expected dtype float32 or bfloat16, got {ssm_states.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected ≥ 1, got {chunk_size}")
    n_tokens, n_heads, head_dim = x.shape
    if B.dim() != 3:
        raise ValueError(f"B: expected shape (T, G, N), got {tuple(B.shape)}")
    n_groups, d_state = B.shape[1:]
    n_seqs = state_indices.shape[0]
    _check_shape("dt", dt, (n_tokens, n_heads), "(T, H)")
    _check_shape("A", A, (n_heads,), "(H,)")
    _check_shape("C", C, tuple(B.shape), "(T, G, N)")
    _check_shape("B", B, (n_tokens, n_groups, d_state), "(T, G, N)")
    _check_shape("D", D, (n_heads,), "(H,)")
    _check_shape("dt_bias", dt_bias, (n_heads,), "(H,)")
    _check_shape("z", z, tuple(x.shape), "(T, H, P)")
    _check_shape("ssm_states", ssm_states, (ssm_states.shape[0], n_heads, head_dim, d_state), "(S, H, P, N)")
    _check_shape("has_initial_state", has_initial_state, (n_seqs,), "(B,)")
    _check_shape("cu_seqlens", cu_seqlens, (n_seqs + 1,), "(B+1,)")
    if n_heads % n_groups:
        raise ValueError(f"B: n_groups G = {n_groups} does not divide the number of heads H = {n_heads}")

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)                              # (T, H, P)
    check = (start_index_check(cu_seqlens, state_indices, n_tokens, ssm_states.shape[0]) if check_indices
             else no_check)
    if n_seqs == 0:
        check()
        return y
    half = (torch.bfloat16, torch.float16)
    rounded = products == "rounded" and x.dtype in half          # fp32 x: nothing to round to, the fp32 mode
    blocks = _block_sizes(chunk_size, n_heads, head_dim, d_state, "rounded" if rounded else "fp32", x.device)
    chunk_start, chunk_len, seq_chunks = _logical_chunks(cu_seqlens, blocks.chunk, n_tokens)
    n_chunks = chunk_start.shape[0]                                                       # NC (an upper bound)
    on_gpu = blocks.tensor_cores
    chunk_blocks = cdiv(n_chunks, blocks.c)
    head_blocks = cdiv(n_heads, blocks.h)
    m_blocks = blocks.q // blocks.m
    f32 = dict(dtype=torch.float32, device=x.device)
    # _dot's precision for each product (see its table): 16-bit operands take the tensor cores on the GPU only
    how_cb = 0 if on_gpu and B.dtype == C.dtype and B.dtype in half else 3
    if rounded:                # one rounding to the 16-bit operand's dtype (GPU: 4; interpreter: 6, the same math)
        # stage 2's products make the final states, which the next call starts from: x·decay·Δ as two bf16 pieces
        # there (8, 9), so the states are off by 2^-15 rather than bf16's 2^-8 (fp16 B: one rounding to fp16, 2^-11)
        how_xb = ({torch.bfloat16: 8 if on_gpu else 9, torch.float16: 4 if on_gpu else 6}.get(B.dtype, 3))
        how_cs = (0 if on_gpu else 3) if C.dtype in half else 3         # C @ state entering, stored in C's dtype
        how_x = (4 if on_gpu else 6) if x.dtype in half else 3          # (C·Bᵀ∘L·Δ) @ x         (stage 4)
    else:
        how_xb = 1 if on_gpu and B.dtype == torch.bfloat16 else 3       # (x·decay·Δ)ᵀ @ B       (stage 2)
        how_cs = 2 if on_gpu and C.dtype == torch.bfloat16 else 3       # C @ state entering    (stage 4)
        how_x = 1 if on_gpu and x.dtype == torch.bfloat16 else 3        # (C·Bᵀ∘L·Δ) @ x         (stage 4)

    # the register cap was measured for the tensor-core products (bf16 x); the fp32 FMA paths would spill under it
    registers = {"maxnreg": blocks.max_registers} if blocks.max_registers and how_x in (1, 4) else {}
    scan_cap = blocks.scan_max_registers or blocks.max_registers
    scan_registers = {"maxnreg": scan_cap} if scan_cap and how_x in (1, 4) else {}
    delta = torch.empty(n_chunks, n_heads, blocks.q, **f32)                              # (NC, H, Q)
    dA_cumsum = torch.empty(n_chunks, n_heads, blocks.q, dtype=torch.float32 if rounded else torch.float64,
                            device=x.device)                                              # (NC, H, Q)
    chunk_decay = torch.empty(n_chunks, n_heads, **f32)                                  # (NC, H)
    dt_min, dt_max = dt_limit
    has_dt_limit = dt_min > 0.0 or dt_max < math.inf
    _ssd_chunk_cumsum_fwd_kernel[(chunk_blocks, cdiv(n_heads, blocks.h_cumsum))](
        dt, A, dt_bias if dt_bias is not None else A, delta, dA_cumsum, chunk_decay, chunk_start, chunk_len,
        n_chunks, n_heads, float(dt_min), min(float(dt_max), torch.finfo(torch.float32).max),
        dt.stride(0), dt.stride(1),
        delta.stride(0), delta.stride(1), chunk_decay.stride(0),
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_DT_LIMIT=has_dt_limit,
        CUMSUM_FP64=not rounded, BLOCK_C=blocks.c, BLOCK_Q=blocks.q, BLOCK_H=blocks.h_cumsum,
    )

    states = torch.empty(n_chunks, n_heads, head_dim, d_state, **f32)                    # (NC, H, P, N)
    heads_per_group = n_heads // n_groups
    tiles = blocks.c == 1 and blocks.h == 1          # the GPU's launch: 2-D tiles, one chunk and head a program
    # what both forms of stage 2 take (the batched one also the chunk and head counts, which it cuts into blocks)
    operands = (x, B, delta, dA_cumsum, states, chunk_start, chunk_len)
    strides = (x.stride(0), x.stride(1), x.stride(2),
               B.stride(0), B.stride(1), B.stride(2),
               delta.stride(0), delta.stride(1),
               states.stride(0), states.stride(1), states.stride(2), states.stride(3))
    launch = dict(HOW_XB=how_xb, BLOCK_K=blocks.m, BLOCK_P=blocks.p, BLOCK_N=blocks.n_state, num_warps=blocks.warps,
                  num_stages=blocks.stages, **registers)
    state_tiles = cdiv(head_dim, blocks.p) * cdiv(d_state, blocks.n_state)
    if tiles:
        _ssd_chunk_state_tile_kernel[(n_heads, n_chunks, state_tiles)](
            *operands, head_dim, d_state, heads_per_group, *strides, **launch)
    else:
        _ssd_chunk_state_fwd_kernel[(head_blocks, chunk_blocks, state_tiles)](
            *operands, n_chunks, n_heads, head_dim, d_state, heads_per_group, *strides,
            BLOCK_C=blocks.c, BLOCK_H=blocks.h, **launch)

    # the states entering the chunks: in place over the chunks' own (fp32), or rounded to C's 16-bit dtype once here
    # rather than in every stage-4 program that reads them (products="rounded")
    states_in = (torch.empty(states.shape, dtype=C.dtype, device=x.device) if rounded and C.dtype in half
                 else states)
    _ssd_state_passing_fwd_kernel[(n_seqs, head_blocks,
                                   cdiv(head_dim, blocks.p) * cdiv(d_state, blocks.n_pass))](
        states, states_in, chunk_decay, seq_chunks,
        ssm_states, state_indices,
        has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state,
        n_heads, head_dim, d_state, ssm_states.shape[0],
        chunk_decay.stride(0),
        states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), ssm_states.stride(3),
        BLOCK_H=blocks.h, BLOCK_P=blocks.p, BLOCK_N=blocks.n_pass, ROUND_BY_BITS=interpreted(),
    )

    cb = torch.empty(n_chunks, n_groups, blocks.q, blocks.q, **f32)                     # (NC, G, Q, Q)
    group_blocks = cdiv(n_groups, blocks.h)
    _ssd_bmm_chunk_fwd_kernel[(group_blocks, chunk_blocks * m_blocks * m_blocks)](
        B, C, cb, chunk_start, chunk_len,
        n_chunks, n_groups, d_state,
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        cb.stride(0), cb.stride(1), cb.stride(2),
        HOW_CB=how_cb, M_BLOCKS=m_blocks, BLOCK_C=blocks.c, BLOCK_G=blocks.h, BLOCK_M=blocks.m,
        BLOCK_N=blocks.n_scan, num_warps=blocks.warps, num_stages=blocks.stages,
    )

    # stage 4's own tile and launch (0: the shared fields); the sweep varies them without touching the other stages
    scan_m, scan_p = blocks.scan_m or blocks.m, blocks.scan_p or blocks.p
    if scan_m > blocks.m:
        raise ValueError(f"stage 4's rows ({scan_m}) exceed the C·Bᵀ tile ({blocks.m}): "
                         "it would read tiles that were not written")
    scan_m_blocks = blocks.q // scan_m
    scan_k = blocks.scan_k or scan_m
    operands = (x, z if z is not None else x, C, cb, D if D is not None else A, delta, dA_cumsum, states_in, y,
                chunk_start, chunk_len)
    strides = (x.stride(0), x.stride(1), x.stride(2),
               *(z.stride() if z is not None else (0, 0, 0)),
               C.stride(0), C.stride(1), C.stride(2),
               cb.stride(0), cb.stride(1), cb.stride(2),
               delta.stride(0), delta.stride(1),
               states.stride(0), states.stride(1), states.stride(2), states.stride(3),
               y.stride(0), y.stride(1), y.stride(2))
    launch = dict(HAS_D=D is not None, HAS_Z=z is not None, HOW_CS=how_cs, HOW_X=how_x, M_BLOCKS=scan_m_blocks,
                  BLOCK_M=scan_m, BLOCK_K=scan_k, BLOCK_P=scan_p, BLOCK_N=blocks.n_scan,
                  num_warps=blocks.scan_warps or blocks.warps, num_stages=blocks.scan_stages or blocks.stages,
                  **scan_registers)
    # (an fp32 x on the GPU, whose products run as fp32 FMAs, keeps the batched kernel: the tile kernel's three
    # product loops spill there, 16-24 bytes, at any column step)
    if tiles and not (on_gpu and how_x == 3):
        if scan_m % scan_k:
            raise ValueError(f"stage 4's column step ({scan_k}) does not divide its rows ({scan_m})")
        _ssd_chunk_scan_tile_kernel[(n_heads, n_chunks * scan_m_blocks, cdiv(head_dim, scan_p))](
            *operands, head_dim, d_state, heads_per_group, *strides, **launch)
    else:
        _ssd_chunk_scan_fwd_kernel[(head_blocks, chunk_blocks * scan_m_blocks, cdiv(head_dim, scan_p))](
            *operands, n_chunks, n_heads, head_dim, d_state, heads_per_group, *strides,
            BLOCK_C=blocks.c, BLOCK_H=blocks.h, **launch)
    check()
    return y
