"""GraniteMoeHybrid through the harness: the oracle's family flows through scenarios, the runner and the judge (the
reference engine in fp32 judged against the fp64 oracle on a Granite zoo model passes, with a budget it calibrates),
and an engine that does not serve a family says so as a skip naming the family rather than running."""

from __future__ import annotations

import pytest

from harness import zoo
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import build_scenarios


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = zoo.write_checkpoint("granite-moe4-kv2-attention-first-dt-limit", tmp_path_factory.mktemp("granite"))
    oracle = Oracle(path)
    yield path, oracle
    oracle.close()


@pytest.mark.parametrize("scenario_id", ["batching-together", "chunked_prefill-budget9-Q8"])
def test_the_reference_in_fp32_passes_against_the_oracle(granite, scenario_id):
    path, oracle = granite
    cfg = zoo.model_config("granite-moe4-kv2-attention-first-dt-limit")
    scenario = next(s for s in build_scenarios(cfg) if s.id == scenario_id)
    report = check_scenario("reference", scenario, oracle=oracle,
                            source=zoo.prompt_source("granite-moe4-kv2-attention-first-dt-limit"), dtype="float32")
    assert report.passed, report.message()
    assert sum(len(c.positions) for c in report.comparisons) > 0
    assert 0 < report.max_delta <= report.meta["budget"]


def test_an_engine_without_the_family_is_a_skip_naming_it(granite, monkeypatch):
    from harness.adapters.vendored import VendoredEngine

    path, oracle = granite
    monkeypatch.setattr(VendoredEngine, "families", ("bamba",))
    scenario = build_scenarios(zoo.model_config("granite-moe4-kv2-attention-first-dt-limit"))[0]
    with pytest.raises(ScenarioSkipped, match="model_type 'granitemoehybrid': vendored serves bamba checkpoints only"):
        check_scenario("vendored", scenario, oracle=oracle, source=zoo.prompt_source("granite-moe4-top2"))


def test_list_says_which_engines_serve_the_checkpoints_family(granite, capsys):
    from harness import cli

    path, _ = granite
    assert cli.main(["list", "--checkpoint", str(path)]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("engine ")}
    assert "unavailable: serves bamba checkpoints, not granitemoehybrid" in lines["server"]
    assert "serves" not in lines["reference"] and "serves" not in lines["vendored"]
