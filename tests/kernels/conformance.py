"""The kernel conformance table: tests/kernels run against every op provider, one pytest process each, tabulated.

    python -m tests.kernels.conformance --out out/kernel-conformance            # make kernel-conformance
    python -m tests.kernels.conformance --ops vendored,vllm-0.7.3 --doc ''      # some providers, no docs file

Rows are the tests grouped by the boundary class they exercise (CLASSES), columns the providers (--ops names, peers at
their pinned versions). A cell counts passed / failed / xfailed (a pinned finding, tests/kernels/peer_findings.py) /
skipped tests and gives the worst error among those that ran, in units of the test's tolerance (1.0 = on the bound;
the three-way bound of tests/kernels/common.py). Writes OUT/<provider>.jsonl (one line per test), OUT/table.json,
OUT/table.md and, unless --doc '', docs/kernel-conformance.md (the table with its date, device and versions).
On a CPU the tests run under the Triton interpreter (fp32 and fp16 shapes); on a GPU add --gpu to run the gpu-marked
tests too (Bamba-9B shapes, bf16).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import fnmatch
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROVIDERS = ("vendored", "vllm", "vllm-0.10.2", "vllm-0.7.3", "mamba_ssm", "fla")

# (boundary class, fnmatch patterns of "module.py::test_function"), first match wins
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("scan: one sequence from an initial state, lengths 1, W-1, Q-1, Q, Q+1, 5Q",
     ("test_ssd_scan.py::test_one_sequence_with_initial_state",)),
    ("scan: packed sequences starting inside chunks, initial states mixed, all, none",
     ("test_ssd_scan.py::test_packed_sequences_*",)),
    ("scan: groups, chunk sizes (8, 24, 128, 192)", ("test_ssd_scan.py::test_groups", "test_ssd_scan.py::test_chunk_sizes")),
    ("scan: without z, D or dt_bias; dt_limit; no softplus",
     ("test_ssd_scan.py::test_without_optional_input", "test_ssd_scan.py::test_dt_*")),
    ("scan: 16-bit inputs, fp32 and bf16 state pools", ("test_ssd_scan.py::test_rounded_products",
                                                         "test_ssd_scan.py::test_16bit_*", "test_ssd_scan.py::test_bamba_9b_*")),
    ("scan: empty sequences", ("test_ssd_scan.py::test_empty_sequence*",)),
    ("scan: strided views of one projection; offsets past 2^31",
     ("test_ssd_scan.py::test_strided_*", "test_ssd_scan.py::test_long_input*")),
    ("decode state update: padding rows, groups, sizes, optional inputs, softplus",
     ("test_selective_state_update.py::test_groups*", "test_selective_state_update.py::test_awkward*",
      "test_selective_state_update.py::test_optional*", "test_selective_state_update.py::test_*softplus*",
      "test_selective_state_update.py::test_pad*", "test_selective_state_update.py::test_one_row",
      "test_selective_state_update.py::test_dt_limit*")),
    ("decode state update: 16-bit inputs, strided views, offsets past 2^31",
     ("test_selective_state_update.py::test_16bit*", "test_selective_state_update.py::test_strided*",
      "test_selective_state_update.py::test_bamba*", "test_selective_state_update.py::test_row_offsets*")),
    ("causal conv prefill: sequences anywhere, windows kept, widths, bias, activation",
     ("test_causal_conv1d.py::test_*",)),
    ("causal conv decode: padding rows, widths, strided pools", ("test_causal_conv1d_update.py::test_*",)),
    ("gated RMSNorm: groups, gate position, strided views", ("test_rms_norm_gated.py::test_*",)),
    ("prefill pieces then decode steps = one whole prefill (conv + scan + state update)",
     ("test_state_equivalence.py::test_*",)),
)
OTHER = "our kernels' own internals, input errors and ops the peers lack"


def boundary_class(nodeid: str) -> str:
    module, _, name = nodeid.rpartition("/")[2].partition("::")
    key = f"{module}::{name.split('[')[0]}"
    for label, patterns in CLASSES:
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return label
    return OTHER


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.kernels.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(PROVIDERS), help="comma-separated providers (default: all)")
    p.add_argument("--out", default="out/kernel-conformance")
    p.add_argument("--doc", default="docs/kernel-conformance.md", help="markdown file to write ('' for none)")
    p.add_argument("--gpu", action="store_true", help="also the gpu-marked tests (a CUDA machine)")
    p.add_argument("--gpu-only", action="store_true",
                   help="with --gpu: the gpu-marked tests alone (Bamba-9B shapes, bf16: what the CPU table lacks)")
    p.add_argument("--jobs", default=os.environ.get("XDIST", "2"), help="pytest-xdist workers per provider")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per provider; its pytest is then stopped and the tests it finished are tabulated, "
                        "the provider marked incomplete")
    p.add_argument("--parallel", type=int, default=1,
                   help="providers run side by side, each its own pytest process (a GPU run: on the one device, their "
                        "large-gpu-memory tests one at a time through conftest.py's lock file)")
    p.add_argument("--reuse", action="store_true",
                   help="tabulate OUT/<provider>.jsonl and OUT/meta.json of earlier runs (e.g. GPU runs split "
                        "across calls) instead of running pytest where they exist")
    a = p.parse_args(argv)
    a.providers = [o.strip() for o in a.ops.split(",") if o.strip()]
    unknown = [o for o in a.providers if o not in PROVIDERS]
    if unknown:
        p.error(f"--ops: unknown provider {unknown[0]!r}; expected some of {', '.join(PROVIDERS)}")
    if a.gpu_only and not a.gpu:
        p.error("--gpu-only: only with --gpu")
    if a.parallel < 1:
        p.error(f"--parallel: {a.parallel} is not a positive number of processes")
    return a


def run_provider(name: str, out: Path, a: argparse.Namespace) -> tuple[list[dict], float, int]:
    report = out / f"{name}.jsonl"
    report.unlink(missing_ok=True)
    marks = ("gpu and " if a.gpu_only else "") + "not slow and not scale" if a.gpu else "not gpu and not slow"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", "-m", marks,
           "--ops", name, "--ops-report", str(report), "-n", str(a.jobs)]
    if a.gpu:
        cmd += ["--dist", "loadgroup"]              # the large-gpu-memory tests one at a time (conftest.py)
    started = time.monotonic()
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        done = subprocess.CompletedProcess(cmd, 124, stdout + f"\nstopped after {a.timeout:.0f} s (--timeout)", "")
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    print(f"   {name}: {tail} ({time.monotonic() - started:.0f} s; {out / f'{name}.log'})", flush=True)
    rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    if not rows:
        print(f"{name}: pytest wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}",
              file=sys.stderr, flush=True)
    return rows, time.monotonic() - started, done.returncode


# Failures that are no verdict on the kernel: the device ran out of memory (other tests, other providers' processes
# on the same GPU), and CUDA errors that poison a process, after which every later test of that process fails the
# same way (the first of them may be the kernel's own fault: its log says which came first).
NO_VERDICT = (("OutOfMemoryError", "oom"), ("CUDA error: an illegal memory access", "cuda error"))


def outcome_of(row: dict) -> str:
    """A report line's outcome for the table: a strict xfail that passed is a failure; a failure whose reason is
    one of NO_VERDICT is that ("oom", "cuda error")."""
    outcome = {"xpass": "failed"}.get(row["outcome"], row["outcome"])
    if outcome == "failed":
        for marker, label in NO_VERDICT:
            if marker in (row.get("reason") or ""):
                return label
    return outcome


def tabulate(results: dict[str, list[dict]]) -> dict:
    """{class: {provider: {passed, failed, xfail, skipped, oom, cuda error, worst}}} in CLASSES order, OTHER last."""
    table: dict = {label: {} for label, _ in CLASSES}
    table[OTHER] = {}
    for provider, rows in results.items():
        for row in rows:
            cell = table[boundary_class(row["nodeid"])].setdefault(
                provider, dict(passed=0, failed=0, xfail=0, skipped=0, worst=None, failures=[]))
            outcome = outcome_of(row)
            cell[outcome] = cell.get(outcome, 0) + 1
            if outcome == "failed":
                cell["failures"].append(row["nodeid"])
            if row.get("worst") is not None and outcome in ("passed", "failed", "xfail"):
                cell["worst"] = max(cell["worst"] or 0.0, row["worst"])
    return table


def cell_text(cell: dict | None) -> str:
    if not cell:
        return "—"
    ran = cell["passed"] + cell["failed"] + cell["xfail"]
    broken = [f"{label} {cell[label]}" for _, label in NO_VERDICT if cell.get(label)]
    if ran == 0:
        return ", ".join(broken + ([f"skip {cell['skipped']}"] if cell["skipped"] or not broken else []))
    parts = []
    if cell["failed"]:
        parts.append(f"**FAIL {cell['failed']}**")
    if cell["xfail"]:
        parts.append(f"**finding {cell['xfail']}**")
    if cell["passed"]:
        parts.append(f"pass {cell['passed']}")
    parts += broken
    if cell["skipped"]:
        parts.append(f"skip {cell['skipped']}")
    worst = cell["worst"]
    if worst is not None:
        parts.append(f"{worst:.3g}×" if worst < 1e4 else f"{worst:.1e}×")
    return ", ".join(parts)


def versions() -> dict:
    import torch
    import triton
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU ({platform.machine()}, {os.cpu_count()} cores), Triton interpreter"
    return dict(date=datetime.date.today().isoformat(), device=device, torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version())


def markdown(table: dict, providers: list[str], meta: dict) -> str:
    lines = [f"Run {meta['date']} on {meta['device']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"python {meta['python']}. Peers: vLLM 0.33.0 (`vllm`), 0.10.2, 0.7.3, mamba_ssm 2.3.2.post1, "
             f"fla-core 0.6.0, unmodified (bench/fetch_peers.py)."
             + (f" Stopped by --timeout before every test ran: {', '.join(meta['incomplete'])}."
                if meta.get("incomplete") else "")
             + (f" Crashed before any test ran (no report; OUT/<provider>.log): {', '.join(meta['crashed'])}."
                if meta.get("crashed") else ""), "",
             "| boundary class | " + " | ".join(f"`{p}`" for p in providers) + " |",
             "| --- |" + " --- |" * len(providers)]
    for label, cells in table.items():
        if not any(cells.get(p) for p in providers):
            continue
        lines.append(f"| {label} | " + " | ".join(cell_text(cells.get(p)) for p in providers) + " |")
    return "\n".join(lines) + "\n"


def write_doc(path: Path, body: str, marker: str) -> None:
    """Replace the block between `<!-- {marker} -->` and `<!-- /{marker} -->` in `path` with `body`."""
    text = path.read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path}: no {start} ... {end} block to fill")
    head, rest = text.split(start, 1)
    path.write_text(head + start + "\n" + body + end + rest.split(end, 1)[1])


def main(argv=None) -> int:
    a = parse_args(argv)
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    results, status, incomplete, ran, crashed = {}, 0, [], [], []
    saved = out / "meta.json"
    todo = []
    for name in a.providers:
        report = out / f"{name}.jsonl"
        if a.reuse and report.exists():
            results[name] = [json.loads(line) for line in report.read_text().splitlines()]
        else:
            todo.append(name)
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.parallel) as pool:
        runs = dict(zip(todo, pool.map(lambda name: run_provider(name, out, a), todo)))
    for name in todo:
        rows, _, rc = runs[name]
        if not rows:                        # it crashed before any test ran: a column of dashes, said in the header
            crashed.append(name)
            status = 1
        results[name] = rows
        ran.append(name)
        if rc == 124:
            incomplete.append(name)
        if rc not in (0, 5):
            status = 1
    table = tabulate(results)
    meta = json.loads(saved.read_text()) if a.reuse and saved.exists() else versions()
    # a provider reused from an earlier run keeps what that run said of it; one run now, what this run says
    incomplete += [p for p in meta.get("incomplete", []) if p in results and p not in ran]
    crashed += [p for p in meta.get("crashed", []) if p in results and p not in ran]
    meta = meta | dict(incomplete=incomplete, crashed=crashed)
    saved.write_text(json.dumps(meta))
    meta = meta | dict(gpu_tests=a.gpu, providers=a.providers)
    (out / "table.json").write_text(json.dumps(dict(meta=meta, table=table), indent=1))
    body = markdown(table, a.providers, meta)
    (out / "table.md").write_text(body)
    print(body)
    if a.doc:
        write_doc(ROOT / a.doc, body, "gpu-table" if a.gpu else "cpu-table")
        print(f"wrote {a.doc}")
    failed = {p: [n for c in table.values() for n in c.get(p, {}).get("failures", [])] for p in a.providers}
    for provider, nodes in failed.items():
        for node in nodes:
            print(f"FAILED (not a pinned finding) {provider}: {node}")
    return status


if __name__ == "__main__":
    sys.exit(main())
