"""Does the nope-given-rope mutant show in bf16 on granite4h-tiny-2layer (the scale model as written, q/k gain
included) when the prompts are longer? For prompts of each length L: the bf16 reference's own error against fp64
(what the budget is set from) and the mutant's (the attention layer rotating q and k) in bf16 and in fp64, every
teacher-forced position. Run from the repository root: `python <this file> 160 640 1280 2048`."""
import json
import sys
import time

import torch

from harness import scale
from harness.zoo import iter_weights
from reference.config import ModelConfig
from reference.model import BambaReference

torch.set_num_threads(2)
NAME = "granite4h-tiny-2layer"
raw = scale.config_dict(NAME)
cfg = ModelConfig.from_dict(raw)
rope_cfg = ModelConfig.from_dict({**raw, "position_embedding_type": "rope"})
gain = scale.qk_gain(cfg)
weights = dict(iter_weights(cfg, 0, ssm_scalars=scale.scale_ssm_scalars, dtype=torch.bfloat16,
                            gain=lambda key: gain if key.endswith(("q_proj.weight", "k_proj.weight")) else 1.0))


def logprobs(c, prompt, dtype):
    model = BambaReference(c, weights, dtype=dtype)
    out = model.prompt_logprobs(prompt).double()
    del model
    return out


for length in [int(x) for x in sys.argv[1:]] or [160, 640, 1280, 2048]:
    t = time.time()
    prompt = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    ref = logprobs(cfg, prompt, torch.float64)
    twin = (logprobs(cfg, prompt, torch.bfloat16) - ref).abs()
    mut64 = (logprobs(rope_cfg, prompt, torch.float64) - ref).abs()
    mut16 = (logprobs(rope_cfg, prompt, torch.bfloat16) - ref).abs()
    tail = slice(length // 2, None)                       # the second half: positions far from the start
    row = {"length": length, "qk_gain": gain, "twin_mean": twin.mean().item(), "twin_max": twin.max().item(),
           "mutant_fp64_mean": mut64.mean().item(), "mutant_fp64_max": mut64.max().item(),
           "mutant_fp64_mean_second_half": mut64[tail].mean().item(),
           "mutant_bf16_mean": mut16.mean().item(), "mutant_bf16_max": mut16.max().item(),
           "mutant_bf16_max_over_2E": mut16.max().item() / (2 * twin.max().item()),
           "mutant_bf16_mean_over_twin_mean": mut16.mean().item() / twin.mean().item(),
           "seconds": round(time.time() - t, 1)}
    print(json.dumps(row), flush=True)
