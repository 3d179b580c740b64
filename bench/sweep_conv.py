"""Sweep of the launch parameters of our causal_conv1d and causal_conv1d_update at the benchmark's Bamba-9B cases.

    python -m bench.sweep_conv --out out/sweep-conv --peers .peers          # CUDA machine; < 2 min on an H200
    TRITON_INTERPRET=1 python -m bench.sweep_conv --smoke --out /tmp/sweep  # CPU: the machinery on tiny shapes

Each candidate replaces `_prefill_launch` or `_update_launch` of vendored/ops/causal_conv1d.py (the one
function that chooses that op's tiles, warps and programmatic dependent launch) while its case runs. Its outputs
after one call from the fresh state must equal those of the default choice bit for bit (y and the written slots): a
candidate that differs is marked and not ranked. Timing as bench/kernels.py does it: triton.testing.do_bench
(median, L2 flushed) for prefill, replays of a CUDA graph of back-to-back calls for decode; the prefill called as
the benchmark calls it, check_indices=False (bench/latency.py measures what the check costs). Also timed, for scale:
vLLM on the same inputs with --peers.

Output: per case, every candidate's ms, TB/s and its time over the default's; per op, candidates ranked by the
geometric mean of that ratio over the op's cases; sweep.json and sweep.md in --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.kernel_cases import BAMBA_9B, SMOKE, Case, Setup, conv_case, conv_update_case
from bench.kernels import load_peers, time_call
from vendored.ops.causal_conv1d import PrefillLaunch, UpdateLaunch

# the module in which the ops look up their launch choosers at every call (vendored/ops/causal_conv1d_kernels.py holds the
# kernels)
conv_module = importlib.import_module("vendored.ops.causal_conv1d")

# 2-D tiles (block_t, block_c, num_warps): 16 to 64 tokens, 128 to 512 channels, 2 to 8 warps (16 to 64 elements a
# thread), programs along the channels; two along the tokens. Row kernel (block_t, block_c, num_warps,
# rows_per_step): 13 to 125 tokens a program (block_t + 3 a multiple of the step where it can be), 2 to 8 channels
# a thread, 2 to 8 rows in flight. Then the default without PDL, and smaller programs (5 to 29 tokens, 128 to 512
# channels) for the 2K-token case.
def _prefill(block_t, block_c, num_warps, channels_fastest=True, rows_per_step=0, state_block_c=256, pdl=True):
    return PrefillLaunch(block_t=block_t, block_c=block_c, num_warps=num_warps, channels_fastest=channels_fastest,
                         rows_per_step=rows_per_step, state_block_b=1, state_block_c=state_block_c, pdl=pdl)


PREFILL_CANDIDATES = [
    *[_prefill(t, c, w) for t, c, w in ((16, 256, 2), (16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8),
                                        (32, 128, 2), (16, 512, 4))],
    *[_prefill(t, c, w, channels_fastest=False) for t, c, w in ((16, 256, 4), (32, 256, 8))],
    *[_prefill(t, c, w, rows_per_step=r) for t, c, w, r in ((29, 256, 1, 8), (61, 256, 1, 8), (125, 256, 1, 8),
                                                            (13, 256, 1, 4), (29, 256, 1, 4), (29, 256, 2, 4),
                                                            (29, 128, 1, 2), (61, 512, 2, 8), (61, 256, 4, 8))],
    _prefill(29, 256, 1, channels_fastest=False, rows_per_step=8),
    _prefill(29, 256, 1, rows_per_step=8, pdl=False),
    # more programs for a 2K-token call (the row kernel in one launch is device-bound there): fewer tokens or fewer
    # channels a program
    *[_prefill(t, c, w, rows_per_step=r) for t, c, w, r in ((5, 256, 1, 8), (13, 256, 1, 8), (13, 128, 1, 8),
                                                            (29, 128, 1, 8), (21, 256, 1, 8), (13, 256, 2, 8),
                                                            (29, 512, 2, 8), (13, 512, 2, 8))],
]
# (block_b, block_c, num_warps): 1 to 8 rows, 128 to 1024 channels, 1 to 4 warps (4 to 32 elements a thread, 1 to
# 4 rows a thread); then two of the default tiles without PDL.
UPDATE_CANDIDATES = [
    *[UpdateLaunch(block_b=b, block_c=c, num_warps=w, pdl=True)
      for b, c, w in ((1, 128, 1), (1, 256, 1), (1, 256, 2), (1, 512, 2), (1, 1024, 4), (2, 256, 1), (2, 256, 2),
                      (4, 256, 1), (4, 256, 4), (8, 256, 2))],
    *[UpdateLaunch(block_b=b, block_c=256, num_warps=1, pdl=False) for b in (1, 4)],
]
CHOOSER = {"causal_conv1d": "_prefill_launch", "causal_conv1d_update": "_update_launch"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sweep_conv", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/sweep-conv", help="folder for sweep.json and sweep.md")
    p.add_argument("--peers", default=None, help="folder holding peer_loader.py and vendor/: vLLM timed for scale")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1, fp32")
    p.add_argument("--budget", type=float, default=100.0, help="seconds after which no new candidate starts")
    p.add_argument("--warmup-ms", type=float, default=5.0, help="do_bench warmup")
    p.add_argument("--rep-ms", type=float, default=20.0, help="do_bench measuring time")
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--graph-replays", type=int, default=10, help="timed replays of that graph")
    p.add_argument("--only", default="", help="comma-separated ops to sweep (default: both)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sweep_cases(setup: Setup, peers: dict, smoke: bool) -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    if smoke:
        return [conv_case(setup, peers, 40, 3), conv_update_case(setup, peers, 3, f32)]
    return [*[conv_case(setup, peers, t, n) for t, n in ((2048, 8), (32768, 8), (2048, 1), (32768, 1))],
            *[conv_update_case(setup, peers, b, sd) for b in (1, 8, 64, 256) for sd in (bf16, f32)]]


def run_candidate(case: Case, impl, label: str, a: argparse.Namespace, on_gpu: bool, reference) -> dict:
    """One call from the fresh state (compared with `reference`, the default's outputs, when given), then timed."""
    run, read = impl.prepare()
    run()
    if on_gpu:
        torch.cuda.synchronize()
    outputs = tuple(t.detach().clone() for t in read())
    row = dict(candidate=label)
    if reference is not None:
        row["equal"] = len(outputs) == len(reference) and all(torch.equal(o, r) for o, r in zip(outputs, reference))
    ms = time_call(run, case.timing, a, on_gpu)
    row.update(ms=ms, tbps=case.counts.bytes / (ms * 1e-3) / 1e12)
    return row, outputs


def sweep_case(case: Case, a: argparse.Namespace, on_gpu: bool, deadline: float, log) -> dict:
    """Default first, then every candidate (patched into the module), then the extras; returns the case's record."""
    impls = case.build()
    chooser = CHOOSER[case.op]
    original = getattr(conv_module, chooser)
    candidates = PREFILL_CANDIDATES if case.op == "causal_conv1d" else UPDATE_CANDIDATES
    if not on_gpu:                                                   # the interpreter has no PDL
        candidates = [c._replace(pdl=False) for c in candidates[:2]]
    record = dict(op=case.op, case=case.name, params=case.params, bytes=case.counts.bytes, rows=[])
    n_channels = (BAMBA_9B if on_gpu else SMOKE).conv_channels
    device = torch.device("cuda" if on_gpu else "cpu")
    first = case.params["tokens"] if case.op == "causal_conv1d" else case.params["batch"]
    default = original(first, n_channels, device)
    record["default"] = default._asdict()
    row, reference = run_candidate(case, impls["ours"], "default", a, on_gpu, None)
    record["rows"].append(dict(row, config=default._asdict(), is_default=True))
    for candidate in candidates:
        if time.time() > deadline:
            record["rows"].append(dict(candidate=str(tuple(candidate)), config=candidate._asdict(),
                                       error=f"skipped: --budget {a.budget:.0f}s spent"))
            continue
        setattr(conv_module, chooser, lambda *args, _c=candidate: _c)
        try:
            row, _ = run_candidate(case, impls["ours"], str(tuple(candidate)), a, on_gpu, reference)
        except Exception as e:                                       # a config that fails to compile or launch
            row = dict(candidate=str(tuple(candidate)), error=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            setattr(conv_module, chooser, original)
        record["rows"].append(dict(row, config=candidate._asdict(), is_default=candidate == default))
    if "vllm" in impls:
        try:
            row, _ = run_candidate(case, impls["vllm"], "vllm", a, on_gpu, None)
            record["vllm_ms"] = row["ms"]
        except Exception as e:
            record["vllm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    base = record["rows"][0]["ms"]
    for row in record["rows"]:
        if "ms" in row:
            row["vs_default"] = row["ms"] / base
    best = min((r for r in record["rows"] if "ms" in r and r.get("equal", True)),
               key=lambda r: r["ms"])
    log(f"{case.op:<22} {case.name:<22} default {base:.4f} ms, best {best['ms']:.4f} ms {best['candidate']}"
        + (f", vllm {record['vllm_ms']:.4f} ms" if "vllm_ms" in record else ""))
    return record


def ranking(records: list[dict], op: str) -> list[tuple[str, float, int]]:
    """(candidate, geometric mean of ms / default ms over the op's cases, cases timed), best first; candidates
    whose outputs differed anywhere are left out, and so are candidates not timed in every case."""
    ratios: dict[str, list[float]] = {}
    unequal = set()
    cases = [r for r in records if r["op"] == op]
    for record in cases:
        for row in record["rows"]:
            if row.get("equal") is False:
                unequal.add(row["candidate"])
            if "vs_default" in row and row["candidate"] != "default":
                ratios.setdefault(row["candidate"], []).append(row["vs_default"])
    ranked = [(name, math.exp(sum(map(math.log, rs)) / len(rs)), len(rs)) for name, rs in ratios.items()
              if name not in unequal and len(rs) == len(cases)]
    return sorted(ranked, key=lambda item: item[1])


def markdown(records: list[dict], meta: dict) -> str:
    lines = [f"Conv launch sweep, {meta['date']}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}.",
             "", "Candidates are (block_t, block_c, num_warps, channels_fastest, rows_per_step, state_block_b, "
             "state_block_c, pdl) "
             "for causal_conv1d and (block_b, block_c, num_warps, pdl) for causal_conv1d_update; ratio = ms / "
             "default ms.", ""]
    for op in CHOOSER:
        ranked = ranking(records, op)
        if ranked:
            lines += [f"### {op}: candidates by geometric mean of ms / default ms", "", "| candidate | ratio |",
                      "|---|---|", *[f"| {name} | {ratio:.3f} |" for name, ratio, _ in ranked], ""]
    for record in records:
        vllm = f", vLLM {record['vllm_ms']:.4f} ms" if "vllm_ms" in record else ""
        lines += [f"### {record['op']} {record['case']} (default {tuple(record['default'].values())}{vllm})", "",
                  "| candidate | ms | TB/s | ratio | equal to default |", "|---|---|---|---|---|"]
        for row in sorted(record["rows"], key=lambda r: r.get("ms", math.inf)):
            if "ms" not in row:
                lines.append(f"| {row['candidate']} | - | - | - | {row['error']} |")
                continue
            equal = {None: "-", True: "yes", False: "**NO**"}[row.get("equal")]
            lines.append(f"| {row['candidate']} | {row['ms']:.4f} | {row['tbps']:.2f} | {row['vs_default']:.3f} | "
                         f"{equal} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.time()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    on_gpu = torch.cuda.is_available() and not interpreted
    if not on_gpu and not (interpreted and a.smoke):
        sys.exit("bench.sweep_conv: no CUDA device; on a CPU run `TRITON_INTERPRET=1 python -m bench.sweep_conv "
                 "--smoke`")
    log = lambda line: print(line, flush=True)  # noqa: E731
    peers = load_peers(a.peers, log)
    device = torch.device("cuda" if on_gpu else "cpu")
    setup = Setup(SMOKE if a.smoke else BAMBA_9B, device, torch.float32 if a.smoke else torch.bfloat16, a.seed)
    import triton
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if on_gpu else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__, args=vars(a))
    records, failed = [], []
    with torch.inference_mode():
        only = {op for op in a.only.split(",") if op}
        for case in [c for c in sweep_cases(setup, peers, a.smoke) if not only or c.op in only]:
            try:
                records.append(sweep_case(case, a, on_gpu, t_start + a.budget, log))
            except Exception as e:                                   # the default itself failed: the other cases go on
                traceback.print_exc()
                failed.append(f"{case.op} {case.name}: {type(e).__name__}: {str(e)[:200]}")
                log(f"# FAILED {failed[-1]}")
            if on_gpu:
                torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t_start, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {op: ranking(records, op) for op in CHOOSER}
    (out / "sweep.json").write_text(json.dumps(dict(meta=meta, cases=records, ranking=summary, failed=failed),
                                               indent=1))
    (out / "sweep.md").write_text(markdown(records, meta))
    for op, ranked in summary.items():
        if ranked:
            log(f"# {op}: best over all cases {ranked[0][0]} at {ranked[0][1]:.3f} x the default's time")
    unequal = [(r["case"], row["candidate"]) for r in records for row in r["rows"] if row.get("equal") is False]
    for case_name, candidate in unequal:
        log(f"# MISMATCH: {candidate} differs from the default in {case_name}")
    log(f"# done in {meta['wall_s']}s: {out / 'sweep.md'}")
    return 1 if unequal or failed else 0


if __name__ == "__main__":
    sys.exit(main())
