"""The PNG of a comparison run: |Δ logprob| by position, one panel per scenario, one line per request.

The title says what was judged (engine, dtype, baseline, checkpoint, date), and every scenario that was not checked
(skipped, or the engine raised) gets a labelled empty panel with the reason: a figure that leaves them out looks
like a complete run.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

from .compare import Report

# Exact agreement plots at this floor on the log axis.
FLOOR = 1e-17
COLUMNS = 3
REASON_WIDTH = 60          # characters per line of a skip reason in its panel


def plot_deltas(reports: Sequence[Report], path: str | Path, *, title: str = "",
                unchecked: Sequence[tuple[str, str, str]] = ()) -> Path:
    """Write the figure (`figure`) to `path` and return the path. The file is written beside `path` and renamed
    over it, so a half-written PNG is never left behind."""
    import matplotlib.pyplot as plt

    fig = figure(reports, title=title, unchecked=unchecked)
    path = Path(path)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(partial, dpi=90, format="png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        plt.close(fig)
    return path


def figure(reports: Sequence[Report], *, title: str = "", unchecked: Sequence[tuple[str, str, str]] = ()):
    """The matplotlib figure (Agg backend, no display needed): a panel per report, then a labelled empty panel per
    unchecked scenario, given as (scenario, verdict, reason) with verdict SKIP or ERROR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(reports) + len(unchecked)
    cols = min(COLUMNS, max(1, panels))
    rows = max(1, math.ceil(panels / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows + 0.6), squeeze=False,
                             layout="constrained")
    if title:
        fig.suptitle(title, fontsize=10)
    for ax, report in zip(axes.flat, reports):
        _draw_report(ax, report)
    for ax, (scenario, verdict, reason) in zip(axes.flat[len(reports):], unchecked):
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{scenario}: {verdict}", fontsize=9, color="dimgray" if verdict == "SKIP" else "red")
        ax.text(0.5, 0.5, textwrap.fill(reason, REASON_WIDTH), ha="center", va="center", fontsize=7,
                transform=ax.transAxes)
    for ax in axes.flat[panels:]:
        ax.set_axis_off()
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no scenario selected", ha="center", va="center", transform=axes[0, 0].transAxes)
    return fig


def _draw_report(ax, report: Report) -> None:
    for comp in report.comparisons:
        ax.plot(comp.positions, [max(d, FLOOR) for d in comp.deltas], marker=".", linewidth=0.8,
                label=comp.request_id)
    ax.axhline(max(report.meta.get("budget", FLOOR), FLOOR), color="black", linestyle="--", linewidth=1,
               label="budget" if "budget_floor" not in report.meta else "largest position budget")
    if "budget_floor" in report.meta:               # the quantile rule: most positions' budget
        ax.axhline(max(report.meta["budget_floor"], FLOOR), color="grey", linestyle=":", linewidth=1,
                   label="budget floor (quantile rule)")
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
