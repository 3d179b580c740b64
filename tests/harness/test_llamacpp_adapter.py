"""The llama.cpp adapter's own logic, without llama.cpp (make test): the slot plan, the conversion cache and the
converter's refusals (a stand-in converter), the errors it reads from llama.cpp's log, the options it refuses, its
scenarios, and the checkpoint variants the findings use. llama.cpp itself is judged by tests/llamacpp."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.adapters import llamacpp
from harness.adapters.llamacpp import (ConversionError, LlamaCppEngine, converter_message, load_error,
                                       slot_plan, source_provenance)
from harness.engine import EngineOptions
from harness.scenarios import build_scenarios, select_scenarios
from harness.schedule import RequestShape, plan_steps
from harness.variants import variant_checkpoint
from reference.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "tiny-bamba"


def _slots(shapes, **plan):
    steps = plan_steps(shapes, max_num_batched_tokens=plan.get("budget"), max_num_seqs=plan.get("seqs"))
    total = [s.prompt_len + max(s.max_new_tokens - 1, 0) for s in shapes]
    return slot_plan(steps, len(shapes), total)


def test_slot_plan_one_at_a_time_reuses_one_slot():
    assert _slots([RequestShape(5, 2), RequestShape(3, 3), RequestShape(1, 1)], seqs=1) == ([0, 0, 0], 1)


def test_slot_plan_together_gives_each_request_its_own_slot():
    assert _slots([RequestShape(5, 2), RequestShape(3, 3), RequestShape(1, 1)]) == ([0, 1, 2], 3)


def test_slot_plan_a_late_request_takes_the_lowest_freed_slot():
    shapes = [RequestShape(2, 1), RequestShape(2, 6), RequestShape(2, 2, arrival_step=3)]
    slots, used = _slots(shapes)
    assert used == 2 and slots == [0, 1, 0]


def test_converter_message_is_the_last_exception_line():
    log = "INFO:hf-to-gguf:Loading\nTraceback (most recent call last):\n  File x\nNotImplementedError: BPE x\n"
    assert converter_message(log) == "NotImplementedError: BPE x"
    assert converter_message("ERROR:hf-to-gguf:Model Foo is not supported\n") == \
        "ERROR:hf-to-gguf:Model Foo is not supported"


def test_load_error_reads_llamacpp_words_from_the_log(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("llama_model_load: error loading model: check_tensor_dims: tensor 'x' not found\nother\n")
    assert load_error(log) == "error loading model: check_tensor_dims: tensor 'x' not found"
    log.write_text("/src/granite-hybrid.cpp:54: GGML_ASSERT(2 * n_embd == d_inner) failed\n")
    assert load_error(log) == "GGML_ASSERT(2 * n_embd == d_inner) failed"
    log.write_text("nothing wrong said\n")
    assert load_error(log) is None


def test_source_provenance_names_the_vendored_commit(tmp_path):
    source = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    source.mkdir(parents=True)
    (source.parents[1] / "CHANGELOG.md").write_text("## [0.3.36]\n\n- feat: update llama.cpp to "
                                                    "ggml-org/llama.cpp@0c1e57098\n\n## [0.3.35]\n- feat: update "
                                                    "llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    assert source_provenance(source) == {"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e57098"}


def _fake_source(tmp_path: Path, body: str) -> Path:
    source = tmp_path / "src" / "llama_cpp_python-0.0.0" / "vendor" / "llama.cpp"
    (source / "gguf-py").mkdir(parents=True)
    (source / "conversion").mkdir()
    (source / "conversion" / "__init__.py").write_text("")
    (source / "convert_hf_to_gguf.py").write_text(body)
    return source


@pytest.fixture
def fake_converter(tmp_path, monkeypatch):
    """A stand-in converter run exactly as the real one (through llamacpp_convert.py, with this python); each run
    appends a line to runs.txt. The process's memory of refused conversions starts empty for each test (a refusal
    remembered from another test made this one order-dependent: make flaky found it)."""
    monkeypatch.setattr(llamacpp, "_refusals", {})

    def install(body: str) -> Path:
        runs = tmp_path / "runs.txt"
        source = _fake_source(tmp_path, f"import sys\nopen({str(runs)!r}, 'a').write('run\\n')\n{body}")
        monkeypatch.setenv(llamacpp.SOURCE_ENV, str(source))
        monkeypatch.setenv(llamacpp.PYTHON_ENV, sys.executable)
        monkeypatch.setenv(llamacpp.CACHE_ENV, str(tmp_path / "cache"))
        return runs
    return install


def test_conversion_is_cached_by_content(fake_converter, tmp_path):
    runs = fake_converter("open(sys.argv[sys.argv.index('--outfile') + 1], 'w').write('gguf')\n")
    first = llamacpp.convert(TINY, "f32")
    assert first.read_text() == "gguf" and llamacpp.convert(TINY, "f32") == first
    assert runs.read_text().count("run") == 1
    assert llamacpp.convert(TINY, "f16") != first and runs.read_text().count("run") == 2
    copy = variant_checkpoint(TINY, tmp_path / "copy", rms_norm_eps=1e-6)
    assert llamacpp.convert(copy, "f32") != first, "another config.json must be another conversion"


def test_a_refused_conversion_is_an_error_in_the_converters_words(fake_converter):
    runs = fake_converter("raise NotImplementedError('BPE pre-tokenizer was not recognized - update it')\n")
    with pytest.raises(ConversionError, match=r"refused .*tiny-bamba.*NotImplementedError: BPE pre-tokenizer was "
                                              r"not recognized.*pre_tokenizer=gpt-2"):
        llamacpp.convert(TINY, "f32", pre_tokenizer=None, patch=None)
    with pytest.raises(ConversionError):
        llamacpp.convert(TINY, "f32")
    assert runs.read_text().count("run") == 1, "a refusal is not repeated within one process"
    assert not list((Path(llamacpp.os.environ[llamacpp.CACHE_ENV])).glob("*.gguf")), "nothing half-written"


def test_the_engine_is_unavailable_without_its_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(llamacpp.PYTHON_ENV, str(tmp_path / "no-python"))
    assert "make llamacpp-venv" in LlamaCppEngine.dependency_problem()


@pytest.mark.parametrize("options,dtype,expected", [
    (EngineOptions(tensor_parallel_size=2), torch.float32, "splits a model only across GPUs"),
    (EngineOptions(cuda_graphs=True), torch.float32, "cuda_graphs"),
    (EngineOptions(ssm_state_dtype="bfloat16"), torch.float32, "recurrent state in f32"),
    (EngineOptions(engine_args={"kv_type": "f16"}), torch.float32, "mixed precision"),
    (EngineOptions(engine_args={"kv_type": "q8"}), torch.float16, "kv_type: expected one of f32, f16"),
    (EngineOptions(engine_args={"flash_attn": "yes"}), torch.float32, "flash_attn: expected one of auto, on, off"),
    (EngineOptions(engine_args={"threads": "0"}), torch.float32, "threads: expected a positive integer"),
    (EngineOptions(engine_args={"nthreads": "2"}), torch.float32, "unknown to llamacpp"),
    (EngineOptions(), torch.float64, "f32, f16 or bf16"),
], ids=["tp", "cuda-graphs", "bf16-state", "f16-cache-f32-model", "bad-kv-type", "bad-flash-attn", "zero-threads",
        "unknown-arg", "fp64"])
def test_options_llamacpp_cannot_honour_are_refused_with_the_reason(options, dtype, expected):
    reasons = LlamaCppEngine.unsupported(options, dtype=dtype, device="cpu")
    assert any(expected in r for r in reasons), reasons


def test_f16_cache_is_honoured_under_an_f16_model():
    assert LlamaCppEngine.unsupported(EngineOptions(engine_args={"kv_type": "f16"}), dtype=torch.float16,
                                      device="cpu") == []


def test_llamacpp_scenarios_are_selectable_by_kind_with_the_engine_only():
    cfg = ModelConfig.from_json(TINY)
    scenarios = build_scenarios(cfg, LlamaCppEngine)
    assert [s.id for s in select_scenarios(scenarios, "ubatch")] == [
        "ubatch2-batch50-Q16", "ubatch15-batch50-Q16", "ubatch16-batch50-Q16", "ubatch17-batch50-Q16"]
    assert {s.kind for s in select_scenarios(scenarios, "all")} >= {"threads", "flash_attn", "kv_cache", "ubatch",
                                                                    "state_restore", "batching"}
    with pytest.raises(ValueError, match="unknown scenario 'ubatch'"):
        select_scenarios(build_scenarios(cfg), "ubatch")


def test_a_scenarios_own_engine_args_win_over_the_callers():
    from harness.runner import _prepare
    from harness.scenarios import PromptSource

    cfg = ModelConfig.from_json(TINY)
    scenario = next(s for s in build_scenarios(cfg, LlamaCppEngine) if s.id == "flash_attn-on")
    _, options, _ = _prepare(LlamaCppEngine, scenario, dtype=torch.float32, device="cpu",
                             source=PromptSource(cfg.vocab_size), engine_args={"flash_attn": "off", "threads": "2"},
                             top_k=5)
    assert options.engine_args == {"flash_attn": "on", "threads": "2"}


def test_variant_checkpoint_changes_config_fields_only(tmp_path):
    variant = variant_checkpoint(TINY, tmp_path / "v", partial_rotary_factor=1.0, time_step_limit=None)
    raw = json.loads((variant / "config.json").read_text())
    assert raw["partial_rotary_factor"] == 1.0 and raw["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert "time_step_limit" not in raw
    assert (variant / "model.safetensors").resolve() == (TINY / "model.safetensors").resolve()
    assert ModelConfig.from_json(variant).rotary_dim == ModelConfig.from_json(variant).attn_head_dim
    assert json.loads((TINY / "config.json").read_text())["partial_rotary_factor"] == 0.5


def test_zoo_checkpoint_is_the_entry_as_transformers_saves_it(tmp_path):
    from harness import zoo
    from harness.llamacpp_cases import zoo_checkpoint

    made = zoo_checkpoint("granite-moe4-kv2-attention-first-dt-limit", tmp_path / "g")
    raw = json.loads((made / "config.json").read_text())
    assert "rms_norm_eps" not in zoo.config_dict("granite-moe4-kv2-attention-first-dt-limit")
    assert raw["rms_norm_eps"] == ModelConfig.from_json(made).rms_norm_eps, "a default written out"
    assert raw["layer_types"] == ["attention", "mamba", "mamba"], "Granite's layer names as published"
    entry, written = zoo.model_config("granite-moe4-kv2-attention-first-dt-limit"), ModelConfig.from_json(made)
    assert written.vocab_size == 104
    same = {k for k in entry.__dataclass_fields__ if k not in ("vocab_size", "extra_ignored")}
    assert {k: getattr(written, k) for k in same} == {k: getattr(entry, k) for k in same}


def test_oracle_fields_name_the_model_llamacpp_computes():
    from harness import zoo
    from harness.llamacpp_cases import oracle_fields_for

    assert oracle_fields_for(ModelConfig.from_json(TINY)) == ({"partial_rotary_factor": 1.0}, ["partial-rope"])
    assert oracle_fields_for(zoo.model_config("granite-moe4-kv2-attention-first-dt-limit")) == (
        {"position_embedding_type": "nope", "time_step_limit": None}, ["granite-rope-dropped", "time-step-limit"])
    assert oracle_fields_for(ModelConfig.from_json(ROOT / "fixtures" / "tiny-granite")) == ({}, [])


def test_docs_findings_table_is_the_registry():
    from harness.llamacpp_cases import findings_markdown

    assert findings_markdown() in (ROOT / "docs" / "llamacpp.md").read_text(), \
        "docs/llamacpp.md's findings table differs from harness/llamacpp_cases.FINDINGS: paste findings_markdown()"
