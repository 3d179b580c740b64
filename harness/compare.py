"""How a candidate is judged against a baseline: the fp64 oracle, or the same engine in another configuration.

Every position is compared (docs/design.md §4): the teacher-forced prompt logprobs at positions 1..T-1 and the
logprob of every generated token, not only top-k containment and not only up to the first divergence.

The budget. A candidate computing in dtype d may differ from the fp64 oracle by at most
    budget = k · E(d) + atol(d)          (k = 2 by default)
at every position, where E(d) is the error of the reference itself run in d: the largest |ref_d − ref_fp64| over
every position of the scenario's requests (prompts and oracle continuations, teacher-forced).
Why one max over the whole workload: the error of one position is no scale at all — it is ~0 wherever the rounding
happens to cancel, and a per-position budget would reject a correct engine there. The error level of a dtype is a
property of the model and the dtype, and the max over a request's 5-30 positions is still a noisy sample of it:
measured on 5 random G = 1 checkpoints (tests/helpers.py, seeds 0-4) × 3 workloads, transformers' largest error on a
request reached 2.9× (bf16) and 3.2× (fp32) the reference's largest error on that same request, but only 1.8× / 2.0×
the largest over the workload (at 32 trained layers, deep-bamba on the CPU, 2.9× in 5 of 400 runs: a
false-failure rate near 1% of runs there, docs/scale.md). A workload of fewer than MIN_BUDGET_POSITIONS positions
(harness/runner.py) takes E over the model's batching workload too, since its own max is a request-sized sample. The max (not a quantile)
guarantees that the reference in d passes its own budget at k >= 1; k = 2 leaves room for an engine that rounds in other places (fused kernels, chunked scan, another summation
order) without hiding errors several times what the dtype itself causes.

The quantile rule (`--budget-rule quantile`; the max rule above stays the default). At depth one position can set
E: on the 32-layer random Bamba-9B-shaped model in bf16 the reference's largest error was near 11 nats where the
typical one is a quarter of a nat, so k · E (22 nats) passes nearly anything there, and the excess test alone
keeps power. The quantile rule gives each position its own budget,
    budget(p) = k · max(E_q, e(p)) + atol
with e(p) the reference's error in d at p and E_q the BUDGET_QUANTILE quantile of e over every position of the
workload (the same positions E is the max of). It keeps the max rule's guarantee, position by position: the
reference in d passes its own budget at k >= 1. A position where the reference itself errs beyond E_q (the
chaotic positions that set E) gets its own error as the scale, so a correct candidate, which errs there too, is
not failed; every other position gets k · E_q, the level of the dtype's typical large error rather than the
workload's single largest. A workload of fewer than 1 / (1 - q) positions has the largest error for its floor: the
max rule. Measured at depth (docs/scale.md) it failed correct engines: 4 of 160 bf16 runs of the vendored engine
on a trained 32-layer model, on requests of 16-17 tokens, where twice the 99th percentile does not bound another
engine's error at a typical position. It stays an option for comparison, not a default.

atol(d) is a floor for workloads where the reference's own error happens to be small. Measured with
`python -m harness.measure_atol --engine NAME --dtype D --scenarios ... CKPT...` on random G = 1 checkpoints
(torch 2.13 CPU / 2.11 on an H200, transformers 5.17), as the excess max |Δ| − 2·E:
    transformers fp32 and bf16, batching + cudagraph-off, 5 checkpoints, CPU (bf16 also on the H200): always < 0
        (fp32: largest |Δ| 1.1e-05 at E = 8.6e-06, E over the runs 4.4e-06..1.6e-05; bf16: 0.44 at E = 0.39).
    vendored fp32, batching-together + chunked budgets, 3 checkpoints: Triton interpreter (CPU) +1.1e-06 in 1 of 12
        runs (|Δ| 1.03e-05 at a token of logprob -13.2, E = 4.6e-06); compiled on the H200 +2.4e-06 and +3.2e-07
        in 2 of 12 (largest: chunked budget 9, |Δ| 1.44e-05, E = 6.0e-06), else < 0. bf16 on the H200: always < 0.
So atol = 1e-05 for every dtype below fp64: 4× the largest excess seen, about 10 float32 spacings of a logprob of
magnitude 8-16 (2^-20 ≈ 9.5e-07), and negligible beside E in 16-bit dtypes (E ~ 0.1-1 on these models).
fp64 against fp64 (the oracle chunked vs whole, E = 0): measured difference ≤ 5e-14 on these workloads; atol 1e-10.
Relative checks (config A vs config B of one engine) use the same Budget with A as the baseline.

Greedy generation: the candidate's tokens must be the baseline's. A different token at step s is legitimate only if
the baseline's logprob of its own token exceeds its logprob of the candidate's token by at most the budget (so the
baseline's top-2 margin is within the budget and the candidate chose one of the near-tied tokens); past that step the
candidate is re-run teacher-forced on the baseline's tokens and those positions are compared like prompt positions.
The baseline's logprob of the candidate's token comes from its full rows, else its top-k, else (the fp64 oracle
at a large vocabulary) its NEAR_TIE_K most likely tokens of each generated position (harness/runner.py). A token
in none of them is not taken for a near-tie: the failure says so, with the bound the last listed token gives.

The excess test (16-bit candidates against the oracle). The max budget bounds the worst position; a bug that
doubles the error everywhere stays inside it, since a bf16 model's typical error is a fraction of its largest. So
the candidate's error is also compared, on average, with the error of the reference run in the candidate's dtype
(the "noise floor": same requests, teacher-forced, the SSM state and recurrence kept in float32 as engines keep
them): per position class, over the positions the class holds,
    mean |cand − oracle|  <=  EXCESS_RATIO · mean |ref_d − oracle|  + atol
with classes all, prompt (teacher-forced prompt positions), decode (generated positions), after-piece (the first
BOUNDARY_WINDOW positions predicted from a chunked-prefill piece that continues a saved state), after-chunk (the
first BOUNDARY_WINDOW positions after each multiple of the chunk size Q inside a prefill piece, where the chunked
scan hands its state on). A class with fewer than MIN_CLASS_POSITIONS positions is reported but not judged. Each
class also has paired_z: the mean of d = cand − EXCESS_RATIO·ref over its positions, less atol, in standard errors
of those differences. A judged class whose mean is over the limit fails when paired_z is over EXCESS_Z (the excess
is more than the class's own scatter explains) or its mean is over EXCESS_RATIO_ALONE times the reference's. The
ratio alone failed one correct run in 160 on a trained 32-layer model (1.70× on a class of 33 positions, where a few
positions set the mean; docs/scale.md); a bug that raises the error over a whole class moves every d, so its z grows
with the class's size; and a bug whose excess sits on a few positions can be large with a small z (6.2× at z 2.9 on
that model), which the second bound fails. The ratio alone stays available (NoiseFloor.z_limit None, `--excess-z
none`). Each class reports both verdicts, and its variances and covariance, from which paired_z_at gives its z
against another ratio (how mutants.scale weighs a lower limit on runs already made). The
boundaries are those of the scheduler plan of harness/schedule.py (exact for the vendored engine, the closest
model of others'). Its threshold and false-failure rate are measured on real-width models (docs/scale.md).

Metrics: max |Δ logprob|; mean KL(baseline ‖ candidate) over positions, on the full distributions when both sides
return them, else on the top-k coarsening (the tokens in both top-k lists plus one bucket for the rest of the mass,
a lower bound of the full KL; either is clamped at 0, where rounding of nearly equal distributions leaves it);
top-1 agreement; first position whose top-1 token differs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .engine import Request, RequestResult

DEFAULT_K = 2.0
# How a position's budget is set from the reference's own errors (module docstring, "The quantile rule").
BUDGET_RULES = ("max", "quantile")
BUDGET_QUANTILE = 0.99


def parse_budget_rules(text: str) -> list[str]:
    """--budget-rule's value (the CLI's and mutants.scale's): one rule or several comma-separated, each once; the
    first gives the verdict. ValueError naming the value otherwise."""
    rules = [r.strip() for r in text.split(",")]
    if not text.strip() or any(r not in BUDGET_RULES for r in rules) or len(set(rules)) != len(rules):
        raise ValueError(f"--budget-rule {text}: expected {' or '.join(BUDGET_RULES)}, or both comma-separated")
    return rules
ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-5,
    torch.float16: 1e-5,
}


# The excess test's threshold, the positions a class needs to be judged, and how many positions after a boundary
# belong to its class (module docstring; measured in docs/scale.md).
EXCESS_RATIO = 1.5
EXCESS_Z = 3.0
EXCESS_RATIO_ALONE = 2.0
MIN_CLASS_POSITIONS = 32
BOUNDARY_WINDOW = 16
POSITION_CLASSES = ("all", "prompt", "decode", "after-piece", "after-chunk")


@dataclass(frozen=True)
class NoiseFloor:
    """The reference's own error in the candidate's dtype: errors[request_id][i] = |ref_d − ref_fp64| at position
    i+1 (teacher-forced on the oracle's continuation, so rows match the comparison's), and the positions of each
    class (position_classes) per request."""

    dtype: str
    errors: dict[str, list[float]]
    classes: dict[str, dict[str, set[int]]]
    ratio: float = EXCESS_RATIO
    atol: float = 0.0
    min_positions: int = MIN_CLASS_POSITIONS
    z_limit: float | None = EXCESS_Z                # None: the ratio alone judges (the excess test before paired z)
    ratio_alone: float = EXCESS_RATIO_ALONE         # over this ratio a class fails whatever its paired z


def position_classes(prompt_len: int, n_new: int, pieces: Sequence[tuple[int, int, bool]], chunk_size: int, *,
                     window: int = BOUNDARY_WINDOW) -> dict[str, set[int]]:
    """The positions (1..T+n-1) of each class for one request fed in `pieces` ((start, stop, decode) in order).
    Position p is predicted from token p-1, so a boundary before token b makes positions b+1..b+window "after" it."""
    last = prompt_len + n_new - 1
    classes = {"all": set(range(1, last + 1)), "prompt": set(range(1, prompt_len)),
               "decode": set(range(prompt_len, last + 1)), "after-piece": set(), "after-chunk": set()}
    for start, stop, decode in pieces:
        if decode:
            continue
        if start > 0:
            classes["after-piece"].update(range(start + 1, min(start + window, stop) + 1))
        for b in range(start + chunk_size, stop, chunk_size):
            classes["after-chunk"].update(range(b + 1, min(b + window, stop) + 1))
    return {name: {p for p in ps if 1 <= p <= last} for name, ps in classes.items()}


def excess_table(comparisons: Sequence["RequestComparison"], noise: NoiseFloor) -> dict[str, dict]:
    """Per class: positions, the candidate's and the reference's mean error there, their ratio, whether judged,
    paired_z, and the verdicts: over_ratio (judged and its mean over the limit: the ratio alone's failure) and failed
    (over_ratio, and paired_z over noise.z_limit unless that is None, or the mean over noise.ratio_alone times the
    reference's; a z that is not a number fails)."""
    table = {}
    for name in POSITION_CLASSES:
        cand, ref = [], []
        for c in comparisons:
            members = noise.classes.get(c.request_id, {}).get(name, set())
            errors = noise.errors.get(c.request_id, [])
            for position, delta in zip(c.positions, c.deltas):
                if position in members and position - 1 < len(errors):
                    cand.append(delta)
                    ref.append(errors[position - 1])
        n = len(cand)
        cand_mean = sum(cand) / n if n else 0.0
        ref_mean = sum(ref) / n if n else 0.0
        limit = noise.ratio * ref_mean + noise.atol
        judged = n >= noise.min_positions
        z = paired_z(cand, ref, noise.ratio, noise.atol)
        over_ratio, failed = excess_verdict(judged, cand_mean, ref_mean, z, ratio=noise.ratio, atol=noise.atol,
                                            z_limit=noise.z_limit, ratio_alone=noise.ratio_alone)
        table[name] = {"positions": n, "candidate_mean": cand_mean, "reference_mean": ref_mean,
                       "ratio": cand_mean / ref_mean if ref_mean > 0 else (math.inf if cand_mean > 0 else 0.0),
                       "limit": limit, "judged": judged, "paired_z": z, "over_ratio": over_ratio, "failed": failed,
                       **_moments(cand, ref, cand_mean, ref_mean)}
    return table


def excess_verdict(judged: bool, cand_mean: float, ref_mean: float, z: float | None, *, ratio: float, atol: float,
                   z_limit: float | None, ratio_alone: float) -> tuple[bool, bool]:
    """(over_ratio, failed) of one class (excess_table): over the ratio's limit when judged, and failed when its
    paired z (against that ratio) is over z_limit, is not a number, or its mean is over ratio_alone times the
    reference's; z_limit None: the ratio alone."""
    over_ratio = judged and not cand_mean <= ratio * ref_mean + atol
    failed = over_ratio and (z_limit is None or z is None or not z <= z_limit
                             or not cand_mean <= ratio_alone * ref_mean + atol)
    return over_ratio, failed


def excess_verdict_at(entry: dict, ratio: float, atol: float) -> tuple[bool, bool, float | None]:
    """(over_ratio, failed, paired z) of a judged excess_table class at another ratio limit, from its means and
    moments (paired_z_at), with compare's z limit and ratio-alone bound: how a lower limit is weighed on runs already
    made."""
    z = paired_z_at(entry, ratio, atol)
    over_ratio, failed = excess_verdict(True, entry["candidate_mean"], entry["reference_mean"], z, ratio=ratio,
                                        atol=atol, z_limit=EXCESS_Z, ratio_alone=EXCESS_RATIO_ALONE)
    return over_ratio, failed, z


def _moments(cand: Sequence[float], ref: Sequence[float], cand_mean: float, ref_mean: float) -> dict[str, float]:
    """The class's sample variances and covariance (n − 1; 0 under two positions): with the means they give the
    paired z against any ratio (paired_z_at), so that another excess limit can be weighed on runs already made."""
    n = len(cand)
    if n < 2:
        return {"candidate_var": 0.0, "reference_var": 0.0, "covariance": 0.0}
    return {"candidate_var": sum((c - cand_mean) ** 2 for c in cand) / (n - 1),
            "reference_var": sum((r - ref_mean) ** 2 for r in ref) / (n - 1),
            "covariance": sum((c - cand_mean) * (r - ref_mean) for c, r in zip(cand, ref)) / (n - 1)}


def paired_z_at(row: dict, ratio: float, atol: float) -> float | None:
    """paired_z of an excess_table class against another ratio, from its positions, means and moments (the same
    number paired_z gives on the class's positions, up to rounding); None where paired_z would be."""
    n = row["positions"]
    if n < 2:
        return None
    mean = row["candidate_mean"] - ratio * row["reference_mean"]
    var = row["candidate_var"] + ratio * ratio * row["reference_var"] - 2 * ratio * row["covariance"]
    if var <= 1e-12 * max(row["candidate_var"] + ratio * ratio * row["reference_var"], 1e-300):
        return 0.0 if mean == atol else math.copysign(math.inf, mean - atol)
    return (mean - atol) / math.sqrt(var / n)


def paired_z(cand: Sequence[float], ref: Sequence[float], ratio: float, atol: float) -> float | None:
    """How many standard errors the mean of the paired differences d = cand − ratio·ref lies above atol: the excess
    test's margin measured against the class's own spread (module docstring, the excess test).
    None under two positions; ±inf when every difference is equal (sd 0) and the mean is off atol; 0 at it."""
    n = len(cand)
    if n < 2:
        return None
    diffs = [c - ratio * r for c, r in zip(cand, ref)]
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    if sd == 0.0:
        return 0.0 if mean == atol else math.copysign(math.inf, mean - atol)
    return (mean - atol) / (sd / math.sqrt(n))


@dataclass(frozen=True)
class Budget:
    """The largest |Δ logprob| allowed at a position. The max rule (positions None): k · reference_error + atol at
    every position, reference_error the reference's largest error over the workload; 0: the baseline is exact for
    this comparison (fp64 against fp64) and the budget is atol alone. The quantile rule (BUDGET_RULES): at position
    p of request r, k · max(floor, positions[r][p-1]) + atol, floor a high quantile of the reference's per-position
    errors; a position the rows do not hold gets the max rule's budget. Under either rule a position downstream of
    a routing near-tie (an MoE token whose last chosen expert and best one left out are closer than the candidate's
    dtype can tell apart) also gets routing[r][p-1]: what trading those experts moves its logprob (harness/routing.py).
    """

    k: float
    atol: float
    reference_error: float = 0.0
    floor: float | None = None                            # the quantile rule's floor
    positions: dict[str, list[float]] | None = None       # the quantile rule's per-position reference errors
    routing: dict[str, list[float]] | None = None         # per-position routing near-tie allowances

    @property
    def value(self) -> float:
        """The largest budget of any position (the max rule's, which the quantile rule never exceeds)."""
        return self.k * self.reference_error + self.atol

    @property
    def rule(self) -> str:
        return "max" if self.positions is None else "quantile"

    def at(self, request_id: str, position: int) -> float:
        """The budget of one position (1-based, as RequestComparison.positions)."""
        row = None if self.positions is None else self.positions.get(request_id)
        if row is None or not 1 <= position <= len(row) or math.isnan(row[position - 1]):
            return self.value + self.allowance(request_id, position)
        return self.k * max(self.floor, row[position - 1]) + self.atol + self.allowance(request_id, position)

    def k_to_pass(self, request_id: str, position: int, delta: float) -> float:
        """The smallest k at which |Δ| = delta at this position is within its budget, the rest of the budget (atol,
        a routing allowance, the reference's error it scales) as it is: 0 when delta is within atol and allowance,
        inf when no k would do (an exact baseline's 0 scale, or a NaN)."""
        rest = self.atol + self.allowance(request_id, position)
        if delta <= rest:
            return 0.0
        row = None if self.positions is None else self.positions.get(request_id)
        if row is None or not 1 <= position <= len(row) or math.isnan(row[position - 1]):
            scale = self.reference_error
        else:
            scale = max(self.floor, row[position - 1])
        return (delta - rest) / scale if scale > 0 and math.isfinite(delta) else math.inf

    def allowance(self, request_id: str, position: int) -> float:
        """The routing near-tie allowance of one position (0 where there is none)."""
        row = None if self.routing is None else self.routing.get(request_id)
        return row[position - 1] if row is not None and 1 <= position <= len(row) else 0.0


@dataclass(frozen=True)
class Failure:
    """One position outside the budget (what = "logprob"), a greedy token that is no near-tie ("token"), a result
    of the wrong shape ("shape"), or a class of positions whose mean error exceeds the noise floor's ("excess":
    where = the class, position 0)."""

    scenario: str
    request_id: str
    position: int
    where: str
    what: str
    baseline_token: int | None = None
    candidate_token: int | None = None
    baseline_logprob: float | None = None
    candidate_logprob: float | None = None
    budget: float = 0.0
    baseline_name: str = "oracle"
    detail: str = ""

    def message(self) -> str:
        head = f"{self.scenario}: request {self.request_id!r} position {self.position} ({self.where})"
        if self.what == "logprob":
            delta = abs(self.candidate_logprob - self.baseline_logprob)
            return (f"{head}: token {self.baseline_token}: {self.baseline_name} logprob {self.baseline_logprob:.6f}, "
                    f"candidate {self.candidate_logprob:.6f}, |Δ| {delta:.3g} > budget {self.budget:.3g}")
        if self.what == "token" and self.detail:
            return (f"{head}: {self.baseline_name} token {self.baseline_token} (logprob {self.baseline_logprob:.6f}), "
                    f"candidate token {self.candidate_token}: {self.detail}")
        if self.what == "token":
            return (f"{head}: {self.baseline_name} token {self.baseline_token} (logprob {self.baseline_logprob:.6f}), "
                    f"candidate token {self.candidate_token} ({self.baseline_name} logprob of it "
                    f"{self.candidate_logprob:.6f}): margin {self.baseline_logprob - self.candidate_logprob:.3g} "
                    f"> budget {self.budget:.3g}, not a near-tie")
        if self.what == "excess":
            return f"{self.scenario}: positions {self.where}: {self.detail}"
        return f"{head}: {self.detail}"


@dataclass
class RequestComparison:
    """Per-position records of one request; positions are numbered in the request's sequence (1..T+n-1)."""

    request_id: str
    prompt_len: int
    positions: list[int] = field(default_factory=list)
    deltas: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    top1_agree: list[bool] = field(default_factory=list)
    token_divergence: int | None = None
    token_margin: float | None = None     # at token_divergence: the baseline's logprob of its token over the other's
    not_compared: list[int] = field(default_factory=list)

    @property
    def max_delta(self) -> float:
        return max(self.deltas, default=0.0)

    @property
    def first_top1_difference(self) -> int | None:
        return next((p for p, ok in zip(self.positions, self.top1_agree) if not ok), None)


@dataclass
class Report:
    """The verdict on one scenario: every request's comparison, the failures, and the summary metrics."""

    scenario: str
    comparisons: list[RequestComparison]
    failures: list[Failure]
    meta: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def max_delta(self) -> float:
        return max((c.max_delta for c in self.comparisons), default=0.0)

    @property
    def mean_kl(self) -> float:
        kls = [k for c in self.comparisons for k in c.kls]
        return sum(kls) / len(kls) if kls else 0.0

    @property
    def top1_agreement(self) -> float:
        agree = [a for c in self.comparisons for a in c.top1_agree]
        return sum(agree) / len(agree) if agree else 1.0

    @property
    def first_divergence(self) -> tuple[str, int] | None:
        """(request, position) of the earliest top-1 difference over the requests, or None."""
        firsts = [(c.first_top1_difference, c.request_id) for c in self.comparisons
                  if c.first_top1_difference is not None]
        return (min(firsts)[1], min(firsts)[0]) if firsts else None

    def message(self, limit: int = 10) -> str:
        lines = [f.message() for f in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more failures")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"scenario": self.scenario, "passed": self.passed, "max_abs_delta": self.max_delta,
                "mean_kl": self.mean_kl, "top1_agreement": self.top1_agreement,
                "first_divergence": self.first_divergence, **self.meta,
                "failures": [asdict(f) | {"message": f.message()} for f in self.failures],
                "requests": [asdict(c) for c in self.comparisons]}


@dataclass
class _Rows:
    """One result's per-position arrays over positions 1..L (row i is position i+1); tokens are the targets."""

    tokens: list[int]
    logprobs: torch.Tensor          # (L,)
    top_ids: torch.Tensor           # (L, K)
    top_logprobs: torch.Tensor      # (L, K)
    dists: torch.Tensor | None      # (L, V)
    near: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)   # row -> wide (ids, logprobs)

    @classmethod
    def of(cls, request: Request, result: RequestResult) -> "_Rows":
        dists = None
        if result.prompt_dists is not None and result.output_dists is not None:
            dists = torch.cat([result.prompt_dists, result.output_dists])
        near = {}
        if result.output_near_ids is not None and result.output_near_logprobs is not None:
            first = len(request.prompt) - 1
            near = {first + j: (ids, values) for j, (ids, values)
                    in enumerate(zip(result.output_near_ids, result.output_near_logprobs))}
        return cls(list(request.prompt[1:]) + list(result.output_ids), result.sequence_logprobs(),
                   torch.cat([result.prompt_top_ids, result.output_top_ids]),
                   torch.cat([result.prompt_top_logprobs, result.output_top_logprobs]), dists, near)

    def logprob_of(self, row: int, token: int) -> float:
        """This side's logprob of `token` at `row`; -inf when only its top lists are known and it is in neither."""
        if self.dists is not None:
            return float(self.dists[row, token])
        for ids, values in ((self.top_ids[row], self.top_logprobs[row]), self.near.get(row, (None, None))):
            if ids is not None:
                hits = (ids == token).nonzero()
                if len(hits):
                    return float(values[hits[0, 0]])
        return -math.inf

    def listed(self, row: int) -> tuple[int, float]:
        """How many of this row's most likely tokens are known (the whole vocabulary with full rows), and the
        logprob of the last of them: a bound on the logprob of every token not listed."""
        if self.dists is not None:
            return self.dists.shape[1], -math.inf
        ids, values = self.near.get(row, (self.top_ids[row], self.top_logprobs[row]))
        return len(ids), float(values[-1])


def kl_divergence(base: _Rows, cand: _Rows, row: int) -> float:
    """KL(base ‖ cand) at one position: full distributions when both have them, else the top-k coarsening."""
    if base.dists is not None and cand.dists is not None:
        p_log, q_log = base.dists[row], cand.dists[row]
        p = p_log.exp()
        terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
        return max(float(terms.sum()), 0.0)
    b_ids, c_ids = base.top_ids[row].tolist(), cand.top_ids[row].tolist()
    shared = [t for t in b_ids if t in c_ids]
    p = torch.tensor([base.logprob_of(row, t) for t in shared], dtype=torch.float64).exp()
    q = torch.tensor([cand.logprob_of(row, t) for t in shared], dtype=torch.float64).exp()
    kl = float((p * (p.log() - q.log())).sum())
    p_rest, q_rest = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(q.sum()), 1e-300)
    return max(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0), 0.0)


def results_digest(results: Sequence[RequestResult]) -> str:
    """A hash of every number of `results`, in order: each request's id, tokens and every tensor field's dtype,
    shape and bytes. Two runs of a baseline (the oracle resident and layer-streamed, say) with one digest gave the
    same bits; report.json carries it per scenario as baseline_digest."""
    h = hashlib.sha256()
    for r in results:
        h.update(repr((r.request_id, list(r.output_ids))).encode())
        for name in ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "output_logprobs", "output_top_ids",
                     "output_top_logprobs", "prompt_dists", "output_dists", "output_near_ids", "output_near_logprobs"):
            t = getattr(r, name)
            if t is None:
                h.update(f"{name}:none".encode())
                continue
            t = t.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def compare_runs(*, scenario: str, requests: Sequence[Request], baseline: Sequence[RequestResult],
                 candidate: Sequence[RequestResult], budget: Budget,
                 rerun: Callable[[list[Request]], list[RequestResult]] | None = None,
                 baseline_name: str = "oracle", noise: NoiseFloor | None = None) -> Report:
    """Judge `candidate` against `baseline` (results of the same requests, matched by request_id).

    rerun: runs the candidate engine on teacher-forced requests (prompt + the baseline's continuation); it is called
    once, with every request whose greedy tokens diverged. Without it the positions after a divergence are listed
    in `not_compared`. noise: run the excess test against this noise floor (module docstring).
    """
    by_id = {r.request_id: r for r in requests}
    base = {r.request_id: r for r in baseline}
    cand = {r.request_id: r for r in candidate}
    failures: list[Failure] = []
    usable = []
    for req in requests:
        problem = _shape_problem(req, base.get(req.request_id), cand.get(req.request_id), baseline_name)
        if problem:
            failures.append(Failure(scenario, req.request_id, 0, "result", "shape", detail=problem,
                                    baseline_name=baseline_name))
        else:
            usable.append(req.request_id)
    diverged = [rid for rid in usable if cand[rid].output_ids != base[rid].output_ids]
    forced: dict[str, RequestResult] = {}
    if diverged and rerun is not None:
        forced_reqs = [by_id[rid].teacher_forced(base[rid].output_ids) for rid in diverged]
        forced = {r.request_id: r for r in rerun(forced_reqs)}
    comparisons = []
    for rid in usable:
        comparison, found = _compare_request(scenario, by_id[rid], base[rid], cand[rid], forced.get(rid),
                                             lambda position, rid=rid: budget.at(rid, position), baseline_name)
        comparisons.append(comparison)
        failures += found
    meta = {"k": budget.k, "atol": budget.atol, "reference_error": budget.reference_error, "budget": budget.value,
            "budget_rule": budget.rule, "baseline_digest": results_digest([base[r.request_id] for r in requests
                                                                             if r.request_id in base])}
    if budget.routing is not None:
        meta["routing_allowance"] = {"positions": sum(1 for row in budget.routing.values() for a in row if a > 0),
                                     "largest": max((a for row in budget.routing.values() for a in row), default=0.0)}
    if budget.positions is not None:
        meta["budget_floor"] = budget.k * budget.floor + budget.atol
    if budget.positions is not None or budget.routing is not None:
        # each position has its own budget (the quantile rule's, or one widened by a routing near-tie): what a
        # position's |Δ| is against that budget, not against `budget` alone, which a trade at a tie exceeds by far
        ratios = [d / budget.at(c.request_id, p) for c in comparisons for p, d in zip(c.positions, c.deltas)]
        meta["max_delta_over_position_budget"] = max(ratios, default=0.0)
    # how far the run is from passing the checks a larger k widens (logprob and token; a shape or excess failure
    # is k's no matter): the smallest k at which none of them fails, the rest of the budget as it is
    meta["k_to_pass"] = max([budget.k_to_pass(c.request_id, p, d) for c in comparisons
                             for p, d in zip(c.positions, c.deltas)]
                            + [budget.k_to_pass(c.request_id, c.token_divergence, c.token_margin)
                               for c in comparisons if c.token_margin is not None], default=0.0)
    if noise is not None:
        table = excess_table(comparisons, noise)
        meta["excess"] = {"dtype": noise.dtype, "ratio_limit": noise.ratio, "z_limit": noise.z_limit,
                          "atol": noise.atol,
                          "ratio_alone": None if noise.z_limit is None else noise.ratio_alone, "classes": table}
        for name, row in table.items():
            if row["failed"]:
                z, limit = row["paired_z"], noise.z_limit
                why = ("" if limit is None else ", paired z not defined" if z is None
                       else f", paired z {z:.2f} > {limit:g}" if not z <= limit
                       else f", over {noise.ratio_alone:g}× whatever its paired z ({z:.2f})")
                failures.append(Failure(
                    scenario, "*", 0, name, "excess", budget=row["limit"], baseline_name=baseline_name,
                    detail=(f"mean |Δ| {row['candidate_mean']:.3g} over {row['positions']} positions is "
                            f"{row['ratio']:.2f}× the {noise.dtype} reference's {row['reference_mean']:.3g} "
                            f"(limit {noise.ratio:g}× + {noise.atol:g}{why})")))
    return Report(scenario, comparisons, failures, meta)


def _shape_problem(req: Request, base: RequestResult | None, cand: RequestResult | None, baseline_name: str) -> str:
    if base is None:
        return f"no {baseline_name} result"
    if cand is None:
        return "the candidate returned no result for this request"
    n_prompt = len(req.prompt) - 1
    if len(cand.prompt_logprobs) != n_prompt:
        return f"the candidate returned {len(cand.prompt_logprobs)} prompt logprobs, expected {n_prompt}"
    if len(cand.output_ids) != req.max_new_tokens or len(cand.output_logprobs) != req.max_new_tokens:
        return (f"the candidate returned {len(cand.output_ids)} tokens and {len(cand.output_logprobs)} logprobs, "
                f"expected {req.max_new_tokens}")
    return ""


def _compare_request(scenario: str, req: Request, base_result: RequestResult, cand_result: RequestResult,
                     forced_result: RequestResult | None, budget_at: Callable[[int], float],
                     baseline_name: str) -> tuple[RequestComparison, list[Failure]]:
    T, n = len(req.prompt), len(base_result.output_ids)
    base, cand = _Rows.of(req, base_result), _Rows.of(req, cand_result)
    out = RequestComparison(req.request_id, T)
    failures: list[Failure] = []
    split = next((s for s in range(n) if cand_result.output_ids[s] != base_result.output_ids[s]), None)
    direct_rows = T - 1 + (n if split is None else split)

    def record(side: _Rows, row: int, where: str) -> None:
        position = row + 1
        b_lp, c_lp = float(base.logprobs[row]), float(side.logprobs[row])
        delta = abs(c_lp - b_lp) if not math.isnan(c_lp) else math.inf
        out.positions.append(position)
        out.deltas.append(delta)
        out.kls.append(kl_divergence(base, side, row))
        out.top1_agree.append(int(side.top_ids[row, 0]) == int(base.top_ids[row, 0]))
        budget = budget_at(position)
        if not delta <= budget:
            failures.append(Failure(scenario, req.request_id, position, where, "logprob", base.tokens[row],
                                    side.tokens[row], b_lp, c_lp, budget, baseline_name))

    for row in range(direct_rows):
        record(cand, row, "prompt" if row + 1 < T else f"generated step {row + 1 - T}")
    if split is None:
        return out, failures

    row = T - 1 + split
    out.token_divergence = row + 1
    b_token, c_token = base_result.output_ids[split], cand_result.output_ids[split]
    b_lp, c_lp_base = float(base.logprobs[row]), base.logprob_of(row, c_token)
    out.token_margin = b_lp - c_lp_base
    budget = budget_at(row + 1)
    if not b_lp - c_lp_base <= budget:
        detail = ""
        if c_lp_base == -math.inf:          # not among the tokens the baseline listed: only a bound is known
            listed, last = base.listed(row)
            detail = (f"not among the {baseline_name}'s {listed} most likely tokens (the last at logprob {last:.4g}): "
                      f"margin >= {b_lp - last:.3g}" + (f" <= budget {budget:.3g}: cannot show it is a near-tie, "
                                                         "so it is not taken for one" if b_lp - last <= budget
                                                         else f" > budget {budget:.3g}, not a near-tie"))
        failures.append(Failure(scenario, req.request_id, row + 1, f"generated step {split}", "token", b_token,
                                c_token, b_lp, c_lp_base, budget, baseline_name, detail))
    if forced_result is None:
        out.not_compared = list(range(row + 1, T + n))
        return out, failures
    forced_req = req.teacher_forced(base_result.output_ids)
    if len(forced_result.prompt_logprobs) != T - 1 + n:
        failures.append(Failure(scenario, req.request_id, row + 1, "teacher-forced re-run", "shape",
                                detail=f"the re-run returned {len(forced_result.prompt_logprobs)} prompt logprobs, "
                                       f"expected {T - 1 + n}", baseline_name=baseline_name))
        return out, failures
    forced = _Rows.of(forced_req, forced_result)
    for r in range(row, T - 1 + n):
        record(forced, r, f"generated step {r + 1 - T}, teacher-forced")
    return out, failures
