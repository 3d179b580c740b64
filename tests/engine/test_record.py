"""What a step returns without the full rows. The harness asks the vendored engine for every position's top-k on
its device (prompt_top) instead of its full log-softmax rows (keep_rows), which at a 128K vocabulary cost seconds of
host work per scenario. Both are asked here, through chunked prefill, decode and a preemption, and every returned
number is compared with the rows it must come from; then the adapter's two paths are compared result by result."""

from __future__ import annotations

import pytest
import torch

from harness.adapters.vendored import VendoredEngine
from harness.engine import EngineOptions, Request
from tests.helpers import random_bamba_checkpoint
from vendored.engine import LLMEngine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("record"), seed=11)


REQUESTS = [("a", [3, 9, 14, 2, 7, 7, 1, 30, 5, 11, 4], 3), ("b", [8, 2], 4), ("c", [5, 6, 7, 8, 9, 10, 12], 2)]


def test_prompt_top_and_outputs_are_the_top_k_of_the_rows(checkpoint):
    # 4 tokens a step: prompts in pieces, decodes beside them; 5 K/V blocks of 4 for 9 blocks of context force a
    # preemption.
    engine = LLMEngine(checkpoint, max_model_len=32, max_num_seqs=3, max_num_batched_tokens=4, block_size=4,
                       num_kv_blocks=5)
    outputs = engine.generate(REQUESTS, top_k=3, keep_rows=True, prompt_top=True)
    assert sum(o.preemptions for o in outputs) > 0, "the workload was meant to preempt"
    for (rid, prompt, max_new), out in zip(REQUESTS, outputs):
        rows = out.rows.double()                                                     # (T-1+n, V)
        n_prompt = len(prompt) - 1
        assert rows.shape[0] == n_prompt + max_new and len(out.prompt_top) == n_prompt
        top = rows.topk(3, dim=-1)
        tops = out.prompt_top + out.output_top
        for i, entry in enumerate(tops):
            assert [t for t, _ in entry] == top.indices[i].tolist(), f"{rid} position {i + 1}"
            assert [v for _, v in entry] == top.values[i].tolist(), f"{rid} position {i + 1}"
        targets = torch.tensor(prompt[1:] + out.output_ids)
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        assert out.prompt_logprobs + out.output_logprobs == chosen
        assert out.output_ids == top.indices[n_prompt:, 0].tolist()


def test_without_prompt_top_the_engine_returns_none(checkpoint):
    (out,) = LLMEngine(checkpoint, max_model_len=32).generate([("a", [1, 2, 3], 1)], top_k=2)
    assert out.prompt_top is None and out.rows is None and len(out.output_top[0]) == 2


def test_the_adapter_returns_the_same_results_from_top_k_as_from_rows(checkpoint):
    """Requests without full distributions take the top-k path; with them, the rows path: same numbers."""
    options = EngineOptions(max_num_batched_tokens=4, max_num_seqs=3, num_kv_blocks=5, kv_block_size=4)
    plain = [Request(rid, tuple(p), n, top_k=3) for rid, p, n in REQUESTS]
    full = [Request(rid, tuple(p), n, top_k=3, full_distributions=True) for rid, p, n in REQUESTS]
    with VendoredEngine(checkpoint, options=options) as engine:
        by_top, by_rows = engine.run(plain), engine.run(full)
    for a, b in zip(by_top, by_rows):
        assert a.prompt_dists is None and b.prompt_dists is not None
        assert a.output_ids == b.output_ids
        for name in ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "output_logprobs",
                     "output_top_ids", "output_top_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), f"{a.request_id}: {name}"
