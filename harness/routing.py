"""Routing near-ties: where a correct MoE engine may route a token to other experts than the fp64 oracle.

A GraniteMoeHybrid token goes to its top-k experts by router logit. When the k-th logit (the last expert chosen)
and the (k+1)-th (the best one left out) are closer than the candidate's dtype computes them, a correct engine may
choose either, and the expert it trades in adds a different SwiGLU's output, weighted about 1/k: a step in the
logprobs, not rounding. In bf16 the budget's twin (the reference in that dtype) trades experts at such ties as
often as any engine and its largest error already holds those steps; in fp32 it rarely does, and a single traded
expert can move a logprob a hundred times further than fp32 rounding does (measured on granite4h-small-2layer:
docs/scale.md). The judge then fails a correct engine at that position.

In 16-bit dtypes the twin's router error is so large (tiny-granite in bf16: 0.46, against fp32's 2.6e-6) that
most tokens are such ties (71% of the token-layers of four random prompts): there the budget, set by the twin's
own largest error, already spans the trades, and no allowance is computed. For a candidate in fp32 on a model
with routed experts, the budget of every position gets an allowance for each near-tie upstream of it:

1. The fp64 oracle and the reference in the candidate's dtype score each request's teacher-forced sequence in one
   piece, recording every MoE layer's router logits. The dtype's router error e is the largest |logit_d − logit_64|
   over every token, layer and expert of the workload.
2. A near-tie is a (request, layer, token) whose fp64 gap between the k-th and (k+1)-th logit is below k_tie · e
   (k_tie = the budget's k: as the budget allows k times the reference's largest error).
3. For each near-tie the oracle scores the sequence again with that one token's last chosen expert traded for the
   best one left out (reference.ops.moe_ref's swap). The allowance of position p is the sum, over near-ties, of
   |logprob_traded(p) − logprob(p)|: what any subset of those trades can move p, to first order.

Positions with no near-tie upstream keep their budget, so a bug in routing is still judged everywhere else. The
allowance is computed once per request and dtype (Oracle memoises it); its cost is two forwards per request plus
one per near-tie. MAX_TIES bounds the near-ties of one workload: a model whose routing that dtype cannot resolve
at more tokens than that is refused with a clear error rather than judged with a budget that is mostly allowance.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_TIES = 512


class RoutingTieError(RuntimeError):
    """Too many routing near-ties to judge the workload position by position."""


@dataclass
class RoutingTies:
    """A workload's routing near-ties in one dtype: the router error e, the threshold, the ties found
    ((sequence index, layer, token)) and each sequence's per-position allowance (row i: position i + 1)."""

    dtype: str
    router_error: float
    threshold: float
    ties: list[tuple[int, int, int]] = field(default_factory=list)
    allowance: list[list[float]] = field(default_factory=list)

    def describe(self) -> dict:
        return {"dtype": self.dtype, "router_error": self.router_error, "threshold": self.threshold,
                "ties": len(self.ties),
                "largest_allowance": max((a for row in self.allowance for a in row), default=0.0)}


def _recorded(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logprobs and each MoE layer's router logits (T, E) of one sequence scored in one piece."""
    model.router_record = {}
    try:
        logprobs = model.prompt_logprobs(ids).double().cpu()
        record = {layer: torch.cat(calls).double().cpu() for layer, calls in model.router_record.items()}
    finally:
        model.router_record = None
    return logprobs, record


@torch.no_grad()
def routing_ties(oracle_model, twin_model, sequences: Sequence[Sequence[int]], *, k: float,
                 threshold: float | None = None, max_ties: int = MAX_TIES) -> RoutingTies:
    """The near-ties of `sequences` (each a request's prompt and continuation) for a candidate in twin_model's dtype,
    and each sequence's allowance. oracle_model: the fp64 BambaReference; twin_model: the reference in the
    candidate's dtype. threshold: the gap below which a routing is a near-tie (default k · the twin's router error)."""
    cfg = oracle_model.cfg
    top_k = cfg.num_experts_per_tok
    ids = [torch.as_tensor(list(s), dtype=torch.long) for s in sequences]
    base, gaps, error = [], [], 0.0
    for seq in ids:
        logprobs, logits64 = _recorded(oracle_model, seq)
        _, logits_d = _recorded(twin_model, seq)
        for layer, value in logits64.items():
            error = max(error, float((logits_d[layer] - value).abs().max()))
        ranked = {layer: value.sort(dim=-1, descending=True).values for layer, value in logits64.items()}
        gaps.append({layer: r[:, top_k - 1] - r[:, top_k] for layer, r in ranked.items()})
        base.append(logprobs)
    limit = k * error if threshold is None else threshold
    ties = [(s, layer, int(t)) for s, by_layer in enumerate(gaps) for layer, gap in sorted(by_layer.items())
            for t in (gap[:-1] < limit).nonzero()[:, 0].tolist()]           # the last token's logits are not judged
    if len(ties) > max_ties:
        raise RoutingTieError(
            f"{len(ties)} routing near-ties (router logit gap below {limit:.3g}, {k:g} times the "
            f"{twin_model.dtype} reference's router error {error:.3g}) in {len(ids)} sequences: more than {max_ties}, "
            f"too many to judge position by position in this dtype; judge the model in another dtype")
    allowance = [torch.zeros_like(b) for b in base]
    for s, layer, token in ties:
        mask = torch.zeros(len(ids[s]), dtype=torch.bool, device=oracle_model.device)
        mask[token] = True
        oracle_model.route_swaps = {layer: mask}
        try:
            traded = oracle_model.prompt_logprobs(ids[s]).double().cpu()
        finally:
            oracle_model.route_swaps = {}
        moved = (traded - base[s]).abs()
        moved[:token] = 0.0     # causally untouched; the regrouped experts' fp64 rounding is all that differs there
        allowance[s] += moved
    return RoutingTies(str(twin_model.dtype).removeprefix("torch."), error, limit, ties,
                       [row.tolist() for row in allowance])
