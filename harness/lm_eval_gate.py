"""`make lm-eval`: lm-eval tasks through the oracle and through candidate engines; one table; exit 1 when a candidate
does not score what its oracle scores.

    python -m harness.lm_eval_gate [--checkpoint DIR] [--tasks bamba_tiny] [--include-path fixtures/tasks] \\
        [--candidate engine=vendored,max_num_batched_tokens=128 ...] [--oracle engine=reference] [--limit N]

The gate, per task and metric (fixtures/tasks/README.md says why):
- accuracy (acc, acc_norm, exact_match, under any filter): the candidate's accuracy must lie inside the 95% Wilson
  score interval of the oracle's (k correct of the n items both answered);
- perplexity (any metric named *perplexity): |candidate / oracle - 1| <= 0.5%;
- anything else (bits_per_byte, ...) is reported without a verdict.
A candidate of engine transformers on a checkpoint with mamba_n_groups > 1 is judged against the oracle run with
gated_norm=full, the model transformers computes (docs/findings.md); every other candidate against the oracle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS_DIR = REPO_ROOT / "fixtures" / "tasks"
DEFAULT_CHECKPOINT = REPO_ROOT / "fixtures" / "tiny-bamba"
WILSON_Z = 1.959963984540054          # two-sided 95%
PERPLEXITY_RTOL = 0.005
ACCURACY_METRICS = frozenset({"acc", "acc_norm", "exact_match"})


def wilson_interval(successes: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion successes/n (n >= 1)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: expected 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Verdict:
    engine: str
    task: str
    metric: str
    n: int
    oracle: float
    candidate: float
    allowed: str
    verdict: str          # PASS, FAIL or INFO

    @property
    def delta(self) -> float:
        return self.candidate - self.oracle


def judge(engine: str, task: str, metric: str, n: int, oracle: float, candidate: float) -> Verdict:
    """One metric of one task: the candidate's value against the oracle's, by the rule of its kind."""
    base = metric.split(",")[0]
    if base in ACCURACY_METRICS:
        successes = round(oracle * n)
        lo, hi = wilson_interval(successes, n)
        ok = lo - 1e-12 <= candidate <= hi + 1e-12
        return Verdict(engine, task, metric, n, oracle, candidate, f"[{lo:.3f}, {hi:.3f}]", "PASS" if ok else "FAIL")
    if base.endswith("perplexity"):
        ok = abs(candidate / oracle - 1) <= PERPLEXITY_RTOL
        return Verdict(engine, task, metric, n, oracle, candidate, f"±{PERPLEXITY_RTOL:.1%} rel",
                       "PASS" if ok else "FAIL")
    return Verdict(engine, task, metric, n, oracle, candidate, "-", "INFO")


def scores(results: dict) -> dict[str, tuple[int, dict[str, float]]]:
    """task -> (items evaluated, {metric: value}) from lm-eval's results (stderr entries left out)."""
    out = {}
    for task, entry in results["results"].items():
        metrics = {k: float(v) for k, v in entry.items()
                   if "," in k and "_stderr," not in k and isinstance(v, (int, float))}
        out[task] = (int(entry["sample_len"]), metrics)
    return out


def parse_model_args(text: str) -> dict:
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(text)


def label(args: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in args.items() if k != "checkpoint")


def oracle_for(candidate: dict, oracle: dict, checkpoint: Path) -> dict:
    """The oracle a candidate is judged against (transformers' full-width gated norm when G > 1, see above)."""
    from reference.config import ModelConfig

    if candidate.get("engine") == "transformers" and ModelConfig.from_json(checkpoint).mamba_n_groups > 1:
        return {**oracle, "gated_norm": "full"}
    return dict(oracle)


def evaluate(model_args: dict, *, tasks: list[str], task_manager, limit, device: str, batch_size: int):
    """lm-eval's simple_evaluate on one engine; (scores, seconds)."""
    import lm_eval

    from .lm_eval import BambaHarnessLM

    start = time.perf_counter()
    lm = BambaHarnessLM(**{"device": device, "batch_size": batch_size, **model_args})
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit,
                                          bootstrap_iters=0, log_samples=False, verbosity="WARNING")
    finally:
        lm.close()
    return scores(results), time.perf_counter() - start


def _format(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    from .cli import prepare_environment

    parser = argparse.ArgumentParser(prog="python -m harness.lm_eval_gate", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--tasks", default="bamba_tiny", help="comma-separated lm-eval tasks, groups or tags")
    parser.add_argument("--include-path", default=str(DEFAULT_TASKS_DIR), help="lm-eval --include_path")
    parser.add_argument("--oracle", default="engine=reference", help="model_args of the oracle")
    parser.add_argument("--candidate", action="append", default=None,
                        help="model_args of a candidate, repeatable (default: vendored at budget 128, transformers)")
    parser.add_argument("--limit", type=float, default=None, help="lm-eval --limit (items per task)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64, help="requests per engine call")
    parser.add_argument("--out", default="out/lm-eval", help="directory for report.json")
    args = parser.parse_args(argv)

    prepare_environment()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    checkpoint = Path(args.checkpoint)
    tasks = [t for t in args.tasks.split(",") if t]
    # lm-eval's own thousands of task files take a minute to index on a small CPU: only when a task is not local.
    task_manager = TaskManager(include_path=args.include_path, include_defaults=False)
    if not set(tasks) <= set(task_manager.all_tasks):
        task_manager = TaskManager(include_path=args.include_path)
    candidates = [parse_model_args(c) for c in (args.candidate or ["engine=vendored,max_num_batched_tokens=128",
                                                                   "engine=transformers"])]
    oracle_args = parse_model_args(args.oracle)
    runs: dict[str, dict] = {}

    def run(model_args: dict) -> dict:
        key = label(model_args)
        if key not in runs:
            print(f"== {key}", file=sys.stderr, flush=True)
            got, seconds = evaluate({"checkpoint": str(checkpoint), **model_args}, tasks=tasks,
                                    task_manager=task_manager, limit=args.limit, device=args.device,
                                    batch_size=args.batch_size)
            runs[key] = {"model_args": model_args, "scores": got, "seconds": seconds}
        return runs[key]

    verdicts = []
    for candidate in candidates:
        oracle = run(oracle_for(candidate, oracle_args, checkpoint))
        got = run(candidate)
        for task, (n, metrics) in sorted(got["scores"].items()):
            oracle_n, oracle_metrics = oracle["scores"][task]
            if oracle_n != n:
                raise RuntimeError(f"{task}: the oracle scored {oracle_n} items, the candidate {n}")
            for metric, value in sorted(metrics.items()):
                verdicts.append(judge(label(candidate) + f" vs {label(oracle['model_args'])}", task, metric, n,
                                      oracle_metrics[metric], value))

    header = ("candidate vs oracle", "task", "metric", "n", "oracle", "candidate", "delta", "allowed", "verdict")
    print(_format([(v.engine, v.task, v.metric, v.n, f"{v.oracle:.6g}", f"{v.candidate:.6g}", f"{v.delta:+.4g}",
                    v.allowed, v.verdict) for v in verdicts], header))
    for key, entry in runs.items():
        print(f"{key}: {entry['seconds']:.0f}s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(checkpoint), "tasks": tasks, "limit": args.limit, "wilson_z": WILSON_Z,
              "perplexity_rtol": PERPLEXITY_RTOL, "runs": runs,
              "verdicts": [{**v.__dict__, "delta": v.delta} for v in verdicts]}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    failed = [v for v in verdicts if v.verdict == "FAIL"]
    print(f"\n{len(failed)} of {sum(v.verdict != 'INFO' for v in verdicts)} gated metrics failed; wrote "
          f"{out / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
