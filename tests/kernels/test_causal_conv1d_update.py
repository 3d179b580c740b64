"""causal_conv1d_update (one decode token per row) against its twin causal_conv1d_update_ref: every output element,
every live row's slot, padding rows that read and write nothing, and every slot not named left bit-identical."""

from __future__ import annotations

import pytest
import torch

from reference.ops import causal_conv1d_update_ref
from tests.kernels.common import DEVICE, assert_slots_untouched, assert_three_way, gpu, needs_gpu, poison_slots
from tests.kernels.test_causal_conv1d import (BAMBA_CHANNELS, assert_rejected, channels, conv_inputs, kernel_pool,
                                              to_device)
from tests.kernels.providers import OPS

K = 2.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}

W = 4
N_SLOTS = 10
PAD = -1


def run_and_check(slots: list[int], *, n_channels: int = channels(1), width: int = W, with_bias: bool = True,
                  activation: str | None = "silu", pad_slot_id: int = PAD, dtype: torch.dtype = torch.float32,
                  n_slots: int = N_SLOTS, strided: bool = False, seed: int = 0) -> torch.Tensor:
    """Decode one token for each row of `slots` (pad_slot_id marks padding); poison every slot that no live row
    reads; check against the twins. Returns the kernel's output."""
    gen = torch.Generator().manual_seed(seed)
    # Strided: x is a column view and the pool is stored (S, W-1, C) and viewed transposed.
    x, weight, bias = conv_inputs(gen, len(slots), n_channels, width, with_bias=with_bias, strided=strided)
    live = [s for s in slots if s != pad_slot_id]
    pool = poison_slots(torch.randn(n_slots, n_channels, width - 1, generator=gen), keep=live)  # (S, C, W-1)
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)

    x_low, weight_low, bias_low = to_device(x, dtype), to_device(weight, dtype), to_device(bias, dtype)
    pool_before = to_device(pool, dtype)
    pool_kernel = kernel_pool(pool_before, transposed=strided)
    pool_low, pool64 = pool_before.clone(), pool_before.double()
    out = OPS.causal_conv1d_update(x_low, pool_kernel, weight_low, bias_low, state_indices, activation=activation,
                               pad_slot_id=pad_slot_id)
    ref_low = causal_conv1d_update_ref(x_low, pool_low, weight_low, bias_low, state_indices, activation=activation,
                                       pad_slot_id=pad_slot_id)
    ref64 = causal_conv1d_update_ref(x_low.double(), pool64, weight_low.double(), to_device(bias_low, torch.float64),
                                     state_indices, activation=activation, pad_slot_id=pad_slot_id)
    assert out.dtype == ref_low.dtype, f"out.dtype: expected {ref_low.dtype}, got {out.dtype}"
    assert_three_way("out", out, ref64, ref_low, k=K, atol=ATOL[dtype])
    assert_three_way("conv_states", pool_kernel[live], pool64[live], pool_low[live], k=K, atol=ATOL[dtype])
    assert_slots_untouched("conv_states", pool_before, pool_kernel, touched=live)
    return out


@pytest.mark.parametrize("n_groups", [1, 2, 4], ids=lambda g: f"G{g}")
def test_padding_rows_between_live_rows(n_groups):
    run_and_check([3, PAD, 0, 7, PAD, PAD, 5], n_channels=channels(n_groups))


def test_padding_rows_output_exact_zero():
    slots = [PAD, 4, PAD, 1]
    out = run_and_check(slots, seed=1)
    pad_rows = out[[i for i, s in enumerate(slots) if s == PAD]]
    assert bool((pad_rows == 0).all()), "out: padding rows must be exactly 0"


def test_pad_slot_id_names_a_real_slot():
    # Engines that reserve a real slot for padding: that slot must be neither read (it is NaN) nor written.
    run_and_check([2, 0, 6, 0, 9], pad_slot_id=0, seed=2)


def test_one_row():
    run_and_check([6], seed=3)


def test_only_padding():
    run_and_check([PAD, PAD], seed=4)


def test_without_bias():
    run_and_check([1, PAD, 8], with_bias=False, seed=5)


def test_without_activation():
    run_and_check([1, PAD, 8], activation=None, seed=6)


def test_strided_input_and_transposed_pool():
    run_and_check([4, PAD, 2, 9], strided=True, seed=7)


@pytest.mark.parametrize("width", [2, 3], ids=lambda w: f"W{w}")
def test_other_widths(width):
    run_and_check([4, PAD, 2], width=width, seed=8)


def _valid_args():
    c = channels(1)
    return dict(x=torch.zeros(3, c, device=DEVICE), conv_states=torch.zeros(4, c, W - 1, device=DEVICE),
                weight=torch.zeros(c, W, device=DEVICE), bias=None,
                state_indices=torch.tensor([1, -1, 3], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("name, bad, message", [
    ("x", torch.zeros(3, channels(1), 1), "x.dim(): expected 2, got 3"),
    ("conv_states", torch.zeros(4, channels(1) - 1, W - 1), "conv_states.shape[1:]: expected (C, W-1) ="),
    ("state_indices", torch.tensor([1, 3], dtype=torch.int32), "state_indices.shape: expected (B,) = (3,)"),
    ("conv_states", torch.zeros(4, channels(1), W - 1, dtype=torch.int32), "conv_states: expected dtype in"),
], ids=["x_rank", "state_channels", "indices_length", "pool_int"])
def test_rejects_bad_input(name, bad, message):
    OPS.require("input_errors")
    assert_rejected(OPS.causal_conv1d_update, _valid_args(), name, bad, message)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=[gpu, needs_gpu])],
                         ids=["fp16", "bf16"])
def test_16bit_inputs(dtype):
    """fp16 on both backends, bf16 on the GPU: 64 rows of 512 channels, one of them padding (as
    test_causal_conv1d.py's test_16bit_inputs, for the decode update)."""
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(80, generator=gen)[:64].tolist()
    slots[5] = PAD
    run_and_check(slots, n_channels=512, dtype=dtype, n_slots=80, seed=3)


@gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 7, 256], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bamba_shapes(dtype, batch):
    gen = torch.Generator().manual_seed(batch)
    slots = torch.randperm(300, generator=gen)[:batch].tolist()
    slots[batch // 2] = PAD                                            # one padding row among the live ones
    run_and_check(slots, n_channels=BAMBA_CHANNELS, dtype=dtype, n_slots=300, seed=batch)


@pytest.mark.parametrize("bad_slot", [N_SLOTS, -2], ids=["past_the_pool", "negative"])
def test_slot_outside_the_pool_touches_nothing_and_outputs_nan(bad_slot):
    OPS.require("slot_bounds")
    # No host check in a captured decode step: the kernel itself keeps a bad slot from memory (here the row just past
    # the pool's end, where a missing bound would read and write) and makes its row NaN, where padding gives 0.
    c = channels(1)
    backing = torch.randn(N_SLOTS + 1, c, W - 1, device=DEVICE)       # pool = rows 0..9, row 10 just past its end
    before = backing.clone()
    out = OPS.causal_conv1d_update(torch.randn(3, c, device=DEVICE), backing[:N_SLOTS], torch.randn(c, W, device=DEVICE),
                               torch.randn(c, device=DEVICE),
                               torch.tensor([2, bad_slot, PAD], dtype=torch.int32, device=DEVICE), pad_slot_id=PAD)
    assert torch.isnan(out[1]).all(), "out: the row with a slot outside the pool is not NaN"
    assert not torch.isnan(out[0]).any() and bool((out[2] == 0).all()), "out: the live and padding rows changed"
    assert torch.equal(backing[N_SLOTS], before[N_SLOTS]), "conv_states: the row past the pool was read or written"
    assert_slots_untouched("conv_states", before, backing, touched=[2])
