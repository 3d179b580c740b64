"""Top-k with a defined tie rule: among equal values the lower index ranks first.

`torch.topk` leaves the order of equal values unspecified, and on CUDA which of several tied values makes the cut
at the k-th place can change from run to run. Ties are common where it matters: bf16 logits of a 128K vocabulary
hold many equal values, and a greedy choice or a returned top-k set that depends on the run makes two runs of the
same engine differ (and a router that picks experts so makes the engine disagree with the oracle's rule).
"""

from __future__ import annotations

import torch

SORT_WIDTH = 1024    # rows at most this wide are ranked with one stable sort (router logits: no host sync, graph-safe)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x (..., V), largest first, ties by lower index.

    Rows up to SORT_WIDTH wide: a stable descending sort (no host synchronisation, safe inside a captured graph).
    Wider rows: torch.topk for k + 1, the k kept re-ordered by (value, index); only rows whose k-th and (k+1)-th
    values tie are ranked again exactly, which needs one host synchronisation (not for use inside a graph).
    """
    width = x.shape[-1]
    if not 0 <= k <= width:
        raise ValueError(f"top_k: k={k} for rows of width {width}")
    if width <= SORT_WIDTH or k == width:
        ranked = torch.sort(x, dim=-1, descending=True, stable=True)
        return ranked.values[..., :k], ranked.indices[..., :k]
    flat = x.reshape(-1, width)
    values, indices = torch.topk(flat, k + 1, dim=-1)
    boundary_tie = values[:, k - 1] == values[:, k] if k > 0 else torch.zeros_like(values[:, 0], dtype=torch.bool)
    values, indices = _by_value_then_index(values[:, :k], indices[:, :k])
    rows = boundary_tie.nonzero()[:, 0]
    if rows.numel():
        ranked = torch.sort(flat[rows], dim=-1, descending=True, stable=True)
        values[rows], indices[rows] = ranked.values[:, :k], ranked.indices[:, :k]
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


def _by_value_then_index(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-order each row's k pairs: value descending, then index ascending (two stable sorts, the last key first)."""
    order = torch.sort(indices, dim=-1, stable=True).indices
    values, indices = values.gather(-1, order), indices.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), indices.gather(-1, order)
