"""The oracle as an engine: `BambaReference` driven by the token-budget scheduler of harness/schedule.py.

Each planned step is one `forward_batch` call holding the pieces of several requests (decodes and prefill pieces
together), so the oracle itself runs every batching and chunked-prefill scenario and its results can be compared
with its own unchunked run. fp64 by default, any dtype on request.

Honours max_num_batched_tokens, long_prefill_token_threshold, max_num_seqs, arrival steps, num_kv_blocks and
kv_block_size (the plan's preemptions and recomputations are executed too), allow_long_context and ssm_state_dtype
(narrower than the run dtype: the SSM state is rounded to it between steps, as an engine's state cache would hold it;
wider, say float32 under bfloat16: the recurrence computes and keeps its state in it, as engines run 16-bit models).
engine_args: gated_norm = "grouped" (default; how Bamba was trained) | "full" (what transformers computes);
batch_invariant = 1 (default 0): each piece of each request alone, one token per forward; weights = "resident"
(default) | "streamed": each step reads one layer's weights at a time from the checkpoint (reference/model.py), for
a model whose weights in the run dtype do not fit the device (the Oracle chooses it under a memory cap).

Why a batch-invariant mode: a step packs every piece into one (T, D) matrix, and the CPU's fp64 matmuls give a row
bits that depend on how many rows share the call (measured on fixtures/tiny-bamba: a 50-token prompt's logits
prefilled whole and in pieces of 3, 15, 17 or 25 tokens differ by up to 2e-14, and a request's logprobs alone and
beside five others by 9e-16), far inside any budget but not bit-identical. With batch_invariant = 1 every forward
holds one token of one request, so what a token computes has the same shapes in every configuration: the results
do not depend on the batch, the chunking or a preemption (the `invariance` scenario, harness/runner.py's
check_invariance, checks it bit for bit). It costs one forward per token; the fp64 oracle itself does not use it.
"""

from __future__ import annotations

import torch

from reference.model import BambaReference, SequenceState

from ..engine import (FLAG_VALUES, Engine, EngineOptions, Request, RequestResult, RowSummary, engine_flag,
                      log_softmax, parse_dtype, result_from_summary, summarise_rows, top_k_lower_index)
from ..schedule import Piece, RequestShape, plan_options, plan_steps


class ReferenceEngine(Engine):
    name = "reference"
    default_dtype = torch.float64
    families = ("bamba", "granitemoehybrid")
    engine_arg_names = frozenset({"gated_norm", "batch_invariant", "weights"})
    has_scheduler = True
    batch_invariance = "--engine-arg batch_invariant=1 (each request alone, one token per forward)"
    samples = True      # a sampling request draws from softmax(logits / T) with a generator seeded by (seed, position)
    near_k = 0          # > 0: also the near_k most likely tokens of every generated position (the Oracle sets it)

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = []
        if options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1:
            reasons.append(f"tensor_parallel_size = {options.tensor_parallel_size}, pipeline_parallel_size = "
                           f"{options.pipeline_parallel_size}: the reference runs on one device")
        if options.cuda_graphs:
            reasons.append("cuda_graphs: the reference has no graph capture")
        if options.engine_args.get("gated_norm", "grouped") not in ("grouped", "full"):
            reasons.append(f"gated_norm: expected 'grouped' or 'full', got {options.engine_args['gated_norm']!r}")
        if options.engine_args.get("weights", "resident") not in ("resident", "streamed"):
            reasons.append(f"weights: expected 'resident' or 'streamed', got {options.engine_args['weights']!r}")
        if engine_flag(options.engine_args.get("batch_invariant", 0)) is None:
            reasons.append(f"batch_invariant: expected one of {', '.join(FLAG_VALUES)}, got "
                           f"{options.engine_args['batch_invariant']!r}")
        return reasons

    def _load(self) -> None:
        state_dtype = self.options.ssm_state_dtype
        state = parse_dtype(state_dtype) if state_dtype is not None else None
        wider = state is not None and state.itemsize > self.dtype.itemsize
        self.model = BambaReference.from_pretrained(
            self.checkpoint, dtype=self.dtype, device=self.device,
            gated_norm=self.options.engine_args.get("gated_norm", "grouped"),
            allow_long_context=self.options.allow_long_context,
            scan_dtype=state if wider else None,                    # a wider state: the scan computes in it
            streamed=self.options.engine_args.get("weights", "resident") == "streamed")
        self.ssm_state_dtype = None if wider else state               # a narrower one: rounded between steps

    def close(self) -> None:
        self.model = None
        super().close()

    def forward_step(self, pieces: list[Piece], tokens: list[torch.Tensor],
                     states: list[SequenceState]) -> tuple[list[torch.Tensor], list[SequenceState]]:
        """One engine step: the model on the packed pieces (with batch_invariant, each token of each piece on its
        own). A separate method so a test can plant a fault here."""
        if engine_flag(self.options.engine_args.get("batch_invariant", 0)):
            return self._forward_alone(tokens, states)
        logits, new_states = self.model.forward_batch(tokens, states)
        return logits, [self._stored(state) for state in new_states]

    def _forward_alone(self, tokens: list[torch.Tensor],
                       states: list[SequenceState]) -> tuple[list[torch.Tensor], list[SequenceState]]:
        """The batch-invariant step: one forward per token of each piece, its state stored after each (so a state
        narrower than the run dtype is rounded after every token, wherever the step boundaries fall)."""
        logits, new_states = [], []
        for piece, state in zip(tokens, states):
            rows = []
            for token in piece.split(1):
                (row,), (state,) = self.model.forward_batch([token], [state])
                rows.append(row)
                state = self._stored(state)
            logits.append(torch.cat(rows))
            new_states.append(state)
        return logits, new_states

    def _stored(self, state: SequenceState) -> SequenceState:
        """The state as kept between steps: its SSM state rounded to a narrower ssm_state_dtype, if one is set."""
        if self.ssm_state_dtype is not None:
            state.ssm = {i: s.to(self.ssm_state_dtype).to(self.dtype) for i, s in state.ssm.items()}
        return state

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        shapes = [RequestShape(len(r.prompt), r.max_new_tokens, r.arrival_step) for r in requests]
        plan = plan_steps(shapes, **plan_options(self.options))
        states = [self.model.initial_state() for _ in requests]
        # each row is reduced as soon as its step computes it (its target token is known by then): holding whole
        # rows of a 128K vocabulary in fp64 until the end would take a megabyte a position
        parts: list[list[tuple[list[int], RowSummary]]] = [[] for _ in requests]
        done: list[set[int]] = [set() for _ in requests]          # positions summarised (a recomputed one is not)
        near: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in requests]   # generated rows
        outputs: list[list[int]] = [[] for _ in requests]
        for step in plan:
            tokens = []
            for p in step.pieces:
                if p.start == 0:                         # a first piece, or a preempted request recomputed
                    states[p.request] = self.model.initial_state()
                known = requests[p.request].prompt + tuple(outputs[p.request])
                tokens.append(torch.tensor(known[p.start:p.stop]))
            logits, new_states = self.forward_step(list(step.pieces), tokens, [states[p.request] for p in step.pieces])
            for piece, piece_logits, state in zip(step.pieces, logits, new_states):
                req, out = requests[piece.request], outputs[piece.request]
                states[piece.request] = state
                logprobs = log_softmax(piece_logits)                      # (L, V)
                if piece.stop == len(req.prompt) + len(out) and len(out) < req.max_new_tokens:
                    out.append(_draw(logprobs[-1], req, len(req.prompt) + len(out)) if req.samples
                               else int(logprobs[-1].argmax()))
                known = req.prompt + tuple(out)
                keep = len(req.prompt) - 1 + req.max_new_tokens   # the last row predicts a token never generated
                positions = [p for p in range(piece.start, piece.stop)
                             if p < keep and p not in done[piece.request]]
                if positions or not parts[piece.request]:      # (an empty summary for a request with no rows)
                    rows = logprobs[torch.tensor([p - piece.start for p in positions], dtype=torch.long,
                                                 device=logprobs.device)]
                    parts[piece.request].append((positions, summarise_rows(
                        rows, [known[p + 1] for p in positions], req.top_k, full=req.full_distributions)))
                    done[piece.request].update(positions)
                    generated = [i for i, p in enumerate(positions) if p >= len(req.prompt) - 1]
                    if self.near_k and generated:
                        values, ids = top_k_lower_index(rows[generated], min(self.near_k, rows.shape[1]))
                        for i, v, t in zip(generated, values.to("cpu", torch.float64), ids.cpu()):
                            near[piece.request][positions[i]] = (t, v)
            logits = logprobs = rows = None                 # freed before the next step's forward allocates its own
        results = []
        for req, req_parts, out in zip(requests, parts, outputs):
            positions = [p for ps, _ in req_parts for p in ps]
            order = sorted(range(len(positions)), key=positions.__getitem__)
            if [positions[i] for i in order] != list(range(len(req.prompt) - 1 + len(out))):
                raise RuntimeError(f"request {req.request_id!r}: the plan computed positions "
                                   f"{sorted(positions)[:8]}..., not every one of 0..{len(req.prompt) - 2 + len(out)}")
            summary = RowSummary.join([part for _, part in req_parts], order)
            result = result_from_summary(req, summary, out)
            if self.near_k and out:
                rows = [near[len(results)][p] for p in range(len(req.prompt) - 1, len(req.prompt) - 1 + len(out))]
                result.output_near_ids = torch.stack([t for t, _ in rows])
                result.output_near_logprobs = torch.stack([v for _, v in rows])
            results.append(result)
        return results


def _draw(row: torch.Tensor, req: Request, position: int) -> int:
    """The reference's draw for a sampling request: one multinomial draw from softmax(row / T) (row: a log-softmax
    row) with a CPU generator seeded by the request's seed and the position, so a draw does not depend on the
    batch or the schedule."""
    gen = torch.Generator().manual_seed((req.seed * 1_000_003 + position) % (1 << 63))
    probs = torch.softmax(row.detach().to("cpu", torch.float64) / req.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
