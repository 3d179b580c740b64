"""Time candidate launch choices of rms_norm_gated and selective_state_update at the bench shapes (Bamba-9B).

    python -m bench.sweep_norm_ssu --peers .peers --out out/sweep-norm-ssu.json   # GPU, about 1-2 min on an H200
    python -m bench.sweep_norm_ssu --compile-only                                  # CPU: every candidate builds for sm_90
    TRITON_INTERPRET=1 python -m bench.sweep_norm_ssu --smoke --out /tmp/s.json    # CPU: the script end to end, tiny

Each op chooses its launch in one function (`_block_sizes` of vendored/ops/rms_norm_gated.py and
vendored/ops/selective_state_update.py); here that function is replaced by one returning a candidate. Cases are
bench/kernel_cases.py's: rms_norm_gated at 2048 and 32768 tokens (do_bench, median, L2 flushed), and
selective_state_update at batch 1, 8, 64, 256 with an fp32 and a bf16 state pool (CUDA-graph replay, as
bench/kernels.py times it). Stage 1 times every candidate shape; stage 2 times each case's two fastest again with
the eviction policy "evict_first" on the state (ssu) or on x and the gate (norm), and (ssu's tile kernel) with its
program order (rows inside heads or heads inside rows) and its store order (y or the state first) flipped, alone
and together. Within a stage all candidates
(and the peers, given --peers) are timed once per round, in a new shuffled order each round, and each gets the
median over rounds, so drift of clocks or of the L2 does not favour whoever runs first.

Every candidate's outputs after one call from the same inputs are compared with the default launch's: "exact"
when every element is bit-identical; "y rounding" when the states are bit-identical and y differs by at most
4 ulps of y's dtype at max |y| (a reduction over N or over the group summed in another order); anything else is
"WRONG" and never recommended. The table lists, per case, the default, the fastest candidates and the peers; the
JSON (--out) has every measurement and, per case, the recommended launch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.testing

from bench.kernel_cases import BAMBA_9B, SMOKE, Case, Setup, rms_case, ssu_case
from vendored.ops.rms_norm_gated import NormLaunch
from vendored.ops.selective_state_update import SsuLaunch

# the modules, not the functions of the same name that vendored.ops exports
norm_module = importlib.import_module("vendored.ops.rms_norm_gated")
ssu_module = importlib.import_module("vendored.ops.selective_state_update")

# each op's module and the kernels its launches may run
OPS = {"rms_norm_gated": (norm_module, (norm_module._rms_norm_gated_fwd_kernel,)),
       "selective_state_update": (ssu_module, (ssu_module._selective_state_update_tile_kernel,
                                               ssu_module._selective_state_update_fwd_kernel))}
EVICT = "evict_first"


# ---------------------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------------------

def norm_candidates(group_size: int) -> list[NormLaunch]:
    """Rows per program 1, 2, 4; the group in one piece (up to 8192) or two passes of 4096 or 2048 channels;
    4 to 32 warps; kept where a thread holds 8 to 64 values of a piece."""
    found = []
    for rows, block_d, warps in itertools.product((1, 2, 4), (8192, 4096, 2048), (4, 8, 16, 32)):
        block_d = min(block_d, triton.next_power_of_2(group_size))
        launch = NormLaunch(rows, block_d, warps)
        if 8 <= rows * block_d // (32 * warps) <= 64 and launch not in found:
            found.append(launch)
    return found


def ssu_candidates(head_dim: int, d_state: int) -> list[SsuLaunch]:
    """One head: 1 to 64 channels of it per program on 1 to 8 warps, kept where a thread holds 4 to 128 state
    values; and 2 or 4 whole heads per program (consecutive heads are consecutive memory)."""
    block_n, top_p = triton.next_power_of_2(d_state), triton.next_power_of_2(head_dim)
    found = []
    for block_p, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)):
        launch = SsuLaunch(1, 1, min(block_p, top_p), warps)
        if 4 <= launch.block_p * block_n // (32 * warps) <= 128 and launch not in found:
            found.append(launch)
    for block_h, warps in ((2, 4), (2, 8), (4, 8)):
        if block_h * top_p * block_n // (32 * warps) <= 128:
            found.append(SsuLaunch(1, block_h, top_p, warps))
    return found


def with_eviction(launch):
    return launch._replace(**{"eviction" if isinstance(launch, NormLaunch) else "state_eviction": EVICT})


def with_orders(launch) -> list:
    """The tile kernel's launch with its program order and its store order each flipped, and both (none for the
    norm or for the batched kernel)."""
    if isinstance(launch, NormLaunch) or launch.block_b != 1 or launch.block_h != 1:
        return []
    flip_rows = launch._replace(rows_inner=not launch.rows_inner)
    return [flip_rows, launch._replace(y_first=not launch.y_first), flip_rows._replace(y_first=not launch.y_first)]


def describe(launch) -> str:
    if isinstance(launch, NormLaunch):
        text = f"rows={launch.block_rows} block_d={launch.block_d} warps={launch.num_warps}"
        return text + (f" {launch.eviction}" if launch.eviction else "")
    text = f"heads={launch.block_h} block_p={launch.block_p} warps={launch.num_warps}"
    for flag, on in (("rows-inner", launch.rows_inner), ("y-first", launch.y_first), (launch.state_eviction, True)):
        text += f" {flag}" if flag and on else ""
    return text


@contextlib.contextmanager
def launching(op: str, launch):
    """The op launches with `launch` (None: its own choice) while active."""
    module = OPS[op][0]
    chosen = module._block_sizes
    if launch is not None:
        module._block_sizes = lambda *args: launch
    try:
        yield
    finally:
        module._block_sizes = chosen


def default_launch(case: Case, s, device: torch.device):
    if case.op == "rms_norm_gated":
        return norm_module._block_sizes(case.params["group_size"], device)
    state_dtype = getattr(torch, case.params["state_dtype"])
    return ssu_module._block_sizes(case.params["batch"], s.H, s.P, s.N, state_dtype, device)


# ---------------------------------------------------------------------------------------------------------------
# Timing and checking
# ---------------------------------------------------------------------------------------------------------------

def timer(case: Case, a: argparse.Namespace, on_gpu: bool):
    if not on_gpu:
        def once(run):
            t0 = time.perf_counter()
            run()
            return (time.perf_counter() - t0) * 1e3
        return once
    if case.timing == "bench":
        return lambda run: triton.testing.do_bench(run, warmup=a.warmup_ms, rep=a.rep_ms, return_mode="median")
    from bench.kernels import time_graph
    return lambda run: time_graph(run, a)


def compare(reference: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> tuple[str, float]:
    """("exact" | "y rounding" | "WRONG", max |Δy|). Outputs are (y, written states...)."""
    if all(torch.equal(r, g) for r, g in zip(reference, got)):
        return "exact", 0.0
    y_ref, y = reference[0].float(), got[0].float()
    diff = (y_ref - y).abs().max().item() if y.numel() else 0.0
    states_equal = all(torch.equal(r, g) for r, g in zip(reference[1:], got[1:]))
    bound = 4 * torch.finfo(reference[0].dtype).eps * y_ref.abs().max().item()
    return ("y rounding" if states_equal and diff <= bound and torch.isfinite(y).all() else "WRONG"), diff


def precompile(op: str, impls: dict, launches: list, on_gpu: bool, workers: int) -> None:
    """Build every candidate's kernel in parallel threads before anything is timed (calls that only compile)."""
    if not on_gpu:
        return
    from triton.runtime._async_compile import AsyncCompileMode
    kernels = OPS[op][1]
    for kernel in kernels:
        kernel.run = (lambda *args, grid, warmup, _run=type(kernel).run.__get__(kernel), **kwargs:
                      _run(*args, grid=grid, warmup=True, **kwargs))
    try:
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
            for launch in launches:
                with launching(op, launch):
                    impls["ours"].prepare()[0]()
    finally:
        for kernel in kernels:
            del kernel.run


def sweep_stage(case: Case, impls: dict, launches: list, reference, a, on_gpu: bool, deadline: float,
                with_peers: bool) -> dict:
    """Time `launches` (and the peers) in shuffled rounds: {launch or peer name: {times, status, max |Δy|}}."""
    time_one = timer(case, a, on_gpu)
    rng = random.Random(a.seed)
    results: dict = {}
    peers = [name for name in impls if name != "ours" and with_peers]
    for launch in launches:
        if launch not in results:
            with launching(case.op, launch):
                run, read = impls["ours"].prepare()
                run()
                if on_gpu:
                    torch.cuda.synchronize()
                status, diff = compare(reference, tuple(t.clone() for t in read()))
            results[launch] = dict(launch=launch, status=status, max_abs_diff_y=diff, times=[])
    entries = [("ours", launch) for launch in launches] + [(peer, None) for peer in peers]
    for round_index in range(a.rounds):
        if round_index and time.time() > deadline:
            break
        rng.shuffle(entries)
        for name, launch in entries:
            with launching(case.op, launch):
                run, _ = impls[name].prepare()
                ms = time_one(run)
            key = launch if name == "ours" else name
            results.setdefault(key, dict(times=[]))["times"].append(ms)
            if on_gpu:
                torch.cuda.empty_cache()
    return results


def run_case(case: Case, a, on_gpu: bool, deadline: float, log) -> dict:
    device = torch.device("cuda" if on_gpu else "cpu")
    s = BAMBA_9B if not a.smoke else SMOKE
    impls = case.build()
    default = default_launch(case, s, device)
    with launching(case.op, default):
        run, read = impls["ours"].prepare()
        run()
        reference = tuple(t.clone() for t in read())
    if case.op == "rms_norm_gated":
        shapes = norm_candidates(case.params["group_size"])
    else:
        shapes = ssu_candidates(s.P, s.N)
    if a.smoke:
        shapes = shapes[:: max(1, len(shapes) // 3)]
    stage1 = list(dict.fromkeys([default, *shapes]))
    precompile(case.op, impls, stage1, on_gpu, a.workers)
    first = sweep_stage(case, impls, stage1, reference, a, on_gpu, deadline, with_peers=False)
    ranked = sorted((e for e in first.values() if e["status"] != "WRONG"), key=lambda e: statistics.median(e["times"]))
    finalists = [e["launch"] for e in ranked[:2]]
    stage2 = list(dict.fromkeys([*finalists, *[with_eviction(f) for f in finalists],
                                 *[o for f in finalists for o in with_orders(f)], default]))
    precompile(case.op, impls, stage2, on_gpu, a.workers)
    second = sweep_stage(case, impls, stage2, reference, a, on_gpu, deadline, with_peers=True)
    candidates = []
    for stage, results in ((1, first), (2, second)):
        for key, entry in results.items():
            if isinstance(key, str):
                continue
            candidates.append(dict(stage=stage, launch=key._asdict(), describe=describe(key), default=key == default,
                                   status=entry["status"], max_abs_diff_y=entry["max_abs_diff_y"],
                                   times=entry["times"], ms=statistics.median(entry["times"])))
    peers = {k: statistics.median(v["times"]) for k, v in second.items() if isinstance(k, str) and v["times"]}
    stage2_ok = [c for c in candidates if c["stage"] == 2 and c["status"] != "WRONG"]
    best = min(stage2_ok, key=lambda c: c["ms"]) if stage2_ok else None
    default_ms = next((c["ms"] for c in candidates if c["stage"] == 2 and c["default"]), None)
    row = dict(op=case.op, case=case.name, params=case.params, bytes=case.counts.bytes, default=default._asdict(),
               default_ms=default_ms, best=best, peers_ms=peers, candidates=candidates)
    if best and peers:
        row["best_ratio_to_faster_peer"] = min(peers.values()) / best["ms"]
    log(table(row))
    return row


def table(row: dict) -> str:
    lines = [f"\n{row['op']} {row['case']}  ({row['bytes'] / 1e6:.1f} MB moved)",
             f"  {'launch':<44} {'stage':>5} {'ms':>9} {'TB/s':>6}  check"]
    shown = sorted(row["candidates"], key=lambda c: (c["stage"] != 2, c["ms"]))
    keep = [c for c in shown if c["stage"] == 2] + [c for c in shown if c["stage"] == 1][:6]
    keep += [c for c in shown if c["default"] and c not in keep]
    for c in keep:
        mark = " (default)" if c["default"] else ""
        lines.append(f"  {c['describe'] + mark:<44} {c['stage']:>5} {c['ms']:>9.4f} "
                     f"{row['bytes'] / (c['ms'] * 1e-3) / 1e12:>6.2f}  {c['status']}"
                     + (f" max|Δy| {c['max_abs_diff_y']:.2g}" if c["status"] != "exact" else ""))
    for name, ms in row["peers_ms"].items():
        lines.append(f"  {'peer ' + name:<44} {2:>5} {ms:>9.4f} {row['bytes'] / (ms * 1e-3) / 1e12:>6.2f}")
    if row.get("best"):
        ratio = row.get("best_ratio_to_faster_peer")
        lines.append(f"  best: {row['best']['describe']}" + (f", faster peer / best = {ratio:.3f}" if ratio else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Compile-only (CPU)
# ---------------------------------------------------------------------------------------------------------------

def compile_only(workers: int) -> int:
    """Build every candidate (and its eviction variant) for sm_90 from the CPU, as vendored.ops._compile_check does
    for the defaults: the ops are called on CPU tensors of Bamba-9B's widths with each launch; launches are caught."""
    from vendored.ops._compile_check import Launch, compile_for_gpu
    s = BAMBA_9B
    caught: list[Launch] = []

    def call_norm():
        x = torch.randn(4, s.H * s.P).bfloat16()
        norm_module.rms_norm_gated(x, x.clone(), torch.ones(s.H * s.P).bfloat16(), eps=1e-5, group_size=s.H * s.P)

    def call_ssu(state_dtype):
        rows = 4
        xs = torch.randn(rows, s.H, s.P).bfloat16()
        bc = torch.randn(rows, s.G, s.N).bfloat16()
        ssu_module.selective_state_update(
            torch.zeros(rows + 1, s.H, s.P, s.N, dtype=state_dtype), xs, torch.randn(rows, s.H), -torch.rand(s.H),
            bc, bc.clone(), D=torch.rand(s.H), dt_bias=torch.rand(s.H), z=None,
            state_indices=torch.arange(1, rows + 1, dtype=torch.int32))

    plan = [("rms_norm_gated", launch, call_norm) for launch in norm_candidates(s.H * s.P)]
    plan += [("selective_state_update", launch, lambda dt=dt: call_ssu(dt)) for launch in ssu_candidates(s.P, s.N)
             for dt in (torch.float32, torch.bfloat16)]
    plan += [(op, variant, call) for op, launch, call in plan for variant in (with_eviction(launch),
                                                                             *with_orders(launch))]
    for op, launch, call in plan:
        for kernel in OPS[op][1]:
            kernel.run = lambda *args, grid, warmup, _k=kernel, _d=describe(launch), **kw: caught.append(
                Launch(_k, args, kw, f"{op}: {_d}"))
        try:
            with launching(op, launch):
                call()
        finally:
            for kernel in OPS[op][1]:
                del kernel.run
    builds = {}
    for launch in caught:
        key, build = compile_for_gpu(launch)
        builds.setdefault(key, (launch.case, build))

    def attempt(item):
        case, build = item
        try:
            compiled = build()
            return f"OK   {case}  {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared", True
        except Exception as e:  # report every failure
            return f"FAIL {case}: {type(e).__name__}: {str(e)[:500]}", False

    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(attempt, builds.values()))
    for line, _ in outcomes:
        print(line, flush=True)
    failed = sum(not ok for _, ok in outcomes)
    print(f"{len(outcomes) - failed} of {len(outcomes)} candidate specialisations compiled for sm_90")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sweep_norm_ssu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/sweep-norm-ssu.json", help="JSON with every measurement")
    p.add_argument("--peers", default=None, help="folder holding peer_loader.py and vendor/ (timed alongside)")
    p.add_argument("--only", default="", help="rms_norm_gated and/or selective_state_update (comma-separated)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--compile-only", action="store_true", help="CPU: build every candidate for sm_90, time nothing")
    p.add_argument("--rounds", type=int, default=3, help="rounds per stage (median over them)")
    p.add_argument("--budget", type=float, default=100.0, help="seconds after which no new round starts")
    p.add_argument("--warmup-ms", type=float, default=5.0, help="do_bench warmup")
    p.add_argument("--rep-ms", type=float, default=20.0, help="do_bench measuring time")
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--graph-replays", type=int, default=10, help="timed replays of that graph")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def cases(setup: Setup, peers: dict, smoke: bool, only: set[str]) -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    if smoke:
        found = [rms_case(setup, peers, 5), ssu_case(setup, peers, 3, f32), ssu_case(setup, peers, 3, bf16)]
    else:
        found = [rms_case(setup, peers, 2048), rms_case(setup, peers, 32768),
                 *[ssu_case(setup, peers, b, sd) for b in (256, 64, 8, 1) for sd in (f32, bf16)]]
    return [c for c in found if not only or c.op in only]


def main(argv=None) -> int:
    a = parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if a.compile_only:
        if interpreted:
            sys.exit("bench.sweep_norm_ssu --compile-only: unset TRITON_INTERPRET (the interpreter never compiles)")
        return compile_only(a.workers)
    on_gpu = torch.cuda.is_available() and not interpreted
    if not on_gpu and not (interpreted and a.smoke):
        sys.exit("bench.sweep_norm_ssu: no CUDA device; on a CPU: --compile-only, or TRITON_INTERPRET=1 ... --smoke")
    t_start = time.time()
    log = lambda line: print(line, flush=True)  # noqa: E731
    from bench.kernels import load_peers
    peers = load_peers(a.peers, log)
    setup = Setup(SMOKE if a.smoke else BAMBA_9B, torch.device("cuda" if on_gpu else "cpu"),
                  torch.float32 if a.smoke else torch.bfloat16, a.seed)
    todo = cases(setup, peers, a.smoke, {op for op in a.only.split(",") if op})
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, peers=sorted(peers), args=vars(a))
    rows = []
    # every case gets its share of the budget; a case past its share finishes its current round only
    for index, case in enumerate(todo):
        share = (a.budget - (time.time() - t_start)) / (len(todo) - index)
        with torch.inference_mode():
            rows.append(run_case(case, a, on_gpu, time.time() + share, log))
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta["wall_s"] = round(time.time() - t_start, 1)
        out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        if on_gpu:
            torch.cuda.empty_cache()
    log(f"\n# done in {meta['wall_s']}s: {a.out}")
    log("# recommended launches (fastest candidate that is exact or differs in y by reduction order only):")
    for row in rows:
        if row["best"]:
            log(f"  {row['op']:<24} {row['case']:<26} {row['best']['describe']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
