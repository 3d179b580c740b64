"""The checkpoints llama.cpp is judged on, and its findings (docs/llamacpp.md), in one place for tests/llamacpp and
the reproducers under findings/.

A checkpoint reaches llama.cpp as a user would hand it over: the bundled tiny models, and config-zoo entries
written as transformers saves a model (every config field spelled out). Where llama.cpp cannot take a checkpoint at
all (a finding), the suite also judges the nearest one it can take, so that the rest of llama.cpp is still judged:
Granite with layer_types in the spelling IBM publishes (`published_granite`), zoo entries with a vocabulary rounded
up to a multiple of 8 (`zoo_checkpoint`). Where llama.cpp computes another model than the checkpoint defines (a
finding), the matrix judges it against the oracle of the model it computes (`Case.oracle_fields`: the same weights,
config fields changed), so that every scenario still says whether batching, chunking and state handling are right;
each finding's own test judges it against the real oracle and must fail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reference.config import ModelConfig

from . import zoo
from .variants import variant_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "fixtures"
FINDINGS_DIR = REPO_ROOT / "findings"
# GraniteMoeHybrid's layer names as Granite 4.0-H is published (and as llama.cpp's converter reads them), by the
# names transformers >= 5 writes when it saves the model.
PUBLISHED_LAYER_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}
# The tokenizer workaround the bundled models need (docs/llamacpp.md, finding `pre-tokenizer`).
PRE_TOKENIZER = {"pre_tokenizer": "gpt-2"}


@dataclass(frozen=True)
class Finding:
    """A disagreement of llama.cpp (llama-cpp-python 0.3.36, llama.cpp 0c1e57098) with the model, as measured."""

    id: str
    title: str
    measured: str
    cause: str
    reproducer: str                    # findings/<file>


FINDINGS: dict[str, Finding] = {f.id: f for f in [
    Finding("partial-rope", "Partial RoPE lost: the converter writes no rotary count and permutes Q/K over the "
            "whole head, so llama.cpp rotates every head dim of a Bamba",
            "fixtures/tiny-bamba (RoPE on 16 of 32 dims), f32, flash attention off: max |Δ logprob| 0.93 against a "
            "budget of 1.6e-05 (batching-together), 0.25-0.93 over every scenario, top-1 agreement 91-97%; "
            "config-zoo Bamba entries 3.5-16; with the rotary count alone written (a config with attn_rotary_emb) "
            "still 0.24",
            "converter patch (rotary count R, permutation of the first R rows of each head): within budget; "
            "unpatched, within budget of an oracle given partial_rotary_factor = 1",
            "findings/llamacpp_partial_rope.py"),
    Finding("granite-rope-dropped", "A GraniteMoeHybrid with position_embedding_type 'rope' runs without RoPE: "
            "the converter turns llama.cpp's RoPE switch (rope_scaling.finetuned) on only for Bamba",
            "config-zoo granite-moe4-top2, f32, batching-together: max |Δ logprob| 2.35 against a budget of 2.9e-05 "
            "(Granite 4.0-H, published with NoPE, is not hit)",
            "converter patch (switch from position_embedding_type): within budget; unpatched, within budget of an "
            "oracle given position_embedding_type 'nope'",
            "findings/llamacpp_granite_rope_dropped.py"),
    Finding("time-step-limit", "time_step_limit ignored: neither the converter nor llama.cpp's graph reads it, "
            "so Δ is never clamped",
            "config-zoo, limit (0.15, 0.9), f32, batching-together: max |Δ logprob| 5.2 (dt-limit-both-bounds) and "
            "0.97 (granite-moe4-kv2-attention-first-dt-limit) against budgets of 2.8e-05 and 2.5e-05",
            "within budget of an oracle without the limit; no converter patch can remove it (the clamp is missing "
            "from the graph)",
            "findings/llamacpp_time_step_limit.py"),
    Finding("flash-attention-f16", "Flash attention (on by default: auto) computes an f32 model with an f32 K/V "
            "cache in f16: build_attn_mha casts K and V to f16, and Q follows K's type",
            "fixtures/tiny-granite, f32: max |Δ logprob| 2.6e-04 against a budget of 1.5e-05 (17x); 2.9e-06 with "
            "flash attention off",
            "flash_attn=off is within budget", "findings/llamacpp_flash_attention_f16.py"),
    Finding("granite-layer-types", "A GraniteMoeHybrid saved by transformers >= 5 (layer_types 'linear_attention' / "
            "'full_attention') converts to a GGUF llama.cpp cannot load: the converter knows only 'attention'",
            "fixtures/tiny-granite: check_tensor_dims: tensor 'blk.2.ssm_in.weight' not found",
            "converter patch (both spellings), or the published spelling: loads and is within budget",
            "findings/llamacpp_granite_layer_types.py"),
    Finding("padded-vocabulary", "A vocabulary that is not a multiple of 8 is padded in the token list, not in the "
            "embedding and output matrices: the GGUF does not load",
            "config-zoo, 97 tokens: tensor 'token_embd.weight' has wrong shape; expected 64, 104, got 64, 97",
            "converter patch (no padding): loads and is within budget", "findings/llamacpp_padded_vocabulary.py"),
    Finding("pre-tokenizer", "The converter refuses every tokenizer it does not know by hash, so no model with a "
            "tokenizer of its own converts; of the names a user may try, 'gpt2' converts but does not load",
            "fixtures/tiny-bamba and tiny-granite: BPE pre-tokenizer was not recognized; with 'gpt2': unknown "
            "pre-tokenizer type: 'gpt2'",
            "opt-in workaround --engine-arg pre_tokenizer=gpt-2 (token ids, so the logprobs judged, are unchanged)",
            "findings/llamacpp_refusals.py"),
    Finding("head-dim", "An attention head_dim other than hidden_size / heads is dropped by the converter "
            "('Ignoring head_dim'): the GGUF does not load",
            "config-zoo head-dims-8-heads-state5 (head_dim 48, hidden 64, 2 heads): tensor 'blk.1.attn_q.weight' "
            "has wrong shape; expected 64, 64, got 64, 96", "GraniteModel.set_gguf_parameters pops head_dim", "findings/llamacpp_refusals.py"),
    Finding("biases", "Bias tensors (mamba_proj_bias, attention_bias, mlp_bias) are converted but llama.cpp's "
            "graph has no place for them: the GGUF does not load",
            "config-zoo conv-width3-all-biases: done_getting_tensors: wrong number of tensors; expected 55, got 51",
            "granite-hybrid.cpp creates no bias tensors", "findings/llamacpp_refusals.py"),
    Finding("conv-width-2", "A conv width of 2 converts, then the process that loads it dies (SIGSEGV) instead of "
            "refusing it", "config-zoo conv-width2-no-conv-bias: the worker process dies of signal 11 at load",
            "a crash in llama.cpp's context set-up", "findings/llamacpp_refusals.py"),
    Finding("mamba-d-head-auto", "mamba_d_head = 'auto' (BambaConfig's default) crashes the converter",
            "config-zoo d-head-auto-expand3-chunk5: TypeError: unsupported operand type(s) for %: 'int' and 'str'",
            "GraniteHybridModel.set_gguf_parameters takes d_head as a number", "findings/llamacpp_refusals.py"),
    Finding("mamba-expand", "mamba_expand other than 2 converts, then aborts the process that loads it",
            "config-zoo d-head-auto-expand3-chunk5 with mamba_d_head 48: GGML_ASSERT(2 * n_embd == d_inner) failed",
            "granite-hybrid.cpp hard-codes an expansion of 2", "findings/llamacpp_refusals.py"),
    Finding("pure-mamba2", "A Bamba without attention layers (attn_layer_indices = []) is refused by the converter: "
            "an empty list reads as absent",
            "config-zoo pure-mamba2: AssertionError: Didn't find attn_layer_indices or attn_layer_period",
            "GraniteHybridModel.get_attn_layers", "findings/llamacpp_refusals.py"),
    Finding("granite-dense", "A dense GraniteMoeHybrid (num_local_experts 0) whose shared_intermediate_size differs "
            "from intermediate_size does not load: the shared MLP is written as the dense FFN, which llama.cpp "
            "sizes by intermediate_size",
            "config-zoo granite-dense-tied-theta500: tensor 'blk.0.ffn_gate.weight' has wrong shape; expected 64, "
            "48, got 64, 40", "GraniteMoeModel.modify_tensors", "findings/llamacpp_refusals.py"),
]}


@dataclass(frozen=True)
class Refusal:
    """A checkpoint llama.cpp cannot run at all: how to make it, and what llama.cpp says (a regex)."""

    finding: str
    about: str
    says: str
    fixture: str | None = None                     # a bundled model, else `zoo` (a config-zoo entry)
    zoo: str | None = None
    fields: tuple[tuple[str, object], ...] = ()    # config fields changed (harness/variants.py)
    round_vocab: bool = True
    engine_args: tuple[tuple[str, str], ...] = ()

    def checkpoint(self, root: Path) -> Path:
        """The checkpoint, written under `root` (once)."""
        if self.fixture is not None:
            base = FIXTURES / self.fixture
        else:
            base = zoo_checkpoint(self.zoo, root / f"{self.zoo}{'' if self.round_vocab else '-vocab-as-is'}",
                                  round_vocab=self.round_vocab)
        if not self.fields:
            return base
        target = root / f"{base.name}-{self.finding}"
        return target if target.is_dir() else variant_checkpoint(base, target, **dict(self.fields))


REFUSALS: list[Refusal] = [
    Refusal("pre-tokenizer", "tiny-bamba as it is", r"BPE pre-tokenizer was not recognized", fixture="tiny-bamba"),
    Refusal("pre-tokenizer", "tiny-bamba, pre-tokenizer named 'gpt2'", r"unknown pre-tokenizer type: 'gpt2'",
            fixture="tiny-bamba", engine_args=(("pre_tokenizer", "gpt2"),)),
    Refusal("granite-layer-types", "tiny-granite as transformers 5 saved it",
            r"tensor 'blk\.2\.ssm_in\.weight' not found", fixture="tiny-granite",
            engine_args=tuple(PRE_TOKENIZER.items())),
    Refusal("padded-vocabulary", "granite-moe8-top1-nope-groups2, 97 tokens",
            r"tensor 'token_embd\.weight' has wrong shape", zoo="granite-moe8-top1-nope-groups2", round_vocab=False),
    Refusal("head-dim", "head-dims-8-heads-state5", r"tensor 'blk\.1\.attn_q\.weight' has wrong shape",
            zoo="head-dims-8-heads-state5"),
    Refusal("biases", "conv-width3-all-biases", r"wrong number of tensors", zoo="conv-width3-all-biases"),
    Refusal("conv-width-2", "conv-width2-no-conv-bias", r"died of signal SIGSEGV", zoo="conv-width2-no-conv-bias"),
    Refusal("mamba-d-head-auto", "d-head-auto-expand3-chunk5", r"unsupported operand type\(s\) for %",
            zoo="d-head-auto-expand3-chunk5"),
    Refusal("mamba-expand", "d-head-auto-expand3-chunk5, mamba_d_head 48",
            r"GGML_ASSERT\(2 \* n_embd == d_inner\) failed", zoo="d-head-auto-expand3-chunk5",
            fields=(("mamba_d_head", 48),)),
    Refusal("pure-mamba2", "pure-mamba2", r"Didn't find attn_layer_indices or attn_layer_period", zoo="pure-mamba2"),
    Refusal("granite-dense", "granite-dense-tied-theta500", r"tensor 'blk\.0\.ffn_gate\.weight' has wrong shape",
            zoo="granite-dense-tied-theta500"),
]


def published_granite(src: str | Path, dst: str | Path | None = None) -> Path:
    """A GraniteMoeHybrid checkpoint with layer_types in the published spelling ('mamba', 'attention'); the same
    model for every reader that knows both spellings (the oracle does)."""
    config = json.loads((Path(src) / "config.json").read_text())
    types = [PUBLISHED_LAYER_NAMES.get(t, t) for t in config["layer_types"]]
    return variant_checkpoint(src, dst, layer_types=types)


def as_saved_by_transformers(directory: Path) -> None:
    """Add to directory/config.json every field transformers writes when it saves the model and the file leaves out
    (a zoo entry writes only what it varies; llama.cpp's converter reads some fields with no default, such as
    rms_norm_eps). Fields the file has are kept; ValueError if the oracle would read another model."""
    from transformers import AutoConfig

    path = directory / "config.json"
    original = json.loads(path.read_text())
    before = ModelConfig.from_json(directory)
    saved = json.loads(AutoConfig.from_pretrained(directory).to_json_string())
    if "rope_parameters" not in original:        # RoPE given at the top level: keep it the only place
        saved.pop("rope_parameters", None)
    saved.pop("layer_types", None) if "layer_types" not in original else None
    path.write_text(json.dumps({**saved, **original}, indent=1))
    after = ModelConfig.from_json(directory)
    changed = {k for k in before.__dataclass_fields__ if k != "extra_ignored"
               and getattr(before, k) != getattr(after, k)}
    if changed:
        raise ValueError(f"{directory}: transformers' defaults change {sorted(changed)}")


def zoo_checkpoint(name: str, directory: str | Path, *, round_vocab: bool = True) -> Path:
    """Config-zoo entry `name` as llama.cpp is given it: config.json as transformers saves it, Granite layer names in
    the published spelling, and (round_vocab) the vocabulary rounded up to a multiple of 8 (finding
    `padded-vocabulary`: llama.cpp cannot load any other). Written once per directory."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    cfg = zoo.model_config(name)
    fields = {"vocab_size": -(-cfg.vocab_size // 8) * 8} if round_vocab else {}
    raw = directory.with_name(directory.name + "-raw")
    zoo.write_checkpoint(name, raw, **fields)
    as_saved_by_transformers(raw)
    if name in zoo.GRANITE_ZOO:
        return published_granite(raw, directory)
    raw.rename(directory)
    return directory


def oracle_fields_for(cfg: ModelConfig) -> tuple[dict, list[str]]:
    """The config fields of the model llama.cpp computes for a checkpoint of this config, and the findings that
    make it another model: a GraniteMoeHybrid's RoPE dropped, a Bamba's RoPE on the whole head, Δ not clamped."""
    fields, findings = {}, []
    if cfg.rope and cfg.attn_layer_indices and cfg.granite:
        fields["position_embedding_type"] = "nope"
        findings.append("granite-rope-dropped")
    elif cfg.rope and cfg.attn_layer_indices and cfg.rotary_dim != cfg.attn_head_dim:
        fields["partial_rotary_factor"] = 1.0
        findings.append("partial-rope")
    if cfg.time_step_limit != (0.0, float("inf")):
        fields["time_step_limit"] = None                                  # the default: (0, inf)
        findings.append("time-step-limit")
    return fields, findings


def judge(checkpoint: str | Path, *, oracle_checkpoint: str | Path | None = None,
          scenario: str = "batching-together", dtype: str = "float32", source=None, **engine_args):
    """One scenario of llama.cpp on `checkpoint` against the fp64 oracle of `oracle_checkpoint` (default: the same),
    flash attention off unless engine_args say otherwise: a Report (harness/compare.py). For the reproducers."""
    from .runner import Oracle, check_scenario
    from .scenarios import PromptSource, build_scenarios, select_scenarios
    from .adapters.llamacpp import LlamaCppEngine

    cfg = ModelConfig.from_json(checkpoint)
    if source is None:
        prompts = FIXTURES / "prompts.jsonl"
        source = (PromptSource.from_jsonl(prompts, cfg.vocab_size) if cfg.vocab_size == 512
                  else PromptSource(cfg.vocab_size, seed=0))
    chosen = select_scenarios(build_scenarios(cfg, LlamaCppEngine), scenario)[0]
    oracle = Oracle(oracle_checkpoint or checkpoint)
    try:
        return check_scenario(LlamaCppEngine, chosen, oracle=oracle, source=source, dtype=dtype,
                              engine_args={"flash_attn": "off", **engine_args}, candidate_checkpoint=checkpoint)
    finally:
        oracle.close()


def refusal(checkpoint: str | Path, **engine_args) -> str | None:
    """What llama.cpp (its converter, its loader, or the process that died loading it) says when it cannot run
    `checkpoint`; None when it runs one request."""
    from .adapters.llamacpp import LlamaCppEngine
    from .engine import Request

    try:
        with LlamaCppEngine(checkpoint, options=_options(engine_args)) as engine:
            engine.run([Request("probe", (1, 2, 3), 1)])
    except Exception as err:                     # noqa: BLE001 - what it says is the point
        return f"{type(err).__name__}: {err}"
    return None


def _options(engine_args: dict):
    from .engine import EngineOptions

    return EngineOptions(engine_args={"flash_attn": "off", **engine_args})


def findings_markdown() -> str:
    """docs/llamacpp.md's findings table (tests/harness/test_llamacpp_adapter.py keeps the page equal)."""
    lines = ["| finding | what | measured | cause shown by | reproducer |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{f.id}` | {f.title} | {f.measured} | {f.cause} | [{Path(f.reproducer).name}](../{f.reproducer}) |"
              for f in FINDINGS.values()]
    return "\n".join(lines)
