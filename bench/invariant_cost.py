"""What the vendored engine's batch-invariant mode costs against its default mode, on the CPU or a GPU.

    .venv/bin/python -m bench.invariant_cost                          # CPU (Triton interpreter), tiny-bamba
    python3 -m bench.invariant_cost --device cuda --dtype bfloat16    # a GPU

One workload (prompts of 1, 3, Q-1, Q+1, 2Q+3 and 3Q+2 tokens of fixtures/prompts.jsonl, --new tokens each, all in
one run), under a budget that takes each prompt whole and under a budget of 3 tokens a step, in each mode. Reports
the process CPU time of each run on the CPU (a busy machine's wall time says little there) and the wall time on a
GPU (synchronised), and the invariant mode's ratio to the default's. docs/engine.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.invariant_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(ROOT / "fixtures" / "tiny-bamba"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--new", type=int, default=8, help="tokens each request generates")
    p.add_argument("--max-model-len", type=int, default=128)
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from harness.scenarios import PromptSource
    from reference.config import ModelConfig
    from vendored.engine import LLMEngine

    torch.set_num_threads(1)
    cfg = ModelConfig.from_json(a.checkpoint)
    Q = cfg.mamba_chunk_size
    source = PromptSource.from_jsonl(ROOT / "fixtures" / "prompts.jsonl", cfg.vocab_size)
    lengths = (1, 3, Q - 1, Q + 1, 2 * Q + 3, 3 * Q + 2)
    requests = [(f"r{i}", source.tokens(n, i), a.new) for i, n in enumerate(lengths)]
    cuda = a.device.startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    seconds = {}
    for name, options in (("whole prompts", {}), ("budget 3", dict(max_num_batched_tokens=3))):
        for invariant in (False, True):
            engine = LLMEngine(a.checkpoint, dtype=a.dtype, device=a.device, batch_invariant=invariant,
                               max_model_len=a.max_model_len, **options)
            start = clock()
            engine.generate(requests)
            if cuda:
                torch.cuda.synchronize()
            seconds[name, invariant] = clock() - start
            engine.close()
        default, inv = seconds[name, False], seconds[name, True]
        print(f"{name}: default {default:.2f} s, batch_invariant {inv:.2f} s, ratio {inv / default:.2f} "
              f"({'wall' if cuda else 'process CPU'} time; {a.device}, {a.dtype})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
