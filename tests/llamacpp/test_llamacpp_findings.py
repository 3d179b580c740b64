"""llama.cpp's findings (harness/llamacpp_cases.FINDINGS, docs/llamacpp.md), each pinned two ways:

- a strict expected failure that asserts what the model defines (llama.cpp matches the real oracle, or runs the
  checkpoint at all) and carries the measured number: it fails while the finding holds, and turns into a failure of
  the suite (XPASS, strict) the day llama.cpp changes;
- its cause: the same run with the finding's converter patch (findings/llamacpp_*.py, applied only here) or judged
  against the model llama.cpp computes instead, which must pass.

Only an AssertionError counts as the expected failure: a crash of the harness or a refusal for another reason than
the pinned one fails the test."""

from __future__ import annotations

import re

import pytest

from harness.llamacpp_cases import (FINDINGS, FIXTURES, PRE_TOKENIZER, REFUSALS, judge, oracle_fields_for,
                                    published_granite, refusal, zoo_checkpoint)
from harness.variants import variant_checkpoint
from reference.config import ModelConfig

PATCHES = {finding.id: FIXTURES.parent / finding.reproducer for finding in FINDINGS.values()}


def pinned(finding: str):
    return pytest.mark.xfail(strict=True, raises=AssertionError,
                             reason=f"finding {finding}: {FINDINGS[finding].measured}")


def _assert_matches(report):
    assert report.passed, (f"max |Δ logprob| {report.max_delta:.3g} against a budget of {report.meta['budget']:.3g}"
                           f"\n{report.message()}")


@pytest.fixture(scope="module")
def zoo_model(llamacpp_root):
    """name -> the zoo entry as llama.cpp is given it (round_vocab=False: its vocabulary as the entry has it)."""
    def make(name: str, round_vocab: bool = True):
        suffix = "" if round_vocab else "-vocab-as-is"
        return zoo_checkpoint(name, llamacpp_root / f"{name}{suffix}", round_vocab=round_vocab)
    return make


# ---- partial RoPE (Bamba) ---------------------------------------------------------------------------------------

@pinned("partial-rope")
def test_partial_rope_matches_oracle():
    _assert_matches(judge(FIXTURES / "tiny-bamba", **PRE_TOKENIZER))


def test_partial_rope_cause_converter_patch():
    _assert_matches(judge(FIXTURES / "tiny-bamba", convert_patch=str(PATCHES["partial-rope"]), **PRE_TOKENIZER))


def test_partial_rope_cause_whole_head_rotated():
    tiny = FIXTURES / "tiny-bamba"
    _assert_matches(judge(tiny, oracle_checkpoint=variant_checkpoint(tiny, partial_rotary_factor=1.0),
                          **PRE_TOKENIZER))


# ---- GraniteMoeHybrid RoPE dropped ------------------------------------------------------------------------------

@pinned("granite-rope-dropped")
def test_granite_rope_matches_oracle(zoo_model):
    _assert_matches(judge(zoo_model("granite-moe4-top2")))


def test_granite_rope_cause_converter_patch(zoo_model):
    _assert_matches(judge(zoo_model("granite-moe4-top2"), convert_patch=str(PATCHES["granite-rope-dropped"])))


# ---- time_step_limit ignored ------------------------------------------------------------------------------------

DT_LIMIT_MODELS = ("dt-limit-both-bounds", "granite-moe4-kv2-attention-first-dt-limit")


def _oracle_of_llamacpp(checkpoint, *, keep: str | None = None):
    """The oracle of what llama.cpp computes for `checkpoint`, except the field `keep` (kept as the checkpoint has it)."""
    fields, _ = oracle_fields_for(ModelConfig.from_json(checkpoint))
    fields.pop(keep, None)
    return variant_checkpoint(checkpoint, **fields)


@pinned("time-step-limit")
@pytest.mark.parametrize("name", DT_LIMIT_MODELS)
def test_time_step_limit_matches_oracle(name, zoo_model):
    model = zoo_model(name)
    _assert_matches(judge(model, oracle_checkpoint=_oracle_of_llamacpp(model, keep="time_step_limit")))


@pytest.mark.parametrize("name", DT_LIMIT_MODELS)
def test_time_step_limit_cause_unclamped(name, zoo_model):
    model = zoo_model(name)
    _assert_matches(judge(model, oracle_checkpoint=_oracle_of_llamacpp(model)))


# ---- flash attention in f16 -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_granite_published(llamacpp_root):
    return published_granite(FIXTURES / "tiny-granite", llamacpp_root / "tiny-granite-published")


@pinned("flash-attention-f16")
def test_flash_attention_f32_matches_oracle(tiny_granite_published):
    _assert_matches(judge(tiny_granite_published, flash_attn="on", kv_type="f32", **PRE_TOKENIZER))


def test_flash_attention_cause_off(tiny_granite_published):
    _assert_matches(judge(tiny_granite_published, flash_attn="off", kv_type="f32", **PRE_TOKENIZER))


# ---- converted files llama.cpp cannot load, with a converter patch that loads them ------------------------------

def test_granite_layer_types_cause_converter_patch():
    _assert_matches(judge(FIXTURES / "tiny-granite", convert_patch=str(PATCHES["granite-layer-types"]),
                          **PRE_TOKENIZER))


def test_padded_vocabulary_cause_converter_patch(zoo_model):
    _assert_matches(judge(zoo_model("granite-moe8-top1-nope-groups2", round_vocab=False),
                          convert_patch=str(PATCHES["padded-vocabulary"])))


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [pytest.param(c, marks=pinned(c.finding), id=f"{c.finding}-{c.about}")
                                  for c in REFUSALS])
def test_llamacpp_runs_checkpoint(case, llamacpp_root):
    said = refusal(case.checkpoint(llamacpp_root), **dict(case.engine_args))
    if said is not None and not re.search(case.says, said):
        pytest.fail(f"refused, but not as finding {case.finding} says ({case.says!r}): {said}")
    assert said is None, said


def test_pre_tokenizer_workaround_loads():
    assert refusal(FIXTURES / "tiny-bamba", **PRE_TOKENIZER) is None


@pinned("partial-rope")
def test_partial_rope_rotary_count_alone_matches_oracle():
    """A config.json that carries the rotary count (attn_rotary_emb) is not enough: the permutation spans the
    whole head."""
    patch = f"{PATCHES['partial-rope']}::apply_rotary_count_only"
    _assert_matches(judge(FIXTURES / "tiny-bamba", convert_patch=patch, **PRE_TOKENIZER))
