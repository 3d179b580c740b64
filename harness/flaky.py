"""`make flaky`: the CPU suite run several times, each time in another shuffled order, and the tests whose outcome
changed: a test that passed in one run and failed in another is flaky (docs/flaky.md).

    python -m harness.flaky --runs 10 --out out/flaky -- -m "not gpu and not slow" tests

Each run is `python -m pytest -p harness.flaky --shuffle-seed S --outcomes FILE -n XDIST --dist load ARGS`, with
S = the base seed + the run's index: this module is also the pytest plugin that shuffles the collected tests by S
(every xdist worker alike, so their collections agree; `--dist load` then hands them out in that order, so tests
meet other neighbours in each worker every run) and writes each test's outcome (passed, failed, error, skipped,
xfailed, xpassed) as JSON lines. The summary goes to OUT/summary.json and OUT/summary.md, each run's pytest output
to OUT/run-K.log.

Exit status: 0 when every run passed; 1 when a test is flaky (passed or xpassed in one run, failed or errored in
another); 2 when none is, but a test failed in every run that ran it or a run ended without its outcomes (a
collection error, a crash). A failing rerun is reproduced with `pytest -p harness.flaky --shuffle-seed S ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

PASSED, FAILED = {"passed", "xpassed"}, {"failed", "error"}


# ---- the pytest plugin (-p harness.flaky) ------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flaky", "make flaky (harness/flaky.py)")
    group.addoption("--shuffle-seed", type=int, default=None,
                    help="shuffle the collected tests with this seed (the same order in every xdist worker)")
    group.addoption("--outcomes", default=None, metavar="FILE",
                    help="write each test's outcome to FILE as JSON lines (test, outcome)")


@pytest.hookimpl(trylast=True)          # after every conftest's own reordering
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    seed = config.getoption("shuffle_seed")
    if seed is not None:
        random.Random(seed).shuffle(items)


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("outcomes")
    if path and not hasattr(config, "workerinput"):     # the xdist controller (or a plain run) sees every report
        config.pluginmanager.register(_Outcomes(Path(path)), "harness-flaky-outcomes")


class _Outcomes:
    """Each test's outcome over its setup, call and teardown; written when the session ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        xfail = hasattr(report, "wasxfail")
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "xfailed" if xfail else "skipped"
        elif report.when == "call":
            outcome = "xpassed" if xfail else "passed"
        else:
            return                                   # a setup or teardown that passed says nothing yet
        if self.outcomes.get(report.nodeid) not in FAILED:  # a failure anywhere stays the test's outcome
            self.outcomes[report.nodeid] = outcome

    def pytest_sessionfinish(self, session) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", encoding="utf-8") as handle:
            for test, outcome in self.outcomes.items():
                handle.write(json.dumps({"test": test, "outcome": outcome}) + "\n")


# ---- the runner --------------------------------------------------------------------------------------------------

def read_outcomes(path: Path) -> dict[str, str] | None:
    """A run's outcomes file as {test: outcome}, None where the run wrote none."""
    if not path.is_file():
        return None
    return {row["test"]: row["outcome"] for row in map(json.loads, path.read_text().splitlines()) if row}


def summarize(runs: list[dict], outcomes: list[dict[str, str] | None]) -> dict:
    """The summary of runs (seed, exit status, seconds each) and their outcomes (None: the run wrote none).

    flaky: tests that passed (or xpassed) in one run and failed (or errored) in another; always_failed: tests that
    failed in every run that ran them; varied: other tests whose outcome changed (passed in one, skipped in
    another, say), listed but not counted as flaky."""
    by_test: dict[str, list[str | None]] = {}
    for k, run in enumerate(outcomes):
        for test, outcome in (run or {}).items():
            by_test.setdefault(test, [None] * len(outcomes))[k] = outcome
    flaky, always_failed, varied = [], [], []
    for test in sorted(by_test):
        seen = [o for o in by_test[test] if o is not None]
        tally = dict(Counter(seen))
        row = {"test": test, "outcomes": tally,
               "failed_in_seeds": [runs[k]["seed"] for k, o in enumerate(by_test[test]) if o in FAILED]}
        if set(seen) & PASSED and set(seen) & FAILED:
            flaky.append(row)
        elif seen and set(seen) <= FAILED:
            always_failed.append(row)
        elif len(set(seen)) > 1:
            varied.append(row)
    broken = [run["seed"] for run, found in zip(runs, outcomes) if found is None]
    return {"runs": runs, "tests": len(by_test), "flaky": flaky, "always_failed": always_failed, "varied": varied,
            "runs_without_outcomes": broken,
            "verdict": "flaky" if flaky else "failing" if always_failed or broken else "stable"}


def exit_status(summary: dict) -> int:
    return {"stable": 0, "flaky": 1, "failing": 2}[summary["verdict"]]


def markdown(summary: dict, command: str) -> str:
    """summary.md: the runs, then the flaky tests (and any that always failed, or changed outcome otherwise)."""
    lines = [f"# make flaky: {len(summary['runs'])} runs, {summary['tests']} tests, verdict "
             f"**{summary['verdict']}**", "", f"Each run: `{command}` with `--shuffle-seed` as below.", "",
             "| run | seed | exit | passed | failed | skipped | seconds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for k, run in enumerate(summary["runs"], 1):
        c = run["counts"]
        lines.append(f"| {k} | {run['seed']} | {run['exit']} | {c.get('passed', 0) + c.get('xpassed', 0)} | "
                     f"{c.get('failed', 0) + c.get('error', 0)} | {c.get('skipped', 0) + c.get('xfailed', 0)} | "
                     f"{run['seconds']:.0f} |")
    for title, key in (("Flaky: passed in one run, failed in another", "flaky"),
                       ("Failed in every run", "always_failed"), ("Other outcome changes (not flaky)", "varied")):
        rows = summary[key]
        lines += ["", f"## {title}: {len(rows)}", ""]
        if rows:
            lines += ["| test | outcomes | failed with seeds |", "| --- | --- | --- |"]
            lines += [f"| `{r['test']}` | {', '.join(f'{o} {n}' for o, n in sorted(r['outcomes'].items()))} | "
                      f"{', '.join(map(str, r['failed_in_seeds'])) or '-'} |" for r in rows]
    if summary["runs_without_outcomes"]:
        lines += ["", "Runs that wrote no outcomes (seeds): "
                  + ", ".join(map(str, summary["runs_without_outcomes"])) + "; see their run-K.log."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.flaky", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="how many runs (default 10)")
    parser.add_argument("--seed", type=int, default=None,
                        help="run K shuffles with SEED + K (default: a random SEED, recorded in the summary)")
    parser.add_argument("--xdist", default="2", help="pytest-xdist workers, -n (default 2)")
    parser.add_argument("--out", default="out/flaky", help="directory for summary.json, summary.md, run-K.*")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: pytest's arguments (markers, paths)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs: expected 1 or more")
    pytest_args = [a for a in args.pytest_args if a != "--"] if args.pytest_args[:1] == ["--"] else args.pytest_args
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("run-*.jsonl"), *out.glob("run-*.log"), out / "summary.json", out / "summary.md"]:
        stale.unlink(missing_ok=True)
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1_000_000)
    command = [sys.executable, "-m", "pytest", "-p", "harness.flaky", "-p", "no:cacheprovider",
               "-n", str(args.xdist), "--dist", "load", "-q", *pytest_args]
    shown = " ".join(["python", *command[1:]])
    runs, outcomes = [], []
    started = time.time()
    for k in range(1, args.runs + 1):
        seed = base + k - 1
        path = out / f"run-{k}.jsonl"
        began = time.time()
        with (out / f"run-{k}.log").open("w", encoding="utf-8") as log:
            rc = subprocess.call([*command, "--shuffle-seed", str(seed), "--outcomes", str(path)], stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        found = read_outcomes(path)
        counts = dict(Counter((found or {}).values()))
        runs.append({"seed": seed, "exit": rc, "seconds": round(time.time() - began, 1), "counts": counts,
                     "log": str(out / f"run-{k}.log")})
        outcomes.append(found)
        print(f"run {k}/{args.runs} seed {seed}: " + (", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
              or "no outcomes") + f" (exit {rc}) in {runs[-1]['seconds']:.0f}s", flush=True)
    summary = summarize(runs, outcomes)
    summary.update(command=shown, base_seed=base, seconds=round(time.time() - started, 1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary, shown))
    print(f"{len(summary['flaky'])} flaky, {len(summary['always_failed'])} failed in every run, "
          f"{summary['tests']} tests, {args.runs} runs in {time.time() - started:.0f}s: {summary['verdict']} "
          f"({out / 'summary.md'})")
    return exit_status(summary)


if __name__ == "__main__":
    sys.exit(main())
