"""Gated RMSNorm of the Mamba2 mixer over groups of channels, forward only.

Twin of `reference.ops.rms_norm_gated_ref`. Each row's D· channels are split into D·/group_size groups (Bamba:
group size H·P/G, one group per B/C group) and normalised separately:
    norm_before_gate=False (Bamba):  w · rms_g(x · silu(gate))
    norm_before_gate=True:           w · rms_g(x) · silu(gate)
with rms_g(h) = h / sqrt(mean_g(h²) + eps). Statistics and arithmetic in fp32; the result is stored in x's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_gated(x_rows, gate_rows, offs, mask, stride_x_d, stride_gate_d,
                HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, EVICTION: tl.constexpr):
    """One piece of x in fp32, already times silu(gate) when the gate comes before the norm, and silu(gate)."""
    h = tl.load(x_rows + offs[None, :] * stride_x_d, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    silu_gate = h                                                      # unused unless HAS_GATE
    if HAS_GATE:
        gate = tl.load(gate_rows + offs[None, :] * stride_gate_d, mask=mask, other=0.0,
                       eviction_policy=EVICTION).to(tl.float32)
        silu_gate = gate / (1.0 + tl.exp(-gate))
        if not NORM_BEFORE_GATE:
            h *= silu_gate
    return h, silu_gate


@triton.jit
def _store_normed(out_rows, weight_ptr, h, silu_gate, inv_rms, offs, mask, mask_d, stride_out_d, stride_weight_d,
                  HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    weight = tl.load(weight_ptr + offs * stride_weight_d, mask=mask_d, other=0.0).to(tl.float32)
    h = h * inv_rms[:, None] * weight[None, :]
    if HAS_GATE and NORM_BEFORE_GATE:
        h *= silu_gate
    tl.store(out_rows + offs[None, :] * stride_out_d, h.to(out_rows.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_gated_fwd_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr,
    n_rows, group_size, eps,
    stride_x_t, stride_x_d,
    stride_gate_t, stride_gate_d,
    stride_weight_d,
    stride_out_t, stride_out_d,
    HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, EVICTION: tl.constexpr,
):
    """BLOCK_ROWS rows, group g. ONE_PASS (the group fits in BLOCK_D): x and the gate are read once and kept;
    otherwise two passes over the group's channels in BLOCK_D pieces (sum of squares, then write; the second
    pass's reads mostly hit L2). EVICTION: the cache eviction policy of the loads of x and the gate ("" or
    "evict_first"; the second pass of two reads with the default policy)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)   # (BLOCK_ROWS,)
    mask_t = (rows < n_rows)[:, None]                                  # (BLOCK_ROWS, 1)
    rows = rows.to(tl.int64)[:, None]
    group_start = tl.program_id(1) * group_size
    x_rows = x_ptr + rows * stride_x_t                                 # (BLOCK_ROWS, 1)
    gate_rows = gate_ptr + rows * stride_gate_t
    out_rows = out_ptr + rows * stride_out_t

    if ONE_PASS:
        offs = group_start + tl.arange(0, BLOCK_D)                     # (BLOCK_D,) channel index in the row
        mask_d = offs < group_start + group_size
        mask = mask_t & mask_d[None, :]                                # (BLOCK_ROWS, BLOCK_D)
        h, silu_gate = _load_gated(x_rows, gate_rows, offs, mask, stride_x_d, stride_gate_d, HAS_GATE,
                                   NORM_BEFORE_GATE, EVICTION)
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / group_size + eps)   # (BLOCK_ROWS,)
        _store_normed(out_rows, weight_ptr, h, silu_gate, inv_rms, offs, mask, mask_d, stride_out_d,
                      stride_weight_d, HAS_GATE, NORM_BEFORE_GATE)
    else:
        sum_sq = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        for start in range(0, group_size, BLOCK_D):
            offs = group_start + start + tl.arange(0, BLOCK_D)
            mask = mask_t & (offs < group_start + group_size)[None, :]
            h, _ = _load_gated(x_rows, gate_rows, offs, mask, stride_x_d, stride_gate_d, HAS_GATE and not
                               NORM_BEFORE_GATE, NORM_BEFORE_GATE, "")
            sum_sq += h * h
        inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / group_size + eps)

        for start in range(0, group_size, BLOCK_D):
            offs = group_start + start + tl.arange(0, BLOCK_D)
            mask_d = offs < group_start + group_size
            mask = mask_t & mask_d[None, :]
            h, silu_gate = _load_gated(x_rows, gate_rows, offs, mask, stride_x_d, stride_gate_d, HAS_GATE,
                                       NORM_BEFORE_GATE, EVICTION)
            _store_normed(out_rows, weight_ptr, h, silu_gate, inv_rms, offs, mask, mask_d, stride_out_d,
                          stride_weight_d, HAS_GATE, NORM_BEFORE_GATE)


class NormLaunch(NamedTuple):
    """How the kernel is launched: each program takes block_rows rows of one group, block_d channels at a time."""
    block_rows: int
    block_d: int
    num_warps: int
    eviction: str = ""                                                 # of x's and the gate's loads


def _block_sizes(group_size: int, device: torch.device) -> NormLaunch:
    """GPU: one row per program and the whole group in one piece up to 8192 channels (Bamba's H·P/G), read once
    and kept in registers, by 16 warps at 8192 (16 fp32 values a thread; on an H200 on 2026-11-30 16 and 32 warps
    were 13% faster than 8 at 32K tokens); bench/sweep_norm_ssu.py times the alternatives. Interpreter, where every
    program costs the same fixed time: 64 rows per program, and 32-channel pieces so that groups wider than 32 are
    read in two passes, as the GPU reads groups wider than 8192, and groups up to 32 in one, as the GPU reads
    Bamba's."""
    if device.type == "cuda":
        block_d = min(next_power_of_2(group_size), 8192)
        return NormLaunch(1, block_d, 16 if block_d >= 8192 else 8 if block_d >= 2048 else 4)
    return NormLaunch(64, min(next_power_of_2(group_size), 32), 4)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels (Bamba: group size H·P/G, gate before the norm).

    x (..., D·) and gate (..., D·) or None, fp16/bf16/fp32; weight (D·,); group_size divides D·.
    norm_before_gate=False: w·rms_g(x·silu(gate)); True: w·rms_g(x)·silu(gate). Statistics in fp32.
    Returns a tensor of x's shape and dtype.
    """
    if x.dim() < 1:
        raise ValueError("x.dim(): expected at least 1, got 0")
    width = x.shape[-1]
    for name, t, shape in (("x", x, x.shape), ("gate", gate, x.shape), ("weight", weight, (width,))):
        if t is None:
            continue
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
        if t.shape != shape:
            raise ValueError(f"{name}.shape: expected {tuple(shape)}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name}.device: expected the device of x, {x.device}, got {t.device}")
    if group_size <= 0 or width % group_size:
        raise ValueError(f"group_size: expected a positive divisor of the width {width}, got {group_size}")

    x_rows = x.reshape(-1, width)                                      # (T, D·), a view when strides allow
    gate_rows = gate.reshape(-1, width) if gate is not None else x_rows
    out = torch.empty(x_rows.shape, dtype=x.dtype, device=x.device)    # (T, D·)
    if out.numel() == 0:
        return out.reshape(x.shape)
    n_rows = x_rows.shape[0]
    launch = _block_sizes(group_size, x.device)
    _rms_norm_gated_fwd_kernel[(cdiv(n_rows, launch.block_rows), width // group_size)](
        x_rows, gate_rows, weight, out,
        n_rows, group_size, eps,
        x_rows.stride(0), x_rows.stride(1),
        gate_rows.stride(0), gate_rows.stride(1),
        weight.stride(0),
        out.stride(0), out.stride(1),
        HAS_GATE=gate is not None, NORM_BEFORE_GATE=norm_before_gate, ONE_PASS=launch.block_d >= group_size,
        BLOCK_ROWS=launch.block_rows, BLOCK_D=launch.block_d, EVICTION=launch.eviction, num_warps=launch.num_warps,
    )
    return out.reshape(x.shape)
