"""The meta-test that keeps the config zoo honest (harness/zoo.py).

Every field of reference.config.ModelConfig, enumerated from the dataclass itself, either changes the math or is
listed in zoo.NO_MATH_EFFECT with the reason. Each field that changes the math must be set away from its default by a
zoo entry that runs through (a) the vendored engine against the oracle, with prompts and generation
(tests/engine/test_zoo_vs_oracle.py) and (b) the oracle against transformers (tests/reference/
test_against_transformers.py; an entry where transformers is pinned as deviating does not count for it). The same for
the config shapes of zoo.REQUIRED_SHAPES. Removing a zoo entry, or a suite dropping one, makes this fail for whatever
only that entry covered.
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from harness import zoo
from reference.config import FAMILIES, FAMILY_ONLY, ModelConfig
from tests.engine.test_zoo_vs_oracle import ENGINE_FAMILIES, ENGINE_ZOO, smoke_scenario
from tests.reference.test_against_transformers import TRANSFORMERS_DEVIATIONS, TRANSFORMERS_ZOO

DEFAULT = ModelConfig()
MATH_FIELDS = [f.name for f in fields(ModelConfig) if f.name not in zoo.NO_MATH_EFFECT]
SUITES = {
    "engine vs oracle": ENGINE_ZOO,
    "oracle vs transformers": [n for n in TRANSFORMERS_ZOO if n not in TRANSFORMERS_DEVIATIONS],
}
# The families each suite serves: it answers for the fields of those families only (and for model_type when it
# serves more than one).
SUITE_FAMILIES = {"engine vs oracle": ENGINE_FAMILIES, "oracle vs transformers": FAMILIES}


def fields_of(families) -> list[str]:
    others = set().union(*(FAMILY_ONLY[f] for f in FAMILIES if f not in families))
    return [f for f in MATH_FIELDS if f not in others and (f != "model_type" or len(families) > 1)]


def covering(entries: list[str], field: str) -> list[str]:
    return [n for n in entries if getattr(zoo.model_config(n), field) != getattr(DEFAULT, field)]


@pytest.mark.parametrize("suite", list(SUITES))
@pytest.mark.parametrize("field", MATH_FIELDS)
def test_every_math_field_is_non_default_in_a_zoo_entry_of_each_suite(field, suite):
    if field not in fields_of(SUITE_FAMILIES[suite]):
        pytest.skip(f"{field} belongs to a family the {suite} suite does not serve")
    assert covering(SUITES[suite], field), (
        f"ModelConfig.{field}: no zoo entry that the {suite} suite runs sets it away from its default "
        f"{getattr(DEFAULT, field)!r} (add one to harness/zoo.py, or list the field in zoo.NO_MATH_EFFECT with why)")


@pytest.mark.parametrize("suite", list(SUITES))
@pytest.mark.parametrize("shape", list(zoo.REQUIRED_SHAPES))
def test_every_required_config_shape_is_in_each_suite(shape, suite):
    hit = [n for n in SUITES[suite] if zoo.REQUIRED_SHAPES[shape](zoo.model_config(n))]
    assert hit, f"no zoo entry that the {suite} suite runs has {shape}"


def test_fields_without_math_effect_are_real_fields():
    names = {f.name for f in fields(ModelConfig)}
    assert set(zoo.NO_MATH_EFFECT) <= names, set(zoo.NO_MATH_EFFECT) - names
    assert all(reason.strip() for reason in zoo.NO_MATH_EFFECT.values())


def test_the_engine_suite_compares_prompts_and_generation():
    for name in ENGINE_ZOO:
        shapes = smoke_scenario(zoo.model_config(name)).shapes
        assert any(s.prompt_len > 1 for s in shapes) and all(s.max_new_tokens >= 1 for s in shapes), name


def test_removing_an_entry_is_noticed():
    """The check above is not vacuous: with the entries that tie embeddings gone (one per family), and with the
    only NoPE entry gone, those fields have no covering entry."""
    only = covering(ENGINE_ZOO, "tie_word_embeddings")
    assert only == ["tied-embeddings-vocab300", "granite-dense-tied-theta500"]
    assert not covering([n for n in ENGINE_ZOO if n not in only], "tie_word_embeddings")
    nope = covering(ENGINE_ZOO, "position_embedding_type")
    assert [n for n in nope if not zoo.model_config(n).rope] == ["granite-moe8-top1-nope-groups2"]


def test_the_family_fields_are_real_fields_and_each_suite_of_a_family_has_its_shapes():
    names = {f.name for f in fields(ModelConfig)}
    assert all(only <= names for only in FAMILY_ONLY.values())
    for suite, families in SUITE_FAMILIES.items():
        if "granitemoehybrid" not in families:
            continue
        for shape, holds in zoo.GRANITE_REQUIRED_SHAPES.items():
            assert [n for n in SUITES[suite] if holds(zoo.model_config(n))], f"no entry of {suite} has {shape}"
