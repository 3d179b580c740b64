"""compare.py on synthetic logprob streams: budgets, near-ties, teacher-forced continuation, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare import Budget, compare_runs
from harness.engine import Request, result_from_logprobs

V = 8
PROMPT = (3, 1, 4, 1, 5)            # T = 5: positions 1..4 are prompt positions, 5..7 the generated steps
N_NEW = 3
BUDGET = Budget(k=2.0, atol=1e-6, reference_error=1e-4)     # 2.01e-4


def stream(seed: int = 0, margins: dict[int, float] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Log-softmax rows (T-1+n, V) with a clear argmax everywhere, and the greedy tokens of the output rows.
    margins: generated step -> the top-2 logit margin at that step."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(PROMPT) - 1 + N_NEW, V, generator=gen, dtype=torch.float64)
    for row in range(logits.shape[0]):
        logits[row, row % V] += 4.0
    for step, margin in (margins or {}).items():
        row = len(PROMPT) - 1 + step
        second = (row + 1) % V
        logits[row, second] = logits[row].max() - margin
    rows = torch.log_softmax(logits, dim=-1)
    return rows, [int(rows[len(PROMPT) - 1 + s].argmax()) for s in range(N_NEW)]


def request(full: bool = True, top_k: int = 3) -> Request:
    return Request("req-a", PROMPT, N_NEW, top_k=top_k, full_distributions=full)


def judge(base_rows, base_out, cand_rows, cand_out, *, rerun=None, req=None, budget=BUDGET):
    req = req or request()
    return compare_runs(scenario="synthetic", requests=[req], baseline=[result_from_logprobs(req, base_rows, base_out)],
                        candidate=[result_from_logprobs(req, cand_rows, cand_out)], budget=budget, rerun=rerun)


def forced_rerun(rows: torch.Tensor):
    """A candidate's teacher-forced re-run that returns `rows` for the forced prompt."""
    def rerun(requests):
        return [result_from_logprobs(r, rows, []) for r in requests]
    return rerun


def test_identical_streams_pass_with_zero_metrics():
    rows, out = stream()
    report = judge(rows, out, rows.clone(), list(out))
    assert report.passed, report.message()
    assert (report.max_delta, report.mean_kl, report.top1_agreement, report.first_divergence) == (0.0, 0.0, 1.0, None)
    assert report.comparisons[0].positions == list(range(1, len(PROMPT) + N_NEW))


@pytest.mark.parametrize("row", [1, len(PROMPT) - 1 + 1], ids=["prompt", "generated"])
def test_one_position_beyond_the_budget_fails_and_is_named(row):
    rows, out = stream()
    cand = rows.clone()
    target = (list(PROMPT[1:]) + out)[row]
    cand[row, target] += 3e-4
    report = judge(rows, out, cand, list(out))
    assert not report.passed
    assert len(report.failures) == 1
    message = report.failures[0].message()
    assert f"synthetic: request 'req-a' position {row + 1}" in message
    assert f"token {target}" in message
    assert f"{float(rows[row, target]):.6f}" in message and f"{float(cand[row, target]):.6f}" in message


def test_perturbation_within_the_budget_passes():
    rows, out = stream()
    cand = rows + 1.5e-4
    assert judge(rows, out, cand, list(out)).passed


def test_divergence_at_a_near_tie_passes_and_continues_teacher_forced():
    rows, out = stream(margins={1: 5e-5})
    cand_rows, _ = stream(seed=1)                      # after another token the candidate's rows are unrelated
    cand_out = [out[0], (len(PROMPT) + 1) % V, 0]      # step 1 takes the near-tied runner-up
    cand_rows[: len(PROMPT)] = rows[: len(PROMPT)]
    report = judge(rows, out, cand_rows, cand_out, rerun=forced_rerun(rows.clone()))
    assert report.passed, report.message()
    comparison = report.comparisons[0]
    assert comparison.token_divergence == len(PROMPT) + 1
    assert comparison.positions == list(range(1, len(PROMPT) + N_NEW))
    assert not comparison.not_compared


def test_divergence_at_a_clear_margin_fails_naming_both_tokens():
    rows, out = stream(margins={1: 1.0})
    cand_out = [out[0], (len(PROMPT) + 1) % V, 0]
    report = judge(rows, out, rows.clone(), cand_out, rerun=forced_rerun(rows.clone()))
    tokens = [f for f in report.failures if f.what == "token"]
    assert len(tokens) == 1 and tokens[0].position == len(PROMPT) + 1
    message = tokens[0].message()
    assert f"oracle token {out[1]}" in message and f"candidate token {cand_out[1]}" in message
    assert "not a near-tie" in message


def _with_near(req, rows, out, near_k):
    """The baseline as the oracle returns it at a large vocabulary: top-k only, plus the near_k most likely tokens
    of each generated position."""
    result = result_from_logprobs(req, rows, out)
    gen = rows[len(PROMPT) - 1:]
    result.output_near_logprobs, result.output_near_ids = gen.topk(near_k, dim=-1)
    return result


@pytest.mark.parametrize("near_k", [0, 5], ids=["top-k-only", "near-list"])
def test_a_near_tie_outside_the_baselines_top_k_is_found_in_its_near_list(near_k):
    """The candidate takes the baseline's 4th token at a step where it trails the first by less than the budget:
    with top-2 lists alone the judge cannot see that it is a near-tie (and says so: it fails closed, with the
    bound it knows), with the oracle's wider list of generated positions it can."""
    rows, out = stream()
    step, row = 1, len(PROMPT)
    order = rows[row].argsort(descending=True)
    rows[row, order[1:4]] = rows[row, order[0]] - torch.tensor([2e-5, 4e-5, 6e-5], dtype=torch.float64)
    rows = torch.log_softmax(rows, dim=-1)
    out = [int(rows[len(PROMPT) - 1 + s].argmax()) for s in range(N_NEW)]
    fourth = int(rows[row].argsort(descending=True)[3])
    cand_out = [out[0], fourth, 0]
    req = request(full=False, top_k=2)
    base = _with_near(req, rows, out, near_k) if near_k else result_from_logprobs(req, rows, out)
    report = compare_runs(scenario="synthetic", requests=[req], baseline=[base],
                          candidate=[result_from_logprobs(req, rows.clone(), cand_out)], budget=BUDGET,
                          rerun=lambda reqs: [result_from_logprobs(r, rows.clone(), []) for r in reqs])
    if near_k:
        assert report.passed, report.message()
    else:
        (failure,) = report.failures
        assert failure.what == "token" and failure.position == row + 1
        assert "not among the oracle's 2 most likely tokens" in failure.message()
        assert "cannot show it is a near-tie" in failure.message()


def test_a_token_below_the_whole_near_list_by_more_than_the_budget_is_no_near_tie():
    rows, out = stream(margins={1: 1.0})
    req = request(full=False, top_k=2)
    row = len(PROMPT)
    last = int(rows[row].argsort(descending=True)[-1])          # the least likely token of the row
    report = compare_runs(scenario="synthetic", requests=[req], baseline=[_with_near(req, rows, out, 4)],
                          candidate=[result_from_logprobs(req, rows.clone(), [out[0], last, 0])], budget=BUDGET)
    (failure,) = [f for f in report.failures if f.what == "token"]
    assert "not among the oracle's 4 most likely tokens" in failure.message()
    assert "not a near-tie" in failure.message() and "cannot show" not in failure.message()


def test_positions_after_a_divergence_are_still_compared():
    rows, out = stream(margins={0: 5e-5})
    cand_out = [len(PROMPT) % V, 0, 0]
    forced = rows.clone()
    forced[len(PROMPT) - 1 + 2, out[2]] -= 0.5         # the teacher-forced re-run is wrong two steps later
    report = judge(rows, out, rows.clone(), cand_out, rerun=forced_rerun(forced))
    assert [(f.what, f.position) for f in report.failures] == [("logprob", len(PROMPT) + 2)]
    assert "teacher-forced" in report.failures[0].message()


def test_without_a_rerun_the_positions_after_a_divergence_are_listed_as_not_compared():
    rows, out = stream(margins={0: 5e-5})
    report = judge(rows, out, rows.clone(), [len(PROMPT) % V, 0, 0])
    assert report.comparisons[0].not_compared == [len(PROMPT) + s for s in range(N_NEW)]


def test_nan_in_the_candidate_fails():
    rows, out = stream()
    cand = rows.clone()
    cand[2, PROMPT[3]] = float("nan")
    report = judge(rows, out, cand, list(out))
    assert [f.position for f in report.failures] == [3]


def test_wrong_number_of_prompt_logprobs_is_a_shape_failure():
    rows, out = stream()
    req, short = request(), Request("req-a", PROMPT[:-1], N_NEW)
    cand = result_from_logprobs(short, rows[1:], out)
    report = compare_runs(scenario="synthetic", requests=[req], baseline=[result_from_logprobs(req, rows, out)],
                          candidate=[cand], budget=BUDGET)
    assert [f.what for f in report.failures] == ["shape"]
    assert "3 prompt logprobs, expected 4" in report.failures[0].message()


# A hand-made example: prompt (0, 1, 0), two positions, vocabulary of two tokens.
BASE_P = [[0.7, 0.3], [0.2, 0.8]]
CAND_P = [[0.6, 0.4], [0.6, 0.4]]


def _hand_made(full: bool, top_k: int):
    req = Request("hand", (0, 1, 0), 0, top_k=top_k, full_distributions=full)
    base = result_from_logprobs(req, torch.tensor(BASE_P, dtype=torch.float64).log(), [])
    cand = result_from_logprobs(req, torch.tensor(CAND_P, dtype=torch.float64).log(), [])
    return compare_runs(scenario="hand", requests=[req], baseline=[base], candidate=[cand],
                        budget=Budget(2.0, 10.0))


def test_metrics_on_a_hand_made_example():
    report = _hand_made(full=True, top_k=2)
    kl = [sum(p * math.log(p / q) for p, q in zip(b, c)) for b, c in zip(BASE_P, CAND_P)]
    assert report.max_delta == pytest.approx(math.log(0.6 / 0.2))
    assert report.comparisons[0].deltas == pytest.approx([math.log(0.4 / 0.3), math.log(0.6 / 0.2)])
    assert report.mean_kl == pytest.approx(sum(kl) / 2)
    assert report.top1_agreement == 0.5
    assert report.first_divergence == ("hand", 2)


def test_top_k_kl_uses_shared_tokens_and_one_bucket_for_the_rest():
    report = _hand_made(full=False, top_k=1)
    # Position 1: both top-1 lists hold token 0, the rest bucket holds token 1: the full KL for V = 2.
    # Position 2: the top-1 tokens differ, nothing is shared: both distributions are one bucket, KL 0.
    first = 0.7 * math.log(0.7 / 0.6) + 0.3 * math.log(0.3 / 0.4)
    assert report.comparisons[0].kls == pytest.approx([first, 0.0])


def test_budget_is_k_times_the_reference_error_plus_atol():
    assert Budget(2.0, 1e-6, 1e-4).value == pytest.approx(2.01e-4)
    assert Budget(2.0, 1e-10).value == 1e-10


# ---- k_to_pass: how far a run is from passing the checks a larger k widens -----------------------------------------
def _rejudged(report_k: float, rows, out, cand, cand_out, *, rerun=None, budget=BUDGET):
    """The same runs judged with k just above and just below report_k (the rest of the budget as it is)."""
    def at(k):
        b = Budget(k=k, atol=budget.atol, reference_error=budget.reference_error, floor=budget.floor,
                   positions=budget.positions)
        return judge(rows, out, cand.clone(), list(cand_out), rerun=rerun, budget=b)
    return at(report_k * (1 + 1e-9)), at(report_k * (1 - 1e-6))


@pytest.mark.parametrize("delta", [3e-4, 1.5e-4, 2e-3])
def test_k_to_pass_is_the_k_at_which_a_logprob_failure_would_pass(delta):
    rows, out = stream()
    cand = rows.clone()
    cand[2, PROMPT[3]] += delta
    report = judge(rows, out, cand, list(out))
    needed = report.meta["k_to_pass"]
    assert needed == pytest.approx((delta - BUDGET.atol) / BUDGET.reference_error, rel=1e-9)
    assert report.passed == (needed <= BUDGET.k)
    above, below = _rejudged(needed, rows, out, cand, out)
    assert above.passed and [f.what for f in below.failures] == ["logprob"]


def test_k_to_pass_of_identical_streams_is_0_and_of_a_nan_is_inf():
    rows, out = stream()
    assert judge(rows, out, rows.clone(), list(out)).meta["k_to_pass"] == 0.0
    cand = rows.clone()
    cand[2, PROMPT[3]] = float("nan")
    assert judge(rows, out, cand, list(out)).meta["k_to_pass"] == math.inf


@pytest.mark.parametrize("margin", [5e-5, 1.0])
def test_k_to_pass_counts_a_token_failures_margin(margin):
    rows, out = stream(margins={1: margin})
    cand_out = [out[0], (len(PROMPT) + 1) % V, 0]
    report = judge(rows, out, rows.clone(), cand_out, rerun=forced_rerun(rows.clone()))
    comparison = report.comparisons[0]
    assert comparison.token_margin == pytest.approx(margin, rel=1e-9)
    needed = report.meta["k_to_pass"]
    assert needed == pytest.approx(max(0.0, (margin - BUDGET.atol) / BUDGET.reference_error), rel=1e-9)
    above, below = _rejudged(needed, rows, out, rows, cand_out, rerun=forced_rerun(rows.clone()))
    assert above.passed, above.message()
    if needed > 0:
        assert [f.what for f in below.failures] == ["token"]


def test_k_to_pass_of_a_token_outside_the_near_list_is_inf():
    rows, out = stream(margins={1: 1.0})
    req = request(full=False, top_k=2)
    last = int(rows[len(PROMPT)].argsort(descending=True)[-1])
    report = compare_runs(scenario="synthetic", requests=[req], baseline=[_with_near(req, rows, out, 4)],
                          candidate=[result_from_logprobs(req, rows.clone(), [out[0], last, 0])], budget=BUDGET)
    assert report.meta["k_to_pass"] == math.inf


def test_k_to_pass_under_the_quantile_rule_scales_each_positions_own_error():
    rows, out = stream()
    n = len(PROMPT) - 1 + N_NEW
    errors = [1e-4] * n
    errors[3] = 5e-4                                  # a chaotic position: its own error is its scale
    budget = Budget(k=2.0, atol=1e-6, reference_error=5e-4, floor=1e-4, positions={"req-a": errors})
    cand = rows.clone()
    cand[1, PROMPT[2]] += 4e-4                        # a typical position: (4e-4 - atol) / 1e-4
    cand[3, PROMPT[4]] += 1.2e-3                      # the chaotic one: (1.2e-3 - atol) / 5e-4, smaller
    report = judge(rows, out, cand, list(out), budget=budget)
    needed = report.meta["k_to_pass"]
    assert needed == pytest.approx((4e-4 - 1e-6) / 1e-4, rel=1e-9)
    above, below = _rejudged(needed, rows, out, cand, out, budget=budget)
    assert above.passed and [f.position for f in below.failures] == [2]


def test_budget_k_to_pass_per_position():
    budget = Budget(2.0, 1e-5, reference_error=4.0, floor=0.5, positions={"a": [0.1, 3.0, float("nan")]})
    assert budget.k_to_pass("a", 1, 1e-5) == 0.0                          # within atol
    assert budget.k_to_pass("a", 1, 1.0 + 1e-5) == pytest.approx(2.0)     # the floor scales a typical position
    assert budget.k_to_pass("a", 2, 6.0 + 1e-5) == pytest.approx(2.0)     # its own error a chaotic one
    assert budget.k_to_pass("a", 3, 8.0 + 1e-5) == pytest.approx(2.0)     # NaN: the max rule's scale
    assert budget.k_to_pass("a", 1, math.inf) == math.inf
    assert Budget(2.0, 1e-10, 0.0).k_to_pass("a", 1, 1e-9) == math.inf   # an exact baseline: no k will do
