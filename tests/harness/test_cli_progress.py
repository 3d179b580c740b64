"""Progress inside a scenario: the runner reports its stages and, where the engine counts them, its engine steps;
the CLI shows them on a bar of its own below the bar over scenarios."""

from __future__ import annotations

import pytest

from harness.adapters.reference import ReferenceEngine
from harness.cli import main
from harness.engine import Request
from harness.runner import check_scenario
from harness.scenarios import build_scenarios
from tests.harness.conftest import G1_MODEL

SCENARIOS = {s.id: s for s in build_scenarios(G1_MODEL)}


class SteppingReference(ReferenceEngine):
    """The reference, counting its engine steps through `step_callback` as the vendored engine does."""

    name = "stepping"
    step_callback = None
    forward_steps = 0
    instances: list = []

    def _load(self):
        super()._load()
        self.instances.append(self)

    def forward_step(self, pieces, tokens, states):
        out = super().forward_step(pieces, tokens, states)
        self.forward_steps += 1
        if self.step_callback is not None:
            self.step_callback()
        return out


def test_the_runner_reports_stages_and_every_engine_step(g1_oracle, g1_prompts):
    events = []
    report = check_scenario(SteppingReference, SCENARIOS["chunked_prefill-budget7-Q8"], oracle=g1_oracle,
                            source=g1_prompts, progress=lambda stage, steps: events.append((stage, steps)))
    assert report.passed, report.message()
    stages = [stage for stage, steps in events if steps == 0]
    assert stages == ["oracle", "budget", "stepping"]
    ticks = [stage for stage, steps in events if steps == 1]
    [engine] = SteppingReference.instances
    assert ticks == ["stepping"] * engine.forward_steps and len(ticks) > 1


def test_the_cli_shows_the_stages_of_a_scenario(g1_checkpoint, tmp_path, capsys):
    assert main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint),
                 "--scenarios", "batching-alone", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    for stage in ("oracle", "budget", "reference"):
        assert f"batching-alone: {stage}" in err


@pytest.mark.slow
def test_the_vendored_engine_ticks_once_per_engine_step(g1_checkpoint):
    from harness.adapters.vendored import VendoredEngine

    ticks = []
    with VendoredEngine(g1_checkpoint) as engine:
        engine.step_callback = lambda: ticks.append(1)
        results = engine.run([Request("a", (1, 2, 3), 2), Request("b", (4, 5), 1)])
        assert len(ticks) == engine.engine.steps > 0
    assert [len(r.output_ids) for r in results] == [2, 1]
