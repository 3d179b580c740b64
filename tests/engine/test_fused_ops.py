"""The engine with its fused kernels (add_rms_norm, rotary_, silu_mul, and the CUDA-graph step's decode_attention)
on the CPU, against the fp64 oracle. A CUDA engine always runs them; a CPU engine runs torch expressions in their
place unless vendored.engine.model.FUSED_OPS_ON_CPU is set (interpreted, each launch costs ~10-30 ms). This test
sets it, so the engine's calls of the kernels (the merged q/k/v's rotated heads, the norms' deferred residual adds,
the merged gate/up, the padded decode step's attention over the paged cache with q a view of the merged q/k/v) are
checked on every machine, on models that differ where those calls do: full rotary with grouped K/V heads,
GraniteMoeHybrid without RoPE (its shared MLP's SwiGLU, the residual multiplier), and with partial RoPE."""

from __future__ import annotations

import pytest
import torch

from harness import zoo
from harness.compare import compare_runs
from harness.engine import EngineOptions, Request
from harness.runner import Oracle, check_scenario
from tests.engine.test_cudagraph import run_counted
from tests.engine.test_zoo_vs_oracle import smoke_scenario
from vendored.engine import model as engine_model
from vendored.engine import paged_attention

MODELS = ["rope-theta500-rotary1-gqa4to2", "granite-moe8-top1-nope-groups2", "granite-rotary0.5"]
# The padded decode step (the CUDA-graph step, run eagerly on the CPU): three requests in a batch padded to 4 (one
# padding row), with contexts of about 4, 40 and 76 keys while they decode: under the interpreter's launch of
# decode_attention (splits of 32 keys over a table of 80) one, two and three splits hold keys, so the combine runs.
STATIC_PROMPTS = (3, 39, 75)
STATIC_NEW_TOKENS = 4


def static_decode_report(name, path, oracle):
    source = zoo.prompt_source(name)
    requests = [Request(f"r{i}", tuple(source.tokens(n, i)), STATIC_NEW_TOKENS) for i, n in enumerate(STATIC_PROMPTS)]
    options = EngineOptions(cuda_graphs=True, max_num_seqs=4)
    results, (launches, padding_rows, _) = run_counted("cpu", torch.float32, oracle, requests, options)
    assert 4 in launches and padding_rows > 0, f"padded sizes run: {launches}, padding rows {padding_rows}"
    return compare_runs(scenario=f"{name}-static-decode-fused", requests=requests, baseline=oracle.results(requests),
                        candidate=results, budget=oracle.budget(requests, torch.float32))


@pytest.mark.parametrize("name", MODELS)
def test_fused_kernels_in_the_engine_match_the_oracle(name, tmp_path, monkeypatch):
    calls = {"add_rms_norm": 0, "rotary_": 0, "silu_mul": 0, "decode_attention": 0}
    owners = {"add_rms_norm": engine_model, "rotary_": engine_model, "silu_mul": engine_model,
              "decode_attention": paged_attention}

    def counted(fn_name):
        original = getattr(owners[fn_name], fn_name)

        def wrapper(*args, **kwargs):
            calls[fn_name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine_model, "FUSED_OPS_ON_CPU", True)
    for fn_name in calls:
        monkeypatch.setattr(owners[fn_name], fn_name, counted(fn_name))
    path = zoo.write_checkpoint(name, tmp_path / name)
    cfg = zoo.model_config(name)
    oracle = Oracle(path, device="cpu")
    try:
        report = check_scenario("vendored", smoke_scenario(cfg), oracle=oracle, source=zoo.prompt_source(name))
        assert report.passed, report.message()
        assert calls["decode_attention"] == 0, "the eager step ran the CUDA-graph step's decode attention"
        static = static_decode_report(name, path, oracle)
    finally:
        oracle.close()
    assert static.passed, static.message()
    nope = zoo.config_dict(name).get("position_embedding_type") == "nope"
    expected = {"add_rms_norm", "silu_mul", "decode_attention"} | (set() if nope else {"rotary_"})
    missing = sorted(f for f in expected if calls[f] == 0)
    assert not missing, f"the engine never launched {missing}: the fused path was not taken"
