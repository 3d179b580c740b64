"""row_top_k against its twin torch.topk(ranking._keys(x), k).indices: every index of every row, equal tensors; the
norm of row_top_k_and_norm against reference.ops.log_softmax_norm_ref (fp64): every row's shift exactly, its log-sum
within what fp32 sums and exponentials allow, the special values (NaN, ±inf) as documented.

Rows of normal values, of a handful of levels (ties everywhere, at the k-th place too), of special values (signed
zeros, subnormals of both signs, ±inf, NaN with either sign bit and with a signalling payload), all-equal rows; widths
of one block, of several, with a partial last block, and of several merge pieces (under the interpreter a block is 128
entries in 32 groups of 4, and a merge piece 32 candidates); k in {1, 2, 8, 16} and k == V.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.common import DEVICE, gpu, needs_gpu
from vendored.engine.ranking import _keys
from reference.ops import log_softmax_norm_ref
from vendored.ops.row_top_k import row_top_k, row_top_k_and_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# Bit patterns, per dtype: +NaN, -NaN (sign bit set), +sNaN-like and -sNaN-like payloads, the smallest subnormals.
_BITS = {
    torch.float32: (torch.int32, [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x00000001, 0x80000001]),
    torch.bfloat16: (torch.int16, [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x0001, 0x8001]),
    torch.float16: (torch.int16, [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x0001, 0x8001]),
}


def from_bits(dtype: torch.dtype) -> torch.Tensor:
    """The values of _BITS[dtype] in dtype, built from their bits (a conversion could drop a NaN's sign bit)."""
    int_dtype, patterns = _BITS[dtype]
    width = torch.iinfo(int_dtype).bits
    signed = [p - (1 << width) if p >= 1 << (width - 1) else p for p in patterns]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


def special_row(width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A row of a few levels among which NaNs of both signs, ±inf, ±0.0 and ±subnormals recur, in random places."""
    pool = torch.cat([from_bits(dtype),
                      torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0, 0.5], dtype=dtype)])
    return pool[torch.randint(0, len(pool), (width,), generator=gen)]


def make_rows(width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(4, width): normal values; five levels (ties at every place); special values; one value repeated."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(width, generator=gen).to(dtype)
    levels = (torch.randint(-2, 3, (width,), generator=gen) * 0.25).to(dtype)
    special = special_row(width, dtype, gen)
    equal = torch.full((width,), -1.5, dtype=dtype)
    return torch.stack([normal, levels, special, equal]).to(DEVICE)


def assert_ranked(x: torch.Tensor, k: int) -> None:
    got = row_top_k(x, k)
    want = torch.topk(_keys(x), k, dim=-1).indices
    assert got.dtype == torch.int64, f"indices.dtype: expected torch.int64, got {got.dtype}"
    assert got.shape == want.shape, f"indices.shape: expected {tuple(want.shape)}, got {tuple(got.shape)}"
    if not torch.equal(got, want):
        row = int((got != want).any(dim=1).nonzero()[0, 0])
        raise AssertionError(f"indices differ first in row {row}: kernel {got[row].tolist()}, "
                             f"twin {want[row].tolist()}; row values {x[row, got[row]].tolist()} vs "
                             f"{x[row, want[row]].tolist()}")


@pytest.mark.parametrize("k", [1, 2, 8, 16])
@pytest.mark.parametrize("width", [20, 128, 256, 300],
                         ids=["V20-one-partial-block", "V128-one-block", "V256-two-blocks", "V300-partial-last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_twin(dtype, width, k):
    assert_ranked(make_rows(width, dtype, seed=width + k), k)


def test_special_rows_have_what_they_claim():
    # The special row must hold NaNs of both sign bits, -0.0 and both subnormals, or the tests above test less.
    x = special_row(300, torch.float32, torch.Generator().manual_seed(0))
    bits = x.view(torch.int32)
    nan = torch.isnan(x)
    assert bool((nan & (bits < 0)).any()) and bool((nan & (bits > 0)).any()), "no NaN of one of the signs"
    assert bool((bits == -(1 << 31)).any()), "no -0.0"
    assert bool((bits == 1).any()) and bool((bits == -(1 << 31) + 1).any()), "no subnormal of one of the signs"
    for dtype in (torch.bfloat16, torch.float16):
        b = from_bits(dtype).view(torch.int16)
        assert int(b[1]) < 0 and torch.isnan(from_bits(dtype)[1]), f"{dtype}: -NaN lost its sign bit"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [1, 16], ids=["V1", "V16"])
def test_k_equal_to_width(dtype, width):
    assert_ranked(make_rows(width, dtype, seed=width), width)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ties_decided_at_the_cut(dtype):
    # 16 equal maxima spread over 3 blocks, some side by side (in one group), the rest lower: the first 8 by index
    # must win, in index order.
    x = torch.zeros(3, 300, dtype=dtype)
    places = torch.tensor([5, 40, 64, 70, 127, 128, 129, 130, 131, 150, 255, 256, 260, 280, 298, 299])
    x[:, places] = 2.0
    x[1, places[::3]] = float("nan")                                   # NaNs above the ties, still by index
    x[2] = -x[2]                                                       # the maxima now 0.0 and -0.0
    assert_ranked(x.to(DEVICE), 8)


def test_strided_rows_and_one_row():
    gen = torch.Generator().manual_seed(7)
    base = (torch.randint(-3, 4, (300, 6), generator=gen) * 0.5).to(DEVICE)
    assert_ranked(base.t()[1:4], 8)                                    # fp32 (3, 300), strides (1, 6)
    assert_ranked(base.to(torch.bfloat16).t()[::5, :257], 16)          # bf16 (2, 257), strides (5, 6)
    one_row = base.to(torch.float16)[:, 2].reshape(1, 300)             # fp16 (1, 300), strides (300, 6)
    assert one_row.stride(1) == 6, one_row.stride()
    assert_ranked(one_row, 2)


def test_no_rows():
    out = row_top_k(torch.zeros(0, 100, device=DEVICE), 4)
    assert out.shape == (0, 4) and out.dtype == torch.int64, f"{tuple(out.shape)}, {out.dtype}"


@pytest.mark.parametrize("x, k, error, message", [
    (torch.zeros(10), 2, ValueError, r"x.dim\(\): expected 2 \(rows, V\), got 1"),
    (torch.zeros(2, 3, 10), 2, ValueError, r"x.dim\(\): expected 2 \(rows, V\), got 3"),
    (torch.zeros(2, 10, dtype=torch.float64), 2, TypeError, r"x.dtype: expected one of .*, got torch.float64"),
    (torch.zeros(2, 10, dtype=torch.int32), 2, TypeError, r"x.dtype: expected one of .*, got torch.int32"),
    (torch.zeros(2, 10), 0, ValueError, r"k: expected an int in \[1, min\(16, V=10\)\], got 0"),
    (torch.zeros(2, 100), 17, ValueError, r"k: expected an int in \[1, min\(16, V=100\)\], got 17"),
    (torch.zeros(2, 5), 6, ValueError, r"k: expected an int in \[1, min\(16, V=5\)\], got 6"),
    (torch.zeros(2, 0), 1, ValueError, r"k: expected an int in \[1, min\(16, V=0\)\], got 1"),
    (torch.zeros(2, 10), 2.0, ValueError, r"k: expected an int in .*, got 2.0"),
    (torch.zeros(2, 10), True, ValueError, r"k: expected an int in .*, got True"),
    (torch.zeros(1).expand(1, 1 << 24), 2, ValueError,
     r"x.shape\[1\]: expected fewer than 2\^24 = 16777216 entries a row, got 16777216"),
    (torch.zeros(2, 10, device="meta"), 2, ValueError, r"x.device: expected a CUDA device .*, got meta"),
], ids=["1-D", "3-D", "float64", "int32", "k0", "k17", "k-above-V", "V0", "k-float", "k-bool", "V-2^24", "meta"])
def test_rejects_bad_inputs(x, k, error, message):
    if x.device.type != "meta":
        x = x.to(DEVICE)
    with pytest.raises(error, match=message):
        row_top_k(x, k)


# |log-sum - fp64| allowed: the sum of V terms <= 1 in fp32 over blocks and groups (relative error ~ (log2 V + a few)
# fp32 eps: 1.3e-6 at V = 128K) and approximate exp and log on a GPU (a few ulps each), as an absolute error of the log.
LOG_SUM_ATOL = 2e-6


def assert_norm(x: torch.Tensor, k: int) -> None:
    """row_top_k_and_norm(x, k): indices equal to row_top_k's (k > 0), none for k = 0; each row's shift equal to the
    twin's; its log-sum within LOG_SUM_ATOL of the twin's, NaN and ±inf where the twin has them."""
    indices, norm = row_top_k_and_norm(x, k)
    assert indices.shape == (x.shape[0], k), f"indices.shape: {tuple(indices.shape)}"
    if k:
        assert torch.equal(indices, row_top_k(x, k)), "indices differ from row_top_k's"
    assert norm.dtype == torch.float32 and norm.shape == (x.shape[0], 2), f"norm: {norm.dtype}, {tuple(norm.shape)}"
    want = log_softmax_norm_ref(x.cpu())
    got = norm.cpu().double()
    assert torch.equal(got[:, 0], want[:, 0]), f"shift: kernel {got[:, 0].tolist()}, twin {want[:, 0].tolist()}"
    same_special = (torch.isnan(got[:, 1]) == torch.isnan(want[:, 1])) & (
        torch.isinf(got[:, 1]) == torch.isinf(want[:, 1]))
    assert bool(same_special.all()), f"log-sum special values: kernel {got[:, 1].tolist()}, twin {want[:, 1].tolist()}"
    finite = torch.isfinite(want[:, 1])
    assert torch.equal(got[~finite, 1].nan_to_num(), want[~finite, 1].nan_to_num()), "an infinity of the wrong sign"
    err = (got[finite, 1] - want[finite, 1]).abs()
    assert err.numel() == 0 or float(err.max()) <= LOG_SUM_ATOL, (
        f"log-sum: worst error {float(err.max()):.3g} > {LOG_SUM_ATOL} (row {int(finite.nonzero()[err.argmax(), 0])})")


def norm_rows(width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows at the scale of logits; the rounded, special and all-equal rows of make_rows; one row of -inf but one
    entry, one of -inf only, one with +inf and no NaN."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, width, generator=gen) * 4 + 10).to(dtype)
    lone = torch.full((width,), float("-inf"), dtype=dtype)
    lone[width // 2] = -3.0
    inf_row = logits[0].clone()
    inf_row[width - 1] = float("inf")
    return torch.cat([logits, make_rows(width, dtype, seed).cpu(),
                      torch.stack([lone, torch.full_like(lone, float("-inf")), inf_row])]).to(DEVICE)


# NumPy's warnings for log(0) (the -inf row) and inf - inf in the interpreter's evaluation of both sides of a where
SPECIAL_VALUE_WARNINGS = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
                          pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.mark.parametrize("k", [0, 8])
@pytest.mark.parametrize("width", [20, 300], ids=["V20-one-block", "V300-partial-last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@SPECIAL_VALUE_WARNINGS[0]
@SPECIAL_VALUE_WARNINGS[1]
def test_norm_matches_twin(dtype, width, k):
    assert_norm(norm_rows(width, dtype, seed=width + k), k)


@SPECIAL_VALUE_WARNINGS[0]
@SPECIAL_VALUE_WARNINGS[1]
def test_norm_merged_in_pieces():
    # 4200 entries: 33 blocks under the interpreter, whose partial sums the merge reads in two pieces of 32.
    assert_norm(norm_rows(4200, torch.float32, seed=1)[[0, 1, 4, 7, 8]], 0)


def test_norm_of_strided_rows_and_no_rows():
    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(300, 6, generator=gen) * 3).to(DEVICE)
    assert_norm(base.t()[1:4], 4)                                      # fp32 (3, 300), strides (1, 6)
    assert_norm(base.to(torch.bfloat16).t()[::5, :257], 0)             # bf16 (2, 257), strides (5, 6)
    indices, norm = row_top_k_and_norm(torch.zeros(0, 100, device=DEVICE), 0)
    assert indices.shape == (0, 0) and norm.shape == (0, 2), f"{tuple(indices.shape)}, {tuple(norm.shape)}"


@pytest.mark.parametrize("x, k, error, message", [
    (torch.zeros(2, 10), -1, ValueError, r"k: expected an int in \[0, min\(16, V=10\)\], got -1"),
    (torch.zeros(2, 10), 17, ValueError, r"k: expected an int in \[0, min\(16, V=10\)\], got 17"),
    (torch.zeros(2, 0), 0, ValueError, r"x.shape\[1\]: expected at least 1 entry a row for a norm, got 0"),
    (torch.zeros(2, 10, dtype=torch.float64), 0, TypeError, r"x.dtype: expected one of .*, got torch.float64"),
], ids=["k-negative", "k-above-V", "V0", "float64"])
def test_norm_rejects_bad_inputs(x, k, error, message):
    with pytest.raises(error, match=message):
        row_top_k_and_norm(x.to(DEVICE), k)


@gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_vocabulary_rows(dtype, rows):
    # The engine's decode shape: log-probabilities over a 128256-entry vocabulary, k = 8, and the same rows rounded
    # to a few levels (ties at the cut), with NaNs and infinities sprinkled in.
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 128256, generator=gen).to(DEVICE, dtype)
    assert_ranked(torch.log_softmax(logits, dim=-1), 8)
    rounded = (logits.float() * 2).round().to(dtype)
    rounded[:, ::1001] = float("nan")
    rounded[:, 7::997] = float("inf")
    assert_ranked(rounded, 8)
    assert_ranked(rounded, 16)
    assert_norm(logits * 4, 8)                                         # the spread of real logits
    assert_norm(rounded, 0)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_vocabulary_rows_of_special_values(dtype):
    # The special values of the CPU tests (NaNs of either sign and payload, ±inf, ±0, ±subnormals) at the engine's
    # width, compiled: a GPU conversion that quietened a NaN or flushed a subnormal would reorder them.
    gen = torch.Generator().manual_seed(5)
    rows = torch.stack([special_row(128256, dtype, gen) for _ in range(3)]).to(DEVICE)
    for k in (1, 8, 16):
        assert_ranked(rows, k)
    assert_norm(rows, 8)
