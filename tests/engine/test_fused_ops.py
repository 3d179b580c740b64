"""The engine with the decoder layer's fused kernels (add_rms_norm, rotary_, silu_mul) on the CPU, against the fp64
oracle. A CUDA engine always runs them; a CPU engine runs torch expressions in their place unless
vendored.engine.model.FUSED_OPS_ON_CPU is set (interpreted, each launch costs ~10-30 ms). This test sets it, so the
engine's calls of the kernels (the merged q/k/v's rotated heads, the norms' deferred residual adds, the merged
gate/up) are checked on every machine, on models that differ where those calls do: full rotary with grouped K/V
heads, GraniteMoeHybrid without RoPE (its shared MLP's SwiGLU, the residual multiplier), and with partial RoPE."""

from __future__ import annotations

import pytest

from harness import zoo
from harness.runner import Oracle, check_scenario
from tests.engine.test_zoo_vs_oracle import smoke_scenario
from vendored.engine import model as engine_model

MODELS = ["rope-theta500-rotary1-gqa4to2", "granite-moe8-top1-nope-groups2", "granite-rotary0.5"]


@pytest.mark.parametrize("name", MODELS)
def test_fused_kernels_in_the_engine_match_the_oracle(name, tmp_path, monkeypatch):
    calls = {"add_rms_norm": 0, "rotary_": 0, "silu_mul": 0}

    def counted(fn_name):
        original = getattr(engine_model, fn_name)

        def wrapper(*args, **kwargs):
            calls[fn_name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine_model, "FUSED_OPS_ON_CPU", True)
    for fn_name in calls:
        monkeypatch.setattr(engine_model, fn_name, counted(fn_name))
    path = zoo.write_checkpoint(name, tmp_path / name)
    cfg = zoo.model_config(name)
    oracle = Oracle(path, device="cpu")
    try:
        report = check_scenario("vendored", smoke_scenario(cfg), oracle=oracle, source=zoo.prompt_source(name))
    finally:
        oracle.close()
    assert report.passed, report.message()
    nope = zoo.config_dict(name).get("position_embedding_type") == "nope"
    expected = {"add_rms_norm", "silu_mul"} | (set() if nope else {"rotary_"})
    missing = sorted(f for f in expected if calls[f] == 0)
    assert not missing, f"the engine never launched {missing}: the fused path was not taken"
