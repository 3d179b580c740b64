"""CUDA graphs for decode steps: one graph per batch size, captured once, replayed with padded batches.

A step whose pieces are all decodes (one token per running sequence) goes through `DecodeGraphRunner`:
1. its B rows (token ids, positions, state slots, fixed-width block tables, context lengths, K/V write positions)
   are staged on the host, laid out so that each input is one contiguous run the model reads where it lies, and
   sent in one asynchronous copy; on the device the token ids are one gather, each row's from where the host
   points it: its staged token, or, for a token the previous step chose and the host has not read back yet, that
   step's greedy token (the engine runs one decode step ahead of its results, engine.py);
2. the batch is padded up to the next captured size: a padding row feeds token 0 at position 0, names the pad
   state slot (the mamba kernels skip it) and the pad K/V block (its key is written there and nothing reads it), and
   has context length 0 (its attention output is zero);
3. the graph of that size is replayed; its first B rows of logits and of ranked tokens (log-softmax, top-k) are
   the step's.
`padded_decode_step` is the step itself, a plain function of the buffers (the staged rows spread into the model's
inputs, the forward, the ranking of every row): on a CUDA device it is what is captured; on a CPU (nothing to
capture) the runner calls it eagerly, so the CPU tests check the very padding, buffers and masks that the graphs
replay. Mixed prefill + decode steps, and decode batches above the largest size, run eagerly.

Captured sizes: 1, 2, 4, ..., 512 up to the first one >= max_num_seqs. Attention spans the whole block table
(max_model_len keys), so one graph serves every context length the engine allows.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from collections.abc import Sequence

import numpy as np
import torch

from .cache import KVCache, StatePool
from .model import BambaEngineModel, StepBatch
from .ranking import ranked_log_softmax
from .scheduler import PENDING, Piece

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The staged inputs of a step of b rows (DecodeGraphRunner._stage): one int64 vector holding, each as a run of b
# values, the inputs of every row (token, position, state slot, context length, K/V write position), then where its
# token is read (TOKEN_SOURCE, an index into DecodeBuffers.tokens: its own TOKEN entry when the host knows the
# token, else the row of the step in flight whose greedy token it feeds), then the rows' block tables (b × M,
# row-major). Each is a contiguous view the graph of size b reads in place (no copies on the device).
TOKEN, POSITION, SLOT, CONTEXT, KV_SLOT, TOKEN_SOURCE = range(6)
STAGE_COLUMNS = 6
# The step ranks its rows inside the graph: this many best tokens of each (a step asking for more ranks its logits
# again outside the graph, engine.py).
GRAPH_TOP_K = 8


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture for an engine running at most max_num_seqs sequences at once: every size of
    CAPTURE_SIZES below max_num_seqs and the first one at or above it (all of them beyond 512)."""
    sizes = tuple(s for s in CAPTURE_SIZES if s < max_num_seqs)
    return sizes + tuple(s for s in CAPTURE_SIZES if s >= max_num_seqs)[:1]


def stage_length(size: int, table_width: int) -> int:
    """Values staged for a step of `size` rows with block tables of `table_width` blocks."""
    return size * (STAGE_COLUMNS + table_width)


def stage_views(staged, size: int, table_width: int):
    """The inputs of a step of `size` rows in a staging vector (numpy or torch, laid out as above): a
    (STAGE_COLUMNS, size) view, row c holding input c of every row, and the (size, table_width) block tables."""
    head = STAGE_COLUMNS * size
    return (staged[:head].reshape(STAGE_COLUMNS, size),
            staged[head:stage_length(size, table_width)].reshape(size, table_width))


class DecodeBuffers:
    """The graph's memory, allocated once for the largest size; a step of size b uses the first
    stage_length(b, M) values of `staged`, laid out for b rows (stage_views).

    tokens (Bmax + Bmax · (STAGE_COLUMNS + M),) int64, one buffer so that one gather finds every row's token: first
    next_ids (Bmax,), each row's greedy token, left by the step for the next one, then staged, what the host sends
    (M = blocks of max_model_len); the model reads positions, slots, context lengths, K/V write positions and
    block tables where they lie. A row's TOKEN_SOURCE indexes `tokens`: r < Bmax feeds next_ids[r]; its own TOKEN
    entry feeds the staged token. rows (Bmax + 1,) = 0..Bmax (logits rows and query starts).
    """

    def __init__(self, max_rows: int, table_width: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.long, device=device)
        self.table_width = table_width
        self.tokens = torch.zeros(max_rows + stage_length(max_rows, table_width), **i64)
        self.next_ids, self.staged = self.tokens[:max_rows], self.tokens[max_rows:]
        self.rows = torch.arange(max_rows + 1, **i64)
        self.no_prefill_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        self.no_prefill_bool = torch.zeros(0, dtype=torch.bool, device=device)
        self.prefill_cu_seqlens = torch.zeros(1, dtype=torch.int32, device=device)

    def step_batch(self, size: int, token_ids: torch.Tensor) -> StepBatch:
        """The staged inputs of a step of `size` rows as a StepBatch of decodes feeding `token_ids` (size,)."""
        columns, tables = stage_views(self.staged, size, self.table_width)
        return StepBatch(
            token_ids=token_ids, positions=columns[POSITION], num_decodes=size, decode_slots=columns[SLOT],
            prefill_cu_seqlens=self.prefill_cu_seqlens, prefill_slots=self.no_prefill_i32,
            prefill_has_initial_state=self.no_prefill_bool, query_start=self.rows[:size + 1],
            context_lens=columns[CONTEXT], block_tables=tables, kv_slot_mapping=columns[KV_SLOT],
            logits_rows=self.rows[:size], static_decode=True)


def padded_decode_step(model: BambaEngineModel, buffers: DecodeBuffers, size: int, states: StatePool,
                       kv: KVCache, *, rank: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode step of `size` rows staged in the buffers (padding rows included): the token ids formed (a row
    whose token is pending takes the previous step's from next_ids), the forward on the staged inputs in place,
    and the ranking of every row (the GRAPH_TOP_K best and their logprobs: ranking.ranked_log_softmax); the greedy
    tokens left in next_ids. Returns logits (size, V) fp32 (model.forward's, ranked as every eager step ranks
    them: ranking 16-bit logits directly gave other bits on a GPU, whose kernel reduces a row in another layout for
    another load dtype) and ranked (size, 2·K) fp64: each row's K values then
    its K ids (fp64 holds both exactly), K = min(GRAPH_TOP_K, V). Every shape depends on `size` and the table width
    only, and nothing reads a value back to the host. rank=False: the step without its ranking (ranked None, next_ids
    untouched), the forward as a decode step runs it, for bench/decode.py."""
    columns = stage_views(buffers.staged, size, buffers.table_width)[0]
    token_ids = buffers.tokens[columns[TOKEN_SOURCE]]
    logits = model.forward(buffers.step_batch(size, token_ids), states, kv)
    if not rank:
        return logits, None
    values, ids, _ = ranked_log_softmax(logits, min(GRAPH_TOP_K, logits.shape[-1]))
    buffers.next_ids[:size].copy_(ids[:, 0])
    return logits, torch.cat([values.double(), ids.double()], dim=1)


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
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._forward_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, None]]] = {}
        pinned = self.device.type == "cuda"
        self._stage_host = [torch.zeros(stage_length(self.sizes[-1], self.table_width), dtype=torch.long,
                                        pin_memory=pinned) for _ in range(2)]
        self._stage_np = [t.numpy() for t in self._stage_host]
        self._staged: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._stage_pads = np.zeros(STAGE_COLUMNS, dtype=np.int64)          # a padding row's staged values
        self._stage_pads[SLOT] = states.pad_slot
        self._stage_pads[KV_SLOT] = kv.pad_block * kv.block_size
        if self.device.type == "cuda":
            self._capture()

    def handles(self, pieces: Sequence[Piece]) -> bool:
        """Whether this step goes through the padded path: decodes only, no more than the largest size."""
        return 0 < len(pieces) <= self.sizes[-1] and all(p.is_decode for p in pieces)

    def size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def run(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step: logits (len(pieces), V) and ranked (len(pieces), 2·K) (padded_decode_step), row i
        for pieces[i]; states and K/V updated in place. A sequence whose token to feed is still PENDING takes it
        from row seq.pending_row of the previous step's next_ids."""
        size = self.size_for(len(pieces))
        self._stage(pieces, size)
        self.launches[size] += 1
        self.padding_rows += size - len(pieces)
        logits, ranked = self._launch(size)
        return logits[:len(pieces)], ranked[:len(pieces)]

    def forward_only(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """The decode step of `pieces` without its ranking: inputs staged and spread, the forward; logits
        (len(pieces), V). What bench/decode.py times as "the forward" beside whole engine steps. On CUDA captured
        once per size (its own graph and memory pool: the step's graphs and their outputs are left alone), eager on a
        CPU. States and K/V are updated as by run() (the first call of a size runs its rows twice more, capturing;
        a benchmark's concern only); the engine's pending tokens are not."""
        size = self.size_for(len(pieces))
        self._stage(pieces, size)
        if self.device.type != "cuda":
            return padded_decode_step(self.model, self.buffers, size, self.states, self.kv, rank=False)[0][:len(pieces)]
        if size not in self._forward_graphs:
            self._forward_graphs[size] = self._captured(size, rank=False)
        graph, (logits, _) = self._forward_graphs[size]
        graph.replay()
        return logits[:len(pieces)]

    def _stage(self, pieces: Sequence[Piece], size: int) -> None:
        """Write the step's rows, then padding up to `size`, into a host staging array (numpy: no tensor per row) and
        send it to buffers.staged in one copy: asynchronous from pinned memory on a GPU, two staging arrays used in
        turn so that one is written while the other's copy may still wait in the stream."""
        bs, n = self.kv.block_size, len(pieces)
        turn = self._turn
        self._turn ^= 1
        if self._staged[turn] is not None:
            self._staged[turn].synchronize()                   # its last copy has left this staging array
        inputs, tables = self._padding_stage(self._stage_np[turn], size)      # (STAGE_COLUMNS, size), (size, M)
        # One pass over the pieces for (position, token, slot) (seq.token_at inline).
        given = np.array([(p.start, p.seq.prompt[p.start] if p.start < len(p.seq.prompt)
                           else p.seq.output_ids[p.start - len(p.seq.prompt)], p.seq.slot) for p in pieces],
                         dtype=np.int64).reshape(n, 3)
        positions, tokens = given[:, 0], given[:, 1]
        inputs[POSITION, :n] = positions
        inputs[TOKEN, :n] = tokens
        inputs[SLOT, :n] = given[:, 2]
        inputs[CONTEXT, :n] = positions + 1
        if self.kv.enabled:
            lengths = np.fromiter((len(p.seq.blocks) for p in pieces), dtype=np.int64, count=n)
            flat = np.fromiter(chain.from_iterable(p.seq.blocks for p in pieces), dtype=np.int64,
                               count=int(lengths.sum()))
            rows = np.repeat(np.arange(n), lengths)
            columns = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            tables[rows, columns] = flat
            inputs[KV_SLOT, :n] = tables[np.arange(n), positions // bs] * bs + positions % bs
        waiting = np.flatnonzero(tokens == PENDING)
        if waiting.size:
            inputs[TOKEN, waiting] = 0
            inputs[TOKEN_SOURCE, waiting] = [pieces[i].seq.pending_row for i in waiting]
        length = stage_length(size, self.table_width)
        self.buffers.staged[:length].copy_(self._stage_host[turn][:length], non_blocking=True)
        if self.device.type == "cuda":
            self._staged[turn] = torch.cuda.Event()
            self._staged[turn].record()

    def _padding_stage(self, stage: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Lay out `size` padding rows in the staging vector `stage`; returns its views (stage_views)."""
        columns, tables = stage_views(stage, size, self.table_width)
        columns[:] = self._stage_pads[:, None]
        # each row's own TOKEN entry, as an index into buffers.tokens (staged starts after next_ids)
        columns[TOKEN_SOURCE] = self.sizes[-1] + TOKEN * size + np.arange(size)
        tables[:] = self.kv.pad_block
        return columns, tables

    def _launch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if size in self._graphs:
            graph, outputs = self._graphs[size]
            graph.replay()
            self.replays += 1
            return outputs
        return padded_decode_step(self.model, self.buffers, size, self.states, self.kv)

    def _capture(self) -> None:
        """Capture every size once, largest first, into one shared memory pool. Each is run twice on a side stream
        first (Triton compiles its kernels for the shapes, cuBLAS sets up its workspace), with every row padding so
        that no live state is touched."""
        pool = torch.cuda.graph_pool_handle()
        padding = np.zeros(stage_length(self.sizes[-1], self.table_width), dtype=np.int64)
        for size in sorted(self.sizes, reverse=True):
            self._padding_stage(padding, size)
            self.buffers.staged.copy_(torch.from_numpy(padding).to(self.device))
            self._graphs[size] = self._captured(size, rank=True, pool=pool)
        torch.cuda.synchronize(self.device)

    def _captured(self, size: int, *, rank: bool, pool=None) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """The padded step of `size` rows (rank: with its ranking) captured in a CUDA graph, with its outputs. Run
        twice on a side stream first (Triton compiles its kernels for the shapes, cuBLAS sets up its workspace)
        from the buffers as they are staged; `pool`: a memory pool shared with other graphs (None: its own)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                padded_decode_step(self.model, self.buffers, size, self.states, self.kv, rank=rank)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = padded_decode_step(self.model, self.buffers, size, self.states, self.kv, rank=rank)
        return graph, outputs
