"""make test-llamacpp: llama.cpp (llama-cpp-python built from its sdist, own virtualenv) against the fp64 oracle.

These tests start llama.cpp worker processes and its converter, so they run only when llamacpp is named with
`--engine llamacpp` (make test-llamacpp does); under `make test` they are skipped with that reason.

The checkpoints (harness/llamacpp_cases.py): the bundled tiny models and config-zoo entries, each judged against the
oracle of the model llama.cpp computes for it (`judged_against`): where a finding makes llama.cpp compute another
model (RoPE, Δ's clamp), the matrix still says whether batching, chunking and state handling are right, and the
finding's own test (test_llamacpp_findings.py) judges it against the real oracle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import zoo
from harness.llamacpp_cases import FIXTURES, PRE_TOKENIZER, oracle_fields_for, published_granite, zoo_checkpoint
from harness.runner import Oracle
from harness.scenarios import PromptSource
from harness.variants import variant_checkpoint
from reference.config import ModelConfig

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    named = {n.strip() for value in config.getoption("--engine", default=None) or [] for n in value.split(",")}
    if "llamacpp" in named:
        return
    skip = pytest.mark.skip(reason="starts llama.cpp: runs with --engine llamacpp (make test-llamacpp)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@dataclass
class Model:
    """A checkpoint as llama.cpp gets it, the oracle it is judged against, its prompts and engine_args."""

    checkpoint: Path
    oracle: Oracle
    source: PromptSource
    engine_args: dict
    findings: list[str]

    @property
    def cfg(self) -> ModelConfig:
        return ModelConfig.from_json(self.checkpoint)


# The bundled models, as llama.cpp can take them: tiny-granite with its layer names as Granite 4.0-H is published
# (finding granite-layer-types), both with the pre-tokenizer workaround (finding pre-tokenizer).
TINY_MODELS = ("tiny-bamba", "tiny-granite")
# The config-zoo entries llama.cpp runs (the others are refusals: harness/llamacpp_cases.REFUSALS).
ZOO_MODELS = ("rope-theta500-rotary1-gqa4to2", "dt-limit-both-bounds", "tied-embeddings-vocab300",
              "groups2-kv-heads-equal-q-heads", "groups-equal-heads", "attention-first-4-layers",
              "attention-last-2-layers", "attention-all-but-one", "rms-eps0.1-pad-in-prompts", "granite-moe4-top2",
              "granite-moe8-top1-nope-groups2", "granite-moe4-kv2-attention-first-dt-limit", "granite-rotary0.5")


@pytest.fixture(scope="session")
def llamacpp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llamacpp")


_models: dict[str, Model] = {}


@pytest.fixture(scope="session")
def llamacpp_model(llamacpp_root):
    """model name -> Model, built once per session (per xdist worker)."""

    def get(name: str) -> Model:
        if name not in _models:
            if name in TINY_MODELS:
                checkpoint = FIXTURES / name
                if name == "tiny-granite":
                    checkpoint = published_granite(checkpoint, llamacpp_root / name)
                source = PromptSource.from_jsonl(FIXTURES / "prompts.jsonl", ModelConfig.from_json(checkpoint)
                                                 .vocab_size)
                args = dict(PRE_TOKENIZER)
            else:
                checkpoint = zoo_checkpoint(name, llamacpp_root / name)
                source, args = zoo.prompt_source(name), {}
            fields, findings = oracle_fields_for(ModelConfig.from_json(checkpoint))
            judged = variant_checkpoint(checkpoint, llamacpp_root / f"{name}-as-computed", **fields) if fields \
                else checkpoint
            _models[name] = Model(checkpoint, Oracle(judged), source, {"flash_attn": "off", **args}, findings)
        return _models[name]

    yield get
    for model in _models.values():
        model.oracle.close()
