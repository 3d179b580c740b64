"""Rounding of fp32 values to a 16-bit float when a kernel stores them: round to nearest, ties to even, everywhere.

On a GPU, `x.to(tl.bfloat16)` rounds to nearest even. The Triton interpreter (CPU, triton 3.6.0) converts fp32 to
bf16 by truncating the mantissa (rounding toward zero), and its `fp_downcast_rounding="rtne"` does not round to
nearest even either. A bf16 SSM state stored once per decode step then drifts toward zero, step after step: on the
tiny model that made the vendored engine's logprobs 10x further from the oracle's than the same schedule rounding
correctly (tests/kernels/test_rounding.py). So when interpreted, the kernels round to bf16 themselves, on the bits:
add 0x7FFF plus the lowest kept bit, keep the upper 16 bits and reinterpret them as bf16 (no conversion, so the
interpreter's flushing of subnormals does not apply either). NaN stays NaN (the carry could turn some into
infinities or zeros). fp16 is not affected: the interpreter
casts it with numpy, which rounds to nearest even.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs


def interpreted() -> bool:
    """Whether kernels launched now run in the Triton interpreter (TRITON_INTERPRET=1) rather than compiled."""
    return bool(knobs.runtime.interpret)


@triton.jit
def round_to(x, dtype: tl.constexpr, BY_BITS: tl.constexpr):
    """fp32 `x` converted to `dtype`, rounded to nearest even. BY_BITS: do the bf16 rounding in integer arithmetic
    (pass `interpreted()`); compiled kernels leave it to the hardware conversion."""
    if BY_BITS and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).to(tl.uint16)
        kept = tl.where(x != x, bits >> 16, rounded).to(tl.uint16)            # a NaN keeps its upper half: NaN
        return kept.to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
