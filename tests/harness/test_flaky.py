"""make flaky (harness/flaky.py): the shuffled orders, the outcomes each run writes, and the summary's verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from harness import flaky

SUITE = '''
import os, pathlib, pytest

def test_stable():
    pass

def test_flaky():
    # fails on every second call: the count lives in a file beside the tests
    counter = pathlib.Path(__file__).with_name("count")
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    assert n % 2 == 0

@pytest.mark.skip(reason="never runs")
def test_skipped():
    pass

@pytest.mark.xfail(strict=True)
def test_expected_failure():
    assert False

@pytest.mark.parametrize("i", range(12))
def test_many(i):
    pass
'''


def write_suite(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_suite.py").write_text(textwrap.dedent(SUITE))
    return tests


def collected(tests, seed: int, workers: str | None = None) -> list[str]:
    args = [sys.executable, "-m", "pytest", "-p", "harness.flaky", "-p", "no:cacheprovider", "--collect-only", "-q",
            "--shuffle-seed", str(seed), str(tests)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tests)
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_a_seed_is_one_order_and_another_seed_another(tmp_path):
    tests = write_suite(tmp_path)
    first, again, other = collected(tests, 1), collected(tests, 1), collected(tests, 2)
    assert len(first) == 16 and first == again and other != first and sorted(other) == sorted(first)


def test_two_runs_find_the_flaky_test_and_only_it(tmp_path, capsys):
    tests, out = write_suite(tmp_path), tmp_path / "out"
    code = flaky.main(["--runs", "2", "--seed", "5", "--xdist", "2", "--out", str(out), "--", str(tests)])
    assert code == 1, capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "flaky" and summary["tests"] == 16
    assert [row["test"].split("::")[-1] for row in summary["flaky"]] == ["test_flaky"]
    assert summary["flaky"][0]["outcomes"] == {"passed": 1, "failed": 1}
    assert summary["flaky"][0]["failed_in_seeds"] == [6]                   # run 2: seed 5 + 1
    assert [run["seed"] for run in summary["runs"]] == [5, 6] and not summary["always_failed"]
    # node ids are relative to the rootdir pytest finds for the suite, which depends on where the tree lies: match
    # them by their end
    outcomes = {test.rpartition("/")[2]: outcome
                for test, outcome in flaky.read_outcomes(out / "run-1.jsonl").items()}
    assert {outcomes[f"test_suite.py::{name}"] for name in ("test_skipped", "test_expected_failure")} == {
        "skipped", "xfailed"}
    table = (out / "summary.md").read_text()
    assert "## Flaky: passed in one run, failed in another: 1" in table and "test_suite.py::test_flaky`" in table


def test_verdicts():
    runs = [{"seed": 1}, {"seed": 2}, {"seed": 3}]
    stable = flaky.summarize(runs, [{"a": "passed", "b": "skipped"}] * 3)
    assert stable["verdict"] == "stable" and flaky.exit_status(stable) == 0
    broken = flaky.summarize(runs, [{"a": "failed"}, {"a": "error"}, {"a": "failed", "b": "passed"}])
    assert broken["verdict"] == "failing" and [r["test"] for r in broken["always_failed"]] == ["a"]
    assert flaky.exit_status(broken) == 2
    crashed = flaky.summarize(runs, [{"a": "passed"}, None, {"a": "passed"}])
    assert crashed["verdict"] == "failing" and crashed["runs_without_outcomes"] == [2]
    varied = flaky.summarize(runs, [{"a": "passed"}, {"a": "skipped"}, {"a": "xpassed", "b": "error"}])
    assert varied["verdict"] == "failing" and [r["test"] for r in varied["varied"]] == ["a"]
    mixed = flaky.summarize(runs, [{"a": "xpassed"}, {"a": "error"}, {}])
    assert mixed["verdict"] == "flaky" and mixed["flaky"][0]["failed_in_seeds"] == [2]
