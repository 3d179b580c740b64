"""report.json: the versioned schema with provenance, verdict and counts, written atomically; the summary line; the
PNG's title and its panels for the scenarios that were not checked."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from datetime import datetime

import pytest

from harness import plot, report
from harness.cli import REPO_ROOT, main


def test_a_run_writes_a_versioned_report_with_provenance_and_a_summary_line(g1_checkpoint, tmp_path, capsys,
                                                                           monkeypatch):
    drawn = {}
    real_plot = plot.plot_deltas

    def spy(reports, path, **kwargs):
        drawn.update(kwargs)
        return real_plot(reports, path, **kwargs)

    monkeypatch.setattr(plot, "plot_deltas", spy)
    code = main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint),
                 "--scenarios", "batching-alone,cudagraph-on", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert re.fullmatch(r"1 PASS, 1 SKIP, 0 FAIL, 0 ERROR in \d+\.\ds", printed.rstrip().splitlines()[-1])

    doc = json.loads((tmp_path / "report.json").read_text())
    assert (doc["schema"], doc["schema_version"]) == ("bamba-harness/report", 2)
    assert doc["verdict"] == "pass"
    assert doc["counts"] == {"passed": 1, "failed": 0, "error": 0, "skipped": 1}
    started = datetime.fromisoformat(doc["started_at"])
    finished = datetime.fromisoformat(doc["finished_at"])
    assert started.utcoffset().total_seconds() == 0 and started <= finished
    assert doc["duration_s"] >= 0
    assert doc["command"] == sys.argv
    assert re.fullmatch(r"[0-9a-f]{40}", doc["git"]["commit"]) and isinstance(doc["git"]["dirty"], bool)
    assert doc["versions"]["torch"] == importlib.metadata.version("torch")
    assert set(doc["versions"]) == {"python", "bamba-harness", "torch", "triton", "transformers"}
    assert doc["device_name"]
    assert {k: doc[k] for k in ("engine", "checkpoint", "dtype", "device", "k", "atol")} == {
        "engine": "reference", "checkpoint": str(g1_checkpoint), "dtype": "float32", "device": "cpu",
        "k": 2.0, "atol": 1e-05}
    assert doc["baseline"]["kind"] == "oracle" and doc["baseline"]["dtype"] == "float64"
    assert doc["selected"] == ["batching-alone", "cudagraph-on"] and doc["not_run"] == []
    assert [(s["scenario"], s["verdict"]) for s in doc["scenarios"]] == [("batching-alone", "PASS"),
                                                                         ("cudagraph-on", "SKIP")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta_by_position.png", "report.json"]

    assert drawn["title"].startswith(f"reference float32 on {g1_checkpoint.name} (cpu), {doc['started_at'][:10]}")
    [(scenario, verdict, reason)] = drawn["unchecked"]
    assert (scenario, verdict) == ("cudagraph-on", "SKIP") and "needs a CUDA device" in reason


@pytest.mark.parametrize("tally, interrupted, expected", [
    ({"passed": 2, "failed": 0, "error": 0, "skipped": 1}, False, "pass"),
    ({"passed": 2, "failed": 1, "error": 0, "skipped": 0}, False, "fail"),
    ({"passed": 2, "failed": 0, "error": 1, "skipped": 0}, False, "fail"),
    ({"passed": 0, "failed": 0, "error": 0, "skipped": 3}, False, "nothing-checked"),
    ({"passed": 0, "failed": 0, "error": 0, "skipped": 0}, False, "nothing-checked"),
    ({"passed": 2, "failed": 0, "error": 0, "skipped": 0}, True, "interrupted"),
])
def test_verdict(tally, interrupted, expected):
    assert report.verdict(tally, interrupted=interrupted) == expected


@pytest.mark.parametrize("seconds, text", [(4.24, "4.2s"), (552, "9m12s"), (3787, "1h03m07s")])
def test_summary_line(seconds, text):
    tally = {"passed": 21, "failed": 0, "error": 0, "skipped": 1}
    assert report.summary_line(tally, seconds) == f"21 PASS, 1 SKIP, 0 FAIL, 0 ERROR in {text}"


def test_provenance_is_none_where_unknown(tmp_path, monkeypatch):
    assert report.git_state(tmp_path) == {"commit": None, "dirty": None}          # not a git checkout
    assert report.git_state(REPO_ROOT)["commit"] is not None
    monkeypatch.setattr(report, "VERSIONED_PACKAGES", ("torch", "no-such-package-bamba"))
    assert report.versions()["no-such-package-bamba"] is None


def test_write_atomic_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    report.write_atomic(target, {"verdict": "pass"})
    assert json.loads(target.read_text()) == {"verdict": "pass"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]

    circular: dict = {}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular"):     # fails while writing: the old file stays as it was
        report.write_atomic(target, circular)
    assert json.loads(target.read_text()) == {"verdict": "pass"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_the_figure_has_a_title_and_a_labelled_panel_per_unchecked_scenario():
    fig = plot.figure([], title="vendored float32 on tiny-bamba (cpu), 2026-01-02",
                      unchecked=[("cudagraph-on", "SKIP", "cudagraph-on needs a CUDA device"),
                                 ("tp-size2", "ERROR", "RuntimeError: kernel launch failed")])
    assert fig.get_suptitle() == "vendored float32 on tiny-bamba (cpu), 2026-01-02"
    panels = [(ax.get_title(), [t.get_text() for t in ax.texts]) for ax in fig.axes if ax.get_title()]
    assert panels == [("cudagraph-on: SKIP", ["cudagraph-on needs a CUDA device"]),
                      ("tp-size2: ERROR", ["RuntimeError: kernel launch failed"])]
