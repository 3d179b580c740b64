"""The check of a prefill call's index values (cu_seqlens, state_indices), shared by causal_conv1d and ssd_scan.

Those values live on the device; checking them on the host means a device-to-host copy and a wait for it. The copy is
started before the op queues its kernels and waited for after, on a side stream that waits only for the work already
queued when the op was called, so the kernels never wait for the host; the kernels themselves keep a bad value from
reaching memory outside their tensors (they mask slots outside the pool), so a call that raises has touched nothing
but the slots it names and its outputs. A caller that built the values itself and vouches for them (the engine)
passes check_indices=False to the op and skips the copy and the wait: at a 2K-token chunked-prefill piece the wait
costs more than the kernels take.
"""

from __future__ import annotations

from typing import Callable

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def start_index_check(cu_seqlens: torch.Tensor, state_indices: torch.Tensor, n_tokens: int,
                      n_slots: int) -> Callable[[], None]:
    """Start reading cu_seqlens and state_indices back; returns the check to call after the launches, which waits for
    that copy alone and raises ValueError unless cu_seqlens runs from 0 to n_tokens without decreasing and the slots
    are distinct and in [0, n_slots)."""
    if cu_seqlens.device.type == "cuda":
        device = cu_seqlens.device
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))           # behind the work that made the indices
        with torch.cuda.stream(side):
            values = torch.cat([cu_seqlens.long(), state_indices.long()])   # (B+1 + B,)
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        for t in (cu_seqlens, state_indices):
            t.record_stream(side)                                      # read on the side stream
    else:
        host, copied = torch.cat([cu_seqlens.long(), state_indices.long()]), None

    def check() -> None:
        if copied is not None:
            copied.synchronize()
        listed = host.tolist()
        bounds, slots = listed[:cu_seqlens.shape[0]], listed[cu_seqlens.shape[0]:]
        if bounds[0] != 0 or bounds[-1] != n_tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing from 0 to T = {n_tokens}, got {bounds}")
        if any(not 0 <= s < n_slots for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"state_indices: expected distinct slots in [0, {n_slots}), got {slots}")
    return check


def no_check() -> None:
    """The check of a call whose caller vouches for its index values."""
