"""The vendored engine at real width (harness/scale.py's Bamba-9B-shaped models) against the fp64 oracle on the GPU.

`gpu` (make test-gpu): the 2-layer slice through the capped chunked-prefill scenario in bf16 (pieces of 256 and
several continuing prefills in one step, Q = 256: the shape CI must exercise end to end), judged by the max budget
and the excess test. `gpu` + `scale`: the same slice in fp32 through every scenario mutants/scale.py judges, and the
4-layer model in bf16 (docs/scale.md has the power measurement: python -m mutants.scale).
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import scale
from harness.runner import Oracle, check_scenario
from harness.scenarios import PromptSource, build_scenarios
from mutants.scale import DEFAULT_SCENARIOS
from reference.config import ModelConfig

# The 2-layer slice's fp64 oracle alone takes 16 GB: under make test-gpu's workers these tests run on the one worker
# of the large-memory group (conftest.py), one at a time.
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("large-gpu-memory"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="real-width models need a CUDA device")]


@pytest.fixture(scope="module")
def slice2(tmp_path_factory):
    path = scale.write_checkpoint("bamba9b-2layer", tmp_path_factory.mktemp("b9b-2"), device="cuda",
                                  progress=False)
    oracle = Oracle(path, device="cuda")
    yield path, oracle
    oracle.close()


def _scenario(path, sid):
    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    return {s.id: s for s in build_scenarios(cfg)}[sid]


def test_real_width_smoke_bf16(slice2):
    path, oracle = slice2
    scenario = _scenario(path, "chunked_prefill-capped-budget640-cap256-Q256")
    report = check_scenario("vendored", scenario, oracle=oracle, source=PromptSource(128256, seed=0),
                            dtype="bfloat16", device="cuda")
    assert report.passed, report.message()
    classes = report.meta["excess"]["classes"]
    assert classes["all"]["judged"] and classes["after-piece"]["positions"] > 0


@pytest.mark.scale
@pytest.mark.parametrize("sid", DEFAULT_SCENARIOS.split(","))
def test_real_width_fp32(slice2, sid):
    path, oracle = slice2
    report = check_scenario("vendored", _scenario(path, sid), oracle=oracle, source=PromptSource(128256, seed=0),
                            dtype="float32", device="cuda")
    assert report.passed, report.message()


@pytest.mark.scale
def test_four_layers_bf16(tmp_path):
    path = scale.write_checkpoint("bamba9b-4layer", tmp_path / "b9b-4", device="cuda", progress=False)
    oracle = Oracle(path, device="cuda")
    try:
        for sid in ("batching-together", "chunked_prefill-capped-budget640-cap256-Q256"):
            report = check_scenario("vendored", _scenario(path, sid), oracle=oracle,
                                    source=PromptSource(128256, seed=0), dtype="bfloat16", device="cuda")
            assert report.passed, report.message()
    finally:
        oracle.close()
