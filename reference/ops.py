"""Naive twins of the Triton kernels, and the small functions the reference model is made of.

Each `<op>_ref` has the signature and return values of the kernel `<op>` in vendored/ops, so a test can call both
on the same arguments. They are written for reading, not speed: the SSD scan is the plain sequential recurrence
(one step per token), not the chunked algorithm; `chunk_size` is accepted only so the signatures match.

Layout conventions (shape letters from docs/design.md §2):
- Prefill ops take packed variable-length input: the tokens of all sequences one after another, T in total, with
  `cu_seqlens` (B+1,) the cumulative sequence lengths (sequence b is tokens cu_seqlens[b]:cu_seqlens[b+1]).
- States live in pools of slots: `conv_states` (S, C, W-1) and `ssm_states` (S, H, P, N). Sequence b reads and
  writes slot `state_indices[b]`; it starts from that slot's contents when `has_initial_state[b]`, from zeros
  otherwise. Slots not named are neither read nor written.
- Decode ops take one token per row; a row whose slot index equals `pad_slot_id` is padding: its slot is neither
  read nor written and its output row is zero.
Arithmetic runs in the promoted dtype of the inputs (and of the state pool, for the recurrences); a state is stored
back in the pool's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Mamba2 mixer ops: the twins of vendored/ops
# ---------------------------------------------------------------------------------------------------------------


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")


def causal_conv1d_ref(
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

    x (T, C); weight (C, W); bias (C,) or None; conv_states (S, C, W-1), updated in place: slot state_indices[b]
    receives the last W-1 inputs of sequence b (its initial window in front, so a piece shorter than W-1 keeps part
    of the old window); cu_seqlens (B+1,); state_indices (B,); has_initial_state (B,) bool.
    Returns out (T, C) = activation(conv(x) + bias), in x's dtype promoted with the weight's.
    check_indices is unused (kept for the kernel's signature: the twin indexes with the values on the host).
    """
    del check_indices
    width = weight.shape[1]                                            # W
    dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)           # (T, C)
    for b in range(len(state_indices)):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        slot = int(state_indices[b])
        if bool(has_initial_state[b]):
            initial = conv_states[slot].to(dtype)                      # (C, W-1)
        else:
            initial = torch.zeros(x.shape[1], width - 1, dtype=dtype, device=x.device)
        window = torch.cat([initial, x[start:end].to(dtype).T], dim=1)  # (C, W-1+L)
        taps = window.unfold(1, width, 1)                              # (C, L, W)
        y = torch.einsum("clw,cw->lc", taps, weight.to(dtype))         # (L, C)
        if bias is not None:
            y = y + bias.to(dtype)
        out[start:end] = _activate(y, activation)
        conv_states[slot] = window[:, window.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """One decode step of the causal convolution for a batch of sequences.

    x (B, C) one new input per sequence; conv_states (S, C, W-1), updated in place (window shifted by one);
    weight (C, W); bias (C,) or None; state_indices (B,); rows with state_indices == pad_slot_id are skipped.
    Returns out (B, C).
    """
    dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)           # (B, C)
    for b in range(x.shape[0]):
        slot = int(state_indices[b])
        if slot == pad_slot_id:
            continue
        window = torch.cat([conv_states[slot].to(dtype), x[b, :, None].to(dtype)], dim=1)  # (C, W)
        y = (window * weight.to(dtype)).sum(dim=1)                     # (C,)
        if bias is not None:
            y = y + bias.to(dtype)
        out[b] = _activate(y, activation)
        conv_states[slot] = window[:, 1:].to(conv_states.dtype)
    return out


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """Δ = clamp(softplus(dt + dt_bias), dt_limit). dt (..., H); dt_bias (H,) or None."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)                      # threshold 20: identity above, as every Mamba kernel does
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def group_of_head(n_heads: int, n_groups: int, device=None) -> torch.Tensor:
    """The B/C group each mamba head reads: interleaved blocks, head h -> h // (H/G) (not h % G)."""
    return torch.arange(n_heads, device=device) // (n_heads // n_groups)   # (H,)


SCAN_BLOCK = 64                 # tokens whose state-independent terms ssd_scan_ref forms at once


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    check_indices: bool = True,
) -> torch.Tensor:
    """The selective state-space recurrence over packed sequences, one token at a time.

    For each sequence, head h (group g = h // (H/G)) and token t:
        Δ_t = clamp(softplus(dt_t + dt_bias), dt_limit)
        S_t = exp(Δ_t·A_h)·S_{t-1} + Δ_t·x_t ⊗ B_t          S (P, N)
        y_t = S_t·C_t + D_h·x_t,  then y_t·silu(z_t) if z is given
    x (T, H, P); dt (T, H); A (H,) (negative); B, C (T, G, N); D (H,) or None; dt_bias (H,) or None;
    z (T, H, P) or None; cu_seqlens (B+1,); ssm_states (S, H, P, N), updated in place with each sequence's final
    state; state_indices (B,); has_initial_state (B,) bool. chunk_size and check_indices are unused (kept for the
    kernel's signature). Returns y (T, H, P) in the promoted dtype of x and the state pool.
    """
    del chunk_size, check_indices
    n_heads, n_groups = x.shape[1], B.shape[1]
    dtype = torch.promote_types(x.dtype, ssm_states.dtype)
    group = group_of_head(n_heads, n_groups, x.device)                 # (H,)
    delta = discretize_dt(dt.to(torch.promote_types(dt.dtype, dtype)), dt_bias, dt_softplus, dt_limit).to(dtype)
    x, A = x.to(dtype), A.to(dtype)
    B_h, C_h = B.to(dtype)[:, group], C.to(dtype)[:, group]            # (T, H, N)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)             # (T, H, P)
    for b in range(len(state_indices)):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        slot = int(state_indices[b])
        if bool(has_initial_state[b]):
            state = ssm_states[slot].to(dtype)                         # (H, P, N)
        else:
            state = torch.zeros(ssm_states.shape[1:], dtype=dtype, device=x.device)
        # The recurrence runs one token at a time; what does not depend on the state (the decay and the input
        # term) is formed SCAN_BLOCK tokens at once, so that a long sequence costs two tensor ops per token and
        # memory stays O(SCAN_BLOCK·H·P·N) however long it is.
        for lo in range(start, end, SCAN_BLOCK):
            hi = min(lo + SCAN_BLOCK, end)
            decay = torch.exp(delta[lo:hi] * A)                                               # (L, H)
            inject = torch.einsum("lhp,lhn->lhpn", delta[lo:hi, :, None] * x[lo:hi], B_h[lo:hi])   # (L, H, P, N)
            states = []
            for t in range(hi - lo):
                state = decay[t, :, None, None] * state + inject[t]                          # (H, P, N)
                states.append(state)
            y[lo:hi] = torch.einsum("lhpn,lhn->lhp", torch.stack(states), C_h[lo:hi])        # (L, H, P)
        ssm_states[slot] = state.to(ssm_states.dtype)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y


def selective_state_update_ref(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    state_indices: torch.Tensor,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """One decode step of the recurrence for a batch of sequences (same equations as ssd_scan_ref).

    ssm_states (S, H, P, N), updated in place; x (B, H, P); dt (B, H); A (H,); B, C (B, G, N); D (H,) or None;
    dt_bias (H,) or None; z (B, H, P) or None; state_indices (B,); rows with state_indices == pad_slot_id are
    padding: not read, not written, output zero. Returns y (B, H, P).
    """
    n_heads, n_groups = x.shape[1], B.shape[1]
    dtype = torch.promote_types(x.dtype, ssm_states.dtype)
    group = group_of_head(n_heads, n_groups, x.device)
    delta = discretize_dt(dt.to(torch.promote_types(dt.dtype, dtype)), dt_bias, dt_softplus, dt_limit).to(dtype)
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)             # (B, H, P)
    for b in range(x.shape[0]):
        slot = int(state_indices[b])
        if slot == pad_slot_id:
            continue
        xb = x[b].to(dtype)                                            # (H, P)
        B_h, C_h = B[b].to(dtype)[group], C[b].to(dtype)[group]        # (H, N)
        decay = torch.exp(delta[b] * A.to(dtype))                      # (H,)
        state = decay[:, None, None] * ssm_states[slot].to(dtype) \
            + torch.einsum("hp,hn->hpn", delta[b, :, None] * xb, B_h)  # (H, P, N)
        ssm_states[slot] = state.to(ssm_states.dtype)
        yb = torch.einsum("hpn,hn->hp", state, C_h)
        if D is not None:
            yb = yb + D.to(dtype)[:, None] * xb
        if z is not None:
            yb = yb * F.silu(z[b].to(dtype))
        y[b] = yb
    return y


def rms_norm_gated_ref(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels (Bamba: group size H·P/G, gate before the norm).

    x (T, D·) and gate (T, D·) or None; weight (D·,). norm_before_gate=False: w·rms_g(x·silu(gate));
    True: w·rms_g(x)·silu(gate). Statistics in at least fp32; returns x's dtype.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype)
    if gate is not None and not norm_before_gate:
        h = h * F.silu(gate.to(dtype))
    width = h.shape[-1]
    if width % group_size:
        raise ValueError(f"group_size = {group_size} does not divide the width {width}")
    grouped = h.reshape(*h.shape[:-1], width // group_size, group_size)       # (T, G, D·/G)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    h = grouped.reshape(h.shape) * weight.to(dtype)
    if gate is not None and norm_before_gate:
        h = h * F.silu(gate.to(dtype))
    return h.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The rest of the layer: norm, rotary embedding, attention, MLP
# ---------------------------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in at least fp32. x (..., D); weight (D,)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then RMSNorm: (x + delta, rms_norm_ref(x + delta)), the sum in x's dtype; delta None: (x,
    rms_norm_ref(x)). x, delta (T, D); weight (D,)."""
    total = x if delta is None else x + delta
    return total, rms_norm_ref(total, weight, eps)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product silu(gate)·up, in the inputs' dtype (16-bit: the silu rounded before the product)."""
    return F.silu(gate) * up


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, *, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first `rotary_dim` dims of each head; the rest pass through.

    x (T, Hx, Dh); positions (T,) absolute token positions. Angles in fp64 for the oracle's sake, whatever x is.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=x.device) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]        # (T, R/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)   # (T, 1, R)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    rotated = torch.cat([-second, first], dim=-1)
    return torch.cat([rot * cos + rotated * sin, passthrough], dim=-1)


ATTENTION_SCORES_LIMIT = 1 << 24   # scores gqa_attention_ref holds at once: queries go in blocks past this


def gqa_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of new queries over all keys of one sequence.

    q (Tq, Hq, Dh) are the last Tq of the Tk positions whose keys/values are k, v (Tk, Hkv, Dh); query head h reads
    kv head h // (Hq/Hkv). Queries are taken in blocks of at most ATTENTION_SCORES_LIMIT / (Hq·Tk) (at least one),
    so that memory stays bounded for contexts of 100,000 tokens and more; rows are independent, so blocks change
    nothing. Returns (Tq, Hq, Dh).
    """
    t_q, n_q, head_dim = q.shape
    t_k, n_kv = k.shape[0], k.shape[1]
    grouped = q.reshape(t_q, n_kv, n_q // n_kv, head_dim)                        # (Tq, Hkv, Hq/Hkv, Dh)
    out = torch.empty(t_q, n_kv, n_q // n_kv, head_dim, dtype=q.dtype, device=q.device)
    block = max(1, ATTENTION_SCORES_LIMIT // (n_q * t_k))
    key_pos = torch.arange(t_k, device=q.device)
    for lo in range(0, t_q, block):
        hi = min(lo + block, t_q)
        scores = torch.einsum("qkgd,tkd->kgqt", grouped[lo:hi], k) * scale     # (Hkv, Hq/Hkv, Lq, Tk)
        query_pos = torch.arange(t_k - t_q + lo, t_k - t_q + hi, device=q.device)
        allowed = key_pos[None, :] <= query_pos[:, None]                         # (Lq, Tk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        out[lo:hi] = torch.einsum("kgqt,tkd->qkgd", probs, v)                    # (Lq, Hkv, Hq/Hkv, Dh)
    return out.reshape(t_q, n_q, head_dim)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, *, block_size: int, scale: float) -> torch.Tensor:
    """Decode attention over a paged K/V cache (twin of vendored.ops.decode_attention): one query per row.

    q (B, Hq, Dh), the query at position n_b - 1 of row b's context of n_b = context_lens[b] keys; k_cache, v_cache
    (num_blocks·block_size, Hkv, Dh); block_tables (B, M): key p of row b is at flat position
    block_tables[b, p // block_size]·block_size + p % block_size. Each row gathers its n_b keys and values through
    the first ceil(n_b / block_size) entries of its table (entries past the context are never looked at), and is
    gqa_attention_ref of its query over them. n_b <= 0 is a padding row: zeros; n_b is taken as at most
    M·block_size (the keys a table names), as the kernel takes it. Returns (B, Hq, Dh) in q's dtype (fp64 given
    fp64).
    """
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    width = block_tables.shape[1] * block_size
    for b, n in enumerate(context_lens.tolist()):
        n = min(max(n, 0), width)
        if n == 0:
            continue
        positions = torch.arange(n, device=block_tables.device)
        slots = block_tables[b, positions // block_size].long() * block_size + positions % block_size
        out[b] = gqa_attention_ref(q[b:b + 1], k_cache[slots], v_cache[slots], scale=scale)[0]
    return out


def swiglu_ref(x: torch.Tensor, gate_w, up_w, down_w, gate_b=None, up_b=None, down_b=None) -> torch.Tensor:
    """Bamba's MLP: down(silu(gate(x)) · up(x)). x (T, D); gate_w, up_w (I, D); down_w (D, I)."""
    return F.linear(F.silu(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


def moe_ref(x: torch.Tensor, router_w: torch.Tensor, experts_in: torch.Tensor, experts_out: torch.Tensor, *,
            top_k: int, swap: torch.Tensor | None = None, record: list | None = None) -> torch.Tensor:
    """GraniteMoeHybrid's routed experts. x (T, D); router_w (E, D); experts_in (E, 2I, D): each expert's gate rows,
    then its up rows; experts_out (E, D, I).

    Each token goes to the top_k experts by router logit (logits in at least fp32, as engines compute them; equal
    logits go to the lower expert index), weighted by the softmax of those top_k logits alone (the weights of a token
    sum to 1; the other experts' logits do not enter), and each expert is a SwiGLU: out_e(silu(gate_e·x) · up_e·x).

    swap (T,) bool, optional: those tokens go instead to the experts ranked 1..top_k-1 and top_k + 1 (the last
    chosen expert traded for the best one left out), as a computation whose rounding reversed those two logits
    would route them (harness/routing.py). record, optional: a list the router logits (T, E) are appended to.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x.to(wide), router_w.to(wide))                                # (T, E)
    if record is not None:
        record.append(logits)
    ranked = torch.sort(logits, dim=-1, descending=True, stable=True)               # stable: ties by lower index
    indices, values = ranked.indices, ranked.values
    if swap is not None and bool(swap.any()):
        order = torch.arange(indices.shape[-1], device=indices.device).repeat(indices.shape[0], 1)
        order[swap, top_k - 1], order[swap, top_k] = top_k, top_k - 1
        indices, values = indices.gather(1, order), values.gather(1, order)
    chosen, weights = indices[:, :top_k], torch.softmax(values[:, :top_k], dim=-1).to(x.dtype)
    out = torch.zeros_like(x)                                                       # (T, D)
    for e in range(router_w.shape[0]):
        tokens, slot = (chosen == e).nonzero(as_tuple=True)                         # who picked expert e, as which
        if tokens.numel():
            gate, up = experts_in[e].chunk(2)
            out.index_add_(0, tokens, swiglu_ref(x[tokens], gate, up, experts_out[e]) * weights[tokens, slot, None])
    return out


def log_softmax_norm_ref(x: torch.Tensor) -> torch.Tensor:
    """Per row of x (n, V), fp64: the shift c (the largest non-NaN entry; 0 where that is ±inf or the row has no
    non-NaN entry) and log Σ exp(x - c), NaN when the row holds a NaN. log_softmax(x)_j = (x_j - c) - log Σ."""
    x = x.double()
    top = torch.where(torch.isnan(x), float("-inf"), x).amax(dim=-1)
    shift = torch.where(torch.isfinite(top), top, 0.0)
    return torch.stack([shift, torch.exp(x - shift[:, None]).sum(dim=-1).log()], dim=-1)
