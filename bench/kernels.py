"""Kernel benchmark: our Triton ops (vendored/ops) against the public Mamba2 Triton kernels of vLLM 0.33.0 and
mamba_ssm 2.3.2.post1, and for the scan fla-core 0.6.0's chunk_simple_gla (the SSD recurrence as scalar-gated linear
attention: B and C expanded to every head, v = x·Δ, log decay Δ·A, D·x added after, all timed with it), on identical
inputs in one process on one GPU, at Bamba-9B shapes
(H=128, P=64, N=128, G=1, Q=256, W=4; x/B/C/z/y and conv weights bf16, dt/A/D/dt_bias fp32).

    make bench-kernels                                            # GPU: python3 -m bench.kernels --peers .peers
    python -m bench.kernels --smoke --out /tmp/bench-smoke        # CPU, Triton interpreter, tiny shapes, fp32

Cases: ssd_scan at 2K, 8K, 32K, 128K tokens as 1 and 8 sequences; causal_conv1d prefill; decode
(causal_conv1d_update and selective_state_update) at batch 1, 8, 64, 256 with an fp32 and a bf16 state pool;
rms_norm_gated; and a device-to-device copy of the batch-256 state pool, the bandwidth selective_state_update is
measured against. Peers come from a `--peers DIR` folder filled by bench/fetch_peers.py (`make fetch-peers`:
peer_loader.py beside vendor/; docs/kernels.md); without it, only our ops run.

Timing: prefill-sized calls with triton.testing.do_bench (median; L2 flushed before every call; first call, with
its compile and autotune, excluded); decode calls with a CUDA graph of --graph-calls back-to-back calls, replayed
--graph-replays times (median per call; no L2 flush, so a batch-1 pool that fits in L2 is read from L2 by all
alike). Both in rounds (--bench-rounds, --graph-rounds) that time every implementation once each, in a new shuffled
order every round: a decode call lasts microseconds and a 2K prefill follows the host's launch, and clock, cache or
host drift over one implementation's timing would otherwise favour whichever ran at the better moment. An
implementation's time is the median over rounds; the notes give the range of the per-round ratio. Cases run most
important first and stop starting new ones after --budget seconds; a failing call is reported in its row and the
run goes on. After every case the JSON and the markdown table in --out are rewritten.

Columns: ms; TB/s and TFLOP/s from the bytes a call must move and the FLOPs it must do (counted in
bench/kernel_cases.py, identical for all implementations); ratio = the faster peer's ms / ours (> 1: ours is faster);
max |Δ| of y and of the written states between ours and each peer after one call from the same state. The notes of a
do_bench case also give each implementation's device time (CUDA profiler, 10 back-to-back calls, no flush) and its
ratio: a call of tens of microseconds (2K tokens) can be bound by the host's time to issue it, which do_bench then
times with its jitter, while the device time is what the kernels cost.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.kernel_cases import (BAMBA_9B, SMOKE, Case, Setup, conv_case, conv_update_case, copy_case, rms_case,
                                scan_case, ssu_case)

PEER_NAMES = ("vllm", "mamba_ssm", "fla")
OP_ORDER = ("ssd_scan", "causal_conv1d", "selective_state_update", "causal_conv1d_update", "rms_norm_gated",
            "d2d_copy")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/bench-kernels", help="folder for kernels.json, kernels.md, kernels.png")
    p.add_argument("--peers", default=None, help="folder holding peer_loader.py and vendor/ (make fetch-peers)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1, fp32")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which no new case starts")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warmup")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench measuring time")
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--graph-replays", type=int, default=15, help="timed replays of that graph")
    p.add_argument("--graph-rounds", type=int, default=7,
                   help="rounds of graph timing, all implementations once a round, shuffled (median over rounds)")
    p.add_argument("--bench-rounds", type=int, default=3, help="the same for the do_bench-timed (prefill) cases")
    p.add_argument("--only", default="", help="comma-separated ops to run (default: all)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_peers(folder: str | None, log, failures: dict | None = None) -> dict:
    """{name: namespace of the peer's functions} for each peer that loads; a failure is logged, not raised, and
    recorded in `failures` (name -> reason) when given, for the report to name."""
    if not folder:
        return {}
    folder = Path(folder).resolve()
    if not (folder / "peer_loader.py").is_file():
        log(f"# no peer_loader.py in {folder}: our ops only (fetch the peers with `make fetch-peers`)")
        return {}
    os.environ.setdefault("PEERS_VENDOR", str(folder / "vendor"))
    sys.path.insert(0, str(folder))
    import peer_loader
    peers = {}
    for name, load in (("vllm", peer_loader.load_vllm), ("mamba_ssm", peer_loader.load_mamba_ssm),
                       ("fla", peer_loader.load_fla)):
        try:
            peers[name] = load()
        except Exception as e:  # the other peer and our ops still run
            log(f"# peer {name} failed to load: {type(e).__name__}: {e}")
            if failures is not None:
                failures[name] = f"{type(e).__name__}: {e}"
    if "mamba_ssm" in peers and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        # vLLM's filter for chunk-scan configs that Triton miscompiles on sm90 (NaN/Inf rows); see bench/peer_loader.py
        kernel = peers["mamba_ssm"].autotuned_kernels["_chunk_scan_fwd_kernel"]
        log(f"# mamba_ssm: dropped {peer_loader.drop_sm90_racy_configs(kernel)} sm90-racy chunk-scan configs")
    if os.environ.get("TRITON_INTERPRET") == "1":
        peer_loader.patch_torch_for_interpreter()
        peer_loader.prune_autotune_for_interpreter(
            *[m for k, m in list(sys.modules.items()) if k.startswith(("mamba_ssm.ops", "vllm.model_executor"))])
    return peers


def cases(setup: Setup, peers: dict, smoke: bool) -> list[Case]:
    """All cases, most important first (the issue's targets), so that a cut-short run still has those."""
    f32, bf16 = torch.float32, torch.bfloat16
    s = setup.shape
    if smoke:
        return [copy_case(setup, 3, f32),
                *[scan_case(setup, peers, 40, n, f32) for n in (1, 3)],
                *[ssu_case(setup, peers, b, sd) for b in (1, 3) for sd in (f32, bf16)],
                conv_case(setup, peers, 40, 3),
                *[conv_update_case(setup, peers, b, sd) for b in (1, 3) for sd in (f32, bf16)],
                rms_case(setup, peers, 5)]
    return [
        copy_case(setup, 256, f32), copy_case(setup, 256, bf16),
        ssu_case(setup, peers, 256, f32), ssu_case(setup, peers, 256, bf16),
        scan_case(setup, peers, 32768, 1, f32), scan_case(setup, peers, 2048, 1, f32),
        scan_case(setup, peers, 2048, 8, f32), scan_case(setup, peers, 32768, 8, f32),
        conv_case(setup, peers, 2048, 8), conv_case(setup, peers, 32768, 8),
        rms_case(setup, peers, 2048), rms_case(setup, peers, 32768),
        *[ssu_case(setup, peers, b, sd) for b in (1, 8, 64) for sd in (f32, bf16)],
        *[conv_update_case(setup, peers, b, sd) for b in (1, 8, 64, 256) for sd in (bf16, f32)],
        scan_case(setup, peers, 8192, 1, f32), scan_case(setup, peers, 8192, 8, f32),
        scan_case(setup, peers, 131072, 1, f32), scan_case(setup, peers, 131072, 8, f32),
        conv_case(setup, peers, 2048, 1), conv_case(setup, peers, 32768, 1),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------

def time_call(run, how: str, a: argparse.Namespace, on_gpu: bool) -> float:
    """Milliseconds per call (see the module docstring). The call has already run once (compiled, autotuned)."""
    if not on_gpu:                                   # interpreter: one timed call, meaningless except as a smoke test
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    return bench_once(run, a) if how == "bench" else time_graph(run, a)


def time_graph(run, a: argparse.Namespace) -> float:
    """Median milliseconds per call over a.graph_replays replays of one CUDA graph holding a.graph_calls calls."""
    side = torch.cuda.Stream()                       # warm up off the capture stream, as torch.cuda.graphs advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(a.graph_calls):
            run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.graph_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / a.graph_calls)
    del graph
    return statistics.median(times)


def bench_once(run, a: argparse.Namespace) -> float:
    """do_bench's median milliseconds per call (L2 flushed before each call)."""
    import triton.testing
    return triton.testing.do_bench(run, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")


def time_in_rounds(runs: dict, a: argparse.Namespace, measure, n_rounds: int) -> tuple[dict, dict]:
    """({name: ms per call in each of n_rounds rounds}, {name: exception}): every round measures each run once
    (`measure(run, a)`: time_graph captures, replays and frees its graph, one alive at a time), in a new shuffled
    order (seeded by --seed). A run whose measurement raises (e.g. a call that cannot be captured) leaves the
    rounds, its exception returned."""
    rng = random.Random(a.seed)
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    failed: dict[str, Exception] = {}
    for _ in range(max(1, n_rounds)):
        order = [name for name in runs if name not in failed]
        rng.shuffle(order)
        for name in order:
            try:
                rounds[name].append(measure(runs[name], a))
            except Exception as e:
                traceback.print_exc()
                failed[name] = e
    return {name: times for name, times in rounds.items() if name not in failed}, failed


def device_ms(run, calls: int = 10) -> tuple[float, float]:
    """(device ms per call, device events per call): the summed time of the kernels and copies `calls` back-to-back
    calls run, from the CUDA profiler; what a call costs the GPU, whatever the host's time to issue it."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / calls / 1e3, len(events) / calls


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def nonfinite(ts) -> int:
    return sum(int((~torch.isfinite(t.float())).sum()) for t in ts)


def run_case(case: Case, a: argparse.Namespace, on_gpu: bool, log) -> dict:
    """Every implementation of one case: one call from the fresh state (kept for the cross-check), then timed."""
    row = dict(op=case.op, case=case.name, params=case.params, timing=case.timing, bytes=case.counts.bytes,
               flops=case.counts.flops, impls={})
    try:
        impls = case.build()
    except Exception as e:
        traceback.print_exc()
        row["error"] = f"inputs: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    outputs, timed = {}, {}
    for name, impl in impls.items():
        entry = row["impls"].setdefault(name, {})
        try:
            run, read = impl.prepare()
            run()
            if on_gpu:
                torch.cuda.synchronize()
            outputs[name] = tuple(t.detach().clone() for t in read())
            entry["nonfinite"] = nonfinite(outputs[name])
            if name.startswith("twin"):                  # an oracle: its outputs are the yardstick, not timed
                continue
            if on_gpu:
                timed[name] = run                    # timed below, in rounds with the others
            else:
                set_time(entry, case, time_call(run, case.timing, a, on_gpu))
        except Exception as e:
            traceback.print_exc()
            entry["error"] = error_text(e)
        if on_gpu:
            torch.cuda.synchronize()
    if timed:
        graph = case.timing == "graph"
        rounds, failed = time_in_rounds(timed, a, time_graph if graph else bench_once,
                                        a.graph_rounds if graph else a.bench_rounds)
        for name, times in rounds.items():
            set_time(row["impls"][name], case, statistics.median(times))
            row["impls"][name]["ms_rounds"] = times
            if not graph:                            # do_bench of a short call can time the host: the GPU's share
                try:
                    row["impls"][name]["device_ms"], row["impls"][name]["device_events"] = device_ms(timed[name])
                except Exception as e:
                    traceback.print_exc()
                    row["impls"][name]["device_error"] = error_text(e)
        for name, e in failed.items():
            entry = row["impls"][name]
            if not graph:
                entry["error"] = error_text(e)
                continue
            entry["timing"] = f"do_bench (CUDA graph failed: {type(e).__name__})"   # e.g. not capturable: uncaptured
            try:
                set_time(entry, case, bench_once(timed[name], a))
            except Exception as e2:
                traceback.print_exc()
                entry["error"] = error_text(e2)
    # ours: the op's default; ours_<mode>: another mode of it (the scan's products="rounded"), a row of its own
    for ours in [name for name in outputs if name.startswith("ours")]:
        suffix = ours.removeprefix("ours")
        for peer in PEER_NAMES:
            if peer in outputs:
                try:
                    row["impls"][peer]["max_abs_diff" + suffix] = [max_abs_diff(o, p)
                                                                   for o, p in zip(outputs[ours], outputs[peer])]
                except Exception as e:
                    row["impls"][peer]["max_abs_diff_error" + suffix] = f"{type(e).__name__}: {e}"
        row["impls"][ours]["max_abs"] = [t.float().abs().max().item() if t.numel() else 0.0 for t in outputs[ours]]
    twin = next((name for name in outputs if name.startswith("twin")), None)
    if twin:                                             # every implementation's error against the fp64 oracle
        for name, out in outputs.items():
            if name != twin:
                row["impls"][name]["error_vs_fp64"] = [max_abs_diff(o, t) for o, t in zip(out, outputs[twin])]
    add_ratios(row)
    return row


def add_ratios(row: dict) -> None:
    """ratio[_<mode>] = the faster peer's ms / ours; ratio_rounds: the range of that ratio over the rounds (the faster
    peer of each round / ours that round); device_ratio: the same of the device times, where measured."""
    peer_ms = [row["impls"][p]["ms"] for p in PEER_NAMES if "ms" in row["impls"].get(p, {})]
    peer_rounds = [row["impls"][p]["ms_rounds"] for p in PEER_NAMES if "ms_rounds" in row["impls"].get(p, {})]
    peer_device = [row["impls"][p]["device_ms"] for p in PEER_NAMES if "device_ms" in row["impls"].get(p, {})]
    for ours in [name for name in row["impls"] if name.startswith("ours")]:
        if peer_ms and "ms" in row["impls"][ours]:
            row["ratio" + ours.removeprefix("ours")] = min(peer_ms) / row["impls"][ours]["ms"]
        if peer_device and "device_ms" in row["impls"][ours]:
            row["device_ratio" + ours.removeprefix("ours")] = min(peer_device) / row["impls"][ours]["device_ms"]
        own_rounds = row["impls"][ours].get("ms_rounds")
        if peer_rounds and own_rounds and len(own_rounds) > 1:   # the faster peer of each round / ours that round
            per_round = [min(p[i] for p in peer_rounds) / t for i, t in enumerate(own_rounds)]
            row["ratio_rounds" + ours.removeprefix("ours")] = [min(per_round), max(per_round)]


def error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def set_time(entry: dict, case: Case, ms: float) -> None:
    entry.update(ms=ms, tbps=case.counts.bytes / (ms * 1e-3) / 1e12, tflops=case.counts.flops / (ms * 1e-3) / 1e12)


def add_copy_fractions(rows: list[dict]) -> None:
    """selective_state_update: achieved bandwidth as a fraction of that of copying its state pool, where measured."""
    copies = {(r["params"]["batch"], r["params"]["state_dtype"]): r["impls"]["torch"]["tbps"] for r in rows
              if r["op"] == "d2d_copy" and "tbps" in r["impls"].get("torch", {})}
    for r in rows:
        if r["op"] == "selective_state_update":
            copy = copies.get((r["params"]["batch"], r["params"]["state_dtype"]))
            for entry in r["impls"].values():
                if copy and "tbps" in entry:
                    entry["of_copy"] = entry["tbps"] / copy


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------

def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    peers = [p for p in PEER_NAMES if any(p in r["impls"] for r in rows)]
    head = ["op", "case", "ours ms", "TB/s", "TFLOP/s", *[f"{p} ms" for p in peers], "peer/ours",
            *[f"max abs diff vs {p} (y; state)" for p in peers], "notes"]
    lines = [f"Kernel benchmark, {meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}"
             f"{', peers: ' + ', '.join(meta['peers']) if meta['peers'] else ', no peers'}"
             + "".join(f"; {name} FAILED TO LOAD ({reason})" for name, reason in meta.get("peers_failed", {}).items())
             + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {op: i for i, op in enumerate(OP_ORDER)}
    for r in sorted(rows, key=lambda r: (order[r["op"]], r["index"])):
        lines += [table_line(r, suffix, peers) for suffix in variants(r)]
    return "\n".join(lines) + "\n"


def variants(row: dict) -> list[str]:
    """The table lines of a case: "" for ours (the op's default), "_<mode>" for each other mode of ours it ran."""
    return [""] + sorted(name.removeprefix("ours") for name in row["impls"] if name.startswith("ours_"))


def table_line(r: dict, suffix: str, peers: list[str]) -> str:
    impls = r["impls"]
    main = impls.get("ours" + suffix) or (impls.get("torch") if not suffix else None) or {}
    own = {n: e for n, e in impls.items() if not n.startswith("ours") or n == "ours" + suffix}
    notes = [f"{n}: {e['error']}" for n, e in own.items() if "error" in e]
    notes += [f"{n}: {e['nonfinite']} non-finite" for n, e in own.items() if e.get("nonfinite")]
    notes += [f"{n}: {e['timing']}" for n, e in own.items() if "timing" in e]
    if "error" in r:
        notes.append(r["error"])
    if "ratio_rounds" + suffix in r:
        low, high = r["ratio_rounds" + suffix]
        notes.append(f"peer/ours per round {low:.2f}-{high:.2f} ({len(main['ms_rounds'])} rounds)")
    timed_device = {("ours" if n.startswith("ours") else n): e["device_ms"] for n, e in own.items()
                    if "device_ms" in e}
    if timed_device:
        ratio = r.get("device_ratio" + suffix)
        notes.append("device µs " + ", ".join(f"{label} {ms * 1e3:.1f}" for label, ms in timed_device.items())
                     + (f" (peer/ours {ratio:.2f})" if ratio else ""))
    if "of_copy" in main:
        notes.append(f"{main['of_copy']:.0%} of copy bandwidth")
    if "max_abs" in main:
        notes.append("ours max abs " + "; ".join(f"{v:.3g}" for v in main["max_abs"]))
    errors = {("ours" if n.startswith("ours") else n): e["error_vs_fp64"] for n, e in own.items()
              if "error_vs_fp64" in e}
    if errors:
        notes.append("max abs error vs the fp64 twin (y; state): " + ", ".join(
            f"{label} {'; '.join(f'{v:.2g}' for v in values)}" for label, values in errors.items()))
    key = "max_abs_diff" + suffix
    diffs = ["; ".join(f"{v:.2g}" for v in impls[p][key]) if key in impls.get(p, {}) else "-" for p in peers]
    op = r["op"] + (f" ({suffix[1:]})" if suffix else "")
    cells = [op, r["case"], _fmt(main.get("ms"), ".4f"), _fmt(main.get("tbps"), ".2f"),
             _fmt(main.get("tflops"), ".1f"), *[_fmt(impls.get(p, {}).get("ms"), ".4f") for p in peers],
             _fmt(r.get("ratio" + suffix), ".2f"), *diffs, " · ".join(notes).replace("|", "/")]
    return "| " + " | ".join(cells) + " |"


def plot(rows: list[dict], path: Path) -> str | None:
    """Bar chart of peer/ours per case; returns why it was not drawn, if it was not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no PNG"
    ranked = [dict(op=r["op"] + (f" ({suffix[1:]})" if suffix else ""), case=r["case"], ratio=r["ratio" + suffix])
              for r in rows for suffix in variants(r) if "ratio" + suffix in r]
    if not ranked:
        return "no ratios to plot"
    labels = [f"{r['op']} {r['case']}" for r in ranked]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(ranked) + 1.2))
    ax.barh(range(len(ranked)), [r["ratio"] for r in ranked],
            color=["tab:green" if r["ratio"] >= 1 else "tab:red" for r in ranked])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(ranked)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("faster peer's time / our time (> 1: ours faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(out: Path, rows: list[dict], meta: dict, final: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    add_copy_fractions(rows)
    (out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "kernels.md").write_text(markdown(rows, meta))
    if final:
        why_not = plot(rows, out / "kernels.png")
        if why_not:
            print(f"# {why_not}", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.time()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    on_gpu = torch.cuda.is_available() and not interpreted
    if not on_gpu and not (interpreted and a.smoke):
        sys.exit("bench.kernels: no CUDA device; on a CPU run `TRITON_INTERPRET=1 python -m bench.kernels --smoke`")
    log = lambda line: print(line, flush=True)  # noqa: E731
    peers_failed: dict[str, str] = {}
    if on_gpu:
        # the profiler (device_ms) imports torch._inductor on first use, which walks sys.modules and trips over the
        # peers' stub modules: import it before the peers load
        importlib.import_module("torch._inductor")
    peers = load_peers(a.peers, log, peers_failed)
    device = torch.device("cuda" if on_gpu else "cpu")
    setup = Setup(SMOKE if a.smoke else BAMBA_9B, device, torch.float32 if a.smoke else torch.bfloat16, a.seed)
    import triton
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                peers=[peers[p].name for p in PEER_NAMES if p in peers], peers_failed=peers_failed,
                shape=setup.shape.__dict__,
                dtype=str(setup.dtype).removeprefix("torch."), args=vars(a))
    only = {op for op in a.only.split(",") if op}
    todo = [c for c in cases(setup, peers, a.smoke) if not only or c.op in only]
    out, rows = Path(a.out), []
    log(f"# {len(todo)} cases on {meta['device']}; peers: {', '.join(meta['peers']) or 'none'}; out: {out}")
    with torch.inference_mode():
        for index, case in enumerate(todo):
            if time.time() - t_start > a.budget:
                rows.append(dict(op=case.op, case=case.name, params=case.params, index=index, impls={},
                                 error=f"skipped: --budget {a.budget:.0f}s spent"))
                continue
            row = dict(run_case(case, a, on_gpu, log), index=index)
            rows.append(row)
            summary = "  ".join(f"{n} {e['ms']:.4f} ms" if "ms" in e else f"{n} FAILED"
                                for n, e in row["impls"].items() if not n.startswith("twin"))
            log(f"{case.op:<24} {case.name:<26} {summary}"
                + "".join(f"  ratio{suffix} {row['ratio' + suffix]:.2f}" for suffix in variants(row)
                          if "ratio" + suffix in row)
                + f"  [{time.time() - t_start:.0f}s]")
            write_outputs(out, rows, meta, final=False)
            if on_gpu:
                torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    write_outputs(out, rows, meta, final=True)
    log(f"# done in {meta['wall_s']}s: {out / 'kernels.md'}")
    failed = [r for r in rows if any("error" in e for e in r["impls"].values())
              or r.get("error", "skipped").startswith("inputs")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
