"""lm-eval model_args are checked by name before anything loads: one line, every known option listed, the nearest
one suggested. Before, a misspelt option surfaced from the adapter once the engine was being built (74 s into an
lm-eval run, in a 30-line traceback) and the adapter's list of what it knows left out the engine options."""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import fields

import pytest

pytest.importorskip("lm_eval")

from harness.adapters import available_engines, get_engine  # noqa: E402
from harness.engine import EngineOptions  # noqa: E402
from harness.lm_eval import BambaHarnessLM, LmEvalInputError, check_model_args, run_lm_eval  # noqa: E402

# A checkpoint that does not exist: an error about the option, not about this path, shows nothing was loaded.
NOWHERE = "/nonexistent/bamba-checkpoint"
ENGINES = [name for name, problem in available_engines().items() if problem is None]


def _valid_model_args(engine: str) -> set[str]:
    """What the model accepts, gathered from where each kind of option is defined: BambaHarnessLM's named
    parameters, every EngineOptions field but engine_args, and the adapter's engine_arg_names."""
    own = {name for name, p in inspect.signature(BambaHarnessLM.__init__).parameters.items()
           if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    knobs = {f.name for f in fields(EngineOptions)} - {"engine_args"}
    return own | knobs | set(get_engine(engine).engine_arg_names)


def _listed(message: str) -> set[str]:
    return set(message.split("; known: ", 1)[1].split(", "))


@pytest.mark.parametrize("misspelt, meant", [("max_num_seq", "max_num_seqs"), ("gated_nrom", "gated_norm"),
                                             ("tensor_paralel_size", "tensor_parallel_size"),
                                             ("max_gen_tokens", "max_gen_toks")])
def test_a_misspelt_model_arg_fails_at_once_with_the_option_meant(misspelt, meant):
    started = time.monotonic()
    with pytest.raises(LmEvalInputError) as caught:
        BambaHarnessLM(engine="reference", checkpoint=NOWHERE, **{misspelt: 2})
    assert time.monotonic() - started < 2.0
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"model_args {misspelt} (did you mean {meant}?): unknown to bamba-harness with "
                              "engine reference; known: ")
    assert meant in _listed(message)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_known_options_listed_are_every_valid_one(engine):
    with pytest.raises(LmEvalInputError) as caught:
        check_model_args({"engine": engine, "no_such_option": 1})
    assert _listed(str(caught.value)) == _valid_model_args(engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_valid_option_passes_the_check(engine):
    check_model_args({name: 1 for name in _valid_model_args(engine)} | {"engine": engine})


class _Stop(Exception):
    pass


class _RecordingEngine:
    """Stands for an engine class: the real one's engine_arg_names, and a constructor that records the options it
    is given and stops there."""

    def __init__(self, real) -> None:
        self.engine_arg_names = real.engine_arg_names
        self.options: EngineOptions | None = None

    def __call__(self, checkpoint, *, dtype, device, options):
        self.options = options
        raise _Stop


def test_engine_options_reach_the_engine_and_the_rest_its_engine_args(monkeypatch):
    """Told apart by name: an option added to EngineOptions is an engine option here without a change."""
    engine = _RecordingEngine(get_engine("reference"))
    monkeypatch.setattr("harness.lm_eval.get_engine", lambda name: engine)
    with pytest.raises(_Stop):
        BambaHarnessLM(engine="reference", checkpoint=NOWHERE, max_num_seqs=3, long_prefill_token_threshold=4,
                       cuda_graphs=1, gated_norm="full")
    options = engine.options
    assert (options.max_num_seqs, options.long_prefill_token_threshold, options.cuda_graphs) == (3, 4, True)
    assert dict(options.engine_args) == {"gated_norm": "full"}


def test_a_misspelt_engine_is_named_with_the_nearest():
    with pytest.raises(LmEvalInputError, match=r"model_args engine=vendord: no such engine \(did you mean "
                                               r"vendored\?\); known: reference, "):
        check_model_args({"engine": "vendord"})


def test_the_command_line_checks_model_args_before_lm_eval_starts(capsys, monkeypatch):
    """One line on stderr and exit status 2, before lm-eval's task indexing (its entry point must not be called)."""
    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval was started"))
    started = time.monotonic()
    status = run_lm_eval(["--model_args", f"engine=vendored,checkpoint={NOWHERE},parallel_timeout=5",
                          "--tasks", "bamba_tiny_cloze"])
    assert time.monotonic() - started < 2.0
    err = capsys.readouterr().err
    assert status == 2
    assert re.fullmatch(r"bamba-harness lm-eval: error: model_args parallel_timeout \(did you mean "
                        r"parallel_timeout_s\?\): unknown to bamba-harness with engine vendored; known: .*\n", err)


def test_the_command_line_leaves_other_models_alone(monkeypatch):
    import lm_eval.__main__

    called = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: called.append(True))
    assert run_lm_eval(["--model", "hf", "--model_args", "pretrained=x,whatever=1", "--tasks", "t"]) == 0
    assert called == [True]
