"""pytest wiring: the `--engine` option and the (engine, scenario) parametrization of harness tests.

Register it once in the root conftest.py:

    pytest_plugins = ["harness.pytest_plugin"]

Then `pytest --engine transformers -k chunked_prefill` runs exactly the chunked-prefill cases of that engine. Without
--engine (or before the plugin is registered) every available engine is tested. A test module opts in with

    def pytest_generate_tests(metafunc):
        parametrize_cases(metafunc, model_config)

and takes a `case` argument: an (engine name, Scenario) pair whose test id is "<engine>-<scenario id>"; the case
carries the scenario's markers (tp, cudagraph, gpu) and `slow` where the scenario is slow or the engine declares
itself slow without a GPU (Engine.slow_on_cpu) and there is none.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from reference.config import ModelConfig

from .adapters import available_engines, engine_names, get_engine
from .scenarios import build_scenarios


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("bamba-harness").addoption(
        "--engine", action="append", default=[], metavar="NAME[,NAME]",
        help="engine(s) whose harness cases run (repeatable); default: every available engine")


def selected_engines(config: pytest.Config) -> list[str]:
    """The engines named with --engine (unknown names are a usage error), else every available one that is not
    opt-in (Engine.opt_in: vllm and server run only when named)."""
    names = [n.strip() for value in config.getoption("--engine", default=None) or [] for n in value.split(",")]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in engine_names()]
    if unknown:
        raise pytest.UsageError(f"--engine {unknown[0]!r}: expected one of {', '.join(engine_names())}")
    return names or [name for name, problem in available_engines().items()
                     if problem is None and not get_engine(name).opt_in]


def scenario_cases(engines: Iterable[str], model: ModelConfig, kinds: Iterable[str] | None = None) -> list:
    """pytest.param((engine, scenario)) for every engine × scenario of `model` (of the given kinds), marked `slow`
    where the scenario is slow, or where the engine declares itself slow without a GPU and there is none."""
    kinds = set(kinds) if kinds is not None else None
    available = available_engines()
    params = []
    for engine in engines:
        slow_engine = (not torch.cuda.is_available() and available.get(engine) is None
                       and get_engine(engine).slow_on_cpu)
        for scenario in build_scenarios(model):
            if kinds is not None and scenario.kind not in kinds:
                continue
            marks = [getattr(pytest.mark, m) for m in scenario.marks]
            params.append(pytest.param((engine, scenario), id=f"{engine}-{scenario.id}",
                                       marks=marks + ([pytest.mark.slow] if scenario.slow or slow_engine else [])))
    return params


def parametrize_cases(metafunc: pytest.Metafunc, model: ModelConfig, kinds: Iterable[str] | None = None) -> None:
    """Parametrize the `case` argument of a test over the selected engines × the model's scenarios."""
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", scenario_cases(selected_engines(metafunc.config), model, kinds))
