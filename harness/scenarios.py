"""The scenario matrix (docs/design.md §5) as data, derived from the model's SSD chunk size Q and conv width W.

A scenario is a named engine configuration (`EngineOptions`) plus a workload (request shapes); its id is readable,
e.g. `chunked_prefill-budget15-Q16`. Request lengths and token budgets are functions of Q and W, so another model
gets its own boundary cases. Token ids come from a `PromptSource`: fixtures/prompts.jsonl when present (real text
gives peaked distributions), else seeded random ids.

Kinds: batching (alone / together / shuffled), chunked_prefill (token budgets, and a per-piece cap), preemption
(a K/V cache too small for the workload), tp, pp, cudagraph, ssm_state_dtype, long, sampled (continuations drawn at
a temperature, judged teacher-forced: the decode path at positions as sensitive as prompt positions), and the opt-in
invariance (the same requests under several configurations, compared bit for bit: an engine's promise of
determinism, which a correct engine need not make, so `all` leaves it out). Which boundary events a scenario
produces is computed from its step plan (harness/events.py); tests/harness/test_event_coverage.py checks that every
model's scenarios produce every event it can have (docs/scenarios.md lists them).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from reference.config import ModelConfig

from .engine import EngineOptions, Request
from .events import plan_events
from .schedule import DEFAULT_KV_BLOCK_SIZE, RequestShape, plan_options, plan_steps

# The long scenarios: a prompt past 100,000 tokens (not a multiple of any chunk or block size), prefilled in pieces of
# 8192 tokens (the vendored adapter's default budget): the last pieces attend over ~100K keys, Hq·8192·100K scores,
# past 2^31 elements for Hq >= 3, the int32-offset class of bug in whatever computes them.
LONG_PROMPT_TOKENS = 100_003
LONG_STEP_TOKENS = 8192

KINDS = ("batching", "chunked_prefill", "preemption", "tp", "pp", "cudagraph", "ssm_state_dtype", "long", "sampled",
         "invariance")

# The sampled scenarios' temperature. A greedy token of a confident model has a logprob near 0, where an error in
# the hidden state barely moves it (the logprob of the top token changes by (1 - p) times the logit error), so a
# decode path's errors hide at greedy positions. Drawn at T = 2 most tokens are not the top one, and their
# logprobs move with the logits as prompt positions' do.
SAMPLE_TEMPERATURE = 2.0

# Names that --scenarios takes beside kinds and ids, each standing for a few scenarios (alias_ids). make compare runs
# `representative` on both tiny models and `boundary-events` on tiny-bamba as well (docs/scenarios.md says why);
# tests/harness/test_representative.py checks that this covers every kind that runs on a CPU and every boundary
# event.
ALIASES = ("representative", "boundary-events")


def alias_ids(Q: int, W: int) -> dict[str, tuple[str, ...]]:
    """The scenario ids each alias names for a model of chunk size Q and conv width W (build_scenarios marks them).

    representative: one scenario of each kind that runs on a CPU, the cheapest under the Triton interpreter that still
    turns the kind's knob (measured: docs/scenarios.md). `long` has none: its CPU case (a prompt past the tiny models'
    4096 positions) is slow. cudagraph-off is the CPU half of the cudagraph pair (cudagraph-on needs CUDA).
    boundary-events: the fewest scenarios that between them produce every boundary event (harness/events.py): the
    token budget of W-1 (every split event, the only budget above 2 to end a piece W-1 tokens in), the per-piece cap
    (continuing prefills) and preemption (a recompute across a chunk boundary)."""
    capped = f"chunked_prefill-capped-budget{2 * Q + -(-Q // 2)}-cap{Q}-Q{Q}"
    preemption = f"preemption-blocks7x{preemption_block_size(Q)}-Q{Q}"
    return {
        "representative": ("batching-together", capped, preemption, "tp-size2", "pp-size2", "cudagraph-off",
                           "ssm_state_dtype-bfloat16", f"sampled-decode-T{SAMPLE_TEMPERATURE:g}"),
        "boundary-events": (f"chunked_prefill-budget{max(W - 1, 1)}-Q{Q}", capped, preemption),
    }


@dataclass(frozen=True)
class Configuration:
    """One engine configuration under which an invariance scenario runs its requests. neighbours: requests run
    beside them whose results are not compared (requests `n{i}-len{T}`, presented first); order_seed: present the
    scenario's requests in a seeded random order; needs_cuda: left out (and the report says so) without a CUDA
    device."""

    name: str
    options: EngineOptions
    about: str
    neighbours: tuple[RequestShape, ...] = ()
    order_seed: int | None = None
    needs_cuda: bool = False

    def arranged(self, judged: Sequence, extra: Sequence) -> list:
        """The items of a workload in this configuration's presentation order: `extra` (one per neighbour) first,
        then `judged` (one per scenario request) in the seeded order, if any."""
        judged = list(judged)
        if self.order_seed is not None:
            random.Random(self.order_seed).shuffle(judged)
        return [*extra, *judged]

    def shapes(self, judged: Sequence[RequestShape]) -> tuple[RequestShape, ...]:
        """The request shapes as this configuration presents them (what its step plan is made of)."""
        return tuple(self.arranged(judged, self.neighbours))

    def requests(self, judged: Sequence[Request], source: "PromptSource", *, top_k: int = 5,
                 full_distributions: bool = False) -> list[Request]:
        """The scenario's requests (`judged`, as Scenario.requests made them) and the neighbours, with prompts of
        their own, in presentation order."""
        extra = [Request(f"n{i}-len{s.prompt_len}", source.tokens(s.prompt_len, NEIGHBOUR_INDEX + i),
                         s.max_new_tokens, top_k, s.arrival_step, full_distributions)
                 for i, s in enumerate(self.neighbours)]
        return self.arranged(judged, extra)


# Neighbour i of an invariance configuration takes the prompt of request index NEIGHBOUR_INDEX + i of the prompt
# source, past any workload's own indices.
NEIGHBOUR_INDEX = 1000


@dataclass(frozen=True)
class Scenario:
    """A named configuration plus workload. shapes: the requests (lengths, tokens to generate, arrival steps);
    shuffle_seed: present the requests in a seeded random order; needs_cuda: skipped without a CUDA device;
    marks: pytest markers of its cases; slow: left out unless asked for by id; temperature: > 0, every request
    samples its continuation at it, request i with seed i; aliases: the ALIASES that name it (alias_ids);
    configurations: an invariance scenario's configurations, the first its baseline (its options are `options`);
    opt_in: left out of `all` and of the generic pytest matrix, selected by its kind or id (invariance: a promise
    of determinism that a correct engine need not make)."""

    id: str
    kind: str
    options: EngineOptions
    shapes: tuple[RequestShape, ...]
    about: str
    shuffle_seed: int | None = None
    needs_cuda: bool = False
    marks: tuple[str, ...] = ()
    slow: bool = False
    temperature: float = 0.0
    aliases: tuple[str, ...] = ()
    configurations: tuple[Configuration, ...] = ()
    opt_in: bool = False

    def workloads(self) -> list[tuple[str, EngineOptions, tuple[RequestShape, ...]]]:
        """(name, options, shapes as presented) of each engine run the scenario makes: one, or one per
        configuration (what its boundary events and its share of a progress bar are computed from)."""
        if not self.configurations:
            return [(self.id, self.options, self.shapes)]
        return [(c.name, c.options, c.shapes(self.shapes)) for c in self.configurations]

    def requests(self, source: "PromptSource", *, top_k: int = 5, full_distributions: bool = False) -> list[Request]:
        """The workload's requests in presentation order; request i of the shapes is named `r{i}-len{T}`."""
        reqs = [Request(f"r{i}-len{s.prompt_len}", source.tokens(s.prompt_len, i), s.max_new_tokens, top_k,
                        s.arrival_step, full_distributions, self.temperature, i) for i, s in enumerate(self.shapes)]
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed).shuffle(reqs)
        return reqs


def _found(value) -> str:
    """A JSON value as a prompts-file error names what it found: its text (cut at 40 characters) and its type."""
    kind = ("a boolean" if isinstance(value, bool) else "an integer" if isinstance(value, int) else
            "a float" if isinstance(value, float) else "a string" if isinstance(value, str) else
            "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else None)
    text = json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= 40 else text[:37] + "..."
    return text if kind is None else f"{text} ({kind})"


@dataclass
class PromptSource:
    """Token ids for workloads. With real prompts: request `index` of length L takes the first L tokens of one of the
    prompts at least L long (cycling through them by index), or of all prompts joined when none is that long.
    Without: ids drawn uniformly from [0, vocab_size) by a generator seeded with (seed, index, length)."""

    vocab_size: int
    seed: int = 0
    prompts: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_jsonl(cls, path: str | Path, vocab_size: int) -> "PromptSource":
        """fixtures/prompts.jsonl: one JSON object a line (blank lines skipped) with token_ids, a non-empty list of
        integer ids in [0, vocab_size), and optionally id, a string or integer not repeated in the file (kind, text
        and any other fields are unused here). Anything else raises ValueError as `path:line: field: expected ...,
        found ...`, the first bad line only."""
        prompts, seen = [], {}                     # seen: str(id) -> (line, id) of its first use
        for line_no, raw in enumerate(Path(path).read_bytes().splitlines(), 1):   # bytes: \n, \r\n, \r only
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: expected UTF-8 text, found byte 0x{raw[err.start]:02x} at column "
                                 f"{err.start + 1}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: expected a JSON object with token_ids, found text that is not JSON "
                                 f"({err.msg} at column {err.colno})") from None
            except (ValueError, RecursionError) as err:      # an integer of over 4300 digits; arrays nested deep
                raise ValueError(f"{where}: expected a JSON object with token_ids, found JSON that Python cannot "
                                 f"read ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with token_ids, found {_found(row)}")
            if "id" in row:
                rid = row["id"]
                if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                    raise ValueError(f"{where}: id: expected a string or an integer, found {_found(rid)}")
                if str(rid) in seen:
                    first_line, first = seen[str(rid)]
                    raise ValueError(f"{where}: id: expected each id once in the file, found {json.dumps(rid)} "
                                     f"again (line {first_line} has {json.dumps(first)})")
                seen[str(rid)] = (line_no, rid)
            if "token_ids" not in row:
                fields = ", ".join(row) or "no fields"
                raise ValueError(f"{where}: token_ids: expected a list of integer token ids, found no such field "
                                 f"(the object has {fields})")
            ids = row["token_ids"]
            if not isinstance(ids, list):
                raise ValueError(f"{where}: token_ids: expected a list of integer token ids, found {_found(ids)}")
            if not ids:
                raise ValueError(f"{where}: token_ids: expected at least one token id, found an empty list (an "
                                 "empty prompt cannot be scored)")
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"{where}: token_ids[{i}]: expected an integer token id, found {_found(t)}")
                if not 0 <= t < vocab_size:
                    hint = " (prompts made for another tokenizer?)" if t >= vocab_size else ""
                    raise ValueError(f"{where}: token_ids[{i}]: token id {t} outside the model's vocabulary "
                                     f"[0, {vocab_size}){hint}")
            prompts.append(ids)
        if not prompts:
            raise ValueError(f"{path}: no prompts (expected one JSON object a line with token_ids)")
        return cls(vocab_size, prompts=prompts)

    def tokens(self, length: int, index: int) -> list[int]:
        if not self.prompts:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 1_009 + length)
            return torch.randint(0, self.vocab_size, (length,), generator=gen).tolist()
        long_enough = [p for p in self.prompts if len(p) >= length]
        if long_enough:
            return long_enough[index % len(long_enough)][:length]
        joined = [t for p in self.prompts for t in p]
        return (joined * (length // len(joined) + 1))[:length]


# ---- workloads -------------------------------------------------------------------------------------------------

def batching_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Lengths 1, W-1, Q-1, Q, Q+1, 3Q and the first that ends on both a chunk and a K/V block boundary (lcm of Q
    and the default block size), deduplicated, 6 new tokens each."""
    lengths = dict.fromkeys([1, W - 1, Q - 1, Q, Q + 1, 3 * Q, math.lcm(Q, DEFAULT_KV_BLOCK_SIZE)])
    return tuple(RequestShape(n, 6) for n in lengths if n >= 1)


LONG_DECODE_TOKENS = 128


def long_decode_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Four prompts (1, W-1, Q+1, 2Q+1 tokens) each decoding LONG_DECODE_TOKENS tokens side by side: 512 decode
    positions, every request's SSM state carried through 128 single-token updates. A state that loses precision at
    each update (stored in 16 bits, say) drifts further with every step, which a few decode steps cannot show."""
    return tuple(RequestShape(n, LONG_DECODE_TOKENS) for n in dict.fromkeys([1, max(W - 1, 1), Q + 1, 2 * Q + 1]))


# Tokens each request of batching-long-generation decodes, where the model's positions allow.
LONG_GENERATION_TOKENS = 3584


def long_generation_shapes(Q: int, max_positions: int) -> tuple[RequestShape, ...]:
    """Two prompts (1 and Q+1 tokens) each decoding LONG_GENERATION_TOKENS tokens (fewer where max_positions stops
    them). A state rounded at every update (kept in 16 bits, say) adds an error that grows like the square root of
    the updates while the inputs' own rounding does not accumulate so: measured at Bamba-9B widths in bf16, 128
    updates left such a bug at the noise floor (excess ratio +0.05); whether a few thousand lift it above the
    excess test's limit is still to be measured (docs/scale.md)."""
    prompts = (1, Q + 1)
    return tuple(RequestShape(n, max(1, min(LONG_GENERATION_TOKENS, max_positions - n))) for n in prompts)


def chunked_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """A prompt of several chunks first (3Q+2), then Q+1, W-1, Q, 2Q-1, and a one-token prompt arriving at step 2,
    4 new tokens each: under every budget the short ones are prefilled while the long one decodes."""
    return (RequestShape(3 * Q + 2, 4), RequestShape(Q + 1, 4), RequestShape(max(W - 1, 1), 4), RequestShape(Q, 4),
            RequestShape(2 * Q - 1, 4), RequestShape(1, 4, arrival_step=2))


def decode_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Six requests finishing one after another (2..12 new tokens): decode batches of 6, 5, 4, 3, 2, 1 rows."""
    lengths = (Q + 1, W - 1, Q - 1, 1, Q, 2 * Q)
    return tuple(RequestShape(max(n, 1), 2 + 2 * i) for i, n in enumerate(lengths))


def capped_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Three prompts longer than a chunk first (3Q+2, 2Q+1, 2Q-1), then Q+1, W-1 and a one-token prompt arriving at
    step 2, 4 new tokens each: under a per-piece cap of Q and a budget of 2Q + ⌈Q/2⌉ the first step takes Q, Q and
    ⌈Q/2⌉ tokens of the first three, so the next step continues two of them on a chunk boundary and one inside a
    chunk."""
    return (RequestShape(3 * Q + 2, 4), RequestShape(2 * Q + 1, 4), RequestShape(max(2 * Q - 1, 1), 4),
            RequestShape(Q + 1, 4), RequestShape(max(W - 1, 1), 4), RequestShape(1, 4, arrival_step=2))


def preemption_block_size(Q: int) -> int:
    return -(-Q // 2)


def preemption_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Prompts of exactly 4 and 3 K/V blocks of ⌈Q/2⌉ tokens (the second longer than a chunk), 4 new tokens each."""
    block = preemption_block_size(Q)
    return RequestShape(4 * block, 4), RequestShape(3 * block, 4)


def preemption_options(Q: int, W: int) -> EngineOptions:
    """A K/V cache of exactly the 7 blocks the two prompts of `preemption_shapes` fill, and a budget that prefills both
    in the first step: the first decode needs an eighth block, so the younger request is preempted, and recomputed
    from position 0 through its first chunk boundary once the older one has finished."""
    block = preemption_block_size(Q)
    return EngineOptions(num_kv_blocks=7, kv_block_size=block, max_num_batched_tokens=7 * block)


def cudagraph_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """17 requests at once (lengths 1, W-1, Q-1, Q, Q+1, 2Q+1, cycled and lengthened), of which 12 stop after 3 new
    tokens, 2 after 6 and 3 after 9: decode batches of 17, then 5, then 3 rows, each short of a power of two. Three
    more (a one-token prompt, Q+1, W-1; 4 new tokens) arrive at step 7: under max_num_seqs = 17 they take state slots
    freed by finished requests and then decode in batches of 6 and 3 with them."""
    base = (1, max(W - 1, 1), Q - 1, Q, Q + 1, 2 * Q + 1)
    first = tuple(RequestShape(max(base[i % len(base)] + i // len(base), 1), n)
                  for i, n in enumerate((3,) * 12 + (6,) * 2 + (9,) * 3))
    later = tuple(RequestShape(n, 4, arrival_step=7) for n in (1, Q + 1, max(W - 1, 1)))
    return first + later


CUDAGRAPH_MAX_NUM_SEQS = 17       # the requests of cudagraph_shapes that run at once: later ones reuse their slots


def chunked_prefill_budgets(Q: int, W: int) -> list[int]:
    """1 (every token alone), 2, W-1 (pieces inside the conv window, steps mixing many requests), Q-1, Q, Q+1 (piece
    ends next to chunk boundaries), 2Q+1 (a piece spanning two chunk edges), 3Q+2, the first prompt's length (a
    budget that ends exactly at a prompt end), and 1000 (no prompt of the workload is split)."""
    return sorted({1, 2, max(W - 1, 1), Q - 1, Q, Q + 1, 2 * Q + 1, 3 * Q + 2, 1000} - {0})


# The invariance scenario's tokens to generate per request (greedy) and its neighbours' (which keep decoding beside
# the judged requests' decodes).
INVARIANCE_NEW_TOKENS = 3
INVARIANCE_NEIGHBOUR_TOKENS = 6
INVARIANCE_ORDER_SEED = 1234


def invariance_shapes(Q: int, W: int) -> tuple[RequestShape, ...]:
    """Prompts of 1, W-1, Q-1, Q+1, 2Q+3 and 3Q+2 tokens (deduplicated), INVARIANCE_NEW_TOKENS new tokens each:
    prompts that end just before and after a chunk boundary, inside the first conv window, and span two and three
    chunks, so the token budgets of the invariance configurations cut them at every kind of place."""
    lengths = dict.fromkeys(max(n, 1) for n in (1, W - 1, Q - 1, Q + 1, 2 * Q + 3, 3 * Q + 2))
    return tuple(RequestShape(n, INVARIANCE_NEW_TOKENS) for n in lengths)


def invariance_preemption_options(Q: int, W: int) -> EngineOptions:
    """The preemption scenario's K/V blocks of ⌈Q/2⌉ tokens and budget of 7 blocks a step (preemption_options),
    with the fewest blocks (at least its 7) that hold the longest invariance request and still preempt one of the
    requests run together, which is then recomputed from position 0."""
    block = preemption_block_size(Q)
    shapes = invariance_shapes(Q, W)
    longest = max(-(-(s.prompt_len + s.max_new_tokens - 1) // block) for s in shapes)
    for blocks in range(max(7, longest), max(7, longest) + 8):
        options = EngineOptions(num_kv_blocks=blocks, kv_block_size=block, max_num_batched_tokens=7 * block)
        if _recomputes(plan_steps(shapes, **plan_options(options))):
            return options
    raise AssertionError(f"Q = {Q}, W = {W}: no K/V cache of {max(7, longest)}..{max(7, longest) + 7} blocks of "
                         f"{block} tokens preempts a request of the invariance workload")


def _recomputes(plan) -> bool:
    """Whether a plan feeds a request from position 0 again (a preempted request recomputed)."""
    fed: dict[int, int] = {}
    for step in plan:
        for piece in step.pieces:
            if piece.start == 0 and fed.get(piece.request, 0) > 0:
                return True
            fed[piece.request] = piece.stop
    return False


def invariance_budgets(Q: int) -> list[int]:
    """Token budgets Q-1, Q, Q+1 (prefill pieces ending next to chunk boundaries) and 3 (pieces inside the conv
    window, many requests a step), deduplicated, in that order."""
    return [b for b in dict.fromkeys((Q - 1, Q, Q + 1, 3)) if b >= 1]


def invariance_configurations(Q: int, W: int) -> tuple[Configuration, ...]:
    """alone (the baseline), together, shuffled, beside neighbours, the token budgets of invariance_budgets,
    preempted, and (on CUDA) with decode steps replayed as CUDA graphs."""
    neighbours = (RequestShape(2 * Q + 1, INVARIANCE_NEIGHBOUR_TOKENS),
                  RequestShape(W + 1, INVARIANCE_NEIGHBOUR_TOKENS))
    preempt = invariance_preemption_options(Q, W)
    return (
        Configuration("alone", EngineOptions(max_num_seqs=1), "each request alone (max_num_seqs = 1): the baseline, "
                      "judged against the oracle"),
        Configuration("together", EngineOptions(), "all requests in one batch"),
        Configuration("shuffled", EngineOptions(), "all requests in one batch, in a seeded random order",
                      order_seed=INVARIANCE_ORDER_SEED),
        Configuration("neighbours", EngineOptions(), f"all requests beside {len(neighbours)} more of "
                      f"{' and '.join(str(n.prompt_len) for n in neighbours)} tokens (presented first, decoding "
                      f"{INVARIANCE_NEIGHBOUR_TOKENS} tokens each; their results are not compared)",
                      neighbours=neighbours),
        *(Configuration(f"budget{b}", EngineOptions(max_num_batched_tokens=b), f"token budget {b} per step "
                        "(chunked prefill)") for b in invariance_budgets(Q)),
        Configuration("preempted", preempt, f"a K/V cache of {preempt.num_kv_blocks} blocks of "
                      f"{preempt.kv_block_size} tokens, too small for all at once: a request is preempted and "
                      "recomputed from position 0"),
        Configuration("cudagraph-on", EngineOptions(cuda_graphs=True), "all requests in one batch, decode steps "
                      "replayed as CUDA graphs (padded batch sizes)", needs_cuda=True),
    )


# ---- the matrix ------------------------------------------------------------------------------------------------

def build_scenarios(cfg: ModelConfig, engine=None) -> list[Scenario]:
    """Every scenario for this model, in KINDS order, then those of `engine` (an Engine class: its own knobs, from
    its engine_scenarios, e.g. llama.cpp's thread count and flash attention)."""
    return _with_aliases(_common_scenarios(cfg), cfg) + (list(engine.engine_scenarios(cfg)) if engine is not None
                                                         else [])


def _with_aliases(scenarios: list[Scenario], cfg: ModelConfig) -> list[Scenario]:
    """The scenarios with their `aliases` set from alias_ids; an alias naming an id that was not built raises."""
    named = alias_ids(cfg.mamba_chunk_size, cfg.mamba_d_conv)
    missing = {sid for ids in named.values() for sid in ids} - {s.id for s in scenarios}
    if missing:
        raise AssertionError(f"alias_ids names scenarios that build_scenarios does not make: {sorted(missing)}")
    return [replace(s, aliases=tuple(a for a, ids in named.items() if s.id in ids)) for s in scenarios]


def _common_scenarios(cfg: ModelConfig) -> list[Scenario]:
    Q, W, G = cfg.mamba_chunk_size, cfg.mamba_d_conv, cfg.mamba_n_groups
    batch, chunked, decode = batching_shapes(Q, W), chunked_shapes(Q, W), decode_shapes(Q, W)
    graphs = cudagraph_shapes(Q, W)
    lengths = ", ".join(str(s.prompt_len) for s in batch)
    out = [
        Scenario("batching-alone", "batching", EngineOptions(max_num_seqs=1), batch,
                 f"one request at a time; prompt lengths {lengths}"),
        Scenario("batching-together", "batching", EngineOptions(), batch,
                 f"all requests in one batch; prompt lengths {lengths}"),
        Scenario("batching-shuffled", "batching", EngineOptions(), batch,
                 "all requests in one batch, in a seeded random order", shuffle_seed=1234),
        Scenario("batching-long-decode", "batching", EngineOptions(), long_decode_shapes(Q, W),
                 f"{len(long_decode_shapes(Q, W))} requests decoding {LONG_DECODE_TOKENS} tokens each in one batch "
                 "(precision lost by the SSM state at each update accumulates)", slow=True),
        Scenario("batching-long-generation", "batching", EngineOptions(),
                 long_generation_shapes(Q, cfg.max_position_embeddings),
                 f"{len(long_generation_shapes(Q, cfg.max_position_embeddings))} requests decoding up to "
                 f"{LONG_GENERATION_TOKENS} tokens each (a state's per-update rounding, grown past the noise floor); "
                 "thousands of decode steps: on a GPU only", slow=True, needs_cuda=True, marks=("gpu",)),
    ]
    for budget in chunked_prefill_budgets(Q, W):
        options = EngineOptions(max_num_batched_tokens=budget)
        tags = ", ".join(sorted(plan_events(chunked, options, Q, W)))
        out.append(Scenario(f"chunked_prefill-budget{budget}-Q{Q}", "chunked_prefill", options, chunked,
                            f"token budget {budget} per step; {tags}"))
    capped = capped_shapes(Q, W)
    cap_options = EngineOptions(max_num_batched_tokens=2 * Q + -(-Q // 2), long_prefill_token_threshold=Q)
    out.append(Scenario(f"chunked_prefill-capped-budget{cap_options.max_num_batched_tokens}-cap{Q}-Q{Q}",
                        "chunked_prefill", cap_options, capped,
                        f"token budget {cap_options.max_num_batched_tokens}, at most {Q} tokens a prompt piece: "
                        + ", ".join(sorted(plan_events(capped, cap_options, Q, W)))))
    preempt = preemption_options(Q, W)
    out.append(Scenario(f"preemption-blocks{preempt.num_kv_blocks}x{preempt.kv_block_size}-Q{Q}", "preemption",
                        preempt, preemption_shapes(Q, W),
                        f"a K/V cache of {preempt.num_kv_blocks} blocks of {preempt.kv_block_size} tokens, too small "
                        "for both long requests: " + ", ".join(sorted(plan_events(preemption_shapes(Q, W), preempt,
                                                                                  Q, W)))))
    tp_sizes = sorted({1, 2, 4} | {next_power_of_two_above(G)})
    for tp in tp_sizes:
        if tp == 1:
            about = "one rank: the baseline of the tp scenarios"
        elif G % tp == 0:
            about = f"tensor parallel over {tp} ranks, G = {G}: B/C groups sharded, {G // tp} per rank"
        else:
            about = (f"tensor parallel over {tp} ranks, G = {G}: G % tp = {G % tp}, B/C groups replicated on the "
                     "ranks that read them, gated-norm statistics summed across ranks")
        out.append(Scenario(f"tp-size{tp}", "tp", EngineOptions(tensor_parallel_size=tp), batch, about,
                            marks=("tp",) if tp > 1 else ()))
    tp_budget = Q + 1
    out.append(Scenario(f"tp-size2-budget{tp_budget}-Q{Q}", "tp",
                        EngineOptions(tensor_parallel_size=2, max_num_batched_tokens=tp_budget), chunked,
                        f"tensor parallel over 2 ranks with chunked prefill, token budget {tp_budget}: "
                        + ", ".join(sorted(plan_events(chunked, EngineOptions(max_num_batched_tokens=tp_budget),
                                                         Q, W))), marks=("tp",)))
    for pp in (1, 2):
        out.append(Scenario(f"pp-size{pp}", "pp", EngineOptions(pipeline_parallel_size=pp), batch,
                            "pipeline parallel over 2 stages, each holding the weights, states and K/V of its layers"
                            if pp > 1 else "one stage: the baseline of pp-size2", marks=("tp",) if pp > 1 else ()))
    out += [
        Scenario("cudagraph-off", "cudagraph", EngineOptions(cuda_graphs=False, max_num_seqs=CUDAGRAPH_MAX_NUM_SEQS),
                 graphs, "eager decode of the cudagraph workload (the baseline of cudagraph-on)",
                 marks=("cudagraph",)),
        Scenario("cudagraph-on", "cudagraph", EngineOptions(cuda_graphs=True, max_num_seqs=CUDAGRAPH_MAX_NUM_SEQS),
                 graphs, "graph-captured decode: batches of 17, 6, 5 and 3 rows padded to 32, 8, 8 and 4; freed "
                 "slots reused between replays; a one-token prompt arriving mid-run", needs_cuda=True,
                 marks=("cudagraph", "gpu")),
    ]
    for state_dtype in ("float32", "bfloat16"):
        out.append(Scenario(f"ssm_state_dtype-{state_dtype}", "ssm_state_dtype",
                            EngineOptions(ssm_state_dtype=state_dtype), decode,
                            f"SSM state stored in {state_dtype} between steps; up to 12 decode steps"))
    past_max = cfg.max_position_embeddings + Q + 1
    out.append(Scenario("long-past_max_positions", "long", EngineOptions(allow_long_context=True),
                        (RequestShape(past_max, 4),),
                        f"a {past_max}-token prompt, past max_position_embeddings (explicit opt-in)",
                        slow=past_max > 4096))
    long_len = LONG_PROMPT_TOKENS
    long_options = EngineOptions(allow_long_context=long_len > cfg.max_position_embeddings, max_num_seqs=1,
                                 max_num_batched_tokens=LONG_STEP_TOKENS)
    out.append(Scenario("long-100k", "long", long_options, (RequestShape(long_len, 4),),
                        f"a {long_len}-token prompt in chunks of {LONG_STEP_TOKENS} tokens, then 4 decodes at that "
                        "context (int32 offset overflow class)", needs_cuda=True, marks=("gpu",), slow=True))
    out.append(Scenario("long-100k-cudagraph", "long", replace(long_options, cuda_graphs=True),
                        (RequestShape(long_len, 4),),
                        f"long-100k with its decodes replayed as CUDA graphs at a {long_len}-token context",
                        needs_cuda=True, marks=("gpu", "cudagraph"), slow=True))
    T = SAMPLE_TEMPERATURE
    out += [
        Scenario(f"sampled-decode-T{T:g}", "sampled", EngineOptions(), decode,
                 f"the decode workload (batches of 6 down to 1 rows, up to 12 steps) with every continuation drawn "
                 f"at temperature {T:g} (seed = request index) and judged teacher-forced", temperature=T),
        Scenario(f"sampled-cudagraph-T{T:g}", "sampled",
                 EngineOptions(cuda_graphs=True, max_num_seqs=CUDAGRAPH_MAX_NUM_SEQS), graphs,
                 f"cudagraph-on's workload (decode batches padded to captured sizes, padding rows and all) with every "
                 f"continuation drawn at temperature {T:g}: a padding row's damage judged where greedy tokens hide it",
                 needs_cuda=True, marks=("cudagraph", "gpu"), temperature=T),
        Scenario(f"sampled-long-decode-T{T:g}", "sampled", EngineOptions(), long_decode_shapes(Q, W),
                 f"{len(long_decode_shapes(Q, W))} requests drawing {LONG_DECODE_TOKENS} tokens each at temperature "
                 f"{T:g}, judged teacher-forced: every decode position as sensitive to a state that drifts as a "
                 "prompt position is", slow=True, temperature=T),
    ]
    configurations = invariance_configurations(Q, W)
    shapes = invariance_shapes(Q, W)
    out.append(Scenario(
        f"invariance-Q{Q}", "invariance", configurations[0].options, shapes,
        f"prompt lengths {', '.join(str(s.prompt_len) for s in shapes)}, {INVARIANCE_NEW_TOKENS} greedy tokens each, "
        f"under {len(configurations)} configurations ({', '.join(c.name for c in configurations)}; cudagraph-on on "
        f"CUDA only): every logprob, token and top-k bit-identical to {configurations[0].name}'s, which is judged "
        "against the oracle (opt-in: an engine's declared batch-invariant mode)",
        configurations=configurations, opt_in=True))
    return out


def next_power_of_two_above(n: int) -> int:
    p = 1
    while p <= n:
        p *= 2
    return p


def select_scenarios(scenarios: Sequence[Scenario], spec: str | None) -> list[Scenario]:
    """spec: comma-separated kinds, aliases (ALIASES) and/or scenario ids ("all" or None: every scenario neither
    slow nor opt-in). A kind selects its scenarios that are not slow (opt-in ones included: naming the kind asks
    for them); an alias the scenarios it names (alias_ids); an id selects that scenario; a name with a leading "-"
    removes what it would select (a spec of removals alone starts from "all"). Unknown names raise ValueError."""
    names = [n.strip() for n in (spec or "all").split(",") if n.strip()]
    kinds = tuple(dict.fromkeys([*KINDS, *(s.kind for s in scenarios)]))
    if names and all(n.startswith("-") for n in names):
        names.insert(0, "all")
    by_id = {s.id: s for s in scenarios}

    def named(name: str) -> list[Scenario]:
        if name == "all":
            return [s for s in scenarios if not s.slow and not s.opt_in]
        if name in kinds:
            return [s for s in scenarios if s.kind == name and not s.slow]
        if name in ALIASES:
            return [s for s in scenarios if name in s.aliases]
        if name in by_id:
            return [by_id[name]]
        raise ValueError(f"unknown scenario {name!r}: expected 'all', a kind ({', '.join(kinds)}), an alias "
                         f"({', '.join(ALIASES)}) or an id "
                         f"({', '.join(by_id)}), each optionally with a leading '-' to leave it out")

    chosen: dict[str, Scenario] = {}
    for name in names:
        if name.startswith("-"):
            for s in named(name[1:]):
                chosen.pop(s.id, None)
        else:
            chosen.update({s.id: s for s in named(name)})
    return [s for s in scenarios if s.id in chosen]
