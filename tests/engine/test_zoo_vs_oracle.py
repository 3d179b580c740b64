"""The vendored engine against the fp64 oracle on every model of the config zoo (harness/zoo.py), both families.

`make test` runs each zoo model through one scenario that has it all: prompts split into pieces that continue from a
saved state (two of them in one step), decodes in the same steps, a request arriving mid-run and greedy generation
(ZOO_SMOKE), in fp32 on the CPU (and bf16 on a GPU). `make test-slow` adds, for each model, the scenarios that exercise
config handling in other paths (ZOO_SLOW: all requests batched together, a budget of Q+1, preemption, a bf16 SSM
state, two tensor-parallel ranks where the model divides). `make test-zoo` runs the rest of the matrix: every
batching, chunked-prefill, preemption and SSM-state-dtype scenario and tp 1 and 2 (marked zoo_full; about an hour
on 2 cores, too long for CI).
The coverage test (tests/harness/test_zoo_coverage.py) reads ENGINE_ZOO and the smoke scenario from here.
"""

from __future__ import annotations

import pytest
import torch

from harness import zoo
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import build_scenarios

# The zoo entries this suite runs, and the scenario each runs in `make test` (its id for the model's chunk size Q).
ENGINE_ZOO = list(zoo.ZOO) + list(zoo.GRANITE_ZOO)
# The model families the vendored engine serves: the coverage test holds this suite to the config fields of these.
ENGINE_FAMILIES = ("bamba", "granitemoehybrid")
ZOO_SMOKE = "chunked_prefill-capped"
ZOO_MATRIX_KINDS = ("batching", "chunked_prefill", "ssm_state_dtype", "preemption", "tp")
ZOO_MATRIX_TP = (1, 2)          # tensor-parallel sizes of the matrix (4 and 8 run on the tiny model only)


def zoo_slow(scenario, Q: int) -> bool:
    """The matrix cases `make test-slow` runs for every zoo model of chunk size Q."""
    chosen = ("batching-together", "ssm_state_dtype-bfloat16", "tp-size2", f"chunked_prefill-budget{Q + 1}-Q{Q}")
    return scenario.id in chosen or scenario.kind == "preemption"


def smoke_scenario(cfg):
    return next(s for s in build_scenarios(cfg) if s.id.startswith(ZOO_SMOKE))


DEVICES = [("cpu", torch.float32),
           pytest.param(("cuda", torch.bfloat16), marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module", params=ENGINE_ZOO)
def zoo_model(request, tmp_path_factory):
    return request.param, zoo.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("device_dtype", DEVICES, ids=["cpu-fp32", "cuda-bf16"])
def test_zoo_model_matches_oracle(zoo_model, device_dtype):
    name, path = zoo_model
    device, dtype = device_dtype
    oracle = Oracle(path, device=device)
    try:
        report = check_scenario("vendored", smoke_scenario(zoo.model_config(name)), oracle=oracle,
                                source=zoo.prompt_source(name), dtype=dtype, device=device)
    finally:
        oracle.close()
    assert report.passed, report.message()
    generated = sum(1 for c in report.comparisons for w in c.positions if w >= c.prompt_len)
    assert generated > 0, "no generated position was compared"


def _matrix():
    cases = []
    for name in ENGINE_ZOO:
        for s in build_scenarios(zoo.model_config(name)):
            if (s.kind in ZOO_MATRIX_KINDS and not s.slow and not s.needs_cuda and not s.id.startswith(ZOO_SMOKE)
                    and s.options.tensor_parallel_size in ZOO_MATRIX_TP):
                marks = [pytest.mark.slow] + [getattr(pytest.mark, m) for m in s.marks]
                if not zoo_slow(s, zoo.model_config(name).mamba_chunk_size):
                    marks.append(pytest.mark.zoo_full)
                cases.append(pytest.param(name, s, id=f"{name}-{s.id}", marks=marks))
    return cases


@pytest.mark.parametrize("name,scenario", _matrix())
def test_zoo_matrix_matches_oracle(name, scenario, tmp_path):
    oracle = Oracle(zoo.write_checkpoint(name, tmp_path / name))
    try:
        report = check_scenario("vendored", scenario, oracle=oracle, source=zoo.prompt_source(name),
                                dtype=torch.float32)
    except ScenarioSkipped as skip:          # tp sizes the model does not divide into
        pytest.skip(str(skip))
    finally:
        oracle.close()
    assert report.passed, report.message()
