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

Prefill on a GPU is one launch of the row kernel, which writes the final windows too. A slot is read (the initial
window, at a sequence's first tokens) and written (the final window) by one program only, the sequence's owner:
the program whose token block holds the sequence's first token. It computes the sequence's first W-1 outputs even
where they lie past its block (the only outputs that need the initial window), so no other program reads the slot,
and it writes the final windows after all its reads. The 2-D tiles (the interpreter's launch) read initial windows
in whichever tile holds a sequence's first tokens, so there the final windows are a second launch, after them.

Both ops are memory-bound: every tile runs along the channels (stride 1 in the channel-last layouts of the mixer's
projection and of vLLM's pool), so loads and stores are 16-byte vectors when the strides allow. Tiles, warps and
programmatic dependent launch (on a GPU, a kernel's programs may be scheduled while the previous kernel finishes;
they wait for its writes before touching memory) are chosen in `_prefill_launch` and `_update_launch` only,
in vendored/ops/causal_conv1d.py with the rest of the host side (argument checks, grids, launches).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    n_slots,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHANNELS_FASTEST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One (BLOCK_T packed tokens, BLOCK_C channels) tile of out; a tile may straddle sequence boundaries.
    CHANNELS_FASTEST: consecutive programs take consecutive channel blocks of the same tokens (whole rows of x
    read together), else consecutive token blocks of the same channels.

    Tap j of token t reads input t + j - (W-1): the same tile shifted up by W-1-j rows, so the W loads of a tile
    overlap and all but the first come from L1/L2. Addresses are a per-tile int64 base plus int32 offsets inside
    the tile (the host keeps those below 2^31). The host checks the index values only after the launch, so bad
    ones must not make the kernel touch memory outside x, out and the pool: the masks keep every input row >= 0
    and every state read inside its slot, and slots inside the pool."""
    pid = tl.program_id(0)                                             # one grid axis: no 65535 limit
    if CHANNELS_FASTEST:
        n_blocks_c = tl.cdiv(n_channels, BLOCK_C)
        pid_t, pid_c = pid // n_blocks_c, pid % n_blocks_c
    else:
        n_blocks_t = tl.cdiv(n_tokens, BLOCK_T)
        pid_t, pid_c = pid % n_blocks_t, pid // n_blocks_t
    t0 = pid_t * BLOCK_T                                               # first token of the tile
    c0 = pid_c * BLOCK_C
    rows = tl.arange(0, BLOCK_T)                                       # (BLOCK_T,) token inside the tile
    cols = tl.arange(0, BLOCK_C)                                       # (BLOCK_C,) channel inside the tile
    offs_t = t0 + rows
    offs_c = c0 + cols
    mask_t = offs_t < n_tokens
    mask_c = offs_c < n_channels
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                                       # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()                          # the next one may start (and wait likewise)
    # The W weight columns, loaded (and laid out for the tile) once, before any input.
    w_taps = ()
    for j in tl.static_range(WIDTH):
        w_j = tl.load(weight_ptr + offs_c * stride_weight_c + j * stride_weight_w, mask=mask_c, other=0.0)
        w_taps = w_taps + (w_j.to(tl.float32),)                        # W x (BLOCK_C,)

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
    pos = offs_t - seq_start                                           # (BLOCK_T,) position inside the sequence

    x_tile = x_ptr + t0.to(tl.int64) * stride_x_t + c0.to(tl.int64) * stride_x_c
    col_x = (cols * stride_x_c)[None, :]                               # (1, BLOCK_C)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # Tap j reads window entry pos + j: input t + j - (W-1) when that is inside the sequence, as it is for
        # every token but a sequence's first W-1 (whose tiles are redone below). So these loads need not wait for
        # the search.
        x_tap = tl.load(x_tile + ((rows + (j - (WIDTH - 1))) * stride_x_t)[:, None] + col_x,
                        mask=(mask_t & (offs_t >= WIDTH - 1 - j))[:, None] & mask_c[None, :], other=0.0)
        acc += x_tap.to(tl.float32) * w_taps[j][None, :]

    # Taps before a sequence's start read its initial window (zeros without one). Only a sequence's first W-1
    # tokens have such taps, so most tiles skip this block, and its loads.
    near_start = mask_t & (pos < WIDTH - 1)                            # (BLOCK_T,)
    if tl.max(near_start.to(tl.int32), axis=0) > 0:
        slot = tl.load(state_indices_ptr + seq, mask=near_start, other=0).to(tl.int64)
        has_initial = tl.load(has_initial_state_ptr + seq, mask=near_start, other=0) != 0
        reads_state = mask_t & (pos < WIDTH - 1) & has_initial         # (BLOCK_T,)
        reads_state = reads_state & (pos >= 0) & (slot >= 0) & (slot < n_slots)   # false unless indices are bad
        state_rows = conv_states_ptr + slot * stride_states_s          # (BLOCK_T,) int64 slot bases
        # The tile again, each tap now its input or its initial-window entry: every output the same sum, in the
        # same order, as without initial windows (and as in the row kernel), so launch choices agree bit for bit.
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            x_tap = tl.load(x_tile + ((rows + (j - (WIDTH - 1))) * stride_x_t)[:, None] + col_x,
                            mask=(mask_t & (offs_t >= WIDTH - 1 - j))[:, None] & mask_c[None, :], other=0.0)
            from_x = pos + j >= WIDTH - 1                              # (BLOCK_T,)
            tap = tl.where(from_x[:, None], x_tap.to(tl.float32), 0.0)
            if j < WIDTH - 1:
                # window entry pos + j < W-1 is column pos + j of the initial window
                s_tap = tl.load(state_rows[:, None] + (offs_c * stride_states_c)[None, :]
                                + ((pos + j) * stride_states_w)[:, None],
                                mask=(reads_state & (pos + j < WIDTH - 1))[:, None] & mask_c[None, :], other=0.0)
                tap += s_tap.to(tl.float32)
            acc += tap * w_taps[j][None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c * stride_bias_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if APPLY_SILU:
        acc = _silu(acc)
    out_tile = out_ptr + t0.to(tl.int64) * stride_out_t + c0.to(tl.int64) * stride_out_c
    tl.store(out_tile + (rows * stride_out_t)[:, None] + (cols * stride_out_c)[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _lower_bound(cu_seqlens_ptr, n_seqs, target, n_steps):
    """The first b in [0, n_seqs] with cu_seqlens[b] >= target (n_seqs if none): n_steps = ceil(log2(n_seqs + 1))
    halvings, each reading inside cu_seqlens whatever its values."""
    lo = 0
    hi = n_seqs
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        below = tl.load(cu_seqlens_ptr + mid) < target
        lo, hi = tl.where((lo < hi) & below, mid + 1, lo), tl.where((lo < hi) & ~below, mid, hi)
    return lo


@triton.jit
def _causal_conv1d_rows_fwd_kernel(
    x_ptr, weight_ptr, bias_ptr, conv_states_ptr, cu_seqlens_ptr, state_indices_ptr, has_initial_state_ptr,
    out_ptr,
    n_tokens, n_channels, n_seqs, n_search_steps, n_bound_steps,
    stride_x_t, stride_x_c,
    stride_weight_c, stride_weight_w,
    stride_bias_c,
    stride_states_s, stride_states_c, stride_states_w,
    stride_out_t, stride_out_c,
    n_slots,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ROWS_PER_STEP: tl.constexpr, CHANNELS_FASTEST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The same outputs and final windows as _causal_conv1d_fwd_kernel followed by the final-window kernel (bit for
    bit), in one launch, computed row after row: tokens t0..t0+BLOCK_T-1 for BLOCK_C channels, the window (the W-1
    entries before the current token) carried in registers. Each input row is loaded once (and the W-1 before the
    block once more), ROWS_PER_STEP rows at a time so that their loads are in flight together.

    The program owns the sequences that start in its block (the last block also those starting at n_tokens: empty
    trailing ones): at an owned sequence's first token the window becomes its initial window (zeros without one),
    its first W-1 outputs are computed here even past the block's end, and its final window is written here, after
    every read. At the first token of a sequence it does not own the window starts from zeros, and its outputs
    before the sequence's W-1th token are left to the owner: so a slot is touched by one program only. The grid has
    at least one token block whenever there are sequences (all of them empty included)."""
    pid = tl.program_id(0)
    if CHANNELS_FASTEST:
        n_blocks_c = tl.cdiv(n_channels, BLOCK_C)
        pid_t, pid_c = pid // n_blocks_c, pid % n_blocks_c
    else:
        n_blocks_t = tl.maximum(tl.cdiv(n_tokens, BLOCK_T), 1)
        pid_t, pid_c = pid % n_blocks_t, pid // n_blocks_t
    t0 = pid_t * BLOCK_T
    t_end = tl.minimum(t0 + BLOCK_T, n_tokens)
    is_last = t0 + BLOCK_T >= n_tokens
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)                  # (BLOCK_C,)
    mask_c = offs_c < n_channels
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w_taps = ()
    for j in tl.static_range(WIDTH):
        w_j = tl.load(weight_ptr + offs_c * stride_weight_c + j * stride_weight_w, mask=mask_c, other=0.0)
        w_taps = w_taps + (w_j.to(tl.float32),)                        # W x (BLOCK_C,)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c * stride_bias_c, mask=mask_c, other=0.0).to(tl.float32)

    # The sequence b of token t0 (largest b with cu_seqlens[b] <= t0), then start W-1 rows earlier, or at b's start.
    lo = 0
    hi = n_seqs
    for _ in range(n_search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_ptr + mid) <= t0
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    seq_start = tl.load(cu_seqlens_ptr + seq)
    next_start = tl.load(cu_seqlens_ptr + seq + 1)
    t = tl.maximum(t0 - (WIDTH - 1), seq_start)
    # The owned sequences [b_first, b_end): the first b with cu_seqlens[b] >= t0, and with cu_seqlens[b] >= t_end
    # (n_seqs in the last block). The last of them may run past the block: its first W-1 tokens are this
    # program's, so the rows go on to t_stop.
    b_first = _lower_bound(cu_seqlens_ptr, n_seqs, t0, n_bound_steps)
    b_end = tl.where(is_last, n_seqs, _lower_bound(cu_seqlens_ptr, n_seqs, t_end, n_bound_steps))
    t_stop = t_end
    if b_end > b_first:
        last_start = tl.load(cu_seqlens_ptr + b_end - 1)
        last_end = tl.load(cu_seqlens_ptr + b_end)
        t_stop = tl.maximum(t_end, tl.minimum(tl.minimum(last_start + WIDTH - 1, last_end), n_tokens))
    window = ()
    for j in tl.static_range(WIDTH - 1):
        window = window + (tl.zeros([BLOCK_C], dtype=tl.float32),)    # W-1 x (BLOCK_C,); set before it is read
    x_cols = x_ptr + offs_c * stride_x_c
    out_cols = out_ptr + offs_c * stride_out_c
    state_cols = conv_states_ptr + offs_c * stride_states_c
    while t < t_stop:
        x_rows = ()
        for u in tl.static_range(ROWS_PER_STEP):
            row_ok = (t + u >= 0) & (t + u < t_stop)                   # >= 0 unless cu_seqlens is bad
            x_row = tl.load(x_cols + (t + u).to(tl.int64) * stride_x_t, mask=mask_c & row_ok, other=0.0)
            x_rows = x_rows + (x_row,)
        for u in tl.static_range(ROWS_PER_STEP):
            if t + u < t_stop:
                while (next_start <= t + u) & (seq < n_seqs - 1):      # into the next sequence (past empty ones)
                    seq += 1
                    seq_start = next_start
                    next_start = tl.load(cu_seqlens_ptr + seq + 1)
                if t + u == seq_start:                                 # a sequence's first token: its initial window
                    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
                    reads = (tl.load(has_initial_state_ptr + seq) != 0) & (slot >= 0) & (slot < n_slots)
                    reads = reads & (seq_start >= t0)                  # the owner's alone
                    window = ()
                    for j in tl.static_range(WIDTH - 1):
                        column = tl.load(state_cols + slot * stride_states_s + j * stride_states_w,
                                         mask=mask_c & reads, other=0.0)
                        window = window + (column.to(tl.float32),)
                x_now = x_rows[u].to(tl.float32)
                acc = tl.zeros([BLOCK_C], dtype=tl.float32)
                for j in tl.static_range(WIDTH - 1):
                    acc += window[j] * w_taps[j]
                acc += x_now * w_taps[WIDTH - 1]
                if HAS_BIAS:
                    acc += bias
                if APPLY_SILU:
                    acc = _silu(acc)
                # Rows before t0 only fill the window; a sequence's first W-1 rows are its owner's.
                mine = (t + u >= t0) & ((seq_start >= t0) | (t + u >= seq_start + WIDTH - 1))
                tl.store(out_cols + (t + u).to(tl.int64) * stride_out_t, acc.to(out_ptr.dtype.element_ty),
                         mask=mask_c & mine)
                window = window[1:] + (x_now,)
        t += ROWS_PER_STEP

    # The owned sequences' final windows: entry length + i of [initial | inputs] is column i. Every read (those of
    # the rows above included) before the first store, since a new column may be an old one.
    for b in range(b_first, b_end):
        start = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - start
        slot = tl.load(state_indices_ptr + b).to(tl.int64)
        has_initial = tl.load(has_initial_state_ptr + b) != 0
        in_pool = mask_c & (slot >= 0) & (slot < n_slots)              # false only for bad slots
        slot_cols = state_cols + slot * stride_states_s
        columns = ()
        for i in tl.static_range(WIDTH - 1):
            entry = length + i
            token = start + entry - (WIDTH - 1)                        # the input, when entry >= W-1
            x_val = tl.load(x_cols + token.to(tl.int64) * stride_x_t,
                            mask=in_pool & (entry >= WIDTH - 1) & (token >= 0) & (token < n_tokens), other=0.0)
            old_val = tl.load(slot_cols + entry * stride_states_w,
                              mask=in_pool & (entry < WIDTH - 1) & (entry >= 0) & has_initial, other=0.0)
            columns = columns + (x_val.to(tl.float32) + old_val.to(tl.float32),)
        tl.debug_barrier()
        for i in tl.static_range(WIDTH - 1):
            tl.store(slot_cols + i * stride_states_w, columns[i].to(conv_states_ptr.dtype.element_ty),
                     mask=in_pool & (length + i >= 0))


@triton.jit
def _causal_conv1d_final_state_fwd_kernel(
    x_ptr, conv_states_ptr, cu_seqlens_ptr, state_indices_ptr, has_initial_state_ptr,
    n_seqs, n_channels,
    stride_x_t, stride_x_c,
    stride_states_s, stride_states_c, stride_states_w,
    n_tokens, n_slots,
    WIDTH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Slot state_indices[b] <- last W-1 entries of sequence b's window [initial | inputs], for BLOCK_B sequences
    and BLOCK_C channels. Every read comes before the one store (a new column may be an old one). As in the
    convolution, bad index values (checked after the launch) touch nothing outside x and the pool."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)       # (BLOCK_B,)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)       # (BLOCK_C,)
    offs_w = tl.arange(0, BLOCK_W)                                     # (BLOCK_W,) column of the new window
    mask_b = offs_b < n_seqs
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.load(cu_seqlens_ptr + offs_b, mask=mask_b, other=0)    # (BLOCK_B,)
    length = tl.load(cu_seqlens_ptr + offs_b + 1, mask=mask_b, other=0) - start
    slot = tl.load(state_indices_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)
    has_initial = tl.load(has_initial_state_ptr + offs_b, mask=mask_b, other=0) != 0

    # New column i is window entry length + i: an input when it is >= W-1, else the old column length + i.
    entry = length[:, None] + offs_w[None, :]                          # (BLOCK_B, BLOCK_W)
    in_pool = mask_b & (slot >= 0) & (slot < n_slots)                  # (BLOCK_B,) false only for bad slots
    mask = (in_pool[:, None, None] & (offs_c < n_channels)[None, :, None]
            & ((offs_w < WIDTH - 1)[None, :] & (entry >= 0))[:, None, :])   # (BLOCK_B, BLOCK_C, BLOCK_W)
    from_x = (entry >= WIDTH - 1)[:, None, :]                          # (BLOCK_B, 1, BLOCK_W)
    token = (start[:, None] + entry - (WIDTH - 1)).to(tl.int64)        # (BLOCK_B, BLOCK_W) packed index when from_x
    in_x = ((token >= 0) & (token < n_tokens))[:, None, :]             # false only for bad cu_seqlens
    x_vals = tl.load(x_ptr + token[:, None, :] * stride_x_t + offs_c[None, :, None] * stride_x_c,
                     mask=mask & from_x & in_x, other=0.0)
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
    n_rows, n_channels, pad_slot_id, n_slots,
    stride_x_b, stride_x_c,
    stride_states_s, stride_states_c, stride_states_w,
    stride_weight_c, stride_weight_w,
    stride_bias_c,
    stride_out_b, stride_out_c,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, APPLY_SILU: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    """BLOCK_B decode rows, BLOCK_C channels: out = act(window · weight + bias); each slot's window shifts by one.
    Every operand is a (BLOCK_B, BLOCK_C) tile, one window column at a time, so that loads run along the channels."""
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)       # (BLOCK_B,)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)       # (BLOCK_C,)
    mask_b = offs_b < n_rows
    mask_c = offs_c < n_channels
    offs_b = offs_b.to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                                       # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()                          # the next one may start (and wait likewise)
    slot = tl.load(state_indices_ptr + offs_b, mask=mask_b, other=pad_slot_id).to(tl.int64)
    # A padding row reads and writes no slot and outputs 0. (Its input is loaded with the others, not waiting for
    # the slot, and left unused.) A row whose slot lies outside the pool (a bad index, which a captured decode step
    # cannot wait for the host to check) touches no slot either and outputs NaN, so that the bad value shows.
    real = mask_b & (slot != pad_slot_id)                              # (BLOCK_B,)
    in_pool = (slot >= 0) & (slot < n_slots)
    live = real & in_pool
    live_c = live[:, None] & mask_c[None, :]                           # (BLOCK_B, BLOCK_C)
    x_new = tl.load(x_ptr + offs_b[:, None] * stride_x_b + offs_c[None, :] * stride_x_c,
                    mask=mask_b[:, None] & mask_c[None, :], other=0.0)
    state_base = (conv_states_ptr + (slot * stride_states_s)[:, None]
                  + (offs_c * stride_states_c)[None, :])               # (BLOCK_B, BLOCK_C) column 0 of each slot
    # window (C, W) = [old columns 0..W-2 | x]
    w_last = tl.load(weight_ptr + offs_c * stride_weight_c + (WIDTH - 1) * stride_weight_w, mask=mask_c, other=0.0)
    acc = x_new.to(tl.float32) * w_last.to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH - 1):
        column = tl.load(state_base + k * stride_states_w, mask=live_c, other=0.0)
        w_k = tl.load(weight_ptr + offs_c * stride_weight_c + k * stride_weight_w, mask=mask_c, other=0.0)
        acc += column.to(tl.float32) * w_k.to(tl.float32)[None, :]
    # Shift: column k <- column k+1, column W-2 <- x. Column k+1 is read again (from cache) just before the store
    # that needs it, so that no store sits between the loads above, and read before it is itself overwritten.
    for k in tl.static_range(WIDTH - 2):
        column = tl.load(state_base + (k + 1) * stride_states_w, mask=live_c, other=0.0)
        tl.store(state_base + k * stride_states_w, column, mask=live_c)
    tl.store(state_base + (WIDTH - 2) * stride_states_w, x_new.to(conv_states_ptr.dtype.element_ty), mask=live_c)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c * stride_bias_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if APPLY_SILU:
        acc = _silu(acc)
    acc = tl.where(live[:, None], acc, tl.where(real & ~in_pool, float("nan"), 0.0)[:, None])
    tl.store(out_ptr + offs_b[:, None] * stride_out_b + offs_c[None, :] * stride_out_c,
             acc.to(out_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_c[None, :])

