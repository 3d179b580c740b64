"""What the vendored engine's batch-invariant mode costs against its default mode: decode tokens/s, prefill ms and a
mixed workload, both modes side by side in one process, on the CPU or a GPU.

    .venv/bin/python -m bench.invariant_cost                                    # CPU (Triton interpreter), tiny-bamba
    python3 -m bench.invariant_cost --device cuda --model bamba9b-2layer        # a GPU, bf16

- decode: bench/decode.py's measurement (a batch of 16-token prompts prefilled, warm-up steps, then --steps decode
  steps timed; engine tokens/s) at each --batch-sizes, CUDA graphs on where the device has them;
- prefill: one request of each --prefill-lengths tokens, the step that prefills it timed (ms), after one untimed
  request of the same length;
- workload: prompts of 1, 3, Q-1, Q+1, 2Q+3 and 3Q+2 tokens of fixtures/prompts.jsonl, --new tokens each, all in one
  run, under a budget that takes each prompt whole and under a budget of 3 tokens a step.
Times are wall clock on a GPU (synchronised) and the process CPU time on the CPU (a busy machine's wall time says
little there). Each row gives both modes and the invariant mode's cost as a ratio (time over time; for tokens/s the
default's over the invariant's). Writes invariant_cost.json and invariant_cost.md to --out; docs/engine.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny", "bamba9b-2layer")


def _clock(cuda: bool):
    return time.perf_counter if cuda else time.process_time


def prefill_ms(checkpoint, *, length: int, invariant: bool, dtype: str, device: str) -> float:
    """The step that prefills one `length`-token request, after an untimed one of the same length."""
    import torch

    from vendored.engine import LLMEngine
    cuda = device.startswith("cuda")
    engine = LLMEngine(checkpoint, dtype=dtype, device=device, batch_invariant=invariant, max_num_seqs=1,
                       max_num_batched_tokens=length, max_model_len=length + 1, cuda_graphs=False)
    try:
        vocab = engine.cfg.vocab_size
        clock, best = _clock(cuda), None
        for i in range(2):
            engine.add_request(f"p{i}", [(5 * t + 11 * i + 1) % vocab for t in range(length)], max_new_tokens=1,
                               top_k=1)
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            best = clock() - start
            while engine.has_unfinished():
                engine.step()
        return 1e3 * best
    finally:
        engine.close()


def workload_s(checkpoint, *, invariant: bool, budget: int | None, new: int, max_model_len: int, dtype: str,
               device: str) -> float:
    import torch

    from harness.scenarios import PromptSource
    from vendored.engine import LLMEngine
    cuda = device.startswith("cuda")
    Q = json.loads((Path(checkpoint) / "config.json").read_text()).get("mamba_chunk_size", 256)
    longest = 3 * Q + 2 + new                                    # the longest request below, prompt and output
    engine = LLMEngine(checkpoint, dtype=dtype, device=device, batch_invariant=invariant,
                       max_model_len=max(max_model_len, longest),
                       **({} if budget is None else dict(max_num_batched_tokens=budget)))
    try:
        source = PromptSource.from_jsonl(ROOT / "fixtures" / "prompts.jsonl", engine.cfg.vocab_size)
        lengths = (1, 3, Q - 1, Q + 1, 2 * Q + 3, 3 * Q + 2)
        requests = [(f"r{i}", source.tokens(n, i), new) for i, n in enumerate(lengths)]
        clock = _clock(cuda)
        start = clock()
        engine.generate(requests)
        if cuda:
            torch.cuda.synchronize()
        return clock() - start
    finally:
        engine.close()


def markdown(meta: dict, rows: list[dict]) -> str:
    unit = "wall" if meta["device"].startswith("cuda") else "process CPU"
    lines = [f"Batch-invariant mode against the default ({meta['device_name']}, {meta['model']}, {meta['dtype']}, "
             f"torch {meta['torch']}; {unit} time)", "",
             "| measurement | default | batch_invariant | cost |", "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['default']:.4g} {r['unit']} | {r['invariant']:.4g} {r['unit']} | "
                     f"{r['cost']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.invariant_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=MODELS,
                   help="tiny: fixtures/tiny-bamba; bamba9b-2layer: bench/decode.py's random Bamba-9B-wide slice")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--batch-sizes", default=None, help="decode batches (default 1,8,64 on CUDA, 1,4 on a CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 50 on CUDA, 4 on a CPU)")
    p.add_argument("--prefill-lengths", default=None,
                   help="(default 256,1024,4000 on CUDA, 64 on a CPU; each below the model's max positions)")
    p.add_argument("--new", type=int, default=8, help="tokens each request of the workload generates")
    p.add_argument("--max-model-len", type=int, default=128,
                   help="the workload's engines (raised to its longest request, 3Q + 2 + --new tokens)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: decode, prefill, workload")
    p.add_argument("--out", default="out/bench")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from bench.decode import BAMBA_9B_SLICE, TINY, measure, write_random_slice

    if not cuda:
        torch.set_num_threads(1)
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    batches = [int(b) for b in (a.batch_sizes or ("1,8,64" if cuda else "1,4")).split(",")]
    steps = a.steps or (50 if cuda else 4)
    lengths = [int(n) for n in (a.prefill_lengths or ("256,1024,4000" if cuda else "64")).split(",")]
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    unknown = skip - {"decode", "prefill", "workload"}
    if unknown:
        p.error(f"--skip: unknown part {sorted(unknown)[0]!r}; expected decode, prefill or workload")
    rows = []

    def row(what, unit, default, invariant, cost):
        rows.append(dict(what=what, unit=unit, default=default, invariant=invariant, cost=cost))
        print(f"{what}: default {default:.4g} {unit}, batch_invariant {invariant:.4g} {unit}, cost {cost:.2f}x",
              flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = TINY if a.model == "tiny" else write_random_slice(Path(scratch) / a.model, BAMBA_9B_SLICE,
                                                                       device=a.device)
        if "decode" not in skip:
            for batch in batches:
                tps = {inv: measure(checkpoint, batch=batch, graphs=cuda, steps=steps, dtype=dtype, device=a.device,
                                    batch_invariant=inv)["engine_tokens_per_s"] for inv in (False, True)}
                row(f"decode, batch {batch}" + (", CUDA graphs" if cuda else ""), "tok/s", tps[False], tps[True],
                    tps[False] / tps[True])
        if "prefill" not in skip:
            for length in lengths:
                ms = {inv: prefill_ms(checkpoint, length=length, invariant=inv, dtype=dtype, device=a.device)
                      for inv in (False, True)}
                row(f"prefill, {length} tokens", "ms", ms[False], ms[True], ms[True] / ms[False])
        if "workload" not in skip:
            for name, budget in (("whole prompts", None), ("budget 3", 3)):
                sec = {inv: workload_s(checkpoint, invariant=inv, budget=budget, new=a.new,
                                       max_model_len=a.max_model_len, dtype=dtype, device=a.device)
                       for inv in (False, True)}
                row(f"workload, {name}", "s", sec[False], sec[True], sec[True] / sec[False])
    meta = dict(model=a.model, device=a.device, dtype=dtype, torch=torch.__version__,
                device_name=torch.cuda.get_device_name() if cuda else "cpu", decode_steps=steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "invariant_cost.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "invariant_cost.md").write_text(markdown(meta, rows))
    print(f"wrote {out / 'invariant_cost.json'}, {out / 'invariant_cost.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
