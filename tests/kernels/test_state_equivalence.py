"""Carrying state works: prefill of a prompt (causal_conv1d, then ssd_scan) followed by k decode steps
(causal_conv1d_update, then selective_state_update) gives what a prefill of the prompt and those k tokens gives,
for the outputs of the k decoded tokens and for every final conv window and SSM state.

The mixer is cut down to the ops that carry state: xBC -> conv + SiLU -> split x | B | C -> scan with dt, z.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import pytest
import torch

from reference.ops import causal_conv1d_ref, causal_conv1d_update_ref, selective_state_update_ref, ssd_scan_ref
from tests.kernels.common import DEVICE, assert_slots_untouched, assert_three_way, poison_slots
from tests.kernels.providers import OPS

K = 2.0
ATOL = 1e-5                             # fp32 (the interpreter); the GPU runs these too, still in fp32

H, P, N, G, W, Q = 4, 16, 16, 2, 4, 16
CHANNELS = H * P + 2 * G * N            # xBC width
PROMPTS = [1, W - 1, Q + 1]             # prompt lengths: one token, exactly the window, just past a chunk
HAS_INITIAL = [False, True, False]
SLOTS = [6, 2, 0]                       # never the batch index; slot 0 live, where a careless padding row would land
PAD = -1
DECODE_ROWS = [0, PAD, 6, PAD, 2]       # decode batch: padding rows between live rows, not in prefill order
N_SLOTS = 8
MAX_STEPS = 5


class Ops(NamedTuple):
    conv: Callable
    conv_update: Callable
    scan: Callable
    state_update: Callable


TWINS = Ops(causal_conv1d_ref, causal_conv1d_update_ref, ssd_scan_ref, selective_state_update_ref)


def kernel_ops() -> Ops:
    return Ops(OPS.causal_conv1d, OPS.causal_conv1d_update, OPS.ssd_scan, OPS.selective_state_update)


class Run(NamedTuple):
    y: torch.Tensor                     # (B, k, H, P): the outputs of each sequence's last k tokens
    conv_pool: torch.Tensor             # (S, C, W-1) after the run
    ssm_pool: torch.Tensor              # (S, H, P, N) after the run


@functools.cache
def inputs() -> dict:
    """Every sequence's tokens for its prompt and MAX_STEPS more; weights; initial states (NaN where unused)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [n + MAX_STEPS for n in PROMPTS]
    keep = [s for s, init in zip(SLOTS, HAS_INITIAL) if init]
    return dict(
        xbc=[torch.randn(n, CHANNELS, generator=gen) for n in lengths],                 # (L, C) per sequence
        dt=[torch.randn(n, H, generator=gen) for n in lengths],                         # (L, H)
        z=[torch.randn(n, H, P, generator=gen) for n in lengths],                       # (L, H, P)
        weight=0.5 * torch.randn(CHANNELS, W, generator=gen),
        bias=0.2 * torch.randn(CHANNELS, generator=gen),
        A=-(torch.rand(H, generator=gen) * 7.0 + 0.5),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.rand(H, generator=gen) * 3.0 - 2.5,
        conv_pool=poison_slots(torch.randn(N_SLOTS, CHANNELS, W - 1, generator=gen), keep=keep),
        ssm_pool=poison_slots(torch.randn(N_SLOTS, H, P, N, generator=gen), keep=keep),
    )


def _split_xbc(xbc_out: torch.Tensor):
    """(T, C) -> x (T, H, P), B (T, G, N), C (T, G, N), as strided views like the mixer's split."""
    x, B, C = xbc_out.split([H * P, G * N, G * N], dim=-1)
    return x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))


def run(ops: Ops, dtype: torch.dtype, n_steps: int, *, decode: bool) -> Run:
    """All in `dtype`: prefill each prompt then decode n_steps tokens one at a time (decode=True), or prefill the
    prompts and those n_steps tokens at once (decode=False)."""
    data = {name: ([t.to(DEVICE, dtype) for t in v] if isinstance(v, list) else v.to(DEVICE, dtype))
            for name, v in inputs().items()}
    conv_pool, ssm_pool = data["conv_pool"].clone(), data["ssm_pool"].clone()
    weights = dict(D=data["D"], dt_bias=data["dt_bias"])

    def index(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    n_prefill = PROMPTS if decode else [n + n_steps for n in PROMPTS]
    cu_seqlens = index([0] + torch.tensor(n_prefill).cumsum(0).tolist())
    xbc, dt, z = (torch.cat([seq[:n] for seq, n in zip(data[name], n_prefill)]) for name in ("xbc", "dt", "z"))
    conv_out = ops.conv(xbc, data["weight"], data["bias"], conv_pool, cu_seqlens, index(SLOTS),
                        torch.tensor(HAS_INITIAL, device=DEVICE))
    x, B, C = _split_xbc(conv_out)
    y = ops.scan(x, dt, data["A"], B, C, chunk_size=Q, z=z, cu_seqlens=cu_seqlens, ssm_states=ssm_pool,
                 state_indices=index(SLOTS), has_initial_state=torch.tensor(HAS_INITIAL, device=DEVICE), **weights)
    if not decode:
        ends = cu_seqlens[1:].tolist()
        return Run(torch.stack([y[end - n_steps:end] for end in ends]), conv_pool, ssm_pool)

    rows = [SLOTS.index(slot) if slot != PAD else None for slot in DECODE_ROWS]   # sequence of each decode row
    y_steps = []
    for step in range(n_steps):
        def token(name, b):
            return data[name][b][PROMPTS[b] + step] if b is not None else torch.zeros_like(data[name][0][0])

        xbc, dt, z = (torch.stack([token(name, b) for b in rows]) for name in ("xbc", "dt", "z"))
        conv_row = ops.conv_update(xbc, conv_pool, data["weight"], data["bias"], index(DECODE_ROWS), pad_slot_id=PAD)
        x, B, C = _split_xbc(conv_row)
        y_row = ops.state_update(ssm_pool, x, dt, data["A"], B, C, z=z, state_indices=index(DECODE_ROWS),
                                 pad_slot_id=PAD, **weights)                   # (rows, H, P)
        y_steps.append(y_row[[rows.index(b) for b in range(len(SLOTS))]])      # (B, H, P) in sequence order
    return Run(torch.stack(y_steps, dim=1), conv_pool, ssm_pool)


@functools.cache
def runs(n_steps: int) -> dict[str, Run]:
    return dict(
        pieces=run(kernel_ops(), torch.float32, n_steps, decode=True),
        whole=run(kernel_ops(), torch.float32, n_steps, decode=False),
        whole64=run(TWINS, torch.float64, n_steps, decode=False),
        whole_low=run(TWINS, torch.float32, n_steps, decode=False),
    )


def _compared(r: Run) -> dict[str, torch.Tensor]:
    return dict(y=r.y, conv_states=r.conv_pool[SLOTS], ssm_states=r.ssm_pool[SLOTS])


STEPS = pytest.mark.parametrize("n_steps", range(1, MAX_STEPS + 1), ids=lambda k: f"k{k}")


@STEPS
def test_pieces_match_whole_prefill_oracle(n_steps):
    r = runs(n_steps)
    pieces, ref64, ref_low = _compared(r["pieces"]), _compared(r["whole64"]), _compared(r["whole_low"])
    for name in pieces:
        assert_three_way(name, pieces[name], ref64[name], ref_low[name], k=K, atol=ATOL)
    for name in ("conv_pool", "ssm_pool"):
        assert_slots_untouched(name, inputs()[name], getattr(r["pieces"], name).cpu(), touched=SLOTS)


@STEPS
def test_pieces_match_whole_prefill_kernel(n_steps):
    # A relative check inside one engine, with the same budget (docs/design.md §4): |pieces - whole| must stay within
    # k·|ref_low - ref64| + atol. Passing pieces - whole + ref64 as the candidate states exactly that.
    r = runs(n_steps)
    pieces, whole = _compared(r["pieces"]), _compared(r["whole"])
    ref64, ref_low = _compared(r["whole64"]), _compared(r["whole_low"])
    for name in pieces:
        shifted = pieces[name].double() - whole[name].double() + ref64[name]
        assert_three_way(f"{name} (pieces - whole kernel prefill)", shifted, ref64[name], ref_low[name], k=K,
                         atol=ATOL)
