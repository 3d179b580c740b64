"""Helpers shared by the tests: random Bamba checkpoints that transformers and the oracle both load from disk."""

from __future__ import annotations

import math
from pathlib import Path

import torch

TINY_CONFIG = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, rms_norm_eps=1e-5,
    max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
)


def random_bamba_checkpoint(directory: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised BambaForCausalLM (transformers) to `directory` and return it.

    Weights are drawn with initializer_range 0.2 (logits peaked enough for comparisons to mean something), and the
    mixer's scalars that transformers initialises to constants (A_log, D, dt_bias, norm weights, conv bias) are
    randomised too so that no per-head mix-up can hide behind equal values.
    """
    from transformers import BambaConfig, BambaForCausalLM

    fields = {**TINY_CONFIG, **overrides}
    rope = fields.pop("rope_parameters", None)
    cfg = BambaConfig(**fields, **({"rope_parameters": rope} if rope else {}))
    torch.manual_seed(seed)
    model = BambaForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(param.shape, generator=gen) * 7.0 + 0.5))
            elif name.endswith("dt_bias"):
                param.copy_(torch.rand(param.shape, generator=gen) * 3.0 - 2.5)
            elif name.endswith(".D"):
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif name == "lm_head.weight":
                # 3x the other weights: logits with a spread of a few nats, so next-token choices are clear
                param.copy_(3 * cfg.initializer_range * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(cfg.initializer_range * torch.randn(param.shape, generator=gen))
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def unclamped_delta(monkeypatch, ref, tokens) -> torch.Tensor:
    """Δ = softplus(dt + dt_bias) before the time_step_limit clamp, over every mamba layer, head and token of one
    forward of the reference `ref` on `tokens` (the scan is wrapped for the call: monkeypatch undoes it)."""
    import torch.nn.functional as F

    import reference.model

    seen = []
    real_scan = reference.model.ssd_scan_ref

    def spy(x, dt, *args, dt_bias, **kwargs):
        seen.append(F.softplus(dt + dt_bias).flatten())
        return real_scan(x, dt, *args, dt_bias=dt_bias, **kwargs)

    monkeypatch.setattr(reference.model, "ssd_scan_ref", spy)
    ref.forward(tokens)
    return torch.cat(seen)
