"""The PNG of a comparison run: |Δ logprob| by position, one panel per scenario, one line per request."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .compare import Report

# Exact agreement plots at this floor on the log axis.
FLOOR = 1e-17


def plot_deltas(reports: Sequence[Report], path: str | Path) -> Path:
    """Write the figure to `path` (Agg backend, no display needed) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, max(1, len(reports)))
    rows = math.ceil(len(reports) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(reports):]:
        ax.set_visible(False)
    for ax, report in zip(axes.flat, reports):
        for comp in report.comparisons:
            ax.plot(comp.positions, [max(d, FLOOR) for d in comp.deltas], marker=".", linewidth=0.8,
                    label=comp.request_id)
        ax.axhline(max(report.meta.get("budget", FLOOR), FLOOR), color="black", linestyle="--", linewidth=1,
                   label="budget")
        failed = [(f.position, abs(f.candidate_logprob - f.baseline_logprob)) for f in report.failures
                  if f.what == "logprob"]
        if failed:
            ax.scatter(*zip(*[(p, max(d, FLOOR)) for p, d in failed]), color="red", marker="x", zorder=3,
                       label="outside budget")
        ax.set_yscale("log")
        ax.set_title(f"{report.scenario}: {'PASS' if report.passed else 'FAIL'}", fontsize=9)
        ax.set_xlabel("position")
        ax.set_ylabel("|Δ logprob|")
        ax.legend(fontsize=6, loc="best", ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
