"""Depthwise causal convolution of the Mamba2 mixer (width W, per-channel bias, SiLU), forward only.

Two entry points, twins of `reference.ops.causal_conv1d_ref` and `causal_conv1d_update_ref`:
- `causal_conv1d`: packed variable-length prefill. Sequence b (tokens cu_seqlens[b]:cu_seqlens[b+1]) sees the
  window `[initial (W-1) | its own inputs]`, where initial is slot state_indices[b] of the pool when
  has_initial_state[b], zeros otherwise; afterwards that slot holds the last W-1 entries of the window (so a piece
  shorter than W-1 keeps the tail of the old window). Inputs, never activations, are what a slot stores.
- `causal_conv1d_update`: one decode token per row; the window shifts by one; a row whose slot is pad_slot_id
  reads and writes no slot and outputs 0.

Arithmetic is fp32 inside the kernels whatever the storage dtypes are (the Triton interpreter cannot compute in
bf16, and fp32 accumulation is what a careful kernel does anyway).

Prefill runs two launches: the convolution, which reads initial windows, then the final-window write, which
overwrites the same slots. One launch could not do both without a race between the program that reads a slot
(the first tokens of a sequence) and the one that writes it (the last tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def _causal_conv1d_fwd_kernel(
    x_ptr, weight_ptr, bias_ptr, conv_states_ptr, cu_seqlens_ptr, state_indices_ptr, has_initial_state_ptr,
    out_ptr,
    n_tokens, n_channels, n_seqs, n_search_steps,
    stride_x_t, stride_x_c,
    stride_weight_c, stride_weight_w,
    stride_bias_c,
    stride_states_s, stride_states_c, stride_states_w,
    stride_out_t, stride_out_c,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (BLOCK_T packed tokens, BLOCK_C channels) tile of out; a tile may straddle sequence boundaries."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)                  # (BLOCK_T,) packed token index
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)                  # (BLOCK_C,)
    mask_t = offs_t < n_tokens
    mask_c = offs_c < n_channels

    # The sequence of each token: the largest b with cu_seqlens[b] <= t (binary search; empty sequences skipped
    # because their start equals the next one's). Invariant: cu_seqlens[lo] <= t < cu_seqlens[hi].
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + n_seqs
    for _ in range(n_search_steps):                                    # ceil(log2(B)) halvings of [lo, hi)
        mid = (lo + hi) // 2
        mid_start = tl.load(cu_seqlens_ptr + mid, mask=mask_t, other=0)
        go_right = mid_start <= offs_t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo                                                           # (BLOCK_T,)
    seq_start = tl.load(cu_seqlens_ptr + seq, mask=mask_t, other=0)    # (BLOCK_T,)
    slot = tl.load(state_indices_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + seq, mask=mask_t, other=0) != 0
    pos = offs_t - seq_start                                           # (BLOCK_T,) position inside the sequence

    offs_t64 = offs_t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # Tap j reads window entry pos + j, i.e. input t + j - (W-1) or, before the sequence start, the initial
        # window's column pos + j.
        from_x = (pos + j >= WIDTH - 1)[:, None]                       # (BLOCK_T, 1)
        valid = mask_t[:, None] & mask_c[None, :]
        x_ptrs = x_ptr + (offs_t64 + (j - (WIDTH - 1)))[:, None] * stride_x_t + offs_c[None, :] * stride_x_c
        x_tap = tl.load(x_ptrs, mask=valid & from_x, other=0.0).to(tl.float32)
        s_ptrs = (conv_states_ptr + (slot * stride_states_s)[:, None] + offs_c[None, :] * stride_states_c
                  + (pos + j)[:, None] * stride_states_w)
        s_tap = tl.load(s_ptrs, mask=valid & ~from_x & has_initial[:, None], other=0.0).to(tl.float32)
        w_j = tl.load(weight_ptr + offs_c * stride_weight_c + j * stride_weight_w, mask=mask_c, other=0.0)
        acc += (x_tap + s_tap) * w_j.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c * stride_bias_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if APPLY_SILU:
        acc = _silu(acc)
    out_ptrs = out_ptr + offs_t64[:, None] * stride_out_t + offs_c[None, :] * stride_out_c
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _causal_conv1d_final_state_fwd_kernel(
    x_ptr, conv_states_ptr, cu_seqlens_ptr, state_indices_ptr, has_initial_state_ptr,
    n_seqs, n_channels,
    stride_x_t, stride_x_c,
    stride_states_s, stride_states_c, stride_states_w,
    WIDTH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Slot state_indices[b] <- last W-1 entries of sequence b's window [initial | inputs], for BLOCK_B sequences
    and BLOCK_C channels."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)       # (BLOCK_B,)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)       # (BLOCK_C,)
    offs_w = tl.arange(0, BLOCK_W)                                     # (BLOCK_W,) column of the new window
    mask_b = offs_b < n_seqs
    mask = (mask_b[:, None, None] & (offs_c < n_channels)[None, :, None]
            & (offs_w < WIDTH - 1)[None, None, :])                     # (BLOCK_B, BLOCK_C, BLOCK_W)

    start = tl.load(cu_seqlens_ptr + offs_b, mask=mask_b, other=0)    # (BLOCK_B,)
    length = tl.load(cu_seqlens_ptr + offs_b + 1, mask=mask_b, other=0) - start
    slot = tl.load(state_indices_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + offs_b, mask=mask_b, other=0) != 0

    # New column i is window entry length + i: an input when it is >= W-1, else the old column length + i.
    entry = length[:, None] + offs_w[None, :]                          # (BLOCK_B, BLOCK_W)
    from_x = (entry >= WIDTH - 1)[:, None, :]                          # (BLOCK_B, 1, BLOCK_W)
    token = (start[:, None] + entry - (WIDTH - 1)).to(tl.int64)        # (BLOCK_B, BLOCK_W) packed index when from_x
    x_vals = tl.load(x_ptr + token[:, None, :] * stride_x_t + offs_c[None, :, None] * stride_x_c,
                     mask=mask & from_x, other=0.0)
    state_base = (conv_states_ptr + (slot * stride_states_s)[:, None, None]
                  + offs_c[None, :, None] * stride_states_c)           # (BLOCK_B, BLOCK_C, 1)
    old_vals = tl.load(state_base + entry[:, None, :] * stride_states_w,
                       mask=mask & ~from_x & has_initial[:, None, None], other=0.0)
    new_vals = x_vals.to(tl.float32) + old_vals.to(tl.float32)         # (BLOCK_B, BLOCK_C, BLOCK_W)
    tl.store(state_base + offs_w[None, None, :] * stride_states_w, new_vals.to(conv_states_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _causal_conv1d_update_fwd_kernel(
    x_ptr, conv_states_ptr, weight_ptr, bias_ptr, state_indices_ptr, out_ptr,
    n_rows, n_channels, pad_slot_id,
    stride_x_b, stride_x_c,
    stride_states_s, stride_states_c, stride_states_w,
    stride_weight_c, stride_weight_w,
    stride_bias_c,
    stride_out_b, stride_out_c,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """BLOCK_B decode rows, BLOCK_C channels: out = act(window · weight + bias); each slot's window shifts by one."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)       # (BLOCK_B,)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)       # (BLOCK_C,)
    offs_w = tl.arange(0, BLOCK_W)                                     # (BLOCK_W,)
    mask_b = offs_b < n_rows
    mask_c = offs_c < n_channels
    offs_b = offs_b.to(tl.int64)
    slot = tl.load(state_indices_ptr + offs_b, mask=mask_b, other=pad_slot_id).to(tl.int64)
    # A padding row reads and writes no slot (nor its input) and outputs 0.
    live = mask_b & (slot != pad_slot_id)                              # (BLOCK_B,)
    live_c = live[:, None] & mask_c[None, :]                           # (BLOCK_B, BLOCK_C)
    x_new = tl.load(x_ptr + offs_b[:, None] * stride_x_b + offs_c[None, :] * stride_x_c, mask=live_c, other=0.0)
    x_new = x_new.to(tl.float32)[:, :, None]                           # (BLOCK_B, BLOCK_C, 1)
    state_base = (conv_states_ptr + (slot * stride_states_s)[:, None, None]
                  + offs_c[None, :, None] * stride_states_c)           # (BLOCK_B, BLOCK_C, 1)
    in_state = live_c[:, :, None] & (offs_w < WIDTH - 1)[None, None, :]   # (BLOCK_B, BLOCK_C, BLOCK_W)
    # window (C, W) = [old columns 0..W-2 | x]; shifted (C, W-1) = [old columns 1..W-2 | x]. Both are read
    # before the slot is written.
    window = tl.load(state_base + offs_w[None, None, :] * stride_states_w, mask=in_state, other=0.0).to(tl.float32)
    window += tl.where((offs_w == WIDTH - 1)[None, None, :], x_new, 0.0)
    shifted = tl.load(state_base + (offs_w + 1)[None, None, :] * stride_states_w,
                      mask=live_c[:, :, None] & (offs_w < WIDTH - 2)[None, None, :], other=0.0).to(tl.float32)
    shifted += tl.where((offs_w == WIDTH - 2)[None, None, :], x_new, 0.0)
    weight = tl.load(weight_ptr + offs_c[:, None] * stride_weight_c + offs_w[None, :] * stride_weight_w,
                     mask=mask_c[:, None] & (offs_w < WIDTH)[None, :], other=0.0).to(tl.float32)   # (BLOCK_C, BLOCK_W)
    acc = tl.sum(window * weight[None, :, :], axis=2)                  # (BLOCK_B, BLOCK_C)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c * stride_bias_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if APPLY_SILU:
        acc = _silu(acc)
    acc = tl.where(live[:, None], acc, 0.0)
    tl.store(out_ptr + offs_b[:, None] * stride_out_b + offs_c[None, :] * stride_out_c,
             acc.to(out_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_c[None, :])
    tl.store(state_base + offs_w[None, None, :] * stride_states_w, shifted.to(conv_states_ptr.dtype.element_ty),
             mask=in_state)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------


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


def _block_sizes(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, BLOCK_B). GPU: tiles sized for bandwidth, one sequence or decode row per program.
    Interpreter, where every program costs the same fixed time whatever its size: the GPU's tile (tests with more
    tokens or channels cross its edges), and 4 sequences or decode rows, so that test batches cross row blocks."""
    return (64, 128, 1) if device.type == "cuda" else (64, 128, 4)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution over packed sequences, carrying each sequence's window in a state slot.

    x (T, C) fp16/bf16/fp32, any strides; weight (C, W); bias (C,) or None; conv_states (S, C, W-1), updated in
    place: slot state_indices[b] receives the last W-1 inputs of sequence b (its initial window in front, so a piece
    shorter than W-1 keeps part of the old window); cu_seqlens (B+1,) int; state_indices (B,) int, distinct;
    has_initial_state (B,) bool. Slots not named are neither read nor written; a slot whose has_initial_state is
    False is not read. Returns out (T, C) = activation(conv(x) + bias), in x's dtype promoted with the weight's.

    Checks the index values too (one device-to-host copy): prefill is not captured in CUDA graphs.
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
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != n_tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing from 0 to T = {n_tokens}, got {bounds}")
    slots = state_indices.tolist()
    if any(not 0 <= s < conv_states.shape[0] for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"state_indices: expected distinct slots in [0, {conv_states.shape[0]}), got {slots}")

    out = torch.empty((n_tokens, n_channels), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block_t, block_c, block_b = _block_sizes(x.device)
    bias_arg = bias if bias is not None else weight                    # never read when HAS_BIAS is False
    if n_tokens > 0:
        grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(n_channels, block_c))
        _causal_conv1d_fwd_kernel[grid](
            x, weight, bias_arg, conv_states, cu_seqlens, state_indices, has_initial_state, out,
            n_tokens, n_channels, n_seqs, (n_seqs - 1).bit_length(),
            x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1),
            bias_arg.stride(0),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            out.stride(0), out.stride(1),
            WIDTH=width, HAS_BIAS=bias is not None, APPLY_SILU=apply_silu, BLOCK_T=block_t, BLOCK_C=block_c,
        )
    if n_seqs > 0:
        _causal_conv1d_final_state_fwd_kernel[(triton.cdiv(n_seqs, block_b), triton.cdiv(n_channels, block_c))](
            x, conv_states, cu_seqlens, state_indices, has_initial_state,
            n_seqs, n_channels,
            x.stride(0), x.stride(1),
            conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
            WIDTH=width, BLOCK_B=block_b, BLOCK_W=triton.next_power_of_2(width - 1), BLOCK_C=block_c,
        )
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
    graph), so slot values are trusted.
    """
    apply_silu = _check_activation(activation)
    width = _check_conv_operands(x, weight, bias, conv_states, state_indices)
    n_rows, n_channels = x.shape
    _expect("state_indices.shape", "(B,) =", (n_rows,), tuple(state_indices.shape))
    out = torch.empty((n_rows, n_channels), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if n_rows == 0:
        return out
    _, block_c, block_b = _block_sizes(x.device)
    bias_arg = bias if bias is not None else weight                    # never read when HAS_BIAS is False
    _causal_conv1d_update_fwd_kernel[(triton.cdiv(n_rows, block_b), triton.cdiv(n_channels, block_c))](
        x, conv_states, weight, bias_arg, state_indices, out,
        n_rows, n_channels, pad_slot_id,
        x.stride(0), x.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        weight.stride(0), weight.stride(1),
        bias_arg.stride(0),
        out.stride(0), out.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, APPLY_SILU=apply_silu,
        BLOCK_B=block_b, BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c,
    )
    return out
