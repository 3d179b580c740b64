"""LLMEngine: requests in, prompt logprobs and continuations (greedy, or sampled with a seed) out, one packed step
at a time."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .cache import KVCache, StatePool
from .cudagraph import DecodeGraphRunner
from .errors import EngineError
from .model import BambaEngineModel, StepBatch
from .ranking import log_softmax_at, log_softmax_norm, ranked_log_softmax
from .sampling import SamplingParams, sample
from .scheduler import PENDING, Piece, Scheduler, Sequence
from .weights import load


@dataclass
class _Ahead:
    """A decode step queued on the device and not yet read back: row i is seqs[i], whose output id at indices[i] is
    PENDING; host (n, 2k) (with its event, on a GPU) receives the k best values then their k ids of each row;
    finished: the sequences it completed; wanted: the most of the k any of them reads (at least 1)."""

    seqs: list[Sequence]
    indices: list[int]
    host: torch.Tensor
    event: "torch.cuda.Event | None"
    finished: list[Sequence]
    wanted: int


@dataclass
class RequestOutput:
    request_id: str
    prompt_logprobs: list[float]                  # log p(prompt[t] | prompt[:t]) for t = 1..T-1
    output_ids: list[int]
    output_logprobs: list[float]
    output_top: list[list[tuple[int, float]]]     # top-k (token, logprob) at each generated step
    preemptions: int
    rows: torch.Tensor | None = None              # (T-1+n, V) log-softmax rows when asked for (keep_rows)
    prompt_top: list[list[tuple[int, float]]] | None = None   # top-k at prompt positions 1..T-1 (prompt_top)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _token_id(request_id: str, pos: int, token) -> int:
    """token as an int: Python and numpy integers (and integer 0-d tensors) pass; floats, bools and anything else
    are an EngineError naming the request and the position."""
    if not (isinstance(token, (bool, np.bool_)) or (isinstance(token, torch.Tensor) and token.dtype == torch.bool)):
        try:
            return operator.index(token)
        except TypeError:
            pass
    raise EngineError(f"request {request_id}: token id {token!r} at position {pos} is a {type(token).__name__}, "
                      "expected an integer")


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise EngineError(f"dtype: expected one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


class LLMEngine:
    """A small serving engine for Bamba on the kernels of vendored/ops.

    max_num_batched_tokens: token budget of one step (chunked prefill below the prompt length); max_num_seqs: running
    sequences at once, and the number of state slots; max_model_len: longest prompt + generation; num_kv_blocks:
    size of the K/V cache in blocks of block_size tokens (default: enough for every slot at max_model_len; fewer
    forces preemption); ssm_state_dtype: dtype of the SSM state pool (fp32 default); cuda_graphs: decode-only steps
    are padded to a captured batch size and replayed as CUDA graphs (vendored/engine/cudagraph.py; on a CPU the same
    padded step runs eagerly, nothing being capturable); allow_long_context: max_model_len may exceed
    max_position_embeddings (RoPE positions past the trained range).
    tensor_parallel_size, pipeline_parallel_size: with more than one rank in all, the engine spawns that many worker
    processes (vendored/engine/parallel.py; on CUDA, one device each from `device` on) and joins them in close();
    parallel_timeout_s bounds start-up and every step, after which the call fails with the workers' stacks. CUDA
    graphs are for a single rank (a parallel engine with cuda_graphs is refused). long_prefill_token_threshold: the
    most tokens one prefill piece takes in a step (vLLM's knob), so that several prompts advance in the same step.
    run_ahead: CUDA-graph decode steps run one step ahead of their results (step()); False reads every step back
    before the next (the same outputs, for comparison).
    batch_invariant: every request's logprobs and tokens the same bits whatever else shares its steps, however its
    prefill is split, after a preemption, with or without CUDA graphs (vendored/engine/invariant.py; slower); not
    with tensor or pipeline parallelism.
    """

    def __init__(self, checkpoint: str | Path, *, dtype="float32", device="cpu", max_num_batched_tokens: int = 512,
                 max_num_seqs: int = 8, max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 block_size: int = 16, ssm_state_dtype="float32", allow_long_context: bool = False,
                 cuda_graphs: bool = False, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 parallel_timeout_s: float = 600.0, long_prefill_token_threshold: int | None = None,
                 run_ahead: bool = True, batch_invariant: bool = False) -> None:
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                            ("block_size", block_size), ("tensor_parallel_size", tensor_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise EngineError(f"{name}: expected a positive integer, got {value!r}")
        if long_prefill_token_threshold is not None and (not isinstance(long_prefill_token_threshold, int)
                                                         or long_prefill_token_threshold < 1):
            raise EngineError("long_prefill_token_threshold: expected a positive integer or None, got "
                              f"{long_prefill_token_threshold!r}")
        try:
            self.cfg, tensors = load(checkpoint)
        except Exception as err:          # noqa: BLE001 - any loading failure becomes one clear engine error
            raise EngineError(f"cannot load model from {checkpoint}: {err}") from err
        self.device = torch.device(device)
        self.dtype = _dtype(dtype)
        if self.device.type == "cpu" and self.dtype != torch.float32:
            raise EngineError(f"dtype {dtype}: the Triton interpreter on the CPU runs float32 only")
        limit = self.cfg.max_position_embeddings
        self.max_model_len = max_model_len or limit
        if self.max_model_len > limit and not allow_long_context:
            raise EngineError(f"max_model_len = {self.max_model_len} exceeds max_position_embeddings = {limit}; "
                              "pass allow_long_context=True to go beyond")
        parallel = tensor_parallel_size * pipeline_parallel_size > 1
        if not isinstance(batch_invariant, bool):
            raise EngineError(f"batch_invariant: expected True or False, got {batch_invariant!r}")
        if parallel and batch_invariant:
            raise EngineError("batch_invariant: not with tensor_parallel_size = "
                              f"{tensor_parallel_size}, pipeline_parallel_size = {pipeline_parallel_size} (the "
                              "order of a cross-rank sum is the collective library's choice); pass 1 and 1")
        if parallel and cuda_graphs:
            raise EngineError("cuda_graphs: decode graphs are captured for a single rank; with tensor_parallel_size = "
                              f"{tensor_parallel_size}, pipeline_parallel_size = {pipeline_parallel_size} pass "
                              "cuda_graphs=False")
        held = () if parallel else None       # a parallel engine's states and K/V live in its workers
        self._batch_device = torch.device("cpu") if parallel else self.device
        self.states = StatePool(self.cfg, max_num_seqs, dtype=self.dtype, state_dtype=_dtype(ssm_state_dtype),
                                device=self.device, layers=held)
        blocks_per_seq = -(-self.max_model_len // block_size)
        self.kv = KVCache(self.cfg, num_kv_blocks or max_num_seqs * blocks_per_seq, block_size, dtype=self.dtype,
                          device=self.device, layers=held)
        if parallel:
            from .parallel import start_parallel_model

            self.model = start_parallel_model(
                checkpoint, self.cfg, tensors, tp=tensor_parallel_size, pp=pipeline_parallel_size, dtype=self.dtype,
                state_dtype=_dtype(ssm_state_dtype), device=self.device, max_positions=self.max_model_len,
                num_slots=max_num_seqs, num_blocks=self.kv.num_blocks, block_size=block_size,
                timeout_s=parallel_timeout_s)
        else:
            self.model = BambaEngineModel(self.cfg, tensors, dtype=self.dtype, device=self.device,
                                          max_positions=self.max_model_len, batch_invariant=batch_invariant)
        self.graphs = DecodeGraphRunner(self.model, self.states, self.kv, max_num_seqs=max_num_seqs,
                                        max_model_len=self.max_model_len) if cuda_graphs else None
        self.scheduler = Scheduler(self.states, self.kv, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, long_prefill_token_threshold=long_prefill_token_threshold)
        self._arrivals = 0
        self._in_flight: set[str] = set()          # ids added and not yet finished: outputs are matched by id
        self.run_ahead = run_ahead
        self.batch_invariant = batch_invariant
        self._ahead: _Ahead | None = None          # a decode step queued and not yet read back (step)
        self._result_buffers: list[torch.Tensor | None] = [None, None]
        self._result_turn = 0
        self.steps = 0
        self.total_preemptions = 0

    def close(self) -> None:
        """Stop and join the worker processes of a parallel engine, and let go of the weights, K/V cache, SSM states
        and captured graphs, so that their device memory is free at once, even while something still refers to the
        engine (a reference cycle would otherwise hold it until the garbage collector runs). A closed engine raises
        EngineError when used."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
        self.model = self.kv = self.states = self.graphs = self.scheduler = None
        self._ahead = None
        self._closed = True

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise EngineError("this engine is closed: its weights and caches were released by close()")

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], max_new_tokens: int = 0, top_k: int = 5,
                    keep_rows: bool = False, prompt_top: bool = False,
                    sampling: SamplingParams | None = None) -> None:
        """Queue a request; EngineError naming the request (and the position) if the engine cannot serve it.
        keep_rows: return every position's full log-softmax row; prompt_top: the top-k at prompt positions too;
        sampling: draw each new token (vendored/engine/sampling.py) instead of taking the greedy one; its logprob is
        still the model's. A step holding a sampling request replays the CUDA graph (padding rows included) but is
        not run one step ahead: the draw is made from the step's logits after the replay."""
        self._check_open()
        prompt = self._checked_prompt(request_id, prompt, max_new_tokens)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise EngineError(f"request {request_id}: sampling: expected a SamplingParams or None, got "
                              f"{type(sampling).__name__}")
        self.scheduler.add(Sequence(request_id, prompt, max_new_tokens, top_k, self._arrivals, keep_rows=keep_rows,
                                    sampling=sampling,
                                    prompt_logprobs=[None] * (len(prompt) - 1),
                                    prompt_top=[None] * (len(prompt) - 1) if prompt_top else None))
        self._in_flight.add(request_id)
        self._arrivals += 1

    def _checked_prompt(self, request_id: str, prompt, max_new_tokens: int) -> list[int]:
        """The prompt as a list of ints, after every check: the id is not in flight (an output names only its id),
        every token id is an integer (Python or numpy ints; int() would silently truncate 3.7 to 3 and read True as
        1) inside the vocabulary, and the request fits max_model_len and the K/V cache."""
        if request_id in self._in_flight:
            raise EngineError(f"request {request_id}: duplicate request id, a request with this id is already in "
                              "flight (outputs are matched to requests by id)")
        prompt = [_token_id(request_id, pos, tok) for pos, tok in enumerate(prompt)]
        if not prompt:
            raise EngineError(f"request {request_id}: empty prompt")
        for pos, tok in enumerate(prompt):
            if not 0 <= tok < self.cfg.vocab_size:
                raise EngineError(f"request {request_id}: token id {tok} at position {pos} is outside the "
                                  f"vocabulary [0, {self.cfg.vocab_size})")
        total = len(prompt) + max_new_tokens
        if total > self.max_model_len:
            raise EngineError(f"request {request_id}: prompt of {len(prompt)} tokens + {max_new_tokens} new tokens "
                              f"exceeds max_model_len = {self.max_model_len}")
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise EngineError(f"request {request_id}: needs {self.kv.blocks_for(total)} K/V blocks, the cache has "
                              f"{self.kv.num_blocks}")
        return prompt

    def has_unfinished(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (their outputs complete).

        A decode-only step that goes through the CUDA-graph runner, for sequences that neither keep whole rows nor
        sample, runs one step ahead of its results: its ranking is queued on the device, each sequence gets a
        PENDING output id (counts, finishing and the next schedule need no token value), and the step before it is
        read back only after this one is queued, so the host's bookkeeping overlaps the device's forward. The next step feeds the
        pending tokens from the device. Any other step, and the last step of the work queued, reads everything back
        first. Outputs, tokens and logprobs are those of the synchronous order; a request that finished in a step
        run ahead is returned by the step after it."""
        self._check_open()
        pieces = self.scheduler.schedule()
        if not pieces:
            raise EngineError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                              f"{len(self.scheduler.running)} running requests")
        graphed = self.graphs is not None and self.graphs.handles(pieces)
        if graphed and not any(p.seq.keep_rows or p.seq.sampling is not None for p in pieces):
            previous, self._ahead = self._ahead, None
            ahead = self._launch_decode(pieces)
            self.steps += 1
            done = self._read_back(previous) if previous is not None else []
            if self.run_ahead and self.scheduler.has_work():
                self._ahead = ahead
            else:                                                     # nothing left to overlap with, or not asked
                done += self._read_back(ahead)
            return done
        done = self._settle()
        if graphed:
            logits, _ = self.graphs.run(pieces)                   # one row per decode, every one wanted
            logits = logits.float()                               # the raw logits in fp32, as the eager step's
            rows = [(i, 1) for i in range(len(pieces))]
        else:
            batch, rows = self._build_batch(pieces)
            logits = self.model.forward(batch, self.states, self.kv)
        self.steps += 1
        self._record(pieces, rows, logits)
        for piece in pieces:
            piece.seq.num_computed += piece.length
            if piece.seq.finished:
                self.total_preemptions += piece.seq.preemptions
                self.scheduler.finish(piece.seq)
                self._in_flight.discard(piece.seq.request_id)
                done.append(self._output(piece.seq))
        return done

    def _settle(self) -> list[RequestOutput]:
        """Read back the step in flight, if any (before anything that needs every token on the host)."""
        ahead, self._ahead = self._ahead, None
        return self._read_back(ahead) if ahead is not None else []

    def _launch_decode(self, pieces: list[Piece]) -> "_Ahead":
        """Queue a decode-only graph step (its rows ranked inside the graph; a k above GRAPH_TOP_K ranked again
        from the logits, also on the device) and the copy of its results to the host; give every sequence its
        PENDING output id, advance it, and finish (free the slot and blocks of) the sequences this step completes.
        Nothing here waits for the device."""
        logits, ranked = self.graphs.run(pieces)
        seqs = [p.seq for p in pieces]
        k = max(max(seq.top_k for seq in seqs), 1)
        if k > ranked.shape[1] // 2:
            values, ids, _ = ranked_log_softmax(logits, k)                              # (n, k) each
            ranked = torch.cat([values.double(), ids.double()], dim=1)
        host, event = self._to_host(ranked)
        indices, finished = [], []
        for row, seq in enumerate(seqs):
            outputs = seq.output_ids
            indices.append(len(outputs))
            outputs.append(PENDING)
            seq.pending_row = row
            seq.num_computed += 1
            if len(outputs) >= seq.max_new_tokens:                  # seq.finished: a decode's prompt is computed
                finished.append(seq)
        for seq in finished:
            self.total_preemptions += seq.preemptions
            self.scheduler.finish(seq)
        return _Ahead(seqs, indices, host, event, finished, k)

    def _to_host(self, ranked: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """ranked (n, 2k) on the host: on a GPU copied asynchronously into one of two pinned buffers (used in turn:
        one step's may be read while the next is written) with an event to wait on; on a CPU, ranked itself."""
        if ranked.device.type != "cuda":
            return ranked, None
        turn = self._result_turn
        self._result_turn ^= 1
        buffer = self._result_buffers[turn]
        if buffer is None or buffer.numel() < ranked.numel():
            buffer = self._result_buffers[turn] = torch.empty(max(ranked.numel(), 1 << 12), dtype=torch.float64,
                                                              pin_memory=True)
        host = buffer[:ranked.numel()].view(ranked.shape)
        host.copy_(ranked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _read_back(self, ahead: "_Ahead") -> list[RequestOutput]:
        """Wait for a step launched by _launch_decode, put its tokens, logprobs and top-k into its sequences, and
        return the outputs of those it finished."""
        if ahead.event is not None:
            ahead.event.synchronize()
        k, wanted = ahead.host.shape[1] // 2, ahead.wanted         # the columns any sequence reads
        values = ahead.host[:, :wanted].tolist()
        ids = ahead.host[:, k:k + wanted].long().tolist()
        for seq, index, vals, row_ids in zip(ahead.seqs, ahead.indices, values, ids):
            seq.output_ids[index] = row_ids[0]                     # greedy; ties go to the lowest index (ranking.py)
            seq.output_logprobs.append(vals[0])
            top_k = seq.top_k
            seq.output_top.append(list(zip(row_ids[:top_k], vals[:top_k])))
            if index == len(seq.output_ids) - 1:                   # not already run ahead again
                seq.pending_row = None
        done = []
        for seq in ahead.finished:
            self._in_flight.discard(seq.request_id)
            done.append(self._output(seq))
        return done

    def _build_batch(self, pieces: list[Piece]) -> tuple[StepBatch, list[tuple[int, int]]]:
        dev, bs = self._batch_device, self.kv.block_size
        tokens, positions, kv_map, logits_rows, rows, q_start = [], [], [], [], [], [0]
        for piece in pieces:
            seq, span = piece.seq, range(piece.start, piece.start + piece.length)
            base = len(tokens)
            tokens += seq.token_span(piece.start, piece.length)
            positions += list(span)
            kv_map += [seq.blocks[p // bs] * bs + p % bs for p in span] if self.kv.enabled else []
            wanted = [i for i, p in enumerate(span) if self._wants_logits(seq, p)]
            rows.append((len(logits_rows), len(wanted)))
            logits_rows += [base + i for i in wanted]
            q_start.append(len(tokens))
        decodes = [p for p in pieces if p.is_decode]
        prefills = [p for p in pieces if not p.is_decode]
        n_blocks = max(1, max(len(p.seq.blocks) for p in pieces))
        tables = [p.seq.blocks + [0] * (n_blocks - len(p.seq.blocks)) for p in pieces]
        i32 = dict(dtype=torch.int32, device=dev)
        batch = StepBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            decode_slots=torch.tensor([p.seq.slot for p in decodes], **i32),
            prefill_cu_seqlens=torch.tensor([0] + [p.length for p in prefills], **i32).cumsum(0, dtype=torch.int32),
            prefill_slots=torch.tensor([p.seq.slot for p in prefills], **i32),
            prefill_has_initial_state=torch.tensor([p.start > 0 for p in prefills], dtype=torch.bool, device=dev),
            query_start=torch.tensor(q_start, dtype=torch.long, device=dev),
            context_lens=torch.tensor([p.start + p.length for p in pieces], dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            kv_slot_mapping=torch.tensor(kv_map, dtype=torch.long, device=dev),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        return batch, rows

    @staticmethod
    def _wants_logits(seq: Sequence, pos: int) -> bool:
        """Logits at pos predict token pos+1: wanted for a prompt logprob not yet recorded, or for the next token."""
        nxt = pos + 1
        if nxt < len(seq.prompt):
            return seq.prompt_logprobs[nxt - 1] is None
        return nxt == seq.num_tokens and len(seq.output_ids) < seq.max_new_tokens

    def _record(self, pieces: list[Piece], rows: list[tuple[int, int]], logits: torch.Tensor) -> None:
        """What a step returns, for every piece at once: the norms of the step's logit rows (where prompt logprobs
        or kept rows need them), one gather of the prompt logprobs, one ranking of the rows that choose a next token
        (and the prompt rows of sequences that asked for their top-k), and one transfer to the host of what the
        sequences keep (no per-row device reads). Every logprob is ranking.log_softmax_at of its row's norm.
        rows[i] = (first logit row, count) of pieces[i]."""
        prompt_rows, prompt_targets, prompt_slots = [], [], []        # row, token it predicts, (seq, index)
        top_rows, top_owners, kept = [], [], []                       # row, (seq, prompt index or None: a choice)
        for piece, (first_row, count) in zip(pieces, rows):
            seq = piece.seq
            if piece.is_decode and count == 1 and not seq.keep_rows and self._wants_logits(seq, piece.start):
                top_rows.append(first_row)                              # a decode choosing its next token
                top_owners.append((seq, None))
                continue
            wanted = [p for p in range(piece.start, piece.start + piece.length) if self._wants_logits(seq, p)]
            if len(wanted) != count:
                raise EngineError(f"request {seq.request_id}: {count} logit rows for {len(wanted)} wanted positions")
            for row, pos in enumerate(wanted, start=first_row):
                if seq.keep_rows:
                    kept.append((seq, pos, row))
                if pos + 1 < len(seq.prompt):
                    prompt_rows.append(row)
                    prompt_targets.append(seq.prompt[pos + 1])
                    prompt_slots.append((seq, pos))
                    if seq.prompt_top is not None:
                        top_rows.append(row)
                        top_owners.append((seq, pos))
                else:
                    top_rows.append(row)
                    top_owners.append((seq, None))
        if not (prompt_rows or top_rows):
            return
        device = logits.device
        # one norm per row (ranking.log_softmax_norm), the same bits whichever path computes it
        kept_index = torch.tensor([r for _, _, r in kept], dtype=torch.long, device=device) if kept else None
        norm = log_softmax_norm(logits) if prompt_rows or kept else None                  # (rows, 2)
        parts = []
        if prompt_rows:
            index = torch.tensor(prompt_rows, dtype=torch.long, device=device)
            target = torch.tensor(prompt_targets, dtype=torch.long, device=device)
            parts.append(log_softmax_at(logits[index, target][:, None], norm[index])[:, 0].double())  # (n_prompt,)
        # choices of sampling sequences: drawn (sampling.py) at the position the token will take, logprob the model's
        drawn = [i for i, (seq, pos) in enumerate(top_owners) if pos is None and seq.sampling is not None]
        if top_rows:
            k = max(max(1, seq.top_k) for seq, _ in top_owners)
            top_index = torch.tensor(top_rows, dtype=torch.long, device=device)
            values, ids, top_norm = ranked_log_softmax(logits[top_index], k)
            parts += [values.double().reshape(-1), ids.double().reshape(-1)]               # (n, k) each
        if drawn:
            which = torch.tensor(drawn, dtype=torch.long, device=device)
            params = [top_owners[i][0].sampling for i in drawn]
            tokens = sample(logits[top_index[which]],
                            torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
                            torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
                            torch.tensor([top_owners[i][0].num_tokens for i in drawn], dtype=torch.int64,
                                         device=device))
            chosen = logits[top_index[which], tokens][:, None]
            parts += [tokens.double(), log_softmax_at(chosen, top_norm[which])[:, 0].double()]   # (n_drawn,) each
        host = torch.cat(parts).cpu()                                  # one transfer (fp64: ids and values exact)
        kept_rows = log_softmax_at(logits[kept_index], norm[kept_index]).cpu() if kept else None
        for (seq, pos), value in zip(prompt_slots, host[:len(prompt_rows)].tolist()):
            seq.prompt_logprobs[pos] = value
        if top_rows:
            n = len(top_rows)
            flat = host[len(prompt_rows):]
            values = flat[:n * k].reshape(n, k).tolist()
            indices = flat[n * k:2 * n * k].reshape(n, k).long().tolist()
            tail = flat[2 * n * k:].tolist()
            draws = dict(zip(drawn, zip((int(t) for t in tail[:len(drawn)]), tail[len(drawn):])))
            for i, ((seq, pos), vals, ids) in enumerate(zip(top_owners, values, indices)):
                if pos is not None:
                    seq.prompt_top[pos] = list(zip(ids, vals))[:seq.top_k]
                    continue
                token, logprob = draws.get(i, (ids[0], vals[0]))       # greedy: ties go to the lowest index
                seq.output_ids.append(token)
                seq.output_logprobs.append(logprob)
                seq.output_top.append(list(zip(ids, vals))[:seq.top_k])
        for i, (seq, pos, _) in enumerate(kept):
            seq.rows[pos] = kept_rows[i]

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        rows = torch.stack([seq.rows[p] for p in sorted(seq.rows)]) if seq.keep_rows and seq.rows else None
        return RequestOutput(seq.request_id, [float(x) for x in seq.prompt_logprobs], list(seq.output_ids),
                             list(seq.output_logprobs), list(seq.output_top), seq.preemptions, rows,
                             None if seq.prompt_top is None else list(seq.prompt_top))

    # ---- driving -----------------------------------------------------------------------------------------
    def _check_all(self, requests: list, arrivals: dict[int, list]) -> None:
        """Every request of a generate call checked before any is queued, so that a bad one leaves the engine as it
        was. Outputs are returned by id: two requests sharing one would both get the output of whichever finished
        last."""
        seen: dict[str, str] = {}
        places = [(f"requests[{i}]", r) for i, r in enumerate(requests)]
        places += [(f"arrivals[{step}][{i}]", r) for step in sorted(arrivals) for i, r in enumerate(arrivals[step])]
        for place, (request_id, prompt, max_new, *rest) in places:
            if request_id in seen:
                raise EngineError(f"request {request_id}: duplicate request id ({seen[request_id]} and {place}); "
                                  "outputs are matched to requests by id")
            seen[request_id] = place
            self._checked_prompt(request_id, prompt, max_new)
            if len(rest) > 1 or (rest and rest[0] is not None and not isinstance(rest[0], SamplingParams)):
                raise EngineError(f"request {request_id}: expected (id, prompt, max_new_tokens[, SamplingParams or "
                                  f"None]), got {len(rest) + 3} fields with {rest!r} after the third")

    def generate(self, requests: list[tuple[str, list[int], int]], *, arrivals: dict[int, list] | None = None,
                 top_k: int = 5, keep_rows: bool = False, prompt_top: bool = False,
                 max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Run requests (id, prompt, max_new_tokens[, sampling]) to completion (sampling: a SamplingParams, or None
        for greedy); arrivals maps a step number to more requests that arrive before that step. Returns outputs in
        the order the requests were given."""
        self._check_open()
        pending = dict(arrivals or {})
        order = [r[0] for r in requests] + [r[0] for step in sorted(pending) for r in pending[step]]
        self._check_all(requests, pending)
        for request_id, prompt, max_new, *sampling in requests:
            self.add_request(request_id, prompt, max_new, top_k, keep_rows, prompt_top, *sampling)
        results: dict[str, RequestOutput] = {}
        start = self.steps
        while self.has_unfinished() or pending:
            for step in [s for s in pending if s <= self.steps - start]:
                for request_id, prompt, max_new, *sampling in pending.pop(step):
                    self.add_request(request_id, prompt, max_new, top_k, keep_rows, prompt_top, *sampling)
            if not self.has_unfinished():
                self.steps += 1                                    # an idle step until the next arrival
                continue
            for out in self.step():
                results[out.request_id] = out
            if self.steps - start > max_steps:
                raise EngineError(f"no completion after {max_steps} steps")
        return [results[r] for r in order]
