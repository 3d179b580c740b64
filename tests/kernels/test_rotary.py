"""rotary_ against its twin rotary_ref: every element of every head, partial and full rotary dims, q/k/v side by side
(only the first heads rotated, the rest bit-identical), positions in any order, every float dtype, bad inputs named."""

from __future__ import annotations

import pytest
import torch

from reference.ops import rotary_ref
from tests.kernels.common import DEVICE, assert_three_way, gpu, needs_gpu
from vendored.ops.rotary import rotary_

K = 2.0
ULPS = 1.0   # a·cos − b·sin in fp32 may differ from torch's in its last bits (a fused multiply-add on a GPU) and
             # round to a 16-bit dtype one step away near a rounding boundary
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}
THETA = 10000.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def tables(max_positions: int, rotary_dim: int, theta: float = THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's tables: fp64 angles, each row's half repeated, stored in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None]
    return (torch.cat([angles.cos()] * 2, -1).float().to(DEVICE), torch.cat([angles.sin()] * 2, -1).float().to(DEVICE))


def run_and_check(tokens: int, heads: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, *,
                  n_rot_heads: int | None = None, seed: int = 0, max_positions: int = 4096) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, max_positions, (tokens,), generator=gen).to(DEVICE)
    cos, sin = tables(max_positions, rotary_dim)
    before = t.clone()
    out = rotary_(t, positions, cos, sin, n_rot_heads=n_rot_heads)
    assert out is t, "rotary_ works in place and returns its tensor"
    n = heads if n_rot_heads is None else n_rot_heads
    rotated = before[:, :n]
    ref_low = rotary_ref(rotated, positions, rotary_dim=rotary_dim, theta=THETA)
    ref64 = rotary_ref(rotated.double(), positions, rotary_dim=rotary_dim, theta=THETA)
    assert_three_way("rotated heads", out[:, :n], ref64, ref_low, k=K, atol=ATOL[dtype], ulps=ULPS)
    assert torch.equal(out[:, :n, rotary_dim:], before[:, :n, rotary_dim:]), "dims past the rotary dims changed"
    assert torch.equal(out[:, n:], before[:, n:]), "heads past n_rot_heads changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads, head_dim, rotary_dim", [(3, 16, 16), (5, 16, 8), (2, 32, 4), (1, 8, 2)],
                         ids=["full", "half", "eighth", "one-pair"])
def test_rotary_dims(heads, head_dim, rotary_dim, dtype):
    run_and_check(11, heads, head_dim, rotary_dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_q_and_k_rotated_v_left(dtype):
    """q (4 heads), k (2) and v (2) side by side: the first 6 heads rotate, v stays."""
    run_and_check(9, 8, 16, 8, dtype, n_rot_heads=6, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_several_programs(dtype):
    """3000 tokens × 3 rotated heads of 4: (token, head) pairs past one program on either backend, the last one
    partial, and heads not a power of two (a pair's token and head from its row number)."""
    run_and_check(3000, 4, 16, 16, dtype, n_rot_heads=3, seed=2)


def test_no_tokens_and_no_heads():
    cos, sin = tables(16, 8)
    t = torch.randn(0, 2, 8, device=DEVICE)
    assert rotary_(t, torch.zeros(0, dtype=torch.long, device=DEVICE), cos, sin) is t
    t = torch.randn(3, 2, 8, device=DEVICE)
    before = t.clone()
    rotary_(t, torch.zeros(3, dtype=torch.long, device=DEVICE), cos, sin, n_rot_heads=0)
    assert torch.equal(t, before)


@pytest.mark.parametrize("bad, message", [
    (dict(t=torch.zeros(3, 16)), r"t.dim\(\): expected 3"),
    (dict(t=torch.zeros(3, 2, 16, dtype=torch.long)), r"t: expected dtype in"),
    (dict(t=torch.zeros(3, 16, 2).transpose(1, 2)), r"t: expected unit stride along head_dim"),
    (dict(positions=torch.zeros(4, dtype=torch.long)), r"positions: expected an integer tensor of shape \(3,\)"),
    (dict(positions=torch.zeros(3)), r"positions: expected an integer tensor"),
    (dict(n_rot_heads=3), r"n_rot_heads: expected 0..2, got 3"),
    (dict(cos=torch.zeros(8, 5), sin=torch.zeros(8, 5)), r"\(the rotary dims\): expected an even number in 2..16, got 5"),
    (dict(cos=torch.zeros(8, 32), sin=torch.zeros(8, 32)), r"expected an even number in 2..16, got 32"),
    (dict(cos=torch.zeros(8, 8, dtype=torch.float64)), r"cos: expected a \(positions, rotary_dim\) fp32 table"),
    (dict(sin=torch.zeros(9, 8)), r"cos and sin: expected one shape and layout"),
], ids=["2d", "int-dtype", "strided-head-dim", "positions-shape", "float-positions", "too-many-heads", "odd-dims",
        "dims-past-head", "fp64-table", "table-shapes"])
def test_rejects_bad_input(bad, message):
    args = dict(t=torch.zeros(3, 2, 16), positions=torch.zeros(3, dtype=torch.long), cos=torch.zeros(8, 8),
                sin=torch.zeros(8, 8), n_rot_heads=None)
    args.update(bad)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        rotary_(args["t"], args["positions"], args["cos"], args["sin"], n_rot_heads=args["n_rot_heads"])


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 8, 1000])
def test_bamba_shapes(dtype, tokens):
    """Bamba-9B: 32 query and 8 K/V heads of 128, half the dims rotated; q and k rotated in one launch."""
    run_and_check(tokens, 48, 128, 64, dtype, n_rot_heads=40, seed=2, max_positions=131072)
