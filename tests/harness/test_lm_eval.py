"""harness/lm_eval.py and harness/lm_eval_gate.py: the lm-eval model over harness engines, the bamba_tiny tasks
(fixtures/tasks) loaded offline from another working directory, and the accuracy / perplexity gate.

The agreement test runs a few items of each task through the oracle and through transformers on the tiny model and
compares every item: transformers computes the full-width gated norm, so its oracle is the reference with
gated_norm=full (docs/findings.md); both then compute the same model, fp64 against fp32.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from harness.lm_eval import (  # noqa: E402
    BambaHarnessLM,
    LmEvalInputError,
    cut_at_stops,
    lm_eval_argv,
    rolling_windows,
)
from harness.lm_eval_gate import judge, oracle_for, wilson_interval  # noqa: E402
from reference.model import BambaReference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "fixtures" / "tiny-bamba"
TASKS_DIR = REPO / "fixtures" / "tasks"
TASKS = ["bamba_tiny_cloze", "bamba_tiny_ppl", "bamba_tiny_lines"]
LIMIT = 6
# fp32 transformers vs the fp64 oracle on the tiny model: per-token |Δ logprob| is below 2e-4 (test_tiny_model.py);
# a summed continuation of at most 16 tokens stays below 16 x that.
LOGPROB_ATOL = 16 * 2e-4


def instance(*args):
    """What the model reads of an lm-eval Instance: its arguments."""
    return SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def oracle_lm():
    lm = BambaHarnessLM(engine="reference", checkpoint=str(TINY), batch_size=8)
    yield lm
    lm.close()


# ---- pieces -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens, max_length", [(1, 2), (7, 2), (10, 4), (12, 4), (5, 100)])
def test_rolling_windows_score_every_token_once_within_max_length(n_tokens, max_length):
    tokens = list(range(10, 10 + n_tokens))
    windows = rolling_windows(tokens, 0, max_length)
    assert windows[0][0][0] == 0
    assert all(len(prompt) <= max_length and n == len(prompt) - 1 for prompt, n in windows)
    scored = [t for prompt, n in windows for t in prompt[len(prompt) - n:]]
    assert scored == tokens
    # each window is conditioned on the token just before its first scored one
    sequence = [0, *tokens]
    position = 0
    for prompt, n in windows:
        assert prompt == sequence[position:position + n + 1]
        position += n


def test_rolling_windows_refuse_a_context_of_one_token():
    with pytest.raises(LmEvalInputError, match="max_length: rolling windows need at least 2 tokens, got 1"):
        rolling_windows([1, 2], 0, 1)


def test_cut_at_stops_cuts_at_the_earliest_stop():
    assert cut_at_stops("abc\ndef;gh", ["\n", ";"]) == "abc"
    assert cut_at_stops("abc;def\ngh", ["\n", ";"]) == "abc"
    assert cut_at_stops("abc", ["\n", ""]) == "abc"


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-5)
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.40383, abs=1e-5) and hi == pytest.approx(0.59617, abs=1e-5)
    lo, hi = wilson_interval(7, 7)
    assert hi == 1.0 and lo == pytest.approx(0.64567, abs=1e-5)
    with pytest.raises(ValueError, match="expected 0 <= successes <= n"):
        wilson_interval(3, 2)


def test_judge_accuracy_inside_and_outside_the_wilson_interval():
    lo, hi = wilson_interval(32, 64)
    assert judge("e", "t", "acc,none", 64, 0.5, hi - 1e-6).verdict == "PASS"
    assert judge("e", "t", "acc,none", 64, 0.5, lo - 1e-3).verdict == "FAIL"
    assert judge("e", "t", "exact_match,strict-match", 64, 0.5, hi + 1e-3).verdict == "FAIL"


def test_judge_perplexity_within_half_a_percent():
    assert judge("e", "t", "word_perplexity,none", 8, 100.0, 100.49).verdict == "PASS"
    assert judge("e", "t", "byte_perplexity,none", 8, 100.0, 99.4).verdict == "FAIL"
    assert judge("e", "t", "bits_per_byte,none", 8, 1.0, 2.0).verdict == "INFO"


def test_transformers_is_judged_against_the_full_norm_oracle_when_groups_exceed_one():
    assert oracle_for({"engine": "transformers"}, {"engine": "reference"}, TINY) == {"engine": "reference",
                                                                                      "gated_norm": "full"}
    assert oracle_for({"engine": "vendored"}, {"engine": "reference"}, TINY) == {"engine": "reference"}


def test_lm_eval_argv_adds_the_model_device_and_batch_size_only_where_missing():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert lm_eval_argv(["--tasks", "x"]) == ["run", "--model", "bamba-harness", "--device", device,
                                              "--batch_size", "64", "--tasks", "x"]
    assert lm_eval_argv(["run", "--model=hf", "--batch_size", "2", "--device", "cpu"]) == [
        "run", "--model=hf", "--batch_size", "2", "--device", "cpu"]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks"]


def test_bamba_harness_lm_eval_is_lm_evals_command_line(capsys):
    from harness.cli import main

    assert main(["lm-eval", "run", "--help"]) == 0
    assert "--model_args" in capsys.readouterr().out


# ---- the model --------------------------------------------------------------------------------------------------
def test_unknown_engine_argument_is_refused_by_name():
    with pytest.raises(LmEvalInputError, match=r"model_args nonsense: unknown to bamba-harness with engine reference"):
        BambaHarnessLM(engine="reference", checkpoint=str(TINY), nonsense=1)


def test_auto_batch_size_is_refused():
    with pytest.raises(LmEvalInputError, match="batch_size = 'auto'"):
        BambaHarnessLM(engine="reference", checkpoint=str(TINY), batch_size="auto")


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"until": ["\n"], "do_sample": True}, "decode greedily only"),
    ({"until": ["\n"], "temperature": 0.7}, "decode greedily only"),
    ({"until": ["\n"], "top_p": 0.9}, r"generation kwargs \['top_p'\]: not understood"),
], ids=["do_sample", "temperature", "top_p"])
def test_generation_other_than_greedy_is_refused(oracle_lm, gen_kwargs, message):
    with pytest.raises(LmEvalInputError, match=message):
        oracle_lm.generate_until([instance("def f(x):", gen_kwargs)])


def test_loglikelihood_is_the_oracles_sum_and_greedy_flag(oracle_lm):
    model = BambaReference.from_pretrained(TINY)
    context, continuation = "def main():", "\n    return"   # no trailing space: lm-eval would move it
    ctx, whole = oracle_lm.tok_encode(context), oracle_lm.tok_encode(context + continuation)
    n = len(whole) - len(ctx)
    logprobs = model.prompt_logprobs(whole)                               # (T-1,)
    [(got, greedy)] = oracle_lm.loglikelihood([instance(context, continuation)])
    assert got == pytest.approx(float(logprobs[-n:].sum()), abs=1e-9)
    logits, _ = model.forward(whole)                                       # (T, V)
    assert greedy == (logits[len(whole) - n - 1:-1].argmax(-1).tolist() == whole[-n:])


def test_rolling_loglikelihood_sums_windows_of_max_length(oracle_lm):
    model = BambaReference.from_pretrained(TINY)
    text = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"
    tokens = oracle_lm.tok_encode(text)
    whole = float(model.prompt_logprobs([oracle_lm.prefix_token_id, *tokens]).sum())
    [got] = oracle_lm.loglikelihood_rolling([instance(text)])
    assert got == pytest.approx(whole, abs=1e-9)
    short = BambaHarnessLM(engine="reference", checkpoint=str(TINY), max_length=8)
    expected = sum(float(model.prompt_logprobs(prompt)[-n:].sum())
                   for prompt, n in rolling_windows(tokens, short.prefix_token_id, 8))
    [windowed] = short.loglikelihood_rolling([instance(text)])
    short.close()
    assert windowed == pytest.approx(expected, abs=1e-9)
    assert windowed < whole           # less context: the text is less likely


def test_generate_until_is_the_greedy_continuation_cut_at_the_stop(oracle_lm):
    model = BambaReference.from_pretrained(TINY)
    context = "def main(argv):\n    "
    tokens, _ = model.greedy(oracle_lm.tok_encode(context), 12)
    full = oracle_lm.tokenizer.decode(tokens)
    [got] = oracle_lm.generate_until([instance(context, {"until": ["("], "max_gen_toks": 12})])
    assert got == full.split("(")[0]


# ---- the tasks, offline from another directory, oracle against transformers ------------------------------------
def _samples(model_args: dict, task_manager) -> dict:
    import lm_eval

    lm = BambaHarnessLM(checkpoint=str(TINY), batch_size=32, **model_args)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=task_manager, limit=LIMIT,
                                      bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    finally:
        lm.close()
    return out


def test_tasks_agree_between_the_oracle_and_transformers(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.chdir(tmp_path)                   # the tasks resolve their data files themselves
    assert not (Path(os.getcwd()) / "bamba_tiny_cloze").exists()
    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert set(TASKS) <= set(task_manager.all_tasks)
    oracle = _samples({"engine": "reference", "gated_norm": "full"}, task_manager)
    candidate = _samples({"engine": "transformers"}, task_manager)

    for task in TASKS:
        assert oracle["results"][task]["sample_len"] == candidate["results"][task]["sample_len"] == LIMIT
        for want, got in zip(oracle["samples"][task], candidate["samples"][task], strict=True):
            assert want["doc_id"] == got["doc_id"]
            if task == "bamba_tiny_lines":
                assert got["filtered_resps"] == want["filtered_resps"], f"{task} item {want['doc_id']}"
                continue
            for w, g in zip(want["filtered_resps"], got["filtered_resps"], strict=True):
                w_value, g_value = (w[0], g[0]) if isinstance(w, (list, tuple)) else (w, g)
                assert math.isclose(g_value, w_value, abs_tol=LOGPROB_ATOL), (
                    f"{task} item {want['doc_id']}: transformers {g_value}, oracle {w_value}")
        for metric, value in oracle["results"][task].items():
            if "," in metric and "_stderr" not in metric:
                assert candidate["results"][task][metric] == pytest.approx(value, rel=1e-4), f"{task} {metric}"
