"""Is an engine bit-reproducible, and does it read memory it never wrote?

Runs one engine (default: the vendored one) on the requests of a few scenarios several times in one process and
compares every returned number bit for bit with the first run: a plain second run (run-to-run variation), and runs
after the memory the CUDA caching allocator holds free has been filled with NaN, with zeros and with 1e4 (a buffer
created with torch.empty and read before it is written gives a different answer after each). A difference is
reported as the request, the first differing position and the largest |difference|.

With --trace (the vendored engine) every kernel and layer call of the model (causal_conv1d, causal_conv1d_update,
ssd_scan, selective_state_update, rms_norm_gated, the masked and paged decode attention, torch's
scaled_dot_product_attention, the linear layers and RoPE, and the attention, mamba, MLP and logits stages) is
fingerprinted on the device: an exact integer checksum of the bits of its result and of every tensor it was given
(the state pools it updates in place included), taken after the call. The first call whose fingerprint differs from
the first run's, in execution order, is the one that made the difference. --dump FILE keeps the first
run's results and trace; --against FILE compares this process's first run with another process's (the variation
seen between processes, where one process's runs may all agree).

    python3 -m bench.reproducibility --checkpoint /tmp/b9b-2 --dtype bfloat16 \
        --scenarios chunked_prefill-budget257-Q256,batching-long-decode,batching-together

Writes reproducibility.json to --out (default out/reproducibility). Exit status 0 when every run equals the first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TRACED_OPS = ("causal_conv1d", "causal_conv1d_update", "ssd_scan", "selective_state_update", "rms_norm_gated",
              "paged_decode_attention", "masked_attention")
TRACED_STAGES = ("embed", "_attention", "_mamba", "_mlp", "logits", "_rope", "_linear", "_output_linear")
TRACED_TORCH = ("scaled_dot_product_attention",)      # torch.nn.functional calls the model makes
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


def fingerprint(t) -> tuple[int, int]:
    """An exact checksum of a tensor's bits, computed where it lives: (sum of its words, position-weighted sum)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    words = flat.view(torch.int16 if flat.element_size() == 2 else torch.int32 if flat.element_size() == 4 else
                      torch.int64 if flat.element_size() == 8 else torch.uint8).long()
    weights = torch.arange(words.numel(), device=words.device) % 65521 + 1
    return int(words.sum()), int((words * weights).sum())


class Trace:
    """Wraps the vendored model's ops and stages so that each call appends (name, fingerprints of its result and
    of its tensor arguments after the call) to `calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []
        self._undo: list = []

    def _wrap(self, owner, name: str) -> None:
        import torch

        original = getattr(owner, name)

        def traced(*args, **kwargs):
            out = original(*args, **kwargs)
            tensors = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, tuple) else ())
                                                                   if isinstance(t, torch.Tensor)]
            tensors += [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            self.calls.append((name, [fingerprint(t) for t in tensors]))
            return out

        setattr(owner, name, traced)
        self._undo.append((owner, name, original))

    def __enter__(self) -> "Trace":
        from vendored.engine import model

        for name in TRACED_OPS:
            self._wrap(model, name)
        for name in TRACED_STAGES:
            self._wrap(model.BambaEngineModel, name)
        for name in TRACED_TORCH:
            self._wrap(model.F, name)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def first_trace_difference(a: list, b: list) -> dict | None:
    """The first call (in execution order) whose fingerprints differ between two traces, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"call": i, "name": x[0], "other_name": y[0],
                    "what": "result" if x[1][:1] != y[1][:1] else "an argument after the call (updated in place)",
                    "calls_before_by_name": {n: sum(1 for c in a[:i] if c[0] == n) for n in {c[0] for c in a[:i]}}}
    if len(a) != len(b):
        return {"call": min(len(a), len(b)), "name": "(one trace is longer)", "lengths": [len(a), len(b)]}
    return None


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
    parser.add_argument("--trace", action="store_true", help="fingerprint every op call (the vendored engine)")
    parser.add_argument("--dump", help="write the first run's results (and trace) per scenario to this file")
    parser.add_argument("--against", help="compare the first run with the results --dump wrote in another process")
    parser.add_argument("--out", default="out/reproducibility")
    args = parser.parse_args(argv)
    runs = args.runs.split(",") if args.runs else []
    if any(r not in POISONS for r in runs):
        parser.error(f"--runs: expected names among {', '.join(POISONS)}, got {args.runs}")
    if torch.device(args.device).type != "cuda" and any(POISONS[r] is not None for r in runs):
        parser.error("the caching allocator's memory can only be poisoned on a CUDA device (on the CPU: --runs plain)")
    if args.trace and args.engine != "vendored":
        parser.error("--trace wraps the vendored engine's model")
    cfg = ModelConfig.from_dict(json.loads((Path(args.checkpoint) / "config.json").read_text()))
    by_id = {s.id: s for s in build_scenarios(cfg)}
    unknown = [s for s in args.scenarios.split(",") if s not in by_id]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; this model has {', '.join(by_id)}")
    engine_cls, dtype = get_engine(args.engine), parse_dtype(args.dtype)
    source = PromptSource(cfg.vocab_size, seed=args.seed)
    report = {"checkpoint": str(args.checkpoint), "engine": args.engine, "dtype": args.dtype, "seed": args.seed,
              "torch": torch.__version__, "scenarios": {},
              "device_name": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"}
    other = torch.load(args.against, weights_only=False) if args.against else {}
    dumped = {}
    ok = True
    for sid in tqdm(args.scenarios.split(","), desc="scenarios", unit="scenario"):
        scenario = by_id[sid]
        requests = scenario.requests(source)
        found = {}
        first = first_trace = None
        for name in ["first"] + runs:
            poison(POISONS.get(name), args.device)
            trace = Trace() if args.trace else None
            with engine_cls(args.checkpoint, dtype=dtype, device=args.device, options=scenario.options) as engine:
                if trace is not None:
                    with trace:
                        results = engine.run(requests)
                else:
                    results = engine.run(requests)
            calls = trace.calls if trace is not None else None
            if first is None:
                first, first_trace = results, calls
                dumped[sid] = {"results": results, "trace": calls}
                if sid in other:
                    found["other process"] = _compare(other[sid]["results"], results, other[sid]["trace"], calls)
                    ok &= not found["other process"]
                    print(f"{sid} against {args.against}: {found['other process'] or 'bit-identical'}", flush=True)
                continue
            found[name] = _compare(first, results, first_trace, calls)
            ok &= not found[name]
            print(f"{sid} {name}: {found[name] or 'bit-identical'}", flush=True)
        report["scenarios"][sid] = found
    if args.dump:
        torch.save(dumped, args.dump)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reproducibility.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'reproducibility.json'}")
    return 0 if ok else 1


def _compare(first, results, first_trace, trace) -> dict:
    """{request id: its first difference} and, with traces, {"first call": where the runs parted}; {} if none."""
    diffs = {r.request_id: d for a, r in zip(first, results) if (d := first_difference(a, r))}
    if diffs and first_trace is not None and trace is not None:
        diffs["first call"] = first_trace_difference(first_trace, trace)
    return diffs


if __name__ == "__main__":
    sys.exit(main())
