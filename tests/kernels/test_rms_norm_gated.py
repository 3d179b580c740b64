"""rms_norm_gated against its twin rms_norm_gated_ref: every output element, both gate positions, groups of several
sizes (statistics per group, never over the full width unless the group is the full width)."""

from __future__ import annotations

import pytest
import torch

from reference.ops import rms_norm_gated_ref
from tests.kernels.common import DEVICE, assert_three_way, gpu, needs_gpu
from tests.kernels.providers import OPS

K = 2.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}

EPS = 1e-5
H, P = 4, 16                            # CPU width D· = H·P = 64
ROWS = 67                               # past the interpreter's 64-row block: the last block is partial


def run_and_check(shape: tuple[int, ...], group_size: int, *, with_gate: bool = True, norm_before_gate: bool = False,
                  dtype: torch.dtype = torch.float32, strided: bool = False, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1]
    x = torch.randn(shape, generator=gen)                              # (..., D·)
    # Strided: x and gate are column views of one wider tensor, as the mixer splits its projection.
    if strided:
        both = torch.randn(*shape[:-1], 2 * width + 8, generator=gen)
        x, gate = both[..., :width], both[..., width + 8:]
    else:
        gate = torch.randn(shape, generator=gen)
    gate = gate if with_gate else None
    weight = 1.0 + 0.2 * torch.randn(width, generator=gen)             # (D·,)
    x_low, weight_low = x.to(DEVICE, dtype), weight.to(DEVICE, dtype)
    gate_low = None if gate is None else gate.to(DEVICE, dtype)
    options = dict(eps=EPS, group_size=group_size, norm_before_gate=norm_before_gate)
    out = OPS.rms_norm_gated(x_low, gate_low, weight_low, **options)
    ref_low = rms_norm_gated_ref(x_low, gate_low, weight_low, **options)
    ref64 = rms_norm_gated_ref(x_low.double(), None if gate_low is None else gate_low.double(), weight_low.double(),
                               **options)
    assert out.dtype == x_low.dtype, f"out.dtype: expected {x_low.dtype}, got {out.dtype}"
    assert_three_way("out", out, ref64, ref_low, k=K, atol=ATOL[dtype])


@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_before_norm", "norm_before_gate"])
@pytest.mark.parametrize("width, group_size", [(64, 64), (64, 32), (64, 16), (96, 48), (96, 12)],
                         ids=["D64-group64", "D64-group32", "D64-group16", "D96-group48", "D96-group12"])
def test_groups_and_gate_position(width, group_size, norm_before_gate):
    run_and_check((ROWS, width), group_size, norm_before_gate=norm_before_gate)


def test_without_gate():
    run_and_check((7, H * P), 32, with_gate=False, seed=1)


def test_one_row():
    run_and_check((1, H * P), 32, seed=2)


def test_leading_dims_and_strided_views():
    run_and_check((2, 3, H * P), 16, strided=True, seed=3)


def test_rejects_group_size_not_dividing_width():
    OPS.require("input_errors")
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="group_size: expected a positive divisor of the width 64, got 24"):
        OPS.rms_norm_gated(x, None, torch.ones(64, device=DEVICE), eps=EPS, group_size=24)


def test_rejects_gate_of_another_shape():
    OPS.require("input_errors")
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate.shape: expected \(2, 64\), got \(2, 32\)"):
        OPS.rms_norm_gated(x, torch.zeros(2, 32, device=DEVICE), torch.ones(64, device=DEVICE), eps=EPS, group_size=32)


def test_rejects_weight_of_another_width():
    OPS.require("input_errors")
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight.shape: expected \(64,\), got \(32,\)"):
        OPS.rms_norm_gated(x, None, torch.ones(32, device=DEVICE), eps=EPS, group_size=32)


@gpu
@needs_gpu
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_before_norm", "norm_before_gate"])
@pytest.mark.parametrize("group_size", [8192, 1024], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bamba_shapes(dtype, group_size, norm_before_gate):
    run_and_check((1000, 8192), group_size, norm_before_gate=norm_before_gate, dtype=dtype, seed=4)
