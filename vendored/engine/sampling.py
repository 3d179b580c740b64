"""Seeded sampling of a next token, reproducible whatever the batch, the schedule or the device.

A request that samples gives a temperature T > 0 and a seed. Its token at position p is

    argmax_v  logits_v + T · g(seed, p, v),     g = -log(-log(u)),  u = (hash(seed, p, v) + 0.5) / 2^32

the Gumbel-max form of drawing from softmax(logits / T): the noise is a pure function of (seed, position, token id)
(a 32-bit integer mix, no generator state), so the same logits give the same token in any batch, after preemption
and recomputation, and on any device. The noise and the sum are computed in float64. The token's logprob the engine
returns is that of the model's own distribution (T plays no part), as engines report sampled tokens' logprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0 (finite); seed: any int (only its low 32 bits count)."""

    temperature: float
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"temperature: expected a finite number > 0, got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift / multiply rounds) on int64 tensors holding values below 2^32; the
    multipliers are below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x4B3A9C5D) & _MASK
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n, vocab_size) float64 Gumbel noise of rows (seeds[i], positions[i]) (int64 (n,) each) at every token id."""
    row = _mix((_mix(seeds & _MASK) + positions * 0x9E3779B1) & _MASK)                  # (n,)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _mix((row[:, None] + ids[None, :] * 0x85EBCA77) & _MASK)                       # (n, V)
    u = (bits.double() + 0.5) / 2.0**32
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """The sampled token id (n,) int64 of each row of logits (n, V) at temperatures (n,), seeds and positions (n,)
    (the position the token will take in its sequence). A NaN logit is never chosen unless the whole row is NaN."""
    noise = gumbel_noise(seeds, positions, logits.shape[-1])
    scores = logits.double() + temperatures.double()[:, None] * noise
    return torch.nan_to_num(scores, nan=-math.inf).argmax(dim=-1)
