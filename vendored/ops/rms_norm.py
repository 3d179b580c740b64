"""The residual add and the RMSNorm after it, in one pass: the decoder layer's `h = h + delta; x = rms(h)`.

Twin of `reference.ops.add_rms_norm_ref`. For each row of x (T, D) and delta (T, D) or None:
    s = x + delta                       (in x's dtype: the fp32 sum rounded once, as torch adds two 16-bit tensors)
    n = w · round(s / sqrt(mean(s²) + eps))
with the statistics in fp32, the normalised row rounded to x's dtype before the weight multiplies it and the product
rounded again: the arithmetic of HF's Bamba RMSNorm (`weight * hidden.to(input_dtype)`), so the engine rounds where
the model it serves does. Returns (s, n); s is x itself when delta is None.

Why a kernel: in torch the add and the norm are ~8 launches (cast, square, mean, add, rsqrt, multiply, cast,
multiply), and a decode step of a small batch runs them 2·layers + 1 times; each is a few microseconds of a step
whose weights read in ~0.5 ms (bench/decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._rounding import interpreted, round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr,
    n_rows, width, eps,
    stride_x, stride_delta, stride_sum, stride_out,
    HAS_DELTA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BY_BITS: tl.constexpr,
):
    """BLOCK_ROWS rows, each whole in BLOCK_D >= width lanes."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (offs < width)[None, :]        # (BLOCK_ROWS, BLOCK_D)
    rows = rows.to(tl.int64)[:, None]
    dtype = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + rows * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        s += tl.load(delta_ptr + rows * stride_delta + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        s_low = round_to(s, dtype, ROUND_BY_BITS)
        tl.store(sum_ptr + rows * stride_sum + offs[None, :], s_low, mask=mask)
        s = s_low.to(tl.float32)                                       # the norm sees the stored sum
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / width + eps)        # (BLOCK_ROWS,)
    normed = round_to(s * inv_rms[:, None], dtype, ROUND_BY_BITS).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=offs < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + offs[None, :], round_to(normed * weight[None, :], dtype, ROUND_BY_BITS),
             mask=mask)


LAUNCH_CHOOSERS = ("_launch",)


def _launch(rows: int, width: int, device: torch.device) -> tuple[int, int, int]:
    """(rows per program, lanes, warps). GPU: one row per program, the whole row in registers (Bamba-9B: 4096
    channels, 8 fp32 values a thread at 16 warps; at 8 warps the fp32 kernel with a residual spilled, by the compile
    check). Interpreter: every row in as few programs as 64K values allow
    (a program costs ~10 ms there whatever its size: numpy does the elements)."""
    block_d = next_power_of_2(width)
    if device.type == "cuda":
        return 1, block_d, 16 if block_d >= 4096 else 8 if block_d >= 2048 else 4
    return min(next_power_of_2(rows), max(1, 65536 // block_d)), block_d, 4


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, *,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) · weight), or (x, RMSNorm(x) · weight) when delta is None.

    x, delta (T, D), fp16/bf16/fp32, the same dtype; weight (D,) of x's dtype. Rows up to 65536 wide.
    """
    if x.dim() != 2:
        raise ValueError(f"x.dim(): expected 2 (tokens, width), got {x.dim()}")
    width = x.shape[1]
    for name, t, shape in (("x", x, x.shape), ("delta", delta, x.shape), ("weight", weight, (width,))):
        if t is None:
            continue
        if t.dtype != x.dtype or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected x's dtype, one of {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}.shape: expected {tuple(shape)}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name}.device: expected the device of x, {x.device}, got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride along the width, got strides {t.stride()}")
    if not 0 < width <= 65536:
        raise ValueError(f"x.shape[1]: expected a width in 1..65536, got {width}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = out if delta is None else torch.empty_like(out)
    if x.shape[0] == 0:
        return (x if delta is None else total), out
    block_rows, block_d, warps = _launch(x.shape[0], width, x.device)
    _add_rms_norm_kernel[(cdiv(x.shape[0], block_rows),)](
        x, x if delta is None else delta, weight, total, out,
        x.shape[0], width, eps,
        x.stride(0), (x if delta is None else delta).stride(0), total.stride(0), out.stride(0),
        HAS_DELTA=delta is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d, ROUND_BY_BITS=interpreted(),
        num_warps=warps,
    )
    return (x if delta is None else total), out
