"""Tensor and pipeline parallelism of the vendored engine against the fp64 oracle, and its failure behaviour.

CPU: gloo between worker processes, fp32 under the Triton interpreter. Random checkpoints cover n_groups 1, 2 and 4
at tp = 2 and 4 (groups sharded when tp divides G, replicated on the ranks that read them otherwise, K/V heads
sharded at tp = 2 and replicated at tp = 4), and G = 3 with 6 heads at tp = 2 (a rank whose heads read their groups
unevenly); the bundled tiny model (G = 2, one K/V head) runs the tp and pp scenarios of harness/scenarios.py.
GPU (two CUDA devices or more): the same in bf16 with NCCL.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from harness.engine import EngineOptions
from harness.runner import Oracle, ScenarioSkipped, check_scenario
from harness.scenarios import PromptSource, Scenario, build_scenarios
from harness.schedule import RequestShape
from reference.config import ModelConfig
from tests.helpers import random_bamba_checkpoint
from vendored.engine import EngineError, LLMEngine
from vendored.engine.model import StepBatch

from .conftest import TINY, TINY_CFG

# A small workload for random configs (Q = 8, W = 4): a one-token prompt, a prompt across a chunk edge, and one that
# arrives at step 1 so that a step mixes its prefill with the others' decodes.
RANDOM_SHAPES = (RequestShape(1, 3), RequestShape(11, 3), RequestShape(9, 2, arrival_step=1))
# G = 3 needs H divisible by 3 and by tp = 2: 6 heads of 16 channels (H·P = mamba_expand · hidden_size = 96). Rank 0
# holds heads 0-2, which read groups 0, 0, 1; group 1 spans both ranks.
UNEVEN_HEADS = {"hidden_size": 48, "mamba_n_heads": 6}

TINY_SCENARIOS = {s.id: s for s in build_scenarios(TINY_CFG) if s.kind in ("tp", "pp")}

GPU2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class _Checkpoints:
    """Random checkpoints and their oracles by config, made once per session."""

    def __init__(self, factory) -> None:
        self.factory, self.made = factory, {}

    def oracle(self, overrides: dict, device: str = "cpu") -> tuple[Oracle, ModelConfig]:
        key = (tuple(sorted(overrides.items())), device)
        if key not in self.made:
            name = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
            path = random_bamba_checkpoint(self.factory.mktemp(f"tp-{name}"), seed=11, **overrides)
            self.made[key] = (Oracle(path, device=device), ModelConfig.from_json(path))
        return self.made[key]

    def close(self) -> None:
        for oracle, _ in self.made.values():
            oracle.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    made = _Checkpoints(tmp_path_factory)
    yield made
    made.close()


def _assert_passes(scenario: Scenario, oracle: Oracle, cfg: ModelConfig, dtype=torch.float32, device="cpu",
                   source: PromptSource | None = None) -> None:
    report = check_scenario("vendored", scenario, oracle=oracle, source=source or PromptSource(cfg.vocab_size, seed=5),
                            dtype=dtype, device=device)
    assert report.passed, report.message()
    assert report.comparisons and all(c.positions for c in report.comparisons)


# ---- against the oracle (CPU, gloo) --------------------------------------------------------------------------

def _random_case(tp: int, groups: int, *, pp: int = 1, budget: int | None = None, slow: bool = False, **overrides):
    overrides = {"mamba_n_groups": groups, **overrides}
    name = f"tp-size{tp}" + (f"-pp-size{pp}" if pp > 1 else "") + f"-G{groups}-H{overrides.get('mamba_n_heads', 4)}"
    name += f"-budget{budget}" if budget else ""
    options = EngineOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=budget)
    marks = [pytest.mark.tp] + ([pytest.mark.slow] if slow else [])
    return pytest.param(overrides, name, options, id=name, marks=marks)


# In `make test`: groups sharded (G4 at tp 2), replicated with norm statistics summed across ranks and K/V heads
# replicated (G2 at tp 4), heads reading their groups unevenly (G3, H6), tp with chunked prefill (budget 5: pieces
# end inside the conv window, on a chunk edge and one past it, and steps mix prefills with decodes), and two pipeline
# stages. The rest under `slow`.
RANDOM_CASES = [
    _random_case(2, 4), _random_case(4, 2), _random_case(2, 3, **UNEVEN_HEADS), _random_case(2, 2, budget=5),
    _random_case(1, 2, pp=2),
    _random_case(2, 1, slow=True), _random_case(4, 1, slow=True), _random_case(2, 2, slow=True),
    _random_case(4, 4, slow=True), _random_case(2, 2, pp=2, slow=True),
]


@pytest.mark.parametrize("overrides,name,options", RANDOM_CASES)
def test_random_config_matches_oracle(overrides, name, options, checkpoints):
    oracle, cfg = checkpoints.oracle(overrides)
    _assert_passes(Scenario(name, "tp", options, RANDOM_SHAPES, name), oracle, cfg)


@pytest.mark.tp
@pytest.mark.slow
@pytest.mark.parametrize("scenario_id", sorted(TINY_SCENARIOS))
def test_tiny_model_scenario_matches_oracle(scenario_id, tiny_oracle, tiny_prompts):
    _assert_passes(TINY_SCENARIOS[scenario_id], tiny_oracle, TINY_CFG, source=tiny_prompts)


# ---- configurations that cannot be split ----------------------------------------------------------------------

def test_unshardable_config_is_a_clear_error_before_any_process_starts(checkpoints):
    oracle, _ = checkpoints.oracle({"mamba_n_groups": 2})
    started = time.monotonic()
    with pytest.raises(EngineError, match="mamba_n_heads = 4 is not divisible by tensor_parallel_size = 3"):
        LLMEngine(oracle.checkpoint, tensor_parallel_size=3)
    with pytest.raises(EngineError, match="pipeline_parallel_size = 4 exceeds num_hidden_layers = 3"):
        LLMEngine(oracle.checkpoint, pipeline_parallel_size=4)
    assert time.monotonic() - started < 30


def test_harness_skips_a_scenario_the_model_cannot_be_split_for(checkpoints):
    oracle, cfg = checkpoints.oracle({"mamba_n_groups": 4})
    tp8 = next(s for s in build_scenarios(cfg) if s.id == "tp-size8")      # 4 heads over 8 ranks
    with pytest.raises(ScenarioSkipped, match="mamba_n_heads = 4 is not divisible by tensor_parallel_size = 8"):
        check_scenario("vendored", tp8, oracle=oracle, source=PromptSource(cfg.vocab_size))


# ---- worker failures: a clear error, never a hang -------------------------------------------------------------

def _tp2_engine(oracle: Oracle, **kwargs) -> LLMEngine:
    return LLMEngine(oracle.checkpoint, tensor_parallel_size=2, max_model_len=32, max_num_seqs=2, **kwargs)


def _all_workers_gone(engine: LLMEngine) -> bool:
    return all(not proc.is_alive() for proc in engine.model.processes)


@pytest.mark.tp
def test_close_joins_every_worker_and_removes_the_run_directory(checkpoints):
    oracle, _ = checkpoints.oracle({"mamba_n_groups": 2})
    engine = _tp2_engine(oracle)
    model = engine.model
    run_dir = model.spec.run_dir
    engine.generate([("a", [1, 2, 3], 1)])
    engine.close()
    assert [proc.exitcode for proc in model.processes] == [0, 0]
    assert not os.path.exists(run_dir)


@pytest.mark.tp
def test_a_worker_exception_fails_the_step_with_its_traceback(checkpoints):
    oracle, cfg = checkpoints.oracle({"mamba_n_groups": 2})
    engine = _tp2_engine(oracle)
    bad = StepBatch(  # a token id past the vocabulary: the workers' embedding lookup raises
        token_ids=torch.tensor([cfg.vocab_size + 5]), positions=torch.tensor([0]), num_decodes=0,
        decode_slots=torch.zeros(0, dtype=torch.int32), prefill_cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        prefill_slots=torch.tensor([0], dtype=torch.int32), prefill_has_initial_state=torch.tensor([False]),
        query_start=torch.tensor([0, 1]), context_lens=torch.tensor([1]), block_tables=torch.tensor([[0]]),
        kv_slot_mapping=torch.tensor([0]), logits_rows=torch.tensor([0]))
    with pytest.raises(EngineError, match=r"(?s)rank \d raised during a step:.*Traceback.*IndexError"):
        engine.model.forward(bad, engine.states, engine.kv)
    assert _all_workers_gone(engine)
    with pytest.raises(EngineError, match="shut down after an earlier failure"):
        engine.generate([("a", [1, 2, 3], 1)])


@pytest.mark.tp
def test_a_killed_worker_fails_the_next_step_naming_it(checkpoints):
    oracle, _ = checkpoints.oracle({"mamba_n_groups": 2})
    engine = _tp2_engine(oracle)
    os.kill(engine.model.processes[1].pid, signal.SIGKILL)
    engine.model.processes[1].join(timeout=30)
    started = time.monotonic()
    with pytest.raises(EngineError, match="rank 1.*killed by signal SIGKILL"):
        engine.generate([("a", [1, 2, 3], 1)])
    assert time.monotonic() - started < 30
    assert _all_workers_gone(engine)


@pytest.mark.tp
def test_a_hung_worker_fails_the_step_within_the_timeout_with_the_stacks(checkpoints):
    oracle, _ = checkpoints.oracle({"mamba_n_groups": 2})
    engine = _tp2_engine(oracle, parallel_timeout_s=5.0)
    os.kill(engine.model.processes[1].pid, signal.SIGSTOP)       # rank 0 then waits for it in an all-reduce
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)no answer from rank\(s\) \[0\] within 5 s.*rank 0 log.*all_reduce"):
        engine.generate([("a", [1, 2, 3], 1)])
    assert time.monotonic() - started < 30
    assert _all_workers_gone(engine)


# ---- GPU: NCCL, bf16 -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cuda_oracle():
    oracle = Oracle(TINY, device="cuda")
    yield oracle
    oracle.close()


@pytest.mark.gpu
@pytest.mark.tp
@GPU2
@pytest.mark.parametrize("scenario_id", sorted(TINY_SCENARIOS))
def test_tiny_model_scenario_matches_oracle_bf16_nccl(scenario_id, tiny_cuda_oracle, tiny_prompts):
    try:
        _assert_passes(TINY_SCENARIOS[scenario_id], tiny_cuda_oracle, TINY_CFG, dtype=torch.bfloat16, device="cuda",
                       source=tiny_prompts)
    except ScenarioSkipped as skip:         # tp-size4 on a machine with fewer than four devices
        pytest.skip(str(skip))


@pytest.mark.gpu
@pytest.mark.tp
@GPU2
@pytest.mark.parametrize("groups", [1, 2, 4], ids=["G1", "G2", "G4"])
def test_random_config_tp2_matches_oracle_bf16_nccl(groups, checkpoints):
    oracle, cfg = checkpoints.oracle({"mamba_n_groups": groups}, device="cuda")
    scenario = Scenario(f"tp-size2-G{groups}", "tp", EngineOptions(tensor_parallel_size=2), RANDOM_SHAPES, "")
    _assert_passes(scenario, oracle, cfg, dtype=torch.bfloat16, device="cuda")
