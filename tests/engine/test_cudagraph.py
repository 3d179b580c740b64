"""CUDA-graph decode in the vendored engine (vendored/engine/cudagraph.py) against the fp64 oracle.

On a CUDA device decode-only steps are padded to a captured size and replayed. On a CPU nothing can be captured, so
these tests run the same padded static-buffer step eagerly (through `StaticDecodeOnCPU`): the padding rows, pad slot,
pad K/V block, persistent buffers and fixed-width masks are exactly what the GPU replays; only the capture differs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.adapters.vendored import VendoredEngine
from harness.compare import compare_runs
from harness.engine import EngineOptions, Request
from harness.runner import as_teacher_forced, check_relative, check_scenario
from harness.scenarios import build_scenarios
from reference.ops import gqa_attention_ref
from vendored.engine.cudagraph import DecodeGraphRunner, capture_sizes
from vendored.engine import paged_attention
from vendored.engine.paged_attention import paged_decode_attention

from .conftest import TINY_CFG

SCENARIOS = {s.id: s for s in build_scenarios(TINY_CFG) if s.kind == "cudagraph"}
SCENARIOS_SAMPLED = {s.id: s for s in build_scenarios(TINY_CFG) if s.kind == "sampled"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param(("cpu", torch.float32), id="cpu-fp32"),
           pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=[pytest.mark.gpu, needs_cuda]),
           pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=[pytest.mark.gpu, needs_cuda])]
# The 20-request workloads take minutes under the Triton interpreter: their CPU cases run with the slow tests.
SLOW_ON_CPU = [pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=pytest.mark.slow), *DEVICES[1:]]


class StaticDecodeOnCPU(VendoredEngine):
    """The vendored adapter honouring cuda_graphs on a CPU, where the engine runs its padded graph step eagerly."""

    @classmethod
    def _unsupported(cls, options, *, dtype, device):
        return [r for r in super()._unsupported(options, dtype=dtype, device=device) if not r.startswith("cuda_graphs")]


def engine_class(device: str) -> type[VendoredEngine]:
    return VendoredEngine if device == "cuda" else StaticDecodeOnCPU


def run_counted(device, dtype, oracle, requests, options):
    """Run the requests; return the results and the graph runner's counters (launches by size, padding rows,
    replays) of that run."""
    with engine_class(device)(oracle.checkpoint, dtype=dtype, device=device, options=options) as engine:
        results = engine.run(requests)
        runner = engine.engine.graphs
        return results, (dict(runner.launches), runner.padding_rows, runner.replays)


def poison_unowned(runner: DecodeGraphRunner, pieces) -> None:
    """NaN into what no live request of this step may read: free state slots and the pad slot (conv and SSM pools),
    free K/V blocks and the pad block, and in each decoding request's own blocks the positions after the one this
    step writes."""
    nan = float("nan")
    states, kv = runner.states, runner.kv
    unowned = list(states.free_slots) + [states.pad_slot]
    for pool in (*states.conv.values(), *states.ssm.values()):
        pool[unowned] = nan
    bs = kv.block_size
    dead = [b * bs + o for b in (*kv.free_blocks, kv.pad_block) for o in range(bs)]
    for piece in pieces:
        blocks = piece.seq.blocks
        dead += [blocks[p // bs] * bs + p % bs for p in range(piece.start + 1, len(blocks) * bs)]
    for cache in (*kv.k.values(), *kv.v.values()):
        cache.view(-1, *cache.shape[2:])[dead] = nan                        # (blocks·bs, Hkv, Dh)


# ---- pieces ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, (1,)), (3, (1, 2, 4)), (8, (1, 2, 4, 8)), (17, (1, 2, 4, 8, 16, 32)), (200, (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    (256, (1, 2, 4, 8, 16, 32, 64, 128, 256)), (600, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
], ids=["seqs1", "seqs3", "seqs8", "seqs17", "seqs200", "seqs256", "seqs600"])
def test_capture_sizes_reach_the_first_size_at_or_above_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def paged_case():
    """Rows with contexts 1, 5, 16, 17 and 40 over shuffled blocks of a NaN-filled fp64 cache (blocks of 8), a table
    of fixed width 6 (entries past a context name other rows' blocks or free ones), and a padding row (context 0).
    Returns the call's inputs, its block size and each row's keys and values."""
    gen = torch.Generator().manual_seed(0)
    bs, width, Hq, Hkv, Dh = 8, 6, 4, 2, 16
    lens = [1, 5, 16, 17, 40, 0]
    k_cache = torch.full((40, bs, Hkv, Dh), float("nan"), dtype=torch.float64)
    v_cache = k_cache.clone()
    order = torch.randperm(40, generator=gen).tolist()
    tables, keys, values = [], [], []
    for n in lens:
        own = [order.pop() for _ in range(-(-n // bs))]
        k = torch.randn(n, Hkv, Dh, generator=gen, dtype=torch.float64)
        v = torch.randn(n, Hkv, Dh, generator=gen, dtype=torch.float64)
        for p in range(n):
            k_cache[own[p // bs], p % bs], v_cache[own[p // bs], p % bs] = k[p], v[p]
        tables.append(own + order[:width - len(own)])                    # stale entries: blocks of nobody / NaN
        keys.append(k)
        values.append(v)
    q = torch.randn(len(lens), Hq, Dh, generator=gen, dtype=torch.float64)
    inputs = (q, k_cache.view(-1, Hkv, Dh), v_cache.view(-1, Hkv, Dh), torch.tensor(tables), torch.tensor(lens))
    return inputs, bs, keys, values


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_paged_decode_attention_matches_reference_and_ignores_unowned_blocks(device):
    """paged_case's rows, fp64 (the torch path): each live row equals the oracle's attention of its last query over
    its keys, the padding row is zero, and no NaN gets through."""
    (q, k_cache, v_cache, tables, lens), bs, keys, values = paged_case()
    Hq, Dh = q.shape[1], q.shape[2]
    out = paged_decode_attention(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                                 lens.to(device), block_size=bs, scale=Dh ** -0.5).cpu()
    assert not out.isnan().any()
    for row, n in enumerate(lens.tolist()):
        expected = (gqa_attention_ref(q[row:row + 1], keys[row], values[row], scale=Dh ** -0.5)[0] if n
                    else torch.zeros(Hq, Dh, dtype=torch.float64))
        torch.testing.assert_close(out[row], expected, rtol=1e-12, atol=1e-12, msg=f"row {row}, context {n}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_paged_decode_attention_fused_runs_the_kernel(device, monkeypatch):
    """fused=True (what a model running its fused ops passes): paged_case's rows in fp32 go to the decode_attention
    kernel (counted), with q a strided view of a merged q/k/v output as the model passes it; each live row within
    fp32's rounding of the oracle's attention, the padding row exactly zero, no NaN."""
    calls = []
    original = paged_attention.decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "decode_attention", counted)
    (q, k_cache, v_cache, tables, lens), bs, keys, values = paged_case()
    Hq, Dh, Hkv = q.shape[1], q.shape[2], k_cache.shape[1]
    qkv = torch.cat([q, torch.zeros(q.shape[0], 2 * Hkv, Dh, dtype=q.dtype)], dim=1)   # (B, Hq + 2Hkv, Dh)
    q_view = qkv.float().to(device)[:, :Hq]
    out = paged_decode_attention(q_view, k_cache.float().to(device), v_cache.float().to(device), tables.to(device),
                                 lens.to(device), block_size=bs, scale=Dh ** -0.5, fused=True).cpu()
    assert len(calls) == 1 and calls[0] is q_view, "the kernel was not called, or was given a copy of q"
    assert not out.isnan().any()
    for row, n in enumerate(lens.tolist()):
        expected = (gqa_attention_ref(q[row:row + 1], keys[row], values[row], scale=Dh ** -0.5)[0] if n
                    else torch.zeros(Hq, Dh, dtype=torch.float64))
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5, msg=f"row {row}, context {n}")
        if not n:
            assert bool((out[row] == 0).all())


# ---- the cudagraph workload against the oracle -----------------------------------------------------------------

@pytest.mark.cudagraph
@pytest.mark.parametrize("device_dtype", SLOW_ON_CPU)
def test_cudagraph_workload_matches_oracle(device_dtype, tiny_oracle, tiny_prompts):
    """cudagraph-on: decode batches of 17, 5, 3 and 6 rows padded to 32, 8 and 4, slots freed and reused, a one-token
    prompt arriving mid-run; every position within the oracle's budget, and the padded path really taken."""
    device, dtype = device_dtype
    scenario = SCENARIOS["cudagraph-on"]
    requests = scenario.requests(tiny_prompts, full_distributions=True)
    results, (launches, padding_rows, replays) = run_counted(device, dtype, tiny_oracle, requests, scenario.options)
    report = compare_runs(scenario=f"{scenario.id}-{device}", requests=requests,
                          baseline=tiny_oracle.results(requests), candidate=results,
                          budget=tiny_oracle.budget(requests, dtype))
    assert report.passed, report.message()
    assert {4, 8, 32} <= set(launches), f"padded sizes run: {launches}"
    assert padding_rows > 0
    assert replays == (sum(launches.values()) if device == "cuda" else 0), f"{replays} replays of {launches}"


@pytest.mark.cudagraph
@pytest.mark.parametrize("temperature", [0.0, 2.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("device_dtype", DEVICES)
def test_nan_in_unowned_memory_never_reaches_a_live_request(device_dtype, temperature, tiny_oracle, tiny_prompts,
                                                            monkeypatch):
    """Before every padded step (before every replay on CUDA) the free slots, the pad slot, the free K/V blocks, the
    pad block and the positions past each context are NaN. Three requests decode in a batch of 3 (one padding row);
    a fourth waits for the slot the one-token request frees, while that slot is NaN. Outputs stay finite and match
    the oracle. Sampled: every continuation drawn (steps holding sampling requests replay the graph too, without
    running ahead), judged teacher-forced on the drawn tokens."""
    device, dtype = device_dtype
    poisoned = []
    original_run = DecodeGraphRunner.run

    def run_poisoned(runner, pieces):
        poison_unowned(runner, pieces)
        poisoned.append(len(pieces))
        return original_run(runner, pieces)

    monkeypatch.setattr(DecodeGraphRunner, "run", run_poisoned)
    shapes = [(5, 4), (1, 2), (17, 5), (3, 3)]
    requests = [Request(f"r{i}-len{n}", tiny_prompts.tokens(n, i), new, 5, 0, True, temperature=temperature, seed=i)
                for i, (n, new) in enumerate(shapes)]
    options = EngineOptions(cuda_graphs=True, max_num_seqs=3)
    results, (launches, padding_rows, _) = run_counted(device, dtype, tiny_oracle, requests, options)
    assert poisoned and padding_rows > 0, f"poisoned steps {poisoned}, padded sizes {launches}"
    for result in results:
        assert torch.isfinite(result.prompt_logprobs).all() and torch.isfinite(result.output_logprobs).all(), (
            f"{result.request_id}: NaN reached a live request")
    if temperature > 0:                 # judged on the drawn tokens, as the sampled scenarios judge them
        requests = [r.teacher_forced(res.output_ids) for r, res in zip(requests, results)]
        results = [as_teacher_forced(res) for res in results]
    report = compare_runs(scenario=f"cudagraph-nan-poison-{device}", requests=requests,
                          baseline=tiny_oracle.results(requests), candidate=results,
                          budget=tiny_oracle.budget(requests, dtype))
    assert report.passed, report.message()


@pytest.mark.cudagraph
@pytest.mark.parametrize("device_dtype", SLOW_ON_CPU)
def test_sampled_cudagraph_workload_passes_the_judge(device_dtype, tiny_oracle, tiny_prompts):
    """sampled-cudagraph-T2: cudagraph-on's padded decode batches with every continuation drawn, judged
    teacher-forced on the drawn tokens (on a CPU through the same padded static step, run eagerly)."""
    device, dtype = device_dtype
    scenario = replace(SCENARIOS_SAMPLED["sampled-cudagraph-T2"], needs_cuda=False)
    report = check_scenario(engine_class(device), scenario, oracle=tiny_oracle, source=tiny_prompts, dtype=dtype,
                            device=device)
    assert report.passed, report.message()


@pytest.mark.cudagraph
@pytest.mark.parametrize("device_dtype", SLOW_ON_CPU)
def test_graphs_on_match_graphs_off(device_dtype, tiny_oracle, tiny_prompts):
    """cudagraph-on judged against the same engine with cudagraph-off's options, within the oracle's budget."""
    device, dtype = device_dtype
    on, off = SCENARIOS["cudagraph-on"], SCENARIOS["cudagraph-off"]
    report = check_relative(engine_class(device), replace(on, needs_cuda=False), baseline_options=off.options,
                            oracle=tiny_oracle, source=tiny_prompts, dtype=dtype, device=device)
    assert report.passed, report.message()


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("name", ["granite-moe4-top2", "granite-moe8-top1-nope-groups2"])
def test_granite_experts_in_the_static_decode_step(name, device_dtype, tmp_path):
    """GraniteMoeHybrid's routed experts in the padded static step (every expert on every row, the unchosen weighted
    0, so that the shapes do not depend on the routing): eight requests decoding together, padded to 8, against the
    oracle, top-1 and top-2 routing."""
    from harness import zoo
    from harness.runner import Oracle

    device, dtype = device_dtype
    path = zoo.write_checkpoint(name, tmp_path)
    oracle = Oracle(path)
    source = zoo.prompt_source(name)
    requests = [Request(f"r{i}", tuple(source.tokens(5 + i, i)), 6) for i in range(7)]
    options = EngineOptions(cuda_graphs=True, max_num_seqs=8)
    results, (launches, padding_rows, _) = run_counted(device, dtype, oracle, requests, options)
    report = compare_runs(scenario=f"{name}-static-decode", requests=requests, baseline=oracle.results(requests),
                          candidate=results, budget=oracle.budget(requests, dtype))
    assert report.passed, report.message()
    assert 8 in launches and padding_rows > 0, f"padded sizes run: {launches}, padding rows {padding_rows}"
    oracle.close()
