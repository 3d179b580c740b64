"""Decode throughput of the vendored engine with and without CUDA graphs.

For each model, batch size and mode (graphs on / off) an engine is built with max_num_seqs = batch, `batch` prompts
of PROMPT_TOKENS tokens are prefilled in one step, a few decode steps warm up, then `--steps` decode steps are timed:
- engine tokens/s: whole engine steps (scheduling, the forward, each row's log-softmax, top-k and greedy choice,
  the results read back);
- forward tokens/s: the decode forward alone as a step runs it (inputs written to the device, the model run; with
  graphs, the padded buffers filled and a graph of the step without its ranking replayed), repeated on one step's
  pieces. The ranking is engine work: it counts in the engine's time, not the forward's.
Models: `tiny` (fixtures/tiny-bamba) and `bamba9b-2layer` (random weights, one mamba and one attention layer at
Bamba-9B widths: D 4096, H 128 × P 64, N 128, G 1, Hq 32 / Hkv 8 × Dh 128, MLP 14336, V 128256).

    python -m bench.decode                           # on CUDA: both models, batches 1, 8, 64, 256, bf16
    python -m bench.decode --models tiny --batch-sizes 1,8 --steps 4     # a CPU smoke run (no capture there)

The bound beside each row: a decode step must read every weight once (the embedding only for its `batch` rows),
so at the device's copy rate (bytes read + written per second of a 1 GiB device-to-device copy, measured in the same
run, as bench/kernels.py defines it) it takes at least weight bytes / copy rate; "of bound" is that time over the
measured forward. K/V cache and SSM state reads come on top (a few MB at these lengths) and are left out.
The anchor (unless --no-transformers): transformers' `generate` on the same model, prompts and batch sizes in the
same process, with the engine's best tokens/s over it.

Writes decode.json, decode.md and decode.png (when matplotlib is there) to --out (default out/bench).
On a CPU nothing is captured: "graphs on" is the same padded step run eagerly, so the numbers only show its cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from harness.cli import prepare_environment

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "fixtures" / "tiny-bamba"
PROMPT_TOKENS = 16
WARMUP_STEPS = 3

BAMBA_9B_SLICE = dict(
    architectures=["BambaForCausalLM"], model_type="bamba", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=32,
    num_key_value_heads=8, mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def write_random_slice(directory: Path, config: dict, *, device: str, seed: int = 0) -> Path:
    """A checkpoint of `config` with random bf16 weights under Hugging Face key names (weights drawn on `device`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    D, V, I = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    H, P, G, N, W = (config[k] for k in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                                         "mamba_d_conv"))
    Hq, Hkv = config["num_attention_heads"], config["num_key_value_heads"]
    Dh, C = D // Hq, H * P + 2 * G * N

    def normal(*shape, std=0.02):
        return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    def uniform(n, lo, hi):
        return (torch.rand(n, generator=gen, device=device) * (hi - lo) + lo).cpu()

    tensors = {"model.embed_tokens.weight": normal(V, D), "lm_head.weight": normal(V, D),
               "model.final_layernorm.weight": torch.ones(D, dtype=torch.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        tensors[p + "pre_ff_layernorm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            tensors[p + f"feed_forward.{name}.weight"] = normal(*shape)
        if i in config["attn_layer_indices"]:
            for name, rows in (("q_proj", Hq * Dh), ("k_proj", Hkv * Dh), ("v_proj", Hkv * Dh)):
                tensors[p + f"self_attn.{name}.weight"] = normal(rows, D)
            tensors[p + "self_attn.o_proj.weight"] = normal(D, Hq * Dh)
            continue
        dt = uniform(H, math.log(1e-3), math.log(1e-1)).exp()
        tensors.update({
            p + "mamba.in_proj.weight": normal(H * P + C + H, D),
            p + "mamba.conv1d.weight": normal(C, 1, W, std=0.2),
            p + "mamba.conv1d.bias": torch.zeros(C, dtype=torch.bfloat16),
            p + "mamba.out_proj.weight": normal(D, H * P),
            p + "mamba.norm.weight": torch.ones(H * P, dtype=torch.bfloat16),
            p + "mamba.A_log": uniform(H, 1.0, 16.0).log(),
            p + "mamba.D": torch.ones(H),
            p + "mamba.dt_bias": dt + torch.log(-torch.expm1(-dt)),                    # softplus⁻¹(dt)
        })
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def copy_rate(device: torch.device, n_bytes: int | None = None, repeats: int = 10) -> float:
    """Bytes moved (read + written) per second by the best of `repeats` copies of an n_bytes device buffer."""
    n_bytes = n_bytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.ones(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n_bytes / best


def weight_bytes_per_step(checkpoint: Path, dtype: torch.dtype, batch: int) -> int:
    """The bytes of weights one decode step of `batch` rows reads: every tensor in `dtype` (the SSM scalars A_log,
    D and dt_bias at most in fp32 too), the embedding only for its `batch` rows unless it is also the head."""
    from reference.checkpoint import expected_shapes
    from reference.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((Path(checkpoint) / "config.json").read_text()))
    total = 0
    for key, shape in expected_shapes(cfg).items():
        count = math.prod(shape)
        if key == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            count = batch * cfg.hidden_size
        total += count * dtype.itemsize
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(checkpoint: Path, *, batch: int, graphs: bool, steps: int, dtype: str, device: str,
            rate: float | None = None, batch_invariant: bool = False) -> dict:
    """Tokens/s of `steps` decode steps at this batch size (engine and forward alone), and the weight-read bound
    at copy rate `rate` (bytes/s) where given; `batch_invariant`: the engine's batch-invariant mode
    (bench/invariant_cost.py)."""
    from vendored.engine import LLMEngine          # after prepare_environment: the interpreter where no CUDA

    engine = LLMEngine(checkpoint, dtype=dtype, device=device, max_num_seqs=batch,
                       max_num_batched_tokens=batch * PROMPT_TOKENS,
                       max_model_len=PROMPT_TOKENS + WARMUP_STEPS + 2 * steps + 2, cuda_graphs=graphs,
                       batch_invariant=batch_invariant)
    try:
        vocab = engine.cfg.vocab_size
        for i in range(batch):
            prompt = [(7 * i + 3 * t + 1) % vocab for t in range(PROMPT_TOKENS)]
            engine.add_request(f"b{i}", prompt, max_new_tokens=WARMUP_STEPS + 2 * steps + 1, top_k=1)
        for _ in range(1 + WARMUP_STEPS):                                  # the prefill step, then warm-up decodes
            engine.step()
        dev = engine.device
        _sync(dev)
        gc.collect()             # the earlier measurements' garbage is not this one's to collect
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(dev)
        engine_s = time.perf_counter() - start

        engine._settle()                                          # the step run ahead read back: tokens on the host
        pieces = engine.scheduler.schedule()                               # the next step's decodes, run repeatedly
        assert len(pieces) == batch and all(p.is_decode for p in pieces), "the benchmark step is not all decodes"
        if graphs and engine.graphs.handles(pieces):
            def forward():
                return engine.graphs.forward_only(pieces)
        else:
            def forward():
                return engine.model.forward(engine._build_batch(pieces)[0], engine.states, engine.kv)
        forward()
        _sync(dev)
        start = time.perf_counter()
        for _ in range(steps):
            forward()
        _sync(dev)
        forward_s = time.perf_counter() - start
        row = dict(batch=batch, cuda_graphs=graphs, captured=bool(graphs and engine.graphs.replays),
                   steps=steps, engine_step_ms=1e3 * engine_s / steps, engine_tokens_per_s=batch * steps / engine_s,
                   forward_ms=1e3 * forward_s / steps, forward_tokens_per_s=batch * steps / forward_s)
        if rate:
            n_bytes = weight_bytes_per_step(checkpoint, engine.dtype, batch)
            row.update(weight_bytes=n_bytes, bound_ms=1e3 * n_bytes / rate)
            row["forward_of_bound"] = row["bound_ms"] / row["forward_ms"]
        return row
    finally:
        engine.close()             # frees its GPU memory now: the next measurement starts from the same state


def measure_transformers(checkpoint: Path, *, batch: int, steps: int, dtype: str, device: str) -> dict:
    """The user's alternative on the same model, same prompts: transformers' `generate` (greedy, its cache, its
    PyTorch path) for `steps` new tokens after a warm-up call; tokens/s over the decode part (the time of a one-token
    generate, which is the prefill, is subtracted). Out of memory is recorded, not raised."""
    from transformers import BambaForCausalLM

    dev = torch.device(device)
    try:
        model = BambaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(dev).eval()
        vocab = model.config.vocab_size
        prompts = torch.tensor([[(7 * i + 3 * t + 1) % vocab for t in range(PROMPT_TOKENS)] for i in range(batch)],
                               device=dev)                                                   # (batch, T)
        kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))

        def run(new_tokens: int) -> float:
            _sync(dev)
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            _sync(dev)
            return time.perf_counter() - start

        run(2)                                                                               # warm-up
        prefill_s, total_s = run(1), run(steps + 1)
        decode_s = max(total_s - prefill_s, 1e-9)
        return dict(batch=batch, steps=steps, hf_step_ms=1e3 * decode_s / steps,
                    hf_tokens_per_s=batch * steps / decode_s)
    except torch.OutOfMemoryError as err:
        return dict(batch=batch, steps=steps, hf_error=f"out of memory: {str(err).splitlines()[0][:120]}")
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | graphs | engine tok/s | forward tok/s | forward ms/step | forward speed-up | "
             "bound ms/step | forward of bound |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    off = {(r["model"], r["batch"]): r for r in rows if not r["cuda_graphs"]}
    for r in rows:
        base = off.get((r["model"], r["batch"]))
        gain = f"{base['forward_ms'] / r['forward_ms']:.2f}×" if r["cuda_graphs"] and base else ""
        mode = ("on" if r["captured"] else "on (eager, no CUDA)") if r["cuda_graphs"] else "off"
        bound = (f"{r['bound_ms']:.3f} | {r['forward_of_bound']:.0%}" if "bound_ms" in r else " | ")
        lines.append(f"| {r['model']} | {r['batch']} | {mode} | {r['engine_tokens_per_s']:.4g} | "
                     f"{r['forward_tokens_per_s']:.4g} | {r['forward_ms']:.3f} | {gain} | {bound} |")
    return "\n".join(lines) + "\n"


def anchor_markdown(rows: list[dict], anchors: list[dict]) -> str:
    """transformers' generate beside the engine's best tokens/s (graphs on or off) on the same model and batch."""
    lines = ["| model | batch | transformers tok/s | engine tok/s | engine / transformers |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for a in anchors:
        mine = [r["engine_tokens_per_s"] for r in rows if (r["model"], r["batch"]) == (a["model"], a["batch"])]
        engine = max(mine) if mine else None
        theirs = a.get("hf_tokens_per_s")
        cells = [a.get("hf_error") or f"{theirs:.4g}", f"{engine:.4g}" if engine else "",
                 f"{engine / theirs:.3g}×" if engine and theirs else ""]
        lines.append(f"| {a['model']} | {a['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for graphs, offset in ((False, -0.2), (True, 0.2)):
            mine = [r for r in rows if r["model"] == model and r["cuda_graphs"] == graphs]
            ax.bar([i + offset for i in range(len(mine))], [r["forward_tokens_per_s"] for r in mine], width=0.4,
                   label="graphs on" if graphs else "graphs off")
            ax.set_xticks(range(len(mine)), [str(r["batch"]) for r in mine])
        ax.set_title(f"{model}: decode forward")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    prepare_environment()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if on_gpu else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--models", default="tiny,bamba9b-2layer" if on_gpu else "tiny")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave out the anchor: transformers' generate on the same model and batches")
    args = parser.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"tiny", "bamba9b-2layer"})
    if unknown:
        parser.error(f"--models: unknown {unknown}; expected tiny and/or bamba9b-2layer")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    rate = copy_rate(torch.device(args.device))
    with tempfile.TemporaryDirectory() as scratch:
        checkpoints = {"tiny": TINY}
        if "bamba9b-2layer" in models:
            checkpoints["bamba9b-2layer"] = write_random_slice(Path(scratch) / "bamba9b-2layer", BAMBA_9B_SLICE,
                                                                device=args.device)
        runs = [(m, b, g) for m in models for b in batches for g in (False, True)]
        for model, batch, graphs in tqdm(runs, desc="decode bench"):
            row = measure(checkpoints[model], batch=batch, graphs=graphs, steps=args.steps, dtype=dtype,
                          device=args.device, rate=rate)
            rows.append(dict(model=model, device=args.device, dtype=dtype, **row))
            if args.device == "cuda":
                torch.cuda.empty_cache()
        anchors = []
        if not args.no_transformers:
            for model, batch in tqdm([(m, b) for m in models for b in batches], desc="transformers anchor"):
                anchors.append(dict(model=model, **measure_transformers(checkpoints[model], batch=batch,
                                                                        steps=args.steps, dtype=dtype,
                                                                        device=args.device)))
    meta = dict(torch=torch.__version__, device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                prompt_tokens=PROMPT_TOKENS, warmup_steps=WARMUP_STEPS, copy_rate_bytes_per_s=rate)
    (out / "decode.json").write_text(json.dumps(dict(meta=meta, rows=rows, transformers=anchors), indent=1))
    table = markdown(rows)
    if anchors:
        table += "\ntransformers' generate on the same model, prompts and batch, in the same process:\n\n"
        table += anchor_markdown(rows, anchors)
    (out / "decode.md").write_text(f"Decode throughput ({meta['device_name']}, {dtype}, torch {meta['torch']}; copy "
                                   f"rate {rate / 1e12:.3g} TB/s)\n\n" + table)
    plotted = plot(rows, out / "decode.png")
    print(table)
    print(f"wrote {out / 'decode.json'}, {out / 'decode.md'}" + (f", {out / 'decode.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
