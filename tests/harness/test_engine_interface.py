"""The engine interface: input checks, unsupported options, the registry, and the adapters' agreement with the
oracle's own API."""

from __future__ import annotations

import re

import pytest
import torch

from harness import adapters, zoo
from harness.adapters import EngineUnavailable, UnknownEngine, available_engines, get_engine
from harness.engine import EngineInputError, EngineOptions, Request, UnsupportedOptions, check_requests, parse_dtype
from reference.model import BambaReference

from .conftest import G1_MODEL

ENGINES = ["reference", "transformers"]


@pytest.mark.parametrize("request_, message", [
    (Request("empty", ()), "request 'empty': empty prompt"),
    (Request("oov", (1, 2, 97)), "request 'oov': token id 97 at position 2 is outside the vocabulary \\[0, 97\\)"),
    (Request("neg", (-1,)), "request 'neg': token id -1 at position 0"),
    (Request("long", (1,) * 500, max_new_tokens=14), "request 'long': position 512 .* exceeds max_position_embeddings"),
], ids=["empty", "out-of-vocabulary", "negative", "too-long"])
def test_bad_requests_are_named(request_, message):
    with pytest.raises(EngineInputError, match=message):
        check_requests([Request("fine", (1, 2)), request_], G1_MODEL, allow_long_context=False)


def test_long_requests_pass_with_the_opt_in():
    check_requests([Request("long", (1,) * 600, 4)], G1_MODEL, allow_long_context=True)


def test_duplicate_request_ids_are_refused():
    with pytest.raises(EngineInputError, match="request 'a': duplicate request_id"):
        check_requests([Request("a", (1,)), Request("a", (2,))], G1_MODEL, allow_long_context=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_engines_check_their_input(engine, g1_checkpoint):
    with get_engine(engine)(g1_checkpoint) as instance:
        with pytest.raises(EngineInputError, match="request 'bad': token id 500 at position 1"):
            instance.run([Request("bad", (3, 500, 4), 2)])


@pytest.mark.parametrize("engine,options,reason", [
    ("transformers", EngineOptions(max_num_batched_tokens=7), "no chunked prefill"),
    ("transformers", EngineOptions(ssm_state_dtype="bfloat16"), "keeps the SSM state in its own dtype"),
    ("reference", EngineOptions(tensor_parallel_size=2), "the reference runs on one device"),
    ("reference", EngineOptions(cuda_graphs=True), "no graph capture"),
    ("reference", EngineOptions(engine_args={"gated_norm": "diagonal"}), "gated_norm: expected"),
    ("transformers", EngineOptions(engine_args={"gated_norm": "full"}), r"engine_args \['gated_norm'\]: unknown"),
], ids=["tf-budget", "tf-ssm-dtype", "ref-tp", "ref-cudagraph", "ref-bad-norm", "tf-unknown-arg"])
def test_unhonoured_options_are_refused_with_the_reason(engine, options, reason, g1_checkpoint):
    cls = get_engine(engine)
    assert any(re.search(reason, r) for r in cls.unsupported(options, dtype=torch.float32, device="cpu"))
    with pytest.raises(UnsupportedOptions, match=reason):
        cls(g1_checkpoint, options=options)


def test_staggered_arrivals_need_a_scheduler(g1_checkpoint):
    with get_engine("transformers")(g1_checkpoint) as engine:
        with pytest.raises(UnsupportedOptions, match="no scheduler steps"):
            engine.run([Request("late", (1, 2), 1, arrival_step=3)])


def test_a_wider_ssm_state_runs_the_references_scan_in_it(tmp_path):
    """ssm_state_dtype float32 under bfloat16: the reference keeps its SSM state in float32 (the recurrence computes
    in it, as engines run a 16-bit model): the state it carries holds values no bfloat16 can, and the logprobs differ
    from the all-bfloat16 reference's (a zoo model: half its heads decay slowly, so the state carries the prompt)."""
    checkpoint = zoo.write_checkpoint("attention-last-2-layers", tmp_path / "model")
    prompt = tuple(int(t) for t in torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(1)))
    request = Request("long", prompt, 4)
    logprobs = {}
    for state in (None, "float32"):
        options = EngineOptions(ssm_state_dtype=state)
        assert not get_engine("reference").unsupported(options, dtype=torch.bfloat16, device="cpu")
        with get_engine("reference")(checkpoint, dtype=torch.bfloat16, options=options) as engine:
            model = engine.model
            assert model.scan_dtype == (torch.bfloat16 if state is None else torch.float32)
            _, carried = model.forward(torch.tensor(prompt))
            ssm = carried.ssm[0]
            assert ssm.dtype == model.scan_dtype
            if state is not None:
                assert not torch.equal(ssm, ssm.to(torch.bfloat16).to(ssm.dtype)), "the state was rounded to bf16"
            logprobs[state] = engine.run([request])[0].prompt_logprobs
    assert not torch.equal(logprobs[None], logprobs["float32"])


def test_options_are_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens: expected a positive integer"):
        EngineOptions(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        EngineOptions(ssm_state_dtype="float8")
    assert parse_dtype("bf16") is torch.bfloat16


def test_registry_names_unknown_and_unavailable_engines(monkeypatch):
    with pytest.raises(UnknownEngine, match="unknown engine 'nope'"):
        get_engine("nope")
    monkeypatch.setitem(adapters._ADAPTERS, "ghost", ("harness.adapters.ghost", "GhostEngine"))
    assert "harness/adapters/ghost.py does not exist" in available_engines()["ghost"]
    with pytest.raises(EngineUnavailable, match="engine 'ghost' is unavailable"):
        get_engine("ghost")
    assert available_engines()["reference"] is None


@pytest.mark.parametrize("engine", ENGINES)
def test_context_manager_frees_the_model(engine, g1_checkpoint):
    with get_engine(engine)(g1_checkpoint) as instance:
        assert instance.model is not None
    assert instance.model is None


def test_reference_adapter_agrees_with_the_oracle_api(g1_checkpoint, g1_prompts):
    model = BambaReference.from_pretrained(g1_checkpoint)
    prompts = [g1_prompts.tokens(n, i) for i, n in enumerate((1, 9, 20))]
    requests = [Request(f"r{i}", p, 5, full_distributions=True) for i, p in enumerate(prompts)]
    with get_engine("reference")(g1_checkpoint, options=EngineOptions(max_num_batched_tokens=6)) as engine:
        results = engine.run(requests)
    for prompt, result in zip(prompts, results):
        tokens, steps = model.greedy(prompt, 5)
        assert result.output_ids == tokens
        torch.testing.assert_close(result.output_dists, steps.double(), rtol=0, atol=1e-12)
        torch.testing.assert_close(result.prompt_logprobs, model.prompt_logprobs(prompt), rtol=0, atol=1e-12)
