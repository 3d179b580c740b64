"""causal_conv1d (packed varlen prefill) against its twin causal_conv1d_ref: every output element, every named
state slot, and every slot not named left bit-identical."""

from __future__ import annotations

import importlib

import pytest
import torch

from reference.ops import causal_conv1d_ref
from tests.kernels.common import DEVICE, assert_slots_untouched, assert_three_way, gpu, needs_gpu, poison_slots
from tests.kernels.providers import OPS

# The module in which causal_conv1d looks up its launch choice, _prefill_launch, at every call: a chooser replaced
# there changes the launch (vendored/ops/causal_conv1d.py holds the kernels and only re-exports the ops).
conv_module = importlib.import_module("vendored.ops.causal_conv1d")

K = 2.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}

H, P, N, W = 4, 16, 16, 4               # CPU shapes; channels C = H·P + 2·G·N
Q = 16                                  # the scan's chunk size on CPU: lengths around it are the awkward ones
N_SLOTS = 8


def channels(n_groups: int, n_heads: int = H, head_dim: int = P, d_state: int = N) -> int:
    return n_heads * head_dim + 2 * n_groups * d_state


def to_device(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(device=DEVICE, dtype=dtype)


def kernel_pool(pool: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A copy of a conv pool (S, C, W-1) for the kernel; transposed: stored (S, W-1, C) and viewed (S, C, W-1), the
    layout some engines keep."""
    return pool.transpose(1, 2).contiguous().transpose(1, 2) if transposed else pool.clone()


def assert_rejected(fn, args: dict, name: str, bad: torch.Tensor, message: str) -> None:
    """fn(**args) with args[name] replaced by `bad` raises an error whose text contains `message`."""
    with pytest.raises((ValueError, TypeError)) as info:
        fn(**{**args, name: bad.to(DEVICE)})
    assert message in str(info.value)


def conv_inputs(gen: torch.Generator, n_rows: int, n_channels: int, width: int, *, with_bias: bool, strided: bool):
    """x (rows, C), weight (C, W), bias (C,) or None in fp32 on the CPU. Strided: x is the xBC columns of a wider
    projection, as the mixer splits it."""
    x_full = torch.randn(n_rows, n_channels + (24 if strided else 0), generator=gen)
    x = x_full[:, 8:8 + n_channels] if strided else x_full               # (rows, C)
    weight = 0.5 * torch.randn(n_channels, width, generator=gen)         # (C, W)
    bias = 0.2 * torch.randn(n_channels, generator=gen) if with_bias else None
    return x, weight, bias


def run_and_check(lengths: list[int], has_initial: list[bool], *, n_channels: int = channels(1), width: int = W,
                  with_bias: bool = True, activation: str | None = "silu", dtype: torch.dtype = torch.float32,
                  n_slots: int = N_SLOTS, strided: bool = False, seed: int = 0) -> None:
    """Build a packed batch, poison every slot that is not an initial state, run kernel and twins, check all."""
    gen = torch.Generator().manual_seed(seed)
    # Strided: x is a column view and the pool is stored (S, W-1, C) and viewed transposed.
    x, weight, bias = conv_inputs(gen, sum(lengths), n_channels, width, with_bias=with_bias, strided=strided)
    pool = torch.randn(n_slots, n_channels, width - 1, generator=gen)   # (S, C, W-1)
    slots = torch.randperm(n_slots, generator=gen)[:len(lengths)].tolist()
    pool = poison_slots(pool, keep=[s for s, init in zip(slots, has_initial) if init])
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor(has_initial, dtype=torch.bool, device=DEVICE)

    x_low, weight_low, bias_low = to_device(x, dtype), to_device(weight, dtype), to_device(bias, dtype)
    pool_before = to_device(pool, dtype)
    pool_kernel = kernel_pool(pool_before, transposed=strided)
    pool_low, pool64 = pool_before.clone(), pool_before.double()
    out = OPS.causal_conv1d(x_low, weight_low, bias_low, pool_kernel, cu_seqlens, state_indices, has_initial_state,
                        activation=activation)
    ref_low = causal_conv1d_ref(x_low, weight_low, bias_low, pool_low, cu_seqlens, state_indices,
                                has_initial_state, activation=activation)
    ref64 = causal_conv1d_ref(x_low.double(), weight_low.double(), to_device(bias_low, torch.float64), pool64,
                              cu_seqlens, state_indices, has_initial_state, activation=activation)
    assert out.dtype == ref_low.dtype, f"out.dtype: expected {ref_low.dtype}, got {out.dtype}"
    assert_three_way("out", out, ref64, ref_low, k=K, atol=ATOL[dtype])
    assert_three_way("conv_states", pool_kernel[slots], pool64[slots], pool_low[slots], k=K, atol=ATOL[dtype])
    assert_slots_untouched("conv_states", pool_before, pool_kernel, touched=slots)


# ---------------------------------------------------------------------------------------------------------------
# One sequence: the lengths around W-1 and the scan's chunk size
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("initial", [True, False], ids=["initial_state", "zero_state"])
@pytest.mark.parametrize("length", [1, W - 1, Q - 1, Q, Q + 1, 3 * Q + 2], ids=lambda n: f"T{n}")
def test_one_sequence(length, initial):
    run_and_check([length], [initial])


# ---------------------------------------------------------------------------------------------------------------
# Packed batches: boundaries anywhere, mixed initial states, short pieces
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_groups", [1, 2, H], ids=lambda g: f"G{g}")
def test_five_sequences_boundaries_anywhere(n_groups):
    # Boundaries at 1, 3, 63, 65, 96: inside the kernel's 64-token tiles, and a two-token sequence across the edge.
    run_and_check([1, 2, 60, 2, 31], [True, False, True, True, False], n_channels=channels(n_groups))


def test_pieces_shorter_than_window_keep_old_window():
    # Every piece is shorter than W-1, so each new window is part old window, part new inputs.
    run_and_check([1, 2, 1, 2, 1], [True, True, False, True, True], seed=1)


def launch_with(monkeypatch, **changes) -> None:
    OPS.internal("our conv kernel's launch choices")
    """Make causal_conv1d launch with `changes` applied to its usual choice (a choice a GPU may make)."""
    choose = conv_module._prefill_launch
    monkeypatch.setattr(conv_module, "_prefill_launch", lambda *args: choose(*args)._replace(**changes))


# Tiles small enough that the batch spans 6 token blocks and 2 channel blocks; 2-D tiles or the row kernel.
LAUNCHES = {"tiles_channels_fastest": dict(block_t=16, block_c=64, channels_fastest=True),
            "tiles_tokens_fastest": dict(block_t=16, block_c=64, channels_fastest=False),
            "rows_channels_fastest": dict(block_t=16, block_c=64, channels_fastest=True, rows_per_step=4),
            "rows_tokens_fastest": dict(block_t=8, block_c=64, channels_fastest=False, rows_per_step=3)}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_other_launch_choices(launch, monkeypatch):
    launch_with(monkeypatch, **LAUNCHES[launch])
    run_and_check([1, 2, 60, 2, 31], [True, False, True, True, False], n_channels=channels(2), seed=10)


@pytest.mark.parametrize("case", ["short_pieces", "one_long_sequence", "widths_2_3", "strided_no_bias"])
def test_row_kernel(case, monkeypatch):
    launch_with(monkeypatch, block_t=8, block_c=64, rows_per_step=3)
    if case == "short_pieces":
        run_and_check([1, 2, 1, 2, 1], [True, True, False, True, True], seed=11)
    elif case == "one_long_sequence":
        run_and_check([3 * Q + 2], [True], seed=12)
    elif case == "widths_2_3":
        run_and_check([1, 4, Q + 1], [True, True, False], width=2, seed=13)
        run_and_check([1, 4, Q + 1], [True, False, True], width=3, seed=14)
    else:
        run_and_check([2, Q, 7], [True, False, True], strided=True, with_bias=False, activation=None, seed=15)


def test_row_kernel_equals_tiles_bit_for_bit(monkeypatch):
    # bench/sweep_conv.py requires every launch choice to give the default's very bits: same sums, same order. The
    # batch has empty sequences too (which the twin cannot take): the kernels find sequences in two different ways.
    gen = torch.Generator().manual_seed(16)
    c = channels(2)
    x, weight, bias = (t.to(DEVICE) for t in conv_inputs(gen, 40, c, W, with_bias=True, strided=False))
    pool = torch.randn(8, c, W - 1, generator=gen).to(DEVICE)
    index = dict(cu_seqlens=torch.tensor([0, 0, 1, 3, 3, 20, 40, 40], dtype=torch.int32, device=DEVICE),
                 state_indices=torch.tensor([1, 4, 0, 3, 2, 5, 6], dtype=torch.int32, device=DEVICE),
                 has_initial_state=torch.tensor([True, True, False, True, True, True, False], device=DEVICE))
    results = []
    for rows_per_step in (0, 4):
        launch_with(monkeypatch, block_t=16, block_c=64, rows_per_step=rows_per_step)
        states = pool.clone()
        out = OPS.causal_conv1d(x, weight, bias, states, **index)
        results.append((out, states))
    assert torch.equal(results[0][0], results[1][0]), "out: the row kernel's bits differ from the tiles'"
    assert torch.equal(results[0][1], results[1][1]), "conv_states differ"


def _tiles_and_rows(monkeypatch, lengths, has_initial, *, width=W, seed=0, block_t=8, rows_per_step=3):
    """causal_conv1d's outputs and pool after the 2-D tiles with the final-window launch, and after the row kernel
    alone (which writes the final windows itself), on one packed batch (empty sequences allowed)."""
    gen = torch.Generator().manual_seed(seed)
    c = channels(1)
    x, weight, bias = (t.to(DEVICE) for t in conv_inputs(gen, sum(lengths), c, width, with_bias=True,
                                                           strided=False))
    pool = torch.randn(N_SLOTS, c, width - 1, generator=gen).to(DEVICE)
    slots = torch.randperm(N_SLOTS, generator=gen)[:len(lengths)]
    index = dict(cu_seqlens=torch.tensor([0] + torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist(),
                                         dtype=torch.int32, device=DEVICE),
                 state_indices=slots.to(device=DEVICE, dtype=torch.int32),
                 has_initial_state=torch.tensor(has_initial, dtype=torch.bool, device=DEVICE))
    results = []
    for tile_t, rows in ((8, 0), (block_t, rows_per_step)):                # the 2-D tiles need a power of 2
        launch_with(monkeypatch, block_t=tile_t, block_c=64, rows_per_step=rows)
        states = pool.clone()
        results.append((OPS.causal_conv1d(x, weight, bias, states, **index), states))
    return results


def test_row_kernel_owner_at_every_block_offset(monkeypatch):
    # One launch: the program whose block holds a sequence's first token reads its slot, computes its first W-1
    # outputs even past the block's end, and writes its final window; no other program touches the slot. A short
    # sequence (1 to W+1 tokens, with an initial window or without, alternately) starts at every offset of a
    # 6-token block, between a sequence ending there and one it hands its last tokens to.
    for offset in range(6):
        for length in range(1, W + 2):
            initial = (offset + length) % 2 == 0
            lengths = [offset, length, 9] if offset else [length, 9]
            (out_tiles, pool_tiles), (out_rows, pool_rows) = _tiles_and_rows(
                monkeypatch, lengths, [True, initial, True][-len(lengths):], seed=offset * 10 + length, block_t=6,
                rows_per_step=4)
            case = f"offset {offset}, length {length}, initial window {initial}"
            assert torch.equal(out_rows, out_tiles), f"out differs from the tiles': {case}"
            assert torch.equal(pool_rows, pool_tiles), f"conv_states differ from the tiles': {case}"


@pytest.mark.parametrize("width", [2, 3, 4], ids=lambda w: f"W{w}")
def test_row_kernel_empty_sequences_keep_or_clear_their_windows(width, monkeypatch):
    # Empty sequences at the start, in the middle, at a block edge and after the last token, with and without an
    # initial window (kept, or cleared to zeros); and a batch of only empty sequences (no token: one block still runs).
    for lengths, initial in [([0, 3, 0, 5, 0, 8, 0, 0], [True, False, False, True, True, False, True, False]),
                             ([0, 0, 0], [True, False, True])]:
        (out_tiles, pool_tiles), (out_rows, pool_rows) = _tiles_and_rows(monkeypatch, lengths, initial, width=width,
                                                                         seed=width)
        assert torch.equal(out_rows, out_tiles), f"out differs from the tiles': {lengths}"
        assert torch.equal(pool_rows, pool_tiles), f"conv_states differ from the tiles': {lengths}"


def test_rejects_tokens_without_sequences():
    OPS.require("input_errors")
    x = torch.zeros(3, channels(1), device=DEVICE)
    with pytest.raises(ValueError, match="3 tokens but cu_seqlens names no sequence"):
        OPS.causal_conv1d(x, torch.zeros(channels(1), W, device=DEVICE), None,
                      torch.zeros(N_SLOTS, channels(1), W - 1, device=DEVICE),
                      torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE),
                      torch.zeros(0, dtype=torch.bool, device=DEVICE))


def test_one_sequence_in_a_large_pool_without_initial_state():
    run_and_check([Q + 1], [False], n_slots=32, seed=2)


def test_without_bias():
    run_and_check([5, Q + 1], [True, False], with_bias=False, seed=4)


def test_without_activation():
    run_and_check([5, Q + 1], [True, False], activation=None, seed=5)


def test_strided_input_and_transposed_pool():
    run_and_check([2, Q, 7], [True, False, True], strided=True, seed=6)


@pytest.mark.parametrize("width", [2, 3], ids=lambda w: f"W{w}")
def test_other_widths(width):
    run_and_check([1, 4, Q + 1], [True, True, False], width=width, seed=7)


# ---------------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------------


def _valid_args():
    c = channels(1)
    return dict(x=torch.zeros(6, c, device=DEVICE), weight=torch.zeros(c, W, device=DEVICE),
                bias=torch.zeros(c, device=DEVICE), conv_states=torch.zeros(4, c, W - 1, device=DEVICE),
                cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE),
                state_indices=torch.tensor([1, 3], dtype=torch.int32, device=DEVICE),
                has_initial_state=torch.tensor([True, False], device=DEVICE))


@pytest.mark.parametrize("name, bad, message", [
    ("weight", torch.zeros(channels(1) + 1, W), "weight.shape[0]: expected the channel count of x,"),
    ("bias", torch.zeros(3), "bias.shape: expected"),
    ("conv_states", torch.zeros(4, channels(1), W), "conv_states.shape[1:]: expected (C, W-1) ="),
    ("cu_seqlens", torch.tensor([0, 2, 5], dtype=torch.int32), "cu_seqlens: expected non-decreasing from 0 to T"),
    ("cu_seqlens", torch.tensor([0, 6], dtype=torch.int32), "cu_seqlens.shape: expected (B+1,)"),
    ("state_indices", torch.tensor([3, 3], dtype=torch.int32), "state_indices: expected distinct slots"),
    ("state_indices", torch.tensor([1, 4], dtype=torch.int32), "state_indices: expected distinct slots in [0, 4)"),
    ("x", torch.zeros(6, channels(1), dtype=torch.float64), "x: expected dtype in"),
    ("state_indices", torch.tensor([1.0, 3.0]), "state_indices: expected dtype in"),
], ids=["weight_channels", "bias_shape", "state_width", "cu_seqlens_end", "cu_seqlens_length", "duplicate_slots",
        "slot_out_of_range", "x_float64", "float_indices"])
def test_rejects_bad_input(name, bad, message):
    OPS.require("input_errors")
    assert_rejected(OPS.causal_conv1d, _valid_args(), name, bad, message)


@pytest.mark.parametrize("check_indices", [True, False], ids=["checked", "unchecked"])
def test_slot_past_the_pool_is_not_touched(check_indices):
    # The index values are checked after the kernels are queued (or not at all, for a caller that vouches for them),
    # so the kernels themselves must keep a bad slot from reaching memory: here the row past the pool's end, where
    # a missing bound would read and write.
    OPS.require("index_checks" if check_indices else "slot_bounds")
    c = channels(1)
    backing = torch.randn(5, c, W - 1, device=DEVICE)                 # pool = rows 0..3, row 4 just past its end
    before = backing.clone()
    args = dict(_valid_args(), conv_states=backing[:4],
                state_indices=torch.tensor([1, 4], dtype=torch.int32, device=DEVICE),
                has_initial_state=torch.tensor([True, True], device=DEVICE), check_indices=check_indices)
    if check_indices:
        with pytest.raises(ValueError, match=r"state_indices: expected distinct slots in \[0, 4\)"):
            OPS.causal_conv1d(**args)
    else:
        OPS.causal_conv1d(**args)
    assert torch.equal(backing[4], before[4]), "conv_states: the row past the pool was written"
    assert torch.equal(backing[[0, 2, 3]], before[[0, 2, 3]]), "conv_states: a slot not named was written"


def test_rejects_unknown_activation():
    OPS.require("input_errors")
    with pytest.raises(ValueError, match="activation: expected 'silu', 'swish' or None, got 'relu'"):
        OPS.causal_conv1d(**_valid_args(), activation="relu")


# ---------------------------------------------------------------------------------------------------------------
# GPU: Bamba-9B shapes in 16-bit, and a prefill long enough for int32 offsets to overflow
# ---------------------------------------------------------------------------------------------------------------

# 16-bit inputs on both backends: fp16 everywhere (the interpreter's fp16 products round as a GPU's do), bf16 on the
# GPU. A kernel that multiplies 16-bit x and weight in 16 bits rounds every tap's product before the sum, and where
# the taps cancel the sum's error is far more than one rounding of the result (vLLM's Triton conv:
# peer_findings.py, vllm-conv-16bit-products).
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=[gpu, needs_gpu])],
                         ids=["fp16", "bf16"])
def test_16bit_inputs(dtype):
    run_and_check([1, 2, 300, 63, 124], [True, False, True, True, False], n_channels=512, dtype=dtype, n_slots=16,
                  seed=8)


BAMBA_CHANNELS = channels(1, n_heads=128, head_dim=64, d_state=128)   # 8448


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bamba_shapes_8k_tokens(dtype):
    run_and_check([1, 2, 3000, 63, 5124], [True, False, True, True, False], n_channels=BAMBA_CHANNELS,
                  dtype=dtype, n_slots=16, seed=8)


def _conv_by_shifts(x, weight, bias, initial, dtype):
    """The twin's arithmetic for one sequence as W shifted multiply-adds in `dtype` (the twin's unfold + einsum
    would materialise (C, L, W) in fp64: 73 GB at this length). x (L, C); initial (C, W-1). Returns (L, C)."""
    width = weight.shape[1]
    window = torch.cat([initial.to(dtype).T, x.to(dtype)], dim=0)      # (W-1+L, C)
    length = x.shape[0]
    y = bias.to(dtype).expand(length, -1).clone()                      # (L, C)
    for j in range(width):
        y += window[j:j + length] * weight[:, j].to(dtype)
    return torch.nn.functional.silu(y)


@gpu
@needs_gpu
@pytest.mark.xdist_group("large-gpu-memory")                           # 24 GB reserved (conftest.py)
def test_long_prefill_past_int32_offsets():
    # T·C = 270,000 · 8448 = 2.3e9 elements > 2^31: a kernel that forms token·stride in int32 wraps around. fp32:
    # the offsets are what this test is for, and 16-bit products (vllm-conv-16bit-products) would fail it first.
    dtype, c = torch.float32, BAMBA_CHANNELS
    lengths, has_initial, slots = [5, 269_990, 5], [True, True, False], [2, 0, 1]
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    x = torch.randn(sum(lengths), c, generator=gen, device=DEVICE).to(dtype)   # (T, C)
    weight = (0.5 * torch.randn(c, W, generator=gen, device=DEVICE)).to(dtype)
    bias = (0.2 * torch.randn(c, generator=gen, device=DEVICE)).to(dtype)
    pool = poison_slots(torch.randn(4, c, W - 1, generator=gen, device=DEVICE).to(dtype), keep=[2, 0])
    pool_before, pool_kernel = pool.clone(), pool.clone()
    cu = [0, 5, 269_995, 270_000]
    out = OPS.causal_conv1d(x, weight, bias, pool_kernel, torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                        torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                        torch.tensor(has_initial, device=DEVICE))
    for b, slot in enumerate(slots):
        start, end = cu[b], cu[b + 1]
        initial = pool_before[slot] if has_initial[b] else torch.zeros_like(pool_before[slot])
        for c0 in range(0, c, 1024):                                   # channel blocks keep host memory small
            cols = slice(c0, c0 + 1024)
            args = (x[start:end, cols], weight[cols], bias[cols], initial[cols])
            ref64 = _conv_by_shifts(*args, torch.float64)
            ref_low = _conv_by_shifts(*args, dtype)
            assert_three_way(f"out[seq {b}, channels {c0}:]", out[start:end, cols], ref64, ref_low, k=K,
                             atol=ATOL[dtype])
        window = torch.cat([initial, x[max(start, end - (W - 1)):end].T], dim=1)   # (C, W-1 + min(L, W-1))
        expected = window[:, window.shape[1] - (W - 1):]
        assert torch.equal(pool_kernel[slot], expected), f"conv_states: slot {slot} is not the last W-1 inputs"
    assert_slots_untouched("conv_states", pool_before, pool_kernel, touched=slots)
