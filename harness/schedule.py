"""The step plan of a token-budget scheduler: which pieces of which requests go into each engine step.

The policy is vLLM v1's: requests are admitted first come, first served (by arrival step, then by their order) while
fewer than `max_num_seqs` are running; each step first gives every running request that is decoding its one token,
then fills what is left of `max_num_batched_tokens` with prefill pieces, oldest request first. Greedy requests of
known length finish at a known step, so the whole plan is known in advance: the reference adapter executes it, and
scenarios.py reads it to prove where its token budgets put the piece boundaries.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


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


def plan_steps(shapes: Sequence[RequestShape], *, max_num_batched_tokens: int | None,
               max_num_seqs: int | None) -> list[Step]:
    """Every non-empty step until all requests have generated their tokens (empty steps still advance the clock).

    A request's last prompt piece yields its first generated token; each later token needs one decode of the
    previous one, at position T + j for output j.
    """
    budget_per_step = max_num_batched_tokens or math.inf
    seq_limit = max_num_seqs or math.inf
    waiting = deque(sorted(range(len(shapes)), key=lambda i: (shapes[i].arrival_step, i)))
    running: list[int] = []
    fed = [0] * len(shapes)            # positions fed so far
    generated = [0] * len(shapes)      # output tokens produced so far
    steps: list[Step] = []
    clock = 0
    while waiting or running:
        while waiting and shapes[waiting[0]].arrival_step <= clock and len(running) < seq_limit:
            running.append(waiting.popleft())
        budget = budget_per_step
        pieces: list[Piece] = []
        for i in running:
            shape = shapes[i]
            if budget > 0 and fed[i] == shape.prompt_len + generated[i] - 1 and generated[i] >= 1:
                pieces.append(Piece(i, fed[i], fed[i] + 1, True))
                budget -= 1
        for i in running:
            remaining = shapes[i].prompt_len - fed[i]
            if budget > 0 and remaining > 0:
                take = int(min(remaining, budget))
                pieces.append(Piece(i, fed[i], fed[i] + take, False))
                budget -= take
        for piece in pieces:
            fed[piece.request] = piece.stop
            if piece.decode or piece.stop == shapes[piece.request].prompt_len:
                generated[piece.request] = min(generated[piece.request] + 1, shapes[piece.request].max_new_tokens)
        if pieces:
            steps.append(Step(clock, tuple(pieces)))
        running = [i for i in running
                   if fed[i] < shapes[i].prompt_len or generated[i] < shapes[i].max_new_tokens]
        clock += 1
    return steps
