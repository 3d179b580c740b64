"""CUDA graphs for decode steps: one graph per batch size, captured once, replayed with padded batches.

A step whose pieces are all decodes (one token per running sequence) goes through `DecodeGraphRunner`:
1. its B rows are written into persistent buffers (token ids, positions, state slots, fixed-width block tables,
   context lengths, K/V write positions), one host-to-device copy;
2. the batch is padded up to the next captured size: a padding row feeds token 0 at position 0, names the pad
   state slot (the mamba kernels skip it) and the pad K/V block (its key is written there and nothing reads it), and
   has context length 0 (its attention output is zero);
3. the graph of that size is replayed; its first B logits rows are the step's.
`padded_decode_forward` is the step itself, a plain function of the buffers: on a CUDA device it is what is captured;
on a CPU (nothing to capture) the runner calls it eagerly, so the CPU tests check the very padding, buffers and
masks that the graphs replay. Mixed prefill + decode steps, and decode batches above the largest size, run eagerly.

Captured sizes: 1, 2, 4, ..., 512 up to the first one >= max_num_seqs. Attention spans the whole block table
(max_model_len keys), so one graph serves every context length the engine allows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from .cache import KVCache, StatePool
from .model import BambaEngineModel, StepBatch
from .scheduler import Piece

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture for an engine running at most max_num_seqs sequences at once: every size of
    CAPTURE_SIZES below max_num_seqs and the first one at or above it (all of them beyond 512)."""
    sizes = tuple(s for s in CAPTURE_SIZES if s < max_num_seqs)
    return sizes + tuple(s for s in CAPTURE_SIZES if s >= max_num_seqs)[:1]


class DecodeBuffers:
    """The graph inputs, allocated once for the largest size; a step of size b uses the first b rows.

    token_ids, positions, context_lens, kv_slot_mapping (Bmax,) int64; slots (Bmax,) int32; block_tables
    (Bmax, M) int64 with M = blocks of max_model_len; rows (Bmax + 1,) = 0..Bmax (logits rows and query starts).
    """

    def __init__(self, max_rows: int, table_width: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.long, device=device)
        self.token_ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.context_lens = torch.zeros(max_rows, **i64)
        self.kv_slot_mapping = torch.zeros(max_rows, **i64)
        self.slots = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, table_width, **i64)
        self.rows = torch.arange(max_rows + 1, **i64)
        self.no_prefill_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        self.no_prefill_bool = torch.zeros(0, dtype=torch.bool, device=device)
        self.prefill_cu_seqlens = torch.zeros(1, dtype=torch.int32, device=device)

    def step_batch(self, size: int) -> StepBatch:
        """Views of the first `size` rows as a StepBatch of decodes."""
        return StepBatch(
            token_ids=self.token_ids[:size], positions=self.positions[:size], num_decodes=size,
            decode_slots=self.slots[:size], prefill_cu_seqlens=self.prefill_cu_seqlens,
            prefill_slots=self.no_prefill_i32, prefill_has_initial_state=self.no_prefill_bool,
            query_start=self.rows[:size + 1], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], kv_slot_mapping=self.kv_slot_mapping[:size],
            logits_rows=self.rows[:size], static_decode=True)


def padded_decode_forward(model: BambaEngineModel, buffers: DecodeBuffers, size: int, states: StatePool,
                          kv: KVCache) -> torch.Tensor:
    """The decode step over the first `size` rows of the buffers (padding rows included); returns fp32 logits
    (size, V). Every shape depends on `size` and the table width only, and nothing reads a value back to the host."""
    return model.forward(buffers.step_batch(size), states, kv)


class DecodeGraphRunner:
    """Runs decode-only steps padded to captured sizes: graph replay on CUDA, the same padded step eagerly on a CPU.

    Counters (for tests and benchmarks): `launches` counts steps by padded size; `padding_rows` the padding rows
    run; `replays` the graph replays (0 on a CPU).
    """

    def __init__(self, model: BambaEngineModel, states: StatePool, kv: KVCache, *, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model, self.states, self.kv = model, states, kv
        self.sizes = capture_sizes(max_num_seqs)
        self.table_width = -(-max_model_len // kv.block_size)                          # M
        self.device = model.device
        self.buffers = DecodeBuffers(self.sizes[-1], self.table_width, self.device)
        self.launches: Counter[int] = Counter()
        self.padding_rows = 0
        self.replays = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.device.type == "cuda":
            self._capture()

    def handles(self, pieces: Sequence[Piece]) -> bool:
        """Whether this step goes through the padded path: decodes only, no more than the largest size."""
        return 0 < len(pieces) <= self.sizes[-1] and all(p.is_decode for p in pieces)

    def size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def run(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """Logits (len(pieces), V) of a decode-only step, row i for pieces[i]; states and K/V updated in place."""
        size = self.size_for(len(pieces))
        self._fill(pieces, size)
        self.launches[size] += 1
        self.padding_rows += size - len(pieces)
        return self._launch(size)[:len(pieces)]

    def _fill(self, pieces: Sequence[Piece], size: int) -> None:
        """Write the step's rows, then padding up to `size`, into the buffers (one copy per buffer). The rows are
        assembled in numpy arrays (no tensor per row: this runs on the host for every decode step)."""
        bs, pad_block, n = self.kv.block_size, self.kv.pad_block, len(pieces)
        positions = np.fromiter((p.start for p in pieces), dtype=np.int64, count=n)
        tables = np.full((size, self.table_width), pad_block, dtype=np.int64)                # (size, M)
        kv_map = np.full(size, pad_block * bs, dtype=np.int64)
        if self.kv.enabled:
            for row, piece in enumerate(pieces):
                blocks = piece.seq.blocks
                tables[row, :len(blocks)] = blocks
            kv_map[:n] = tables[np.arange(n), positions // bs] * bs + positions % bs
        host = {
            self.buffers.token_ids: np.fromiter((p.seq.token_at(p.start) for p in pieces), dtype=np.int64, count=n),
            self.buffers.positions: positions,
            self.buffers.slots: np.fromiter((p.seq.slot for p in pieces), dtype=np.int64, count=n),
            self.buffers.context_lens: positions + 1,
        }
        pads = {self.buffers.slots: self.states.pad_slot}
        for buffer, values in host.items():
            row = np.full(size, pads.get(buffer, 0), dtype=np.int64)
            row[:n] = values
            buffer[:size].copy_(torch.from_numpy(row))
        self.buffers.kv_slot_mapping[:size].copy_(torch.from_numpy(kv_map))
        self.buffers.block_tables[:size].copy_(torch.from_numpy(tables))

    def _launch(self, size: int) -> torch.Tensor:
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
            self.replays += 1
            return logits
        return padded_decode_forward(self.model, self.buffers, size, self.states, self.kv)

    def _capture(self) -> None:
        """Capture every size once, largest first, into one shared memory pool. Each is run twice on a side stream
        first (Triton compiles its kernels for the shapes, cuBLAS sets up its workspace), with every row padding so
        that no live state is touched."""
        buffers, pad_block = self.buffers, self.kv.pad_block
        buffers.slots.fill_(self.states.pad_slot)
        buffers.context_lens.zero_()
        buffers.block_tables.fill_(pad_block)
        buffers.kv_slot_mapping.fill_(pad_block * self.kv.block_size)
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    padded_decode_forward(self.model, buffers, size, self.states, self.kv)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = padded_decode_forward(self.model, buffers, size, self.states, self.kv)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
