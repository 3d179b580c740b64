"""llama.cpp (harness/adapters/llamacpp.py) through every scenario it can honour, judged against the fp64 oracle of the
model it computes (conftest.py): the bundled tiny models in f32 (every common scenario and llama.cpp's own: threads,
flash attention, K/V cache type, n_ubatch splits, sequence state save and restore) and f16, and the config-zoo
entries it runs through a scenario of each boundary kind. Flash attention on an f32 model is a finding
(flash-attention-f16): that case must fail, as a strict expected failure. Two invariances are checked bit for bit:
the thread count, and saving and restoring every sequence's state after every step."""

from __future__ import annotations

import pytest
import torch

from harness.adapters.llamacpp import LlamaCppEngine
from harness.engine import EngineOptions
from harness import zoo
from harness.llamacpp_cases import FINDINGS, FIXTURES
from harness.runner import ScenarioSkipped, check_scenario
from harness.scenarios import build_scenarios, select_scenarios
from reference.config import ModelConfig

from .conftest import TINY_MODELS, ZOO_MODELS

# A scenario whose f32 run is a finding: (scenario id, dtype) -> finding id.
FINDING_CASES = {("flash_attn-on", "float32"): "flash-attention-f16"}
# The f16 GGUF: the scenarios that change llama.cpp's numerics or its batch layout.
F16_SCENARIOS = ("batching-together", "chunked_prefill-budget17-Q16", "preemption-blocks7x8-Q16", "flash_attn-on",
                 "kv_cache-f16", "ubatch15-batch50-Q16", "state_restore-budget17-Q16")


def _scenarios(cfg: ModelConfig, spec: str = "all"):
    return select_scenarios(build_scenarios(cfg, LlamaCppEngine), spec)


def _zoo_spec(cfg: ModelConfig) -> str:
    """A scenario of each boundary kind llama.cpp can honour, at this entry's chunk size."""
    Q = cfg.mamba_chunk_size
    return ",".join(["batching-together", f"chunked_prefill-budget1-Q{Q}", f"chunked_prefill-budget{Q + 1}-Q{Q}",
                     f"preemption-blocks7x{-(-Q // 2)}-Q{Q}", f"state_restore-budget{Q + 1}-Q{Q}",
                     f"ubatch{Q - 1}-batch{3 * Q + 2}-Q{Q}"])


def _cases():
    out = []
    for name in TINY_MODELS:
        cfg = ModelConfig.from_json(FIXTURES / name)
        for scenario in _scenarios(cfg):
            out.append(pytest.param(name, scenario.id, "float32", id=f"{name}-{scenario.id}-f32"))
        for sid in F16_SCENARIOS:
            out.append(pytest.param(name, sid, "float16", id=f"{name}-{sid}-f16"))
    for name in ZOO_MODELS:
        for scenario in _scenarios(zoo.model_config(name), _zoo_spec(zoo.model_config(name))):
            out.append(pytest.param(name, scenario.id, "float32", id=f"zoo-{name}-{scenario.id}-f32"))
    return out


def _judge(model, scenario_id: str, dtype: str):
    scenario = {s.id: s for s in build_scenarios(model.cfg, LlamaCppEngine)}[scenario_id]
    try:
        return check_scenario(LlamaCppEngine, scenario, oracle=model.oracle, source=model.source, dtype=dtype,
                              engine_args=model.engine_args, candidate_checkpoint=model.checkpoint)
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))


@pytest.mark.parametrize("name,scenario_id,dtype", _cases())
def test_llamacpp_matches_oracle(name, scenario_id, dtype, llamacpp_model):
    report = _judge(llamacpp_model(name), scenario_id, dtype)
    assert sum(len(c.positions) for c in report.comparisons) > 0
    finding = FINDING_CASES.get((scenario_id, dtype))
    if finding is not None:
        assert not report.passed, f"{name} {scenario_id} {dtype} passed: finding {finding} no longer reproduces"
        assert report.max_delta > 5 * report.meta["budget"]
        pytest.xfail(f"finding {finding}: {FINDINGS[finding].measured}; here max |Δ| {report.max_delta:.3g} "
                     f"against {report.meta['budget']:.3g}")
    assert report.passed, report.message()


def _logprobs(model, requests, **engine_args) -> list[torch.Tensor]:
    options = EngineOptions(**{k: v for k, v in engine_args.items() if k == "max_num_batched_tokens"},
                            engine_args={**model.engine_args,
                                         **{k: v for k, v in engine_args.items() if k != "max_num_batched_tokens"}})
    with LlamaCppEngine(model.checkpoint, options=options) as engine:
        return [torch.cat([r.prompt_logprobs, r.output_logprobs]) for r in engine.run(requests)]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_thread_count_changes_no_bit(name, llamacpp_model):
    model = llamacpp_model(name)
    requests = next(s for s in build_scenarios(model.cfg) if s.id == "batching-together").requests(model.source)
    one, two = _logprobs(model, requests, threads="1"), _logprobs(model, requests, threads="2")
    for request, a, b in zip(requests, one, two):
        assert torch.equal(a, b), f"{request.request_id}: threads 1 and 2 differ by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_state_save_and_restore_changes_no_bit(name, llamacpp_model):
    """Chunked prefill at Q+1 with every unfinished sequence saved, removed and restored after every step gives the
    same bits as without: llama_state_seq_* carries the whole state (conv window, SSM state, K/V)."""
    model = llamacpp_model(name)
    Q = model.cfg.mamba_chunk_size
    requests = next(s for s in build_scenarios(model.cfg) if s.id == f"chunked_prefill-budget{Q + 1}-Q{Q}") \
        .requests(model.source)
    plain = _logprobs(model, requests, max_num_batched_tokens=Q + 1)
    restored = _logprobs(model, requests, max_num_batched_tokens=Q + 1, state_roundtrip="1")
    for request, a, b in zip(requests, plain, restored):
        assert torch.equal(a, b), f"{request.request_id}: restored state differs by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("scenario_id", ["batching-together", "chunked_prefill-budget17-Q16"])
def test_llamacpp_matches_the_vendored_engine(scenario_id, llamacpp_model):
    """--against: llama.cpp judged directly against the vendored engine (Triton, interpreted on the CPU), each side's
    budget added (harness/runner.py check_against)."""
    from harness.runner import check_against

    model = llamacpp_model("tiny-granite")
    scenario = {s.id: s for s in build_scenarios(model.cfg)}[scenario_id]
    report = check_against(LlamaCppEngine, scenario, against="vendored", oracle=model.oracle, source=model.source,
                           engine_args=model.engine_args)
    assert report.meta["baseline"] == "vendored float32"
    assert sum(len(c.positions) for c in report.comparisons) > 0
    assert report.passed, report.message()


def test_the_report_records_what_llamacpp_ran(llamacpp_model):
    model = llamacpp_model("tiny-granite")
    seen = _judge(model, "batching-together", "float32").meta["engine_provenance"]
    assert seen["llama_cpp_python"] == "0.3.36" and len(seen["llama_cpp_commit"]) >= 7
    assert seen["pre_tokenizer_workaround"] == "gpt-2" and seen["outtype"] == "f32"
    assert seen["gguf"].endswith(".gguf") and seen["flash_attn"] == "off"
