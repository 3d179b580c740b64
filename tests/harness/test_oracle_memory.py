"""The oracle on a GPU too small for all its reference models at once (a 9.8B model: 78 GB in fp64 beside its bf16
twins and the candidate on one 141 GB H200): before loading another, it closes the ones it holds when the free
memory would not hold the new one, and keeps every result and error it computed. The GPU is simulated (the free
memory is what the test says); the decision and what survives it are what is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import runner
from harness.engine import Request
from harness.runner import CANDIDATE_ROOM_FACTOR, ROOM_FACTOR, Oracle
from reference.checkpoint import parameter_count, read_safetensors

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"
REQUESTS = [Request("a", (1, 5, 9, 2, 7), 3), Request("b", (4, 4, 8), 2)]


def test_parameter_count_reads_the_headers():
    assert parameter_count(TINY) == sum(t.numel() for t in read_safetensors(TINY).values())


def test_models_are_closed_only_when_the_next_would_not_fit(monkeypatch):
    oracle = Oracle(TINY)
    free = {"bytes": 0}
    monkeypatch.setattr(runner, "_on_gpu", lambda device: True)
    monkeypatch.setattr(runner, "_free_memory", lambda device: free["bytes"])
    runs = []
    original = runner.ReferenceEngine.run

    def counted(self, requests):
        runs.append(self.dtype)
        return original(self, requests)

    monkeypatch.setattr(runner.ReferenceEngine, "run", counted)
    baseline = oracle.results(REQUESTS)                                  # the fp64 model
    fp32_need = ROOM_FACTOR * parameter_count(TINY) * 4
    free["bytes"] = fp32_need                                           # room: the fp64 model stays
    budget = oracle.budget(REQUESTS, torch.float32)
    assert set(oracle._engines) == {(torch.float64, None), (torch.float32, None)}
    free["bytes"] = fp32_need - 1                                       # no room for a bf16-state twin... of fp32
    oracle.engine(torch.float32, "bfloat16")
    assert set(oracle._engines) == {(torch.float32, "bfloat16")}, "the others were to be closed"
    # what they computed is still there: asking again runs nothing
    n = len(runs)
    assert [r.prompt_logprobs.tolist() for r in oracle.results(REQUESTS)] == \
        [r.prompt_logprobs.tolist() for r in baseline]
    assert oracle.budget(REQUESTS, torch.float32).reference_error == budget.reference_error
    assert len(runs) == n
    oracle.close()


def test_on_the_cpu_nothing_is_closed(monkeypatch):
    monkeypatch.setattr(runner, "_free_memory", lambda device: 0)
    oracle = Oracle(TINY)
    oracle.engine()
    oracle.engine(torch.float32)
    assert len(oracle._engines) == 2
    oracle.close()


def test_the_reference_engine_holds_no_rows_past_their_step(monkeypatch):
    """Each step's log-softmax rows (a megabyte a position at a 128K vocabulary in fp64) are reduced to what the
    results keep during the step that computed them: when the next step starts, none of them is alive. Before, the
    oracle kept every row of every request until the end of a run (tens of GB on a GPU at real width)."""
    import weakref

    from harness.adapters import reference
    from harness.engine import EngineOptions

    alive: list[weakref.ref] = []
    original_log_softmax, original_step = reference.log_softmax, reference.ReferenceEngine.forward_step

    def tracked(logits):
        rows = original_log_softmax(logits)
        alive.append(weakref.ref(rows))
        return rows

    def step(self, *args, **kwargs):
        held = [r for r in alive if r() is not None]
        assert not held, f"{len(held)} log-softmax tensors of earlier steps still alive"
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(reference, "log_softmax", tracked)
    monkeypatch.setattr(reference.ReferenceEngine, "forward_step", step)
    requests = [Request("a", tuple(range(1, 12)), 4), Request("b", (4, 4, 8), 3, full_distributions=True)]
    with reference.ReferenceEngine(TINY, options=EngineOptions(max_num_batched_tokens=4)) as engine:
        stepped = engine.run(requests)
    assert len(alive) > 4, "the run was meant to take several steps"
    whole = Oracle(TINY).results(requests)                       # one step per request: rows reduced together
    for a, b in zip(stepped, whole):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.sequence_logprobs(), b.sequence_logprobs(), rtol=0, atol=1e-12)
        assert torch.equal(a.prompt_top_ids, b.prompt_top_ids) and torch.equal(a.output_top_ids, b.output_top_ids)
    assert stepped[0].prompt_dists is None and stepped[1].prompt_dists.shape == (2, stepped[1].prompt_dists.shape[1])


def test_the_oracle_lists_the_most_likely_tokens_of_each_generated_position():
    """Beside its top-k, the oracle keeps the NEAR_TIE_K most likely tokens of every generated position (the judge
    looks up there its logprob of a candidate's different greedy token): exactly the leading entries of the full
    rows, ranked as top-k ranks them, for a request split over several steps (a preempted, recomputed one too)."""
    from harness.engine import EngineOptions

    requests = [Request("a", (1, 5, 9, 2, 7, 3), 4, top_k=2), Request("b", (4, 4, 8), 3, top_k=2)]
    oracle = Oracle(TINY)
    near = oracle.results(requests)
    full = oracle.results([Request(r.request_id, r.prompt, r.max_new_tokens, 2, 0, True) for r in requests])
    chunked = runner.ReferenceEngine(TINY, options=EngineOptions(max_num_batched_tokens=2, num_kv_blocks=4,
                                                                 kv_block_size=4))
    chunked.near_k = runner.NEAR_TIE_K
    for n, f, c in zip(near, full, chunked.run(requests)):
        k = min(runner.NEAR_TIE_K, f.output_dists.shape[1])
        assert n.output_near_ids.shape == (len(n.output_ids), k)
        values, ids = f.output_dists.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(n.output_near_ids, ids[:, :k]) and torch.equal(n.output_near_logprobs, values[:, :k])
        assert torch.equal(c.output_near_ids, n.output_near_ids)
        torch.testing.assert_close(c.output_near_logprobs, n.output_near_logprobs, rtol=0, atol=1e-12)
    assert oracle.engine(torch.float32).near_k == 0              # the references in other dtypes need none
    oracle.close()


def test_the_candidate_gets_room_before_it_loads(monkeypatch):
    """At 9.8B the fp64 oracle and its two bf16 twins leave a bf16 candidate 2 GB on an H200 for its activations
    (the 32-layer compare ran out of memory there): before the candidate runs, the reference models are closed
    when twice its weights would not fit (its caches and logits come on top); with room, they stay (no reload in the
    next scenario)."""
    from harness.scenarios import PromptSource, build_scenarios
    from reference.config import ModelConfig

    scenario = next(s for s in build_scenarios(ModelConfig.from_json(TINY)) if s.id == "batching-together")
    monkeypatch.setattr(runner, "_on_gpu", lambda device: True)
    candidate_need = parameter_count(TINY) * 4
    for free, kept in ((CANDIDATE_ROOM_FACTOR * candidate_need - 1, False), (CANDIDATE_ROOM_FACTOR * candidate_need, True)):
        seen = {}
        original = runner.ReferenceEngine.run

        def watched(self, requests, original=original, seen=seen):  # the candidate: the "reference" engine in fp32
            if self.dtype == torch.float32 and self.options.max_num_batched_tokens is None:
                seen["references held"] = set(oracle._engines)
            return original(self, requests)

        monkeypatch.setattr(runner.ReferenceEngine, "run", watched)
        monkeypatch.setattr(runner, "_free_memory", lambda device: 1e15)
        oracle = Oracle(TINY)
        requests = scenario.requests(PromptSource(512, seed=0))
        oracle.budget(requests, torch.float32)                  # the fp64 oracle and its fp32 twin loaded
        monkeypatch.setattr(runner, "_free_memory", lambda device, free=free: free)
        report = runner.check_scenario("reference", scenario, oracle=oracle, source=PromptSource(512, seed=0))
        assert report.passed, report.message()
        assert bool(seen["references held"]) == kept, seen
        oracle.close()


def _batching_together():
    from harness.scenarios import build_scenarios
    from reference.config import ModelConfig

    return next(s for s in build_scenarios(ModelConfig.from_json(TINY)) if s.id == "batching-together")


def _oom_once(monkeypatch, oracle, seen):
    """The candidate (the reference engine in fp32 under the scenario's options) runs out of GPU memory the first
    time; `seen` records which reference models the oracle held at each of its runs."""
    original = runner.ReferenceEngine.run

    def flaky(self, requests):
        if self.dtype == torch.float32 and self.options.max_num_batched_tokens is None:
            seen.append(set(oracle._engines))
            if len(seen) == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 378.00 MiB")
        return original(self, requests)

    monkeypatch.setattr(runner.ReferenceEngine, "run", flaky)


def test_a_candidate_out_of_memory_beside_the_references_runs_again_without_them(monkeypatch):
    """The 32-layer compare: the candidate ran out of memory with room for twice its weights (its states and logits
    took more). The references held are the harness's, not the engine's fault: closed, the candidate runs again."""
    from harness.scenarios import PromptSource

    scenario = _batching_together()
    monkeypatch.setattr(runner, "_on_gpu", lambda device: True)
    monkeypatch.setattr(runner, "_free_memory", lambda device: 1e15)           # room by the estimate
    oracle, seen = Oracle(TINY), []
    _oom_once(monkeypatch, oracle, seen)
    report = runner.check_scenario("reference", scenario, oracle=oracle, source=PromptSource(512, seed=0))
    assert report.passed, report.message()
    assert len(seen) >= 2 and seen[0] and not seen[1], seen     # held at the first run, none at the second
    oracle.close()


def test_a_candidate_out_of_memory_with_nothing_to_free_is_its_own_error(monkeypatch):
    """With no reference model on the GPU (the oracle from a cache, or on the CPU) there is nothing to free: the
    engine's out-of-memory error is the scenario's, not retried."""
    from harness.scenarios import PromptSource

    scenario = _batching_together()
    oracle, seen = Oracle(TINY), []
    runner.check_scenario("reference", scenario, oracle=oracle, source=PromptSource(512, seed=0))
    oracle.close()                                  # results memoised, no model held
    _oom_once(monkeypatch, oracle, seen)
    monkeypatch.setattr(runner, "_on_gpu", lambda device: True)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        runner.check_scenario("reference", scenario, oracle=oracle, source=PromptSource(512, seed=0))
    assert seen == [set()]
