"""Stores to a bf16 state pool round to nearest even, as on a GPU, also under the Triton interpreter (which truncates
on its own; see vendored/ops/_rounding.py). A truncating store passes the three-way bounds of the kernel tests (its
error is at most one bf16 ulp) yet biases every stored state toward zero, which compounds over decode steps; so here
the stored bits are compared with torch's rounding of the same fp32 values."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from reference.ops import selective_state_update_ref, ssd_scan_ref
from tests.kernels.common import DEVICE
from tests.kernels.test_selective_state_update import make_inputs as ssu_inputs
from tests.kernels.test_ssd_scan import Case, make_inputs as scan_inputs, run_twin
from vendored.ops._rounding import interpreted, round_to
from vendored.ops.selective_state_update import selective_state_update
from vendored.ops.ssd_scan import ssd_scan

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# A kernel's fp32 state differs from the twin's fp32 state in its last bits; after rounding both to bf16 (8 bits of
# mantissa) they agree unless the two fp32 values straddle a rounding boundary, a chance of ~2^-14 per element for a
# relative difference of ~1e-6. 0.99 leaves room for that and fails by far for truncation (~50% differ).
MIN_SAME_BITS = 0.99


@triton.jit
def _store_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, BY_BITS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, round_to(x, y_ptr.dtype.element_ty, BY_BITS), mask=mask)


def special_values() -> torch.Tensor:
    one_ulp = 2.0 ** -7                                          # bf16 spacing at 1.0
    ties = [1.0 + one_ulp / 2, 1.0 + 3 * one_ulp / 2, -(1.0 + one_ulp / 2), 2.0 + one_ulp]   # halfway: to even
    near = [1.0 + one_ulp / 2 + 2.0 ** -20, 1.0 + one_ulp / 2 - 2.0 ** -20]                  # just off halfway
    edges = [0.0, -0.0, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.1754944e-38, 65504.0, 1e-3]
    return torch.tensor(ties + near + edges, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_round_to_matches_torch_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([special_values(), torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-6, 6, (4000,),
                                                                                                  generator=gen)])
    x = x.to(DEVICE)
    out = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    _store_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), BY_BITS=interpreted())
    expected = x.to(dtype)
    differ = (out.view(torch.int16 if dtype != torch.float32 else torch.int32)
              != expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert not differ.any(), (f"{int(differ.sum())} of {x.numel()} values rounded unlike torch, e.g. "
                              f"{x[differ][:4].tolist()} -> {out[differ][:4].float().tolist()} "
                              f"(torch: {expected[differ][:4].float().tolist()})")


def test_round_to_keeps_nan():
    x = torch.tensor([math.nan, -math.nan, 1.0], device=DEVICE)
    x[1] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)         # 0xFFFFFFFF: a NaN the bit trick overflows
    out = torch.empty(3, dtype=torch.bfloat16, device=DEVICE)
    _store_kernel[(1,)](x, out, 3, BLOCK=4, BY_BITS=interpreted())
    assert out[:2].isnan().all() and out[2] == 1.0, out


def assert_same_bits(name: str, kernel: torch.Tensor, twin: torch.Tensor) -> None:
    same = (kernel.view(torch.int16) == twin.view(torch.int16)).float().mean().item()
    bias = (kernel.double() - twin.double()).mean().item()
    assert same >= MIN_SAME_BITS, (f"{name}: only {same:.1%} of the stored bf16 states equal the twin's rounding of "
                                   f"the same values (mean signed difference {bias:.2e}): the store does not "
                                   "round to nearest even")


def test_selective_state_update_rounds_bf16_state_to_nearest():
    slots = [3, 0, 7, 5]
    inputs = ssu_inputs(len(slots), n_groups=2, seed=11)
    pool = inputs.pop("pool").to(device=DEVICE, dtype=torch.bfloat16)
    args = {k: v.to(DEVICE) for k, v in inputs.items()}
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    kernel_pool, twin_pool = pool.clone(), pool.clone()
    for fn, target in ((selective_state_update, kernel_pool), (selective_state_update_ref, twin_pool)):
        fn(target, args["x"], args["dt"], args["A"], args["B"], args["C"], D=args["D"], dt_bias=args["dt_bias"],
           z=args["z"], state_indices=state_indices)
    assert_same_bits("selective_state_update", kernel_pool[slots], twin_pool[slots])


def test_ssd_scan_rounds_bf16_final_state_to_nearest():
    case = Case(lengths=(5, 40, 17), initial="all")
    args, kwargs, pool = scan_inputs(case, torch.float32, torch.bfloat16, seed=12)
    kernel_pool = pool.clone()
    ssd_scan(*args, ssm_states=kernel_pool, **kwargs)
    _, twin_states = run_twin(ssd_scan_ref, args, kwargs, pool, None)
    slots = kwargs["state_indices"].tolist()
    assert_same_bits("ssd_scan", kernel_pool[slots], twin_states[slots].to(torch.bfloat16))
