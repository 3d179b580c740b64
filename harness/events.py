"""Boundary events: the moments where an engine's state handling can go wrong, read off a workload's step plan.

A scenario is only as strong as the events its workload makes happen: a bug in how a second continuing prefill finds
its saved state cannot show in a run where no step has two. So the events are computed, not assumed, from the plan of
harness/schedule.py (the vendored engine's schedule, tests/engine/test_scheduler.py checks that it is), and a test
(tests/harness/test_event_coverage.py) asserts that the union of a model's scenarios produces every event the model
can have. Q is the SSD chunk size, W the conv width, and positions count from 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .engine import EngineOptions
from .schedule import DEFAULT_KV_BLOCK_SIZE, RequestShape, plan_options, plan_steps

EVENTS = {
    "split@Q-1": "a prompt piece ends one token before a chunk boundary (position ≡ Q-1 mod Q)",
    "split@Q": "a prompt piece ends exactly on a chunk boundary (position ≡ 0 mod Q)",
    "split@Q+1": "a prompt piece ends one token after a chunk boundary (position ≡ 1 mod Q)",
    "split<W-1": "a prompt piece ends inside the first W-1 tokens (the next piece's conv window reaches the start)",
    "split@W-1": "a prompt piece ends exactly W-1 tokens in (the next piece's conv window is the first piece)",
    "budget_at_sequence_end": "a step's budget runs out exactly at the end of a prompt while another prompt waits",
    "mixed_step": "one step holds prefill pieces of several requests together with decodes",
    "one_token_prompt_with_decodes": "a whole one-token prompt is prefilled in a step that also holds decodes",
    "continuing_prefills": "one step holds two or more prefill pieces that continue from saved states, one starting "
                           "inside a chunk and one on a chunk boundary",
    "decode_after_chunk_and_block_end": "a prompt ends exactly at a chunk end that is also a K/V block end, and the "
                                        "next step decodes it",
    "prompt_W-1_decoded": "a prompt of exactly W-1 tokens is continued by decodes (its conv window is the prompt)",
    "recompute_across_chunk": "a preempted request is recomputed from position 0 through a chunk boundary",
}


def impossible_events(Q: int, W: int) -> dict[str, str]:
    """The events a model with chunk size Q and conv width W cannot have, with the reason."""
    out = {}
    if W <= 2:
        out["split<W-1"] = f"W = {W}: the first W-1 = {W - 1} tokens cannot be split"
    if Q == 1:
        for event in ("split@Q-1", "split@Q+1", "continuing_prefills"):
            out[event] = "Q = 1: every position is a chunk boundary"
    return out


def required_events(Q: int, W: int) -> set[str]:
    return set(EVENTS) - set(impossible_events(Q, W))


def plan_events(shapes: Sequence[RequestShape], options: EngineOptions, Q: int, W: int) -> set[str]:
    """Which EVENTS the planned schedule of this workload under these options produces."""
    plan = plan_steps(shapes, **plan_options(options))
    block = options.kv_block_size or DEFAULT_KV_BLOCK_SIZE
    budget = options.max_num_batched_tokens or math.inf
    events: set[str] = set()
    fed = [0] * len(shapes)
    recomputing: set[int] = set()
    ended_on_boundary: set[int] = set()        # requests whose prompt ended at a chunk and block end last step
    for step in plan:
        prefill = [p for p in step.pieces if not p.decode]
        decoding = [p for p in step.pieces if p.decode]
        prompt_pieces = [p for p in prefill if p.start < shapes[p.request].prompt_len and p.request not in
                         recomputing and not (p.start == 0 and fed[p.request] > 0)]
        if len(prefill) >= 2 and decoding:
            events.add("mixed_step")
        continuing = [p.start for p in prefill if p.start > 0]
        if len(continuing) >= 2 and any(s % Q for s in continuing) and any(s % Q == 0 for s in continuing):
            events.add("continuing_prefills")
        for p in prompt_pieces:
            if p.start == 0 and shapes[p.request].prompt_len == 1 and decoding:
                events.add("one_token_prompt_with_decodes")
            if p.start > 0:
                offset = p.start % Q
                events |= {tag for tag, hit in (("split@Q-1", offset == Q - 1), ("split@Q", offset == 0),
                                                ("split@Q+1", offset == 1 % Q)) if hit}
                if p.start < W - 1:
                    events.add("split<W-1")
                if p.start == W - 1:
                    events.add("split@W-1")
        for p in decoding:
            if p.request in ended_on_boundary:
                events.add("decode_after_chunk_and_block_end")
            if shapes[p.request].prompt_len == W - 1 and p.start == W - 1:
                events.add("prompt_W-1_decoded")
        for p in prefill:
            if p.start == 0 and fed[p.request] > 0:
                recomputing.add(p.request)
            if p.request in recomputing and any(q % Q == 0 for q in range(max(p.start, 1), p.stop)):
                events.add("recompute_across_chunk")
        ended_on_boundary = {p.request for p in prefill if p.stop == shapes[p.request].prompt_len
                             and p.stop % Q == 0 and p.stop % block == 0}
        last = step.pieces[-1]
        for p in step.pieces:
            fed[p.request] = p.stop
        prompt_waits = any(fed[i] < s.prompt_len for i, s in enumerate(shapes))
        if (step.n_tokens == budget and not last.decode and last.stop == shapes[last.request].prompt_len
                and prompt_waits):
            events.add("budget_at_sequence_end")
    return events


def scenario_events(scenario, Q: int, W: int) -> set[str]:
    """The events a scenario's runs produce: its plan's, or, for one that runs its requests under several
    configurations (invariance), the union of theirs (Scenario.workloads)."""
    return set().union(*(plan_events(shapes, options, Q, W) for _, options, shapes in scenario.workloads()))


def events_table(scenarios, Q: int, W: int) -> str:
    """A markdown table: each scenario's id and the events its runs produce (docs/scenarios.md)."""
    short = {event: f"`{event}`" for event in EVENTS}
    lines = ["| scenario | events |", "| --- | --- |"]
    for s in scenarios:
        events = scenario_events(s, Q, W)
        lines.append(f"| `{s.id}` | {', '.join(short[e] for e in EVENTS if e in events) or '-'} |")
    return "\n".join(lines)
