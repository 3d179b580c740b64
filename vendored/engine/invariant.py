"""The engine's batch-invariant mode (LLMEngine(batch_invariant=True)): a request's logprobs and tokens are the same
bits whatever else shares its steps, however its prompt is cut into prefill pieces, after a preemption and its
recompute, and with decode steps replayed as CUDA graphs or run eagerly.

The default mode computes the same model, within rounding, but not the same bits: its GEMMs run over the whole
step, so a library may choose another kernel (another reduction order, a split of the inner dimension) for another
number of rows; its prefill attention reduces over the step's longest context; its decode attention splits the keys
by the batch size; and its scan cuts a prefill piece into chunks from the piece's first token, so a piece boundary
moves the chunk grid, and a recompute runs as a prefill the tokens that decode steps produced. The mode changes
exactly these:

- GEMMs (`linear`): the rows go through in tiles of GEMM_ROWS rows, zero-padded, one library call of the same shape
  per tile, so no kernel choice can depend on how many rows the step has and no row's reduction on its neighbours.
- Attention: every query row, prefill or decode, is a decode-attention row over its own context (its position + 1
  keys in the paged cache), launched with one split per row (vendored.ops.decode_attention, batch_invariant=True),
  so the keys are reduced tile by tile in order from position 0, whatever the batch and the table width.
- Mamba mixers: a prefill piece runs token by token through the decode kernels (causal_conv1d_update,
  selective_state_update), the recurrence the scan computes in chunks, so a piece boundary or a recompute changes
  nothing: every token of a request meets the same arithmetic in every schedule.
- The element-wise and norm ops run as the Triton kernels on the CPU too (one row per reduction), as on a GPU.
- Sampling is already per request: seeded by the request's seed and the position of the token it draws.

What it costs (a sequential prefill, one split per decode row, tiled GEMMs) is measured in docs/engine.md. Tensor
and pipeline parallelism are refused in this mode: a cross-rank sum's order is the collective library's choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows a GEMM takes at a time in batch-invariant mode: every call has this many rows (the last tile zero-padded).
GEMM_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (n, K) whose row i does not depend on n or on the other rows: the rows in
    contiguous tiles of GEMM_ROWS (the last zero-padded), one call of the same shape each."""
    n = x.shape[0]
    pad = (-n) % GEMM_ROWS
    rows = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    if n == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(tile, weight, bias) for tile in rows.split(GEMM_ROWS)])[:n]


def token_steps(cu_seqlens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For prefill pieces packed at offsets cu_seqlens (n+1,): one entry per token index j of the longest piece,
    (rows, pieces): the packed rows holding each piece's j-th token and the indices of those pieces, both int64 on
    the CPU, in piece order."""
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.long)
    lengths = torch.tensor(cu_seqlens[1:], dtype=torch.long) - starts
    steps = []
    for j in range(int(lengths.max()) if len(lengths) else 0):
        pieces = (lengths > j).nonzero()[:, 0]
        steps.append((starts[pieces] + j, pieces))
    return steps
