"""`compare` over several checkpoints and in worker processes (--checkpoint repeated, --jobs): what make compare runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main, planned_steps
from harness.scenarios import build_scenarios
from tests.harness.conftest import G1_MODEL


def test_two_models_in_two_workers_each_with_its_own_scenarios(g1_checkpoint, g2_checkpoint, tmp_path, capsys):
    """transformers passes on the G = 1 model and fails batching-alone on the G = 2 one (it normalises over all
    groups): each model's table and files, the first non-zero status, and a last line over both."""
    out = tmp_path / "out"
    code = main(["compare", "--engine", "transformers", "--jobs", "2", "--out", str(out),
                 "--checkpoint", str(g1_checkpoint), "--scenarios", "batching-together,pp-size1",
                 "--checkpoint", str(g2_checkpoint), "--scenarios", "batching-alone"])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    lines = captured.out.splitlines()
    g1, g2 = Path(g1_checkpoint).resolve().name, Path(g2_checkpoint).resolve().name
    assert lines.index(f"== {g1}") < lines.index(f"== {g2}")
    assert "batching-alone: request 'r" in captured.out          # the failure, printed under its model's table
    assert lines[-1].startswith("2 models: 2 PASS, 0 SKIP, 1 FAIL, 0 ERROR in ")
    assert f"({g1}: its scenarios' time in the workers)" in captured.out
    for name, scenarios, verdict in ((g1, ["batching-together", "pp-size1"], "pass"), (g2, ["batching-alone"], "fail")):
        report = json.loads((out / name / "report.json").read_text())
        assert [s["scenario"] for s in report["scenarios"]] == scenarios and report["verdict"] == verdict
        assert (out / name / "delta_by_position.png").is_file()
    assert "step" in captured.err                                # the one progress bar, counted in engine steps


@pytest.mark.parametrize("extra, message", [
    (["--scenarios", "batching-alone", "--scenarios", "batching-alone", "--scenarios", "batching-alone"],
     "--scenarios given 3 times for 2 --checkpoint"),
    (["--jobs", "0"], "--jobs 0: expected 1 or more"),
])
def test_usage_errors_of_several_models(extra, message, g1_checkpoint, g2_checkpoint, tmp_path, capsys):
    code = main(["compare", "--engine", "reference", "--out", str(tmp_path), "--checkpoint", str(g1_checkpoint),
                 "--checkpoint", str(g2_checkpoint), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("bamba-harness: error: ") and message in err


def test_two_checkpoints_of_one_name_are_refused(g1_checkpoint, tmp_path, capsys):
    code = main(["compare", "--engine", "reference", "--out", str(tmp_path), "--checkpoint", str(g1_checkpoint),
                 "--checkpoint", str(g1_checkpoint)])
    assert code == 2 and "several directories named alike" in capsys.readouterr().err


def test_workers_take_the_longest_scenario_first():
    steps = {s.id: planned_steps(s) for s in build_scenarios(G1_MODEL)}
    Q = G1_MODEL.mamba_chunk_size
    assert steps[f"chunked_prefill-budget1-Q{Q}"] > steps[f"chunked_prefill-budget1000-Q{Q}"] > 1
    assert steps["batching-alone"] > steps["batching-together"]
