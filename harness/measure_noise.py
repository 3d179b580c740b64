"""Measure the reference's own error in a low dtype, position by position: what the budget rules read (compare.py).

    python -m harness.measure_noise CHECKPOINT [CHECKPOINT ...] [--random-twin] [--dtype bfloat16] [--out DIR]

Each checkpoint runs as the fp64 oracle and as the reference in --dtype (reference.BambaReference, one forward a
window) on text: the held-out windows of fixtures/eval/heldout_sample.json where the model's vocabulary is the
tokenizer's, else seeded random ids. Per position, |logprob_d − logprob_fp64| of the text's next token, and whether
the two agree on the most likely token. Per checkpoint: top-1 agreement, the mean, median, 99th percentile and
largest error, the largest over the 99th percentile (how far one outlier sets the max rule's E), and the budget at
k = 2 under each rule (2·max; the quantile rule's floor 2·q99). --random-twin adds, for each checkpoint, a model of
its config with weights drawn by the config zoo's scheme (harness/zoo.py): trained against random weights at the
same shape. Writes noise.json, noise.md and noise.png (the error distribution of each model) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "fixtures" / "eval" / "heldout_sample.json"


def texts(vocab_size: int, windows: int, tokens: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """`windows` sequences of `tokens` ids: held-out text where it fits the vocabulary, else seeded random ids."""
    sample = json.loads(HELDOUT.read_text())
    if len(sample["unigram_counts"]) == vocab_size and windows <= len(sample["windows"]):
        return [w[:tokens] for w in sample["windows"][:windows]], f"held-out text ({HELDOUT.relative_to(ROOT)})"
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (windows, tokens), generator=gen).tolist(), f"random ids (seed {seed})"


def position_errors(checkpoint: Path, dtype: torch.dtype, sequences: list[list[int]]) -> tuple[list[float], list[bool]]:
    """|Δ logprob| of each next token and top-1 agreement, over every position of every sequence; log-softmax in
    at least fp32, as the judge's twins (harness/engine.py)."""
    from reference.model import BambaReference

    from .engine import log_softmax

    errors, agree = [], []
    models = {d: BambaReference.from_pretrained(checkpoint, dtype=d) for d in (torch.float64, dtype)}
    for ids in sequences:
        x = torch.tensor(ids)
        rows = {d: log_softmax(m.forward(x)[0]).double()[:-1] for d, m in models.items()}   # as the judge's
        target = x[1:, None]
        low, exact = rows[dtype].gather(1, target)[:, 0], rows[torch.float64].gather(1, target)[:, 0]
        errors += (low - exact).abs().tolist()
        agree += (rows[dtype].argmax(-1) == rows[torch.float64].argmax(-1)).tolist()
    return errors, agree


def summary(errors: list[float], agree: list[bool], k: float = 2.0) -> dict:
    ordered = sorted(errors)
    q99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return {"positions": len(errors), "top1_agreement": sum(agree) / len(agree),
            "mean": sum(errors) / len(errors), "median": ordered[len(ordered) // 2], "q99": q99,
            "max": ordered[-1],
            "max_over_q99": ordered[-1] / q99 if q99 > 0 else (1.0 if ordered[-1] == 0 else math.inf),
            "budget_max_rule": k * ordered[-1], "budget_floor_quantile_rule": k * q99}


def random_twin(checkpoint: Path, directory: Path, seed: int = 0) -> Path:
    """A checkpoint of `checkpoint`'s config with weights drawn by the zoo's scheme."""
    from safetensors.torch import save_file

    from reference.config import ModelConfig

    from .zoo import draw_weights

    raw = json.loads((checkpoint / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    save_file(draw_weights(ModelConfig.from_dict(raw), seed), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def markdown(rows: list[dict], dtype: str) -> str:
    lines = [f"The reference in {dtype} against fp64, teacher-forced (harness/measure_noise.py)", "",
             "| model | text | positions | top-1 | mean \\|Δ\\| | median | q99 | max | max / q99 | 2·max | 2·q99 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        s = r["summary"]
        lines.append(f"| {r['model']} | {r['text']} | {s['positions']} | {s['top1_agreement']:.1%} | {s['mean']:.3g} | "
                     f"{s['median']:.3g} | {s['q99']:.3g} | {s['max']:.3g} | {s['max_over_q99']:.1f} | "
                     f"{s['budget_max_rule']:.3g} | {s['budget_floor_quantile_rule']:.3g} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ordered = sorted(r["errors"])
        n = len(ordered)
        ax.plot(ordered, [1 - i / n for i in range(n)], label=r["model"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|Δ logprob| against fp64")
    ax.set_ylabel("share of positions with a larger error")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from .engine import parse_dtype

    p = argparse.ArgumentParser(prog="harness.measure_noise", description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--windows", type=int, default=8, help="sequences a model (default 8)")
    p.add_argument("--tokens", type=int, default=256, help="tokens a sequence (default 256)")
    p.add_argument("--random-twin", action="store_true", help="also each checkpoint's shape with random weights")
    p.add_argument("--out", type=Path, default=Path("out/noise"))
    a = p.parse_args(argv)
    dtype = parse_dtype(a.dtype)
    for c in a.checkpoints:
        if not (c / "config.json").is_file():
            p.error(f"{c}: no config.json (expected a checkpoint directory)")
    models = [(c.name, c, str(c)) for c in a.checkpoints]
    with tempfile.TemporaryDirectory() as scratch:
        if a.random_twin:
            models += [(f"{c.name} (random weights)", random_twin(c, Path(scratch) / c.name),
                        f"{c}'s config, weights drawn by harness/zoo.py (seed 0)") for c in a.checkpoints]
        rows = []
        for name, path, source in tqdm(models, desc="models", unit="model", delay=2):
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            sequences, text = texts(vocab, a.windows, a.tokens)
            errors, agree = position_errors(path, dtype, sequences)
            rows.append({"model": name, "checkpoint": source, "text": text, "summary": summary(errors, agree),
                         "errors": errors})
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"dtype": a.dtype, "torch": torch.__version__, "windows": a.windows, "tokens": a.tokens}
    (a.out / "noise.json").write_text(json.dumps({"meta": meta, "models": rows}))
    (a.out / "noise.md").write_text(markdown(rows, a.dtype))
    plot(rows, a.out / "noise.png")
    print(markdown(rows, a.dtype))
    print(f"wrote {a.out / 'noise.json'}, {a.out / 'noise.md'}, {a.out / 'noise.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
