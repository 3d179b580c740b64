"""The scenario matrix: readable ids derived from Q and W, boundary coverage, the step plan, prompt sources."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from harness import pytest_plugin
from harness.adapters.reference import ReferenceEngine
from harness.engine import EngineOptions
from harness.pytest_plugin import scenario_cases
from harness.events import plan_events
from harness.scenarios import (
    LONG_DECODE_TOKENS,
    LONG_GENERATION_TOKENS,
    PromptSource,
    batching_shapes,
    build_scenarios,
    chunked_prefill_budgets,
    chunked_shapes,
    select_scenarios,
)
from harness.schedule import RequestShape, plan_options, plan_steps
from reference.config import ModelConfig


def model(Q: int = 16, W: int = 4, G: int = 1) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=G, mamba_d_state=8,
                       mamba_d_conv=W, mamba_chunk_size=Q, max_position_embeddings=512)


def test_scenario_ids_for_q16_w4():
    assert [s.id for s in build_scenarios(model(16, 4))] == [
        "batching-alone", "batching-together", "batching-shuffled", "batching-long-decode",
        "batching-long-generation", "chunked_prefill-budget1-Q16", "chunked_prefill-budget2-Q16", "chunked_prefill-budget3-Q16",
        "chunked_prefill-budget15-Q16", "chunked_prefill-budget16-Q16", "chunked_prefill-budget17-Q16",
        "chunked_prefill-budget33-Q16", "chunked_prefill-budget50-Q16", "chunked_prefill-budget1000-Q16",
        "chunked_prefill-capped-budget40-cap16-Q16", "preemption-blocks7x8-Q16",
        "tp-size1", "tp-size2", "tp-size4", "tp-size2-budget17-Q16", "pp-size1", "pp-size2",
        "cudagraph-off", "cudagraph-on",
        "ssm_state_dtype-float32", "ssm_state_dtype-bfloat16", "long-past_max_positions", "long-100k",
        "long-100k-cudagraph", "sampled-decode-T2", "sampled-cudagraph-T2", "sampled-long-decode-T2",
        "invariance-Q16",
    ]


def test_sampled_scenarios_draw_every_continuation_with_its_own_seed():
    scenarios = {s.id: s for s in build_scenarios(model(16, 4))}
    for sid in ("sampled-decode-T2", "sampled-long-decode-T2"):
        requests = scenarios[sid].requests(PromptSource(97))
        assert [(r.temperature, r.seed) for r in requests] == [(2.0, i) for i in range(len(requests))]
        assert all(r.samples for r in requests)
        forced = requests[0].teacher_forced([5, 6])
        assert (forced.temperature, forced.max_new_tokens, forced.samples) == (0.0, 0, False)
    assert scenarios["sampled-long-decode-T2"].slow and not scenarios["sampled-decode-T2"].slow
    assert all(r.temperature == 0.0 for r in scenarios["batching-together"].requests(PromptSource(97)))


@pytest.mark.parametrize("Q,W", [(16, 4), (8, 4), (256, 4), (8, 2), (64, 3)])
def test_batching_lengths_derive_from_q_and_w(Q, W):
    lengths = {s.prompt_len for s in batching_shapes(Q, W)}
    assert lengths == {1, W - 1, Q - 1, Q, Q + 1, 3 * Q, math.lcm(Q, 16)}


@pytest.mark.parametrize("Q,W", [(16, 4), (8, 4), (256, 4), (8, 2), (64, 3)])
def test_chunked_budgets_split_next_to_chunk_boundaries(Q, W):
    shapes = chunked_shapes(Q, W)
    tags = {b: plan_events(shapes, EngineOptions(max_num_batched_tokens=b), Q, W)
            for b in chunked_prefill_budgets(Q, W)}
    assert 1 in tags
    assert "split@Q-1" in tags[Q - 1] and "split@Q" in tags[Q] and "split@Q+1" in tags[Q + 1]


def test_tp_sizes_include_one_above_the_group_count():
    ids = [s.id for s in build_scenarios(model(G=4)) if s.kind == "tp"]
    assert ids == ["tp-size1", "tp-size2", "tp-size4", "tp-size8", "tp-size2-budget17-Q16"]


def test_select_by_kind_and_id_and_unknown_names():
    scenarios = build_scenarios(model())
    assert {s.kind for s in select_scenarios(scenarios, "batching,tp")} == {"batching", "tp"}
    assert [s.id for s in select_scenarios(scenarios, "long-100k")] == ["long-100k"]
    assert "long-100k" not in [s.id for s in select_scenarios(scenarios, "all")]
    with pytest.raises(ValueError, match="unknown scenario 'chunky'"):
        select_scenarios(scenarios, "batching,chunky")


def test_a_leading_minus_leaves_out_what_the_name_selects():
    scenarios = build_scenarios(model())
    chunked = [s.id for s in select_scenarios(scenarios, "chunked_prefill")]
    fewer = [s.id for s in select_scenarios(scenarios, "batching,chunked_prefill,-chunked_prefill-budget1-Q16")]
    assert "chunked_prefill-budget1-Q16" in chunked and "chunked_prefill-budget1-Q16" not in fewer
    assert set(fewer) == set(chunked) - {"chunked_prefill-budget1-Q16"} | {
        s.id for s in scenarios if s.kind == "batching" and not s.slow}
    everything_but_tp = [s.id for s in select_scenarios(scenarios, "-tp")]
    assert everything_but_tp == [s.id for s in select_scenarios(scenarios, "all") if s.kind != "tp"]
    with pytest.raises(ValueError, match="unknown scenario 'chunky'"):
        select_scenarios(scenarios, "all,-chunky")


@pytest.mark.parametrize("Q,max_positions", [(16, 512), (256, 8192), (256, 4096)])
def test_long_generation_decodes_thousands_of_tokens_where_the_positions_allow(Q, max_positions):
    cfg = replace(model(Q, 4), max_position_embeddings=max_positions)
    scenario = {s.id: s for s in build_scenarios(cfg)}["batching-long-generation"]
    assert scenario.slow and scenario.needs_cuda and scenario.kind == "batching"
    assert [s.prompt_len for s in scenario.shapes] == [1, Q + 1]
    assert all(s.prompt_len + s.max_new_tokens <= max_positions for s in scenario.shapes)
    assert scenario.shapes[0].max_new_tokens == min(LONG_GENERATION_TOKENS, max_positions - 1)
    assert "batching-long-generation" not in [s.id for s in select_scenarios(build_scenarios(cfg), "batching")]


@pytest.mark.parametrize("Q,W", [(16, 4), (256, 4), (8, 2)])
def test_long_decode_carries_each_state_through_many_single_token_updates(Q, W):
    scenario = {s.id: s for s in build_scenarios(model(Q, W))}["batching-long-decode"]
    assert scenario.slow and scenario.kind == "batching"
    steps = plan_steps(scenario.shapes, **plan_options(scenario.options))
    decodes = [p for step in steps for p in step.pieces if p.decode]
    assert len(decodes) == len(scenario.shapes) * (LONG_DECODE_TOKENS - 1) >= 3 * 127
    # every request decodes in every step after its prefill, side by side with the others
    assert max(sum(p.decode for p in step.pieces) for step in steps) == len(scenario.shapes)
    assert "batching-long-decode" not in [s.id for s in select_scenarios(build_scenarios(model(Q, W)), "batching")]


def test_shuffled_presents_the_same_requests_in_another_order():
    by_id = {s.id: s for s in build_scenarios(model())}
    source = PromptSource(97, seed=3)
    together = by_id["batching-together"].requests(source)
    shuffled = by_id["batching-shuffled"].requests(source)
    assert sorted(together, key=lambda r: r.request_id) == sorted(shuffled, key=lambda r: r.request_id)
    assert [r.request_id for r in together] != [r.request_id for r in shuffled]


@pytest.mark.parametrize("budget,max_seqs", [(None, None), (1, None), (7, None), (17, 2), (None, 1)],
                         ids=["unlimited", "budget1", "budget7", "budget17-seqs2", "seqs1"])
def test_plan_feeds_every_position_once_in_order_within_the_limits(budget, max_seqs):
    shapes = list(chunked_shapes(16, 4)) + [RequestShape(5, 0)]
    plan = plan_steps(shapes, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    fed = [[] for _ in shapes]
    for step in plan:
        assert budget is None or step.n_tokens <= budget
        decodes = [p.decode for p in step.pieces]
        assert decodes == sorted(decodes, reverse=True), "decodes come first in a step"
        assert max_seqs is None or len({p.request for p in step.pieces}) <= max_seqs
        for piece in step.pieces:
            assert step.index >= shapes[piece.request].arrival_step
            fed[piece.request] += list(range(piece.start, piece.stop))
    # The prompt and every generated token but the last are fed, each once, in order.
    assert fed == [list(range(s.prompt_len + max(s.max_new_tokens - 1, 0))) for s in shapes]


def test_random_prompts_are_seeded_and_in_the_vocabulary():
    source = PromptSource(97, seed=5)
    assert source.tokens(40, 2) == PromptSource(97, seed=5).tokens(40, 2)
    assert source.tokens(40, 2) != source.tokens(40, 3)
    assert all(0 <= t < 97 for t in source.tokens(40, 2))


def test_prompts_file_is_sliced_and_checked_against_the_vocabulary(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "kind": "text", "token_ids": [1, 2, 3], "text": "x"},
            {"id": "b", "kind": "text", "token_ids": [4, 5], "text": "y"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = PromptSource.from_jsonl(path, 97)
    assert [source.tokens(2, 0), source.tokens(2, 1), source.tokens(3, 1)] == [[1, 2], [4, 5], [1, 2, 3]]
    assert source.tokens(7, 0) == [1, 2, 3, 4, 5, 1, 2]
    with pytest.raises(ValueError, match="token id 5 outside the model's vocabulary"):
        PromptSource.from_jsonl(path, 5)


def test_case_ids_carry_engine_and_scenario_and_markers():
    params = scenario_cases(["reference", "transformers"], model(), kinds=["cudagraph", "tp"])
    assert [p.id for p in params] == [
        "reference-tp-size1", "reference-tp-size2", "reference-tp-size4", "reference-tp-size2-budget17-Q16",
        "reference-cudagraph-off", "reference-cudagraph-on",
        "transformers-tp-size1", "transformers-tp-size2", "transformers-tp-size4",
        "transformers-tp-size2-budget17-Q16", "transformers-cudagraph-off", "transformers-cudagraph-on",
    ]
    by_id = {p.id: p for p in params}
    assert {m.name for m in by_id["reference-cudagraph-on"].marks} == {"cudagraph", "gpu"}
    assert {m.name for m in by_id["reference-tp-size2"].marks} == {"tp"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="engines are marked slow only where there is no CUDA device")
def test_cases_of_an_engine_slow_without_a_gpu_are_marked_slow(monkeypatch):
    class Slowpoke(ReferenceEngine):
        slow_on_cpu = True

    monkeypatch.setattr(pytest_plugin, "available_engines", lambda: {"slowpoke": None})
    monkeypatch.setattr(pytest_plugin, "get_engine", lambda name: Slowpoke)
    params = scenario_cases(["slowpoke"], model(), kinds=["batching"])
    assert params and all("slow" in {m.name for m in p.marks} for p in params)


def test_cases_over_several_models_carry_the_model_and_skip_engines_of_another_family(monkeypatch):
    """parametrize_cases over {name: model}: ids "<model>-<engine>-<scenario>", a `model_name` argument beside
    `case`, and an engine that does not serve a model's family skipped with the reason (the server adapter serves
    Bamba only)."""
    from harness import zoo

    class Metafunc:
        fixturenames = ["model_name", "case"]
        config = None

        def function(self):
            pass

        def parametrize(self, names, params):
            self.names, self.params = names, params

    metafunc = Metafunc()
    monkeypatch.setattr(pytest_plugin, "selected_engines", lambda config: ["reference", "server"])
    models = {"bamba-g1": model(), "granite": zoo.model_config("granite-moe4-top2")}
    pytest_plugin.parametrize_cases(metafunc, models, kinds=["batching"])
    assert metafunc.names == "model_name,case"
    by_id = {p.id: p for p in metafunc.params}
    assert set(by_id) == {f"{m}-{e}-batching-{k}" for m in models for e in ("reference", "server")
                          for k in ("alone", "together", "shuffled", "long-decode", "long-generation")}
    assert any(m.name == "slow" for m in by_id["bamba-g1-reference-batching-long-decode"].marks)
    name, (engine, scenario) = by_id["granite-reference-batching-together"].values
    assert (name, engine, scenario.id) == ("granite", "reference", "batching-together")
    skipped = [p.id for p in metafunc.params if any(m.name == "skip" for m in p.marks)]
    assert skipped == [f"granite-server-batching-{k}" for k in ("alone", "together", "shuffled", "long-decode",
                                                                 "long-generation")]
    assert "not granitemoehybrid" in by_id["granite-server-batching-alone"].marks[-1].kwargs["reason"]
    metafunc.fixturenames = ["case"]
    with pytest.raises(pytest.UsageError, match="needs a `model_name` argument"):
        pytest_plugin.parametrize_cases(metafunc, models)


def test_cudagraph_workload_needs_padding_and_reuses_slots():
    """Under the reference schedule: decode-only steps of 17, 5 and 3 rows (none a power of two), and requests that
    arrive after others finished, with no more slots than max_num_seqs."""
    cudagraph = next(s for s in build_scenarios(model()) if s.id == "cudagraph-on")
    plan = plan_steps(cudagraph.shapes, max_num_batched_tokens=None, max_num_seqs=cudagraph.options.max_num_seqs)
    decode_only = {len(s.pieces) for s in plan if all(p.decode for p in s.pieces)}
    assert {3, 5, 17} <= decode_only
    assert cudagraph.options.max_num_seqs == 17 < len(cudagraph.shapes)
    assert any(s.prompt_len == 1 and s.arrival_step > 0 for s in cudagraph.shapes)
