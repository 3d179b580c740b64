"""`bamba-harness`: judge an engine against the fp64 oracle on the scenario matrix.

    bamba-harness compare --engine transformers --checkpoint DIR --scenarios chunked_prefill,batching \\
        --dtype bfloat16 --device cuda --out out/
    bamba-harness list [--checkpoint DIR]
    bamba-harness lm-eval --model_args engine=vendored,checkpoint=DIR --tasks bamba_tiny --include_path fixtures/tasks

`lm-eval ...` is lm-eval's own command line with the model `bamba-harness` (harness/lm_eval.py) registered and
chosen unless --model says otherwise; everything after `lm-eval` goes to lm-eval as it is.

`compare` prints a table (scenario, requests, max |Δ|, budget, mean KL, top-1 agreement, first divergence, verdict:
PASS, FAIL, SKIP with the engine's reason, or ERROR where the engine raised), writes report.json and
delta_by_position.png to --out, and exits 1 if any scenario fails or errs. Usage errors (unknown
engine, scenario or dtype, missing checkpoint or unavailable engine) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO_ROOT / "fixtures" / "tiny-bamba"
DEFAULT_PROMPTS = REPO_ROOT / "fixtures" / "prompts.jsonl"


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bamba-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="run scenarios on an engine and judge it against the fp64 oracle")
    compare.add_argument("--engine", required=True, help="engine name (see `bamba-harness list`)")
    compare.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    compare.add_argument("--scenarios", default="all", help="comma-separated kinds and/or scenario ids")
    compare.add_argument("--dtype", default="float32", help="the candidate's dtype (float32, bfloat16, ...)")
    compare.add_argument("--device", default="cpu", help="device of the candidate and the oracle")
    compare.add_argument("--out", default="out", help="directory for report.json and delta_by_position.png")
    compare.add_argument("--prompts", default=None,
                         help="prompts .jsonl (default: fixtures/prompts.jsonl where its ids fit the model's "
                              "vocabulary, else seeded random ids)")
    compare.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    compare.add_argument("--k", type=float, default=None, help="budget multiplier (default 2)")
    compare.add_argument("--atol", type=float, default=None, help="budget floor (default: per dtype, compare.py)")
    compare.add_argument("--gated-norm", default="grouped", choices=("grouped", "full"),
                         help="the oracle's gated RMSNorm: per group (Bamba) or full width (transformers)")
    compare.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                         help="an adapter-specific option, repeatable")
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's command line with the bamba-harness model (arguments go to lm-eval as they are)")
    listing = sub.add_parser("list", help="engines (with availability) and the scenarios of a checkpoint")
    listing.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    return parser


def _load_inputs(args):
    """Checkpoint, config, scenarios, prompt source and a note to print once the input is known to be good (or
    UsageError in one line)."""
    from reference.config import ConfigError, ModelConfig

    from .scenarios import PromptSource, build_scenarios

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise UsageError(f"checkpoint directory {checkpoint} does not exist")
    try:
        cfg = ModelConfig.from_json(checkpoint)
    except ConfigError as err:
        raise UsageError(str(err)) from err
    source, note = PromptSource(cfg.vocab_size, seed=getattr(args, "seed", 0)), ""
    given = getattr(args, "prompts", None)
    if given:
        try:
            source = PromptSource.from_jsonl(given, cfg.vocab_size)
        except (OSError, ValueError, KeyError) as err:
            raise UsageError(f"--prompts {given}: {err}") from err
    elif DEFAULT_PROMPTS.is_file():
        try:
            source = PromptSource.from_jsonl(DEFAULT_PROMPTS, cfg.vocab_size)
        except ValueError as err:      # the bundled prompts belong to the bundled model's tokenizer
            note = f"{err}; using random prompts"
    return checkpoint, cfg, build_scenarios(cfg), source, note


def _engine_args(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _format_row(cells, widths) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()


def _compare(args) -> int:
    import torch
    from tqdm import tqdm

    from .adapters import EngineUnavailable, UnknownEngine, get_engine
    from .compare import ATOL, DEFAULT_K
    from .engine import dtype_name, parse_dtype
    from .plot import plot_deltas
    from .runner import Oracle, ScenarioSkipped, check_scenario
    from .scenarios import select_scenarios

    try:
        engine_cls = get_engine(args.engine)
        dtype = parse_dtype(args.dtype)
        torch.device(args.device)
    except (UnknownEngine, EngineUnavailable, ValueError, RuntimeError) as err:
        raise UsageError(str(err)) from err
    checkpoint, cfg, scenarios, source, note = _load_inputs(args)
    try:
        chosen = select_scenarios(scenarios, args.scenarios)
    except ValueError as err:
        raise UsageError(str(err)) from err
    engine_args = _engine_args(args.engine_arg)
    if note:
        print(f"bamba-harness: {note}", file=sys.stderr)
    k = DEFAULT_K if args.k is None else args.k
    atol = ATOL[dtype] if args.atol is None else args.atol

    oracle = Oracle(checkpoint, device=args.device, gated_norm=args.gated_norm)
    reports, entries, table = [], [], []
    for scenario in tqdm(chosen, desc=f"{args.engine} {dtype_name(dtype)}", unit="scenario", file=sys.stderr):
        try:
            report = check_scenario(engine_cls, scenario, oracle=oracle, source=source, dtype=dtype,
                                    device=args.device, k=k, atol=atol, engine_args=engine_args)
        except ScenarioSkipped as skip:
            entries.append({"scenario": scenario.id, "skipped": skip.reasons})
            table.append((scenario.id, len(scenario.shapes), "-", "-", "-", "-", "-", "SKIP"))
            continue
        except Exception as err:       # an engine that crashes fails its scenario; the others still run
            entries.append({"scenario": scenario.id, "error": f"{type(err).__name__}: {err}"})
            table.append((scenario.id, len(scenario.shapes), "-", "-", "-", "-", "-", "ERROR"))
            continue
        reports.append(report)
        entries.append(report.to_dict())
        first = report.first_divergence
        table.append((scenario.id, len(report.comparisons), f"{report.max_delta:.3g}", f"{report.meta['budget']:.3g}",
                      f"{report.mean_kl:.3g}", f"{report.top1_agreement:.1%}",
                      f"{first[0]}@{first[1]}" if first else "-", "PASS" if report.passed else "FAIL"))
    oracle.close()

    header = ("scenario", "requests", "max |Δ|", "budget", "mean KL", "top-1", "first divergence", "verdict")
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header) - 1)] + [0]
    print(_format_row(header, widths))
    for row in table:
        print(_format_row(row, widths))
    skipped = [e for e in entries if "skipped" in e]
    if skipped:
        print("\nskipped:")
        for entry in skipped:
            print(f"  {entry['scenario']}: {'; '.join(entry['skipped'])}")
    for entry in entries:
        if "error" in entry:
            print(f"\n{entry['scenario']}: {entry['error']}")
    for report in reports:
        if not report.passed:
            print(f"\n{report.message()}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"engine": args.engine, "checkpoint": str(checkpoint), "dtype": dtype_name(dtype),
               "device": args.device, "k": k, "atol": atol, "oracle_gated_norm": args.gated_norm,
               "prompts": "random" if not source.prompts else "file", "scenarios": entries}
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    written = [out / "report.json"]
    if reports:
        written.append(plot_deltas(reports, out / "delta_by_position.png"))
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 0 if all(r.passed for r in reports) and not any("error" in e for e in entries) else 1


def _list(args) -> int:
    from .adapters import available_engines

    for name, problem in available_engines().items():
        print(f"engine {name:14s} {'available' if problem is None else 'unavailable: ' + problem}")
    _, cfg, scenarios, _, _ = _load_inputs(args)
    print(f"\nscenarios for Q = {cfg.mamba_chunk_size}, W = {cfg.mamba_d_conv}, G = {cfg.mamba_n_groups}:")
    for s in scenarios:
        print(f"  {s.id:34s} {'(slow) ' if s.slow else ''}{s.about}")
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


def main(argv: list[str] | None = None) -> int:
    prepare_environment()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:
        from .lm_eval import run_lm_eval

        return run_lm_eval(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _compare(args) if args.command == "compare" else _list(args)
    except UsageError as err:
        print(f"bamba-harness: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
