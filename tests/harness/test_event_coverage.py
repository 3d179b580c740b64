"""Scenario coverage as a checked property: for every zoo model, the bundled tiny model and the Bamba-9B shape
(Q = 256), the union of the model's scenarios produces every boundary event of harness/events.py that the model can
have, and each event the model cannot have is listed with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import zoo
from harness.events import EVENTS, events_table, impossible_events, plan_events, required_events
from harness.scenarios import build_scenarios
from reference.config import ModelConfig

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"
MODELS = {**{name: zoo.model_config(name) for name in zoo.ZOO},
          "tiny-bamba": ModelConfig.from_json(TINY),
          "bamba-9b-shape": ModelConfig(attn_layer_indices=(9, 18, 27))}      # BambaConfig's defaults: Q 256, W 4


def scenario_events(cfg: ModelConfig) -> dict[str, set[str]]:
    Q, W = cfg.mamba_chunk_size, cfg.mamba_d_conv
    return {s.id: plan_events(s.shapes, s.options, Q, W) for s in build_scenarios(cfg)}


@pytest.mark.parametrize("name", list(MODELS))
def test_scenarios_produce_every_event_the_model_can_have(name):
    cfg = MODELS[name]
    produced = set().union(*scenario_events(cfg).values())
    missing = required_events(cfg.mamba_chunk_size, cfg.mamba_d_conv) - produced
    assert not missing, f"{name} (Q = {cfg.mamba_chunk_size}, W = {cfg.mamba_d_conv}): no scenario produces {missing}"


def test_bamba_9b_shape_is_the_one_users_run():
    cfg = MODELS["bamba-9b-shape"]
    assert (cfg.mamba_chunk_size, cfg.mamba_d_conv, cfg.num_hidden_layers) == (256, 4, 32)


@pytest.mark.parametrize("Q,W,event", [(8, 2, "split<W-1"), (1, 4, "split@Q-1"), (1, 4, "continuing_prefills")])
def test_impossible_events_have_reasons_and_are_not_required(Q, W, event):
    assert impossible_events(Q, W)[event]
    assert event not in required_events(Q, W)
    assert required_events(16, 4) == set(EVENTS)


def test_new_events_come_from_their_scenarios():
    """Each event added for the zoo comes from the scenario built for it, on the tiny model and at Q = 256."""
    for name in ("tiny-bamba", "bamba-9b-shape"):
        events = scenario_events(MODELS[name])
        capped = next(e for sid, e in events.items() if sid.startswith("chunked_prefill-capped"))
        preemption = next(e for sid, e in events.items() if sid.startswith("preemption"))
        assert "continuing_prefills" in capped
        assert "recompute_across_chunk" in preemption
        assert "decode_after_chunk_and_block_end" in events["batching-together"]
        assert "prompt_W-1_decoded" in events["batching-together"]


def test_the_docs_tables_are_current():
    """docs/scenarios.md shows, for the tiny model and the Bamba-9B shape, the table events_table makes today."""
    doc = (TINY.parents[1] / "docs" / "scenarios.md").read_text()
    for name in ("tiny-bamba", "bamba-9b-shape"):
        cfg = MODELS[name]
        table = events_table(build_scenarios(cfg), cfg.mamba_chunk_size, cfg.mamba_d_conv)
        assert table in doc, f"docs/scenarios.md: the {name} table is out of date; regenerate it with events_table"
