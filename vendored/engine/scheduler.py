"""FCFS continuous batching with a token budget per step.

Each step: every running sequence that is decoding gets its one token first; then running sequences still in prefill
get pieces in arrival order; then waiting sequences are admitted (a state slot, K/V blocks) while the budget, the slot
pool and max_num_seqs allow. A piece may be any length from 1 up to what is left of the budget (and at most
long_prefill_token_threshold tokens, when set), so one step can hold several requests' prefill pieces, several of them
continuing from a saved state, next to many decodes. A one-token piece of a prompt is still a prefill.

When a sequence needs a K/V block and none is free, the most recently arrived running sequence (possibly the one
asking) is preempted: its slot
and blocks are freed and it goes back to the front of the queue, to be recomputed from its tokens later (results are
unchanged; its prompt logprobs already recorded are kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache import KVCache, StatePool


# An output id not yet read back from the device: a decode step runs ahead of its results (engine.py, "in flight");
# the next step takes that token from the device, and the id is filled in when the step is read back.
PENDING = -1


@dataclass(eq=False)               # identity: two requests with equal fields are still two sequences
class Sequence:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    top_k: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    keep_rows: bool = False          # keep every position's full log-softmax row (for a test harness)
    sampling: object | None = None   # sampling.SamplingParams: the next tokens are drawn, not greedy
    prompt_top: list | None = None   # per prompt position, its top-k (token, logprob), when asked for
    rows: dict[int, "object"] = field(default_factory=dict)   # position -> (V,) log-softmax predicting position+1
    num_computed: int = 0            # tokens whose state and K/V are in the cache
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    pending_row: int | None = None   # while its last output id is PENDING: that token's row in the step in flight

    @property
    def tokens(self) -> list[int]:
        """Prompt and output as one new list: O(length), so per-position code uses num_tokens and token_at."""
        return self.prompt + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output_ids[position - n]

    def token_span(self, start: int, length: int) -> list[int]:
        """Tokens [start, start + length) without copying the whole sequence (a 100K-token prompt fed in pieces)."""
        n = len(self.prompt)
        return (self.prompt[start:min(start + length, n)]
                + self.output_ids[max(start - n, 0):max(start + length - n, 0)])

    @property
    def is_decoding(self) -> bool:
        """Prompt fully computed and exactly one token (the last generated) not yet fed."""
        return self.num_computed >= len(self.prompt) and self.num_tokens - self.num_computed == 1

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens and self.num_computed >= len(self.prompt)


@dataclass
class Piece:
    seq: Sequence
    start: int                       # first position fed in this step
    length: int
    is_decode: bool


class Scheduler:
    def __init__(self, states: StatePool, kv: KVCache, *, max_num_batched_tokens: int, max_num_seqs: int,
                 long_prefill_token_threshold: int | None = None) -> None:
        """long_prefill_token_threshold: the most tokens one prefill piece may take in a step (None: the budget)."""
        self.states, self.kv = states, kv
        self.budget, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.piece_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow_blocks(self, seq: Sequence, new_tokens: int) -> bool:
        """Give seq enough K/V blocks for new_tokens more; preempt younger sequences if needed."""
        need = self.kv.blocks_for(seq.num_computed + new_tokens) - len(seq.blocks)
        while need > self.kv.num_free:
            victim = max(self.running, key=lambda s: s.arrival)     # the youngest goes, possibly seq itself
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += self.kv.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.states.free(seq.slot)
            seq.slot = None
        self.kv.free(seq.blocks)
        seq.blocks = []

    def schedule(self) -> list[Piece]:
        """The pieces of the next step: decodes first, then prefill pieces. Empty only when nothing can run.

        A running sequence always holds a state slot and a waiting one never does, so `seq.slot is not None` is
        membership of `running` in O(1) (list membership compared two sequences field by field: 64 decoding
        sequences spent most of a step's host time in it). A piece is kept only if its sequence was
        not preempted after it was planned (were it admitted again in the same step, only its new piece would count)."""
        left = self.budget
        planned: list[tuple[Piece, int]] = []                      # (piece, its sequence's preemptions when planned)
        prefilling: list[Sequence] = []                            # running, not decoding: the second pass's
        capacity = self.kv.block_size
        for seq in list(self.running):
            if left == 0:
                break
            if seq.slot is None:
                continue                                            # preempted by an earlier sequence's growth
            computed, prompt_len = seq.num_computed, len(seq.prompt)
            # seq.is_decoding, inline: this loop runs once per running sequence per step
            if computed < prompt_len or prompt_len + len(seq.output_ids) - computed != 1:
                prefilling.append(seq)
            elif (computed < len(seq.blocks) * capacity               # room for one more token: no growth needed
                  or self._grow_blocks(seq, 1)):
                planned.append((Piece(seq, computed, 1, True), seq.preemptions))
                left -= 1
        # A sequence is decoding or not for the whole of this step (only preemption changes it, and that also takes
        # its slot), so the prefill pass goes over the others only, in running order.
        for seq in prefilling:
            if left == 0:
                break
            if seq.slot is None:
                continue
            n = min(left, seq.num_tokens - seq.num_computed, self.piece_cap)
            if n > 0 and self._grow_blocks(seq, n):
                planned.append((Piece(seq, seq.num_computed, n, False), seq.preemptions))
                left -= n
        while self.waiting and left > 0 and self.states.num_free and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(left, seq.num_tokens, self.piece_cap)
            if self.kv.blocks_for(n) > self.kv.num_free:
                break                                               # wait for running sequences to free blocks
            self.waiting.popleft()
            seq.slot = self.states.allocate()
            seq.blocks = self.kv.allocate(self.kv.blocks_for(n))
            self.running.append(seq)
            planned.append((Piece(seq, 0, n, False), seq.preemptions))
            left -= n
        # Preemption may have removed a sequence after its piece was planned: drop such pieces.
        return [p for p, preemptions in planned if p.seq.slot is not None and p.seq.preemptions == preemptions]

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
