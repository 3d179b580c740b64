"""Shared machinery of the kernel tests: devices, the three-way tolerance, NaN poisoning and untouched-slot checks.

The three-way bound (docs/design.md §6): a kernel run in dtype d may differ from the fp64 twin by at most k times what
the twin itself differs by when run in d, plus atol:  |kernel - ref64| <= k·|ref_d - ref64| + atol, element-wise.
"""

from __future__ import annotations

import math

import pytest
import torch

ON_GPU = torch.cuda.is_available()

# Kernels run on the GPU when there is one, else under the Triton interpreter (set up by the root conftest.py).
DEVICE = "cuda" if ON_GPU else "cpu"

# the worst error/budget ratio of every assert_three_way of the running test (tests/kernels/ops_plugin.py reports it)
WORST: list[float] = []

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def assert_three_way(name: str, out: torch.Tensor, ref64: torch.Tensor, ref_low: torch.Tensor, *, k: float,
                     atol: float, ulps: float = 0.0, extra: torch.Tensor | None = None) -> None:
    """Every element: |out - ref64| <= k·|ref_low - ref64| + atol + ulps·ulp(ref64) (+ extra); NaN anywhere fails.
    Names the worst element. ulp(x): the spacing of out's dtype at |x| (normal range). `ulps` is for element-wise
    kernels that round an fp32 value which may differ from torch's in its last fp32 bits (an exp, a division): near a
    rounding boundary of a 16-bit dtype the two round one step apart, an error ref_low's own does not bound. `extra`
    (out's shape): a further allowance per element, for a kernel that rounds intermediates on purpose (the scan's
    products="rounded"), derived by its test from what those roundings can cost.
    Computed in fp64 on the device `out` lives on (a GPU has fp64 too); only the worst element goes to the host."""
    assert out.shape == ref64.shape == ref_low.shape, f"{name}: shapes {out.shape}, {ref64.shape}, {ref_low.shape}"
    where = out.device
    out64, ref_low64, ref64 = (t.to(device=where, dtype=torch.float64) for t in (out, ref_low, ref64))
    nan = torch.isnan(out64)
    assert not nan.any(), f"{name}: {int(nan.sum())} NaN elements, first at {tuple(nan.nonzero()[0].tolist())}"
    err = (out64 - ref64).abs()
    budget = k * (ref_low64 - ref64).abs() + atol
    if extra is not None:
        budget = budget + extra.to(device=where, dtype=torch.float64)
    if ulps:
        finfo = torch.finfo(out.dtype)
        magnitude = ref64.abs().clamp(min=finfo.tiny)
        budget = budget + ulps * torch.exp2(torch.floor(torch.log2(magnitude))) * finfo.eps
    excess = err - budget
    ratio = torch.where(budget > 0, err / budget.clamp(min=torch.finfo(torch.float64).tiny),
                        torch.where(err > 0, math.inf, 0.0))
    WORST.append(float(ratio.max()) if ratio.numel() else 0.0)
    if (excess > 0).any():
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} of {err.numel()} elements outside |kernel - ref64| <= "
            f"{k}·|ref_low - ref64| + {atol}; worst at {worst}: kernel {out64[worst]:.6g}, ref64 {ref64[worst]:.6g}, "
            f"ref_low {ref_low64[worst]:.6g}, error {err[worst]:.3g} > budget {budget[worst]:.3g}")


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor like t filled with NaN, so any element a kernel forgets to write fails the comparison."""
    return torch.full_like(t, float("nan"))


def poison_slots(pool: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """A copy of a state pool (S, ...) whose slots not in `keep` are NaN: a kernel that reads them spreads NaN."""
    poisoned = torch.full_like(pool, float("nan"))
    if keep:
        idx = torch.tensor(keep, device=pool.device)
        poisoned[idx] = pool[idx]
    return poisoned


def assert_slots_untouched(name: str, before: torch.Tensor, after: torch.Tensor, touched: list[int]) -> None:
    """Slots not in `touched` must be bit-identical (NaN compared as equal). All slots are compared at once; the
    message names the first one that changed."""
    same = (before == after) | (torch.isnan(before) & torch.isnan(after))
    unchanged = same.reshape(before.shape[0], -1).all(dim=1)
    named = sorted(s for s in set(touched) if 0 <= s < before.shape[0])
    if named:
        unchanged[torch.tensor(named, device=unchanged.device)] = True
    changed = (~unchanged).nonzero()
    assert changed.numel() == 0, f"{name}: slot {int(changed[0, 0])} was not named in the call but changed"
