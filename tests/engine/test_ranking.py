"""The tie rule of every top-k the engine and the harness return: equal values rank by the lower token id.

torch.topk leaves the order of equal values open (on this CPU it does not follow the rule either: the tests below
fail against it), and on a GPU which tied token makes the k-th place can change between runs: bf16 logits of a
128K vocabulary hold many exact ties, so a greedy choice or a top-k set taken that way makes two runs of one engine
differ. Checked element by element against a plain sort by (-value, id), on narrow rows (the router's stable-sort
path), wide rows (topk + boundary repair), and through the engine on a checkpoint whose logits tie by construction.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.engine import top_k_lower_index
from tests.helpers import random_bamba_checkpoint
from vendored.engine import LLMEngine
from vendored.engine.ranking import SORT_WIDTH, log_softmax_at, log_softmax_norm, ranked_log_softmax, top_k

IMPLEMENTATIONS = {"vendored": top_k, "harness": top_k_lower_index}


def expected(rows: torch.Tensor, k: int) -> list[list[int]]:
    return [sorted(range(rows.shape[1]), key=lambda j: (-row[j].item(), j))[:k] for row in rows]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("width", [6, SORT_WIDTH, SORT_WIDTH + 1, 3000])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_ties_rank_by_lower_id(impl, width, k):
    gen = torch.Generator().manual_seed(width + k)
    rows = torch.randint(0, 4, (7, width), generator=gen).float()      # few distinct values: ties everywhere
    rows[0] = torch.arange(width, dtype=torch.float32) % 7             # ties across the k-th place
    rows[1] = torch.randn(width, generator=gen)                        # no ties at all
    values, ids = IMPLEMENTATIONS[impl](rows, k)
    assert ids.tolist() == expected(rows, k)
    assert torch.equal(values, rows.gather(1, ids))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_whole_row_and_batch_shapes(impl):
    rows = torch.tensor([[2.0, 5.0, 5.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    values, ids = IMPLEMENTATIONS[impl](rows, 4)
    assert ids.tolist() == [[1, 2, 0, 3], [0, 1, 2, 3]]
    assert IMPLEMENTATIONS[impl](torch.zeros(0, 2000), 3)[1].shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wide_rows_rank_signed_zeros_infinities_and_nans_as_a_stable_sort(dtype):
    """The wide path ranks by integer keys built from the value's bits: -0.0 must tie with +0.0, -inf rank last,
    every NaN (either sign bit) first, as torch's stable descending sort orders them; values keep the row's dtype."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randint(-3, 3, (6, SORT_WIDTH + 5), generator=gen).float()
    rows[0] = torch.randn(SORT_WIDTH + 5, generator=gen)
    rows[1, :] = -0.0
    rows[1, ::3] = 0.0
    rows[2] = float("-inf")
    rows[2, 40] = float("inf")
    rows[3, 9], rows[3, 20] = float("nan"), -float("nan")
    rows[4] = -rows[4].abs() - 1e-3                                    # all negative: the flipped-bits half
    rows = rows.to(dtype)
    for k in (1, 5, 17):
        values, ids = top_k(rows, k)
        assert ids.tolist() == torch.sort(rows.float(), dim=-1, descending=True, stable=True).indices[:, :k].tolist()
        assert values.dtype == dtype
        assert torch.equal(values.nan_to_num(), rows.gather(1, ids).nan_to_num())


@pytest.mark.parametrize("width", [300, SORT_WIDTH + 500], ids=["torch-norm", "kernel-norm"])
def test_logprobs_are_one_expression_whatever_the_path(width):
    # Every logprob the engine returns is log_softmax_at(logit, its row's norm): the ranked values, the same row's
    # entries through log_softmax_norm (a prompt target, a kept row), a subset of rows, and k above the kernel's 16
    # give the same bits; the ranking is top_k's over the logits; the logprobs are log_softmax's to fp32 accuracy.
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=gen) * 6
    x[1, ::7] = x[1, 3]                                                # ties
    values, ids, norm = ranked_log_softmax(x, 4)
    assert torch.equal(ids, top_k(x, 4)[1])
    assert torch.equal(norm, log_softmax_norm(x))
    assert torch.equal(values, log_softmax_at(x.gather(-1, ids), norm))
    assert torch.equal(log_softmax_norm(x[[3, 0]]), norm[[3, 0]])
    wide_values, wide_ids, _ = ranked_log_softmax(x, 20)
    assert torch.equal(wide_ids[:, :4], ids) and torch.equal(wide_values[:, :4], values)
    rows = log_softmax_at(x, norm)
    want = torch.log_softmax(x.double(), dim=-1)
    assert float((rows.double() - want).abs().max()) <= 1e-5                 # a few fp32 ulps of |logits| ~ 20


_ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("width, device", [
    pytest.param(300, "cpu", id="torch-norm"), pytest.param(SORT_WIDTH + 500, "cpu", id="kernel-norm"),
    pytest.param(300, "cuda", id="torch-norm-cuda", marks=_ON_CUDA),
    pytest.param(SORT_WIDTH + 500, "cuda", id="kernel-norm-cuda", marks=_ON_CUDA),
    pytest.param(128256, "cuda", id="vocab-128256-cuda", marks=_ON_CUDA)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [4, 20])
def test_16bit_logits_rank_as_their_fp32_copy(width, dtype, k, device):
    # Ranked directly, 16-bit logits give the indices of their fp32 copy (the same values exactly, so the same order
    # and ties), and logprobs and norms within rounding: not always the same bits (on an H100, 2026-12-06, the
    # kernel reduced a 128256-wide row in another layout for 16-bit loads: other bits), which is why every engine
    # step, CUDA graphs included, ranks fp32 logits.
    gen = torch.Generator().manual_seed(width + k)
    x = (torch.randn(5, width, generator=gen) * 6).to(dtype).to(device)
    x[1, ::7] = x[1, 3]                                                # ties
    x[2, 5], x[2, 9], x[3, 11] = float("inf"), float("-inf"), -0.0
    x[4, :] = float("-inf")
    x[4, 17] = 2.0
    (values, indices, norm), (values32, indices32, norm32) = ranked_log_softmax(x, k), ranked_log_softmax(x.float(), k)
    assert torch.equal(indices, indices32)
    for name, a, b in (("values", values, values32), ("norm", norm, norm32),
                       ("log_softmax_norm", log_softmax_norm(x), log_softmax_norm(x.float()))):
        torch.testing.assert_close(a, b, rtol=4 * 2**-23, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("width, device", [
    pytest.param(300, "cpu", id="torch-norm"), pytest.param(SORT_WIDTH + 500, "cpu", id="kernel-norm"),
    pytest.param(300, "cuda", id="torch-norm-300-cuda", marks=_ON_CUDA),
    pytest.param(512, "cuda", id="torch-norm-512-cuda", marks=_ON_CUDA),
    pytest.param(SORT_WIDTH, "cuda", id="torch-norm-1024-cuda", marks=_ON_CUDA),
    pytest.param(SORT_WIDTH + 500, "cuda", id="kernel-norm-cuda", marks=_ON_CUDA),
    pytest.param(128256, "cuda", id="vocab-128256-cuda", marks=_ON_CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_ranking_is_the_same_bits_in_any_batch(width, dtype, device):
    # The engine's batch-invariant mode and its CUDA-graph steps (padded to a captured size) rank one request's row
    # among other rows, other numbers of rows: its norm, logprobs and ids must be the bits it gets alone.
    rows = 64 if device == "cuda" else 6                              # the interpreter runs a program a row
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, width, generator=gen) * 6).to(dtype).to(device)
    x[5, ::3] = float("-inf")
    whole = ranked_log_softmax(x, 8)
    for n in (n for n in (1, 2, 3, 4, 7, 8, 16, 33) if n < rows):
        part = ranked_log_softmax(x[:n], 8)
        for name, a, b in zip(("values", "indices", "norm"), part, whole):
            assert torch.equal(a, b[:n]), f"{name}: the first {n} rows ranked alone differ from them among {rows}"
        assert torch.equal(log_softmax_norm(x[:n]), whole[2][:n]), f"log_softmax_norm of {n} rows"
    for i in (0, 5, rows - 1):
        alone = ranked_log_softmax(x[i:i + 1], 8)
        assert all(torch.equal(a, b[i:i + 1]) for a, b in zip(alone, whole)), f"row {i} alone"


def test_logprob_norm_of_special_rows():
    # NaN anywhere: NaN; +inf: +inf (its entry NaN, the others -inf); a row of -inf: -inf, every logprob NaN.
    x = torch.zeros(3, 5)
    x[0, 2], x[1, 4], x[2] = float("nan"), float("inf"), float("-inf")
    norm = log_softmax_norm(x)
    assert torch.isnan(norm[0, 1]) and norm[1, 1] == float("inf") and norm[2, 1] == float("-inf")
    assert torch.equal(norm[:, 0], torch.zeros(3))
    rows = log_softmax_at(x, norm)
    assert torch.isnan(rows[1, 4]) and bool((rows[1, :4] == float("-inf")).all()) and bool(torch.isnan(rows[2]).all())


def test_vendored_rejects_a_k_wider_than_the_row():
    with pytest.raises(ValueError, match="k=5 for rows of width 4"):
        top_k(torch.zeros(2, 4), 5)


def test_engine_greedy_choice_and_top_k_follow_the_rule(tmp_path):
    """lm_head rows repeated: token j's logit equals token j mod 5's, so every position's top-k is all ties. The
    greedy token must be the lowest id of the largest group and each top-k the lowest ids, as the oracle's argmax."""
    directory = random_bamba_checkpoint(tmp_path / "ckpt", seed=3)
    weights = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    key = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    head = weights[key]
    weights[key] = head[torch.arange(head.shape[0]) % 5].contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    engine = LLMEngine(directory, max_model_len=32, max_num_batched_tokens=4)
    (out,) = engine.generate([("a", [3, 9, 14, 2, 7, 11], 3)], top_k=4, keep_rows=True, prompt_top=True)
    rows = out.rows.double()
    # equal weight rows give equal logits up to the GEMM's rounding, which may differ at the tail of the vocabulary
    assert all(len(set(r.topk(5).values.tolist())) < 5 for r in rows), "the top-k were meant to tie"
    for i, entry in enumerate(out.prompt_top + out.output_top):
        assert [t for t, _ in entry] == expected(rows[i:i + 1], 4)[0], f"position {i + 1}"
    assert out.output_ids == [expected(rows[i:i + 1], 1)[0][0] for i in range(5, 8)]
