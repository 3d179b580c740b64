"""The transformers adapter says what it cannot do instead of failing obscurely: a pure-Mamba2 checkpoint is a
skip with the reason (not an ERROR from inside transformers), and a checkpoint with G > 1 comes with a one-line note
naming the oracle it agrees with (--gated-norm full), since against the default grouped oracle it fails every
scenario."""

from __future__ import annotations

import logging

import pytest
import torch

from harness.adapters.transformers import TransformersEngine
from harness.engine import UnsupportedOptions
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import PromptSource, build_scenarios
from reference.config import ModelConfig
from tests.helpers import random_bamba_checkpoint

from .conftest import G1_MODEL

PURE_MAMBA2_REASON = (r"a pure-Mamba2 checkpoint \(attn_layer_indices = \[\]\): transformers \S+ cannot build the "
                      r"attention mask from a cache without attention layers")


@pytest.fixture(scope="module")
def pure_mamba2(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("pure-mamba2"), seed=11, attn_layer_indices=[])


class _UntouchableOracle(Oracle):
    def results(self, requests):
        raise AssertionError("the oracle ran for a scenario the candidate cannot run")


def test_a_pure_mamba2_checkpoint_is_refused_with_the_reason(pure_mamba2):
    with pytest.raises(UnsupportedOptions, match=PURE_MAMBA2_REASON):
        TransformersEngine(pure_mamba2)


def test_a_pure_mamba2_scenario_is_a_skip_before_the_oracle_runs(pure_mamba2):
    cfg = ModelConfig.from_json(pure_mamba2)
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    with pytest.raises(ScenarioSkipped, match=PURE_MAMBA2_REASON):
        check_scenario("transformers", scenario, oracle=_UntouchableOracle(pure_mamba2),
                       source=PromptSource(cfg.vocab_size), dtype=torch.float32)


def test_the_oracle_hint_names_the_full_width_oracle_only_where_it_applies(g2_checkpoint):
    g2 = ModelConfig.from_json(g2_checkpoint)
    hint = TransformersEngine.oracle_hint(g2, "grouped")
    assert hint is not None and "\n" not in hint
    assert "mamba_n_groups = 2" in hint and "--gated-norm full" in hint and 'Oracle(gated_norm="full")' in hint
    assert TransformersEngine.oracle_hint(g2, "full") is None           # that oracle computes what transformers does
    assert TransformersEngine.oracle_hint(G1_MODEL, "grouped") is None  # one group: both norms are the same


def test_loading_a_grouped_checkpoint_notes_it_once(tmp_path, g1_checkpoint, caplog):
    """Its own G = 2 checkpoint: the note is once per checkpoint and process, and other tests load the shared one."""
    g2 = random_bamba_checkpoint(tmp_path, seed=2)
    caplog.set_level(logging.WARNING, logger="harness.adapters.transformers")
    for _ in range(2):                                                  # two scenarios on one checkpoint
        TransformersEngine(g2).close()
    TransformersEngine(g1_checkpoint).close()
    notes = [r.getMessage() for r in caplog.records if r.name == "harness.adapters.transformers"]
    assert len(notes) == 1 and "--gated-norm full" in notes[0] and "mamba_n_groups = 2" in notes[0]


def test_a_report_failing_on_the_gated_norm_carries_the_hint(g2_checkpoint):
    """Against the grouped oracle with G = 2 transformers fails, and the report says which oracle it agrees with."""
    cfg = ModelConfig.from_json(g2_checkpoint)
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    oracle = Oracle(g2_checkpoint)
    report = check_scenario("transformers", scenario, oracle=oracle, source=PromptSource(cfg.vocab_size, seed=0))
    oracle.close()
    assert not report.passed and "--gated-norm full" in report.meta["hint"]


@pytest.mark.parametrize("name", ["granite-moe4-top2", "granite-moe8-top1-nope-groups2", "granite-dense-tied-theta500"])
def test_granite_checkpoints_run_through_transformers_granite_class(name, tmp_path):
    """A GraniteMoeHybrid checkpoint is served by GraniteMoeHybridForCausalLM: left-padded batches with the cache,
    the routed experts, the multipliers, NoPE, and it passes against the oracle where the two compute the same model
    (with G = 2, the full-width-norm oracle)."""
    from harness import zoo

    path = zoo.write_checkpoint(name, tmp_path)
    cfg = ModelConfig.from_json(path)
    oracle = Oracle(path, gated_norm="full" if cfg.mamba_n_groups > 1 else "grouped")
    with TransformersEngine(path) as engine:
        assert type(engine.model).__name__ == "GraniteMoeHybridForCausalLM"
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    report = check_scenario("transformers", scenario, oracle=oracle, source=zoo.prompt_source(name))
    oracle.close()
    assert report.passed, report.message()
    assert TransformersEngine.oracle_hint(cfg, oracle.gated_norm) is None


def test_a_granite_partial_rotary_failure_carries_the_hint(tmp_path):
    """transformers' Granite rotates the whole head: against the oracle (which honours the factor) it fails, and
    the report says why."""
    from harness import zoo

    path = zoo.write_checkpoint("granite-rotary0.5", tmp_path)
    cfg = ModelConfig.from_json(path)
    oracle = Oracle(path)
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    report = check_scenario("transformers", scenario, oracle=oracle, source=zoo.prompt_source("granite-rotary0.5"))
    oracle.close()
    assert not report.passed
    assert "rotates all 32 dims of each attention head, whatever partial_rotary_factor = 0.5" in report.meta["hint"]


def test_a_clamped_dt_failure_in_decode_carries_the_hint(tmp_path):
    """transformers' cached decode does not clamp Δ (a pinned finding): a model with a time_step_limit fails at
    generated positions only, and the report says why."""
    from harness import zoo

    name = "granite-moe4-kv2-attention-first-dt-limit"
    path = zoo.write_checkpoint(name, tmp_path)
    cfg = ModelConfig.from_json(path)
    oracle = Oracle(path)
    scenario = next(s for s in build_scenarios(cfg) if s.id == "batching-together")
    report = check_scenario("transformers", scenario, oracle=oracle, source=zoo.prompt_source(name))
    oracle.close()
    assert not report.passed and all("generated step" in f.message() for f in report.failures)
    assert "does not clamp Δ to time_step_limit = (0.15, 0.9)" in report.meta["hint"]
