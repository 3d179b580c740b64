"""selective_state_update (one decode step of the SSM recurrence) against its twin selective_state_update_ref: every
output element, every live row's state, padding rows that read and write nothing, untouched slots bit-identical.

Every test runs each launch form the op has: the device's own choice (on the CPU the interpreter's batch of rows ×
heads a program), and the 2-D tile kernel (one row and one head a program, here with channel tiles of 8 so that
P = 16 spans two and odd P leaves a tail) in both program orders and both store orders the GPU's choices use."""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch

from reference.ops import discretize_dt, selective_state_update_ref
from tests.kernels.common import DEVICE, assert_slots_untouched, assert_three_way, gpu, needs_gpu, poison_slots
from tests.kernels.test_causal_conv1d import assert_rejected
from tests.kernels.providers import OPS
from vendored.ops.selective_state_update import SsuLaunch

ssu_module = importlib.import_module("vendored.ops.selective_state_update")
LAUNCHES = {"own-launch": None, "tile-kernel": SsuLaunch(1, 1, 8, 1),
            "tile-kernel-rows-inner-y-first": SsuLaunch(1, 1, 8, 1, rows_inner=True, y_first=True)}


@pytest.fixture(autouse=True, params=list(LAUNCHES))
def launch_form(request, monkeypatch):
    """The launch every test of this module runs with (the module docstring says which)."""
    if LAUNCHES[request.param] is not None:
        OPS.internal("our decode kernel's launch forms")
        monkeypatch.setattr(ssu_module, "_block_sizes", lambda *args: LAUNCHES[request.param])
    return request.param

K = 2.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}

H, P, N = 4, 16, 16
N_SLOTS = 10
PAD = -1
LIVE_AND_PAD = [3, PAD, 0, 7, PAD, 5]


def make_inputs(n_rows: int, *, n_heads: int = H, head_dim: int = P, d_state: int = N, n_groups: int = 1,
                n_slots: int = N_SLOTS, dt_shift: float = 0.0, seed: int = 0) -> dict:
    """fp32 CPU inputs on Bamba-like scales: A = -exp(A_log) with A_log in log[0.5, 7.5], dt_bias in [-2.5, 0.5];
    C scaled by N^-½ so that y = S·C stays of order 1 whatever N is (the fp32 atol is absolute)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        pool=torch.randn(n_slots, n_heads, head_dim, d_state, generator=gen),           # (S, H, P, N)
        x=torch.randn(n_rows, n_heads, head_dim, generator=gen),                         # (B, H, P)
        dt=torch.randn(n_rows, n_heads, generator=gen) + dt_shift,                       # (B, H)
        A=-(torch.rand(n_heads, generator=gen) * 7.0 + 0.5),                             # (H,)
        B=torch.randn(n_rows, n_groups, d_state, generator=gen),                         # (B, G, N)
        C=torch.randn(n_rows, n_groups, d_state, generator=gen) / math.sqrt(d_state),   # (B, G, N)
        D=torch.randn(n_heads, generator=gen),                                           # (H,)
        dt_bias=torch.rand(n_heads, generator=gen) * 3.0 - 2.5,                          # (H,)
        z=torch.randn(n_rows, n_heads, head_dim, generator=gen),                         # (B, H, P)
    )


def run_and_check(slots: list[int], inputs: dict, *, drop: tuple[str, ...] = (), dtype: torch.dtype = torch.float32,
                  state_dtype: torch.dtype = torch.float32, pad_slot_id: int = PAD, **options) -> None:
    """Poison every slot no live row reads, run kernel and twins (fp64 and on the inputs cast to `dtype`), check
    all. `drop` names the optional inputs (D, dt_bias, z) passed as None; `options` go to both sides."""
    live = [s for s in slots if s != pad_slot_id]
    pool_before = poison_slots(inputs["pool"].to(DEVICE), keep=live).to(dtype=state_dtype)
    low = {name: None if name in drop else t.to(device=DEVICE, dtype=dtype)
           for name, t in inputs.items() if name != "pool"}
    wide = {name: None if t is None else t.double() for name, t in low.items()}
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    pool_kernel, pool_low, pool64 = pool_before.clone(), pool_before.clone(), pool_before.double()

    def call(fn, pool, args):
        return fn(pool, args["x"], args["dt"], args["A"], args["B"], args["C"], D=args["D"],
                  dt_bias=args["dt_bias"], z=args["z"], state_indices=state_indices, pad_slot_id=pad_slot_id,
                  **options)

    y = call(OPS.selective_state_update, pool_kernel, low)
    y_low = call(selective_state_update_ref, pool_low, low)
    y64 = call(selective_state_update_ref, pool64, wide)
    assert y.dtype == y_low.dtype, f"y.dtype: expected {y_low.dtype}, got {y.dtype}"
    assert_three_way("y", y, y64, y_low, k=K, atol=ATOL[y.dtype])
    assert_three_way("ssm_states", pool_kernel[live], pool64[live], pool_low[live], k=K, atol=ATOL[state_dtype])
    assert_slots_untouched("ssm_states", pool_before, pool_kernel, touched=live)


# ---------------------------------------------------------------------------------------------------------------
# Heads and groups
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_groups", [1, 2, H], ids=lambda g: f"G{g}")
def test_groups_interleaved_with_padding_rows(n_groups):
    run_and_check(LIVE_AND_PAD, make_inputs(len(LIVE_AND_PAD), n_groups=n_groups))


def test_awkward_sizes():
    # P and N not powers of two (masked tiles), 3 heads per group; more heads and channels than the interpreter's
    # 4-head, 16-channel tile, so the last tile of each is partial.
    run_and_check([2, PAD, 8], make_inputs(3, n_heads=6, head_dim=20, d_state=10, n_groups=2, seed=1))


# ---------------------------------------------------------------------------------------------------------------
# Optional inputs and Δ
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop", [("z",), ("D",), ("dt_bias",), ("z", "D", "dt_bias")],
                         ids=["no_z", "no_D", "no_dt_bias", "none_of_them"])
def test_optional_inputs(drop):
    run_and_check(LIVE_AND_PAD, make_inputs(len(LIVE_AND_PAD), n_groups=2, seed=2), drop=drop)


def test_without_softplus():
    inputs = make_inputs(len(LIVE_AND_PAD), n_groups=2, seed=3)
    inputs["dt"] = inputs["dt"].abs() + 2.5                            # Δ = dt + dt_bias stays positive
    run_and_check(LIVE_AND_PAD, inputs, dt_softplus=False)


def test_softplus_identity_above_threshold():
    # dt + dt_bias spans [12, 29]: both branches of torch's threshold at 20.
    inputs = make_inputs(len(LIVE_AND_PAD), n_groups=2, dt_shift=22.0, seed=4)
    inputs["A"] = inputs["A"] / 200.0                                  # keep exp(Δ·A) away from 0 at Δ ≈ 20
    inputs["x"] = inputs["x"] / 20.0                                   # and Δ·x of order 1, like y elsewhere
    run_and_check(LIVE_AND_PAD, inputs)


def test_dt_limit_clamps_both_ends():
    inputs = make_inputs(len(LIVE_AND_PAD), n_groups=2, seed=5)
    limit = (0.15, 0.4)
    delta = discretize_dt(inputs["dt"], inputs["dt_bias"], True, (0.0, math.inf))
    assert (delta < limit[0]).any() and (delta > limit[1]).any(), "test inputs must reach beyond both limits"
    run_and_check(LIVE_AND_PAD, inputs, dt_limit=limit)


def test_16bit_input_with_fp32_state_pool():
    # fp16 inputs (the interpreter runs fp16, not bf16), fp32 pool: the new state keeps fp32 precision in the pool.
    run_and_check(LIVE_AND_PAD, make_inputs(len(LIVE_AND_PAD), n_groups=2, seed=9), dtype=torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# Slots and layouts
# ---------------------------------------------------------------------------------------------------------------


def test_pad_slot_id_names_a_real_slot():
    run_and_check([2, 0, 6, 0, 9], make_inputs(5, n_groups=2, seed=6), pad_slot_id=0)


def test_one_row():
    run_and_check([6], make_inputs(1, n_groups=2, seed=7))


def test_strided_views_of_one_projection():
    # x, B, C, dt as column views of one (B, H·P + 2·G·N + H) tensor, as the mixer splits its projection; the pool
    # stored (S, H, N, P) and viewed transposed.
    n_rows, n_groups = 4, 2
    inputs = make_inputs(n_rows, n_groups=n_groups, seed=8)
    slots = [1, PAD, 4, 9]
    packed = torch.cat([inputs["x"].flatten(1), inputs["B"].flatten(1), inputs["C"].flatten(1), inputs["dt"]], 1)
    sizes = [H * P, n_groups * N, n_groups * N, H]
    x, B, C, dt = packed.split(sizes, dim=1)
    views = dict(x=x.unflatten(1, (H, P)), B=B.unflatten(1, (n_groups, N)), C=C.unflatten(1, (n_groups, N)), dt=dt)
    assert not views["x"].is_contiguous() and not views["dt"].is_contiguous()
    live = [s for s in slots if s != PAD]
    pool_before = poison_slots(inputs["pool"], keep=live).to(DEVICE)
    pool_kernel = pool_before.transpose(2, 3).contiguous().transpose(2, 3)   # (S, H, P, N) with P fastest
    state_indices = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    common = dict(D=inputs["D"].to(DEVICE), dt_bias=inputs["dt_bias"].to(DEVICE), z=inputs["z"].to(DEVICE),
                  state_indices=state_indices)
    args = [views[n].to(DEVICE) for n in ("x", "dt")] + [inputs["A"].to(DEVICE)] + \
        [views[n].to(DEVICE) for n in ("B", "C")]
    y = OPS.selective_state_update(pool_kernel, *args, **common)
    pool_low = pool_before.clone()
    y_low = selective_state_update_ref(pool_low, *args, **common)
    pool64 = pool_before.double()
    y64 = selective_state_update_ref(pool64, *[a.double() for a in args],
                                     **{n: (t.double() if t.is_floating_point() else t) for n, t in common.items()})
    assert_three_way("y", y, y64, y_low, k=K, atol=ATOL[torch.float32])
    assert_three_way("ssm_states", pool_kernel[live], pool64[live], pool_low[live], k=K, atol=ATOL[torch.float32])
    assert_slots_untouched("ssm_states", pool_before, pool_kernel, touched=live)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_takes_the_returned_y_rounded_once(out_dtype):
    OPS.require("out_any_dtype")
    # y written into a strided view of a wider 16-bit buffer (the mixer's (T, H, P) output, decode rows first) holds
    # the bits of the returned fp32 y rounded by .to(): the same pool update, one rounding, nothing else written.
    inputs = {n: t.to(DEVICE) for n, t in make_inputs(len(LIVE_AND_PAD), n_groups=2, seed=11).items()}
    slots = torch.tensor(LIVE_AND_PAD, dtype=torch.int32, device=DEVICE)
    args = [inputs[n] for n in ("x", "dt", "A", "B", "C")]
    common = dict(D=inputs["D"], dt_bias=inputs["dt_bias"], z=inputs["z"], state_indices=slots, pad_slot_id=PAD)
    pool_plain, pool_out = inputs["pool"].clone(), inputs["pool"].clone()
    y = OPS.selective_state_update(pool_plain, *args, **common)
    buffer = torch.full((len(LIVE_AND_PAD) + 3, H, P + 5), 7.0, dtype=out_dtype, device=DEVICE)
    view = buffer[:len(LIVE_AND_PAD), :, 2:2 + P]
    assert not view.is_contiguous()
    returned = OPS.selective_state_update(pool_out, *args, **common, out=view)
    assert returned.data_ptr() == view.data_ptr()
    assert torch.equal(view, y.to(out_dtype))
    assert torch.equal(pool_out, pool_plain)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:len(LIVE_AND_PAD), :, 2:2 + P] = False
    assert (buffer[outside] == 7.0).all()


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(3, H, P + 1), "out.shape: expected (3, 4, 16), got (3, 4, 17)"),
    (torch.zeros(3, H, P, dtype=torch.int32), "out: expected dtype in"),
], ids=["shape", "int_dtype"])
def test_rejects_bad_out(bad, message):
    OPS.require("input_errors")
    with pytest.raises((ValueError, TypeError)) as info:
        OPS.selective_state_update(**_valid_args(), out=bad.to(DEVICE))
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------------


def _valid_args():
    t = {n: v.to(DEVICE) for n, v in make_inputs(3, n_groups=2).items()}
    return dict(ssm_states=t["pool"], x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"], D=t["D"],
                dt_bias=t["dt_bias"], z=t["z"], state_indices=torch.tensor([1, -1, 3], device=DEVICE))


@pytest.mark.parametrize("name, bad, message", [
    ("ssm_states", torch.zeros(N_SLOTS, H, P + 1, N), "ssm_states.shape[1:3]: expected (H, P) of x, (4, 16)"),
    ("B", torch.zeros(3, 3, N), "B.shape[1]: expected a group count G dividing H = 4, got 3"),
    ("C", torch.zeros(3, 2, N + 1), "C.shape: expected (3, 2, 16), got (3, 2, 17)"),
    ("dt", torch.zeros(3, H + 1), "dt.shape: expected (3, 4), got (3, 5)"),
    ("z", torch.zeros(3, H, P, dtype=torch.float64), "z: expected dtype in"),
    ("state_indices", torch.tensor([1.0, 2.0, 3.0]), "state_indices: expected dtype torch.int32 or torch.int64"),
], ids=["state_head_dim", "groups_not_dividing", "C_d_state", "dt_heads", "z_float64", "float_indices"])
def test_rejects_bad_input(name, bad, message):
    OPS.require("input_errors")
    assert_rejected(OPS.selective_state_update, _valid_args(), name, bad, message)


def test_rejects_inverted_dt_limit():
    OPS.require("input_errors")
    with pytest.raises(ValueError, match=r"dt_limit: expected \(low, high\) with low <= high, got \(1.0, 0.5\)"):
        OPS.selective_state_update(**_valid_args(), dt_limit=(1.0, 0.5))


# ---------------------------------------------------------------------------------------------------------------
# GPU: Bamba-9B shapes, 16-bit inputs, fp32 and bf16 state pools
# ---------------------------------------------------------------------------------------------------------------


@gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 64, pytest.param(256, marks=pytest.mark.xdist_group("large-gpu-memory"))],
                         ids=lambda b: f"B{b}")                        # B256: 18-21 GB reserved (conftest.py)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state_fp32", "state_bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bamba_shapes(dtype, state_dtype, batch):
    gen = torch.Generator().manual_seed(batch)
    slots = torch.randperm(batch + 44, generator=gen)[:batch].tolist()
    slots[batch // 2] = PAD
    run_and_check(slots, _bamba_inputs(batch), dtype=dtype, state_dtype=state_dtype, dt_limit=(0.0, 10.0))


@functools.lru_cache(maxsize=3)
def _bamba_inputs(batch: int) -> dict:
    """make_inputs at Bamba-9B's widths with batch + 44 slots (4 MB of fp32 state a slot: at batch 256 a 1.3 GB
    pool, seconds to draw on a CPU), drawn once a process for all the dtype and launch cases of a batch
    (run_and_check never writes them)."""
    return make_inputs(batch, n_heads=128, head_dim=64, d_state=128, n_groups=1, n_slots=batch + 44, seed=batch)


@gpu
@needs_gpu
@pytest.mark.xdist_group("large-gpu-memory")                           # 6.4 + 12.9 GB of buffers
def test_row_offsets_past_int32():
    """3 rows of x (bf16) and of y (fp32, through `out`) as views of buffers whose rows are 2^30 + 64 wide: row 2
    starts past 2^31, so a row offset computed in int32 (the row index is 32-bit when rows run inside heads) lands
    elsewhere. Against the twins on the same values, contiguous."""
    n_rows, row = 3, 2**30 + 64
    inputs = make_inputs(n_rows, seed=11)
    slots = [4, PAD, 2]
    live = [s for s in slots if s != PAD]
    low = {name: t.to(device=DEVICE, dtype=torch.bfloat16) for name, t in inputs.items() if name != "pool"}
    x_wide = torch.zeros(n_rows, row, dtype=torch.bfloat16, device=DEVICE)
    y_wide = torch.zeros(n_rows, row, dtype=torch.float32, device=DEVICE)
    x_view, y_view = (t[:, :H * P].unflatten(1, (H, P)) for t in (x_wide, y_wide))
    x_view.copy_(low["x"])
    assert max(2 * t.stride(0) for t in (x_view, y_view)) >= 2**31
    pool_before = poison_slots(inputs["pool"], keep=live).to(DEVICE)
    pool_kernel, pool_low, pool64 = pool_before.clone(), pool_before.clone(), pool_before.double()
    common = dict(state_indices=torch.tensor(slots, dtype=torch.int32, device=DEVICE), pad_slot_id=PAD)
    OPS.selective_state_update(pool_kernel, x_view, low["dt"], low["A"], low["B"], low["C"], D=low["D"],
                           dt_bias=low["dt_bias"], z=low["z"], out=y_view, **common)
    y_low = selective_state_update_ref(pool_low, low["x"], low["dt"], low["A"], low["B"], low["C"], D=low["D"],
                                       dt_bias=low["dt_bias"], z=low["z"], **common)
    wide = {name: t.double() for name, t in low.items()}
    y64 = selective_state_update_ref(pool64, wide["x"], wide["dt"], wide["A"], wide["B"], wide["C"], D=wide["D"],
                                     dt_bias=wide["dt_bias"], z=wide["z"], **common)
    assert_three_way("y", y_view, y64, y_low, k=K, atol=ATOL[torch.float32])
    assert_three_way("ssm_states", pool_kernel[live], pool64[live], pool_low[live], k=K, atol=ATOL[torch.float32])
    assert_slots_untouched("ssm_states", pool_before, pool_kernel, touched=live)
    assert not y_wide[:, H * P:].any(), "y: written outside its rows' first H·P columns"


@pytest.mark.parametrize("bad_slot", [N_SLOTS, -2], ids=["past_the_pool", "negative"])
def test_slot_outside_the_pool_touches_nothing_and_outputs_nan(bad_slot):
    OPS.require("slot_bounds")
    # No host check in a captured decode step: the kernel itself keeps a bad slot from memory (here the row just past
    # the pool's end, where a missing bound would read and write) and makes its row NaN, where padding gives 0.
    inputs = {name: t.to(DEVICE) for name, t in make_inputs(3).items()}
    backing = torch.cat([inputs["pool"], torch.randn_like(inputs["pool"][:1])])   # pool = rows 0..9, row 10 past it
    before = backing.clone()
    y = OPS.selective_state_update(backing[:N_SLOTS], inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                               D=inputs["D"], dt_bias=inputs["dt_bias"], z=inputs["z"],
                               state_indices=torch.tensor([2, bad_slot, PAD], dtype=torch.int32, device=DEVICE),
                               pad_slot_id=PAD)
    assert torch.isnan(y[1]).all(), "y: the row with a slot outside the pool is not NaN"
    assert not torch.isnan(y[0]).any() and bool((y[2] == 0).all()), "y: the live and padding rows changed"
    assert torch.equal(backing[N_SLOTS], before[N_SLOTS]), "ssm_states: the row past the pool was read into or written"
    assert_slots_untouched("ssm_states", before, backing, touched=[2])


# ---------------------------------------------------------------------------------------------------------------
# The tile kernel's launch: its grid and its row-index width (meta tensors: any shape and strides, no memory)
# ---------------------------------------------------------------------------------------------------------------


class _RecordedLaunch:
    """Stands in for the tile kernel: `kernel[grid](*args, **constexprs)` records the grid and the constexprs."""

    def __init__(self):
        self.grid, self.constexprs = None, None

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.grid, self.constexprs = grid, constexprs
        return launch


def _launch_on_meta(monkeypatch, launch: SsuLaunch, n_rows: int, n_heads: int, x_row_stride: int | None = None):
    """(grid, constexprs) of the tile kernel's launch for n_rows × n_heads (P = 64, N = 128, fp32 pool); x with the
    given row stride (default: contiguous)."""
    recorded = _RecordedLaunch()
    monkeypatch.setattr(ssu_module, "_selective_state_update_tile_kernel", recorded)
    monkeypatch.setattr(ssu_module, "_block_sizes", lambda *args: launch)
    p, n, meta = 64, 128, dict(device="meta")
    x = torch.empty_strided((n_rows, n_heads, p), (x_row_stride or n_heads * p, p, 1), **meta)
    bc = torch.empty(n_rows, 1, n, **meta)
    OPS.selective_state_update(torch.empty(n_rows, n_heads, p, n, **meta), x, torch.empty(n_rows, n_heads, **meta),
                           torch.empty(n_heads, **meta), bc, bc, D=None, dt_bias=None, z=None,
                           state_indices=torch.empty(n_rows, dtype=torch.int32, **meta))
    return recorded.grid, recorded.constexprs


@pytest.mark.vendored_only("our decode kernel's launch grid")
def test_tile_grid_orders_rows_inside_heads_on_request(monkeypatch):
    grid, constexprs = _launch_on_meta(monkeypatch, SsuLaunch(1, 1, 4, 1, rows_inner=True, y_first=True), 8, 128)
    assert grid == (16, 8, 128) and constexprs["ROWS_INNER"] and constexprs["Y_FIRST"]
    grid, constexprs = _launch_on_meta(monkeypatch, SsuLaunch(1, 1, 4, 1), 8, 128)
    assert grid == (16 * 128 * 8,) and not constexprs["ROWS_INNER"] and not constexprs["Y_FIRST"]


@pytest.mark.vendored_only("our decode kernel's launch grid")
def test_tile_row_index_widens_when_a_row_offset_reaches_2_31(monkeypatch):
    # rows inside heads keeps the row index 32-bit; an offset of 2^31 or more must make it 64-bit, or it wraps
    launch = SsuLaunch(1, 1, 4, 1, rows_inner=True)
    assert not _launch_on_meta(monkeypatch, launch, 3, 2)[1]["WIDE_ROWS"]
    # x (3, 2, 64) with row stride s: its last element at 2·s + 64 + 63
    assert not _launch_on_meta(monkeypatch, launch, 3, 2, x_row_stride=2**30 - 64)[1]["WIDE_ROWS"]    # 2^31 - 1
    assert _launch_on_meta(monkeypatch, launch, 3, 2, x_row_stride=2**30 - 63)[1]["WIDE_ROWS"]        # 2^31 + 1


@pytest.mark.vendored_only("our decode kernel's launch grid")
def test_tile_rows_inside_heads_refuses_a_grid_past_cuda_limits(monkeypatch):
    with pytest.raises(ValueError, match="rows_inner: a grid of 65536 rows × 1 heads exceeds the 65535"):
        _launch_on_meta(monkeypatch, SsuLaunch(1, 1, 4, 1, rows_inner=True), 65536, 1)


@pytest.mark.vendored_only("our decode kernel's launch grid")
def test_batched_kernel_refuses_the_tile_kernels_choices(monkeypatch):
    with pytest.raises(ValueError, match="rows_inner and y_first are the tile kernel's"):
        _launch_on_meta(monkeypatch, SsuLaunch(2, 1, 4, 1, y_first=True), 3, 2)
