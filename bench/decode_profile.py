"""Where a decode step of the 2-layer Bamba-9B slice spends its time, on a GPU: the device, kernel by kernel, and the
host, function by function.

    python3 -m bench.decode_profile --batch-sizes 1,8,256 --out out/decode-profile

For each batch size an engine with CUDA graphs (bf16) prefills `batch` prompts and runs a few decode steps, then:
- `kernels-b{batch}.txt`: the graph replay's wall time per step (the step's device work: inputs spread, forward,
  ranking), then one eager run of the same padded step under the CUDA profiler (5 repeats), each kernel's device
  time per step, largest first, with the number of kernels a step launches;
- `host-b{batch}.txt`: the wall time of 20 engine steps one by one, with run-ahead on and off, and a cProfile of 20
  run-ahead steps (by cumulative, then by own time): what the host does per step and whether the step waits for it.
Throughput numbers come from bench/decode.py; this shows where a step's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.decode import BAMBA_9B_SLICE, PROMPT_TOKENS, write_random_slice

REPEATS = 5          # profiled eager steps per batch size
HOST_STEPS = 20      # engine steps timed one by one and profiled


def _engine(checkpoint: Path, batch: int, *, run_ahead: bool = True):
    from vendored.engine import LLMEngine

    engine = LLMEngine(checkpoint, dtype="bfloat16", device="cuda", max_num_seqs=batch,
                       max_num_batched_tokens=batch * PROMPT_TOKENS, max_model_len=PROMPT_TOKENS + 128,
                       cuda_graphs=True, run_ahead=run_ahead)
    for i in range(batch):
        engine.add_request(f"b{i}", [(7 * i + 3 * t + 1) % 1000 for t in range(PROMPT_TOKENS)], 100, top_k=1)
    for _ in range(5):                                                  # the prefill, then warm-up decodes
        engine.step()
    torch.cuda.synchronize()
    return engine


def kernel_profile(checkpoint: Path, batch: int) -> str:
    """The replay's wall time and one eager step's kernels (device time per step, largest first)."""
    from torch.profiler import ProfilerActivity, profile

    from vendored.engine.cudagraph import padded_decode_step

    engine = _engine(checkpoint, batch)
    try:
        engine._settle()
        pieces = engine.scheduler.schedule()
        graphs = engine.graphs
        size = graphs.size_for(len(pieces))
        graphs._stage(pieces, size)
        torch.cuda.synchronize()
        for _ in range(3):
            padded_decode_step(engine.model, graphs.buffers, size, engine.states, engine.kv)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            graphs._launch(size)
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - start) / 50 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                padded_decode_step(engine.model, graphs.buffers, size, engine.states, engine.kv)
            torch.cuda.synchronize()
    finally:
        engine.close()
    kernels: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time_total
    total_us = sum(us for _, us in kernels.values()) / REPEATS
    count = sum(n for n, _ in kernels.values()) // REPEATS
    lines = [f"batch {batch}: graph replay {replay_ms:.3f} ms a step; one eager step's kernels {total_us / 1e3:.3f} ms "
             f"of device time, {count} kernels"]
    for name, (n, us) in sorted(kernels.items(), key=lambda item: -item[1][1]):
        lines.append(f"{us / REPEATS:10.1f} us  {n // REPEATS:4d}x  {name[:150]}")
    return "\n".join(lines) + "\n"


def host_profile(checkpoint: Path, batch: int) -> str:
    """Per-step wall times with run-ahead on and off, and a cProfile of run-ahead steps."""
    lines = []
    for run_ahead in (True, False):
        engine = _engine(checkpoint, batch, run_ahead=run_ahead)
        try:
            times = []
            for _ in range(HOST_STEPS):
                start = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            lines.append(f"run_ahead={run_ahead}, batch {batch}: step wall ms " + " ".join(f"{t:.2f}" for t in times))
            if run_ahead:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(HOST_STEPS):
                    engine.step()
                torch.cuda.synchronize()
                profiler.disable()
                for key, count in (("cumulative", 40), ("tottime", 25)):
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(count)
                    lines.append(text.getvalue())
        finally:
            engine.close()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,256")
    parser.add_argument("--out", default="out/decode-profile")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.decode_profile: needs a CUDA device (it profiles CUDA kernels and graph replays)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch_sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = write_random_slice(Path(scratch) / "bamba9b-2layer", BAMBA_9B_SLICE, device="cuda")
        for batch in batches:
            (out / f"kernels-b{batch}.txt").write_text(kernel_profile(checkpoint, batch))
            torch.cuda.empty_cache()
            (out / f"host-b{batch}.txt").write_text(host_profile(checkpoint, batch))
            torch.cuda.empty_cache()
            print(f"batch {batch}: wrote {out / f'kernels-b{batch}.txt'} and {out / f'host-b{batch}.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
