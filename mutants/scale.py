"""The judge's power at real width: engine mutants judged end to end on a real-width model, and the clean engine's
false-failure rate on the same workload (`make mutants-scale`, on a CUDA machine; docs/scale.md).

    python -m mutants.scale [--model bamba9b-2layer] [--dtypes bfloat16,float32] [--scenarios ID,...]
                            [--clean-seeds 20] [--clean-procs 1] [--only NAME,...] [--jobs 4] [--out DIR]
                            [--budget-rule max|quantile|quantile,max] [--budget-quantile 0.99]
                            [--resume] [--report-only]

1. The model (harness/scale.py) is written to --model-dir unless it is there.
2. The clean tree judges the vendored engine on every selected scenario, in every dtype, for each of
   --clean-seeds prompt seeds (the false-failure measurement: every one of these runs must pass). Seed 0 runs
   first and saves its oracle results (harness/runner.py, Oracle.save_cache) so that no mutant process loads the
   fp64 model; then seed 0 runs again in another process, against that cache, to show which runs are
   bit-reproducible. Seeds 1.. run from the start, beside seed 0, in --clean-procs processes, each loading the
   oracle once for its seeds.
3. Each engine mutant of mutants/defs (one that edits vendored/) is planted in its own scratch copy of the tree
   (mutants/run.py's copy) and judged on seed 0, --jobs processes at a time on the one GPU. Per dtype the
   scenarios run in the order given and stop at the first that kills it (that scenario is the one the table
   names); a mutant that survives runs them all. Mutants that edit only the oracle or the judge (reference/,
   harness/) are not engine bugs: a scale run uses the unmutated oracle and judge, and they are listed as such. A
   surviving mutant whose every judged number (each position's |Δ| in every scenario) is bit-identical to one of
   the clean engine's seed-0 runs did not change what runs on the GPU for this workload: "not live" in that dtype;
   one that differs only where the clean engine's two runs differ too is "undetermined". A mutant that needs more
   GPUs than there are is listed so.
4. Workers start only while a memory gate (MemoryGate: estimates in multiples of the checkpoint's size until
   measured: an oracle process by clean seed 0's peak, an engine process by the repeat of seed 0's) leaves room on
   the GPU, so that processes sharing it do not run each other out of memory. A mutant's worker (and
   the repeat of seed 0) is admitted as an engine process and answers every oracle question from seed 0's cache; a
   run the cache cannot answer (a sampled scenario whose draws the mutant changed) stops it, and it is started
   again, its finished runs kept, as an oracle process.
Outcomes per dtype: killed (a scenario FAILED or the engine raised: which, and by which check: "logprob" (the max
budget), "token", "excess" (the noise-floor test), "shape", "error"), survived (with its largest max |Δ| / budget and
largest excess ratio beside the clean runs' largest, the noise floor, and where it differs its mean |Δ|, mean KL and
top-1 misses as ratios to the clean engine's run of the same prompts: near 1 for a change of rounding alone, well
over 1 for a bug the rounding drowns). A run that ran out of GPU memory is neither:
it is not recorded, and runs again with --resume.
table.md also weighs excess ratio limits below compare's (LOWER_LIMITS) on the runs that recorded their classes'
moments: how many clean runs each would fail and how many survivors each would kill (limit_lines).
Writes report.json, table.md and power.png to --out; with several --budget-rule (comma-separated) every run is
judged by each, a mutant's scenarios stop only once every rule killed it, and the rules after the first get
report-RULE.json, table-RULE.md and power-RULE.png. Exit status 0 only if every clean run passed by every rule and
every run is complete. Each results file keeps its rows as they finish, so a measurement longer than one GPU call is finished
with --resume (--out carried from call to call); --report-only writes the table from what --out holds.
The worker mode (--worker) is what runs inside each tree.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Richest first: a mutant stops at the first scenario that kills it (capped chunked prefill has chunk and piece
# boundaries and continuing prefills side by side; cudagraph-on is the decode-heavy one). The next-to-last two carry
# the SSM state through hundreds of hand-offs: a budget of 3 tokens a step makes every prompt hundreds of pieces
# (state written and read back between each), and the long decode 128 single-token updates per request; a state that
# loses a little precision at each hand-off shows there and hides in the others' few. The sampled long decode (last:
# it is the one whose oracle a mutant may have to compute itself) judges each drawn continuation teacher-forced,
# where a greedy token's logprob hides a decode-state error: it killed the bug 128 greedy updates left at the noise
# floor (ssu-state-in-input-dtype). batching-long-generation (thousands of greedy updates, 131 s a clean run) was in
# this list for that bug; it did not kill it and killed nothing the others missed (sixth measurement,
# docs/scale.md), so it is no longer a default.


def default_scenarios(chunk_size: int) -> str:
    """The scenarios judged by default on a model of chunk size Q: two continuing prefills a step (pieces capped at
    Q in a budget of 5Q/2), CUDA graphs, batching, pieces of Q+1 and of 3 tokens, preemption with blocks of Q/2,
    a long decode, and a sampled one."""
    Q = chunk_size
    return (f"chunked_prefill-capped-budget{5 * Q // 2}-cap{Q}-Q{Q},cudagraph-on,batching-together,"
            f"chunked_prefill-budget{Q + 1}-Q{Q},preemption-blocks7x{Q // 2}-Q{Q},chunked_prefill-budget3-Q{Q},"
            "batching-long-decode,sampled-long-decode-T2")


DEFAULT_SCENARIOS = default_scenarios(256)                 # Bamba-9B's and Granite 4.0-H's Q
REPEAT = "clean-seed0-repeat.jsonl"         # seed 0 again, in another process: which clean runs are reproducible
DONE = {"done": True}                       # a results file's last line once its worker ran everything it had to
OUT_OF_MEMORY = 3                           # a worker's exit status when a run ran out of GPU memory
NEEDS_ORACLE = 4                            # a cache-only worker's exit status when a run needs the fp64 model
OOM_ATTEMPTS, OOM_WAIT_S = 6, 10            # a run short of GPU memory waits for other processes this often, this long
# GPU memory a worker takes, in multiples of the checkpoint's size on disk (bf16 for the scale models), until measured.
# Measured on an H200 with bamba9b-2layer (4.1 GB), peak reserved memory per process over all seven scenarios and
# both dtypes (2026-12-02, after LLMEngine.close freed a closed engine at once): a process holding the fp64 oracle
# and its bf16 / fp32 references 23-41 GB, one running only the engine 4-16 GB. Once clean seed 0's process has
# recorded its peak (torch counts it per process), an oracle process is admitted on that measurement instead.
ORACLE_PROCESS_X, ENGINE_PROCESS_X = 11, 4
MEASURED_MARGIN, CONTEXT_GB = 1.15, 1.0     # on a measured peak (the allocator's reserve): slack, and the CUDA context
GPU_MEMORY_SHARE = 0.9                      # of the memory free when the measurement starts


class MemoryGate:
    """Admits a worker only while the estimated memory of the workers running leaves room for its own estimate (a
    worker larger than the whole capacity runs alone). Without a CUDA device it admits everything."""

    def __init__(self, capacity: float) -> None:
        self.capacity, self.used = capacity, 0.0
        self._cond = threading.Condition()

    @classmethod
    def for_device(cls, device: str) -> "MemoryGate":
        import torch

        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return cls(float("inf"))
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return cls(GPU_MEMORY_SHARE * free)

    @contextmanager
    def hold(self, need):
        """Wait for room for `need` bytes (a number, or a function giving the current estimate: a worker waiting
        is admitted on the estimate of when it starts, see recheck) and hold them while the block runs."""
        current = need if callable(need) else (lambda: need)
        with self._cond:
            self._cond.wait_for(lambda: self.used + min(current(), self.capacity) <= self.capacity)
            taken = min(current(), self.capacity)
            self.used += taken
        try:
            yield
        finally:
            with self._cond:
                self.used -= taken
                self._cond.notify_all()

    def recheck(self) -> None:
        """The estimates changed (a measurement replaced one): waiting workers look again."""
        with self._cond:
            self._cond.notify_all()
ENGINE_DIRS = ("vendored/",)


# ---- the worker: runs inside a tree (the clean one or a mutant's scratch copy) -----------------------------------
def _digest(report) -> str:
    """A hash of every judged number of a report: each position's |Δ| and top-1 agreement, in order."""
    h = hashlib.sha256()
    for c in report.comparisons:
        h.update(repr((c.request_id, c.positions, c.deltas, c.top1_agree)).encode())
    return h.hexdigest()[:16]


MOMENTS = ("positions", "candidate_mean", "reference_mean", "candidate_var", "reference_var", "covariance")
LOWER_LIMITS = (1.4, 1.3, 1.25, 1.2, 1.1)    # excess ratio limits below compare's EXCESS_RATIO weighed in the table
LARGER_K = (2.5, 3.0, 4.0)                  # budget multipliers above the default k weighed in the table


def fails_at_k(row: dict, k: float, rule: str = "max") -> bool | None:
    """Whether a run judged by `rule` would fail with the budget's k at `k` (above the k it was judged at): a
    failure k does not widen (an engine that raised, a shape or excess failure) stays; a logprob or token failure
    stays where the run's k_to_pass exceeds k. A row recorded before k_to_pass was has from its largest |Δ| what
    its logprob failures need under the max rule (one scale E for every position: (max |Δ| - atol) / E, E from
    the budget k·E + atol at the default k and the dtype's atol; not where a routing allowance widened positions):
    its k_to_pass when logprob was its only failure, a lower bound when a token failed too (enough to say it still
    fails, not that it passes); a first failure that is a token's gives another lower bound from the margin its
    message prints (3 significant digits, taken 0.5% low), or fails at any k where the token was not among those
    the baseline listed; else None. A run that passed passes at any larger k."""
    if row.get("verdict") == "ERROR":
        return True
    if row.get("verdict") == "SKIP":
        return False
    judged = as_rule(row, rule)
    checks = set(judged.get("checks", []))
    if checks - {"logprob", "token"}:
        return True
    if not checks:
        return False
    needed = judged.get("k_to_pass")
    if needed is not None:
        return needed > k
    logprob = _k_from_largest_delta(judged) if "logprob" in checks else None
    if logprob is not None and logprob > k:
        return True
    if logprob is not None and checks == {"logprob"}:
        return False
    token = _k_from_token_margin(judged) if "token" in checks else None
    return True if token is not None and token > k else None


def _k_from_token_margin(row: dict) -> float | None:
    """A lower bound on what a max-rule row's token failures need of k: the margin its first failure's message
    prints, if that failure is a token's (fails_at_k)."""
    text = row.get("first_failure", "")
    if re.search(r"candidate token \d+: not among the \S+ \d+ most likely tokens", text):
        return math.inf             # its margin unknown to the judge: no k makes it a near-tie (compare.py)
    found = re.search(r"margin (\S+) > budget \S+, not a near-tie", text)
    scale = _max_rule_scale(row)
    return None if found is None or scale is None else (float(found.group(1)) * 0.995 - _atol(row)) / scale


def _k_from_largest_delta(row: dict) -> float | None:
    """What a max-rule row's logprob failures need of k, from its largest |Δ| and budget (fails_at_k)."""
    scale = _max_rule_scale(row)
    if scale is None or row.get("max_delta") is None or (row.get("routing_allowance") or {}).get("largest"):
        return None
    return (row["max_delta"] - _atol(row)) / scale


def _atol(row: dict) -> float | None:
    """The judge's atol for the row's dtype (None: a dtype it has none for)."""
    from harness.compare import ATOL

    return {str(d).removeprefix("torch."): v for d, v in ATOL.items()}.get(row.get("dtype"))


def _max_rule_scale(row: dict) -> float | None:
    """E of a row judged by the max rule at the default k, from its budget k·E + atol (None: a quantile-rule row,
    or one without a budget or a known atol)."""
    from harness.compare import DEFAULT_K

    atol = _atol(row)
    if "budget_floor" in row or atol is None or not row.get("budget") or row["budget"] <= atol:
        return None
    return (row["budget"] - atol) / DEFAULT_K


def excess_fails_at(row: dict, ratio: float) -> bool | None:
    """Whether the excess test with its ratio limit at `ratio` (the paired z and the ratio-alone bound as compare
    has them) fails one of the run's judged classes; None when the row has no excess_moments (a row written before
    they were recorded, or a dtype without the excess test)."""
    from harness.compare import excess_verdict_at

    moments = row.get("excess_moments")
    if not moments:
        return None
    atol = row.get("excess_atol") or 0.0
    return any(excess_verdict_at(dict(zip(MOMENTS, values)), ratio, atol)[1] for values in moments.values())


def _mean_delta(report) -> float | None:
    """The mean |Δ| over every compared position of a report (None: none compared)."""
    deltas = [d for c in report.comparisons for d in c.deltas]
    return sum(deltas) / len(deltas) if deltas else None


def beside_clean(mine: list[dict], clean: list[dict]) -> dict[str, tuple[float, float]]:
    """A mutant's effect in units of the clean engine's own error: over its rows whose clean run (same seed, scenario
    and dtype; the first run, not its repeat) is recorded, the range (smallest, largest) of its mean |Δ| over the
    clean run's ("mean"; from the excess test's "all" ratios for rows older than mean_delta), its mean KL over the
    clean run's ("kl") and its top-1 disagreements with the oracle over the clean run's ("top1 misses"). A bug that
    the rounding drowns reads as ratios well over 1 (its own error added to the rounding's), a change of rounding
    alone as ratios near 1. A measure whose clean value is 0 or missing is left out."""
    first = {}
    for r in clean:
        if not r.get("repeat"):
            first.setdefault((r.get("seed"), r["scenario"], r["dtype"]), r)

    def ratio(a, b):
        return a / b if a is not None and b else None

    found: dict[str, list[float]] = {}
    for r in mine:
        c = first.get((r.get("seed"), r["scenario"], r["dtype"]))
        if c is None or c.get("verdict") != "PASS":
            continue
        mean = ratio(r.get("mean_delta"), c.get("mean_delta"))
        if mean is None:
            mean = ratio(r.get("excess", {}).get("all"), c.get("excess", {}).get("all"))
        misses = ratio(None if r.get("top1") is None else 1.0 - r["top1"],
                       None if c.get("top1") is None else 1.0 - c["top1"])
        for key, value in (("mean", mean), ("kl", ratio(r.get("mean_kl"), c.get("mean_kl"))),
                           ("top1 misses", misses)):
            if value is not None and math.isfinite(value):
                found.setdefault(key, []).append(value)
    return {k: (min(v), max(v)) for k, v in found.items()}


def _out_of_memory(err: BaseException) -> bool:
    """A run that failed for want of GPU memory (another process on the GPU held it): not a verdict on the engine."""
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


class OracleNotCached(Exception):
    """A cache-only worker's run needed a reference model the oracle cache does not answer for."""


def cache_only_oracle(oracle_class):
    """A subclass of the harness's Oracle that answers only from the results and errors it loaded (load_cache) and
    raises OracleNotCached instead of loading a reference model. A mutant's process is admitted as an engine process
    (a few GB) on that promise; only a run whose requests seed 0 never ran (a sampled scenario's draws, once the
    mutant changed them) needs the fp64 model, and its worker is then started again as an oracle process."""

    class CacheOnlyOracle(oracle_class):
        def engine(self, dtype=None, ssm_state_dtype=None):
            raise OracleNotCached(f"the oracle cache holds no reference result for this run "
                                  f"({dtype or 'float64'}, SSM state {ssm_state_dtype or 'as the run'})")

    return CacheOnlyOracle


def _save_cache(oracle, path: Path) -> None:
    """The oracle's cache, written whole or not at all (a worker stopped at the time limit mid-write leaves the last
    one): seed 0 saves it after every run, so that --resume carries on from the last run, not from the start."""
    part = path.with_name(path.name + ".part")
    oracle.save_cache(part)
    os.replace(part, path)


def worker(args) -> int:
    from harness.cli import prepare_environment

    prepare_environment()
    import torch

    from harness.runner import Oracle, ScenarioSkipped, check_scenario
    from harness.scenarios import PromptSource, build_scenarios
    from reference.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((Path(args.checkpoint) / "config.json").read_text()))
    by_id = {s.id: s for s in build_scenarios(cfg)}
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in by_id]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; this model has {', '.join(by_id)}")
    rules = parse_rules(args.budget_rule)
    oracle = (cache_only_oracle(Oracle) if args.cache_only else Oracle)(
        args.checkpoint, device=args.device, budget_rule=rules[0], budget_quantile=args.budget_quantile,
        also_rules=rules[1:], memory_limit=args.oracle_memory)
    if args.cache and Path(args.cache).is_file():
        oracle.load_cache(args.cache)
    results = Path(args.results)
    done = {(r["seed"], r["scenario"], r["dtype"]): r for r in _read(results)}     # rows of an earlier call
    status = 0
    with open(results, "a") as out:
        for seed in range(args.seed_start, args.seed_start + args.seeds):
            source = PromptSource(cfg.vocab_size, seed=seed)
            for dtype in args.dtypes.split(","):
                for sid in scenarios:
                    if args.stop_at_kill and any(_killed(done.get((seed, s, dtype), {})) for s in scenarios):
                        break                           # killed in this dtype: the rest would add nothing
                    if (seed, sid, dtype) in done:
                        continue
                    row = dict(scenario=sid, dtype=dtype, seed=seed, **({"repeat": True} if args.repeat else {}))
                    stages, start = {}, time.monotonic()

                    def progress(stage, _count, stages=stages):
                        stages.setdefault(stage, round(time.monotonic() - start, 2))

                    if torch.cuda.is_available():
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        for attempt in range(OOM_ATTEMPTS):       # other processes on the GPU may hold its memory
                            try:
                                report = check_scenario("vendored", by_id[sid], oracle=oracle, source=source,
                                                        dtype=dtype, device=args.device, progress=progress)
                                break
                            except Exception as err:
                                if not _out_of_memory(err) or attempt == OOM_ATTEMPTS - 1:
                                    raise
                                print(f"seed {seed} {sid} {dtype}: out of GPU memory, again in {OOM_WAIT_S} s",
                                      flush=True)
                                del err
                                torch.cuda.empty_cache()
                                time.sleep(OOM_WAIT_S)
                        excess = report.meta.get("excess", {}).get("classes", {})
                        row.update(verdict="PASS" if report.passed else "FAIL",
                                   checks=sorted({f.what for f in report.failures}),
                                   first_failure=report.failures[0].message()[:300] if report.failures else "",
                                   max_delta=report.max_delta, mean_delta=_mean_delta(report),
                                   budget=report.meta["budget"],
                                   delta_over_budget=report.meta.get("max_delta_over_position_budget",
                                                                     report.max_delta / report.meta["budget"]),
                                   top1=report.top1_agreement, mean_kl=report.mean_kl,
                                   excess={k: v["ratio"] for k, v in excess.items() if v["judged"]},
                                   excess_positions={k: v["positions"] for k, v in excess.items() if v["judged"]},
                                   excess_z={k: v.get("paired_z") for k, v in excess.items() if v["judged"]},
                                   excess_over_ratio=sorted(k for k, v in excess.items() if v.get("over_ratio")),
                                   # what the excess test at another ratio limit would say of this run (limit_lines)
                                   excess_moments={k: [v[f] for f in MOMENTS] for k, v in excess.items()
                                                   if v["judged"]},
                                   excess_atol=report.meta.get("excess", {}).get("atol"),
                                   k_to_pass=report.meta.get("k_to_pass"),      # larger_k_lines weighs k on it
                                   digest=_digest(report), oracle_weights=oracle.weights_mode(),
                                   **({"routing_allowance": report.meta["routing_allowance"]}
                                      if "routing_allowance" in report.meta else {}))
                        if "budget_floor" in report.meta:
                            row["budget_floor"] = report.meta["budget_floor"]
                        if "rules" in report.meta:            # every rule's verdict on this one run (also_rules)
                            row["rules"] = {rule: dict(
                                verdict="PASS" if v["passed"] else "FAIL", checks=v["checks"],
                                first_failure=v["first_failure"], budget=v["budget"],
                                delta_over_budget=v["max_delta_over_position_budget"], k_to_pass=v.get("k_to_pass"),
                                **({"budget_floor": v["budget_floor"]} if "budget_floor" in v else {}))
                                for rule, v in report.meta["rules"].items()}
                    except ScenarioSkipped as skip:
                        row.update(verdict="SKIP", reason=str(skip))
                    except OracleNotCached as err:            # not recorded: the driver starts an oracle process
                        print(f"seed {seed} {sid} {dtype}: {err}; stopping for a process that holds the oracle",
                              flush=True)
                        return NEEDS_ORACLE
                    except Exception as err:                  # an engine that raises is caught, as the CLI says
                        if _out_of_memory(err):
                            print(f"seed {seed} {sid} {dtype}: out of GPU memory, not recorded: {err}", flush=True)
                            status = OUT_OF_MEMORY
                            torch.cuda.empty_cache()
                            continue
                        row.update(verdict="ERROR", checks=["error"],
                                   first_failure=f"{type(err).__name__}: {err}"[:300],
                                   trace=traceback.format_exc()[-1500:])
                    row.update(seconds=round(time.monotonic() - start, 2), stages=stages)
                    if torch.cuda.is_available():          # what the memory gate's estimates are checked against
                        row["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
                        row["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
                    if args.save_cache:   # before the row: a worker stopped later leaves a cache for every row
                        _save_cache(oracle, Path(args.save_cache))
                    done[(seed, sid, dtype)] = row
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    gc.collect()                # what a run left in reference cycles, before the next one starts
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        if args.save_cache:
            _save_cache(oracle, Path(args.save_cache))
        if status == 0:
            out.write(json.dumps(DONE) + "\n")
    return status


def parse_rules(text: str) -> list[str]:
    """--budget-rule: one rule, or several comma-separated, each run judged by all of them (the first is the rows'
    own verdict; row["rules"] holds each)."""
    from harness.compare import parse_budget_rules

    try:
        return parse_budget_rules(text)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _killed(row: dict) -> bool:
    """A run that killed its engine: it raised, or it failed by every rule it was judged by."""
    if row.get("verdict") == "ERROR":
        return True
    if "rules" in row:
        return all(v["verdict"] == "FAIL" for v in row["rules"].values())
    return row.get("verdict") == "FAIL"


def as_rule(row: dict, rule: str) -> dict:
    """A row as judged by `rule`: its verdict, checks, first failure, budget and |Δ| over budget by that rule (a
    row judged by one rule, or one that raised or was skipped, as it is)."""
    judged = row.get("rules", {}).get(rule)
    if judged is None:
        return row
    row = {k: v for k, v in row.items() if k != "budget_floor" or rule == "quantile"}
    return {**row, **judged}


def _over_budget(row: dict) -> float:
    """A run's largest |Δ| over its position's budget (the max rule: max |Δ| / budget; rows of an older run lack
    delta_over_budget)."""
    return row.get("delta_over_budget", row["max_delta"] / row["budget"])


# ---- the driver --------------------------------------------------------------------------------------------------
def _run_worker(tree: Path, results: Path, log: Path, *, checkpoint: Path, scenarios: str, dtypes: str, seeds: int,
                device: str, cache: Path | None, save_cache: Path | None, timeout: int, seed_start: int = 0,
                stop_at_kill: bool = False, repeat: bool = False, cache_only: bool = False,
                budget_rule: str, budget_quantile: float, oracle_memory: int | None = None) -> int:
    cmd = [sys.executable, "-m", "mutants.scale", "--worker", "--checkpoint", str(checkpoint), "--scenarios",
           scenarios, "--dtypes", dtypes, "--seeds", str(seeds), "--seed-start", str(seed_start), "--device", device,
           "--results", str(results), "--budget-rule", budget_rule, "--budget-quantile", repr(budget_quantile)]
    if oracle_memory is not None:
        cmd += ["--oracle-memory", str(oracle_memory)]
    if stop_at_kill:
        cmd.append("--stop-at-kill")
    if repeat:
        cmd.append("--repeat")
    if cache_only:
        cmd.append("--cache-only")
    if cache is not None:
        cmd += ["--cache", str(cache)]
    if save_cache is not None:
        cmd += ["--save-cache", str(save_cache)]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    with open(log, "a") as handle:
        try:
            return subprocess.run(cmd, cwd=tree, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\nno result after {timeout} s\n")
            return -1


def _lines(results: Path) -> list[dict]:
    """A results file's lines; a last line cut short by a killed worker is dropped (its run is done again)."""
    lines = []
    for line in results.read_text().splitlines() if results.is_file() else []:
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return lines


def _read(results: Path) -> list[dict]:
    """The run rows of a results file (without its done mark)."""
    return [r for r in _lines(results) if "scenario" in r]


def _complete(results: Path, *, seeds=(), scenarios=(), dtypes=(), stop_at_kill: bool = False) -> bool:
    """Whether `results` holds what is asked now: its worker's done mark and, for each of `seeds` and `dtypes`, a row
    of every one of `scenarios` (with stop_at_kill a kill in the dtype is enough). A file finished by a measurement
    of fewer scenarios is not complete for more: --resume runs only the runs it lacks."""
    lines = _lines(results)
    if not lines or lines[-1] != DONE:
        return False
    rows = {(r["seed"], r["scenario"], r["dtype"]): r for r in lines if "scenario" in r}
    for seed in seeds:
        for dtype in dtypes:
            if stop_at_kill and any(_killed(r) for (s, _, d), r in rows.items() if (s, d) == (seed, dtype)):
                continue
            if any((seed, sid, dtype) not in rows for sid in scenarios):
                return False
    return True


def live_in(reports: list[str], dtypes: list[str]) -> set[str]:
    """The mutants killed or survived in any of `dtypes` in any of these report.json files (SystemExit naming a file
    that is missing, not a mutants.scale report, or measured none of `dtypes`)."""
    live = set()
    for name in reports:
        path = Path(name)
        path = path / "report.json" if path.is_dir() else path
        try:
            report = json.loads(path.read_text())
            mutants, measured = report["mutants"], report["dtypes"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"--live-in {name}: not a mutants.scale report.json ({type(err).__name__}: {err})")
        if not set(dtypes) & set(measured):
            raise SystemExit(f"--live-in {name}: measured {', '.join(measured)}, none of --dtypes {', '.join(dtypes)}")
        live |= {m["name"] for m in mutants for d in dtypes if m.get(d, {}).get("outcome") in ("killed", "survived")}
    return live


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


def summarise(name: str, rows: list[dict], clean: list[dict], dtypes: list[str],
              scenarios: list[str] | None = None) -> dict:
    """Per dtype: killed / survived / not live, by which scenarios and checks, with its effect beside the noise.

    `clean` holds the clean engine's seed-0 rows, once or twice (the second run, in another process, "repeat":
    True, shows which runs are deterministic). A row is the clean engine's when its digest is one the clean engine
    produced; a dtype whose every row is so is "not live"; one whose only differing rows are where the clean engine
    itself varied is "undetermined". Survived and not live need a row for every scenario (default: those of the
    clean rows); a dtype with fewer and no kill is "incomplete" (a run short of GPU memory, or one the time limit
    stopped), with none "not run"."""
    digests: dict[tuple, set] = {}
    for r in clean:
        if r["seed"] == 0 and r.get("digest"):
            digests.setdefault((r["scenario"], r["dtype"]), set()).add(r["digest"])
    expected = set(scenarios if scenarios is not None else {s for s, _ in digests})
    out = {"name": name}
    for dtype in dtypes:
        mine = [r for r in rows if r["dtype"] == dtype]
        killed = [r for r in mine if r["verdict"] in ("FAIL", "ERROR")]
        noise = [r for r in clean if r["dtype"] == dtype and r["verdict"] == "PASS"]
        missing = expected - {r["scenario"] for r in mine}
        differ = [r for r in mine if r.get("digest") not in digests.get((r["scenario"], dtype), set())]
        stable_differ = [r for r in differ if len(digests.get((r["scenario"], dtype), ())) <= 1]
        if killed:
            outcome = "killed"
        elif not mine:
            outcome = "not run"
        elif missing:
            outcome = "incomplete"
        elif stable_differ:
            outcome = "survived"
        else:
            outcome = "undetermined" if differ else "not live"
        out[dtype] = {
            "outcome": outcome,
            "by": sorted({f"{r['scenario']}:{'/'.join(r.get('checks', []))}" for r in killed}),
            "missing": sorted(missing) if not killed else [],
            "max_delta_over_budget": max((_over_budget(r) for r in mine if "max_delta" in r),
                                         default=None),
            "max_excess_ratio": max((v for r in mine for v in r.get("excess", {}).values()), default=None),
            "clean_max_delta_over_budget": max((_over_budget(r) for r in noise), default=None),
            "clean_max_excess_ratio": max((v for r in noise for v in r.get("excess", {}).values()), default=None),
            "first_failure": killed[0].get("first_failure", "") if killed else "",
            # where a survivor's judged numbers are not the clean engine's, and their digests (the table notes
            # survivors whose differing output is bit-identical to another mutant's: two different edits giving
            # one output is the clean engine varying between runs, not two bugs)
            "differs_in": sorted(r["scenario"] for r in differ) if outcome == "survived" else [],
            "differing_digests": sorted(f"{r['scenario']}:{r['digest']}" for r in differ) if outcome == "survived"
            else [],
            # a survivor's effect where it differs, in units of the clean engine's own error on the same run
            "beside_clean": beside_clean(differ, clean) if outcome == "survived" else {},
            # a survivor: would the excess test at a lower ratio limit kill it (None: not known from these rows)
            "excess_kills_at": {f"{x:g}": _any_known([excess_fails_at(r, x) for r in mine])
                                for x in LOWER_LIMITS} if outcome == "survived" else {},
            # a kill: would the max rule with a larger k still make it (None: not known from these rows, or from
            # the scenarios the kill left unrun, which might fail there)
            "kills_at_k": {f"{k:g}": _any_known([fails_at_k(r, k) for r in mine] + ([None] if missing else []))
                           for k in LARGER_K} if outcome == "killed" else {},
        }
    out["live"] = any(out[d]["outcome"] in ("killed", "survived") for d in dtypes)
    return out


def _any_known(values: list[bool | None]) -> bool | None:
    """True if any is True; else None if any is None (not known); else False."""
    return True if True in values else None if None in values else False


def limit_lines(clean: list[dict], mutants: list[dict], dtypes: list[str]) -> list[str]:
    """What lower excess ratio limits would do on these runs: per dtype that recorded excess_moments, the clean runs
    each would fail (false failures) and the survivors each would kill, beside the kill rate that would give (a
    lower limit kills whatever the present one kills, so only survivors can change). A trade-off to weigh, not a
    verdict: the limit stays compare's EXCESS_RATIO."""
    from harness.compare import EXCESS_RATIO

    lines = []
    for d in dtypes:
        runs, known = {}, {}         # per seed and scenario (a repeat of seed 0 has its numbers, and may be newer)
        for r in clean:
            if r["dtype"] == d and r.get("verdict") == "PASS":
                key = (r.get("seed"), r["scenario"])
                runs.setdefault(key, r)
                if excess_fails_at(r, EXCESS_RATIO) is not None:
                    known.setdefault(key, r)
        known = list(known.values())
        survivors = [m for m in mutants if m[d]["outcome"] == "survived"]
        if not known:
            continue
        killed = sum(m[d]["outcome"] == "killed" for m in mutants)
        decided = killed + len(survivors)
        lines += ["", f"### Lower excess ratio limits, {d} (weighed on these runs; the limit stays {EXCESS_RATIO:g})",
                  "", f"Clean runs with the class moments: {len(known)} of {len(runs)}; survivors: {len(survivors)}.",
                  "", "| ratio limit | clean runs failed | survivors killed | survivors not known | kill rate |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for x in LOWER_LIMITS:
            failed = sum(bool(excess_fails_at(r, x)) for r in known)
            verdicts = [m[d].get("excess_kills_at", {}).get(f"{x:g}") for m in survivors]
            more = sum(v is True for v in verdicts)
            rate = f"{100 * (killed + more) / decided:.0f}%" if decided else "-"
            lines.append(f"| {x:g} | {failed} | {more} | {sum(v is None for v in verdicts)} | {rate} |")
    return lines


def larger_k_lines(clean: list[dict], mutants: list[dict], dtypes: list[str]) -> list[str]:
    """What a larger k of the max rule would do on these runs: per dtype that recorded k_to_pass, the clean runs each
    would fail and the kills each would keep, beside the kill rate that would give (a larger k kills nothing the
    present one spares, so only kills can change). A trade-off to weigh, not a verdict."""
    lines = []
    for d in dtypes:
        runs = [r for r in clean if r["dtype"] == d and not r.get("repeat") and r.get("verdict") != "SKIP"]
        known = [r for r in runs if fails_at_k(r, max(LARGER_K)) is not None]
        killed = [m for m in mutants if m[d]["outcome"] == "killed"]
        decided = len(killed) + sum(m[d]["outcome"] == "survived" for m in mutants)
        if not (any(as_rule(r, "max").get("k_to_pass") is not None for r in runs)
                or any(v is not None for m in killed for v in m[d]["kills_at_k"].values())):
            continue                            # nothing known: rows older than k_to_pass, no kill weighable
        lines += ["", f"### Larger k, max rule, {d} (weighed on these runs)", "",
                  f"Clean runs: {len(known)} of {len(runs)} known; kills: {len(killed)}.", "",
                  "| k | clean runs failed | kills kept | kills lost | kills not known | kill rate at least |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in LARGER_K:
            failed = sum(bool(fails_at_k(r, k)) for r in known)
            verdicts = [m[d].get("kills_at_k", {}).get(f"{k:g}") for m in killed]
            kept = sum(v is True for v in verdicts)
            rate = f"{100 * kept / decided:.0f}%" if decided else "-"
            lines.append(f"| {k:g} | {failed} | {kept} | {sum(v is False for v in verdicts)} | "
                         f"{sum(v is None for v in verdicts)} | {rate} |")
    return lines


def unstable(clean: list[dict]) -> list[tuple[str, str]]:
    """(scenario, dtype) pairs where the clean engine's two seed-0 runs differ (not bit-reproducible)."""
    digests: dict[tuple, set] = {}
    for r in clean:
        if r["seed"] == 0 and r.get("digest"):
            digests.setdefault((r["scenario"], r["dtype"]), set()).add(r["digest"])
    return sorted(k for k, v in digests.items() if len(v) > 1)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt3(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def table(clean: list[dict], mutants: list[dict], skipped: dict[str, str], dtypes: list[str]) -> str:
    lines = ["## Clean runs (false failures)", "",
             "budget: the largest over the runs of the max rule's k·E + atol, or for the quantile rule of the floor "
             "k·E_q + atol that every position's budget is at least (a position where the reference errs more gets "
             "k times its own error); budget / largest |Δ|: that over the largest |Δ| of any run; max |Δ|/budget: "
             "the largest over runs and positions of a position's |Δ| over its own budget.", "",
             "| scenario | dtype | runs | failed | largest \\|Δ\\| | budget | budget / largest \\|Δ\\| | "
             "max \\|Δ\\|/budget | largest excess ratio |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in sorted({(r["scenario"], r["dtype"]) for r in clean}):
        rows = [r for r in clean if (r["scenario"], r["dtype"]) == key and r["verdict"] != "SKIP"
                and not r.get("repeat")]
        failed = [r for r in rows if r["verdict"] != "PASS"]
        largest = max((r["max_delta"] for r in rows if "max_delta" in r), default=None)
        budget = max((r.get("budget_floor", r["budget"]) for r in rows if "budget" in r), default=None)
        lines.append(f"| {key[0]} | {key[1]} | {len(rows)} | {len(failed)} | {_fmt3(largest)} | {_fmt3(budget)} | "
                     f"{_fmt(budget / largest if budget is not None and largest else None)} | "
                     f"{_fmt(max((_over_budget(r) for r in rows if 'max_delta' in r), default=None))} | "
                     f"{_fmt(max((v for r in rows for v in r.get('excess', {}).values()), default=None))} |")
    lines += excess_lines(clean)
    lines += ["", "## Engine mutants", "", "| mutant | " + " | ".join(dtypes) + " | effect (max \\|Δ\\|/budget; excess "
              "ratio) per dtype |", "| --- | " + " | ".join("---" for _ in dtypes) + " | --- |"]
    shared: dict[tuple, list[str]] = {}               # a survivor's differing output -> the mutants that gave it
    for m in mutants:
        for d in dtypes:
            if m[d].get("differing_digests"):
                shared.setdefault((d, *m[d]["differing_digests"]), []).append(m["name"])

    def survivor_note(m: dict, d: str) -> str:
        if m[d]["outcome"] != "survived":
            return ""
        others = [n for n in shared.get((d, *m[d].get("differing_digests", [])), []) if n != m["name"]]
        note = f" (differs in {', '.join(m[d].get('differs_in', []))}"
        if m[d].get("beside_clean"):
            note += "; beside the clean run: " + ", ".join(
                f"{k} ×{lo:.3f}" + ("" if f"{lo:.3f}" == f"{hi:.3f}" else f"-{hi:.3f}")
                for k, (lo, hi) in m[d]["beside_clean"].items())
        return note + (f"; that output bit-identical to {len(others)} other mutants')" if others else ")")

    for m in mutants:
        cells = [f"{m[d]['outcome']}" + (f" ({', '.join(m[d]['by'][:3])})" if m[d]["by"] else "")
                 + (f" ({len(m[d]['missing'])} scenarios not run)" if m[d]["outcome"] == "incomplete" else "")
                 + survivor_note(m, d) for d in dtypes]
        effect = "; ".join(f"{d}: {_fmt(m[d]['max_delta_over_budget'])}, {_fmt(m[d]['max_excess_ratio'])} "
                           f"(clean {_fmt(m[d]['clean_max_delta_over_budget'])}, "
                           f"{_fmt(m[d]['clean_max_excess_ratio'])})" for d in dtypes)
        lines.append(f"| {m['name']} | " + " | ".join(cells) + f" | {effect} |")
    for d in dtypes:
        counts = {o: sum(m[d]["outcome"] == o for m in mutants)
                  for o in ("killed", "survived", "not live", "undetermined", "incomplete", "not run")}
        decided = counts["killed"] + counts["survived"]
        lines.append(f"\n{d}: {counts['killed']} of {decided} live engine mutants killed"
                     + (f" ({100 * counts['killed'] / decided:.0f}%)" if decided else "")
                     + f"; {counts['not live']} not live; {counts['undetermined']} undetermined, "
                       f"{counts['incomplete']} incomplete, {counts['not run']} not run (none of these counted)")
    lines += limit_lines(clean, mutants, dtypes)
    lines += larger_k_lines(clean, mutants, dtypes)
    varying = unstable(clean)
    if varying:
        lines += ["", "The clean engine's two seed-0 runs differ (not bit-reproducible) in: "
                  + ", ".join(f"{sc} {d}" for sc, d in varying)
                  + ". A mutant that differs from the clean engine only there is undetermined."]
    if skipped:
        lines += ["", "## Not judged here", ""] + [f"- {name}: {why}" for name, why in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def excess_lines(clean: list[dict]) -> list[str]:
    """The excess test on the clean runs, per dtype: its judged classes, the largest ratio and paired z, and the runs
    it failed by the ratio 1.5 alone and by the excess test as judged (ratio with paired z or the 2x bound;
    harness/compare.py). Rows without paired z (recorded before it was) are left out of the z columns."""
    lines = []
    for dtype in sorted({r["dtype"] for r in clean}):
        rows = [r for r in clean if r["dtype"] == dtype and r.get("excess") and not r.get("repeat")]
        classes = [(r, k) for r in rows for k in r["excess"]]
        if not classes:
            continue
        zs = [(r["excess_z"][k], r, k) for r, k in classes
              if r.get("excess_z", {}).get(k) is not None]
        top = max(classes, key=lambda rk: rk[0]["excess"][rk[1]])
        by_ratio = [r for r in rows if r.get("excess_over_ratio")
                    or (r.get("excess_over_ratio") is None and "excess" in r.get("checks", []))]
        by_both = [r for r in rows if "excess" in r.get("checks", [])]

        def where(r, k):
            n = r.get("excess_positions", {}).get(k)
            return f"{r['scenario']} seed {r['seed']} {k}" + (f", {n} positions" if n is not None else "")

        line = (f"- {dtype}: {len(classes)} judged classes in {len(rows)} runs; largest ratio "
                f"{top[0]['excess'][top[1]]:.2f} ({where(*top)})")
        if zs:
            z, r, k = max(zs, key=lambda t: t[0])
            line += f"; largest paired z {z:.2f} ({where(r, k)}) of the {len(zs)} classes that record it"
        line += (f"; runs over the ratio limit {len(by_ratio)}, failed by the excess test "
                 f"{len(by_both)}")
        lines.append(line)
    return ["", "Excess test on the clean runs:", ""] + lines if lines else []


def plot(mutants: list[dict], dtypes: list[str], path: Path) -> bool:
    """Each live mutant's largest max |Δ| / budget per dtype beside the clean runs' largest (the noise floor). A
    non-finite value (an engine that returned inf or NaN) is drawn past the largest finite one, marked "inf"."""
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
        cap = 3 * max([v for v in values if math.isfinite(v)] + [1.0])
        colors = ["tab:red" if m[d]["outcome"] == "killed" else "tab:gray" for m in live]
        bars = ax.barh([m["name"] for m in live], [v if math.isfinite(v) else cap for v in values], color=colors)
        for bar, v in zip(bars, values):
            if not math.isfinite(v):
                bar.set_hatch("//")
                ax.text(cap, bar.get_y() + bar.get_height() / 2, " inf", va="center", fontsize=7)
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
    parser.add_argument("--model", default=None,
                        help="a scale model (harness/scale.py; default bamba9b-2layer), or with a --model-dir that "
                             "holds a model, the name the report gives it (default: the directory's)")
    parser.add_argument("--model-dir", default=None, help="where the model is (written there if absent); "
                                                          "default: a directory under --out")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--scenarios", default=None,
                        help="scenario ids (default: default_scenarios at the model's chunk size; at Q = 256 "
                             f"{DEFAULT_SCENARIOS})")
    parser.add_argument("--clean-seeds", type=int, default=20, help="prompt seeds of the clean runs")
    parser.add_argument("--clean-procs", type=int, default=1,
                        help="processes for clean seeds 1.. (each loads the fp64 oracle once)")
    parser.add_argument("--only", default=None, help="comma-separated mutant names")
    parser.add_argument("--live-in", default=None, metavar="REPORT[,REPORT]",
                        help="only the mutants live (killed or survived) in any of --dtypes in any of these earlier "
                             "measurements' report.json (with --only: those of them named there too)")
    parser.add_argument("--jobs", type=int, default=4,
                        help="mutant processes at a time on the GPU (fewer when the memory gate says so)")
    parser.add_argument("--stop-at-kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--every-scenario", action="store_true",
                        help="judge each mutant in every scenario, not only up to its first kill (what weighing a "
                             "larger k on its rows needs; with --resume, a killed mutant's other scenarios run)")
    parser.add_argument("--repeat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    from harness.compare import BUDGET_QUANTILE, BUDGET_RULES
    parser.add_argument("--budget-rule", default="max",
                        help=f"the judge's budget rule ({', '.join(BUDGET_RULES)}; harness/compare.py), or several "
                             "comma-separated: each run judged by every one, a table per rule (the first's table.md, "
                             "the others' table-RULE.md); keep one --out per choice")
    parser.add_argument("--budget-quantile", type=float, default=BUDGET_QUANTILE,
                        help="the quantile rule's floor (default %(default)s)")
    parser.add_argument("--oracle-memory", default=None, metavar="SIZE",
                        help="as compare's: a reference model (the fp64 oracle, a twin) whose weights with room for "
                             "its activations exceed SIZE runs layer-streamed, so that a model whose fp64 weights do "
                             "not fit the GPU beside the candidate (bamba9b-32layer on an H100) is judged; rows say "
                             "which ran (oracle_weights)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per worker process")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole measurement: no worker starts after it and running ones are "
                             "stopped at it (their finished runs are kept for --resume)")
    parser.add_argument("--out", default="out/mutants-scale")
    parser.add_argument("--resume", action="store_true",
                        help="keep --out's results: runs already recorded there (clean seeds, mutants) and the "
                             "oracle cache are reused, so a long measurement can span several calls")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the table, JSON and plot from what --out holds")
    args = parser.parse_args(argv)
    if args.oracle_memory is not None:
        from harness.cli import UsageError, parse_size

        try:
            args.oracle_memory = parse_size(args.oracle_memory)
        except UsageError as err:
            parser.error(str(err))
    if args.worker:
        return worker(args)
    parse_rules(args.budget_rule)
    raw = model_config(args)
    if args.scenarios is None:
        args.scenarios = default_scenarios(raw["mamba_chunk_size"])

    from .mutant import load_all

    out = Path(args.out).resolve()                  # workers run in other trees: every path they get is absolute
    out.mkdir(parents=True, exist_ok=True)
    dtypes = args.dtypes.split(",")
    chosen = load_all()
    if args.only:
        names = set(args.only.split(","))
        missing = names - {m.name for m in chosen}
        if missing:
            raise SystemExit(f"--only: no mutants named {sorted(missing)}")
        chosen = [m for m in chosen if m.name in names]
    if args.live_in:
        live = live_in(args.live_in.split(","), dtypes)
        chosen = [m for m in chosen if m.name in live]
    skipped = {m.name: why for m in chosen if (why := classify_mutant(m))}
    judged = [m for m in chosen if m.name not in skipped]
    groups = _seed_groups(args.clean_seeds, args.clean_procs)
    statuses = [0] if args.report_only else _measure(args, out, judged, groups)
    return _report(args, out, judged, skipped, groups, dtypes, statuses)


# The config fields that tell two models' shapes apart (a --model name against what --model-dir holds).
SHAPE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "mamba_n_heads", "mamba_d_head",
                "mamba_d_state", "mamba_chunk_size", "intermediate_size")


def model_config(args) -> dict:
    """The measured model's config, and args.model its name in the report: a --model-dir that holds a model names
    it (--model, when given, must be a model of that shape, else SystemExit: the report would name another model);
    else the scale model --model (default bamba9b-2layer), written to --model-dir or under --out."""
    from harness import scale

    config = Path(args.model_dir) / "config.json" if args.model_dir else None
    if config is None or not config.is_file():
        args.model = args.model or "bamba9b-2layer"
        if args.model not in scale.SCALE:
            raise SystemExit(f"--model {args.model}: no such scale model (harness/scale.py has "
                             f"{', '.join(scale.SCALE)}), and no model in --model-dir {args.model_dir}")
        return scale.config_dict(args.model)
    raw = json.loads(config.read_text())
    if args.model is None:
        args.model = Path(args.model_dir).resolve().name
    elif args.model in scale.SCALE:
        named = scale.config_dict(args.model)
        differ = [f for f in SHAPE_FIELDS if named.get(f) != raw.get(f)]
        if differ:
            raise SystemExit(f"--model {args.model} with --model-dir {args.model_dir}: the directory holds another "
                             "model (" + ", ".join(f"{f} {raw.get(f)} where {args.model} has {named.get(f)}"
                                                   for f in differ) + ")")
    return raw


def _seed_groups(clean_seeds: int, procs: int) -> list[tuple[int, int]]:
    """Seeds 1..clean_seeds-1 as (first, count) for each of `procs` processes (seed 0 runs in its own process)."""
    rest = list(range(1, clean_seeds))
    size = -(-len(rest) // max(1, procs)) if rest else 0
    return [(rest[i], len(rest[i:i + size])) for i in range(0, len(rest), size)] if rest else []


def measured_need(results: Path) -> float | None:
    """The GPU memory (bytes) to admit a process like the one that wrote `results` with: its largest recorded peak
    of reserved memory, with slack and the CUDA context; None when no row recorded one."""
    peaks = [r["peak_gpu_reserved_gb"] for r in _read(results) if r.get("peak_gpu_reserved_gb")]
    return (max(peaks) * MEASURED_MARGIN + CONTEXT_GB) * 1e9 if peaks else None


def _clean_file(first: int, count: int) -> str:
    return f"clean-seed{first}.jsonl" if count == 1 else f"clean-seeds{first}-{first + count - 1}.jsonl"


def _measure(args, out: Path, judged: list, groups: list[tuple[int, int]]) -> list[int]:
    """Run what --out does not hold yet: clean seed 0 (and the oracle cache), then the mutants and the other clean
    seeds side by side. Returns the workers' exit statuses."""
    from tqdm import tqdm

    from harness import scale

    from .run import copy_tree

    checkpoint = Path(args.model_dir or out / args.model).resolve()      # the same path from every tree
    if not (checkpoint / "config.json").is_file():
        scale.write_checkpoint(args.model, checkpoint, device=args.device)
    cache = out / "oracle-cache.pt"
    if not args.resume:
        # what an earlier measurement's workers wrote, and nothing else (a driver's log kept there, say, is the user's)
        for stale in [*out.glob("clean-seed*.jsonl"), *out.glob("clean-seed*.log"), *out.glob("mutant-*.jsonl"),
                      *out.glob("mutant-*.log"), cache, cache.with_name(cache.name + ".part")]:
            stale.unlink(missing_ok=True)
    if cache.is_file():           # an earlier call's: checked against this checkpoint before any worker trusts it
        from harness.runner import restamp_cache

        try:
            restamp_cache(cache, checkpoint)
        except ValueError as err:
            raise SystemExit(f"--out {out}: {err}") from None
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    gate = MemoryGate.for_device(args.device)
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    needs = {"oracle": ORACLE_PROCESS_X * size, "engine": ENGINE_PROCESS_X * size}
    if args.oracle_memory is not None:              # the reference models held within the cap, beside the candidate
        needs["oracle"] = min(needs["oracle"], args.oracle_memory + ENGINE_PROCESS_X * size)

    def adopt_measured(need: str, results: Path, whose: str) -> None:
        """A process of kind `need` ran every scenario and dtype asked (clean seed 0 holding the fp64 oracle; its
        repeat, an engine answered from the cache): its peak replaces the size-based estimate for every later
        process of that kind (at real width an engine's is far below it, so that several run side by side), and
        the workers waiting look again."""
        measured = measured_need(results)
        if measured is not None:
            print(f"memory gate: an {need} process needs {measured / 1e9:.1f} GB ({whose} peak; the estimate was "
                  f"{needs[need] / 1e9:.1f} GB)", flush=True)
            needs[need] = measured
            gate.recheck()

    def run(tree, results, log, *, need, **kwargs):
        """A worker (needing the memory of needs[need]), once the GPU has room for it, stopped at the deadline; -1
        (not started or stopped) once the deadline has passed. An engine worker judges against the oracle cache
        alone; should a run need the fp64 model, the worker stops and is started again (its finished runs kept) as
        an oracle process."""
        for need, cache_only in ([("engine", True), ("oracle", False)] if need == "engine" else [(need, False)]):
            with gate.hold(lambda need=need: needs[need]):
                left = args.timeout if deadline is None else min(args.timeout, int(deadline - time.monotonic()))
                if left <= 0:
                    return -1
                status = _run_worker(tree, results, log, checkpoint=checkpoint, scenarios=args.scenarios,
                                     dtypes=args.dtypes, device=args.device, timeout=left, cache_only=cache_only,
                                     budget_rule=args.budget_rule, budget_quantile=args.budget_quantile,
                                     oracle_memory=args.oracle_memory, **kwargs)
            if status != NEEDS_ORACLE:
                return status
        return status

    print(f"clean runs: {args.clean_seeds} seeds × {len(args.scenarios.split(','))} scenarios × "
          f"{len(args.dtypes.split(','))} dtypes; seed 0 first (its oracle results are every mutant's), the other "
          f"seeds beside it, then seed 0 again beside the mutants", flush=True)
    statuses = [0]
    scratch = Path(tempfile.mkdtemp(prefix="mutants-scale-"))

    asked = dict(scenarios=args.scenarios.split(","), dtypes=args.dtypes.split(","))

    def seed0():
        if not cache.is_file() and (out / "clean-seed0.jsonl").is_file():
            # its oracle results are lost: seed 0 runs again from the start in the dtypes asked now (the runs already
            # recorded would be skipped, and the cache left empty); their old rows are appended beside for
            # comparison, and the rows of dtypes not asked now stay where the summary reads them
            rows = _read(out / "clean-seed0.jsonl")
            with open(out / "clean-seed0.jsonl.without-cache", "a") as kept:
                kept.writelines(json.dumps(r) + "\n" for r in rows if r["dtype"] in asked["dtypes"])
            others = [r for r in rows if r["dtype"] not in asked["dtypes"]]
            if others:
                (out / "clean-seed0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in others))
            else:
                (out / "clean-seed0.jsonl").unlink()
        if not (_complete(out / "clean-seed0.jsonl", seeds=[0], **asked) and cache.is_file()):
            statuses.append(run(ROOT, out / "clean-seed0.jsonl", out / "clean-seed0.log", seeds=1, need="oracle",
                                cache=cache if cache.is_file() else None, save_cache=cache))
        adopt_measured("oracle", out / "clean-seed0.jsonl", "clean seed 0's")

    def repeat():
        if not _complete(out / REPEAT, seeds=[0], **asked):
            statuses.append(run(ROOT, out / REPEAT, out / REPEAT.replace(".jsonl", ".log"), seeds=1,
                                need="engine", cache=cache, save_cache=None, repeat=True))
        adopt_measured("engine", out / REPEAT, "the repeat of seed 0's")

    def clean_group(first, count):
        results = out / _clean_file(first, count)
        if not _complete(results, seeds=range(first, first + count), **asked):
            statuses.append(run(ROOT, results, results.with_suffix(".log"), seeds=count, seed_start=first,
                                need="oracle", cache=None, save_cache=None))

    def one(mutant):
        results = out / f"mutant-{mutant.name}.jsonl"
        stop = not args.every_scenario
        if _complete(results, seeds=[0], stop_at_kill=stop, **asked) or \
                (deadline is not None and time.monotonic() >= deadline):
            return
        tree = scratch / mutant.name
        copy_tree(ROOT, tree, exclude=(checkpoint, out))      # a model or --out kept inside the tree
        mutant.apply(tree)
        statuses.append(run(tree, results, out / f"mutant-{mutant.name}.log", seeds=1, need="engine",
                            cache=cache, save_cache=None, stop_at_kill=stop))
        shutil.rmtree(tree, ignore_errors=True)

    try:
        # Every worker waits for the memory gate: the clean seed groups each hold the fp64 oracle and need nothing
        # else, so they start at once, beside seed 0; a mutant or the repeat of seed 0 holds only an engine (until a
        # run needs more than the cache) and judges against seed 0's cached oracle results, so they start once seed
        # 0 has left its cache.
        with ThreadPoolExecutor(max_workers=1 + len(groups)) as seeds_pool, \
                ThreadPoolExecutor(max_workers=max(1, args.jobs)) as mutant_pool:
            seed_futures = [seeds_pool.submit(seed0)]
            seed_futures += [seeds_pool.submit(clean_group, first, count) for first, count in groups]
            seed_futures[0].result()
            futures = list(seed_futures)
            if cache.is_file():
                futures += [mutant_pool.submit(repeat)] + [mutant_pool.submit(one, m) for m in judged]
            else:
                print(f"the clean run of seed 0 left no oracle cache (status {statuses[-1]}): no mutant is judged; "
                      f"see {out / 'clean-seed0.log'}", file=sys.stderr)
            for future in tqdm(as_completed(futures), total=len(futures), desc="mutants and clean seeds",
                               unit="run"):
                future.result()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return statuses


def _report(args, out: Path, judged: list, skipped: dict[str, str], groups: list[tuple[int, int]],
            dtypes: list[str], statuses: list[int]) -> int:
    """The table, JSON and plot of each budget rule (the first rule's table.md, report.json and power.png, the
    others' with -RULE before the suffix). Exit status 0 only when every clean run passed by every rule and every
    run is complete."""
    files = [out / "clean-seed0.jsonl", out / REPEAT] + [out / _clean_file(first, count) for first, count in groups]
    # clean seeds that an earlier call (--resume with another --clean-procs) recorded in files grouped otherwise
    earlier = sorted({f for f in out.glob("clean-seed*.jsonl")
                      if re.fullmatch(r"clean-seeds?\d+(-\d+)?\.jsonl", f.name)} - set(files))
    clean_rows = list({(r["seed"], r.get("repeat", False), r["scenario"], r["dtype"]): r
                       for f in earlier + files for r in _read(f)}.values())
    asked = dict(scenarios=args.scenarios.split(","), dtypes=dtypes)
    seeds = [[0], [0]] + [range(first, first + count) for first, count in groups]
    have = {(r["seed"], r["scenario"], r["dtype"]) for r in clean_rows if not r.get("repeat")}
    incomplete = [str(f.name) for f, s in zip(files, seeds)
                  if not _complete(f, seeds=s, **asked)
                  and (f.name == REPEAT or not all((seed, sc, d) in have for seed in s
                                                   for sc in asked["scenarios"] for d in dtypes))]
    mutant_rows = {}
    for m in judged:
        results = out / f"mutant-{m.name}.jsonl"
        if not _complete(results, seeds=[0], stop_at_kill=True, **asked):
            incomplete.append(results.name)
        mutant_rows[m.name] = _read(results)
    rules = parse_rules(args.budget_rule)
    failed_clean = False
    for i, rule in enumerate(rules):
        clean = [as_rule(r, rule) for r in clean_rows]
        seed0 = [r for r in clean if r["seed"] == 0]
        # a mutant whose worker never started is in the table too ("not run"), so that the counts add up
        summaries = [summarise(name, [as_rule(r, rule) for r in rows], seed0, dtypes, args.scenarios.split(","))
                     for name, rows in mutant_rows.items()]
        for m in summaries:                 # the noise floor: every clean seed
            for d in dtypes:
                noise = [r for r in clean if r["dtype"] == d and r["verdict"] == "PASS"]
                m[d]["clean_max_delta_over_budget"] = max((_over_budget(r) for r in noise), default=None)
                m[d]["clean_max_excess_ratio"] = max((v for r in noise for v in r.get("excess", {}).values()),
                                                     default=None)
        summaries.sort(key=lambda m: m["name"])
        text = (f"Budget rule: {rule}" + (f" (quantile {args.budget_quantile:g})" if rule == "quantile" else "")
                + (f"; the same runs judged by {', '.join(r for r in rules if r != rule)} too" if len(rules) > 1
                   else "") + "\n\n" + table(clean, summaries, skipped, dtypes))
        if incomplete:
            text += f"\nIncomplete (run again with --resume): {', '.join(sorted(incomplete))}\n"
        suffix = "" if i == 0 else f"-{rule}"
        (out / f"table{suffix}.md").write_text(text)
        plot(summaries, dtypes, out / f"power{suffix}.png")
        report = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=args.model,
                      scenarios=args.scenarios.split(","), dtypes=dtypes, clean_seeds=args.clean_seeds,
                      budget_rule=rule, budget_rules=rules,
                      budget_quantile=args.budget_quantile if rule != "max" else None,
                      clean=clean, mutants=summaries, not_judged=skipped, incomplete=sorted(incomplete))
        (out / f"report{suffix}.json").write_text(json.dumps(report, indent=1))
        print(text)
        failed_clean |= any(r["verdict"] not in ("PASS", "SKIP") for r in clean)
    return 0 if clean_rows and not failed_clean and not incomplete and max(statuses, key=abs) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
