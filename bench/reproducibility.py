"""Is an engine bit-reproducible, and does it read memory it never wrote?

Runs one engine (default: the vendored one) on the requests of a few scenarios several times in one process and
compares every returned number bit for bit with the first run: a plain second run (run-to-run variation), and runs
after the memory the CUDA caching allocator holds free has been filled with NaN, with zeros and with 1e4 (a buffer
created with torch.empty and read before it is written gives a different answer after each). A difference is
reported as the request, the first differing position and the largest |difference|.

    python3 -m bench.reproducibility --checkpoint /tmp/b9b-2 --dtype bfloat16 \
        --scenarios chunked_prefill-budget257-Q256,batching-long-decode,batching-together

Writes reproducibility.json to --out (default out/reproducibility). Exit status 0 when every run equals the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

POISONS = {"plain": None, "nan": float("nan"), "zeros": 0.0, "1e4": 1e4}
FIELDS = ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "output_ids", "output_logprobs",
          "output_top_ids", "output_top_logprobs")


def poison(value: float | None, device, large_gb: float = 4.0) -> None:
    """Fill what the caching allocator will hand out next with `value`: large blocks (split for tensors of 1 MB
    and more) and small ones (the pool of tensors under 1 MB), then give them back to it (not to the driver)."""
    import torch

    if value is None:
        return
    large = [torch.full((256 * 2 ** 20,), value, dtype=torch.float32, device=device) for _ in range(int(large_gb))]
    small = [torch.full((2 ** 15,), value, dtype=torch.float32, device=device) for _ in range(4096)]
    torch.cuda.synchronize(device)
    del large, small


def first_difference(a, b) -> dict | None:
    """Where two results of one request first differ, field by field; None when every number is the same bits."""
    import torch

    for field in FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        if x is None and y is None:
            continue
        x, y = torch.as_tensor(x), torch.as_tensor(y)          # output_ids is a list
        if x.shape != y.shape:
            return {"field": field, "shapes": [list(x.shape), list(y.shape)]}
        same = (x == y) | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() else x == y
        if not bool(same.all()):
            rows = (~same).reshape(same.shape[0], -1).any(dim=1).nonzero()[:, 0]
            diff = (x.double() - y.double()).abs()
            return {"field": field, "first_position": int(rows[0]), "positions": int(rows.numel()),
                    "max_abs": float(diff[~same].nan_to_num(nan=float("inf")).max()),
                    "nan": bool(torch.isnan(x).any() or torch.isnan(y).any())}
    return None


def main(argv: list[str] | None = None) -> int:
    from harness.cli import prepare_environment

    prepare_environment()
    import torch
    from tqdm import tqdm

    from harness.adapters import get_engine
    from harness.engine import parse_dtype
    from harness.scenarios import PromptSource, build_scenarios
    from reference.config import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engine", default="vendored")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scenarios", default="chunked_prefill-budget257-Q256,batching-long-decode,batching-together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default=",".join(POISONS), help=f"after the first: any of {', '.join(POISONS)}")
    parser.add_argument("--out", default="out/reproducibility")
    args = parser.parse_args(argv)
    if torch.device(args.device).type != "cuda":
        parser.error("the caching allocator's memory can only be poisoned on a CUDA device")
    cfg = ModelConfig.from_dict(json.loads((Path(args.checkpoint) / "config.json").read_text()))
    by_id = {s.id: s for s in build_scenarios(cfg)}
    unknown = [s for s in args.scenarios.split(",") if s not in by_id]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; this model has {', '.join(by_id)}")
    runs = args.runs.split(",")
    if any(r not in POISONS for r in runs):
        parser.error(f"--runs: expected names among {', '.join(POISONS)}, got {args.runs}")
    engine_cls, dtype = get_engine(args.engine), parse_dtype(args.dtype)
    source = PromptSource(cfg.vocab_size, seed=args.seed)
    report = {"checkpoint": str(args.checkpoint), "engine": args.engine, "dtype": args.dtype, "seed": args.seed,
              "torch": torch.__version__, "device_name": torch.cuda.get_device_name(), "scenarios": {}}
    ok = True
    for sid in tqdm(args.scenarios.split(","), desc="scenarios", unit="scenario"):
        scenario = by_id[sid]
        requests = scenario.requests(source)
        options = scenario.options
        found = {}
        first = None
        for name in ["first"] + runs:
            poison(POISONS.get(name), args.device)
            with engine_cls(args.checkpoint, dtype=dtype, device=args.device, options=options) as engine:
                results = engine.run(requests)
            if first is None:
                first = results
                continue
            diffs = {r.request_id: d for a, r in zip(first, results) if (d := first_difference(a, r))}
            found[name] = diffs
            ok &= not diffs
            print(f"{sid} {name}: {'bit-identical' if not diffs else diffs}", flush=True)
        report["scenarios"][sid] = found
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reproducibility.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'reproducibility.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
