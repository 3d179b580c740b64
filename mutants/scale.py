"""The judge's power at real width: engine mutants judged end to end on a real-width model, and the clean engine's
false-failure rate on the same workload (`make mutants-scale`, on a CUDA machine; docs/scale.md).

    python -m mutants.scale [--model bamba9b-2layer] [--dtypes bfloat16,float32] [--scenarios ID,...]
                            [--clean-seeds 20] [--only NAME,...] [--jobs 4] [--out out/mutants-scale]

1. The model (harness/scale.py) is written to --model-dir unless it is there.
2. The clean tree judges the vendored engine on every selected scenario, in every dtype, for each of
   --clean-seeds prompt seeds (the false-failure measurement: every one of these runs must pass), and saves the
   oracle's results (harness/runner.py, Oracle.save_cache) so that no mutant process loads the fp64 model again.
3. Each engine mutant of mutants/defs (one that edits vendored/) is planted in its own scratch copy of the tree
   (mutants/run.py's copy) and judged on seed 0 in every dtype, --jobs processes at a time on the one GPU.
   Mutants that edit only the oracle or the judge (reference/, harness/) are not engine bugs: a scale run uses
   the unmutated oracle and judge, and they are listed as such. A mutant whose every judged number (each
   position's |Δ| in every scenario and dtype) is bit-identical to the clean engine's did not change what runs
   on the GPU for this workload: "not live here". A mutant that needs more GPUs than there are is listed so.
Outcomes per dtype: killed (some scenario FAILED or the engine raised: which, and by which check: "logprob" (the
max budget), "token", "excess" (the noise-floor test), "shape", "error"), survived (with its largest max |Δ| /
budget and largest excess ratio beside the clean runs' largest, the noise floor).
Writes report.json, table.md and power.png to --out; exit status 0 only if every clean run passed. With --resume
the complete results already in --out are kept, so a measurement longer than one session's GPU call can be carried
from call to call (its --out copied back and forth) and finished.
The worker mode (--worker) is what runs inside each tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIOS = ("batching-together,chunked_prefill-budget257-Q256,chunked_prefill-capped-budget640-cap256-Q256,"
                     "preemption-blocks7x128-Q256,cudagraph-on")
ENGINE_DIRS = ("vendored/",)


# ---- the worker: runs inside a tree (the clean one or a mutant's scratch copy) -----------------------------------
def _digest(report) -> str:
    """A hash of every judged number of a report: each position's |Δ| and top-1 agreement, in order."""
    h = hashlib.sha256()
    for c in report.comparisons:
        h.update(repr((c.request_id, c.positions, c.deltas, c.top1_agree)).encode())
    return h.hexdigest()[:16]


def worker(args) -> int:
    from harness.cli import prepare_environment

    prepare_environment()
    import torch

    from harness.runner import Oracle, ScenarioSkipped, check_scenario
    from harness.scenarios import PromptSource, build_scenarios
    from reference.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((Path(args.checkpoint) / "config.json").read_text()))
    by_id = {s.id: s for s in build_scenarios(cfg)}
    unknown = [s for s in args.scenarios.split(",") if s not in by_id]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; this model has {', '.join(by_id)}")
    oracle = Oracle(args.checkpoint, device=args.device)
    if args.cache and Path(args.cache).is_file():
        oracle.load_cache(args.cache)
    out = open(args.results, "a")
    for seed in range(args.seed_start, args.seed_start + args.seeds):
        source = PromptSource(cfg.vocab_size, seed=seed)
        for sid in args.scenarios.split(","):
            for dtype in args.dtypes.split(","):
                row = dict(scenario=sid, dtype=dtype, seed=seed)
                start = time.monotonic()
                try:
                    report = check_scenario("vendored", by_id[sid], oracle=oracle, source=source, dtype=dtype,
                                            device=args.device)
                    excess = report.meta.get("excess", {}).get("classes", {})
                    row.update(verdict="PASS" if report.passed else "FAIL",
                               checks=sorted({f.what for f in report.failures}),
                               first_failure=report.failures[0].message()[:300] if report.failures else "",
                               max_delta=report.max_delta, budget=report.meta["budget"],
                               top1=report.top1_agreement, mean_kl=report.mean_kl,
                               excess={k: v["ratio"] for k, v in excess.items() if v["judged"]},
                               digest=_digest(report))
                except ScenarioSkipped as skip:
                    row.update(verdict="SKIP", reason=str(skip))
                except Exception as err:                      # an engine that raises is caught, as the CLI says
                    row.update(verdict="ERROR", checks=["error"], first_failure=f"{type(err).__name__}: {err}"[:300],
                               trace=traceback.format_exc()[-1500:])
                row["seconds"] = round(time.monotonic() - start, 2)
                out.write(json.dumps(row) + "\n")
                out.flush()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    if args.save_cache:
        oracle.save_cache(args.save_cache)
    return 0


# ---- the driver --------------------------------------------------------------------------------------------------
def _run_worker(tree: Path, results: Path, log: Path, *, checkpoint: Path, scenarios: str, dtypes: str, seeds: int,
                device: str, cache: Path | None, save_cache: Path | None, timeout: int, seed_start: int = 0) -> int:
    cmd = [sys.executable, "-m", "mutants.scale", "--worker", "--checkpoint", str(checkpoint), "--scenarios",
           scenarios, "--dtypes", dtypes, "--seeds", str(seeds), "--seed-start", str(seed_start), "--device", device,
           "--results", str(results)]
    if cache is not None:
        cmd += ["--cache", str(cache)]
    if save_cache is not None:
        cmd += ["--save-cache", str(save_cache)]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    with open(log, "w") as handle:
        try:
            return subprocess.run(cmd, cwd=tree, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\nno result after {timeout} s\n")
            return -1


def _read(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.is_file() else []


def classify_mutant(mutant) -> str | None:
    """Why a mutant is not judged at scale, or None when it is an engine mutant to judge."""
    files = {e.file for e in mutant.edits}
    if not any(f.startswith(ENGINE_DIRS) for f in files):
        return f"not an engine mutant: edits {', '.join(sorted(files))} (the oracle or the judge, used unmutated here)"
    if mutant.name.startswith("tp-"):
        import torch

        if torch.cuda.device_count() < 2:
            return "needs 2 GPUs (tensor parallel) and this machine has fewer"
    return None


def summarise(name: str, rows: list[dict], clean: list[dict], dtypes: list[str]) -> dict:
    """Per dtype: killed / survived / not live, by which scenarios and checks, with its effect beside the noise."""
    clean_digest = {(r["scenario"], r["dtype"]): r.get("digest") for r in clean if r["seed"] == 0}
    out = {"name": name}
    live = any(r.get("digest") != clean_digest.get((r["scenario"], r["dtype"])) for r in rows)
    out["live"] = live
    for dtype in dtypes:
        mine = [r for r in rows if r["dtype"] == dtype]
        killed = [r for r in mine if r["verdict"] in ("FAIL", "ERROR")]
        noise = [r for r in clean if r["dtype"] == dtype and r["verdict"] == "PASS"]
        out[dtype] = {
            "outcome": ("killed" if killed else "survived" if live else "not live") if mine else "not run",
            "by": sorted({f"{r['scenario']}:{'/'.join(r.get('checks', []))}" for r in killed}),
            "max_delta_over_budget": max((r["max_delta"] / r["budget"] for r in mine if "max_delta" in r),
                                         default=None),
            "max_excess_ratio": max((v for r in mine for v in r.get("excess", {}).values()), default=None),
            "clean_max_delta_over_budget": max((r["max_delta"] / r["budget"] for r in noise), default=None),
            "clean_max_excess_ratio": max((v for r in noise for v in r.get("excess", {}).values()), default=None),
            "first_failure": killed[0].get("first_failure", "") if killed else "",
        }
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(clean: list[dict], mutants: list[dict], skipped: dict[str, str], dtypes: list[str]) -> str:
    lines = ["## Clean runs (false failures)", "", "| scenario | dtype | runs | failed | max |Δ|/budget | "
             "largest excess ratio |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for key in sorted({(r["scenario"], r["dtype"]) for r in clean}):
        rows = [r for r in clean if (r["scenario"], r["dtype"]) == key and r["verdict"] != "SKIP"]
        failed = [r for r in rows if r["verdict"] != "PASS"]
        lines.append(f"| {key[0]} | {key[1]} | {len(rows)} | {len(failed)} | "
                     f"{_fmt(max((r['max_delta'] / r['budget'] for r in rows if 'max_delta' in r), default=None))} | "
                     f"{_fmt(max((v for r in rows for v in r.get('excess', {}).values()), default=None))} |")
    lines += ["", "## Engine mutants", "", "| mutant | " + " | ".join(dtypes) + " | effect (max |Δ|/budget; excess "
              "ratio) per dtype |", "| --- | " + " | ".join("---" for _ in dtypes) + " | --- |"]
    for m in mutants:
        cells = [f"{m[d]['outcome']}" + (f" ({', '.join(m[d]['by'][:3])})" if m[d]["by"] else "") for d in dtypes]
        effect = "; ".join(f"{d}: {_fmt(m[d]['max_delta_over_budget'])}, {_fmt(m[d]['max_excess_ratio'])} "
                           f"(clean {_fmt(m[d]['clean_max_delta_over_budget'])}, "
                           f"{_fmt(m[d]['clean_max_excess_ratio'])})" for d in dtypes)
        lines.append(f"| {m['name']} | " + " | ".join(cells) + f" | {effect} |")
    live = [m for m in mutants if m["live"]]
    for d in dtypes:
        kills = sum(m[d]["outcome"] == "killed" for m in live)
        lines.append(f"\n{d}: {kills} of {len(live)} live engine mutants killed"
                     + (f" ({100 * kills / len(live):.0f}%)" if live else ""))
    if skipped:
        lines += ["", "## Not judged here", ""] + [f"- {name}: {why}" for name, why in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def plot(mutants: list[dict], dtypes: list[str], path: Path) -> bool:
    """Each live mutant's largest excess ratio per dtype beside the clean runs' largest (the noise floor)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    live = [m for m in mutants if m["live"]]
    if not live:
        return False
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 0.3 * len(live) + 2), squeeze=False)
    for ax, d in zip(axes[0], dtypes):
        values = [m[d]["max_delta_over_budget"] or 0.0 for m in live]
        colors = ["tab:red" if m[d]["outcome"] == "killed" else "tab:gray" for m in live]
        ax.barh([m["name"] for m in live], values, color=colors)
        ax.axvline(1.0, color="black", lw=1, label="budget")
        clean = live[0][d]["clean_max_delta_over_budget"]
        if clean is not None:
            ax.axvline(clean, color="tab:blue", ls="--", lw=1, label="clean runs' largest")
        ax.set_xscale("log")
        ax.set_title(f"{d}: max |Δ| / budget (red: killed)")
        ax.legend(loc="lower right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mutants.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--save-cache", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seed-start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bamba9b-2layer", help="a scale model (harness/scale.py)")
    parser.add_argument("--model-dir", default=None, help="where the model is (written there if absent); "
                                                          "default: a directory under --out")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help="scenario ids")
    parser.add_argument("--clean-seeds", type=int, default=20, help="prompt seeds of the clean runs")
    parser.add_argument("--only", default=None, help="comma-separated mutant names")
    parser.add_argument("--jobs", type=int, default=4, help="mutant processes at a time on the GPU")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per worker process")
    parser.add_argument("--out", default="out/mutants-scale")
    parser.add_argument("--resume", action="store_true",
                        help="keep --out's results: runs (clean seeds, mutants) whose results are complete there and "
                             "the oracle cache are reused, so a long measurement can span several calls")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    from tqdm import tqdm

    from harness import scale

    from .mutant import load_all
    from .run import copy_tree

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(args.model_dir or out / args.model)
    if not (checkpoint / "config.json").is_file():
        scale.write_checkpoint(args.model, checkpoint, device=args.device)
    dtypes = args.dtypes.split(",")
    chosen = load_all()
    if args.only:
        names = set(args.only.split(","))
        missing = names - {m.name for m in chosen}
        if missing:
            raise SystemExit(f"--only: no mutants named {sorted(missing)}")
        chosen = [m for m in chosen if m.name in names]
    skipped = {m.name: why for m in chosen if (why := classify_mutant(m))}
    judged = [m for m in chosen if m.name not in skipped]

    cache = out / "oracle-cache.pt"
    n_scen = len(args.scenarios.split(","))
    runs_per_tree = n_scen * len(dtypes)

    def complete(results: Path) -> bool:
        return args.resume and len(_read(results)) == runs_per_tree

    if not args.resume:
        for stale in [*out.glob("*.jsonl"), *out.glob("*.log"), cache]:
            stale.unlink(missing_ok=True)
    for partial in out.glob("*.jsonl"):                     # a run cut short starts again
        if not complete(partial):
            partial.unlink()
    print(f"clean runs: {args.clean_seeds} seeds × {n_scen} scenarios × {len(dtypes)} dtypes; seed 0 first (its "
          f"oracle results are every mutant's)", flush=True)
    status = 0
    if not (complete(out / "clean-seed0.jsonl") and cache.is_file()):
        (out / "clean-seed0.jsonl").unlink(missing_ok=True)
        status = _run_worker(ROOT, out / "clean-seed0.jsonl", out / "clean-seed0.log", checkpoint=checkpoint,
                             scenarios=args.scenarios, dtypes=args.dtypes, seeds=1, device=args.device, cache=None,
                             save_cache=cache, timeout=args.timeout)
    if status != 0 or not cache.is_file():
        print(f"the clean run of seed 0 ended with status {status}: see {out / 'clean-seed0.log'}", file=sys.stderr)
    seed0 = _read(out / "clean-seed0.jsonl")
    scratch = Path(tempfile.mkdtemp(prefix="mutants-scale-"))
    summaries, statuses = [], [status]

    def clean_seed(seed):
        if complete(out / f"clean-seed{seed}.jsonl"):
            return
        statuses.append(_run_worker(ROOT, out / f"clean-seed{seed}.jsonl", out / f"clean-seed{seed}.log",
                                    checkpoint=checkpoint, scenarios=args.scenarios, dtypes=args.dtypes, seeds=1,
                                    seed_start=seed, device=args.device, cache=None, save_cache=None,
                                    timeout=args.timeout))

    def one(mutant):
        results = out / f"mutant-{mutant.name}.jsonl"
        if complete(results):
            return summarise(mutant.name, _read(results), seed0, dtypes)
        tree = scratch / mutant.name
        copy_tree(ROOT, tree)
        mutant.apply(tree)
        _run_worker(tree, results, out / f"mutant-{mutant.name}.log", checkpoint=checkpoint,
                    scenarios=args.scenarios, dtypes=args.dtypes, seeds=1, device=args.device,
                    cache=cache if cache.is_file() else None, save_cache=None, timeout=args.timeout)
        shutil.rmtree(tree, ignore_errors=True)
        return summarise(mutant.name, _read(results), seed0, dtypes)

    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(one, m) for m in judged]
            futures += [pool.submit(clean_seed, seed) for seed in range(1, args.clean_seeds)]
            for future in tqdm(as_completed(futures), total=len(futures), desc="mutants and clean seeds",
                               unit="run"):
                result = future.result()
                if result is not None:
                    summaries.append(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    clean = [r for seed in range(args.clean_seeds) for r in _read(out / f"clean-seed{seed}.jsonl")]
    for m in summaries:                 # the noise floor: every clean seed, now that all have run
        for d in dtypes:
            noise = [r for r in clean if r["dtype"] == d and r["verdict"] == "PASS"]
            m[d]["clean_max_delta_over_budget"] = max((r["max_delta"] / r["budget"] for r in noise), default=None)
            m[d]["clean_max_excess_ratio"] = max((v for r in noise for v in r.get("excess", {}).values()),
                                                 default=None)
    status = max(statuses, key=abs)
    summaries.sort(key=lambda m: m["name"])
    (out / "table.md").write_text(table(clean, summaries, skipped, dtypes))
    plot(summaries, dtypes, out / "power.png")
    report = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=args.model,
                  scenarios=args.scenarios.split(","), dtypes=dtypes, clean_seeds=args.clean_seeds,
                  clean=clean, mutants=summaries, not_judged=skipped)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print((out / "table.md").read_text())
    clean_failed = [r for r in clean if r["verdict"] not in ("PASS", "SKIP")]
    return 0 if clean and not clean_failed and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
