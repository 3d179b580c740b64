"""How peaked the attention of trained and random-weight models is: for every attention layer, head and query with at
least 16 keys it may attend to, the entropy of its attention over log(number of keys) (1: uniform), and the largest
weight. Trained tiny models on the fixture prompts; random twins (the zoo's draw, harness/zoo.py) and the Granite
scale model on random ids; the Granite scale model also with its q/k weights multiplied by a gain.

    python results/2026-12-06-cpu-attention-sharpness/attention_sharpness.py > attention_sharpness.jsonl
"""
import json, math, sys
import torch
import reference.model as rm
from harness import scale
from harness.zoo import iter_weights
from reference.checkpoint import load_checkpoint
from reference.config import ModelConfig
from reference.ops import gqa_attention_ref

torch.set_num_threads(1)
records = []


def recording(q, k, v, *, scale):
    t_q, n_q, dh = q.shape
    t_k, n_kv = k.shape[0], k.shape[1]
    g = q.reshape(t_q, n_kv, n_q // n_kv, dh)
    s = torch.einsum("qkgd,tkd->kgqt", g, k).double() * scale
    qpos = torch.arange(t_k - t_q, t_k)
    allowed = torch.arange(t_k)[None, :] <= qpos[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    n = allowed.sum(-1)                                               # (Lq,)
    keep = n >= 16
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)     # (Hkv, G, Lq)
    records.append(((ent / n.double().log())[..., keep].flatten(), p.amax(-1)[..., keep].flatten(),
                    s.masked_fill(~allowed, float("nan"))[..., keep, :]))
    return gqa_attention_ref(q, k, v, scale=scale)


rm.gqa_attention_ref = recording


def measure(name, cfg, weights, prompts, **extra):
    records.clear()
    model = rm.BambaReference(cfg, weights, dtype=torch.float64)
    for p in prompts:
        model.prompt_logprobs(torch.tensor(p))
    ent = torch.cat([r[0] for r in records]); top = torch.cat([r[1] for r in records])
    sd = [float(torch.nanmean((r[2] - torch.nanmean(r[2], -1, keepdim=True)) ** 2, -1).sqrt().mean()) for r in records]
    row = {"model": name, **extra, "queries": int(ent.numel()), "entropy_over_log_n_mean": float(ent.mean()),
           "entropy_over_log_n_q10": float(ent.quantile(0.1)), "max_weight_mean": float(top.mean()),
           "score_sd_mean": sum(sd) / len(sd)}
    print(json.dumps(row), flush=True)


fixture_prompts = [json.loads(l)["token_ids"] for l in open("fixtures/prompts.jsonl")]
for name in ("tiny-bamba", "tiny-granite", "deep-bamba"):
    raw = json.load(open(f"fixtures/{name}/config.json"))
    cfg = ModelConfig.from_dict(raw)
    long = [p for p in fixture_prompts if len(p) >= 48 and max(p) < cfg.vocab_size][:8]
    measure(name, cfg, load_checkpoint(f"fixtures/{name}")[1], long, kind="trained")
    measure(name, cfg, dict(iter_weights(cfg, 0)), long, kind="random (zoo draw)")
raw = scale.config_dict("granite4h-tiny-2layer")
cfg = ModelConfig.from_dict(raw)
w0 = dict(iter_weights(cfg, 0, ssm_scalars=scale.scale_ssm_scalars, dtype=torch.bfloat16))
ids = torch.randint(0, cfg.vocab_size, (2, 160), generator=torch.Generator().manual_seed(1)).tolist()
for gain in [float(x) for x in sys.argv[1:]] or (1.0, 3.36, 6.0):
    w = {k: (v.float() * gain).to(torch.bfloat16) if (".q_proj." in k or ".k_proj." in k) else v for k, v in w0.items()}
    measure("granite4h-tiny-2layer", cfg, w, ids, kind="random (scale draw)", qk_gain=gain)
