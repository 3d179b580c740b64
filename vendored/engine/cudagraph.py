"""CUDA graphs for decode steps: one graph per batch size, captured once, replayed with padded batches.

A step whose pieces are all decodes (one token per running sequence) goes through `DecodeGraphRunner`:
1. its B rows are written into persistent buffers (token ids, positions, state slots, fixed-width block tables,
   context lengths, K/V write positions): staged on the host, one asynchronous host-to-device copy, spread on the
   device; a token the previous step chose and the host has not read back yet is taken from that step's device
   output (the engine runs one decode step ahead of its results, engine.py);
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
from .scheduler import PENDING, Piece

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Columns of a staged row (DecodeGraphRunner._fill): the graph inputs of one row, then the row of the step in flight
# whose greedy token it feeds (-1: its token is known on the host), then its block table.
TOKEN, POSITION, SLOT, CONTEXT, KV_SLOT, FROM_PREVIOUS = range(6)
STAGE_COLUMNS = 6


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
        width = STAGE_COLUMNS + self.table_width
        pinned = self.device.type == "cuda"
        self._stage_host = [torch.zeros((self.sizes[-1], width), dtype=torch.long, pin_memory=pinned)
                            for _ in range(2)]
        self._stage_np = [t.numpy() for t in self._stage_host]
        self._stage_dev = torch.zeros((self.sizes[-1], width), dtype=torch.long, device=self.device)
        self._staged: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._stage_pads = np.zeros(STAGE_COLUMNS, dtype=np.int64)          # a padding row's staged values
        self._stage_pads[SLOT] = states.pad_slot
        self._stage_pads[KV_SLOT] = kv.pad_block * kv.block_size
        self._stage_pads[FROM_PREVIOUS] = -1
        if self.device.type == "cuda":
            self._capture()

    def handles(self, pieces: Sequence[Piece]) -> bool:
        """Whether this step goes through the padded path: decodes only, no more than the largest size."""
        return 0 < len(pieces) <= self.sizes[-1] and all(p.is_decode for p in pieces)

    def size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def run(self, pieces: Sequence[Piece], previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (len(pieces), V) of a decode-only step, row i for pieces[i]; states and K/V updated in place.
        previous_ids: the device's greedy tokens of the step in flight, where a sequence's token to feed is still
        PENDING (row seq.pending_row of it)."""
        size = self.size_for(len(pieces))
        self._fill(pieces, size, previous_ids)
        self.launches[size] += 1
        self.padding_rows += size - len(pieces)
        return self._launch(size)[:len(pieces)]

    def _fill(self, pieces: Sequence[Piece], size: int, previous_ids: torch.Tensor | None) -> None:
        """Write the step's rows, then padding up to `size`, into the buffers. The rows are assembled in a host
        staging array (numpy: no tensor per row), sent in one copy (asynchronous from pinned memory on a GPU, two
        staging arrays used in turn so that one is written while the other's copy may still wait in the stream),
        and spread over the buffers on the device. Tokens still PENDING are taken from `previous_ids` there."""
        bs, pad_block, n = self.kv.block_size, self.kv.pad_block, len(pieces)
        turn = self._turn
        self._turn ^= 1
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()                   # its last copy has left this staging array
        stage = self._stage_np[turn][:size]                    # (size, STAGE_COLUMNS + M)
        positions = np.fromiter((p.start for p in pieces), dtype=np.int64, count=n)
        tokens = np.fromiter((p.seq.token_at(p.start) for p in pieces), dtype=np.int64, count=n)
        waiting = np.flatnonzero(tokens == PENDING)
        stage[:, :STAGE_COLUMNS] = self._stage_pads
        stage[:n, TOKEN] = np.where(tokens == PENDING, 0, tokens)
        stage[:n, POSITION] = positions
        stage[:n, SLOT] = np.fromiter((p.seq.slot for p in pieces), dtype=np.int64, count=n)
        stage[:n, CONTEXT] = positions + 1
        tables = stage[:, STAGE_COLUMNS:]                                                  # (size, M)
        tables[:] = pad_block
        if self.kv.enabled:
            for row, piece in enumerate(pieces):
                blocks = piece.seq.blocks
                tables[row, :len(blocks)] = blocks
            stage[:n, KV_SLOT] = tables[np.arange(n), positions // bs] * bs + positions % bs
        if waiting.size:
            if previous_ids is None:
                raise RuntimeError("a decode row's token is pending and no step is in flight")
            stage[waiting, FROM_PREVIOUS] = [pieces[i].seq.pending_row for i in waiting]
        on_device = self._stage_dev[:size]
        on_device.copy_(self._stage_host[turn][:size], non_blocking=True)
        if self.device.type == "cuda":
            self._staged[turn] = torch.cuda.Event()
            self._staged[turn].record()
        buffers = self.buffers
        for buffer, column in ((buffers.token_ids, TOKEN), (buffers.positions, POSITION), (buffers.slots, SLOT),
                               (buffers.context_lens, CONTEXT), (buffers.kv_slot_mapping, KV_SLOT)):
            buffer[:size].copy_(on_device[:, column])
        buffers.block_tables[:size].copy_(on_device[:, STAGE_COLUMNS:])
        if waiting.size:
            source = on_device[:, FROM_PREVIOUS]
            taken = previous_ids[source.clamp(min=0)]
            buffers.token_ids[:size].copy_(torch.where(source >= 0, taken, buffers.token_ids[:size]))

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
