"""The excess test of harness/compare.py: a 16-bit candidate's mean error per position class against the noise floor
(the reference's own error in that dtype). It must fail a systematic excess that the max budget lets through, name
the class, leave small classes unjudged, and pass a candidate whose error is the noise floor's."""

from __future__ import annotations

import json

import pytest
import torch

from harness.compare import (EXCESS_RATIO, EXCESS_RATIO_ALONE, EXCESS_Z, MIN_CLASS_POSITIONS, Budget, NoiseFloor,
                             compare_runs, excess_table, position_classes)
from harness.engine import EngineOptions, Request, result_from_logprobs
from harness.runner import check_scenario
from harness.scenarios import PromptSource, Scenario
from harness.schedule import RequestShape

V, T, N_NEW = 16, 60, 8


def _rows(seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T - 1 + N_NEW, V, generator=gen, dtype=torch.float64)
    logits[torch.arange(logits.shape[0]), torch.arange(logits.shape[0]) % V] += 6.0      # clear greedy choices
    rows = torch.log_softmax(logits, dim=-1)
    return rows, [int(rows[T - 1 + s].argmax()) for s in range(N_NEW)]


def _judge(scale_by_position, *, min_positions=MIN_CLASS_POSITIONS, pieces=((0, T, False),), z_limit=EXCESS_Z):
    """One request; the noise floor's error at position p is e_p in [0.01, 0.1]; the candidate's logprob row at p
    moves by scale_by_position(p) · e_p (alternating sign). The max budget is far above every delta."""
    req = Request("r", tuple(t % V for t in range(1, T + 1)), N_NEW, top_k=3, full_distributions=True)
    base, out = _rows(0)
    errors = (0.01 + 0.09 * torch.rand(base.shape[0], generator=torch.Generator().manual_seed(1))).tolist()
    cand = base.clone()
    for row in range(base.shape[0]):
        cand[row] += (-1) ** row * scale_by_position(row + 1) * errors[row]
    decode = [(T - 1 + s, T + s, True) for s in range(N_NEW)]
    classes = {"r": position_classes(T, N_NEW, list(pieces) + decode, chunk_size=8, window=4)}
    noise = NoiseFloor("bfloat16", {"r": errors}, classes, min_positions=min_positions, z_limit=z_limit)
    return compare_runs(scenario="synthetic", requests=[req], baseline=[result_from_logprobs(req, base, out)],
                        candidate=[result_from_logprobs(req, cand, out)], budget=Budget(2.0, 0.0, 5.0), noise=noise)


def test_classes_of_a_chunked_request():
    pieces = [(0, 8, False), (8, 20, False), (20, 21, True), (21, 22, True)]
    c = position_classes(20, 3, pieces, chunk_size=5, window=4)
    assert c["all"] == set(range(1, 23)) and c["prompt"] == set(range(1, 20)) and c["decode"] == {20, 21, 22}
    assert c["after-piece"] == {9, 10, 11, 12}
    assert c["after-chunk"] == {6, 7, 8} | {14, 15, 16, 17} | {19, 20}


def test_the_noise_floors_own_error_passes():
    report = _judge(lambda p: 1.0)
    assert report.passed, report.message()
    table = report.meta["excess"]["classes"]
    assert table["all"]["ratio"] == pytest.approx(1.0) and table["all"]["judged"]


def test_an_error_twice_the_noise_floor_everywhere_fails_though_every_position_is_in_budget():
    report = _judge(lambda p: 2.0)
    assert report.max_delta < report.meta["budget"]
    failed = {f.where for f in report.failures if f.what == "excess"}
    assert {"all", "prompt"} <= failed
    message = next(f for f in report.failures if f.where == "all").message()
    assert "synthetic: positions all: mean |Δ|" in message and "2.00× the bfloat16 reference's" in message
    assert f"limit {EXCESS_RATIO:g}×" in message and f"> {EXCESS_Z:g})" in message
    row = report.meta["excess"]["classes"]["all"]
    assert row["over_ratio"] and row["failed"] and row["paired_z"] > EXCESS_Z


def test_an_excess_confined_to_positions_after_a_piece_boundary_is_named():
    pieces = [(0, 20, False), (20, 40, False), (40, T, False)]
    after = position_classes(T, N_NEW, pieces, chunk_size=8, window=4)["after-piece"]  # 8 of 67 positions
    report = _judge(lambda p: 2.5 if p in after else 1.0, min_positions=len(after), pieces=pieces)
    failed = {f.where for f in report.failures if f.what == "excess"}
    assert "after-piece" in failed and "all" not in failed, report.message()


def test_a_class_with_too_few_positions_is_reported_not_judged():
    report = _judge(lambda p: 3.0 if p >= T else 1.0)        # decode: 8 positions
    row = report.meta["excess"]["classes"]["decode"]
    assert row["positions"] == N_NEW and not row["judged"] and row["ratio"] == pytest.approx(3.0)
    assert "decode" not in {f.where for f in report.failures}


def test_a_bf16_candidate_is_judged_against_its_noise_floor(g1_checkpoint, g1_oracle):
    """End to end: the reference itself in bf16 as the candidate is its own noise floor (ratio 1 in every class);
    an fp32 candidate gets no excess test."""
    source = PromptSource(64, seed=0)
    scenario = Scenario("chunked-17", "chunked_prefill", EngineOptions(max_num_batched_tokens=17),
                        (RequestShape(40, 4), RequestShape(33, 4), RequestShape(50, 4)), "pieces of 17 tokens")
    report = check_scenario("reference", scenario, oracle=g1_oracle, source=source, dtype="bfloat16")
    assert report.passed, report.message()
    table = report.meta["excess"]["classes"]
    assert table["all"]["positions"] == (39 + 4) + (32 + 4) + (49 + 4) and table["all"]["judged"]
    assert all(row["ratio"] == pytest.approx(1.0) for row in table.values() if row["positions"]), table
    assert table["after-piece"]["positions"] > 0
    fp32 = check_scenario("reference", scenario, oracle=g1_oracle, source=source, dtype="float32")
    assert "excess" not in fp32.meta


def test_paired_z_is_the_mean_excess_over_atol_in_standard_errors():
    from harness.compare import paired_z

    cand, ref = [0.3, 0.1, 0.2, 0.6], [0.1, 0.1, 0.2, 0.2]
    diffs = [c - 1.5 * r for c, r in zip(cand, ref)]                   # 0.15, -0.05, -0.1, 0.3
    mean = sum(diffs) / 4
    sd = (sum((d - mean) ** 2 for d in diffs) / 3) ** 0.5
    assert paired_z(cand, ref, 1.5, 0.01) == pytest.approx((mean - 0.01) / (sd / 2))
    assert paired_z([0.2], [0.1], 1.5, 0.0) is None
    assert paired_z([0.3, 0.3], [0.1, 0.1], 1.5, 0.0) == float("inf")
    assert paired_z([0.75, 0.75], [0.5, 0.5], 1.5, 0.0) == 0.0 and paired_z([0.5, 0.5], [0.5, 0.5], 1.5, 0.0) < 0


def test_every_class_reports_its_paired_z_a_uniform_excess_far_above_a_noise_floor_copy():
    clean = _judge(lambda p: 1.0).meta["excess"]["classes"]
    doubled = _judge(lambda p: 2.0).meta["excess"]["classes"]
    assert clean["all"]["paired_z"] < -3 and doubled["all"]["paired_z"] > 3
    assert all("paired_z" in row for row in doubled.values())


def _spiky(p: int) -> float:
    """Every eighth position 7.5 times the noise floor's error, the rest at it: the class means just over the ratio
    limit, set by a handful of positions."""
    return 7.5 if p % 8 == 0 else 1.0


def test_a_ratio_over_the_limit_that_a_few_positions_set_passes_on_its_paired_z_and_fails_by_the_ratio_alone():
    report = _judge(_spiky)
    row = report.meta["excess"]["classes"]["all"]
    assert row["judged"] and row["ratio"] > EXCESS_RATIO and row["over_ratio"], row        # the premise
    assert 0 < row["paired_z"] < EXCESS_Z and not row["failed"]
    assert "all" not in {f.where for f in report.failures if f.what == "excess"}, report.message()
    assert report.meta["excess"]["z_limit"] == EXCESS_Z
    ratio_alone = _judge(_spiky, z_limit=None)
    assert ratio_alone.meta["excess"]["classes"]["all"]["failed"]
    message = next(f for f in ratio_alone.failures if f.where == "all").message()
    assert "paired z" not in message and f"limit {EXCESS_RATIO:g}× + 0)" in message


def test_an_excess_past_the_ratio_alone_bound_fails_though_a_few_positions_set_it():
    """Every eighth position 20 times the noise floor's error: paired z stays small, the ratio is far past 2."""
    report = _judge(lambda p: 20.0 if p % 8 == 0 else 1.0)
    row = report.meta["excess"]["classes"]["all"]
    assert row["ratio"] > EXCESS_RATIO_ALONE and row["paired_z"] < EXCESS_Z, row          # the premise
    assert row["failed"]
    message = next(f for f in report.failures if f.where == "all").message()
    assert f"over {EXCESS_RATIO_ALONE:g}× whatever its paired z ({row['paired_z']:.2f})" in message
    assert report.meta["excess"]["ratio_alone"] == EXCESS_RATIO_ALONE


def test_the_same_excess_spread_over_every_position_fails_on_its_paired_z():
    """The spiky candidate's mean excess, moved onto every position: same ratio, and now significant."""
    spiky = _judge(_spiky).meta["excess"]["classes"]["all"]
    even = _judge(lambda p: spiky["ratio"]).meta["excess"]["classes"]["all"]
    assert even["ratio"] == pytest.approx(spiky["ratio"], rel=0.1)
    assert even["paired_z"] > EXCESS_Z and even["failed"]


def test_a_class_whose_paired_z_is_not_a_number_fails():
    """An infinite error makes the mean infinite and z NaN: that must fail, not pass by a comparison with NaN."""
    class Row:
        request_id, positions, deltas = "r", list(range(1, 41)), [0.1] * 39 + [float("inf")]
    classes = {"r": {name: set(range(1, 41)) for name in ("all", "prompt")}}
    noise = NoiseFloor("bfloat16", {"r": [0.1] * 40}, classes)
    row = excess_table([Row()], noise)["all"]
    assert row["judged"] and row["failed"] and not row["paired_z"] == row["paired_z"]


def test_the_oracle_takes_a_finite_z_limit_or_none():
    from harness.runner import Oracle

    for bad in ("3", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="excess_z: expected a finite number or None"):
            Oracle("unused", excess_z=bad)


@pytest.mark.parametrize("args, message", [
    (["--excess-z", "three"], "--excess-z three: expected a number (3, 2.5) or none"),
    (["--excess-z", "nan"], "--excess-z nan: expected a number"),
    (["--excess-z", "inf"], "--excess-z inf: expected a number"),
    (["--excess-z", "2", "--against", "reference"], "--excess-z 2: not with --against"),
])
def test_the_cli_refuses_an_excess_z_it_cannot_use(args, message, g1_checkpoint, tmp_path, capsys):
    from harness.cli import main as cli_main

    code = cli_main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint), "--scenarios",
                     "batching-alone", "--out", str(tmp_path / "out"), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, expected", [(None, EXCESS_Z), ("none", None), ("2.5", 2.5)])
def test_the_report_says_which_excess_rule_judged(value, expected, g1_checkpoint, tmp_path, capsys):
    from harness.cli import main as cli_main

    code = cli_main(["compare", "--engine", "reference", "--dtype", "bfloat16", "--checkpoint", str(g1_checkpoint),
                     "--scenarios", "batching-alone", "--out", str(tmp_path),
                     *(["--excess-z", value] if value else [])])
    assert code == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["excess_z"] == expected and report["scenarios"][0]["excess"]["z_limit"] == expected



@pytest.mark.parametrize("ratio", [1.0, 1.1, 1.25, 1.5, 2.0])
def test_the_paired_z_at_any_ratio_comes_from_a_classs_moments_as_from_its_positions(ratio):
    """excess_table keeps each class's variances and covariance, so that another ratio limit can be weighed on runs
    already made (mutants.scale's lower limits): the z from them is paired_z on the positions themselves."""
    from harness.compare import paired_z, paired_z_at

    gen = torch.Generator().manual_seed(7)
    ref = (0.05 + 0.3 * torch.rand(200, generator=gen, dtype=torch.float64)).tolist()
    cand = [r * (1.2 + 0.4 * float(u)) for r, u in zip(ref, torch.rand(200, generator=gen, dtype=torch.float64))]
    n = len(cand)
    cm, rm = sum(cand) / n, sum(ref) / n
    row = {"positions": n, "candidate_mean": cm, "reference_mean": rm,
           "candidate_var": sum((c - cm) ** 2 for c in cand) / (n - 1),
           "reference_var": sum((r - rm) ** 2 for r in ref) / (n - 1),
           "covariance": sum((c - cm) * (r - rm) for c, r in zip(cand, ref)) / (n - 1)}
    assert paired_z_at(row, ratio, 1e-5) == pytest.approx(paired_z(cand, ref, ratio, 1e-5), rel=1e-9)
    # every class of a judged report carries the moments, and at the report's own ratio they give its paired_z
    table = _judge(lambda p: 1.0 + 0.8 * (p % 3)).meta["excess"]["classes"]
    for name, entry in table.items():
        if entry["positions"] >= 2:
            assert paired_z_at(entry, EXCESS_RATIO, 0.0) == pytest.approx(entry["paired_z"], rel=1e-9, abs=1e-9), name


def test_the_paired_z_at_a_ratio_is_none_or_infinite_where_paired_z_is():
    from harness.compare import paired_z_at

    one = {"positions": 1, "candidate_mean": 0.2, "reference_mean": 0.1, "candidate_var": 0.0, "reference_var": 0.0,
           "covariance": 0.0}
    assert paired_z_at(one, 1.5, 0.0) is None
    constant = dict(one, positions=2)                           # every difference 0.2 - r·0.1: no spread
    assert paired_z_at(constant, 1.5, 0.0) == float("inf") and paired_z_at(constant, 3.0, 0.0) == float("-inf")
    assert paired_z_at(constant, 2.0, 0.0) == 0.0


def test_the_excess_verdict_is_over_the_ratio_and_then_the_z_or_the_ratio_alone():
    from harness.compare import excess_verdict

    common = dict(ratio=1.5, atol=0.0, z_limit=3.0, ratio_alone=2.0)
    assert excess_verdict(True, 0.14, 0.1, 5.0, **common) == (False, False)          # under the limit
    assert excess_verdict(True, 0.16, 0.1, 2.0, **common) == (True, False)           # over it, z too small
    assert excess_verdict(True, 0.16, 0.1, 3.5, **common) == (True, True)            # z over 3
    assert excess_verdict(True, 0.21, 0.1, 0.5, **common) == (True, True)            # over 2x whatever z
    assert excess_verdict(True, 0.16, 0.1, None, **common) == (True, True)           # z not defined
    assert excess_verdict(False, 0.5, 0.1, 9.0, **common) == (False, False)          # not judged
    assert excess_verdict(True, 0.16, 0.1, 0.0, **dict(common, z_limit=None)) == (True, True)   # the ratio alone
