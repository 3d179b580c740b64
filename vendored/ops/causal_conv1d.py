"""The depthwise causal convolution's host side, whose kernels (the math) are vendored/ops/causal_conv1d_kernels.py
(which imports nothing from here): argument checks, the launch choices (`_prefill_launch`, `_update_launch`: the only functions that choose tiles,
warps, kernel and programmatic dependent launch), and the grids and launches of `causal_conv1d` and
`causal_conv1d_update`, the ops themselves (vendored.ops re-exports them). A test or sweep that replaces a chooser
replaces it here, where the ops look it up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._host import cdiv, next_power_of_2
from ._index_check import no_check, start_index_check
from .causal_conv1d_kernels import (_causal_conv1d_final_state_fwd_kernel, _causal_conv1d_fwd_kernel,
                            _causal_conv1d_rows_fwd_kernel, _causal_conv1d_update_fwd_kernel)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# The functions that choose launch parameters, each (..., device) -> parameters for that device: vendored/ops/
# _compile_check.py hands them a CUDA device; bench/sweep_conv.py replaces them with candidates.
LAUNCH_CHOOSERS = ("_prefill_launch", "_update_launch")


def _expect(name: str, what: str, expected, got) -> None:
    if expected != got:
        raise ValueError(f"{name}: expected {what + ' ' if what else ''}{expected}, got {got}")


def _expect_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def _check_activation(activation: str | None) -> bool:
    """Whether SiLU is applied; the twin's accepted values only."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
    return activation is not None


def _check_conv_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor) -> int:
    """Checks shared by prefill and decode; returns the width W."""
    _expect("x.dim()", "", 2, x.dim())
    _expect_dtype("x", x, _FLOAT_DTYPES)
    n_channels = x.shape[1]
    _expect("weight.dim()", "", 2, weight.dim())
    _expect_dtype("weight", weight, _FLOAT_DTYPES)
    _expect("weight.shape[0]", "the channel count of x,", n_channels, weight.shape[0])
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"weight.shape[1]: expected a conv width W >= 2, got {width}")
    if bias is not None:
        _expect("bias.shape", "", (n_channels,), tuple(bias.shape))
        _expect_dtype("bias", bias, _FLOAT_DTYPES)
    _expect("conv_states.dim()", "", 3, conv_states.dim())
    _expect_dtype("conv_states", conv_states, _FLOAT_DTYPES)
    _expect("conv_states.shape[1:]", "(C, W-1) =", (n_channels, width - 1), tuple(conv_states.shape[1:]))
    _expect("state_indices.dim()", "", 1, state_indices.dim())
    _expect_dtype("state_indices", state_indices, _INDEX_DTYPES)
    for name, t in (("weight", weight), ("bias", bias), ("conv_states", conv_states),
                    ("state_indices", state_indices)):
        if t is not None:
            _expect(f"{name}.device", "the device of x,", x.device, t.device)
    return width


class PrefillLaunch(NamedTuple):
    """Launch parameters of causal_conv1d: the convolution's (block_t tokens, block_c channels) tile, warps,
    program order (channels_fastest: consecutive programs along a row of x) and kernel (rows_per_step 0: 2-D tiles,
    _causal_conv1d_fwd_kernel; else _causal_conv1d_rows_fwd_kernel, that many rows a step), the final-window kernel's
    (state_block_b sequences, state_block_c channels) tile, and programmatic dependent launch (each kernel may start
    while the previous one finishes; it waits for that one's writes before touching memory)."""
    block_t: int
    block_c: int
    num_warps: int
    channels_fastest: bool
    rows_per_step: int
    state_block_b: int
    state_block_c: int
    pdl: bool


class UpdateLaunch(NamedTuple):
    """Launch parameters of causal_conv1d_update: a (block_b rows, block_c channels) tile, warps, and programmatic
    dependent launch (as in PrefillLaunch)."""
    block_b: int
    block_c: int
    num_warps: int
    pdl: bool


def _prefill_launch(n_tokens: int, n_channels: int, device: torch.device) -> PrefillLaunch:
    """GPU: the row kernel, 128 channels a 1-warp program (4 a thread: 8-byte bf16 loads), 8 rows in flight a step,
    29 tokens a program (with the W-1 = 3 rows before them, 32 rows: 4 whole steps). It loads every input once and
    does not spill, where the 2-D tiles load each input W times (from L1/L2 after the first) and a 32 x 256 tile of
    4 warps needs 255 registers and spills (ptxas -v, sm_90). The row kernel writes the final windows itself: one
    launch, where two launches' host time was what lost at 2K tokens (state_block_* unused). 128 channels rather
    than 256 a program: twice the programs, which a 2K-token call needs to fill the GPU; on an H200 (2026-12-04,
    results/2026-12-04-h200-conv-one-launch) device time 29.3 against 34.5 µs at 2K tokens in one sequence,
    31.2 against 37.8 in 8, 363 against 397 µs at 32K, 408 against 439 in 8.
    Interpreter, where every program costs the same fixed time whatever its size: 64 x 128 2-D tiles and 4 sequences
    a final-window program, smaller than the test shapes so that tests cross tile edges (tests run the row kernel
    too). bench/sweep_conv.py times the alternatives on a GPU."""
    if device.type == "cuda":
        return PrefillLaunch(block_t=29, block_c=128, num_warps=1, channels_fastest=True, rows_per_step=8,
                             state_block_b=1, state_block_c=256, pdl=True)
    return PrefillLaunch(block_t=64, block_c=128, num_warps=4, channels_fastest=True, rows_per_step=0,
                         state_block_b=4, state_block_c=128, pdl=False)


def _update_launch(n_rows: int, n_channels: int, device: torch.device) -> UpdateLaunch:
    """GPU: below 16 rows, one row of 128 channels a 1-warp program (4 channels a thread: as many programs as the
    channels allow, for a step that is one memory round trip); from 16 rows, 4 rows of 256 channels a 4-warp
    program. The fastest of bench/sweep_conv.py's candidates on an H200 (2026-11-30, CUDA-graph replays): at batch
    1, 8, 64 and 256, 0.86, 0.88, 0.67 and 0.75x the time of the launch before (256 channels on one warp, 1 to 4
    rows), bf16 state. Interpreter: 4 rows and 128 channels, so that test batches cross row blocks."""
    if device.type == "cuda":
        if n_rows < 16:
            return UpdateLaunch(block_b=1, block_c=128, num_warps=1, pdl=True)
        return UpdateLaunch(block_b=4, block_c=256, num_warps=4, pdl=True)
    return UpdateLaunch(block_b=4, block_c=128, num_warps=4, pdl=False)


def _tile_offsets_fit_int32(t: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether offsets inside a (rows, cols) tile of the 2-D tensor t, formed in int32 by the kernel, cannot wrap."""
    return rows * abs(t.stride(0)) + cols * abs(t.stride(1)) < 2**31


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    *,
    check_indices: bool = True,
) -> torch.Tensor:
    """Depthwise causal convolution over packed sequences, carrying each sequence's window in a state slot.

    x (T, C) fp16/bf16/fp32, any strides; weight (C, W); bias (C,) or None; conv_states (S, C, W-1), updated in
    place: slot state_indices[b] receives the last W-1 inputs of sequence b (its initial window in front, so a piece
    shorter than W-1 keeps part of the old window); cu_seqlens (B+1,) int; state_indices (B,) int, distinct;
    has_initial_state (B,) bool. Slots not named are neither read nor written; a slot whose has_initial_state is
    False is not read. Returns out (T, C) = activation(conv(x) + bias), in x's dtype promoted with the weight's.

    Checks the index values too (one device-to-host copy: prefill is not captured in CUDA graphs), after queueing
    the kernels so that a GPU need not wait for the host: a call that raises for them may have written the slots
    it names, never memory outside x, out and the pool. check_indices=False skips that copy and its wait, for a
    caller that built the values and vouches for them (vendored/ops/_index_check.py): a slot outside the pool is
    still neither read nor written, but other bad values then give a wrong result instead of an error.
    """
    apply_silu = _check_activation(activation)
    width = _check_conv_operands(x, weight, bias, conv_states, state_indices)
    n_tokens, n_channels = x.shape
    n_seqs = state_indices.shape[0]
    _expect("cu_seqlens.shape", "(B+1,) =", (n_seqs + 1,), tuple(cu_seqlens.shape))
    _expect_dtype("cu_seqlens", cu_seqlens, _INDEX_DTYPES)
    _expect("has_initial_state.shape", "(B,) =", (n_seqs,), tuple(has_initial_state.shape))
    _expect_dtype("has_initial_state", has_initial_state, (torch.bool,) + _INDEX_DTYPES)
    for name, t in (("cu_seqlens", cu_seqlens), ("has_initial_state", has_initial_state)):
        _expect(f"{name}.device", "the device of x,", x.device, t.device)
    if n_seqs == 0 and n_tokens > 0:
        raise ValueError(f"x has {n_tokens} tokens but cu_seqlens names no sequence (state_indices is empty)")
    check = (start_index_check(cu_seqlens, state_indices, n_tokens, conv_states.shape[0]) if check_indices
             else no_check)
    out = torch.empty((n_tokens, n_channels), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    launch = _prefill_launch(n_tokens, n_channels, x.device)
    if not _tile_offsets_fit_int32(x, launch.block_t + width, launch.block_c):
        x = x.contiguous()                                             # a stride so large is no layout to optimise
    bias_arg = bias if bias is not None else weight                    # never read when HAS_BIAS is False
    rows = launch.rows_per_step > 0                                    # the row kernel writes the final windows too
    n_blocks_t = max(cdiv(n_tokens, launch.block_t), 1 if rows and n_seqs > 0 else 0)
    if n_blocks_t > 0:
        grid = (n_blocks_t * cdiv(n_channels, launch.block_c),)
        kernel, extra = ((_causal_conv1d_rows_fwd_kernel, {"ROWS_PER_STEP": launch.rows_per_step}) if rows
                         else (_causal_conv1d_fwd_kernel, {}))
        bound_steps = (n_seqs.bit_length(),) if rows else ()
        kernel[grid](
            x, weight, bias_arg, conv_states, cu_seqlens, state_indices, has_initial_state, out,
            n_tokens, n_channels, n_seqs, (n_seqs - 1).bit_length(), *bound_steps,
            x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1),
            bias_arg.stride(0),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            out.stride(0), out.stride(1),
            conv_states.shape[0],
            WIDTH=width, HAS_BIAS=bias is not None, APPLY_SILU=apply_silu, BLOCK_T=launch.block_t,
            BLOCK_C=launch.block_c, CHANNELS_FASTEST=launch.channels_fastest, USE_PDL=launch.pdl,
            num_warps=launch.num_warps, launch_pdl=launch.pdl, **extra,
        )
    if n_seqs > 0 and not rows:
        block_b, block_c = launch.state_block_b, launch.state_block_c
        _causal_conv1d_final_state_fwd_kernel[(cdiv(n_seqs, block_b), cdiv(n_channels, block_c))](
            x, conv_states, cu_seqlens, state_indices, has_initial_state,
            n_seqs, n_channels,
            x.stride(0), x.stride(1),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            n_tokens, conv_states.shape[0],
            WIDTH=width, BLOCK_B=block_b, BLOCK_W=next_power_of_2(width - 1), BLOCK_C=block_c,
            USE_PDL=launch.pdl, launch_pdl=launch.pdl,
        )
    check()
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """One decode step of the causal convolution for a batch of sequences.

    x (B, C) one new input per sequence, fp16/bf16/fp32, any strides; conv_states (S, C, W-1), updated in place
    (window shifted by one, x appended); weight (C, W); bias (C,) or None; state_indices (B,) int, distinct among
    live rows; rows with state_indices == pad_slot_id are padding: no slot read or written, output 0.
    Returns out (B, C) in x's dtype promoted with the weight's. No device-to-host copy (capturable in a CUDA
    graph), so slot values are not checked on the host: a row whose slot is outside the pool (and not the pad slot)
    reads and writes no slot and outputs NaN.
    """
    apply_silu = _check_activation(activation)
    width = _check_conv_operands(x, weight, bias, conv_states, state_indices)
    n_rows, n_channels = x.shape
    _expect("state_indices.shape", "(B,) =", (n_rows,), tuple(state_indices.shape))
    out = torch.empty((n_rows, n_channels), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if n_rows == 0:
        return out
    launch = _update_launch(n_rows, n_channels, x.device)
    bias_arg = bias if bias is not None else weight                    # never read when HAS_BIAS is False
    _causal_conv1d_update_fwd_kernel[(cdiv(n_rows, launch.block_b), cdiv(n_channels, launch.block_c))](
        x, conv_states, weight, bias_arg, state_indices, out,
        n_rows, n_channels, pad_slot_id, conv_states.shape[0],
        x.stride(0), x.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        weight.stride(0), weight.stride(1),
        bias_arg.stride(0),
        out.stride(0), out.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, APPLY_SILU=apply_silu,
        BLOCK_B=launch.block_b, BLOCK_C=launch.block_c, USE_PDL=launch.pdl, num_warps=launch.num_warps,
        launch_pdl=launch.pdl,
    )
    return out
