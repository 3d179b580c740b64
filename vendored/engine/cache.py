"""The engine's memory, allocated once at start: mamba state slots and a paged K/V cache.

StatePool: per mamba layer a conv pool (S+1, C, W-1) and an SSM pool (S+1, H, P, N). Slot S is the pad slot: it
absorbs nothing and is passed to the kernels as `pad_slot_id`, so padding rows never touch a live request's state.
A request owns one slot from admission to finish; a slot is zeroed when it is handed out again.

KVCache: per attention layer K and V blocks (num_blocks+1, block_size, Hkv, Dh); a request owns a list of blocks
(its block table) that grows as its context does. Block num_blocks is the pad block, never handed out: padding rows of
a CUDA-graph decode step write their K/V there, and no live row reads it.

Both take `layers`: the layers whose tensors this process holds (default: all). A pipeline stage holds its own
layers; the driver of a parallel engine holds none and keeps only the bookkeeping (free slots, free blocks).
"""

from __future__ import annotations

from collections import deque

import torch

from .weights import EngineModelConfig


class StatePool:
    def __init__(self, cfg: EngineModelConfig, num_slots: int, *, dtype: torch.dtype, state_dtype: torch.dtype,
                 device: torch.device, layers=None) -> None:
        self.num_slots = num_slots
        self.pad_slot = num_slots                                     # the extra, never-owned slot
        self._free = list(range(num_slots))
        held = [i for i in cfg.mamba_layers if layers is None or i in layers]
        self.conv = {i: torch.zeros(num_slots + 1, cfg.conv_dim, cfg.d_conv - 1, dtype=dtype, device=device)
                     for i in held}                                   # (S+1, C, W-1)
        self.ssm = {i: torch.zeros(num_slots + 1, cfg.n_heads, cfg.head_dim, cfg.d_state, dtype=state_dtype,
                                   device=device) for i in held}      # (S+1, H, P, N)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free)

    def allocate(self) -> int:
        slot = self._free.pop(0)
        self.reset(slot)
        return slot

    def reset(self, slot: int) -> None:
        for pool in (*self.conv.values(), *self.ssm.values()):
            pool[slot].zero_()                                        # no state leaks from the previous tenant

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._free.append(slot)


class KVCache:
    def __init__(self, cfg: EngineModelConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device: torch.device, layers=None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_block = num_blocks                                   # the extra, never-owned block
        self._free = deque(range(num_blocks))                        # taken from the front, freed to the back
        shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cfg.attn_head_dim)
        held = [i for i in cfg.attn_layers if layers is None or i in layers]
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in held}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in held}
        self.enabled = bool(cfg.attn_layers)

    @property
    def num_free(self) -> int:
        return len(self._free) if self.enabled else 1 << 60

    @property
    def free_blocks(self) -> tuple[int, ...]:
        return tuple(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.enabled else 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} K/V blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]             # O(n), not O(free blocks): a list slice
                                                                    # copied 64K free ids at every decode step

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
