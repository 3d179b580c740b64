"""Launch and structure sweep of our SSD scan on a GPU: candidate `_Blocks` of vendored/ops/ssd_scan.py timed
side by side with vLLM's scan and fla's chunk_simple_gla on the same inputs, plus where the time goes, kernel by kernel,
for ours and for the peers, and the launches the peers' autotuners picked.

    python3 -m bench.sweep_scan --peers .peers --out out/sweep-scan        # CUDA machine, < 2 minutes on an H200

Candidates are the default GPU `_Blocks` with one or two fields changed (stage 4's own row, column and head-dim
tiles, warps and pipelining stages); each is swapped in for `_block_sizes`
while it runs, and tests/kernels/test_ssd_scan.py::test_launch_variants holds each kind of change to the fp64 twin.
The rounded_ candidates run ssd_scan(products="rounded") (the peers' precision, tests/kernels/test_ssd_scan.py holds
it to its own bound) around that mode's default launch. A candidate sums in another order than the default, so its y is
compared with the default's (max |Δ| in the table) rather than required to be equal; the default itself is what
tests/kernels holds to the fp64 twin. Writes sweep_scan.json and prints a table; pick a new default from it and run
`pytest -m gpu tests/kernels/test_ssd_scan.py` before committing it. fla's time includes what the SSD op needs
around its kernels (softplus, B and C expanded to every head, x·Δ, D·x): its profile shows both.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import torch

from bench.kernel_cases import BAMBA_9B, Setup, scan_case
from bench.kernels import load_peers, max_abs_diff

# the module in which ssd_scan looks up `_block_sizes` at every call (vendored/ops/ssd_scan_kernels.py holds the kernels)
scan_module = importlib.import_module("vendored.ops.ssd_scan")

CASES = ((32768, 1), (8192, 8), (2048, 1))
# candidates whose time is also broken down kernel by kernel (CUDA profiler), and the peers'
PROFILED = ("default", "rounded")
PROFILED_PEERS = ("vllm", "fla")


def candidates(default, rounded_default) -> dict[str, tuple[str, object]]:
    """Name -> (products, _Blocks): the defaults of both precision modes and variations around them."""
    out = {"default": default}
    # (narrower state tiles, 3 stages, 32-wide C·S steps, 128-row tiles on 8 warps and 32-wide head-dim tiles were
    # slower than the default in the sweeps of 2026-11-30: results/2026-11-30-h200-after/sweep_scan.txt; stages
    # 2 and 3 fused into one walk along each sequence was 4x slower at 32K tokens in one sequence, and the decays by
    # exp2 of an fp64 product with log2(e) no faster than tl.exp, which is already one ex2.approx an element,
    # 2026-12-04: results/2026-12-04-h200-scan-structure; so were the products of stages 2 and 4 transposed,
    # the fp32 factor on the right, which the tensor cores read from shared memory where its bf16 pieces are stored
    # once: stage 4 2338 against 2208 µs at 32K, spilling under the register cap, experiment_transposed_products.diff
    # there)
    out["max_registers_none"] = default._replace(max_registers=0)
    out["max_registers128"] = default._replace(max_registers=128)
    # stage 4 alone: smaller row tiles, pipelined loads (only where its products do not run on wgmma: with a 64-row
    # tile on 4 warps and num_stages > 1, triton 3.x leaves a wgmma in flight across the loop's back-edge while the
    # next iteration overwrites its register operand, vLLM's note on its own sm90 configs), 2 warps, narrower tiles
    for name, change in (("m32", dict(scan_m=32)), ("m32_s2", dict(scan_m=32, scan_stages=2)),
                         ("m32_s3", dict(scan_m=32, scan_stages=3)),
                         ("w2_k32_s4", dict(scan_warps=2, scan_k=32, scan_stages=4)),
                         ("p32", dict(scan_p=32)),
                         ("k32", dict(scan_k=32)),
                         # 8 warps: each thread holds half of the 64x64 tiles, so fewer registers a thread (Nsight
                         # Compute: 168 registers, 18.5% occupancy, against vLLM's 128 and 24.4%)
                         ("w8_max_registers128", dict(scan_warps=8, max_registers=128)),
                         ("w8_max_registers_none", dict(scan_warps=8, max_registers=0))):
        out[name] = default._replace(**change)
    # (stage 3 handing stage 4 the states entering the chunks as bf16 pieces, so that stage 4 does not split each
    # again for each of its row tiles, was slower: stage 4 2310 vs 2188 µs and stage 3 378 vs 266 µs at 32K tokens,
    # results/2026-11-30-h200-session4/sweep_scan_split_states.txt; and stage 4 computing C·Bᵀ itself, per head
    # and 32 columns at a time, so that the weights stay in registers between the two products instead of going
    # through shared memory, as flash attention does: 2.70 ms (168 registers) and 3.59 ms (uncapped, 205) against
    # 2.18, experiment_stage4_cb_per_head.json there: every head recomputes its group's C·Bᵀ)
    out = {name: ("fp32", blocks) for name, blocks in out.items()}
    # products="rounded": its own default (stage 4 capped at 128 registers, its C·S read-out in one 128-wide step;
    # stage 2 at 168) and variations
    for name, change in (("", {}), ("_max_registers128", dict(max_registers=128)),
                         ("_scan_max_registers168", dict(scan_max_registers=168)),
                         ("_n_scan64", dict(n_scan=64)), ("_k32", dict(scan_k=32))):
        out["rounded" + name] = ("rounded", rounded_default._replace(**change))
    unique = {}
    for name, candidate in out.items():          # a variation equal to the default is not timed twice
        unique.setdefault(candidate, name)
    return {name: candidate for candidate, name in unique.items()}


def profile_kernels(run) -> list[tuple[str, float]]:
    """(kernel name, µs per call) of one configuration, from the CUDA profiler over 5 calls."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 5) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def autotuned_configs() -> dict[str, str]:
    """The launch each autotuned Triton kernel loaded so far (the peers') picked: module.kernel -> config."""
    import sys
    from triton.runtime.autotuner import Autotuner
    found = {}
    for module in list(sys.modules.values()):
        namespace = vars(module) if isinstance(getattr(module, "__dict__", None), dict) else {}
        for name, obj in list(namespace.items()):
            if isinstance(obj, Autotuner) and getattr(obj, "best_config", None) is not None:
                found[f"{module.__name__}.{name}"] = str(obj.best_config)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.sweep_scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default=None, help="folder holding peer_loader.py and vendor/ (make fetch-peers)")
    p.add_argument("--out", default="out/sweep-scan")
    p.add_argument("--rep-ms", type=float, default=30.0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.sweep_scan needs a CUDA device")
    # the profiler imports torch._inductor on first use, which walks sys.modules and trips over the peers' stub
    # modules: import it before the peers load
    importlib.import_module("torch._inductor")
    import triton
    import triton.testing
    peers = load_peers(a.peers, print)
    setup = Setup(BAMBA_9B, torch.device("cuda"), torch.bfloat16, 0)
    real_block_sizes = scan_module._block_sizes
    default = real_block_sizes(BAMBA_9B.Q, BAMBA_9B.H, BAMBA_9B.P, BAMBA_9B.N, "fp32", torch.device("cuda"))
    rounded_default = real_block_sizes(BAMBA_9B.Q, BAMBA_9B.H, BAMBA_9B.P, BAMBA_9B.N, "rounded", torch.device("cuda"))
    results, started = [], time.time()
    for n_tokens, n_seqs in CASES:
        impls = scan_case(setup, peers, n_tokens, n_seqs, torch.float32).build()
        row = dict(tokens=n_tokens, seqs=n_seqs, ms={}, diff={})
        for peer in PROFILED_PEERS:
            if peer in impls:
                run, _ = impls[peer].prepare()
                run()
                row["ms"][peer] = triton.testing.do_bench(run, rep=a.rep_ms, return_mode="median")
                row.setdefault("profiles", {})[peer] = profile_kernels(run)
        row["peer_autotuned"] = autotuned_configs()
        reference = None
        for name, (products, blocks) in candidates(default, rounded_default).items():
            scan_module._block_sizes = lambda *args, _b=blocks: _b
            try:
                run, read = impls["ours" if products == "fp32" else "ours_rounded"].prepare()
                run()
                torch.cuda.synchronize()
                y = read()[0].clone()
                reference = y if reference is None else reference
                row["diff"][name] = max_abs_diff(y, reference)
                row["ms"][name] = triton.testing.do_bench(run, rep=a.rep_ms, return_mode="median")
                if name in PROFILED:
                    row.setdefault("profiles", {})[name] = profile_kernels(run)
            except Exception as e:                    # e.g. out of shared memory: report, go on
                row["ms"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            finally:
                scan_module._block_sizes = real_block_sizes
            print(f"T{n_tokens} seqs{n_seqs} {name:40s} {row['ms'][name]}  (Δ {row['diff'].get(name)})", flush=True)
        results.append(row)
        del impls
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                default=default._asdict(), seconds=time.time() - started)
    (out / "sweep_scan.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str))
    for row in results:
        print(f"\nT{row['tokens']} seqs{row['seqs']}: " + ", ".join(f"{peer} {row['ms'].get(peer)}"
                                                                  for peer in PROFILED_PEERS))
        for name, ms in row["ms"].items():
            if name not in PROFILED_PEERS and isinstance(ms, float):
                ratios = "  ".join(f"{peer}/ours {row['ms'][peer] / ms:5.2f}" for peer in PROFILED_PEERS
                                   if isinstance(row["ms"].get(peer), float))
                print(f"  {name:40s} {ms:8.4f} ms   {ratios}")
        for kernel, config in sorted(row.get("peer_autotuned", {}).items()):
            print(f"  autotuned {kernel}: {config}")
        for name, profile in row.get("profiles", {}).items():
            print(f"  where {name}'s time goes:")
            for kernel, us in profile[:10]:
                print(f"    {us:9.1f} µs  {kernel[:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
