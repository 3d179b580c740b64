"""The eager step's masked attention (vendored/engine/paged_attention.py: masked_attention): equal to the oracle's
grouped-query attention row by row, and on a GPU the same bits from run to run whatever the memory around its inputs
holds (the cuDNN backend, torch's default for a bf16 masked call on an H200, was not)."""

from __future__ import annotations

import pytest
import torch

from reference.ops import gqa_attention_ref
from vendored.engine.paged_attention import masked_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [pytest.param(("cpu", torch.float32), id="cpu-fp32"),
         pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=[pytest.mark.gpu, needs_cuda]),
         pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=[pytest.mark.gpu, needs_cuda])]
# |out - fp64| <= TOL·(max |v| of the row's keys): fp32 accumulation, and in bf16 the rounding of the inputs (each
# 2^-9 relative) and of the output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def padded_batch(n_seq: int, q_lens: list[int], ctx_lens: list[int], L: int, Hq: int, Hkv: int, Dh: int, *,
                 device: str, dtype: torch.dtype, seed: int = 0):
    """Inputs laid out as the engine's eager step makes them: queries padded to the longest piece, keys to L, the
    keys past a context zeroed, each query allowed the keys up to its own position, padding queries key 0 only."""
    gen = torch.Generator().manual_seed(seed)
    Tq = max(q_lens)
    q = torch.randn(n_seq, Tq, Hq, Dh, generator=gen)
    keys, values = torch.randn(n_seq, L, Hkv, Dh, generator=gen), torch.randn(n_seq, L, Hkv, Dh, generator=gen)
    ctx, qlen = torch.tensor(ctx_lens), torch.tensor(q_lens)
    key_valid = torch.arange(L)[None] < ctx[:, None]
    keys, values = keys * key_valid[:, :, None, None], values * key_valid[:, :, None, None]
    q_valid = torch.arange(Tq)[None] < qlen[:, None]
    q_pos = (ctx - qlen)[:, None] + torch.arange(Tq)[None]
    allowed = (torch.arange(L)[None, None] <= q_pos[:, :, None]) & q_valid[:, :, None]
    allowed[..., 0] |= ~q_valid
    cast = dict(device=device, dtype=dtype)
    return (q.to(**cast), keys.to(**cast), values.to(**cast), allowed.to(device), q_valid)


def call(q, keys, values, allowed, scale):
    """masked_attention on the engine's (n, T, H, Dh) layout, transposed as the engine passes them."""
    return masked_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), allowed[:, None],
                            scale=scale).transpose(1, 2)                                   # (n, Tq, Hq, Dh)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_each_query_row_equals_the_oracle(case, Hq, Hkv):
    # Pieces of 1, 5 and 17 queries over contexts of 9, 40 and 270 keys, padded to 272 (not a multiple of 128, nor
    # of the 16 bytes some kernels align masks to).
    device, dtype = case
    q_lens, ctx_lens, L, Dh = [1, 5, 17], [9, 40, 270], 272, 64
    q, keys, values, allowed, q_valid = padded_batch(3, q_lens, ctx_lens, L, Hq, Hkv, Dh, device=device, dtype=dtype)
    scale = Dh ** -0.5
    out = call(q, keys, values, allowed, scale)
    assert out.dtype == dtype and out.shape == q.shape
    for b, (n_q, n_ctx) in enumerate(zip(q_lens, ctx_lens)):
        ref = gqa_attention_ref(q[b, :n_q].double().cpu(), keys[b, :n_ctx].double().cpu(),
                                values[b, :n_ctx].double().cpu(), scale=scale)           # (n_q, Hq, Dh)
        got = out[b, :n_q].double().cpu()
        bound = TOL[dtype] * float(values[b, :n_ctx].abs().max())
        err = (got - ref).abs()
        assert not torch.isnan(got).any(), f"sequence {b}: NaN in the output"
        assert float(err.max()) <= bound, f"sequence {b}: max |out - fp64| {float(err.max()):.3g} > {bound:.3g}"
        assert not torch.isnan(out[b, n_q:]).any(), f"sequence {b}: NaN in a padding query's row"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_same_bits_whatever_the_memory_after_the_mask_holds(dtype):
    # The mask sits at the start of a larger byte buffer, as the caching allocator may place it; the bytes after it
    # are set to 0, then 1, then 0xff, and the allocator's free memory filled with NaN between calls. A kernel that
    # reads past the mask's last row (or any buffer it did not write) gives different bits; this one may not.
    q_lens, ctx_lens, L, Hq, Hkv, Dh = [1, 5, 17, 257], [9, 40, 270, 300], 304, 32, 8, 128
    q, keys, values, allowed, _ = padded_batch(4, q_lens, ctx_lens, L, Hq, Hkv, Dh, device="cuda", dtype=dtype)
    backing = torch.zeros(allowed.numel() + 2 ** 20, dtype=torch.uint8, device="cuda")
    mask = backing[:allowed.numel()].view(allowed.shape).view(torch.bool)
    mask.copy_(allowed)
    first = None
    for fill in (0, 1, 255, 0, 1, 255):
        backing[allowed.numel():] = fill
        junk = torch.full((2 ** 28,), float("nan"), device="cuda")                      # 1 GiB of NaN, then freed
        del junk
        out = call(q, keys, values, mask, Dh ** -0.5)
        if first is None:
            first = out.clone()
            continue
        same = out.view(torch.int16 if dtype != torch.float32 else torch.int32) == \
            first.view(torch.int16 if dtype != torch.float32 else torch.int32)
        assert bool(same.all()), (f"bytes after the mask set to {fill}: {int((~same).sum())} output elements "
                                  f"differ from the first call's, by up to {float((out - first).abs().max()):.3g}")
