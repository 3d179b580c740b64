"""One decode step of the Mamba2 selective state-space recurrence, forward only.

Twin of `reference.ops.selective_state_update_ref`. For each live row b (slot s = state_indices[b]), head h and its
group g = h // (H/G) (interleaved blocks of heads share a group, not h % G):
    Δ = clamp(softplus(dt[b, h] + dt_bias[h]), dt_limit)
    S[s, h] <- exp(Δ·A[h])·S[s, h] + Δ·x[b, h] ⊗ B[b, g]                 S[s, h] (P, N)
    y[b, h] = S[s, h]·C[b, g] + D[h]·x[b, h],  then · silu(z[b, h]) if z is given
A row whose slot is pad_slot_id reads and writes no slot and outputs 0. The recurrence runs in fp32 whatever the
pool's dtype; the new state is rounded to the pool's dtype only when stored, and y uses the unrounded one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._rounding import interpreted, round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _softplus(v):
    """log(1 + e^v) with torch's threshold; log1p by Goldberg's trick so that tiny e^v (v << 0) is not lost."""
    u = tl.exp(-tl.abs(v))
    one_plus_u = 1.0 + u
    log1p_u = tl.where(one_plus_u == 1.0, u, tl.log(one_plus_u) * (u / (one_plus_u - 1.0)))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)         # identity above 20, as torch's softplus


@triton.jit
def _selective_state_update_fwd_kernel(
    ssm_states_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr, state_indices_ptr, y_ptr,
    n_rows, n_heads, head_dim, d_state, heads_per_group, pad_slot_id, n_slots, dt_min, dt_max,
    stride_states_s, stride_states_h, stride_states_p, stride_states_n,
    stride_x_b, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_h,
    stride_A_h,
    stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n,
    stride_D_h,
    stride_dt_bias_h,
    stride_z_b, stride_z_h, stride_z_p,
    stride_y_b, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_PN: tl.constexpr, STATE_EVICTION: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
):
    """BLOCK_B rows × BLOCK_H heads (S pairs, row-major), BLOCK_P of each head's P channels, all N state columns
    (BLOCK_N >= N). EVEN_PN: BLOCK_P divides P and BLOCK_N == N, so only rows and heads need masks. STATE_EVICTION:
the cache eviction policy of the state's load and store ("" or "evict_first": read once, written once).

    One axis of programs, ordered P tiles fastest, then heads, then rows: programs that run at the same time read
    and write neighbouring pieces of one slot's (H, P, N) block, as a copy would (and no grid axis limits rows)."""
    pid = tl.program_id(0)
    n_tiles_p = tl.cdiv(head_dim, BLOCK_P)
    n_tiles_h = tl.cdiv(n_heads, BLOCK_H)
    pid_p = pid % n_tiles_p
    pid_bh = pid // n_tiles_p
    offs_s = tl.arange(0, BLOCK_B * BLOCK_H)                           # (S,) a (row, head) pair
    b = (pid_bh // n_tiles_h) * BLOCK_B + offs_s // BLOCK_H
    h = (pid_bh % n_tiles_h) * BLOCK_H + offs_s % BLOCK_H
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)                   # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)                                     # (BLOCK_N,)
    g = h // heads_per_group                                           # interleaved: heads [g·H/G, (g+1)·H/G)
    mask_s = (b < n_rows) & (h < n_heads)
    b = b.to(tl.int64)
    slot = tl.load(state_indices_ptr + b, mask=mask_s, other=pad_slot_id).to(tl.int64)
    # A padding row reads and writes no slot (nor any input) and outputs 0. A row whose slot lies outside the pool
    # (a bad index: a captured decode step cannot wait for the host to check it) touches no slot either, and outputs
    # NaN, so that the bad value shows instead of passing for padding.
    real = mask_s & (slot != pad_slot_id)                              # (S,)
    in_pool = (slot >= 0) & (slot < n_slots)
    live = real & in_pool
    if EVEN_PN:                                                        # masks broadcast along P and N
        mask_y = mask_s[:, None]                                       # (S, 1)
        live_p = live[:, None]                                         # (S, 1)
        live_n = live[:, None]
        live_pn = live[:, None, None]                                  # (S, 1, 1)
    else:
        mask_p = offs_p < head_dim
        live_p = live[:, None] & mask_p[None, :]                       # (S, BLOCK_P)
        live_n = live[:, None] & (offs_n < d_state)[None, :]           # (S, BLOCK_N)
        live_pn = live_p[:, :, None] & live_n[:, None, :]              # (S, BLOCK_P, BLOCK_N)
        mask_y = mask_s[:, None] & mask_p[None, :]

    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h, mask=live, other=0.0).to(tl.float32)   # (S,)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h * stride_dt_bias_h, mask=live, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(A_ptr + h * stride_A_h, mask=live, other=0.0).to(tl.float32))

    x = tl.load(x_ptr + b[:, None] * stride_x_b + h[:, None] * stride_x_h + offs_p[None, :] * stride_x_p,
                mask=live_p, other=0.0).to(tl.float32)                 # (S, BLOCK_P)
    B = tl.load(B_ptr + b[:, None] * stride_B_b + g[:, None] * stride_B_g + offs_n[None, :] * stride_B_n,
                mask=live_n, other=0.0).to(tl.float32)                 # (S, BLOCK_N)
    C = tl.load(C_ptr + b[:, None] * stride_C_b + g[:, None] * stride_C_g + offs_n[None, :] * stride_C_n,
                mask=live_n, other=0.0).to(tl.float32)
    state_ptrs = (ssm_states_ptr + (slot * stride_states_s + h * stride_states_h)[:, None, None]
                  + (offs_p[None, :, None] * stride_states_p + offs_n[None, None, :] * stride_states_n))
    state = tl.load(state_ptrs, mask=live_pn, other=0.0, eviction_policy=STATE_EVICTION).to(tl.float32)
    state = decay[:, None, None] * state + (dt[:, None] * x)[:, :, None] * B[:, None, :]
    tl.store(state_ptrs, round_to(state, ssm_states_ptr.dtype.element_ty, ROUND_BY_BITS), mask=live_pn,
             eviction_policy=STATE_EVICTION)

    y = tl.sum(state * C[:, None, :], axis=2)                          # (S, BLOCK_P)
    if HAS_D:
        y += tl.load(D_ptr + h * stride_D_h, mask=live, other=0.0).to(tl.float32)[:, None] * x
    if HAS_Z:
        z = tl.load(z_ptr + b[:, None] * stride_z_b + h[:, None] * stride_z_h + offs_p[None, :] * stride_z_p,
                    mask=live_p, other=0.0).to(tl.float32)
        y *= z / (1.0 + tl.exp(-z))
    y = tl.where(live[:, None], y, tl.where(real & ~in_pool, float("nan"), 0.0)[:, None])
    tl.store(y_ptr + b[:, None] * stride_y_b + h[:, None] * stride_y_h + offs_p[None, :] * stride_y_p,
             round_to(y, y_ptr.dtype.element_ty, ROUND_BY_BITS), mask=mask_y)


@triton.jit
def _selective_state_update_tile_kernel(
    ssm_states_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr, state_indices_ptr, y_ptr,
    n_rows, n_heads, head_dim, d_state, heads_per_group, pad_slot_id, n_slots, dt_min, dt_max,
    stride_states_s, stride_states_h, stride_states_p, stride_states_n,
    stride_x_b, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_h,
    stride_A_h,
    stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n,
    stride_D_h,
    stride_dt_bias_h,
    stride_z_b, stride_z_h, stride_z_p,
    stride_y_b, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_PN: tl.constexpr,
    STATE_EVICTION: tl.constexpr, ROUND_BY_BITS: tl.constexpr, ROWS_INNER: tl.constexpr, Y_FIRST: tl.constexpr,
    WIDE_ROWS: tl.constexpr,
):
    """The GPU's form of the kernel above: one row and one head a program, BLOCK_P of its channels × all N, so that
    the row, head, slot and Δ are scalars and the tiles 2-D. Same equations and the same fp32 operations in the same
    order; same program order (P tiles fastest, then heads, then rows).

    What a decode step waits for is a chain of dependent loads. The slot is loaded first and the state right after
    it; the row's own inputs (x, dt, B, C, z: in bounds whatever the slot) are loaded without waiting for the slot,
    so that Δ and its exponential are computed while the state is in flight. A padding row or one whose slot lies
    outside the pool still reads and writes no slot.

    Two choices of SsuLaunch change only the order of work, never a value: ROWS_INNER takes a 3-D grid (channel
    tiles, rows, heads), so that programs launched together hold one head of many rows instead of many heads of one
    row, and the row index stays 32-bit unless WIDE_ROWS (some row offset of x, dt, B, C, z or y reaches 2^31);
    Y_FIRST stores y before the state, so that the state's store is the program's last instruction."""
    if ROWS_INNER:
        pid_p = tl.program_id(0)
        b = tl.program_id(1)
        if WIDE_ROWS:
            b = b.to(tl.int64)
        h = tl.program_id(2)
    else:
        pid = tl.program_id(0)
        n_tiles_p = tl.cdiv(head_dim, BLOCK_P)
        pid_p = pid % n_tiles_p
        pid_bh = pid // n_tiles_p
        b = (pid_bh // n_heads).to(tl.int64)
        h = pid_bh % n_heads
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)                   # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)                                     # (BLOCK_N,)

    slot = tl.load(state_indices_ptr + b).to(tl.int64)
    real = slot != pad_slot_id
    live = real & (slot >= 0) & (slot < n_slots)
    if EVEN_PN:                                                        # the row's inputs need no mask
        mask_p = None
        mask_n = None
        fill = None
        live_pn = live
    else:
        mask_p = offs_p < head_dim
        mask_n = offs_n < d_state
        fill = 0.0
        live_pn = live & mask_p[:, None] & mask_n[None, :]
    state_ptrs = (ssm_states_ptr + slot * stride_states_s + h * stride_states_h
                  + offs_p[:, None] * stride_states_p + offs_n[None, :] * stride_states_n)
    state = tl.load(state_ptrs, mask=live_pn, other=0.0, eviction_policy=STATE_EVICTION).to(tl.float32)

    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h * stride_dt_bias_h).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(A_ptr + h * stride_A_h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p * stride_x_p, mask=mask_p,
                other=fill).to(tl.float32)                              # (BLOCK_P,)
    B = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_n * stride_B_n, mask=mask_n,
                other=fill).to(tl.float32)                              # (BLOCK_N,)
    C = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n * stride_C_n, mask=mask_n,
                other=fill).to(tl.float32)

    state = decay * state + (dt * x)[:, None] * B[None, :]
    if not Y_FIRST:
        tl.store(state_ptrs, round_to(state, ssm_states_ptr.dtype.element_ty, ROUND_BY_BITS), mask=live_pn,
                 eviction_policy=STATE_EVICTION)

    y = tl.sum(state * C[None, :], axis=1)                             # (BLOCK_P,)
    if HAS_D:
        y += tl.load(D_ptr + h * stride_D_h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + offs_p * stride_z_p, mask=mask_p,
                    other=fill).to(tl.float32)
        y *= z / (1.0 + tl.exp(-z))
    # padding: 0; a slot outside the pool: NaN, so that the bad value shows instead of passing for padding
    y = tl.where(live, y, tl.where(real, float("nan"), 0.0))
    tl.store(y_ptr + b * stride_y_b + h * stride_y_h + offs_p * stride_y_p,
             round_to(y, y_ptr.dtype.element_ty, ROUND_BY_BITS), mask=mask_p)
    if Y_FIRST:
        tl.store(state_ptrs, round_to(state, ssm_states_ptr.dtype.element_ty, ROUND_BY_BITS), mask=live_pn,
                 eviction_policy=STATE_EVICTION)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------


def _expect(name: str, what: str, expected, got) -> None:
    if expected != got:
        raise ValueError(f"{name}: expected {what + ' ' if what else ''}{expected}, got {got}")


def _expect_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")


_GRID_YZ_MAX = 65535                                                   # CUDA's limit on a grid's y and z


def _last_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes into t: sum over dims of (size - 1)·|stride| (0 when empty)."""
    return 0 if t.numel() == 0 else sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


class SsuLaunch(NamedTuple):
    """How the op is launched: each program takes block_b rows × block_h heads × block_p channels × all N; one row
    and one head (the GPU's choice) runs the 2-D tile kernel, anything else the batched one. The last two fields are
    the tile kernel's (the batched kernel refuses them): rows_inner orders its programs channel tiles, rows, heads
    (a 3-D grid) instead of channel tiles, heads, rows; y_first stores y before the state."""
    block_b: int
    block_h: int
    block_p: int
    num_warps: int
    state_eviction: str = ""                                           # "" or "evict_first"
    rows_inner: bool = False
    y_first: bool = False


def _block_sizes(n_rows: int, n_heads: int, head_dim: int, d_state: int, state_dtype: torch.dtype,
                 device: torch.device) -> SsuLaunch:
    """GPU: one row and one head per program (the 2-D tile kernel), and a tile of the head's (P, N) state of 512
    elements (fp32 pool) or 2048 (16-bit pool), one warp: many small programs keep enough loads in flight on every SM
    at batch 1 and at batch 256 alike; bench/sweep_norm_ssu.py times the alternatives (on the tile kernel,
    2026-12-04, fp32 pool: 8 channels a program about 2% faster at batch 64 and 256, nothing faster at batch 1 and 8
    in two runs). With an fp32 pool, y is stored before the state, and up to 8 rows the programs run rows inside
    heads (measured on an H200, docs/kernels.md: together 1.08x vLLM at batch 1 and at parity at batch 8, where
    the old order was 0.99x both; rows inside heads is 5% slower at batch 64 and 256, storing y first 2-11% slower
    with a bf16 pool).
    Interpreter, where every program costs the same fixed time: up to 4 rows, 4 heads and 16 channels per program,
    so that tests with more rows, heads or channels than that still cross tile edges."""
    if device.type == "cuda":
        elements, warps = (512, 1) if state_dtype.itemsize >= 4 else (2048, 1)
        block_p = max(1, min(elements // next_power_of_2(d_state), next_power_of_2(head_dim)))
        if state_dtype.itemsize < 4:
            return SsuLaunch(1, 1, block_p, warps)
        return SsuLaunch(1, 1, block_p, warps, rows_inner=n_rows <= 8, y_first=True)
    return SsuLaunch(4, min(next_power_of_2(n_heads), 4), min(next_power_of_2(head_dim), 16), 4)


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    state_indices: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the recurrence for a batch of sequences (same equations as ssd_scan).

    ssm_states (S, H, P, N) fp32/bf16/fp16, updated in place; x (B, H, P); dt (B, H); A (H,); B, C (B, G, N) with
    G dividing H; D (H,) or None; dt_bias (H,) or None; z (B, H, P) or None; state_indices (B,) int, distinct among
    live rows; rows with state_indices == pad_slot_id are padding: not read, not written, output zero. Any strides.
    Returns y (B, H, P) in x's dtype promoted with the pool's, or written into `out` (B, H, P), any float dtype and
    strides, rounded to nearest even once from the fp32 result (as `.to(out.dtype)` of the returned y would round
    it) and returned. No device-to-host copy (capturable in a CUDA graph),
    so slot values are not checked on the host: a row whose slot is outside the pool (and not the pad slot) reads
    and writes no slot and outputs NaN.
    """
    _expect("x.dim()", "", 3, x.dim())
    n_rows, n_heads, head_dim = x.shape
    _expect("ssm_states.dim()", "", 4, ssm_states.dim())
    _expect("ssm_states.shape[1:3]", "(H, P) of x,", (n_heads, head_dim), tuple(ssm_states.shape[1:3]))
    d_state = ssm_states.shape[3]
    _expect("B.dim()", "", 3, B.dim())
    n_groups = B.shape[1]
    if n_groups == 0 or n_heads % n_groups:
        raise ValueError(f"B.shape[1]: expected a group count G dividing H = {n_heads}, got {n_groups}")
    expected = {
        "dt": (n_rows, n_heads), "A": (n_heads,), "B": (n_rows, n_groups, d_state), "C": (n_rows, n_groups, d_state),
        "D": (n_heads,), "dt_bias": (n_heads,), "z": (n_rows, n_heads, head_dim), "state_indices": (n_rows,),
    }
    given = {"dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "z": z, "state_indices": state_indices}
    for name, t in given.items():
        if t is None:
            continue
        _expect(f"{name}.shape", "", expected[name], tuple(t.shape))
        _expect(f"{name}.device", "the device of x,", x.device, t.device)
        if name == "state_indices":
            if t.dtype not in _INDEX_DTYPES:
                raise TypeError(f"state_indices: expected dtype torch.int32 or torch.int64, got {t.dtype}")
        else:
            _expect_float(name, t)
    _expect_float("x", x)
    _expect_float("ssm_states", ssm_states)
    _expect("ssm_states.device", "the device of x,", x.device, ssm_states.device)
    dt_min, dt_max = dt_limit
    if not dt_min <= dt_max:
        raise ValueError(f"dt_limit: expected (low, high) with low <= high, got {dt_limit}")

    if out is None:
        y = torch.empty((n_rows, n_heads, head_dim), dtype=torch.promote_types(x.dtype, ssm_states.dtype),
                        device=x.device)
    else:
        _expect("out.shape", "", (n_rows, n_heads, head_dim), tuple(out.shape))
        _expect("out.device", "the device of x,", x.device, out.device)
        _expect_float("out", out)
        y = out
    if n_rows == 0:
        return y
    launch = _block_sizes(n_rows, n_heads, head_dim, d_state, ssm_states.dtype, x.device)
    block_n = next_power_of_2(d_state)
    stand_in = A                                                       # never read when its flag is False
    D_arg, dt_bias_arg = (D if D is not None else stand_in), (dt_bias if dt_bias is not None else stand_in)
    z_arg = z if z is not None else x
    tile = launch.block_b == launch.block_h == 1                      # the GPU's launch (see _block_sizes)
    kernel = _selective_state_update_tile_kernel if tile else _selective_state_update_fwd_kernel
    grid = (cdiv(n_rows, launch.block_b) * cdiv(n_heads, launch.block_h) * cdiv(head_dim, launch.block_p),)
    if tile:
        if launch.rows_inner:
            if max(n_rows, n_heads) > _GRID_YZ_MAX:
                raise ValueError(f"SsuLaunch.rows_inner: a grid of {n_rows} rows × {n_heads} heads exceeds the "
                                 f"{_GRID_YZ_MAX} programs a grid's 2nd and 3rd axes hold")
            grid = (cdiv(head_dim, launch.block_p), n_rows, n_heads)
        row_tensors = (x, dt, B, C, z_arg, y)
        blocks = dict(BLOCK_P=launch.block_p, ROWS_INNER=launch.rows_inner, Y_FIRST=launch.y_first,
                      WIDE_ROWS=max(_last_offset(t) for t in row_tensors) >= 2**31)
    else:
        if launch.rows_inner or launch.y_first:
            raise ValueError(f"SsuLaunch: rows_inner and y_first are the tile kernel's (block_b = block_h = 1), "
                             f"got {launch}")
        blocks = dict(BLOCK_B=launch.block_b, BLOCK_H=launch.block_h, BLOCK_P=launch.block_p)
    kernel[grid](
        ssm_states, x, dt, A, B, C, D_arg, dt_bias_arg, z_arg, state_indices, y,
        n_rows, n_heads, head_dim, d_state, n_heads // n_groups, pad_slot_id, ssm_states.shape[0], float(dt_min),
        float(dt_max),
        *ssm_states.stride(),
        *x.stride(),
        *dt.stride(),
        A.stride(0),
        *B.stride(),
        *C.stride(),
        D_arg.stride(0),
        dt_bias_arg.stride(0),
        *z_arg.stride(),
        *y.stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus,
        HAS_DT_LIMIT=dt_min > 0.0 or dt_max < math.inf,
        BLOCK_N=block_n, **blocks,
        EVEN_PN=head_dim % launch.block_p == 0 and d_state == block_n, STATE_EVICTION=launch.state_eviction,
        ROUND_BY_BITS=interpreted(), num_warps=launch.num_warps,
    )
    return y
