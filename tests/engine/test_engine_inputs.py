"""LLMEngine refuses what it would otherwise get silently wrong: two requests sharing an id (outputs are matched to
requests by id, so both got the output of whichever finished last) and token ids that are not integers (int()
truncated 3.7 to 3 and read True as 1). Every error names the request, and the position where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import random_bamba_checkpoint
from vendored.engine import EngineError, LLMEngine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("inputs"), seed=5)


@pytest.fixture
def engine(checkpoint):
    return LLMEngine(checkpoint, max_model_len=32, max_num_seqs=4)


def test_generate_refuses_two_requests_with_one_id_before_running_anything(engine):
    with pytest.raises(EngineError, match=r"request a: duplicate request id \(requests\[0\] and requests\[2\]\)"):
        engine.generate([("a", [1, 2, 3], 2), ("b", [4, 5], 1), ("a", [6, 7, 8, 9], 2)])
    assert not engine.has_unfinished() and engine.steps == 0


def test_generate_refuses_an_arrival_that_reuses_an_id(engine):
    with pytest.raises(EngineError, match=r"request b: duplicate request id \(requests\[1\] and arrivals\[2\]\[0\]\)"):
        engine.generate([("a", [1, 2, 3], 2), ("b", [4, 5], 1)], arrivals={2: [("b", [6, 7], 1)]})
    assert not engine.has_unfinished()


def test_add_request_refuses_an_id_in_flight_and_accepts_it_once_finished(engine):
    engine.add_request("a", [1, 2, 3], 1)
    in_flight = "request a: duplicate request id, a request with this id is already in flight"
    with pytest.raises(EngineError, match=in_flight):
        engine.add_request("a", [4, 5], 1)
    with pytest.raises(EngineError, match=in_flight):
        engine.generate([("b", [1], 1), ("a", [4, 5], 1)])
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [out.request_id for out in finished] == ["a"]
    (again,) = engine.generate([("a", [4, 5], 1)])           # a finished id may be used again
    assert again.request_id == "a" and len(again.prompt_logprobs) == 1


@pytest.mark.parametrize("token", [3.0, 3.7, True, np.float32(3), np.bool_(True), torch.tensor(2.0),
                                   torch.tensor(True), "3", None],
                         ids=["float", "fraction", "bool", "numpy-float", "numpy-bool", "tensor-float",
                              "tensor-bool", "str", "none"])
def test_a_token_id_that_is_no_integer_is_named_with_its_request_and_position(engine, token):
    with pytest.raises(EngineError, match=rf"request q: token id .* at position 2 is a {type(token).__name__}, "
                                          "expected an integer"):
        engine.add_request("q", [1, 2, token, 4], 1)
    with pytest.raises(EngineError, match="request q: token id .* at position 2"):
        engine.generate([("p", [5, 6], 1), ("q", [1, 2, token, 4], 1)])
    assert not engine.has_unfinished(), "a refused generate call queued its valid requests"


def test_integral_numpy_and_tensor_token_ids_are_accepted(engine):
    prompt = [np.int64(1), np.int32(2), np.uint8(3), torch.tensor(4), 5]
    engine.add_request("n", prompt, 0)
    (seq,) = engine.scheduler.waiting
    assert seq.prompt == [1, 2, 3, 4, 5] and all(type(t) is int for t in seq.prompt)


def test_a_checkpoint_of_another_family_is_refused_by_name(tmp_path):
    """The engine serves Bamba and GraniteMoeHybrid: any other model_type is an error naming it, before any weight
    is read (here a Granite zoo model relabelled)."""
    import json

    from harness import zoo

    path = zoo.write_checkpoint("granite-moe4-top2", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "granitemoe"}))
    with pytest.raises(EngineError, match="model_type 'granitemoe': this engine serves Bamba"):
        LLMEngine(path, max_model_len=32)


def test_close_lets_go_of_the_weights_even_while_a_cycle_holds_the_engine(checkpoint):
    """The harness wraps an engine's step in a closure that refers back to the engine (a reference cycle): the
    weights, caches and states must not wait for the garbage collector, or each scenario run leaves an engine's
    device memory behind (seen on a GPU: 60 GB held by one process of the scale runs)."""
    import gc
    import weakref

    engine = LLMEngine(checkpoint, max_model_len=32, max_num_seqs=2)
    engine.generate([("a", [1, 2, 3], 1)])
    step = engine.step
    engine.step = lambda: step()                    # the cycle: engine -> closure -> bound method -> engine
    held = [weakref.ref(x) for x in (engine.model, engine.kv, engine.states)]
    gc.disable()
    try:
        engine.close()
        assert all(ref() is None for ref in held), "close() left the weights, K/V cache or states alive"
    finally:
        gc.enable()
    assert not engine.has_unfinished()
    with pytest.raises(EngineError, match="this engine is closed"):
        engine.generate([("b", [1, 2], 1)])
    with pytest.raises(EngineError, match="this engine is closed"):
        LLMEngine.step(engine)
