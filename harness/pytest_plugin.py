"""pytest wiring: the `--engine` option and the (engine, scenario) parametrization of harness tests.

Register it once in the root conftest.py:

    pytest_plugins = ["harness.pytest_plugin"]

Then `pytest --engine transformers -k chunked_prefill` runs exactly the chunked-prefill cases of that engine. Without
--engine (or before the plugin is registered) every available engine is tested. A test module opts in with

    def pytest_generate_tests(metafunc):
        parametrize_cases(metafunc, model_config)

and takes a `case` argument: an (engine name, Scenario) pair whose test id is "<engine>-<scenario id>"; the case
carries the scenario's markers (tp, cudagraph, gpu) and `slow` where the scenario is slow or the engine declares
itself slow without a GPU (Engine.slow_on_cpu) and there is none, and is skipped where the engine does not serve the
model's family. Several models at once (Bamba and GraniteMoeHybrid checkpoints, say):
`parametrize_cases(metafunc, {"tiny-bamba": cfg_a, "tiny-granite": cfg_b})`, and the test takes `model_name` too;
its ids are "<model name>-<engine>-<scenario id>".

A session in which every selected harness case was skipped checked nothing: a green run that means "no engine was
available" is how a broken setup passes CI. The terminal summary says so, and the session exits 5 (pytest's "no
tests", the number `bamba-harness compare` uses for the same thing) unless --allow-skips is given. An xfailed case
ran, so it counts as checked; tests without a `case` argument do not count either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest
import torch

from reference.config import ModelConfig

from .adapters import available_engines, engine_names, get_engine
from .scenarios import build_scenarios


# A test report's attribute that marks it as a harness case's (it travels with the report to the xdist controller).
CASE_ATTRIBUTE = "bamba_harness_case"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bamba-harness")
    group.addoption("--engine", action="append", default=[], metavar="NAME[,NAME]",
                    help="engine(s) whose harness cases run (repeatable); default: every available engine")
    group.addoption("--allow-skips", action="store_true", default=False,
                    help="exit 0, not 5, when every selected harness case was skipped")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):          # the xdist controller (or a plain session) sees every report
        config.pluginmanager.register(SkipAudit(config), "bamba-harness-skip-audit")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item):
    report = yield
    callspec = getattr(item, "callspec", None)
    # the kernel tests' own `case` parameter (their input cases) is not a harness case: skipping all of it under a
    # peer (--ops) must not read as "nothing checked"
    if callspec is not None and "case" in callspec.params and item.path.parent.parts[-2:] != ("tests", "kernels"):
        setattr(report, CASE_ATTRIBUTE, True)
    return report


class SkipAudit:
    """Whether every harness case of the session was skipped; if so, says it and turns exit 0 into 5."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skipped: dict[str, bool] = {}         # nodeid -> a phase of the case was skipped (not an xfail)
        self.exit_changed = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, CASE_ATTRIBUTE, False):
            skipped = report.skipped and not hasattr(report, "wasxfail")
            self.skipped[report.nodeid] = self.skipped.get(report.nodeid, False) or skipped

    def nothing_checked(self) -> bool:
        return bool(self.skipped) and all(self.skipped.values())

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.OK and self.nothing_checked() and not self.config.getoption("allow_skips"):
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
            self.exit_changed = True

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.nothing_checked():
            return
        line = f"bamba-harness: nothing checked: all {len(self.skipped)} selected harness cases were skipped"
        if self.exit_changed:
            terminalreporter.write_line(f"{line} (exit status 5; --allow-skips accepts that)", red=True, bold=True)
        else:
            terminalreporter.write_line(line, yellow=True, bold=True)


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
    where the scenario is slow, or where the engine declares itself slow without a GPU and there is none, and
    skipped where the engine does not serve the model's family (Engine.families). An opt-in scenario (invariance)
    is a case only where `kinds` names its kind: like `--scenarios all`, every engine × every scenario leaves it
    out, since it checks a promise an engine makes by declaring it, not correctness."""
    kinds = set(kinds) if kinds is not None else None
    available = available_engines()
    params = []
    for engine in engines:
        adapter = get_engine(engine)
        slow_engine = not torch.cuda.is_available() and available.get(engine) is None and adapter.slow_on_cpu
        other_family = ([pytest.mark.skip(reason=f"{engine} serves {' and '.join(adapter.families)} checkpoints, "
                                                 f"not {model.model_type}")]
                        if model.model_type not in adapter.families else [])
        for scenario in build_scenarios(model):
            if (scenario.kind not in kinds) if kinds is not None else scenario.opt_in:
                continue
            marks = [getattr(pytest.mark, m) for m in scenario.marks] + other_family
            params.append(pytest.param((engine, scenario), id=f"{engine}-{scenario.id}",
                                       marks=marks + ([pytest.mark.slow] if scenario.slow or slow_engine else [])))
    return params


def parametrize_cases(metafunc: pytest.Metafunc, model: ModelConfig | Mapping[str, ModelConfig],
                      kinds: Iterable[str] | None = None) -> None:
    """Parametrize the `case` argument of a test over the selected engines × the model's scenarios.

    `model` may also map names to models (several checkpoints, of one family or of several): the test then takes a
    `model_name` argument too, and the ids are "<model name>-<engine>-<scenario id>"."""
    if "case" not in metafunc.fixturenames:
        return
    engines = selected_engines(metafunc.config)
    if isinstance(model, ModelConfig):
        metafunc.parametrize("case", scenario_cases(engines, model, kinds))
        return
    if "model_name" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.function.__name__}: parametrize_cases over several models needs a "
                                "`model_name` argument beside `case`")
    params = [pytest.param(name, *param.values, id=f"{name}-{param.id}", marks=param.marks)
              for name, cfg in model.items() for param in scenario_cases(engines, cfg, kinds)]
    metafunc.parametrize("model_name,case", params)
