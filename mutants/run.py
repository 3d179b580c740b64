"""Run the mutation suite: each mutant in its own scratch copy of the tree, its test selection with -x, a table.

    python -m mutants.run [--gpu] [--ci] [--engine NAME] [--ops PEER] [--only NAME,...] [--jobs N] [--out DIR]

The working tree is never modified: the tree (minus .git and what .gitignore names) is copied once per mutant into a
temporary directory, the mutant's edits are written there, and pytest runs from there with that copy first on
sys.path. First a baseline: the union of the selections must pass on an unmutated copy, or a "caught" would mean
nothing. Outcomes: killed (a selected test failed: it is named), timeout (counted as caught: the suite notices a
hang), survived, broken (the selection could not even run: a collection error, no test collected), unapplied (an
anchor not found exactly once). Exit status 0 only when every mutant is killed or timed out.
Mutants of an opt-in engine's adapter (`engine = "llamacpp"` in the file) run only with --engine NAME, their
selections with pytest's --engine NAME, against the engine's own virtualenv and caches in this tree.
Mutants of a peer's kernels (`ops = "vllm"`) run only with --ops PEER: their edits go to the peer's vendored copy,
which (.peers, `make fetch-peers`) is copied into their scratch trees, and their selections run with pytest's --ops.
Writes report.json and table.md to --out.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from .mutant import DEFS, Mutant, MutantError, load_all

ROOT = Path(__file__).resolve().parents[1]
# Left out of every scratch copy: at the top level (as .gitignore has them) and at any depth.
SKIP_TOP = {".git", ".venv", ".venv-vllm", ".venv-llamacpp", ".cache", "out", ".peers", ".whl", "build", "dist"}
# What an opt-in engine in a scratch copy uses from this tree: its virtualenv, its sources, its conversion cache.
ENGINE_ENV = {"BAMBA_LLAMACPP_PYTHON": ROOT / ".venv-llamacpp" / "bin" / "python",
              "BAMBA_LLAMACPP_SOURCE": None, "BAMBA_GGUF_CACHE": ROOT / ".cache" / "gguf",
              "BAMBA_VLLM_PYTHON": ROOT / ".venv-vllm" / "bin" / "python"}
SKIP_ANY = {"__pycache__", ".pytest_cache", ".hypothesis"}
CAUGHT = ("killed", "timeout")


@dataclass
class Outcome:
    name: str
    bug_class: str
    bug: str
    selection: list[str]
    outcome: str                # killed | timeout | survived | broken | unapplied
    caught_by: str | None       # the node id of the first failing test
    message: str                # the failure's first line, or why it is broken / unapplied
    seconds: float
    tests_run: int


def ignored_patterns(src: Path) -> list[tuple[str, bool, bool, bool]]:
    """The top-level .gitignore of `src` as (pattern, anchored, directories only, negated) for `_ignored`: blank
    lines and comments dropped; a pattern with a slash other than a trailing one is anchored at the top."""
    path = src / ".gitignore"
    rules = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line[1:] if negated else line
        directory = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        rules.append((line.lstrip("/"), anchored, directory, negated))
    return rules


def _ignored(rel: str, is_dir: bool, rules) -> bool:
    """Whether the path `rel` (relative to the top, with slashes) is ignored: the last rule that matches decides, as
    in git (a pattern without a slash matches the name at any depth; `**` is not understood)."""
    ignored = False
    for pattern, anchored, directory, negated in rules:
        if directory and not is_dir:
            continue
        if fnmatch.fnmatchcase(rel if anchored else rel.rsplit("/", 1)[-1], pattern):
            ignored = not negated
    return ignored


def copy_tree(src: Path, dst: Path, peers: bool = False, exclude: tuple[Path, ...] = ()) -> None:
    """The tree as a clean clone has it (plus untracked sources): without what its .gitignore names (the
    virtualenvs, outputs, caches, and scratch/, where a 20 GB model may lie), nor the paths in `exclude` (a model or
    an output directory kept inside the tree); with the peers' vendored kernels (.peers) when `peers`."""
    src = src.resolve()
    skip_top = SKIP_TOP - {".peers"} if peers else SKIP_TOP
    rules = ignored_patterns(src)
    excluded = {Path(p).resolve() for p in exclude}

    def ignore(directory: str, names: list[str]) -> set[str]:
        here = Path(directory).resolve()
        top = here == src
        rel = here.relative_to(src).as_posix()
        skipped = set()
        for n in names:
            path = here / n
            if n in SKIP_ANY or n.endswith(".egg-info") or (top and n in skip_top) or path in excluded:
                skipped.add(n)
            elif not (peers and top and n == ".peers") and \
                    _ignored(n if top else f"{rel}/{n}", path.is_dir() and not path.is_symlink(), rules):
                skipped.add(n)
        return skipped

    shutil.copytree(src, dst, ignore=ignore, symlinks=True)


def pytest_command(selection: list[str], junit: Path, *, gpu: bool, timeout: int, stop_first: bool,
                   workers: int = 0, engine: str | None = None, ops: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit)]
    if engine:
        cmd += ["--engine", engine]
    if ops:
        cmd += ["--ops", ops]
    if not gpu:
        cmd += ["-m", "not gpu"]
    if stop_first:
        cmd.append("-x")
    if workers > 1:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:      # absent on the GPU image: then no timeout
        cmd += ["--timeout", str(timeout)]
    return cmd + selection


def scratch_env(tree: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), BAMBA_TORCH_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")
    sources = sorted((ROOT / ".venv-llamacpp" / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    for key, path in {**ENGINE_ENV, "BAMBA_LLAMACPP_SOURCE": sources[-1] if sources else None}.items():
        if path is not None:
            env.setdefault(key, str(path))
    env.pop("PYTEST_XDIST_WORKER", None)
    if (tree / ".peers").is_dir():                    # a peer mutant's tree: its own (mutated) copy of the peers
        env.update(BAMBA_PEERS=str(tree / ".peers"), PEERS_VENDOR=str(tree / ".peers" / "vendor"))
    return env


def first_failure(junit: Path) -> tuple[str | None, str, int]:
    """(node id of the first failed or errored test case, its message's first line, number of tests run)."""
    if not junit.is_file():
        return None, "", 0
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    run = sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            module, name = case.get("classname", ""), case.get("name", "")
            node = f"{module.replace('.', '/')}.py::{name}" if module else name
            text = (bad.get("message") or bad.text or "").strip()
            return node, (text.splitlines() or [""])[0][:240], run
    return None, "", run


def run_mutant(mutant: Mutant, scratch: Path, *, gpu: bool, timeout: int, threads: int, keep: bool) -> Outcome:
    tree = scratch / mutant.name
    result = dict(name=mutant.name, bug_class=mutant.bug_class, bug=mutant.bug, selection=list(mutant.selection))
    copy_tree(ROOT, tree, peers=mutant.ops is not None)
    try:
        mutant.apply(tree)
    except MutantError as err:
        return Outcome(**result, outcome="unapplied", caught_by=None, message=str(err), seconds=0.0, tests_run=0)
    junit = scratch / f"{mutant.name}.xml"
    cmd = pytest_command(list(mutant.selection), junit, gpu=gpu, timeout=timeout, stop_first=True,
                         engine=mutant.engine, ops=mutant.ops)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=scratch_env(tree, threads), capture_output=True, text=True,
                              timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - start
        return Outcome(**result, outcome="timeout", caught_by=None, message=f"no result after {seconds:.0f} s",
                       seconds=seconds, tests_run=0)
    seconds = time.monotonic() - start
    node, message, run = first_failure(junit)
    if not keep:
        shutil.rmtree(tree, ignore_errors=True)
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])[:400]
    outcome, message = classify(proc.returncode, node, message, tail)
    return Outcome(**result, outcome=outcome, caught_by=node if outcome != "survived" else None, message=message,
                   seconds=seconds, tests_run=run)


def classify(returncode: int, node: str | None, message: str, tail: str) -> tuple[str, str]:
    """(outcome, message) of a mutant's pytest run from its exit status and the first failing test in its junit
    report (node, message; None when none failed). A failing test is a kill whether pytest then exits with 1 or dies
    of a signal after writing its report (a CUDA illegal address leaves the context broken, and the process aborts
    on its way out: the report already holds the failure); anything else that is not a pass is "broken"."""
    if returncode == 0:
        return "survived", "every selected test passed"
    if node is not None and (returncode == 1 or returncode < 0):
        outcome = "timeout" if "Timeout" in message else "killed"
        return outcome, message + (f" (then pytest died of signal {-returncode})" if returncode < 0 else "")
    return "broken", f"pytest exit {returncode}: {tail}"


def baseline(mutants: list[Mutant], scratch: Path, *, gpu: bool, timeout: int, jobs: int) -> None:
    """The union of the selections must pass on an unmutated copy, imported from that copy."""
    tree = scratch / "baseline"
    peer_ops = {m.ops for m in mutants}
    if len(peer_ops) > 1:
        sys.exit(f"mutants: one run takes the mutants of one op provider, got {sorted(map(str, peer_ops))}")
    ops = peer_ops.pop()
    copy_tree(ROOT, tree, peers=ops is not None)
    env = scratch_env(tree, 1 if jobs > 1 else 2)
    where = subprocess.run([sys.executable, "-c", "import vendored; print(vendored.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"mutants: the scratch copy imports vendored from {where}, not from {tree}: mutants would not run")
    selection = list(dict.fromkeys(node for m in mutants for node in m.selection))
    engines = {m.engine for m in mutants}
    if len(engines) > 1:
        sys.exit(f"mutants: one run takes the mutants of one engine, got {sorted(map(str, engines))}")
    cmd = pytest_command(selection, scratch / "baseline.xml", gpu=gpu, timeout=timeout, stop_first=False,
                         workers=jobs, engine=engines.pop(), ops=ops)
    print(f"baseline: {len(selection)} selections on the unmutated tree ...", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
        sys.exit(f"mutants: the selections fail on the unmutated tree (pytest exit {proc.returncode}); fix that first")
    print(f"baseline: passed in {time.monotonic() - start:.0f} s", flush=True)
    shutil.rmtree(tree, ignore_errors=True)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | bug class | outcome | caught by | s |", "| --- | --- | --- | --- | ---: |"]
    for o in outcomes:
        lines.append(f"| `{o.name}` | {o.bug_class} | {o.outcome} | {f'`{o.caught_by}`' if o.caught_by else '-'} "
                     f"| {o.seconds:.0f} |")
    caught = sum(o.outcome in CAUGHT for o in outcomes)
    lines.append(f"\nMutation score: {caught}/{len(outcomes)} caught ({100 * caught / max(1, len(outcomes)):.0f}%).")
    return "\n".join(lines)


def select(mutants: list[Mutant], *, gpu: bool, ci: bool, only: str | None, engine: str | None = None,
           ops: str | None = None) -> list[Mutant]:
    chosen = [m for m in mutants if m.gpu == gpu and m.engine == engine and m.ops == ops and (m.ci or not ci)]
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = sorted(set(names) - {m.name for m in mutants})
        if unknown:
            sys.exit(f"mutants: unknown mutant(s) {unknown}; known: {', '.join(m.name for m in mutants)}")
        chosen = [m for m in mutants if m.name in names]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutants.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU-only mutants (CUDA graphs, NCCL TP, long inputs)")
    parser.add_argument("--ci", action="store_true", help="only the fast subset marked ci = true")
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--engine", help="the mutants of this opt-in engine's adapter (llamacpp), run with its tests")
    parser.add_argument("--ops", help="the mutants of this peer's vendored kernels (.peers), run with --ops")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2, CI's cores)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "mutants")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmutated tree")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies (their path is printed)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")

    mutants = select(load_all(DEFS), gpu=args.gpu, ci=args.ci, only=args.only, engine=args.engine, ops=args.ops)
    if args.ops and not (ROOT / ".peers" / "peer_loader.py").is_file():
        sys.exit("mutants: --ops needs the peers' vendored kernels in .peers: run `make fetch-peers` first")
    if not mutants:
        print("mutants: none selected")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="bamba-mutants-"))
    started = time.monotonic()
    try:
        if not args.no_baseline:
            baseline(mutants, scratch, gpu=args.gpu, timeout=args.timeout, jobs=args.jobs)
        threads = 1 if args.jobs > 1 else 2
        outcomes = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_mutant, m, scratch, gpu=args.gpu, timeout=args.timeout, threads=threads,
                                   keep=args.keep) for m in mutants]
            for future in tqdm(as_completed(futures), total=len(futures), desc="mutants", unit="mutant"):
                outcomes.append(future.result())
    finally:
        if args.keep:
            print(f"scratch copies kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(mutants)}
    outcomes.sort(key=lambda o: order[o.name])
    wall = time.monotonic() - started

    text = table(outcomes)
    print(text)
    print(f"wall time {wall:.0f} s with --jobs {args.jobs}")
    args.out.mkdir(parents=True, exist_ok=True)
    caught = sum(o.outcome in CAUGHT for o in outcomes)
    report = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), gpu=args.gpu, jobs=args.jobs,
                  wall_seconds=round(wall, 1), caught=caught, total=len(outcomes),
                  mutants=[asdict(o) for o in outcomes])
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "table.md").write_text(text + "\n")
    for o in outcomes:
        if o.outcome not in CAUGHT:
            print(f"NOT CAUGHT {o.name}: {o.outcome}: {o.message}", file=sys.stderr)
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
