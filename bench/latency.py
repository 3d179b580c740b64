"""Where the time of a small kernel call goes: the host's cost of issuing it against the GPU's time running it.

    python3 -m bench.latency --peers .peers --out out/latency            # GPU; the cases of bench/kernels.py

For ops whose GPU work is tens of microseconds (a 2K-token prefill piece, a decode step), a benchmark's milliseconds
can be the host's: Python argument checks, torch ops that build metadata, Triton's launcher, and any wait for the
device. Per implementation of each case this measures
  host µs    wall time per call of `--calls` calls issued back to back while the GPU is held busy, so the host's cost
             of issuing one call alone (a call that waits for the device, as a checked call does, waits here for
             the spin kernel and shows as huge);
  gpu µs     the summed device time of the kernels (and copies) one call runs, from the CUDA profiler, with their
             count;
  bench µs   triton.testing.do_bench's median, as bench/kernels.py times prefill-sized calls (L2 flushed);
and writes latency.json and latency.md to --out. A call whose host µs exceeds its gpu µs is host-bound: making its
kernels faster does not make it faster.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch
import triton
import triton.testing

from bench.kernel_cases import BAMBA_9B, Setup, conv_case, conv_update_case, rms_case, scan_case, ssu_case
from bench.kernels import device_ms, load_peers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/latency")
    p.add_argument("--peers", default=None, help="folder holding peer_loader.py and vendor/ (make fetch-peers)")
    p.add_argument("--calls", type=int, default=20, help="calls per host-time measurement")
    p.add_argument("--only", default="", help="comma-separated ops (default: all)")
    return p.parse_args(argv)


def host_us(run, calls: int) -> float:
    """Host µs per call while the GPU is held busy (a spin kernel queued first), so that neither the GPU's pace nor
    a full launch queue (calls · kernels per call stays well under its ~1000 entries) enters the measurement."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                    # ~0.1 s of GPU clock cycles: longer than the calls take to issue
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def gpu_us(run, calls: int = 20) -> tuple[float, float]:
    """(device µs per call, device events per call) from the CUDA profiler."""
    ms, events = device_ms(run, calls)
    return ms * 1e3, events


def main(argv=None) -> int:
    a = parse_args(argv)
    # the profiler imports torch._inductor on first use, which walks sys.modules and trips over the peers' stub
    # modules: import it before the peers load
    importlib.import_module("torch._inductor")
    setup = Setup(BAMBA_9B, torch.device("cuda"), torch.bfloat16, 0)
    peers = load_peers(a.peers, print)
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [conv_case(setup, peers, 2048, 8), conv_case(setup, peers, 2048, 1),
             conv_case(setup, {}, 2048, 8, check_indices=True),
             scan_case(setup, peers, 2048, 1, f32), scan_case(setup, peers, 2048, 8, f32),
             scan_case(setup, {}, 2048, 8, f32, check_indices=True),
             rms_case(setup, peers, 2048),
             *[ssu_case(setup, peers, b, sd) for b in (1, 8) for sd in (f32, bf16)],
             *[conv_update_case(setup, peers, b, sd) for b in (1, 8, 64) for sd in (bf16, f32)]]
    only = {o for o in a.only.split(",") if o}
    rows = []
    for case in cases:
        if only and case.op not in only:
            continue
        for name, impl in case.build().items():
            if name.startswith("twin"):                  # the fp64 oracle, for bench.kernels' error column only
                continue
            run, _ = impl.prepare()
            run()
            torch.cuda.synchronize()
            checked = case.params.get("check_indices", False)
            row = dict(op=case.op, case=case.name, impl=name + (" (check_indices=True)" if checked else ""))
            try:
                row["host_us"] = host_us(run, a.calls)
                row["gpu_us"], row["events"] = gpu_us(run)
                row["bench_us"] = triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median") * 1e3
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(row, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"Host and device time per call, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}.")
    (out / "latency.json").write_text(json.dumps(dict(title=title, rows=rows), indent=1))
    (out / "latency.md").write_text(markdown(rows, title))
    return 0


def markdown(rows: list[dict], title: str) -> str:
    """The table of latency.md: one row per implementation of a case; a failed measurement shows as nan, with why."""
    def cell(row: dict, key: str) -> str:
        value = row.get(key)
        return "nan" if value is None else f"{value:.1f}"
    lines = [title, "", "| op | case | impl | host µs | gpu µs | kernels | do_bench µs | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['case']} | {r['impl']} | {cell(r, 'host_us')} | {cell(r, 'gpu_us')} | "
                     f"{cell(r, 'events')} | {cell(r, 'bench_us')} | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
