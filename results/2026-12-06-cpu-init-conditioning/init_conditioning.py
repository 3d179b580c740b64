"""Does a better-conditioned random draw make random weights err in bf16 as trained ones do?

For tiny-bamba's and deep-bamba's configs: the trained checkpoint, its random twin drawn by the zoo's scheme
(harness/zoo.py), and the zoo's draw changed one way at a time and then together (DRAWS):
- depth-scaled: every residual branch's output projection (mamba out_proj, attention o_proj, MLP down_proj)
  multiplied by 1/sqrt(2 L), L the layer count (the depth-scaled initialisation of deep pre-norm transformers);
- narrow inputs: the projections into the mixers and the MLP that are not q and k (mamba in_proj, gate_proj,
  up_proj, v_proj) times 0.5;
- conditioned: both of these, which keep what the scale models draw for the judge's sake (slow-decaying SSM
  heads, peaked attention, a peaked output distribution);
- fast decay only: every SSM head's |A| in [1, 8] (no slow heads: the state forgets within a few tokens);
- head x 0.5: the output head halved (flatter output distributions);
- all: conditioned, fast decay only and head x 0.5 together. Each runs as the fp64 oracle and the bf16 reference on 16 held-out windows of 256 tokens
(harness/measure_noise.py's measurement), with the fp64 model's mean top-1/top-2 logprob margin and the final
residual stream's RMS beside it. CPU, about 10 minutes. Writes init.json and init.md here.

    .venv/bin/python results/2026-12-06-cpu-init-conditioning/init_conditioning.py
"""
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from harness.measure_noise import position_errors, summary, texts  # noqa: E402
from harness.zoo import iter_weights, zoo_ssm_scalars  # noqa: E402
from reference.config import ModelConfig  # noqa: E402
from reference.model import BambaReference  # noqa: E402

BRANCH_OUTPUTS = ("mamba.out_proj.weight", "self_attn.o_proj.weight", "feed_forward.down_proj.weight")
BRANCH_INPUTS = ("mamba.in_proj.weight", "feed_forward.gate_proj.weight", "feed_forward.up_proj.weight",
                 "self_attn.v_proj.weight")


def fast_decay(key, shape, gen, device):
    if key.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=gen, device=device) * 7.0 + 1.0)
    return zoo_ssm_scalars(key, shape, gen, device)


def gains(layers: int, depth=False, narrow=False, head=False):
    def gain(key: str) -> float:
        g = 1.0
        if depth and key.endswith(BRANCH_OUTPUTS):
            g *= (2 * layers) ** -0.5
        if narrow and key.endswith(BRANCH_INPUTS):
            g *= 0.5
        if head and key == "lm_head.weight":
            g *= 0.5
        return g
    return gain


def draws(layers: int) -> dict:
    return {
        "zoo": {},
        "depth-scaled": {"gain": gains(layers, depth=True)},
        "narrow inputs": {"gain": gains(layers, narrow=True)},
        "conditioned": {"gain": gains(layers, depth=True, narrow=True)},
        "fast decay only": {"ssm_scalars": fast_decay},
        "head x 0.5": {"gain": gains(layers, head=True)},
        "all": {"ssm_scalars": fast_decay, "gain": gains(layers, depth=True, narrow=True, head=True)},
    }


def draw(raw: dict, directory: Path, **how) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    weights = dict(iter_weights(ModelConfig.from_dict(raw), 0, **how))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def fp64_stats(path: Path, sequences) -> dict:
    """Mean margin between the fp64 model's two most likely next tokens, and the RMS of the last residual stream."""
    import reference.model as rm

    model = BambaReference.from_pretrained(path, dtype=torch.float64)
    margins, rms, seen = [], [], {}
    plain = rm.rms_norm_ref

    def recording(x, *args, **kwargs):                      # the last call of a forward is the final norm's
        seen["x"] = x
        return plain(x, *args, **kwargs)

    rm.rms_norm_ref = recording
    try:
        for ids in sequences:
            logits = model.forward(torch.tensor(ids))[0]
            top = torch.log_softmax(logits.double(), -1).topk(2, -1).values
            margins += (top[:, 0] - top[:, 1]).tolist()
            rms.append(seen["x"].double().pow(2).mean().sqrt().item())
    finally:
        rm.rms_norm_ref = plain
    return {"mean_top2_margin": sum(margins) / len(margins), "final_residual_rms": sum(rms) / len(rms)}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for fixture in ("tiny-bamba", "deep-bamba"):
            ckpt = ROOT / "fixtures" / fixture
            raw = json.loads((ckpt / "config.json").read_text())
            layers = raw["num_hidden_layers"]
            models = [(f"{fixture} (trained)", ckpt, "trained")]
            for kind, how in draws(layers).items():
                directory = Path(scratch) / f"{fixture}-{kind.replace(' ', '-')}"
                models.append((f"{fixture}'s shape, {kind}", draw(raw, directory, **how), kind))
            sequences, text = texts(raw["vocab_size"], 16, 256)
            for name, path, kind in models:
                errors, agree = position_errors(path, torch.bfloat16, sequences)
                row = {"model": name, "fixture": fixture, "layers": layers, "draw": kind, "text": text,
                       **summary(errors, agree), **fp64_stats(path, sequences)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"torch": torch.__version__, "windows": 16, "tokens": 256, "dtype": "bfloat16", "seed": 0}
    (HERE / "init.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| model | layers | top-1 | mean \\|Δ\\| | q99 | max | max / q99 | fp64 top-2 margin | final residual RMS |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layers']} | {r['top1_agreement']:.1%} | {r['mean']:.3g} | {r['q99']:.3g} | "
                     f"{r['max']:.3g} | {r['max_over_q99']:.1f} | {r['mean_top2_margin']:.3g} | {r['final_residual_rms']:.3g} |")
    (HERE / "init.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
