"""What the vendored engine holds besides the weights: a run's state slots sized by its requests when the scenario
leaves max_num_seqs unset (the same schedule, the same bits), and merged projections made once on the device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.adapters.vendored import DEFAULT_MAX_NUM_SEQS, VendoredEngine, default_max_num_seqs
from harness.scenarios import build_scenarios
from vendored.engine.model import _merge

from .conftest import TINY_CFG


@pytest.mark.parametrize("requests, slots", [(0, 1), (1, 1), (5, 5), (17, 17), (64, 64), (65, 64), (1000, 64)])
def test_default_slots_are_the_runs_requests_at_most_64(requests, slots):
    assert DEFAULT_MAX_NUM_SEQS == 64
    assert default_max_num_seqs(requests) == slots


def _fields(result):
    return {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}


def _same(a, b) -> list[str]:
    """The fields in which two results of one request differ (tensors compared bit for bit, NaN equal to NaN)."""
    differ = []
    for name, x in _fields(a).items():
        y = getattr(b, name)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(torch.nan_to_num(x, nan=123.0),
                                                                           torch.nan_to_num(y, nan=123.0)):
                differ.append(name)
        elif x != y:
            differ.append(name)
    return differ


# A preemption scenario (the K/V cache too small: requests give back their slots and take one again) and one with a
# request arriving mid-run: where the number of slots could change whose slot is whose.
CASES = [s for s in build_scenarios(TINY_CFG) if s.kind == "preemption" and not s.slow][:1] + \
        [s for s in build_scenarios(TINY_CFG) if s.id == "chunked_prefill-budget17-Q16"]


@pytest.mark.parametrize("scenario", CASES, ids=lambda s: s.id)
def test_slots_sized_by_the_run_give_the_same_bits_as_64(scenario, tiny_oracle, tiny_prompts):
    assert scenario.options.max_num_seqs is None, "the case must leave max_num_seqs to the adapter"
    requests = scenario.requests(tiny_prompts, top_k=5)
    assert 1 < len(requests) < DEFAULT_MAX_NUM_SEQS
    runs = {}
    for slots in (None, DEFAULT_MAX_NUM_SEQS):
        options = dataclasses.replace(scenario.options, max_num_seqs=slots)
        with VendoredEngine(tiny_oracle.checkpoint, dtype=torch.float32, device="cpu", options=options) as engine:
            runs[slots] = engine.run(requests)
            held = engine.engine.states.num_slots
            preemptions = engine.engine.total_preemptions
        assert held == (len(requests) if slots is None else slots)
        if scenario.kind == "preemption":
            assert preemptions > 0, "nothing was preempted: the case lost its point"
    for a, b in zip(runs[None], runs[DEFAULT_MAX_NUM_SEQS]):
        assert a.request_id == b.request_id
        assert not _same(a, b), f"{a.request_id}: {_same(a, b)} differ between {len(requests)} slots and 64"


@pytest.mark.parametrize("source, target", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                            (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
@pytest.mark.parametrize("bias", [False, True])
def test_merge_is_the_concatenation_converted(source, target, bias):
    g = torch.Generator().manual_seed(0)
    prefix = "model.layers.0.self_attn."
    w = {prefix + n + ".weight": (torch.randn(r, 12, generator=g) * 3).to(source)
         for n, r in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))}
    if bias:
        w.update({prefix + n + ".bias": torch.randn(r, generator=g).to(source)
                  for n, r in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4))})
    parts = dict(w)
    widths = _merge(w, prefix, ("q_proj", "k_proj", "v_proj"), "qkv_proj", device=torch.device("cpu"), dtype=target)
    assert widths == (8, 4, 4)
    assert sorted(w) == sorted(prefix + "qkv_proj." + k for k in (("weight", "bias") if bias else ("weight",)))
    for kind in ("weight",) + (("bias",) if bias else ()):
        want = torch.cat([parts[prefix + n + "." + kind] for n in ("q_proj", "k_proj", "v_proj")]).to(target)
        got = w[prefix + "qkv_proj." + kind]
        assert got.dtype == target and torch.equal(got, want)


def test_merge_keeps_parts_when_one_is_missing_or_biases_are_mixed():
    prefix = "model.layers.0.feed_forward."
    w = {prefix + "gate_proj.weight": torch.ones(4, 3)}
    assert _merge(w, prefix, ("gate_proj", "up_proj"), "gate_up_proj") is None
    assert list(w) == [prefix + "gate_proj.weight"]
    w = {prefix + "gate_proj.weight": torch.ones(4, 3), prefix + "up_proj.weight": torch.ones(4, 3),
         prefix + "gate_proj.bias": torch.ones(4)}
    before = dict(w)
    assert _merge(w, prefix, ("gate_proj", "up_proj"), "gate_up_proj") is None
    assert w == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_merged_weights_leave_no_holes_on_the_gpu():
    """Loading merged projections frees nothing on the device: what the caching allocator reserved for the weights
    is what they hold (merging after the move left each part's memory free but reserved; 7.5 GB at Bamba-9B width)."""
    from vendored.engine.model import BambaEngineModel
    from vendored.engine.weights import load

    from .conftest import TINY

    cfg, tensors = load(TINY)
    big = {k: v.repeat(64, 1) if k.endswith(("gate_proj.weight", "up_proj.weight")) else v
           for k, v in tensors.items()}              # parts of 1 MB and more: the allocator's large pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    freed_before = torch.cuda.memory_stats()["allocated_bytes.all.freed"]
    model = BambaEngineModel(cfg, big, dtype=torch.float32, device=torch.device("cuda"), max_positions=64)
    torch.cuda.synchronize()
    freed = torch.cuda.memory_stats()["allocated_bytes.all.freed"] - freed_before
    assert torch.cuda.memory_allocated() > before
    merged = sum(t.numel() * t.element_size() for k, t in model.w.items() if k.endswith("gate_up_proj.weight"))
    assert merged > 0
    # what was freed while building is small beside the merged weights (temporaries of the small tensors only)
    assert freed < merged / 4, f"{freed} bytes freed while building, beside {merged} of merged weights"
