"""`bamba-harness`: usage errors are one line with exit status 2; a small run writes its table, JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import adapters
from harness.adapters.reference import ReferenceEngine
from harness.cli import main


@pytest.mark.parametrize("args, message", [
    (["--engine", "nope"], "unknown engine 'nope'"),
    (["--engine", "reference", "--scenarios", "batching,chunky"], "unknown scenario 'chunky'"),
    (["--engine", "reference", "--dtype", "float8"], "dtype: expected one of"),
    (["--engine", "reference", "--checkpoint", "/nonexistent/ckpt"], "checkpoint directory /nonexistent/ckpt does not"),
], ids=["engine", "scenario", "dtype", "checkpoint"])
def test_usage_errors_are_one_line_and_exit_2(args, message, g1_checkpoint, tmp_path, capsys):
    if "--checkpoint" not in args:
        args = [*args, "--checkpoint", str(g1_checkpoint)]
    assert main(["compare", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bamba-harness: error: ") and message in err


def test_a_small_run_writes_the_table_json_and_png(g1_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["compare", "--engine", "transformers", "--checkpoint", str(g1_checkpoint),
                 "--scenarios", "batching-together,chunked_prefill-budget7-Q8", "--out", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "batching-together" in table and "PASS" in table
    assert "chunked_prefill-budget7-Q8" in table and "SKIP" in table and "no chunked prefill" in table
    report = json.loads((out / "report.json").read_text())
    assert [s["scenario"] for s in report["scenarios"]] == ["batching-together", "chunked_prefill-budget7-Q8"]
    assert report["scenarios"][0]["passed"] and report["scenarios"][0]["requests"]
    assert (out / "delta_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_scenario_exits_1_and_prints_the_failure(g2_checkpoint, tmp_path, capsys):
    code = main(["compare", "--engine", "transformers", "--checkpoint", str(g2_checkpoint),
                 "--scenarios", "batching-alone", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in printed and "batching-alone: request 'r" in printed


def test_python_dash_m_entry_point(tmp_path):
    run = subprocess.run([sys.executable, "-m", "harness.cli", "compare", "--engine", "nope", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == ("bamba-harness: error: unknown engine 'nope': expected one of reference, "
                                  "transformers, vendored, vllm, server, llamacpp")


class CrashingEngine(ReferenceEngine):
    name = "crashy"

    def _run(self, requests):
        raise RuntimeError("kernel launch failed")


def test_an_engine_that_raises_is_an_error_row_and_exit_1(g1_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(adapters._ADAPTERS, "crashy", (__name__, "CrashingEngine"))
    code = main(["compare", "--engine", "crashy", "--checkpoint", str(g1_checkpoint),
                 "--scenarios", "batching-together,batching-alone", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 1
    assert [line.split()[0] for line in printed.splitlines() if line.endswith("  ERROR")] == [
        "batching-alone", "batching-together"]
    assert "batching-alone: RuntimeError: kernel launch failed" in printed and "2 ERROR in" in printed
    assert json.loads((tmp_path / "report.json").read_text())["scenarios"][0]["error"].startswith("RuntimeError")
