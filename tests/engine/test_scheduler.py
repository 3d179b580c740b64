"""The vendored engine's scheduler alone (no model): budgets, ordering, slots, K/V blocks and preemption."""

import random

import pytest
import torch

from harness.schedule import RequestShape, plan_steps

from vendored.engine.cache import KVCache, StatePool
from vendored.engine.scheduler import Scheduler, Sequence
from vendored.engine.weights import EngineModelConfig

CFG = EngineModelConfig(
    vocab_size=50, hidden_size=8, num_layers=2, attn_layers=(1,), n_heads=2, head_dim=4, n_groups=1, d_state=4,
    d_conv=4, chunk_size=8, num_q_heads=2, num_kv_heads=1, attn_head_dim=4, rotary_dim=2, rope_theta=1e4,
    rms_norm_eps=1e-5, time_step_limit=(0.0, float("inf")), tie_word_embeddings=False, max_position_embeddings=64)


def _scheduler(budget, slots=4, blocks=64, block_size=4, max_num_seqs=None):
    states = StatePool(CFG, slots, dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))
    kv = KVCache(CFG, blocks, block_size, dtype=torch.float32, device=torch.device("cpu"))
    return Scheduler(states, kv, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs or slots)


def _seq(i, n, new=3):
    return Sequence(f"r{i}", list(range(1, n + 1)), new, 5, i, prompt_logprobs=[None] * (n - 1))


def _advance(sched, pieces, generate=True):
    """What the engine does after a step: count computed tokens, append a token where one is produced."""
    for p in pieces:
        p.seq.num_computed += p.length
        if generate and p.seq.num_computed == len(p.seq.tokens) and len(p.seq.output_ids) < p.seq.max_new_tokens:
            p.seq.output_ids.append(7)
        if p.seq.finished:
            sched.finish(p.seq)


def test_budget_splits_prompts_into_pieces_of_any_length():
    sched = _scheduler(budget=5)
    for i, n in enumerate([7, 3]):
        sched.add(_seq(i, n))
    first = sched.schedule()
    assert [(p.seq.request_id, p.start, p.length) for p in first] == [("r0", 0, 5)]
    _advance(sched, first)
    second = sched.schedule()
    assert [(p.seq.request_id, p.start, p.length, p.is_decode) for p in second] == [
        ("r0", 5, 2, False), ("r1", 0, 3, False)]


def test_decodes_come_first_then_prefill_pieces_share_the_step():
    sched = _scheduler(budget=4)
    sched.add(_seq(0, 2))
    _advance(sched, sched.schedule())                      # r0's prompt done: it now decodes
    sched.add(_seq(1, 9))
    sched.add(_seq(2, 9))
    step = sched.schedule()
    assert [(p.seq.request_id, p.length, p.is_decode) for p in step] == [("r0", 1, True), ("r1", 3, False)]


def test_a_one_token_prompt_piece_is_a_prefill():
    sched = _scheduler(budget=1)
    sched.add(_seq(0, 3))
    pieces = sched.schedule()
    assert pieces[0].length == 1 and not pieces[0].is_decode
    _advance(sched, pieces)
    nxt = sched.schedule()[0]
    assert (nxt.start, nxt.length, nxt.is_decode) == (1, 1, False)


def test_max_num_seqs_and_slots_bound_admission_and_slots_are_reused():
    sched = _scheduler(budget=100, slots=2)
    for i in range(3):
        sched.add(_seq(i, 2, new=1))
    step = sched.schedule()
    assert [p.seq.request_id for p in step] == ["r0", "r1"]
    slots = {p.seq.slot for p in step}
    sched.states.conv[0][list(slots)] = 5.0                # dirty the slots the finished requests leave behind
    _advance(sched, step)                                  # both finish (one new token each)
    third = sched.schedule()
    assert [p.seq.request_id for p in third] == ["r2"] and third[0].seq.slot in slots
    assert torch.equal(sched.states.conv[0][third[0].seq.slot], torch.zeros(CFG.conv_dim, 3)), "slot not reset"


def test_a_reused_slot_starts_with_zero_conv_and_ssm_state_in_every_layer():
    sched = _scheduler(budget=100, slots=1)
    sched.add(_seq(0, 2, new=1))
    sched.add(_seq(1, 2, new=1))
    first = sched.schedule()
    slot = first[0].seq.slot
    for pool in (*sched.states.conv.values(), *sched.states.ssm.values()):
        pool[slot] = 5.0                                   # what the finishing request leaves behind
    _advance(sched, first)
    second = sched.schedule()
    assert [p.seq.request_id for p in second] == ["r1"] and second[0].seq.slot == slot
    for name, pools in (("conv", sched.states.conv), ("ssm", sched.states.ssm)):
        for layer, pool in pools.items():
            assert not pool[slot].any(), f"{name} state of layer {layer}: slot {slot} not reset on reuse"


def test_preemption_frees_the_youngest_and_recomputes_it_later():
    sched = _scheduler(budget=100, blocks=3, block_size=4)    # 12 tokens of K/V for everyone
    sched.add(_seq(0, 4, new=6))
    sched.add(_seq(1, 4, new=6))
    _advance(sched, sched.schedule())                         # both prompts in: one block each, one block free
    _advance(sched, sched.schedule())                         # r0 takes the free block; r1 needs one too: r1 goes
    preempted = list(sched.waiting)
    assert [s.request_id for s in preempted] == ["r1"] and preempted[0].preemptions == 1
    assert preempted[0].num_computed == 0 and preempted[0].slot is None and preempted[0].blocks == []
    assert preempted[0].output_ids == [7], "tokens generated before preemption are kept and recomputed"
    while sched.running:
        _advance(sched, sched.schedule())
    step = sched.schedule()
    assert [(p.seq.request_id, p.start, p.length) for p in step] == [("r1", 0, 5)]


def test_token_span_and_token_at_read_prompt_then_output_at_every_boundary():
    """The engine feeds a piece with token_span (no copy of the whole sequence: a 100K-token prompt in 8192-token
    pieces copied it once per position before): every span and position equals the same slice of `tokens`."""
    seq = _seq(0, 6)
    seq.output_ids += [41, 42, 43]
    whole = seq.tokens
    assert seq.num_tokens == len(whole) == 9
    assert [seq.token_at(p) for p in range(9)] == whole
    for start in range(10):
        for length in range(10 - start):
            assert seq.token_span(start, length) == whole[start:start + length], (start, length)


def _run_scheduler(shapes, *, budget, max_num_seqs, cap, blocks, block_size):
    """Drive the real Scheduler through a whole workload the way LLMEngine.generate does (arrivals before their step,
    idle steps counted); the pieces of each step as (request index, start, stop, decode)."""
    sched = Scheduler(StatePool(CFG, max_num_seqs, dtype=torch.float32, state_dtype=torch.float32,
                                device=torch.device("cpu")),
                      KVCache(CFG, blocks, block_size, dtype=torch.float32, device=torch.device("cpu")),
                      max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, long_prefill_token_threshold=cap)
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i].arrival_step, i))
    pending = list(order)
    steps, clock = [], 0
    while pending or sched.has_work():
        while pending and shapes[pending[0]].arrival_step <= clock:
            i = pending.pop(0)
            sched.add(Sequence(str(i), [1] * shapes[i].prompt_len, shapes[i].max_new_tokens, 5, order.index(i),
                               prompt_logprobs=[None] * (shapes[i].prompt_len - 1)))
        if sched.has_work():
            pieces = sched.schedule()
            steps.append((clock, [(int(p.seq.request_id), p.start, p.start + p.length, p.is_decode) for p in pieces]))
            _advance(sched, pieces)
        clock += 1
    return steps


def _random_workload(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    shapes = [RequestShape(rng.randint(1, 30), rng.randint(1, 5), rng.choice([0, 0, 0, 2, 5]))
              for _ in range(rng.randint(1, 6))]
    longest = max(-(-(s.prompt_len + s.max_new_tokens) // block_size) for s in shapes)
    return shapes, dict(budget=rng.choice([1, 3, 8, 17, 64]), max_num_seqs=rng.randint(1, 4),
                        cap=rng.choice([None, None, 2, 5]), blocks=longest + rng.randint(0, 3), block_size=block_size)


def _plan(shapes, budget, max_num_seqs, cap, blocks, block_size):
    return plan_steps(shapes, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                      long_prefill_token_threshold=cap, num_kv_blocks=blocks, kv_block_size=block_size)


SEEDS = range(60)


@pytest.mark.parametrize("seed", SEEDS)
def test_scheduler_follows_the_reference_plan(seed):
    """harness/schedule.py's plan, from which the scenarios prove their boundary events, is this scheduler's schedule:
    budgets, per-piece caps, max_num_seqs, arrivals and K/V preemption with recomputation, on random workloads."""
    shapes, options = _random_workload(seed)
    expected = [(s.index, [(p.request, p.start, p.stop, p.decode) for p in s.pieces]) for s in _plan(shapes, **options)]
    assert _run_scheduler(shapes, **options) == expected


def test_the_random_workloads_preempt_and_cap():
    """The workloads of the test above do preempt and do cap pieces, or it would prove nothing of either."""
    preempting = capping = 0
    for seed in SEEDS:
        shapes, options = _random_workload(seed)
        plan = _plan(shapes, **options)
        firsts = [p.request for s in plan for p in s.pieces if p.start == 0]
        preempting += len(firsts) > len(set(firsts))                # a request fed from position 0 twice
        capping += any(p.length == options["cap"] for s in plan for p in s.pieces if not p.decode)
    assert preempting >= 5 and capping >= 5, (preempting, capping)
