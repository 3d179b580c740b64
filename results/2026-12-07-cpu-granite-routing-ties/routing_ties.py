"""How an fp32 engine can fail on a GraniteMoeHybrid model at a routing near-tie, measured with the oracle alone.

The model: granite4h-small-2layer (harness/scale.py, Granite 4.0-H-Small's widths), drawn on the CPU (seed 0; the
GPU draws another model from the same seed). Prompts: random token ids, uniform over the vocabulary. For each prompt
the fp64 oracle and the reference in fp32 score it teacher-forced in one piece, layer-streamed (reference/model.py),
and harness/routing.py finds the near-ties the judge allows for (router gap below 2 times the fp32 reference's
router error on that prompt). Then, whether or not a natural tie turns up, the TRADES tokens with the smallest
router gaps are traded one at a time in fp64 (moe_ref's swap), and what each moves the logprob of the next token is
set beside the fp32 reference's own largest error on the prompt, the error the fp32 budget is made of.

Written: prompts.jsonl (a row per prompt), trades.jsonl (a row per traded token); a summary is printed.

    .venv/bin/python results/2026-12-07-cpu-granite-routing-ties/routing_ties.py [--prompts N] [--length T]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.routing import _recorded, routing_ties  # noqa: E402
from harness.scale import write_checkpoint  # noqa: E402
from reference.model import BambaReference  # noqa: E402

TRADES = 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--length", type=int, default=770)
    ap.add_argument("--model-dir", default="/tmp/g4h-small-2layer-cpu")
    args = ap.parse_args()
    out = Path(__file__).resolve().parent
    torch.set_num_threads(2)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        write_checkpoint("granite4h-small-2layer", model_dir, seed=0, device="cpu")
    m64, m32 = (BambaReference.from_pretrained(model_dir, streamed=True, dtype=d, allow_long_context=True)
                for d in (torch.float64, torch.float32))
    top_k = m64.cfg.num_experts_per_tok
    gen = torch.Generator().manual_seed(1234)
    rows, trades = [], []
    for n in range(args.prompts):
        t0 = time.time()
        ids = torch.randint(1, m64.cfg.vocab_size, (args.length,), generator=gen)
        lp64, logits64 = _recorded(m64, ids)
        lp32, _ = _recorded(m32, ids)
        fp32_error = float((lp32 - lp64).abs().max())
        natural = routing_ties(m64, m32, [ids.tolist()], k=2.0)
        gaps = torch.stack([(v.sort(dim=-1, descending=True).values[:, top_k - 1]
                             - v.sort(dim=-1, descending=True).values[:, top_k]) for _, v in sorted(logits64.items())])
        gaps[:, -1] = float("inf")                                   # the last token's logits are not judged
        smallest = gaps.flatten().argsort()[:TRADES].tolist()
        for flat in smallest:
            layer, token = divmod(flat, gaps.shape[1])
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[token] = True
            m64.route_swaps = {sorted(logits64)[layer]: mask}
            try:
                traded, _ = _recorded(m64, ids)
            finally:
                m64.route_swaps = {}
            moved = (traded - lp64).abs()
            trades.append({"prompt": n, "moe_layer": sorted(logits64)[layer], "token": token,
                           "gap_fp64": float(gaps[layer, token]), "moved_next_logprob": float(moved[token]),
                           "moved_largest": float(moved.max()), "fp32_reference_largest_error": fp32_error,
                           "moved_over_fp32_error": float(moved[token]) / fp32_error})
            print("   trade", json.dumps(trades[-1]), flush=True)
        row = {"prompt": n, "tokens": args.length, "moe_layers": len(logits64), "top_k": top_k,
               "fp32_router_error": natural.router_error, "threshold": natural.threshold,
               "natural_ties": len(natural.ties), "largest_allowance": natural.describe()["largest_allowance"],
               "fp32_reference_largest_error": fp32_error,
               "gaps_below": {str(th): int((gaps < th).sum()) for th in (1e-5, 1e-4, 1e-3, 1e-2)},
               "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "trades.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trades))
    judged = sum(r["tokens"] - 1 for r in rows) * rows[0]["moe_layers"]
    print(f"{sum(r['natural_ties'] for r in rows)} natural near-ties in {judged} judged token-layers; "
          f"traded: moved the next logprob {min(t['moved_over_fp32_error'] for t in trades):.0f}-"
          f"{max(t['moved_over_fp32_error'] for t in trades):.0f} times the fp32 reference's largest error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
