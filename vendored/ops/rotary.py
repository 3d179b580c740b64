"""NeoX (rotate-half) rotary embedding, in place, on the first heads of a (tokens, heads, head_dim) tensor.

Twin of `reference.ops.rotary_ref` (which computes its angles itself; here they come from the engine's fp32 tables).
For token t at position p = positions[t] and each of the first `n_rot_heads` heads, the first R = cos.shape[1] dims
(two halves a, b of R/2) become
    a·cos[p] − b·sin[p],   b·cos[p] + a·sin[p]
in fp32, rounded to the tensor's dtype; dims past R and heads past n_rot_heads are left as they are. With q, k and v
side by side in one projection's output (heads q..., k..., v...), one launch rotates q and k and leaves v.

Why a kernel: in torch the table gathers, casts, the rotate-half concatenation and the products are about a dozen
launches for q and a dozen for k in every attention layer of every decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv, next_power_of_2
from ._rounding import interpreted, round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotary_kernel(t_ptr, positions_ptr, cos_ptr, sin_ptr, n_pairs, n_rot_heads, half,
                   stride_t, stride_h, stride_table,
                   BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """Rows BLOCK_ROWS·program_id(0) + [0, BLOCK_ROWS) of the (token, head) pairs, token-major: row r is head
    r % n_rot_heads of token r // n_rot_heads."""
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = pairs < n_pairs
    token, head = pairs // n_rot_heads, pairs % n_rot_heads
    offs = tl.arange(0, BLOCK_R)
    mask = live[:, None] & (offs < half)[None, :]
    position = tl.load(positions_ptr + token, mask=live, other=0).to(tl.int64)[:, None]
    cos = tl.load(cos_ptr + position * stride_table + offs[None, :], mask=mask, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + offs[None, :], mask=mask, other=0.0)
    first = t_ptr + (token * stride_t + head * stride_h)[:, None] + offs[None, :]
    a = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    dtype = t_ptr.dtype.element_ty
    tl.store(first, round_to(a * cos - b * sin, dtype, ROUND_BY_BITS), mask=mask)
    tl.store(first + half, round_to(b * cos + a * sin, dtype, ROUND_BY_BITS), mask=mask)


LAUNCH_CHOOSERS = ("_launch",)


def _launch(n_pairs: int, block_r: int, device: torch.device) -> int:
    """(token, head) pairs a program. GPU: 4K values (Bamba-9B, R 64: 128 pairs, a decode step's q and k in one or
    two programs). Interpreter: a program costs ~10 ms whatever its size, so 64K values each."""
    return min(next_power_of_2(n_pairs), max(1, (4096 if device.type == "cuda" else 65536) // block_r))


def rotary_(t: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            n_rot_heads: int | None = None) -> torch.Tensor:
    """Rotate the first R dims of heads [0, n_rot_heads) of t in place; returns t.

    t (T, heads, Dh) fp16/bf16/fp32 with unit stride along Dh; positions (T,) integer; cos, sin (L, R) fp32 tables,
    the two halves of each row equal (row p: the angles of position p, repeated), R even and <= Dh, every position
    < L. n_rot_heads: default all heads.
    """
    if t.dim() != 3:
        raise ValueError(f"t.dim(): expected 3 (tokens, heads, head_dim), got {t.dim()}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"t: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
    if t.stride(2) != 1:
        raise ValueError(f"t: expected unit stride along head_dim, got strides {t.stride()}")
    n_tokens, heads, head_dim = t.shape
    n_rot_heads = heads if n_rot_heads is None else n_rot_heads
    if not 0 <= n_rot_heads <= heads:
        raise ValueError(f"n_rot_heads: expected 0..{heads}, got {n_rot_heads}")
    if positions.shape != (n_tokens,) or positions.dtype.is_floating_point or positions.is_complex():
        raise ValueError(f"positions: expected an integer tensor of shape ({n_tokens},), got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.dtype != torch.float32 or table.stride(1) != 1:
            raise ValueError(f"{name}: expected a (positions, rotary_dim) fp32 table with unit inner stride, got "
                             f"{table.dtype} {tuple(table.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos and sin: expected one shape and layout, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rotary_dim = cos.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos.shape[1] (the rotary dims): expected an even number in 2..{head_dim}, got {rotary_dim}")
    for name, other in (("positions", positions), ("cos", cos), ("sin", sin)):
        if other.device != t.device:
            raise ValueError(f"{name}.device: expected the device of t, {t.device}, got {other.device}")
    if n_tokens == 0 or n_rot_heads == 0:
        return t
    block_r = next_power_of_2(rotary_dim // 2)
    n_pairs = n_tokens * n_rot_heads
    block_rows = _launch(n_pairs, block_r, t.device)
    _rotary_kernel[(cdiv(n_pairs, block_rows),)](
        t, positions, cos, sin, n_pairs, n_rot_heads, rotary_dim // 2,
        t.stride(0), t.stride(1), cos.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_R=block_r, ROUND_BY_BITS=interpreted(), num_warps=4,
    )
    return t
