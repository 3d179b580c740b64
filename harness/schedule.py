"""The step plan of a token-budget scheduler: which pieces of which requests go into each engine step.

The policy is the vendored engine's (vendored/engine/scheduler.py), close to vLLM v1's: each step first gives every
running request that is decoding its one token, then fills what is left of `max_num_batched_tokens` with prefill
pieces of the running requests, oldest first, then admits waiting requests first come, first served (by arrival
step, then by their order) while budget is left and fewer than `max_num_seqs` run. A prefill piece takes at most
`long_prefill_token_threshold` tokens (vLLM's knob of that name), so that several requests' prompts advance in one
step. With a K/V cache of `num_kv_blocks` blocks of `kv_block_size` tokens, a request that needs a block when none
is free preempts the most recently arrived running request (possibly itself), which frees its blocks and goes back
to the front of the queue, to be recomputed later from all its tokens (prompt and what it generated so far).
Greedy requests of known length finish at a known step, so the whole plan is known in advance: the reference adapter
executes it, and scenarios.py reads it to prove which boundary events its workloads produce.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .engine import EngineOptions

# K/V block size when the options leave it to the engine: vLLM's default and the vendored engine's.
DEFAULT_KV_BLOCK_SIZE = 16


@dataclass(frozen=True)
class RequestShape:
    """What the scheduler needs to know of a request: prompt length T, tokens to generate n, arrival step."""

    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0


@dataclass(frozen=True)
class Piece:
    """Positions start..stop-1 of request `request` (an index), fed in one step; decode: a generated token fed back."""

    request: int
    start: int
    stop: int
    decode: bool

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Step:
    """One engine step: its pieces in packing order (decodes first) and its index on the step clock."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def n_tokens(self) -> int:
        return sum(p.length for p in self.pieces)


def plan_options(options: EngineOptions) -> dict:
    """plan_steps' keyword arguments for an engine configured with `options`."""
    return dict(max_num_batched_tokens=options.max_num_batched_tokens, max_num_seqs=options.max_num_seqs,
                long_prefill_token_threshold=options.long_prefill_token_threshold,
                num_kv_blocks=options.num_kv_blocks, kv_block_size=options.kv_block_size or DEFAULT_KV_BLOCK_SIZE)


def plan_steps(shapes: Sequence[RequestShape], *, max_num_batched_tokens: int | None,
               max_num_seqs: int | None, long_prefill_token_threshold: int | None = None,
               num_kv_blocks: int | None = None, kv_block_size: int = 16) -> list[Step]:
    """Every non-empty step until all requests have generated their tokens (empty steps still advance the clock).

    A piece that feeds a request's last known token yields its next generated token; each later token needs one
    decode of the previous one, at position T + j for output j. A recomputed request (preempted earlier) is fed from
    position 0 again, in pieces that are not decodes, up to its last generated token.
    """
    budget_per_step = max_num_batched_tokens or math.inf
    piece_cap = long_prefill_token_threshold or math.inf
    seq_limit = max_num_seqs or math.inf
    waiting = deque(sorted(range(len(shapes)), key=lambda i: (shapes[i].arrival_step, i)))
    arrival = {i: rank for rank, i in enumerate(waiting)}
    running: list[int] = []
    fed = [0] * len(shapes)            # positions whose state is computed
    generated = [0] * len(shapes)      # output tokens produced so far
    blocks = [0] * len(shapes)         # K/V blocks held
    free_blocks = num_kv_blocks if num_kv_blocks is not None else math.inf
    steps: list[Step] = []
    clock = 0

    def known(i: int) -> int:          # tokens of request i that exist: its prompt and its outputs so far
        return shapes[i].prompt_len + generated[i]

    def decoding(i: int) -> bool:
        return generated[i] >= 1 and fed[i] == known(i) - 1

    def grow(i: int, new_tokens: int) -> bool:
        """Blocks for new_tokens more positions of request i, preempting the youngest until they fit."""
        nonlocal free_blocks
        need = -(-(fed[i] + new_tokens) // kv_block_size) - blocks[i]
        while need > free_blocks:
            victim = max(running, key=arrival.__getitem__)
            running.remove(victim)
            free_blocks += blocks[victim]
            blocks[victim], fed[victim] = 0, 0
            waiting.appendleft(victim)
            if victim == i:
                return False
        if need > 0:
            blocks[i] += need
            free_blocks -= need
        return True

    while waiting or running:
        budget = budget_per_step
        pieces: list[Piece] = []
        for i in list(running):
            if budget <= 0:
                break
            if i in running and decoding(i) and grow(i, 1):
                pieces.append(Piece(i, fed[i], fed[i] + 1, True))
                budget -= 1
        for i in list(running):
            if budget <= 0:
                break
            if i not in running or decoding(i):
                continue
            take = int(min(known(i) - fed[i], budget, piece_cap))
            if take > 0 and grow(i, take):
                pieces.append(Piece(i, fed[i], fed[i] + take, False))
                budget -= take
        while waiting and budget > 0 and shapes[waiting[0]].arrival_step <= clock and len(running) < seq_limit:
            i = waiting[0]
            take = int(min(known(i), budget, piece_cap))
            if -(-take // kv_block_size) > free_blocks:
                break                  # wait for running requests to free blocks
            waiting.popleft()
            running.append(i)
            grow(i, take)
            pieces.append(Piece(i, 0, take, False))
            budget -= take
        pieces = [p for p in pieces if p.request in running]          # preempted after its piece was planned
        for piece in pieces:
            fed[piece.request] = piece.stop
            if piece.stop == known(piece.request):
                generated[piece.request] = min(generated[piece.request] + 1, shapes[piece.request].max_new_tokens)
        if pieces:
            steps.append(Step(clock, tuple(pieces)))
        for i in [i for i in running if fed[i] >= shapes[i].prompt_len and generated[i] >= shapes[i].max_new_tokens]:
            running.remove(i)
            free_blocks += blocks[i]
            blocks[i] = 0
        clock += 1
    return steps
