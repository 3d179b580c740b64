"""silu_mul against its twin silu_mul_ref on every element, each float dtype, widths past one block, bad input."""

from __future__ import annotations

import pytest
import torch

from reference.ops import silu_mul_ref
from tests.kernels.common import DEVICE, assert_three_way, gpu, needs_gpu
from vendored.ops.silu_mul import silu_mul

K = 2.0
ULPS = 2.0   # the fp32 silu may differ from torch's in its last bits: each of the two roundings may land one step off
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def run_and_check(rows: int, width: int, dtype: torch.dtype, *, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = (4.0 * torch.randn(rows, 2 * width, generator=gen)).to(DEVICE, dtype)
    out = silu_mul(gate_up)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    ref_low = silu_mul_ref(gate, up)
    ref64 = silu_mul_ref(gate.double(), up.double())
    assert out.dtype == dtype and out.shape == (rows, width), f"got {out.dtype} {tuple(out.shape)}"
    assert_three_way("silu(gate)·up", out, ref64, ref_low, k=K, atol=ATOL[dtype], ulps=ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows, width", [(7, 64), (3, 150), (1, 1), (300, 1100)],
                         ids=["one-block", "partial-blocks", "one", "several-programs"])
def test_matches_twin(rows, width, dtype):
    run_and_check(rows, width, dtype)


def test_strided_rows():
    """gate_up a row-strided view: columns [0, 2I) of a wider buffer."""
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gate_up = wide[:, :256]
    out = silu_mul(gate_up)
    assert_three_way("strided", out, silu_mul_ref(gate_up[:, :128].double(), gate_up[:, 128:].double()),
                     silu_mul_ref(gate_up[:, :128], gate_up[:, 128:]), k=K, atol=ATOL[torch.float32])


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(4, 7), r"gate_up: expected \(tokens, 2·intermediate\), got shape \(4, 7\)"),
    (torch.zeros(4), r"gate_up: expected \(tokens, 2·intermediate\)"),
    (torch.zeros(4, 8, dtype=torch.long), r"gate_up: expected dtype in"),
    (torch.zeros(8, 4).t(), r"gate_up: expected unit stride along the width"),
], ids=["odd-width", "1d", "int", "column-major"])
def test_rejects_bad_input(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        silu_mul(bad.to(DEVICE))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_bamba_width(dtype, rows):
    run_and_check(rows, 14336, dtype, seed=2)
