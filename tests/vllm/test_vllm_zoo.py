"""vLLM on the config zoo (harness/zoo.py), both families: every entry vLLM can load, through the capped
chunked-prefill scenario (pieces continuing from saved states, two in a step, decodes beside them, greedy generation),
fp32 on the CPU, judged against the fp64 oracle. GraniteMoeHybrid entries are loaded as they are (routed experts,
multipliers, NoPE); Bamba entries through the conversion. Entries vLLM cannot serve as the checkpoint defines them
(an MLP bias, a head_dim that is not hidden/heads, a time-step limit vLLM does not apply) are left out here, named
in VLLM_CANNOT."""

from __future__ import annotations

import pytest
import torch

from harness import zoo
from harness.adapters.granite_convert import conversion_problems, vllm_granite_problems
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from tests.engine.test_zoo_vs_oracle import smoke_scenario

VLLM_CANNOT = {**{name: conversion_problems(zoo.model_config(name)) for name in zoo.ZOO
                  if conversion_problems(zoo.model_config(name))},
               **{name: vllm_granite_problems(zoo.model_config(name)) for name in zoo.GRANITE_ZOO
                  if vllm_granite_problems(zoo.model_config(name))}}
VLLM_ZOO = [name for name in [*zoo.ZOO, *zoo.GRANITE_ZOO] if name not in VLLM_CANNOT]


@pytest.mark.parametrize("name", VLLM_ZOO)
def test_vllm_matches_oracle_on_zoo_model(name, tmp_path):
    oracle = Oracle(zoo.write_checkpoint(name, tmp_path / name))
    try:
        report = check_scenario("vllm", smoke_scenario(zoo.model_config(name)), oracle=oracle,
                                source=zoo.prompt_source(name), dtype=torch.float32)
    except ScenarioSkipped as skip:
        pytest.skip(str(skip))
    finally:
        oracle.close()
    assert report.passed, report.message()
