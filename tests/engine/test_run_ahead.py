"""Decode steps run one step ahead of their results (LLMEngine.step): the engine must return exactly what it returns
when it reads every step back before the next (run_ahead=False), field by field, under arrivals, chunked prefill,
preemption with a token still on the device, mixed top-k and a request that keeps whole rows (which takes the
synchronous path in the middle of run-ahead steps). On the CPU the graph runner runs the same padded step eagerly,
so this checks the bookkeeping (pending ids, the device-fed tokens, outputs one step late) the GPU runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vendored.engine import LLMEngine
from vendored.engine.cudagraph import GRAPH_TOP_K
from vendored.engine.scheduler import PENDING

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"


def _prompt(i: int, n: int) -> list[int]:
    return [(5 * i + 3 * t + 1) % 500 for t in range(n)]


WORKLOADS = {
    # several lengths and generation counts, a late arrival, 3 slots for 4 requests
    "arrivals": (dict(max_num_seqs=3, max_num_batched_tokens=16),
                 [(f"r{i}", _prompt(i, 1 + 7 * i), 3 + i) for i in range(3)], {3: [("late", [1, 2, 3], 4)]}),
    # a K/V cache too small for everyone: sequences preempted while their last token is still on the device
    "preemption": (dict(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=6, block_size=4),
                   [(f"p{i}", _prompt(i, 3 + i), 5) for i in range(4)], {}),
}


def _drive(engine: LLMEngine, requests, arrivals, keep_rows_id: str | None,
           top_k: int | None = None) -> tuple[dict, list[str]]:
    """Step the engine by hand (so the order outputs come back in is seen); the request keep_rows_id ("*": every
    one) keeps whole rows."""
    for request_id, prompt, n in requests:
        engine.add_request(request_id, prompt, n, top_k=top_k or 1 + len(request_id) % 3,
                           keep_rows=keep_rows_id in (request_id, "*"))
    outputs, order = {}, []
    while engine.has_unfinished() or arrivals:
        for request_id, prompt, n in arrivals.pop(engine.steps, []):
            engine.add_request(request_id, prompt, n, top_k=top_k or 2, keep_rows=keep_rows_id == "*")
        if not engine.has_unfinished():
            engine.steps += 1
            continue
        for out in engine.step():
            assert out.request_id not in outputs, f"{out.request_id} returned twice"
            assert PENDING not in out.output_ids
            outputs[out.request_id] = out
            order.append(out.request_id)
    return outputs, order


CASES = [("arrivals", None), ("arrivals", "r1"), ("preemption", "p2")]


# On the CPU the first case runs in make test; the two others (~30 s each under the interpreter) under `slow` (in CI's
# share of it), and all three on CUDA in make test-gpu.
CPU_CASES = [pytest.param(*case, marks=[pytest.mark.slow] if case[1] else []) for case in CASES]


@pytest.mark.parametrize("name, keep_rows_id", CPU_CASES)
def test_run_ahead_returns_what_the_synchronous_engine_returns(name, keep_rows_id, monkeypatch):
    _compare(name, keep_rows_id, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, keep_rows_id", CASES)
def test_run_ahead_on_the_gpu_returns_what_the_synchronous_engine_returns(name, keep_rows_id, dtype, monkeypatch):
    """The same on CUDA graphs: pinned staging and result buffers, events, tokens fed on the device."""
    _compare(name, keep_rows_id, monkeypatch, "cuda", dtype)


def _compare(name, keep_rows_id, monkeypatch, device, dtype="float32"):
    options, requests, arrivals = WORKLOADS[name]
    launched = []
    original = LLMEngine._launch_decode

    def counted(self, pieces):
        launched.append(any(p.seq.token_at(p.start) == PENDING for p in pieces))     # a token fed on the device
        return original(self, pieces)

    monkeypatch.setattr(LLMEngine, "_launch_decode", counted)
    results = {}
    for run_ahead in (False, True):
        engine = LLMEngine(TINY, cuda_graphs=True, run_ahead=run_ahead, device=device, dtype=dtype, **options)
        outputs, order = _drive(engine, requests, dict(arrivals), keep_rows_id)
        results[run_ahead] = (outputs, set(order), engine.steps, dict(engine.graphs.launches),
                              engine.total_preemptions)
        engine.close()
    assert any(launched), "no step fed a token still on the device: this checked nothing"
    sync, ahead = results[False], results[True]
    assert ahead[1:] == sync[1:], "requests, steps, graph launches or preemptions differ"
    if name == "preemption":
        assert sync[4] > 0, "the workload preempted nothing"
    for request_id, want in sync[0].items():
        got = ahead[0][request_id]
        for field in ("output_ids", "output_logprobs", "output_top", "prompt_logprobs", "prompt_top", "preemptions"):
            assert getattr(got, field) == getattr(want, field), f"{request_id}: {field}"
        assert (got.rows is None) == (want.rows is None)
        if want.rows is not None:
            assert got.rows.equal(want.rows)


def _check_ranked_in_the_graph_as_from_the_rows(device, dtype, top_k=None):
    """Outputs of graph steps ranked inside the graph (and run ahead) against the same steps ranked by _record from
    the logits (every request keeping its rows takes that path): the same tokens, logprobs and top-k. top_k: every
    request's, else 1-3 by request."""
    options, requests, arrivals = WORKLOADS["arrivals"]
    got = {}
    for keep in (False, True):
        engine = LLMEngine(TINY, cuda_graphs=True, device=device, dtype=dtype, **options)
        outputs, _ = _drive(engine, [(f"{r}", p, n) for r, p, n in requests], dict(arrivals),
                            keep_rows_id="*" if keep else None, top_k=top_k)
        got[keep] = outputs
        engine.close()
    for request_id, want in got[True].items():
        if top_k is not None:
            assert {len(top) for top in got[False][request_id].output_top} == {top_k}, f"{request_id}: top-k width"
        for field in ("output_ids", "output_logprobs", "output_top", "prompt_logprobs"):
            assert getattr(got[False][request_id], field) == getattr(want, field), f"{request_id}: {field}"


def test_ranked_in_the_graph_as_from_the_rows():
    _check_ranked_in_the_graph_as_from_the_rows("cpu", "float32")


def test_a_top_k_wider_than_the_graph_ranks_again_from_the_logits():
    """More than GRAPH_TOP_K asked: a step run ahead ranks its logits again outside the graph."""
    _check_ranked_in_the_graph_as_from_the_rows("cpu", "float32", top_k=GRAPH_TOP_K + 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ranked_in_the_graph_as_from_the_rows_on_the_gpu(dtype):
    _check_ranked_in_the_graph_as_from_the_rows("cuda", dtype)


def test_a_request_finished_ahead_comes_back_with_the_next_step():
    engine = LLMEngine(TINY, cuda_graphs=True, max_num_seqs=2, max_num_batched_tokens=16)
    engine.add_request("short", [1, 2, 3], 2)
    engine.add_request("long", [4, 5, 6], 6)
    returned = {}
    while engine.has_unfinished():
        for out in engine.step():
            returned[out.request_id] = engine.steps
    # short's last token is chosen in step 2 (prefill chose the first), which ran ahead: it comes back with step 3;
    # long ends the work, and its last step is read back at once
    assert returned == {"short": 3, "long": 6}
    assert engine._ahead is None


def test_closing_with_a_step_in_flight():
    engine = LLMEngine(TINY, cuda_graphs=True, max_num_seqs=2, max_num_batched_tokens=16)
    engine.add_request("a", [1, 2, 3], 5)
    for _ in range(3):
        engine.step()
    assert engine._ahead is not None
    engine.close()
    assert engine._ahead is None
