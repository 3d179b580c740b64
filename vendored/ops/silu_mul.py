"""SwiGLU's product silu(gate) · up in one pass, from one projection's output holding [gate | up] side by side.

Twin of `reference.ops.silu_mul_ref`. silu in fp32, rounded to the input's dtype, times up, rounded again: what
`F.silu(gate) * up` computes on 16-bit tensors, in one launch instead of two and without the silu's round trip
through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._rounding import interpreted, round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_rows, width, stride_in, stride_out,
                     BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """Rows BLOCK_ROWS·program_id(0) + [0, BLOCK_ROWS), columns BLOCK·program_id(1) + [0, BLOCK)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (offs < width)[None, :]
    rows = rows.to(tl.int64)[:, None]
    gate = tl.load(gate_up_ptr + rows * stride_in + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * stride_in + width + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, ROUND_BY_BITS).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + offs[None, :], round_to(silu * up, dtype, ROUND_BY_BITS), mask=mask)


LAUNCH_CHOOSERS = ("_launch",)


def _launch(n_rows: int, width: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) a program. GPU: 1024 columns of one row. Interpreter: a program costs ~10 ms whatever its
    size, so 64K values each."""
    if device.type == "cuda":
        return 1, 1024
    block = next_power_of_2(width)
    return min(next_power_of_2(n_rows), max(1, 65536 // block)), block


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2·I), gate in the first I columns and up in the last I, fp16/bf16/fp32, unit stride along the
    width. Returns silu(gate)·up (T, I) in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected (tokens, 2·intermediate), got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"gate_up: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected unit stride along the width, got strides {gate_up.stride()}")
    n_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block_rows, block = _launch(n_rows, width, gate_up.device)
    _silu_mul_kernel[(cdiv(n_rows, block_rows), cdiv(width, block))](
        gate_up, out, n_rows, width, gate_up.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, BLOCK=block, ROUND_BY_BITS=interpreted(), num_warps=4)
    return out
