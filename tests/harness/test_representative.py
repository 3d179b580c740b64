"""make compare's selection, checked where it is used: `make -n compare` gives the command make compare runs; the
scenarios it selects on each tiny model must hold every scenario kind that runs on a CPU, and together every boundary
event the engine can produce. The aliases themselves (harness/scenarios.py, alias_ids) are checked on the config zoo
and the Bamba-9B shape too."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from harness import zoo
from harness.cli import _parser
from harness.events import EVENTS, plan_events, required_events
from harness.scenarios import ALIASES, KINDS, alias_ids, build_scenarios, select_scenarios
from reference.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
MODELS = {**{name: zoo.model_config(name) for name in [*zoo.ZOO, *zoo.GRANITE_ZOO]},
          "tiny-bamba": ModelConfig.from_json(REPO / "fixtures" / "tiny-bamba"),
          "tiny-granite": ModelConfig.from_json(REPO / "fixtures" / "tiny-granite"),
          "bamba-9b-shape": ModelConfig(attn_layer_indices=(9, 18, 27))}


def events_of(scenarios, cfg: ModelConfig) -> set[str]:
    Q, W = cfg.mamba_chunk_size, cfg.mamba_d_conv
    return set().union(*(plan_events(s.shapes, s.options, Q, W) for s in scenarios))


def cpu_kinds(cfg: ModelConfig) -> set[str]:
    """The kinds with a scenario that `all` selects and a CPU runs."""
    return {s.kind for s in build_scenarios(cfg) if not s.slow and not s.opt_in and not s.needs_cuda}


def make_compare_runs() -> list[tuple[Path, str]]:
    """(checkpoint, scenario spec) for each model of the command `make -n compare` prints, paired as the CLI
    pairs them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPARE_", "MAKE"))}
    printed = subprocess.run(["make", "-n", "--no-print-directory", "compare"], cwd=REPO, env=env, check=True,
                             capture_output=True, text=True, timeout=60).stdout
    [line] = [line for line in printed.replace("\\\n", " ").splitlines() if "bamba-harness compare" in line]
    argv = shlex.split(line)
    assert Path(argv[0]).name == "bamba-harness" and argv[1] == "compare", line
    args = _parser().parse_args(argv[1:])
    assert args.engine == "vendored" and args.jobs >= 1
    specs = args.scenarios
    assert len(specs) in (1, len(args.checkpoint)), line
    return [(REPO / checkpoint, specs[i % len(specs)]) for i, checkpoint in enumerate(args.checkpoint)]


def test_make_compare_runs_every_kind_on_both_tiny_models_and_every_event():
    runs = make_compare_runs()
    assert sorted(checkpoint.name for checkpoint, _ in runs) == ["tiny-bamba", "tiny-granite"]
    produced = set()
    for checkpoint, spec in runs:
        cfg = ModelConfig.from_json(checkpoint)
        chosen = select_scenarios(build_scenarios(cfg), spec)
        kinds = {s.kind for s in chosen}
        assert kinds == cpu_kinds(cfg), f"{checkpoint.name} ({spec}): kinds {sorted(kinds)}"
        assert not [s.id for s in chosen if s.needs_cuda or s.slow], "a GPU-only or slow scenario in make compare"
        produced |= events_of(chosen, cfg)
    assert produced == set(EVENTS), f"make compare misses {sorted(set(EVENTS) - produced)}"


def test_the_tiny_models_share_their_schedules():
    """make compare runs boundary-events on one tiny model: the events are the schedule's, the same on both."""
    bamba, granite = MODELS["tiny-bamba"], MODELS["tiny-granite"]
    assert (bamba.mamba_chunk_size, bamba.mamba_d_conv) == (granite.mamba_chunk_size, granite.mamba_d_conv)
    assert alias_ids(bamba.mamba_chunk_size, bamba.mamba_d_conv) == alias_ids(granite.mamba_chunk_size,
                                                                              granite.mamba_d_conv)


@pytest.mark.parametrize("name", ["tiny-bamba", "tiny-granite"])
def test_representative_is_one_scenario_of_each_cpu_kind(name):
    cfg = MODELS[name]
    chosen = select_scenarios(build_scenarios(cfg), "representative")
    assert sorted(s.kind for s in chosen) == sorted(cpu_kinds(cfg))
    assert cpu_kinds(cfg) == set(KINDS) - {"long", "invariance"}, (
        "long has a CPU scenario now (docs/scenarios.md says it has none), or invariance is no longer opt-in")


@pytest.mark.parametrize("name", ["tiny-bamba", "tiny-granite", "bamba-9b-shape"])
def test_boundary_events_alone_produce_every_event(name):
    cfg = MODELS[name]
    chosen = select_scenarios(build_scenarios(cfg), "boundary-events")
    assert events_of(chosen, cfg) == required_events(cfg.mamba_chunk_size, cfg.mamba_d_conv)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_aliases_name_built_scenarios_and_cover_every_event(name):
    cfg = MODELS[name]
    scenarios = build_scenarios(cfg)                     # raises if an alias names an id that is not built
    for alias in ALIASES:
        assert {s.id for s in scenarios if alias in s.aliases} == set(alias_ids(cfg.mamba_chunk_size,
                                                                               cfg.mamba_d_conv)[alias])
    chosen = select_scenarios(scenarios, ",".join(ALIASES))
    assert events_of(chosen, cfg) == required_events(cfg.mamba_chunk_size, cfg.mamba_d_conv)


def test_an_alias_can_be_left_out():
    scenarios = build_scenarios(MODELS["tiny-bamba"])
    left = [s.id for s in select_scenarios(scenarios, "representative,-tp-size2")]
    assert "tp-size2" not in left and len(left) == len(select_scenarios(scenarios, "representative")) - 1
    assert [s.id for s in select_scenarios(scenarios, "all,-representative")] == [
        s.id for s in select_scenarios(scenarios, "all") if "representative" not in s.aliases]
