"""How far granite4h-tiny-2layer's logprobs move when the one attention layer rotates q and k (the nope-given-rope
mutant), against the bf16 reference's own error, with the scale models' q/k draw and with q/k scaled by c."""
import json, sys, time, torch
from harness import scale
from harness.zoo import iter_weights
from reference.config import ModelConfig
from reference.model import BambaReference
torch.set_num_threads(1)
raw = scale.config_dict("granite4h-tiny-2layer")
cfg = ModelConfig.from_dict(raw)
rope_cfg = ModelConfig.from_dict({**raw, "position_embedding_type": "rope"})
print(cfg.attention_scale if hasattr(cfg, "attention_scale") else None, cfg.attn_head_dim, file=sys.stderr)
t = time.time()
w0 = dict(iter_weights(cfg, 0, ssm_scalars=scale.scale_ssm_scalars, dtype=torch.bfloat16))
print("drawn", time.time() - t, file=sys.stderr)
gen = torch.Generator().manual_seed(1)
prompts = torch.randint(0, cfg.vocab_size, (2, 160), generator=gen)
def lp(c, w, dtype):
    m = BambaReference(c, w, dtype=dtype)
    out = []
    for p in prompts:
        out.append(m.prompt_logprobs(p).double())
    del m
    return torch.cat(out)
res = {}
for qk in ([float(x) for x in sys.argv[1:]]          # gains to try; default: as drawn and (multiplier·√Dh)^-½
           or (1.0, float((cfg.attention_scale * cfg.attn_head_dim ** 0.5) ** -0.5))):
    w = {k: (v.float() * qk).to(torch.bfloat16) if (".q_proj." in k or ".k_proj." in k) else v for k, v in w0.items()}
    ref = lp(cfg, w, torch.float64); twin = lp(cfg, w, torch.bfloat16)
    mut = lp(rope_cfg, w, torch.float64); mut16 = lp(rope_cfg, w, torch.bfloat16)
    e = (twin - ref).abs(); d = (mut - ref).abs(); m16 = (mut16 - ref).abs()
    r = {"qk_scale": qk, "twin_max": e.max().item(), "twin_q99": e.quantile(.99).item(), "twin_mean": e.mean().item(),
         "effect_fp64_max": d.max().item(), "effect_fp64_mean": d.mean().item(),
         "mutant_bf16_max": m16.max().item(), "mutant_bf16_max_over_2E": m16.max().item() / (2 * e.max().item()),
         "top1_twin": None}
    res[str(qk)] = r; print(json.dumps(r), flush=True)
