"""The opt-in `invariance` scenario (harness/runner.py, check_invariance; harness/invariance.py): the same requests
under several engine configurations must give bit-identical results, and the baseline configuration must pass the
oracle judgement. An engine that passes (the reference in its batch-invariant mode), engines that fail either part
(the reference's and the vendored engine's default modes, planted faults), the bitwise comparison itself, the skip of
an engine that promises nothing, and the selection that keeps the scenario out of `all`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.adapters.reference import ReferenceEngine
from harness.adapters.vendored import VendoredEngine
from harness.cli import main, planned_steps
from harness.engine import EngineOptions, Request, result_from_logprobs
from harness.events import plan_events
from harness.invariance import FIELDS, first_difference
from harness.pytest_plugin import scenario_cases
from harness.runner import ScenarioSkipped, check_against, check_scenario
from harness.scenarios import build_scenarios, invariance_shapes, select_scenarios
from harness.schedule import RequestShape
from reference.config import ModelConfig
from tests.engine.conftest import tiny_oracle, tiny_prompts  # noqa: F401  (shared fixtures)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny-bamba"
TINY_CFG = ModelConfig.from_json(TINY)
Q, W = TINY_CFG.mamba_chunk_size, TINY_CFG.mamba_d_conv
INVARIANCE = next(s for s in build_scenarios(TINY_CFG) if s.kind == "invariance")
CONFIGS = {c.name: c for c in INVARIANCE.configurations}




def reduced(*names: str, shapes: tuple[RequestShape, ...] | None = None):
    """The tiny model's invariance scenario with only the named configurations (the first the baseline)."""
    return replace(INVARIANCE, configurations=tuple(CONFIGS[n] for n in names),
                   shapes=INVARIANCE.shapes if shapes is None else shapes)


# ---- an engine that keeps the promise ---------------------------------------------------------------------------

def test_the_reference_in_its_batch_invariant_mode_passes_through_the_cli(tmp_path, capsys):
    """`compare --scenarios invariance` on tiny-bamba: every configuration that runs on a CPU is bit-identical to
    the baseline, which passes the oracle; cudagraph-on is left out, and the report and the table say so."""
    code = main(["compare", "--engine", "reference", "--dtype", "float64", "--checkpoint", str(TINY),
                 "--scenarios", "invariance", "--engine-arg", "batch_invariant=1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    [entry] = json.loads((tmp_path / "report.json").read_text())["scenarios"]
    assert (entry["scenario"], entry["verdict"]) == (f"invariance-Q{Q}", "PASS")
    inv = entry["invariance"]
    assert inv["oracle_passed"] and inv["invariant"] and inv["first_difference"] is None
    status = {c["name"]: c["status"] for c in inv["configurations"]}
    assert status == {"alone": "baseline", "together": "identical", "shuffled": "identical",
                      "neighbours": "identical", f"budget{Q - 1}": "identical", f"budget{Q}": "identical",
                      f"budget{Q + 1}": "identical", "budget3": "identical", "preempted": "identical",
                      "cudagraph-on": "left out"}
    assert "needs a CUDA device" in inv["left_out"]["cudagraph-on"][0]
    assert [r["request_id"] for r in entry["requests"]] == [f"r{i}-len{s.prompt_len}"
                                                            for i, s in enumerate(INVARIANCE.shapes)]
    assert (f"invariance-Q{Q}: baseline alone against the oracle: PASS; 8 configurations compared with it: "
            "8 identical, 0 differ") in printed
    assert "left out: cudagraph-on: needs a CUDA device" in printed


# ---- engines that break it --------------------------------------------------------------------------------------

def test_the_references_packed_steps_are_not_bit_invariant(tiny_oracle, tiny_prompts):
    """The reference's default mode packs every piece of a step into one matmul, and the CPU's fp64 matmuls round a
    row differently with the rows beside it: right (the oracle part passes) and not invariant (the other part
    fails, naming its first difference), with a hint at the mode the engine declares."""
    scenario = reduced("alone", "together", f"budget{Q}")
    report = check_scenario("reference", scenario, oracle=tiny_oracle, source=tiny_prompts, dtype=torch.float64)
    inv = report.meta["invariance"]
    assert not report.passed and inv["oracle_passed"] and not inv["invariant"]
    assert [f.what for f in report.failures] == ["invariance", "invariance"]
    first = inv["first_difference"]
    assert (first["baseline"], first["other"]) == ("alone", "together")
    assert report.failures[0].message() == f"{scenario.id}: {first['message']}"
    assert "--engine-arg batch_invariant=1" in report.meta["hint"] and "engine args: none" in report.meta["hint"]


class OneUlpUnderBudget(ReferenceEngine):
    """The reference in its batch-invariant mode, but with a token budget of Q per step the logprob of request 2 at
    prompt position 5 comes out one unit in the last place higher: far inside the oracle's budget, a broken
    promise all the same."""

    name = "one-ulp"

    def _run(self, requests):
        results = super()._run(requests)
        if self.options.max_num_batched_tokens == Q:
            for res in results:
                if res.request_id.startswith("r2-"):
                    value = res.prompt_logprobs[4]
                    res.prompt_logprobs[4] = torch.nextafter(value, torch.tensor(0.0, dtype=value.dtype))
        return results


def test_one_ulp_in_one_configuration_fails_with_its_first_difference(tiny_oracle, tiny_prompts):
    scenario = reduced("alone", "together", f"budget{Q}")
    report = check_scenario(OneUlpUnderBudget, scenario, oracle=tiny_oracle, source=tiny_prompts,
                            dtype=torch.float64, engine_args={"batch_invariant": "1"})
    inv = report.meta["invariance"]
    assert inv["oracle_passed"] and not inv["invariant"] and not report.passed
    assert {c["name"]: c["status"] for c in inv["configurations"]} == {
        "alone": "baseline", "together": "identical", f"budget{Q}": "differs"}
    [failure] = report.failures
    assert (failure.request_id, failure.position, failure.where, failure.what) == (
        f"r2-len{Q - 1}", 5, "prompt", "invariance")
    first = inv["first_difference"]
    assert (first["field"], first["baseline"], first["other"]) == ("logprob", "alone", f"budget{Q}")
    a, b = first["baseline_value"], first["other_value"]
    assert b == float(torch.nextafter(torch.tensor(a, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    assert failure.message() == (f"{scenario.id}: request 'r2-len{Q - 1}' position 5 (prompt): logprob differs between "
                                 f"configurations alone and budget{Q}: alone {a!r}, budget{Q} {b!r}, difference "
                                 f"{b - a!r}")


class WrongEverywhere(ReferenceEngine):
    """Invariant and wrong: every prompt logprob 1e-3 too high, in every configuration alike."""

    name = "wrong-everywhere"

    def _run(self, requests):
        results = super()._run(requests)
        for res in results:
            res.prompt_logprobs += 1e-3
        return results


def test_an_invariant_engine_that_is_wrong_fails_the_oracle_part(tiny_oracle, tiny_prompts):
    report = check_scenario(WrongEverywhere, reduced("alone", "together"), oracle=tiny_oracle, source=tiny_prompts,
                            dtype=torch.float64, engine_args={"batch_invariant": "1"})
    inv = report.meta["invariance"]
    assert not report.passed and not inv["oracle_passed"] and inv["invariant"]
    assert report.failures and {f.what for f in report.failures} == {"logprob"}
    baseline = inv["configurations"][0]
    assert (baseline["name"], baseline["status"], baseline["oracle"]) == ("alone", "baseline", "FAIL")


class DefaultVendored(VendoredEngine):
    """The vendored engine in its default mode, held to the promise (whether or not the adapter declares a mode:
    this test runs it without the mode's engine arg)."""

    batch_invariance = "declared by tests/harness/test_invariance.py for its default mode"


def test_the_vendored_engines_default_mode_fails_with_a_named_first_difference(tiny_oracle, tiny_prompts):
    """Two requests (W-1 and Q+1 tokens, 2 new each) alone, together and under a budget of Q: its batched attention
    and matmuls round with the batch, so it is right (the oracle part passes) and not invariant. Under the Triton
    interpreter about 20 s."""
    scenario = reduced("alone", "together", f"budget{Q}", shapes=(RequestShape(W - 1, 2), RequestShape(Q + 1, 2)))
    report = check_scenario(DefaultVendored, scenario, oracle=tiny_oracle, source=tiny_prompts, dtype=torch.float32)
    inv = report.meta["invariance"]
    assert inv["oracle_passed"] and not inv["invariant"] and not report.passed
    first = inv["first_difference"]
    assert first["request_id"] in (f"r0-len{W - 1}", f"r1-len{Q + 1}") and first["field"] in FIELDS
    assert (first["baseline"], first["other"]) == ("alone", "together")
    T = int(first["request_id"].split("len")[1])
    assert first["where"] == ("prompt" if first["position"] < T else f"generated step {first['position'] - T}")
    failure = report.failures[0]
    assert failure.what == "invariance" and (failure.request_id, failure.position) == (first["request_id"],
                                                                                        first["position"])
    assert failure.message() == f"{scenario.id}: {first['message']}"
    assert "differs between configurations alone and together: alone " in failure.message()


# ---- the bitwise comparison -------------------------------------------------------------------------------------

def _results(seed: int = 0):
    """Three requests (prompts of 1, 4 and 6 tokens, 3 generated each) and results with full rows."""
    gen = torch.Generator().manual_seed(seed)
    requests = [Request(f"r{i}-len{n}", tuple(range(1, n + 1)), 3, 4, full_distributions=True)
                for i, n in enumerate((1, 4, 6))]
    results = []
    for req in requests:
        rows = torch.log_softmax(torch.randn(len(req.prompt) - 1 + 3, 11, generator=gen, dtype=torch.float64), -1)
        results.append(result_from_logprobs(req, rows, rows[len(req.prompt) - 1:].argmax(-1).tolist()))
    return requests, results


def _copy(results):
    return [replace(r, **{f: getattr(r, f).clone() for f in ("prompt_logprobs", "prompt_top_ids",
                                                               "prompt_top_logprobs", "output_logprobs",
                                                               "output_top_ids", "output_top_logprobs",
                                                               "prompt_dists", "output_dists")},
                    output_ids=list(r.output_ids)) for r in results]


def _first(requests, a, b):
    return first_difference(requests, a, b, baseline_name="alone", other_name="together")


def test_identical_results_and_ignored_neighbours_have_no_difference():
    requests, results = _results()
    neighbour = replace(_results(1)[1][2], request_id="n0-len6")
    assert _first(requests, results, [neighbour, *reversed(_copy(results))]) is None


def test_one_bit_in_a_prompt_logprob_is_named():
    requests, results = _results()
    other = _copy(results)
    value = other[2].prompt_logprobs[3]
    other[2].prompt_logprobs[3] = torch.nextafter(value, torch.tensor(-1.0, dtype=torch.float64))
    found = _first(requests, results, other)
    assert (found.request_id, found.position, found.where, found.field, found.index) == (
        "r2-len6", 4, "prompt", "logprob", None)
    assert found.other_value == float(other[2].prompt_logprobs[3]) != found.baseline_value
    assert found.message() == (f"request 'r2-len6' position 4 (prompt): logprob differs between configurations "
                               f"alone and together: alone {found.baseline_value!r}, together {found.other_value!r}, "
                               f"difference {found.other_value - found.baseline_value!r}")


def test_the_first_request_then_the_earliest_position_then_the_field_order():
    requests, results = _results()
    other = _copy(results)
    other[2].prompt_logprobs[0] += 1.0                                 # request 2, position 1
    other[1].output_top_logprobs[1, 2] += 1e-9                         # request 1, position 5 (generated step 1)
    other[1].output_ids[1] = (other[1].output_ids[1] + 1) % 11         # the same position's token
    found = _first(requests, results, other)
    assert (found.request_id, found.position, found.where, found.field) == ("r1-len4", 5, "generated step 1",
                                                                            "token")
    other[1].output_ids[1] = results[1].output_ids[1]
    found = _first(requests, results, other)
    assert (found.field, found.index) == ("top logprobs", 2)
    assert "top logprobs at rank 2 differs" in found.message()


def test_top_ids_distributions_and_a_one_token_prompt():
    requests, results = _results()
    other = _copy(results)
    other[0].output_top_ids[0, 3] = (other[0].output_top_ids[0, 3] + 1) % 11     # r0: a one-token prompt
    found = _first(requests, results, other)
    assert (found.request_id, found.position, found.where, found.field, found.index) == (
        "r0-len1", 1, "generated step 0", "top ids", 3)
    assert isinstance(found.baseline_value, int) and "difference" not in found.message()
    other = _copy(results)
    other[1].prompt_dists[2, 7] += 1e-12
    found = _first(requests, results, other)
    assert (found.position, found.field, found.index) == (3, "distribution", 7)
    assert "distribution of token 7 differs" in found.message()


def test_nan_equals_only_nan_at_the_same_place():
    requests, results = _results()
    both = [_copy(results), _copy(results)]
    for side in both:
        side[1].prompt_logprobs[1] = float("nan")
    assert _first(requests, *both) is None
    both[1][1].prompt_logprobs[2] = float("nan")                                   # NaN against a number
    found = _first(requests, *both)
    assert (found.request_id, found.position, found.field) == ("r1-len4", 3, "logprob")
    assert repr(found.other_value) == "nan" and "difference nan" in found.message()


def test_missing_results_and_other_lengths_are_differences():
    requests, results = _results()
    found = _first(requests, results, [results[0], results[2]])
    assert (found.request_id, found.field, found.other_value) == ("r1-len4", "result", "none")
    shorter = _copy(results)
    r = shorter[2]
    shorter[2] = replace(r, output_ids=r.output_ids[:2], output_logprobs=r.output_logprobs[:2],
                         output_top_ids=r.output_top_ids[:2], output_top_logprobs=r.output_top_logprobs[:2],
                         output_dists=r.output_dists[:2])
    found = _first(requests, results, shorter)
    assert (found.request_id, found.position, found.where, found.field) == ("r2-len6", 8, "generated step 2",
                                                                            "shape")


# ---- who is held to the promise, and where it runs --------------------------------------------------------------

class Undeclared(ReferenceEngine):
    name = "undeclared"
    batch_invariance = None


def test_an_engine_that_declares_no_mode_is_skipped_unless_asked(tiny_oracle, tiny_prompts):
    with pytest.raises(ScenarioSkipped, match="undeclared does not declare a batch-invariant mode"):
        check_scenario(Undeclared, INVARIANCE, oracle=tiny_oracle, source=tiny_prompts, dtype=torch.float64)
    report = check_scenario(Undeclared, reduced("alone", "together"), oracle=tiny_oracle, source=tiny_prompts,
                            dtype=torch.float64, engine_args={"batch_invariant": "1"})
    assert report.passed and report.meta["invariance"]["declared"] is None


def test_the_cli_skips_an_engine_that_promises_nothing(tmp_path, capsys):
    code = main(["compare", "--engine", "transformers", "--checkpoint", str(TINY), "--scenarios", "invariance",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 5, captured.out
    [entry] = json.loads((tmp_path / "report.json").read_text())["scenarios"]
    assert entry["verdict"] == "SKIP"
    assert entry["skipped"][0].startswith("transformers does not declare a batch-invariant mode")


def test_without_another_configuration_to_compare_the_scenario_is_skipped(tiny_oracle, tiny_prompts):
    with pytest.raises(ScenarioSkipped, match="no configuration but the baseline .alone. can run here.*cudagraph-on: "
                                              "needs a CUDA device"):
        check_scenario("reference", reduced("alone", "cudagraph-on"), oracle=tiny_oracle, source=tiny_prompts,
                       dtype=torch.float64, device="cpu", engine_args={"batch_invariant": "1"})


def test_checks_against_another_engine_refuse_it(tiny_oracle, tiny_prompts):
    with pytest.raises(ScenarioSkipped, match="compares one engine's runs bit for bit"):
        check_against("reference", INVARIANCE, against="reference", oracle=tiny_oracle, source=tiny_prompts)


def test_the_reference_refuses_a_batch_invariant_value_it_cannot_read():
    reasons = ReferenceEngine.unsupported(EngineOptions(engine_args={"batch_invariant": "maybe"}),
                                          dtype=torch.float64, device="cpu")
    assert reasons == ["batch_invariant: expected one of 1, true, yes, on, 0, false, no, off, got 'maybe'"]


# ---- selection and the workload ---------------------------------------------------------------------------------

def test_all_leaves_it_out_and_its_kind_or_id_selects_it():
    scenarios = build_scenarios(TINY_CFG)
    assert INVARIANCE.opt_in and not INVARIANCE.slow and INVARIANCE.id == f"invariance-Q{Q}"
    assert INVARIANCE.id not in [s.id for s in select_scenarios(scenarios, "all")]
    assert INVARIANCE.id not in [s.id for s in select_scenarios(scenarios, "-batching")]
    assert [s.id for s in select_scenarios(scenarios, "invariance")] == [INVARIANCE.id]
    assert [s.id for s in select_scenarios(scenarios, INVARIANCE.id)] == [INVARIANCE.id]
    assert [s.id for s in select_scenarios(scenarios, "batching-together,invariance")] == ["batching-together",
                                                                                          INVARIANCE.id]
    assert select_scenarios(scenarios, "invariance,-invariance") == []
    assert not [p for p in scenario_cases(["reference"], TINY_CFG) if "invariance" in p.id]
    assert [p.id for p in scenario_cases(["reference"], TINY_CFG, kinds=["invariance"])] == [
        f"reference-invariance-Q{Q}"]


@pytest.mark.parametrize("Q_,W_", [(16, 4), (8, 2), (4, 4), (256, 4), (1, 4)])
def test_the_workload_straddles_chunk_boundaries_and_each_configuration_does_what_it_says(Q_, W_):
    cfg = replace(TINY_CFG, mamba_chunk_size=Q_, mamba_d_conv=W_)
    scenario = next(s for s in build_scenarios(cfg) if s.kind == "invariance")
    assert {s.prompt_len for s in scenario.shapes} == {max(n, 1) for n in (1, W_ - 1, Q_ - 1, Q_ + 1, 2 * Q_ + 3,
                                                                           3 * Q_ + 2)}
    assert all(s.max_new_tokens >= 2 and s.arrival_step == 0 for s in scenario.shapes)
    events = {name: plan_events(shapes, options, Q_, W_) for name, options, shapes in scenario.workloads()}
    assert scenario.configurations[0].options == scenario.options == EngineOptions(max_num_seqs=1)
    assert "recompute_across_chunk" in events["preempted"]
    budgets = [name for name in events if name.startswith("budget")]
    assert budgets == [f"budget{b}" for b in dict.fromkeys((Q_ - 1, Q_, Q_ + 1, 3)) if b >= 1]
    assert {"split@Q-1", "split@Q", "split@Q+1"} <= set().union(*(events[name] for name in budgets))
    assert [len(shapes) for name, _, shapes in scenario.workloads() if name == "neighbours"] == [
        len(scenario.shapes) + 2]
    assert [c.name for c in scenario.configurations if c.needs_cuda] == ["cudagraph-on"]
    assert planned_steps(scenario) == sum(planned_steps(replace(scenario, configurations=(c,)))
                                          for c in scenario.configurations)


def test_shuffled_and_neighbours_present_the_same_judged_requests(tiny_prompts):
    judged = INVARIANCE.requests(tiny_prompts)
    shuffled = CONFIGS["shuffled"].requests(judged, tiny_prompts)
    assert sorted(shuffled, key=lambda r: r.request_id) == sorted(judged, key=lambda r: r.request_id)
    assert [r.request_id for r in shuffled] != [r.request_id for r in judged]
    beside = CONFIGS["neighbours"].requests(judged, tiny_prompts)
    assert beside[2:] == judged and [r.request_id for r in beside[:2]] == [f"n0-len{2 * Q + 1}", f"n1-len{W + 1}"]
    assert invariance_shapes(Q, W) == INVARIANCE.shapes
