"""Bit-for-bit comparison of one engine's results for the same requests under two configurations (the `invariance`
scenario; harness/runner.py, check_invariance, runs the configurations and judges the baseline against the oracle).

Why exact equality and not a budget: an engine that promises batch invariance promises that a request's bits do not
depend on what shares its batch, how its prefill is cut into pieces or whether it was preempted and recomputed. A
difference of one unit in the last place anywhere breaks that promise (and downstream, where a sampler or a
threshold reads the numbers, turns into different text), so there is no tolerance to calibrate. What is compared,
for each request and each position (row i predicts position i+1: prompt rows, then generated rows), in FIELDS order:
the token (the generated one at a generated position; the prompt's own at a prompt position, which cannot differ),
its logprob, the top-k ids and their logprobs, and the full log-softmax row where both runs return one. Two values
are equal when they compare equal (float64 tensors: `==`, so -0.0 equals 0.0) or are both NaN; a NaN against a
number is a difference. The first difference is the first request in the workload's order that differs, its
earliest differing position, and at that position the first differing field in FIELDS order (and its first
differing top-k rank or token id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .engine import Request, RequestResult

FIELDS = ("token", "logprob", "top ids", "top logprobs", "distribution")


@dataclass(frozen=True)
class Difference:
    """The first place where one request's results under the configuration `other` differ from those under
    `baseline`. position: 1..T+n-1 (0: the result as a whole: missing, or of another shape); where: "prompt",
    "generated step s" (0-based) or "result"; field: one of FIELDS, "result" (missing) or "shape"; index: the top-k
    rank (top ids, top logprobs) or the token id (distribution) that differs first, else None."""

    request_id: str
    position: int
    where: str
    field: str
    baseline: str
    other: str
    baseline_value: object
    other_value: object
    index: int | None = None

    def detail(self) -> str:
        """What differs, with both values (floats as repr, and their difference): the text after a Failure's
        "request ... position ... (where):" head."""
        what = self.field
        if self.index is not None:
            what += f" at rank {self.index}" if self.field.startswith("top") else f" of token {self.index}"
        values = f"{self.baseline} {self.baseline_value!r}, {self.other} {self.other_value!r}"
        if isinstance(self.baseline_value, float) and isinstance(self.other_value, float):
            values += f", difference {self.other_value - self.baseline_value!r}"
        return f"{what} differs between configurations {self.baseline} and {self.other}: {values}"

    def message(self) -> str:
        return f"request {self.request_id!r} position {self.position} ({self.where}): {self.detail()}"

    def to_dict(self) -> dict:
        return asdict(self) | {"message": self.message()}


def _rows(request: Request, result: RequestResult) -> dict[str, torch.Tensor | None]:
    """Per FIELDS, the result's per-position array over positions 1..T+n-1 (row i: position i+1)."""
    dists = None
    if result.prompt_dists is not None and result.output_dists is not None:
        dists = torch.cat([result.prompt_dists, result.output_dists])
    return {"token": torch.tensor(list(request.prompt[1:]) + [int(t) for t in result.output_ids], dtype=torch.long),
            "logprob": result.sequence_logprobs(),
            "top ids": torch.cat([result.prompt_top_ids, result.output_top_ids]),
            "top logprobs": torch.cat([result.prompt_top_logprobs, result.output_top_logprobs]),
            "distribution": dists}


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: True where a and b differ (floating point: not ==, unless both NaN)."""
    if a.is_floating_point() or b.is_floating_point():
        return ~((a == b) | (a.isnan() & b.isnan()))
    return a != b


def _value(tensor: torch.Tensor, row: int, index: int | None):
    item = tensor[row] if index is None else tensor[row, index]
    return float(item) if tensor.is_floating_point() else int(item)


def first_difference(requests: Sequence[Request], baseline: Sequence[RequestResult],
                     other: Sequence[RequestResult], *, baseline_name: str, other_name: str) -> Difference | None:
    """The first difference (module docstring) between two runs' results of `requests` (matched by request_id; any
    other results, a configuration's neighbours', are ignored), or None when they are bit-identical."""
    base = {r.request_id: r for r in baseline}
    cand = {r.request_id: r for r in other}
    names = dict(baseline=baseline_name, other=other_name)
    for req in requests:
        rid = req.request_id
        if rid not in base or rid not in cand:
            return Difference(rid, 0, "result", "result", baseline_value="a result" if rid in base else "none",
                              other_value="a result" if rid in cand else "none", **names)
        found = _first_in_request(req, base[rid], cand[rid], names)
        if found is not None:
            return found
    return None


def _first_in_request(req: Request, base_result: RequestResult, cand_result: RequestResult,
                      names: dict) -> Difference | None:
    T = len(req.prompt)
    a_rows, b_rows = _rows(req, base_result), _rows(req, cand_result)

    def where(row: int) -> str:
        return "prompt" if row + 1 < T else f"generated step {row + 1 - T}"

    firsts: dict[str, tuple[int, int | None]] = {}          # field -> (row, index) of its first difference
    for name in FIELDS:
        a, b = a_rows[name], b_rows[name]
        if a is None or b is None:
            continue                                        # full rows only where both runs return them
        if a.shape[1:] != b.shape[1:]:
            return Difference(req.request_id, 0, "result", "shape", baseline_value=tuple(a.shape),
                              other_value=tuple(b.shape), **names)
        common = min(len(a), len(b))
        mask = differs(a[:common], b[:common])
        bad_rows = mask.reshape(common, -1).any(dim=1).nonzero()
        if len(bad_rows):
            row = int(bad_rows[0, 0])
            index = int(mask[row].nonzero()[0, 0]) if mask.dim() > 1 else None
            firsts[name] = (row, index)
        elif len(a) != len(b):                              # the common rows agree; one run has more of them
            firsts[name] = (common, None)
    if not firsts:
        return None
    row = min(r for r, _ in firsts.values())
    name = next(f for f in FIELDS if f in firsts and firsts[f][0] == row)
    index = firsts[name][1]
    a, b = a_rows[name], b_rows[name]
    if row >= len(a) or row >= len(b):
        return Difference(req.request_id, row + 1, where(row), "shape",
                          baseline_value=f"{len(a)} positions", other_value=f"{len(b)} positions", **names)
    return Difference(req.request_id, row + 1, where(row), name, baseline_value=_value(a, row, index),
                      other_value=_value(b, row, index), index=index, **names)
