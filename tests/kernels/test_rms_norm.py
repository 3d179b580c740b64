"""add_rms_norm against its twin add_rms_norm_ref: the sum bit for bit (it is one rounded add, as torch's), the
normalised rows element by element within the three-way bound; widths that are and are not powers of two, a partial
last block of rows, no residual, every float dtype, and bad inputs named."""

from __future__ import annotations

import pytest
import torch

from reference.ops import add_rms_norm_ref
from tests.kernels.common import DEVICE, assert_three_way, gpu, needs_gpu
from vendored.ops.rms_norm import add_rms_norm

K = 2.0
ULPS = 2.0   # the fp32 statistics may differ from torch's in their last bits (rsqrt against 1/sqrt): the normalised
             # value and its product with the weight may each round to a 16-bit dtype one step away from torch's
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def run_and_check(rows: int, width: int, dtype: torch.dtype, *, with_delta: bool = True, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn(rows, width, generator=gen)).to(DEVICE, dtype)
    delta = torch.randn(rows, width, generator=gen).to(DEVICE, dtype) if with_delta else None
    weight = (1.0 + 0.3 * torch.randn(width, generator=gen)).to(DEVICE, dtype)
    total, out = add_rms_norm(x, delta, weight, eps=EPS)
    ref_total, ref_low = add_rms_norm_ref(x, delta, weight, EPS)
    _, ref64 = add_rms_norm_ref(ref_total.double(), None, weight.double(), EPS)
    assert total.dtype == out.dtype == dtype, f"dtypes: expected {dtype}, got {total.dtype} and {out.dtype}"
    if with_delta:
        same = total == ref_total
        assert same.all(), (f"sum: {int((~same).sum())} of {same.numel()} elements differ from torch's rounded add; "
                            f"first at {tuple(int(i) for i in (~same).nonzero()[0])}")
    else:
        assert total is x, "without a residual the sum is x itself"
    assert_three_way("normed", out, ref64, ref_low, k=K, atol=ATOL[dtype], ulps=ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows, width", [(37, 64), (37, 100), (1, 48), (5, 1), (1100, 100)],
                         ids=["rows37-D64", "rows37-D100", "rows1-D48", "rows5-D1", "rows1100-several-programs"])
def test_add_then_norm(rows, width, dtype):
    run_and_check(rows, width, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_without_residual(dtype):
    run_and_check(19, 96, dtype, with_delta=False, seed=1)


def test_no_rows():
    x = torch.zeros(0, 64, device=DEVICE)
    total, out = add_rms_norm(x, torch.zeros_like(x), torch.ones(64, device=DEVICE), eps=EPS)
    assert total.shape == out.shape == (0, 64)


def test_row_view_of_a_wider_tensor():
    """x a row-strided view (a slice of a wider buffer's columns starting at 0 keeps unit stride along the width)."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(9, 160, generator=gen).to(DEVICE)
    x = wide[:, :64]
    delta = torch.randn(9, 64, generator=gen).to(DEVICE)
    weight = torch.rand(64, generator=gen).to(DEVICE) + 0.5
    total, out = add_rms_norm(x, delta, weight, eps=EPS)
    ref_total, ref_low = add_rms_norm_ref(x, delta, weight, EPS)
    _, ref64 = add_rms_norm_ref(ref_total.double(), None, weight.double(), EPS)
    assert torch.equal(total, ref_total), "sum of a strided view differs from torch's add"
    assert_three_way("normed", out, ref64, ref_low, k=K, atol=ATOL[torch.float32], ulps=ULPS)


@pytest.mark.parametrize("bad, message", [
    (lambda x: dict(x=x[None]), r"x.dim\(\): expected 2 \(tokens, width\), got 3"),
    (lambda x: dict(delta=x[:, :32].contiguous()), r"delta.shape: expected \(4, 64\), got \(4, 32\)"),
    (lambda x: dict(weight=torch.ones(32, device=x.device)), r"weight.shape: expected \(64,\), got \(32,\)"),
    (lambda x: dict(delta=x.half()), r"delta: expected x's dtype"),
    (lambda x: dict(x=x.long(), delta=None, weight=torch.ones(64, device=x.device, dtype=torch.long)),
     r"x: expected x's dtype, one of"),
    (lambda x: dict(delta=torch.zeros(64, 4, device=x.device).t()), r"delta: expected unit stride along the width"),
], ids=["3d", "delta-shape", "weight-shape", "delta-dtype", "integer-x", "column-major-delta"])
def test_rejects_bad_input(bad, message):
    x = torch.zeros(4, 64, device=DEVICE)
    args = dict(x=x, delta=torch.zeros_like(x), weight=torch.ones(64, device=DEVICE))
    args.update(bad(x))
    with pytest.raises((ValueError, TypeError), match=message):
        add_rms_norm(args["x"], args["delta"], args["weight"], eps=EPS)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 8, 1000])
def test_bamba_width(dtype, rows):
    run_and_check(rows, 4096, dtype, seed=3)
