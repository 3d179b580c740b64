"""How the SSD scan's products keep fp32 accuracy whatever the input dtypes (the docstring of
vendored/ops/ssd_scan_kernels.py says why and when): _dot, one product in one of the ways its table lists, chosen on
the host for each product (vendored/ops/ssd_scan.py); _bdot, its batched form; and the exact bf16 split (_bf16x3)
behind the tensor-core products of an fp32 operand.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rounding import round_to


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
