"""report.json of `bamba-harness compare`: a versioned document that says what was checked, on what, and how it
ended (docs/report-format.md describes it field by field).

Why this much provenance: a report is read later, away from the run. Without the time, the commit, the versions and
the device, a stale report in the same --out directory looks exactly like a fresh one, and a run that checked nothing
(every scenario skipped) looks like a run that passed. So the document carries an overall verdict and the counts, is
written atomically (a reader never sees half a file), and a run cut short says "interrupted" rather than leaving a
report that looks complete.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "bamba-harness/report"
SCHEMA_VERSION = 2
VERDICTS = ("pass", "fail", "nothing-checked", "interrupted")
# Packages whose versions decide the numbers (None where one is not installed).
VERSIONED_PACKAGES = ("bamba-harness", "torch", "triton", "transformers")
GIT_TIMEOUT_S = 5.0


def counts(entries: list[dict]) -> dict[str, int]:
    """Scenario entries by outcome: each entry has "verdict" PASS, FAIL, SKIP or ERROR."""
    tally = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    key = {"PASS": "passed", "FAIL": "failed", "ERROR": "error", "SKIP": "skipped"}
    for entry in entries:
        tally[key[entry["verdict"]]] += 1
    return tally


def verdict(tally: dict[str, int], *, interrupted: bool = False) -> str:
    """The run's verdict: "interrupted" when it was cut short (whatever completed), "fail" when a scenario failed
    or raised, "nothing-checked" when no scenario was checked (all skipped, or none selected), else "pass"."""
    if interrupted:
        return "interrupted"
    if tally["failed"] or tally["error"]:
        return "fail"
    return "pass" if tally["passed"] else "nothing-checked"


def git_state(repo: Path) -> dict[str, str | bool | None]:
    """The commit checked out at `repo` and whether the tree differs from it; None for both where `repo` is not a
    git checkout (an installed wheel), git is missing or does not answer within GIT_TIMEOUT_S."""

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                 timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return run.stdout if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit is not None else None
    return {"commit": commit.strip() if commit else None, "dirty": bool(status.strip()) if status is not None else None}


def versions() -> dict[str, str | None]:
    """python and the packages of VERSIONED_PACKAGES, from importlib.metadata (no package is imported)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the processor (or "cpu" where the platform does not say)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def iso_utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def build(settings: dict, entries: list[dict], *, repo: Path, started: float, finished: float,
          interrupted: bool = False, not_run: list[str] | None = None) -> dict:
    """The whole document: schema, verdict and counts first (what a reader wants), then when, on what, and how,
    then `settings` (engine, checkpoint, dtype, ... as the command line gave them), then the scenario entries.
    not_run: the selected scenarios an interrupted run did not reach."""
    tally = counts(entries)
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "verdict": verdict(tally, interrupted=interrupted), "counts": tally,
        "started_at": iso_utc(started), "finished_at": iso_utc(finished), "duration_s": round(finished - started, 3),
        "command": list(sys.argv), "git": git_state(repo), "versions": versions(),
        "device_name": device_name(str(settings["device"])),
        **settings,
        "not_run": list(not_run or []),
        "scenarios": entries,
    }


def write_atomic(path: Path, document: dict) -> Path:
    """Write the JSON to a temporary file beside `path`, then rename it over `path`: a reader (or a run killed
    mid-write) sees the old file or the new one, never a truncated one."""
    path = Path(path)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False, encoding="utf-8")
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)       # the mode of a file opened plainly, not mkstemp's 0600
        with handle:
            json.dump(document, handle, indent=1, default=str)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return path


def format_duration(seconds: float) -> str:
    """9m12s, 1h03m07s; under a minute with one decimal (4.2s)."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def summary_line(tally: dict[str, int], seconds: float) -> str:
    """"21 PASS, 1 SKIP, 0 FAIL, 0 ERROR in 9m12s": the last line of a run."""
    return (f"{tally['passed']} PASS, {tally['skipped']} SKIP, {tally['failed']} FAIL, {tally['error']} ERROR "
            f"in {format_duration(seconds)}")


def format_table(entries: list[dict]) -> str:
    """The printed table, one row per scenario entry, then the skip reasons and the errors."""
    header = ("scenario", "requests", "max |Δ|", "budget", "mean KL", "top-1", "first divergence", "verdict")
    rows = []
    for e in entries:
        if e["verdict"] in ("SKIP", "ERROR"):
            rows.append((e["scenario"], "-", "-", "-", "-", "-", "-", e["verdict"]))
            continue
        first = e["first_divergence"]
        budget = (f"{e['budget_floor']:.3g}..{e['budget']:.3g}" if e.get("budget_rule") == "quantile"
                  else f"{e['budget']:.3g}")                   # the quantile rule: its floor up to its largest
        rows.append((e["scenario"], len(e["requests"]), f"{e['max_abs_delta']:.3g}", budget,
                     f"{e['mean_kl']:.3g}", f"{e['top1_agreement']:.1%}", f"{first[0]}@{first[1]}" if first else "-",
                     e["verdict"]))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)] + [0]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    invariance = [line for e in entries if e.get("invariance") for line in invariance_lines(e)]
    if invariance:
        lines += ["", "invariance (each configuration's results bit for bit against the baseline configuration's):",
                  *invariance]
    skipped = [f"  {e['scenario']}: {'; '.join(e['skipped'])}" for e in entries if e["verdict"] == "SKIP"]
    if skipped:
        lines += ["", "skipped:", *skipped]
    for e in entries:
        if e["verdict"] == "ERROR":
            lines += ["", f"{e['scenario']}: {e['error']}"]
    return "\n".join(lines)


def invariance_lines(entry: dict) -> list[str]:
    """An invariance scenario's two parts, for the printed table (a row shows max |Δ| and the like of its baseline
    configuration against the oracle only): the oracle's verdict on the baseline, and how many configurations were
    compared and came out identical or different (with the first difference), and which were left out and why."""
    inv = entry["invariance"]
    configs = inv["configurations"]
    compared = [c for c in configs if c["status"] in ("identical", "differs")]
    differ = [c["name"] for c in compared if c["status"] == "differs"]
    line = (f"  {entry['scenario']}: baseline {inv['baseline']} against the oracle: "
            f"{'PASS' if inv['oracle_passed'] else 'FAIL'}; {len(compared)} configurations compared with it: "
            f"{len(compared) - len(differ)} identical, {len(differ)} differ" + (f" ({', '.join(differ)})" if differ
                                                                                 else ""))
    lines = [line]
    if inv["first_difference"]:
        lines.append(f"    first difference: {inv['first_difference']['message']}")
    for name, reasons in inv["left_out"].items():
        lines.append(f"    left out: {name}: {'; '.join(reasons)}")
    return lines


def figure_labels(document: dict) -> dict:
    """plot_deltas' title (what was judged against what, on which checkpoint and device, when) and its unchecked
    scenarios (scenario, SKIP or ERROR, the reason), from a finished report."""
    baseline = document["baseline"]
    against = f" vs {baseline['engine']} {baseline['dtype']}" if baseline["kind"] == "engine" else ""
    title = (f"{document['engine']} {document['dtype']}{against} on {Path(document['checkpoint']).name} "
             f"({document['device']}), {document['started_at']}")
    unchecked = [(e["scenario"], e["verdict"], "; ".join(e["skipped"]) if e["verdict"] == "SKIP" else e["error"])
                 for e in document["scenarios"] if e["verdict"] in ("SKIP", "ERROR")]
    return {"title": title, "unchecked": unchecked}
