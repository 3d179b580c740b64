"""`bamba-harness`: judge an engine against the fp64 oracle on the scenario matrix.

    bamba-harness compare --engine transformers --checkpoint DIR --scenarios chunked_prefill,batching \\
        --dtype bfloat16 --device cuda --out out/
    bamba-harness compare --engine vendored --against reference --against-dtype float32 --scenarios batching
    bamba-harness compare --engine vendored --jobs 2 --out out/compare \
        --checkpoint fixtures/tiny-bamba --scenarios representative,boundary-events \
        --checkpoint fixtures/tiny-granite --scenarios representative
    bamba-harness list [--checkpoint DIR]
    bamba-harness write-model bamba9b-2layer DIR --device cuda      # a generated model: scale (real width) or zoo
    bamba-harness lm-eval --model_args engine=vendored,checkpoint=DIR --tasks bamba_tiny --include_path fixtures/tasks

`lm-eval ...` is lm-eval's own command line with the model `bamba-harness` (harness/lm_eval.py) registered and
chosen unless --model says otherwise; everything after `lm-eval` goes to lm-eval as it is.

`compare` prints a table (scenario, requests, max |Δ|, budget, mean KL, top-1 agreement, first divergence, verdict:
PASS, FAIL, SKIP with the engine's reason, or ERROR where the engine raised) and a summary line ("21 PASS, 1 SKIP,
0 FAIL, 0 ERROR in 9m12s"), and writes report.json (docs/report-format.md) and delta_by_position.png to --out;
the previous run's files there are removed first, so nothing stale survives a run that stops early. With
--against ENGINE the candidate is judged directly against that engine (in --against-dtype) instead of the oracle,
within the oracle's budget of the candidate's dtype plus that of the baseline's (harness/runner.py, check_against).
Everything the run needs is checked before any work starts, so a bad argument costs seconds, not a whole run.

--checkpoint may be given several times: each model's files go to --out/<checkpoint directory name>, its table
follows its own "== name" line, and a last summary line counts every model's scenarios with the whole run's time.
--scenarios is then given once (for every model) or once per --checkpoint, in the same order. With --jobs N (or
several checkpoints) the scenarios run in N worker processes of one torch thread each (OMP_NUM_THREADS, unless set),
the longest first by planned engine steps, under one progress bar counted in engine steps, so its ETA is a live one;
each worker keeps one oracle per model, whose memo serves the scenarios that worker runs.

Exit status:
  0    at least one scenario was checked and every checked scenario passed (skipped ones are listed)
  1    a scenario failed, or an engine raised an error in one
  2    usage error, found before any work: unknown engine, scenario or dtype; unavailable device (--device cuda
       without CUDA); checkpoint missing or not loadable (config.json unreadable, no weights file, weights that
       do not match the config); --out not a writable directory; empty --scenarios ("" or ",")
  5    nothing was checked: every selected scenario was skipped (exit 0 with --allow-skips), or none was selected
  130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM. One line on stderr; report.json, if the run had started,
       says verdict "interrupted" and lists the scenarios not run
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO_ROOT / "fixtures" / "tiny-bamba"
DEFAULT_PROMPTS = REPO_ROOT / "fixtures" / "prompts.jsonl"
REPORT_NAME, PLOT_NAME = "report.json", "delta_by_position.png"
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_NOTHING_CHECKED = 0, 1, 2, 5
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}          # 128 + the signal's number, as shells report it


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread so that the run unwinds as it does on Ctrl-C (KeyboardInterrupt): engines
    close, a partial report says "interrupted". A BaseException, so that no `except Exception` of a scenario takes
    it for that scenario's error."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _parser() -> argparse.ArgumentParser:
    """The command line; built from the standard library alone, so that --help answers before torch is imported."""
    epilog = __doc__[__doc__.index("Exit status:"):]
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="bamba-harness", description=__doc__.splitlines()[0], epilog=epilog,
                                     formatter_class=raw)
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="run scenarios on an engine and judge it against the fp64 oracle",
                             description="Run scenarios on an engine and judge it against the fp64 oracle (or, "
                                         "with --against, another engine).", epilog=epilog, formatter_class=raw)
    compare.add_argument("--engine", required=True, help="engine name (see `bamba-harness list`)")
    compare.add_argument("--checkpoint", action="append", default=None,
                         help="checkpoint directory (repeatable: several models in one run)")
    compare.add_argument("--scenarios", action="append", default=None,
                         help="comma-separated kinds, aliases (representative, boundary-events) and/or scenario ids; "
                              "a leading - leaves one out; once, or once per --checkpoint (default: all, which "
                              "leaves out slow and opt-in scenarios: invariance runs only when named)")
    compare.add_argument("--jobs", type=int, default=1,
                         help="worker processes that run scenarios side by side (default 1: in this process)")
    compare.add_argument("--dtype", default="float32", help="the candidate's dtype (float32, bfloat16, ...)")
    compare.add_argument("--device", default="cpu", help="device of the candidate and the oracle (cpu, cuda[:N])")
    compare.add_argument("--out", default="out", help="directory for report.json and delta_by_position.png")
    compare.add_argument("--prompts", default=None,
                         help="prompts .jsonl, or `random` for seeded random ids (default: fixtures/prompts.jsonl "
                              "where its ids fit the model's vocabulary, else random)")
    compare.add_argument("--seed", type=int, default=None,
                         help="seed of the random prompts (default 0; refused with prompts from a file, whose "
                              "workload it would not change)")
    compare.add_argument("--k", type=float, default=None, help="budget multiplier (default 2)")
    compare.add_argument("--atol", type=float, default=None, help="budget floor (default: per dtype, compare.py)")
    compare.add_argument("--budget-rule", default="max", metavar="RULE[,RULE]",
                         help="max: every position's budget from the reference's largest error on the workload; "
                              "quantile: each position's from its own error, floored at a high quantile of them "
                              "(harness/compare.py); two, comma-separated: the first gives the verdict, and "
                              "report.json holds each rule's verdict on the same runs (`rules`)")
    compare.add_argument("--budget-quantile", type=float, default=None, metavar="Q",
                         help="the quantile rule's floor (default 0.99; with --budget-rule quantile)")
    compare.add_argument("--excess-z", default=None, metavar="Z",
                         help="between 1.5x and 2x the reference's mean error, the paired z a 16-bit candidate's "
                              "excess class must pass to fail (default 3; `none`: the ratio 1.5 alone; "
                              "harness/compare.py, the excess test)")
    compare.add_argument("--gated-norm", default="grouped", choices=("grouped", "full"),
                         help="the oracle's gated RMSNorm: per group (Bamba) or full width (transformers)")
    compare.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                         help="an adapter-specific option, repeatable")
    compare.add_argument("--oracle-memory", default=None, metavar="SIZE",
                         help="cap on a reference model's memory (16GiB, 500MB, bytes): one whose weights would not "
                              "fit it resident runs layer-streamed (default: no cap, resident)")
    compare.add_argument("--allow-skips", action="store_true",
                         help="exit 0 (not 5) when every selected scenario was skipped")
    compare.add_argument("--against", default=None, metavar="ENGINE",
                         help="judge --engine against this engine's results instead of the oracle's")
    compare.add_argument("--against-dtype", default=None,
                         help="the --against engine's dtype (default: that engine's default dtype)")
    compare.add_argument("--against-arg", action="append", default=[], metavar="KEY=VALUE",
                         help="an adapter-specific option of the --against engine, repeatable")
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's command line with the bamba-harness model (arguments go to lm-eval as they are)")
    listing = sub.add_parser("list", help="engines (with availability) and the scenarios of a checkpoint")
    listing.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    write = sub.add_parser("write-model", help="write a generated model (real-width scale model or zoo entry)",
                           description="Write a model generated by code to DIR: a real-width scale model "
                                       "(harness/scale.py: bamba9b-2layer, bamba9b-4layer, bamba9b-32layer) or a "
                                       "config-zoo entry (harness/zoo.py; `bamba-harness write-model --list`).")
    write.add_argument("name", nargs="?", help="model name")
    write.add_argument("directory", nargs="?", help="where to write it (created)")
    write.add_argument("--seed", type=int, default=0, help="seed of the weights")
    write.add_argument("--device", default="cpu", help="where scale models' weights are drawn (cuda is much faster)")
    write.add_argument("--list", action="store_true", help="list the model names and exit")
    return parser


def _read_config(checkpoint: Path):
    from reference.config import ConfigError, ModelConfig

    if not checkpoint.is_dir():
        raise UsageError(f"checkpoint directory {checkpoint} does not exist")
    try:
        return ModelConfig.from_json(checkpoint)
    except (ConfigError, OSError) as err:       # ConfigError names the file; OSError names it as err.filename
        raise UsageError(str(err)) from err


def _check_weights(checkpoint: Path, cfg) -> None:
    """The weights must be the ones the config describes (reference/checkpoint.py's rules: names, shapes,
    floating point), checked on the safetensors headers without reading a tensor, so that a model that cannot be
    loaded is a usage error before any work rather than an ERROR row per scenario."""
    import torch
    from safetensors import SafetensorError, safe_open

    from reference.checkpoint import CheckpointError, _safetensors_files, check_weights

    try:
        files = _safetensors_files(checkpoint)
    except CheckpointError as err:
        raise UsageError(f"checkpoint {err}") from err
    where = files[0] if len(files) == 1 else checkpoint / "model.safetensors.index.json"
    headers = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    shape = piece.get_shape()
                    dtype = piece[:0].dtype if shape else handle.get_tensor(key).dtype
                    headers[key] = torch.empty(shape, dtype=dtype, device="meta")
        except (SafetensorError, OSError) as err:
            raise UsageError(f"checkpoint {file}: not a readable safetensors file ({err})") from err
    head, embed = headers.get("lm_head.weight"), headers.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and head.shape == embed.shape:
        del headers["lm_head.weight"]        # a stored tied head: its values are compared when the oracle loads
    try:
        check_weights(cfg, headers)
    except CheckpointError as err:
        raise UsageError(f"checkpoint {where}: {err}") from err


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 2**10, "kib": 2**10,
               "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def parse_size(text: str, option: str = "--oracle-memory") -> int:
    """Bytes of '16GiB', '16G' (binary), '16GB' (decimal), '500MiB', '1e9' or '1048576'; UsageError otherwise."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(f"{option} {text!r}: expected a size such as 16GiB, 500MB or a number of bytes")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1:
        raise UsageError(f"{option} {text!r}: expected a positive size")
    return int(value)


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UsageError(f"--device {name!r}: {err}") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UsageError(f"--device {name}: " + (f"this machine has {count} CUDA devices" if count
                                                     else "no CUDA device on this machine"))
    elif device.type != "cpu":
        raise UsageError(f"--device {name}: expected cpu, cuda or cuda:N")


def _check_out(out: Path) -> None:
    """--out must be a directory this process can write (created if missing), known before the run, not from a
    traceback after it."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory (expected a directory for {REPORT_NAME} "
                         f"and {PLOT_NAME})")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise UsageError(f"--out {out}: not a writable directory ({err.strerror or err})") from err


def _prompt_source(args, cfg):
    """The prompt source and a note to print once the input is known to be good (or UsageError in one line)."""
    from .scenarios import PromptSource

    source, note = PromptSource(cfg.vocab_size, seed=args.seed or 0), ""
    if args.prompts == "random":
        return source, note
    if args.prompts:
        try:
            source = PromptSource.from_jsonl(args.prompts, cfg.vocab_size)
        except OSError as err:
            raise UsageError(f"--prompts {args.prompts}: not a readable file ({err.strerror or err})") from err
        except ValueError as err:      # "FILE:LINE: field: expected ..., found ...": FILE is args.prompts
            message = str(err)
            raise UsageError(f"--prompts {message}" if message.startswith(f"{args.prompts}:")
                             else f"--prompts {args.prompts}: {message}") from err
    elif DEFAULT_PROMPTS.is_file():
        try:
            source = PromptSource.from_jsonl(DEFAULT_PROMPTS, cfg.vocab_size)
        except ValueError as err:      # the bundled prompts belong to the bundled model's tokenizer
            note = f"{err}; using random prompts"
    if source.prompts and args.seed is not None:
        raise UsageError(f"--seed {args.seed}: seeds random prompts only, and these come from "
                         f"{args.prompts or DEFAULT_PROMPTS} (add --prompts random for seeded random ones)")
    return source, note


def _engine_args(option: str, pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{option} {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


@dataclass
class _Plan:
    """What `compare` will do, every part of it checked by `_validate` before any work starts."""

    engine_cls: type
    dtype: object                      # torch.dtype (torch is not imported at module level: --help stays fast)
    engine_args: dict[str, str]
    base_cls: type | None              # the --against engine, None for the oracle
    base_dtype: object
    against_args: dict[str, str]
    k: float
    checkpoint: Path
    scenarios: list
    source: object                     # PromptSource
    note: str                          # printed once everything is known to be good
    oracle_memory: int | None          # --oracle-memory in bytes (None: no cap)
    budget_quantile: float             # --budget-quantile (the quantile rule's floor)
    excess_z: float | None             # --excess-z (None: the ratio alone)


def _validate(args) -> _Plan:
    """Every check that can fail before any work, in the order of the command line's importance; UsageError."""
    from .adapters import EngineUnavailable, UnknownEngine, get_engine
    from .compare import DEFAULT_K
    from .engine import parse_dtype
    from .scenarios import build_scenarios, select_scenarios

    try:
        engine_cls = get_engine(args.engine)
        dtype = parse_dtype(args.dtype)
        base_cls = get_engine(args.against) if args.against else None
        base_dtype = parse_dtype(args.against_dtype) if args.against_dtype else None
    except (UnknownEngine, EngineUnavailable, ValueError) as err:
        raise UsageError(str(err)) from err
    if args.against_dtype and not args.against:
        raise UsageError(f"--against-dtype {args.against_dtype}: expected --against ENGINE with it")
    engine_args, against_args = _engine_args("--engine-arg", args.engine_arg), _engine_args("--against-arg",
                                                                                             args.against_arg)
    _check_device(args.device)
    oracle_memory = None if args.oracle_memory is None else parse_size(args.oracle_memory)
    budget_quantile = _budget_quantile(args)
    excess_z = _excess_z(args)
    checkpoint = Path(args.checkpoint)
    cfg = _read_config(checkpoint)
    _check_weights(checkpoint, cfg)
    if not [name for name in args.scenarios.split(",") if name.strip()]:
        raise UsageError(f"--scenarios {args.scenarios!r}: expected comma-separated kinds and/or scenario ids, "
                         "got none")
    try:
        chosen = select_scenarios(build_scenarios(cfg, engine_cls), args.scenarios)
    except ValueError as err:
        raise UsageError(str(err)) from err
    source, note = _prompt_source(args, cfg)
    _check_out(Path(args.out))
    if base_cls is not None and base_dtype is None:
        base_dtype = base_cls.default_dtype
    k = DEFAULT_K if args.k is None else args.k
    return _Plan(engine_cls, dtype, engine_args, base_cls, base_dtype, against_args, k, checkpoint, chosen, source,
                 note, oracle_memory, budget_quantile, excess_z)


def _excess_z(args) -> float | None:
    """--excess-z: a finite number, or `none` (the ratio alone); not with --against, which runs no excess test."""
    from .compare import EXCESS_Z

    if args.excess_z is None:
        return EXCESS_Z
    if args.against:
        raise UsageError(f"--excess-z {args.excess_z}: not with --against (the excess test is against the oracle)")
    if args.excess_z.strip().lower() == "none":
        return None
    try:
        z = float(args.excess_z)
    except ValueError:
        z = math.nan
    if not math.isfinite(z):
        raise UsageError(f"--excess-z {args.excess_z}: expected a number (3, 2.5) or none")
    return z


def _budget_quantile(args) -> float:
    """--budget-quantile, checked against --budget-rule (and --against, which judges by the max rule)."""
    from .compare import BUDGET_QUANTILE, parse_budget_rules

    try:
        rules = parse_budget_rules(args.budget_rule)
    except ValueError as err:
        raise UsageError(str(err)) from None
    args.budget_rules = rules
    if args.budget_quantile is not None and "quantile" not in rules:
        raise UsageError(f"--budget-quantile {args.budget_quantile:g}: expected --budget-rule quantile with it")
    if "quantile" in rules and args.against:
        raise UsageError("--budget-rule quantile: not with --against (two engines' budgets add up by the max rule)")
    quantile = BUDGET_QUANTILE if args.budget_quantile is None else args.budget_quantile
    if not 0.5 <= quantile < 1:
        raise UsageError(f"--budget-quantile {quantile:g}: expected a number in [0.5, 1)")
    return quantile


def _oracle(plan: _Plan, args):
    from .runner import Oracle

    return Oracle(plan.checkpoint, device=args.device, gated_norm=args.gated_norm, memory_limit=plan.oracle_memory,
                  budget_rule=args.budget_rules[0], budget_quantile=plan.budget_quantile,
                  also_rules=args.budget_rules[1:], excess_z=plan.excess_z)


def _run_one(plan: _Plan, scenario, args, oracle, progress=None) -> tuple[dict, object]:
    """One scenario: its report entry and its Report (None where it was skipped or raised), with a progress bar of
    its own for the stages and engine steps inside it, or, given `progress` (a worker's), that callback instead."""
    from tqdm import tqdm

    from .runner import ScenarioSkipped, check_against, check_scenario

    bar = tqdm(desc=scenario.id, unit="step", leave=False, file=sys.stderr, position=1, disable=progress is not None)
    if progress is None:
        def progress(stage: str, steps: int) -> None:
            if steps:
                bar.update(steps)
            else:
                bar.set_description_str(f"{scenario.id}: {stage}")

    common = dict(oracle=oracle, source=plan.source, dtype=plan.dtype, device=args.device, k=plan.k,
                  atol=args.atol, engine_args=plan.engine_args, progress=progress)
    try:
        with bar:
            report = (check_scenario(plan.engine_cls, scenario, **common) if plan.base_cls is None else
                      check_against(plan.engine_cls, scenario, against=plan.base_cls, against_dtype=plan.base_dtype,
                                    against_args=plan.against_args, **common))
    except ScenarioSkipped as skip:
        return {"scenario": scenario.id, "verdict": "SKIP", "skipped": skip.reasons}, None
    except Exception as err:       # an engine that crashes fails its scenario; the others still run
        return {"scenario": scenario.id, "verdict": "ERROR", "error": f"{type(err).__name__}: {err}"}, None
    return {"verdict": "PASS" if report.passed else "FAIL", **report.to_dict()}, report


def _compare(args) -> int:
    """One model in this process (one --checkpoint, --jobs 1), else several, or one in worker processes."""
    checkpoints = args.checkpoint or [str(DEFAULT_CHECKPOINT)]
    specs = args.scenarios or ["all"]
    if len(specs) not in (1, len(checkpoints)):
        raise UsageError(f"--scenarios given {len(specs)} times for {len(checkpoints)} --checkpoint: expected it "
                         "once (for every checkpoint) or once per --checkpoint")
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: expected 1 or more worker processes")
    runs = [argparse.Namespace(**{**vars(args), "checkpoint": c, "scenarios": specs[i % len(specs)]})
            for i, c in enumerate(checkpoints)]
    if len(runs) == 1 and args.jobs == 1:
        return _compare_here(runs[0])
    if len(runs) > 1:
        names = [Path(c).resolve().name for c in checkpoints]
        if len(set(names)) < len(names):
            raise UsageError(f"--checkpoint: several directories named alike ({', '.join(names)}); each model's "
                             "files go to --out/<directory name>")
        for run, name in zip(runs, names):
            run.out = str(Path(args.out) / name)
    return _compare_pool(runs, args.jobs)


def _settings(args, plan: _Plan) -> tuple[dict, dict]:
    """The baseline and the settings of one model's report.json."""
    from .compare import ATOL
    from .engine import dtype_name

    if plan.base_cls is None:
        baseline = {"kind": "oracle", "engine": "reference", "dtype": "float64",
                    "engine_args": {"gated_norm": args.gated_norm}}
    else:
        baseline = {"kind": "engine", "engine": plan.base_cls.name, "dtype": dtype_name(plan.base_dtype),
                    "engine_args": plan.against_args}
    settings = {"engine": args.engine, "engine_args": plan.engine_args, "checkpoint": str(plan.checkpoint),
                "dtype": dtype_name(plan.dtype), "device": args.device, "baseline": baseline, "k": plan.k,
                "atol": ATOL[plan.dtype] if args.atol is None else args.atol, "oracle_gated_norm": args.gated_norm,
                "prompts": "random" if not plan.source.prompts else "file", "allow_skips": args.allow_skips,
                "selected": [s.id for s in plan.scenarios],
                "oracle": {"memory_limit_bytes": plan.oracle_memory},
                "excess_z": None if plan.base_cls is not None else plan.excess_z}
    return baseline, settings


def _start(args, plan: _Plan) -> None:
    """Before any work on a validated model: its note, and the previous run's files removed from its --out."""
    if plan.note:
        print(f"bamba-harness: {plan.note}", file=sys.stderr)
    out = Path(args.out)
    for stale in (out / REPORT_NAME, out / PLOT_NAME):
        stale.unlink(missing_ok=True)


def _compare_here(args) -> int:
    from tqdm import tqdm

    from . import report as report_doc

    plan = _validate(args)
    _start(args, plan)
    out = Path(args.out)
    baseline, settings = _settings(args, plan)
    started = time.time()
    oracle = _oracle(plan, args)
    reports, entries = [], []
    try:
        for scenario in tqdm(plan.scenarios, desc=f"{args.engine} {settings['dtype']}", unit="scenario",
                             file=sys.stderr):
            entry, report = _run_one(plan, scenario, args, oracle)
            entries.append(entry)
            reports += [report] if report is not None else []
    except (KeyboardInterrupt, Interrupted):
        report_doc.write_atomic(out / REPORT_NAME, report_doc.build(
            settings, entries, repo=REPO_ROOT, started=started, finished=time.time(), interrupted=True,
            not_run=[s.id for s in plan.scenarios[len(entries):]]))
        raise
    finally:
        oracle.close()
    settings["oracle"] = oracle.describe()
    _print_oracle(settings["oracle"])
    finished = time.time()
    document = _finish(args, plan, settings, baseline, entries, reports, started, finished)
    print(report_doc.summary_line(document["counts"], finished - started))
    return _exit_status(document, allow_skips=args.allow_skips)


def _print_oracle(oracle: dict) -> None:
    """One line per reference model that ran streamed (the report has them all)."""
    for model in oracle["models"]:
        if model["weights"] == "streamed":
            print(f"oracle: {model['dtype']} layer-streamed under --oracle-memory "
                  f"{oracle['memory_limit_bytes'] / 2**30:.3g} GiB: {model['peak_weight_bytes'] / 2**30:.3g} GiB of "
                  f"weights held at most (resident: {model['weight_bytes'] / 2**30:.3g} GiB)"
                  + (f"; device peak {oracle['device_peak_bytes'] / 2**30:.3g} GiB"
                     if oracle["device_peak_bytes"] else ""), file=sys.stderr)


def _finish(args, plan: _Plan, settings: dict, baseline: dict, entries: list[dict], reports: list, started: float,
            finished: float) -> dict:
    """Print one model's table and failures, write its report.json and plot; its report document."""
    from . import report as report_doc
    from .plot import plot_deltas

    out = Path(args.out)
    if plan.base_cls is not None:
        print(f"baseline: {baseline['engine']} {baseline['dtype']} (budget: the oracle's for {settings['dtype']} "
              f"+ for {baseline['dtype']})")
    print(report_doc.format_table(entries))
    for report in reports:
        if not report.passed:
            print(f"\n{report.message()}")
            if report.meta.get("hint"):
                print(f"hint: {report.meta['hint']}")

    document = report_doc.build(settings, entries, repo=REPO_ROOT, started=started, finished=finished)
    written = [report_doc.write_atomic(out / REPORT_NAME, document)]
    written.append(plot_deltas(reports, out / PLOT_NAME, **report_doc.figure_labels(document)))
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    return document


# ---- several models, or worker processes (--checkpoint repeated, --jobs N) -------------------------------------

_WORKER: dict = {}          # in a worker process: "ticks" (the queue to the parent), checkpoint -> (plan, oracle)


def _worker_init(ticks) -> None:
    """A worker process: one torch thread (N workers share N cores), the CLI's environment, and Ctrl-C left to
    the parent, which ends the workers itself."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepare_environment()
    _WORKER["ticks"] = ticks


def _worker_job(run: dict, scenario_id: str, job: int) -> tuple[dict, object, float]:
    """One scenario of one model in a worker: the entry and Report that _run_one gives, and its seconds; every
    engine step is reported to the parent as (job, steps), for its progress bar."""
    began = time.time()
    args = argparse.Namespace(**run)
    if args.checkpoint not in _WORKER:
        plan = _validate(args)
        _WORKER[args.checkpoint] = plan, _oracle(plan, args)
    plan, oracle = _WORKER[args.checkpoint]
    scenario = next(s for s in plan.scenarios if s.id == scenario_id)
    ticks = _WORKER["ticks"]

    def progress(stage: str, steps: int) -> None:
        if steps:
            ticks.put((job, steps))

    entry, report = _run_one(plan, scenario, args, oracle, progress=progress)
    return entry, report, time.time() - began


def planned_steps(scenario) -> int:
    """The engine steps a scenario's workload takes under its options (harness/schedule.py; an invariance
    scenario's, under each of its configurations): the weight of its share of the progress bar and of the order in
    which workers take scenarios (the longest first)."""
    from .schedule import plan_options, plan_steps

    return max(1, sum(len(plan_steps(shapes, **plan_options(options))) for _, options, shapes in scenario.workloads()))


def _compare_pool(runs: list, jobs: int) -> int:
    """Every model's scenarios in `jobs` worker processes, the longest first; then each model's table, files and
    summary line in order, and a last summary line over all of them with the whole run's time."""
    import multiprocessing
    import queue
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from tqdm import tqdm

    from . import report as report_doc

    plans = [_validate(run) for run in runs]           # every model checked before any work
    for run, plan in zip(runs, plans):
        _start(run, plan)
    several = len(runs) > 1
    names = [Path(run.checkpoint).resolve().name for run in runs]
    work = sorted(((m, i, planned_steps(s)) for m, plan in enumerate(plans) for i, s in enumerate(plan.scenarios)),
                  key=lambda job: -job[2])
    entries: list[list] = [[None] * len(plan.scenarios) for plan in plans]
    reports: list[list] = [[None] * len(plan.scenarios) for plan in plans]
    context = multiprocessing.get_context("spawn")
    ticks = context.Queue()
    started = time.time()
    bar = tqdm(total=sum(w for _, _, w in work), unit="step", file=sys.stderr, smoothing=0,
               desc=f"{runs[0].engine} {len(work)} scenarios" + (f" of {len(runs)} models" if several else ""))
    pool = ProcessPoolExecutor(max_workers=max(1, min(jobs, len(work))), mp_context=context,
                               initializer=_worker_init, initargs=(ticks,))
    counted = [0] * len(work)                   # steps shown per job, at most its planned steps
    seconds = [0.0] * len(runs)                 # per model: its scenarios' time in the workers
    try:
        futures = {pool.submit(_worker_job, vars(runs[m]), plans[m].scenarios[i].id, j): j
                   for j, (m, i, _) in enumerate(work)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            with contextlib.suppress(queue.Empty):
                while True:
                    j, steps = ticks.get_nowait()
                    shown = min(steps, work[j][2] - counted[j])
                    counted[j] += shown
                    bar.update(shown)
            for future in done:
                j = futures[future]
                m, i, weight = work[j]
                scenario = plans[m].scenarios[i]
                try:
                    entry, report, took = future.result()
                except Exception as err:         # the worker died (killed, out of memory): this scenario's error
                    entry, report, took = {"scenario": scenario.id, "verdict": "ERROR",
                                           "error": f"{type(err).__name__}: {err}"}, None, 0.0
                seconds[m] += took
                entries[m][i], reports[m][i] = entry, report
                bar.update(weight - counted[j])
                counted[j] = weight
                bar.set_postfix_str(f"{names[m] + ' ' if several else ''}{scenario.id} {entry['verdict']}")
            bar.refresh()
    except (KeyboardInterrupt, Interrupted):
        _stop_pool(pool)
        now = time.time()
        for run, plan, done_entries in zip(runs, plans, entries):
            _, settings = _settings(run, plan)
            report_doc.write_atomic(Path(run.out) / REPORT_NAME, report_doc.build(
                settings, [e for e in done_entries if e is not None], repo=REPO_ROOT, started=started, finished=now,
                interrupted=True, not_run=[s.id for s, e in zip(plan.scenarios, done_entries) if e is None]))
        raise
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
    finished = time.time()

    status, total = EXIT_PASS, {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for run, plan, name, model_entries, model_reports, took in zip(runs, plans, names, entries, reports, seconds):
        if several:
            print(f"== {name}")
        baseline, settings = _settings(run, plan)
        document = _finish(run, plan, settings, baseline, model_entries, [r for r in model_reports if r is not None],
                           started, finished)
        if several:               # the scenarios' own time; the last line gives the run's
            print(report_doc.summary_line(document["counts"], took) + f" ({name}: its scenarios' time in the workers)")
        else:
            print(report_doc.summary_line(document["counts"], finished - started))
        for key in total:
            total[key] += document["counts"][key]
        code = _exit_status(document, allow_skips=run.allow_skips)
        status = code if status == EXIT_PASS else status           # the first model's non-zero status
        if several:
            print()
    if several:
        print(f"{len(runs)} models: " + report_doc.summary_line(total, finished - started))
    return status


def _stop_pool(pool) -> None:
    """End the worker processes now (a worker ends its engine's own processes on SIGTERM: vendored/engine)."""
    for process in list(getattr(pool, "_processes", {}).values()):
        with contextlib.suppress(Exception):
            process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def _exit_status(document: dict, *, allow_skips: bool) -> int:
    """The exit status of a finished run (the table in this module's docstring)."""
    if document["verdict"] == "fail":
        return EXIT_FAIL
    if document["verdict"] == "nothing-checked":
        if not document["counts"]["skipped"]:
            print("bamba-harness: no scenario selected: nothing was checked", file=sys.stderr)
            return EXIT_NOTHING_CHECKED
        if not allow_skips:
            print("bamba-harness: every selected scenario was skipped: nothing was checked (--allow-skips "
                  "accepts that)", file=sys.stderr)
            return EXIT_NOTHING_CHECKED
    return EXIT_PASS


def _list(args) -> int:
    from .adapters import _load, available_engines
    from .scenarios import build_scenarios

    cfg = _read_config(Path(args.checkpoint))
    for name, problem in available_engines().items():
        families = getattr(_load(name), "families", ())
        if problem is None and cfg.model_type not in families:
            problem = f"serves {' and '.join(families)} checkpoints, not {cfg.model_type}"
        print(f"engine {name:14s} {'available' if problem is None else 'unavailable: ' + problem}")
    print(f"\nscenarios for Q = {cfg.mamba_chunk_size}, W = {cfg.mamba_d_conv}, G = {cfg.mamba_n_groups}:")
    for s in build_scenarios(cfg):
        print(f"  {s.id:34s} {'(slow) ' if s.slow else ''}{'(opt-in) ' if s.opt_in else ''}{s.about}")
    for name, problem in available_engines().items():
        loaded = _load(name)
        own = loaded.engine_scenarios(cfg) if not isinstance(loaded, str) else []
        if own:
            print(f"\n{name}'s own scenarios (with --engine {name}):")
            for s in own:
                print(f"  {s.id:34s} {s.about}")
    return 0


def _write_model(args) -> int:
    from . import scale, zoo

    if args.list:
        for name in scale.SCALE:
            print(f"scale {name}")
        for name in zoo.ZOO:
            print(f"zoo   {name}")
        for name in zoo.GRANITE_ZOO:
            print(f"zoo   {name} (GraniteMoeHybrid)")
        return 0
    if not args.name or not args.directory:
        raise UsageError("write-model: expected NAME DIRECTORY (names: `bamba-harness write-model --list`)")
    if args.name not in scale.SCALE and args.name not in zoo.ZOO and args.name not in zoo.GRANITE_ZOO:
        raise UsageError(f"write-model: unknown model {args.name!r}; expected one of "
                         f"{', '.join([*scale.SCALE, *zoo.ZOO, *zoo.GRANITE_ZOO])}")
    directory = Path(args.directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UsageError(f"write-model: {directory} exists and is not an empty directory")
    if args.name in scale.SCALE:
        _check_device(args.device)
        scale.write_checkpoint(args.name, directory, seed=args.seed, device=args.device)
    else:
        zoo.write_checkpoint(args.name, directory, seed=args.seed)
    print(f"wrote {args.name} (seed {args.seed}) to {directory}")
    return 0


def prepare_environment() -> None:
    """Before any engine is imported: Triton kernels run under its interpreter where there is no CUDA device (as
    the root conftest.py arranges for tests), and transformers' notes about falling back to its PyTorch path and
    its weight-loading bars stay out of the table."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def _sigterm_interrupts():
    """While the command runs, SIGTERM raises Interrupted in the main thread (only there can a handler be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None if argv[:1] == ["lm-eval"] else _parser().parse_args(argv)     # --help: before torch is imported
    with _sigterm_interrupts():
        try:
            prepare_environment()
            if args is None:
                from .lm_eval import run_lm_eval

                return run_lm_eval(argv[1:])
            if args.command == "write-model":
                return _write_model(args)
            return _compare(args) if args.command == "compare" else _list(args)
        except UsageError as err:
            print(f"bamba-harness: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except (KeyboardInterrupt, Interrupted) as stop:
            signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
            print("bamba-harness: interrupted" + ("" if signum == signal.SIGINT else " (SIGTERM)"), file=sys.stderr)
            return EXIT_SIGNAL[signum]


if __name__ == "__main__":
    sys.exit(main())
