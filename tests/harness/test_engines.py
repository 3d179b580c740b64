"""Every selected engine (--engine, default: every available one) × every scenario, judged against the fp64 oracle
on a random checkpoint of each family (Bamba with G = 1, GraniteMoeHybrid with four experts, top-2): fp32 on the
CPU, bf16 on CUDA. Test ids are "<model>-<engine>-<scenario>", so `pytest -k chunked_prefill`, `-k granite` or
`-k bamba-g1-transformers-batching` select exactly those cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import zoo
from harness.engine import EngineOptions
from harness.pytest_plugin import parametrize_cases
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import PromptSource, build_scenarios
from reference.config import ModelConfig

from .conftest import G1_MODEL


GRANITE = "granite-moe4-top2"
MODELS = {"bamba-g1": G1_MODEL, GRANITE: zoo.model_config(GRANITE)}


def pytest_generate_tests(metafunc):
    parametrize_cases(metafunc, MODELS)


@pytest.fixture(scope="session")
def granite_checkpoint(tmp_path_factory):
    return zoo.write_checkpoint(GRANITE, tmp_path_factory.mktemp(GRANITE))


@pytest.fixture(scope="session")
def granite_oracles(granite_checkpoint):
    """The Granite checkpoint's oracle per device, opened on first use and closed at the end of the session."""
    oracles: dict[str, Oracle] = {}

    def on(device: str) -> Oracle:
        if device not in oracles:
            oracles[device] = Oracle(granite_checkpoint, device=device)
        return oracles[device]

    yield on
    for oracle in oracles.values():
        oracle.close()


@pytest.fixture
def oracle_and_prompts(request, model_name):
    """The model's oracle (on CUDA for the bf16 test) and prompts."""
    cuda = request.function.__name__.endswith("_cuda")
    if model_name == GRANITE:
        return request.getfixturevalue("granite_oracles")("cuda" if cuda else "cpu"), zoo.prompt_source(GRANITE)
    return request.getfixturevalue("g1_cuda_oracle" if cuda else "g1_oracle"), request.getfixturevalue("g1_prompts")


def _check(case, oracle, prompts, dtype, device):
    engine, scenario = case
    try:
        report = check_scenario(engine, scenario, oracle=oracle, source=prompts, dtype=dtype, device=device)
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))
    assert report.passed, report.message()
    assert report.comparisons and all(c.positions for c in report.comparisons)


def test_matches_oracle_fp32_cpu(case, oracle_and_prompts):
    _check(case, *oracle_and_prompts, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_matches_oracle_bf16_cuda(case, oracle_and_prompts):
    _check(case, *oracle_and_prompts, torch.bfloat16, "cuda")


# ---- transformers with G > 1: a numerics finding, not a tolerance -------------------------------------------

def _batching_together(checkpoint, gated_norm: str):
    cfg = ModelConfig.from_json(checkpoint)
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    oracle = Oracle(checkpoint, gated_norm=gated_norm)
    try:
        return check_scenario("transformers", scenario, oracle=oracle, source=PromptSource(cfg.vocab_size),
                              dtype=torch.float32)
    finally:
        oracle.close()


@pytest.mark.xfail(strict=True, reason=(
    "transformers' gated RMSNorm normalises over all H·P channels; Bamba (the oracle, mamba_ssm, vLLM) per group of "
    "H·P/G. Measured on TINY_CONFIG (G = 2, seed 0), fp32 CPU, batching-together: max |Δ logprob| 9.1 against a "
    "budget of 2.0e-05, top-1 agreement 44%, 88 failing positions. Fails for as long as transformers computes the "
    "full-width norm."))
def test_transformers_matches_the_grouped_oracle_with_two_groups(g2_checkpoint):
    report = _batching_together(g2_checkpoint, "grouped")
    assert report.passed, report.message()


def test_transformers_matches_a_full_width_norm_oracle_with_two_groups(g2_checkpoint):
    """The norm is the only disagreement: against an oracle with the full-width norm, transformers passes."""
    report = _batching_together(g2_checkpoint, "full")
    assert report.passed, report.message()


class _UntouchableOracle(Oracle):
    def results(self, requests):
        raise AssertionError("the oracle ran for a scenario the candidate declared it cannot run")


def test_transformers_declines_prompts_its_ssd_path_cannot_fit(g1_checkpoint, g1_prompts):
    # The PyTorch SSD path of transformers allocates (L/Q + 1)²·H·P·N elements at once: at 100K tokens of the test
    # model that is hundreds of GiB. The scenario (the long prompt without a token budget, which transformers would
    # refuse first) is skipped with the size named, before the oracle runs at all.
    scenario = next(s for s in build_scenarios(G1_MODEL) if s.id == "long-100k")
    scenario = dataclasses.replace(scenario, needs_cuda=False, options=EngineOptions(
        allow_long_context=scenario.options.allow_long_context))
    with pytest.raises(ScenarioSkipped, match=r"\d{6}-token sequence: .* would allocate a \d+ GiB tensor"):
        check_scenario("transformers", scenario, oracle=_UntouchableOracle(g1_checkpoint), source=g1_prompts)
