"""The SSD chunked scan kernel (vendored/ops/ssd_scan.py) against its sequential twin (reference.ops.ssd_scan_ref).

Every element of y and of every final state is held to the three-way bound of tests/kernels/common.py,
|kernel - ref64| <= K·|ref_low - ref64| + atol (ATOL_Y, ATOL_STATE): ref64 is the twin on the same inputs in fp64,
ref_low the twin on the kernel's own inputs (x, B, C, z in the kernel's dtype) with an fp32 state pool, its results
rounded to the dtypes the kernel stores (y in x's dtype, final states in the pool's dtype).
Slots: sequence b of B uses slot 2(B-1-b)+1 of a pool of 2B+1, so named slots run backwards with an unused slot
between neighbours; before each call every slot that is not some sequence's initial state is NaN, and the slots not
named must come back bit-identical.
CPU runs go through the Triton interpreter in fp32 at small shapes (H=4, P=16, N=16, Q=16); the `gpu` tests run
bf16/fp16/fp32 at Bamba-9B shapes, and one past 70K tokens against a chunked fp64 twin written below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from reference.ops import discretize_dt, group_of_head, ssd_scan_ref
from tests.kernels.common import DEVICE, assert_slots_untouched, assert_three_way, gpu, needs_gpu, poison_slots
from tests.kernels.providers import OPS
from vendored.ops.ssd_scan_products import _bf16x3

K = 2.0
# atol: the floor of the bound where ref_low happens to land on ref64. The kernel sums in another order than the
# sequential twin (chunks, tl.dot), so its fp32 noise is of the twin's size but not element-wise below 2x of it; and a
# 16-bit y rounds to the other neighbour where that noise straddles a rounding midpoint. Measured as the largest
# |kernel - ref64| - K·|ref_low - ref64| over all cases: y fp32 2.7e-6 (CPU shapes), 5.1e-5 (Bamba-9B, |y| <= 154,
# H200); y bf16 6.6e-6 (72K tokens, |y| <= 253); y fp16 1.5e-5; final states 7.1e-7 (fp32 pool), 1e-7 (bf16 pool).
ATOL_Y = {torch.float32: 1e-4, torch.bfloat16: 2e-5, torch.float16: 4e-5}
ATOL_STATE = 2e-6

# The Triton interpreter (CPU) itself converts one-element arrays to loop bounds in a way numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BAMBA_9B = dict(n_heads=128, head_dim=64, d_state=128, n_groups=1, chunk_size=256)


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]
    initial: str = "mixed"          # which sequences start from their slot: "all", "none", "mixed" (b % 3 != 2)
    n_heads: int = 4
    head_dim: int = 16
    d_state: int = 16
    n_groups: int = 2
    chunk_size: int = 16
    has_z: bool = True
    has_D: bool = True
    has_dt_bias: bool = True
    dt_softplus: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)


def slots_of(n_seqs: int) -> list[int]:
    return [2 * (n_seqs - 1 - b) + 1 for b in range(n_seqs)]


def initial_of(case: Case) -> list[bool]:
    return [{"all": True, "none": False, "mixed": b % 3 != 2}[case.initial] for b in range(len(case.lengths))]


def make_inputs(case: Case, dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0):
    """(x, dt, A, B, C), the keyword arguments but ssm_states, and a random pool (2B+1, H, P, N) on DEVICE."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    n_tokens, n_seqs = sum(case.lengths), len(case.lengths)
    H, P, N, G = case.n_heads, case.head_dim, case.d_state, case.n_groups

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=DEVICE)

    x, B, C, z = randn(n_tokens, H, P), randn(n_tokens, G, N), randn(n_tokens, G, N), randn(n_tokens, H, P)
    if case.dt_softplus:            # Δ = softplus(dt + dt_bias) mostly in 0.05 .. 0.5
        dt, dt_bias = 0.5 * randn(n_tokens, H), rand(H) * 2.0 - 3.0
    else:
        dt, dt_bias = 0.02 + 0.3 * rand(n_tokens, H), 0.1 * rand(H)
    A = -(0.5 + 3.5 * rand(H))      # per-step decay exp(Δ·A) from ~0.998 to ~0.2: some heads remember past chunks
    D = randn(H)
    cu_seqlens = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    pool = randn(2 * n_seqs + 1, H, P, N).to(state_dtype)
    kwargs = dict(
        chunk_size=case.chunk_size, D=D if case.has_D else None, dt_bias=dt_bias if case.has_dt_bias else None,
        z=z.to(dtype) if case.has_z else None, cu_seqlens=cu_seqlens,
        state_indices=torch.tensor(slots_of(n_seqs), dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor(initial_of(case), device=DEVICE),
        dt_softplus=case.dt_softplus, dt_limit=case.dt_limit,
    )
    return (x.to(dtype), dt, A, B.to(dtype), C.to(dtype)), kwargs, pool


def as_dtype(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def run_twin(twin, args, kwargs, pool: torch.Tensor, dtype: torch.dtype | None):
    """The twin on the inputs cast to `dtype` (None: as they are) with a copy of the pool in `dtype` (None: fp32)."""
    if dtype is not None:
        args, kwargs = [as_dtype(a, dtype) for a in args], {k: as_dtype(v, dtype) for k, v in kwargs.items()}
    states = pool.to(dtype or torch.float32).clone()
    return twin(*args, ssm_states=states, **kwargs), states


# products="rounded": each term of y_t (C_t·S_in·decay, C_t·B_s·decay·Δ_s·x_s) and of a final state (decay·Δ_s·x_s⊗B_s)
# passes through at most two roundings: stage 2's x·decay·Δ, as two bf16 pieces (off by < 2^-15 of it; one rounding
# to fp16, 2^-11, for fp16 inputs), then the entering state that holds it, rounded to the input's dtype (u = 2^-8 for
# bf16, 2^-11 for fp16) and read out by C; or, inside the chunk, C·Bᵀ∘L·Δ, rounded to u. A final state's terms pass
# through stage 2's rounding alone (state passing runs in fp32). So |error| <= (sum of those units)·Σ|terms|, plus
# second-order terms, and Σ|terms| is the twin run on |x|, |B|, |C|, the |initial states|, without D (D·x is exact):
# the same recurrence, every term positive. The allowance is 1.5 times that first-order bound: the half covers the
# second-order terms and the fp32 cumulative sums (their decays off by ~|cs|·2^-24 relative). And a value moved so may
# then round to the other 16-bit neighbour when stored (y, a bf16 pool): one ulp more, which ref_low's own rounding
# does not bound. A peer's scan rounds stage 2's B·decay·Δ to the input's dtype once (tests/kernels/providers.py,
# scan_stage2_rounds_once): its stage-2 unit is u, 2^-8 in bf16 (the same as ours in fp16).
ROUNDED_UNITS = {torch.bfloat16: (2.0 ** -8, 2.0 ** -15), torch.float16: (2.0 ** -11, 2.0 ** -11)}   # (u, stage 2)
ROUNDED_MARGIN = 1.5


def rounding_allowance(args, kwargs, pool: torch.Tensor, twin) -> tuple[torch.Tensor, torch.Tensor]:
    """What products="rounded" may add to |y - ref64| and to |final states - ref64|, element by element (above)."""
    x, dt, A, B, C = args
    u, u_state = ROUNDED_UNITS[x.dtype]
    if OPS.scan_stage2_rounds_once:
        u_state = u
    y_abs, states_abs = run_twin(twin, (x.abs(), dt, A, B.abs(), C.abs()), dict(kwargs, D=None), pool.abs(),
                                 torch.float64)
    return ROUNDED_MARGIN * (u + u_state) * y_abs.abs(), ROUNDED_MARGIN * u_state * states_abs.abs()


def check_call(case: Case, args, kwargs, pool: torch.Tensor, twin=ssd_scan_ref, products: str = "fp32") -> None:
    """Run the kernel on NaN-poisoned state slots; check y, every final state and every slot not named."""
    dtype, state_dtype = args[0].dtype, pool.dtype
    products = OPS.scan_products or products          # a peer is judged by the precision class it has
    slots = slots_of(len(case.lengths))
    poisoned = poison_slots(pool, keep=[s for s, init in zip(slots, initial_of(case)) if init])
    states = poisoned.clone()
    y = OPS.ssd_scan(*args, ssm_states=states, products=products, **kwargs)
    y64, states64 = run_twin(twin, args, kwargs, poisoned, torch.float64)
    y_low, states_low = run_twin(twin, args, kwargs, poisoned, None)
    y_extra = states_extra = None
    ulps = 0.0
    if products == "rounded" and dtype in ROUNDED_UNITS:
        y_extra, states_extra = rounding_allowance(args, kwargs, poisoned, twin)
        ulps = 1.0

    assert y.dtype == dtype, f"y: expected dtype {dtype}, got {y.dtype}"
    starts = kwargs["cu_seqlens"].tolist()
    for b, slot in enumerate(slots):           # per sequence: smaller host copies, and the message names it
        tokens = slice(starts[b], starts[b + 1])
        assert_three_way(f"y of sequence {b}", y[tokens], y64[tokens], y_low[tokens].to(dtype), k=K,
                         atol=ATOL_Y[dtype], ulps=ulps, extra=None if y_extra is None else y_extra[tokens])
        assert_three_way(f"final state of sequence {b} (slot {slot})", states[slot], states64[slot],
                         states_low[slot].to(state_dtype), k=K, atol=ATOL_STATE, ulps=ulps,
                         extra=None if states_extra is None else states_extra[slot])
    assert_slots_untouched("ssm_states", poisoned, states, touched=slots)


def check_against_twin(case: Case, dtype: torch.dtype = torch.float32,
                       state_dtype: torch.dtype = torch.float32, products: str = "fp32") -> None:
    check_call(case, *make_inputs(case, dtype, state_dtype), products=products)


# ---------------------------------------------------------------------------------------------------------------
# CPU (Triton interpreter, fp32) and GPU alike: small shapes, every boundary class
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tokens", [
    pytest.param(1, id="T1"), pytest.param(3, id="T3-W-1"), pytest.param(15, id="T15-Q-1"),
    pytest.param(16, id="T16-Q"), pytest.param(17, id="T17-Q+1"), pytest.param(70, id="T70-five-chunks"),
])
def test_one_sequence_with_initial_state(n_tokens):
    check_against_twin(Case(lengths=(n_tokens,), initial="all"))


PACKED = {
    "inside-chunks": (5, 20, 9, 30, 7),           # boundaries at 5, 25, 34, 64: all strictly inside chunks
    "chunk-edges": (15, 1, 1, 15, 17),            # boundaries at Q-1, Q, Q+1, 2Q, 3Q+1
    "length-1-seqs": (1, 20, 1, 1, 13, 1),
    "two-long": (31, 33),                          # boundary at 2Q-1, each sequence spans three chunks
}


@pytest.mark.parametrize("layout", list(PACKED))
def test_packed_sequences_mixed_initial_states(layout):
    check_against_twin(Case(lengths=PACKED[layout], initial="mixed"))


# Launch structures other than the default that bench/sweep_scan.py times: each must compute the same recurrence.
# (On a GPU the default launch runs every other test; these run there too, at the CPU shapes. Warps and stages mean
# nothing to the interpreter, so on a CPU that variant only checks that they reach the launch.)
LAUNCH_VARIANTS = {
    # the GPU's launch: one chunk and one head a program, stages 2 and 4 as 2-D tile kernels
    "gpu-tile-kernels": dict(c=1, h=1),
    "gpu-tile-kernels-half-height-rows": dict(c=1, h=1, scan_m=-2),
    "gpu-tile-kernels-half-width-column-steps": dict(c=1, h=1, scan_k=-2),
    "stage-4-half-height-rows": dict(scan_m=-2),
    "stage-4-half-width-column-steps": dict(scan_k=-2),
    "stage-4-half-width-head-dim": dict(scan_p=-2),
    "stage-4-pipelined-2-warps": dict(scan_warps=2, scan_stages=3),
}


@pytest.mark.vendored_only("our scan's launch structures")
@pytest.mark.parametrize("variant", list(LAUNCH_VARIANTS))
def test_launch_variants(variant, monkeypatch):
    """Chunks of 72 (two row tiles of 64 under the interpreter), head_dim 80 (two head-dim tiles, the second mostly
    masked), a sequence across three chunks between two shorter ones."""
    import importlib
    module = importlib.import_module("vendored.ops.ssd_scan")
    chosen = module._block_sizes

    def varied(*args):
        blocks = chosen(*args)
        # -2: half of what the default uses for that field (a tile still >= 16 wide, tl.dot's minimum)
        half = {"scan_m": blocks.m, "scan_k": blocks.m, "scan_p": blocks.p}
        changes = {f: (max(16, half[f] // 2) if v == -2 else v) for f, v in LAUNCH_VARIANTS[variant].items()}
        return blocks._replace(**changes)

    monkeypatch.setattr(module, "_block_sizes", varied)
    check_against_twin(Case(lengths=(70, 5, 150), initial="mixed", head_dim=80, d_state=32, chunk_size=72))


@pytest.mark.vendored_only("our scan's launch structures")
def test_stage_4_column_step_must_divide_its_rows(monkeypatch):
    import importlib
    module = importlib.import_module("vendored.ops.ssd_scan")
    chosen = module._block_sizes
    monkeypatch.setattr(module, "_block_sizes", lambda *args: chosen(*args)._replace(c=1, h=1, m=64, scan_k=48))
    with pytest.raises(ValueError, match=r"stage 4's column step \(48\) does not divide its rows \(64\)"):
        check_against_twin(Case(lengths=(70,), initial="none", chunk_size=72))


# products="rounded" (the peers' precision), against the same twins within the allowance of rounding_allowance: 16-bit
# inputs (the mode rounds to them), the interpreter's batched launch and the GPU's tile kernels, chunks of one and of
# two row tiles (72 under the interpreter: stage 4's column blocks before the diagonal), every sequence boundary class
ROUNDED_CASES = {
    "chunk-edges": Case(lengths=PACKED["chunk-edges"]),
    "two-long": Case(lengths=PACKED["two-long"], initial="all"),
    "Q72-two-row-tiles-head-dim-80": Case(lengths=(70, 5, 150), head_dim=80, d_state=32, chunk_size=72),
    "no-z-no-D": Case(lengths=PACKED["inside-chunks"], has_z=False, has_D=False),
}


@pytest.mark.parametrize("launch", ["interpreter-batched", "gpu-tile-kernels"])
@pytest.mark.parametrize("dtype, state_dtype", [pytest.param(torch.bfloat16, torch.float32, id="bf16-state_fp32"),
                                                pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-state_bf16"),
                                                pytest.param(torch.float16, torch.float32, id="fp16-state_fp32")])
@pytest.mark.parametrize("case", list(ROUNDED_CASES))
def test_rounded_products(case, dtype, state_dtype, launch, monkeypatch):
    if launch == "gpu-tile-kernels":
        OPS.internal("our scan's launch structures")
        import importlib
        module = importlib.import_module("vendored.ops.ssd_scan")
        chosen = module._block_sizes
        monkeypatch.setattr(module, "_block_sizes", lambda *args: chosen(*args)._replace(c=1, h=1))
    check_against_twin(ROUNDED_CASES[case], dtype, state_dtype, products="rounded")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_products_do_round(dtype):
    """The mode is what it says: with 16-bit inputs its y differs from the fp32 mode's (so the tests above hold the
    rounded path to its allowance, not the fp32 path to a looser bound), and its final states too; with an fp32 x
    the two modes are the same computation, bit for bit."""
    OPS.require("products_switch")
    case = ROUNDED_CASES["two-long"]
    (x, *rest), kwargs, pool = make_inputs(case, dtype, torch.float32)
    outputs = {}
    for products in ("fp32", "rounded"):
        states = pool.clone()
        outputs[products] = OPS.ssd_scan(x, *rest, ssm_states=states, products=products, **kwargs), states
    assert not torch.equal(outputs["fp32"][0], outputs["rounded"][0])
    assert not torch.equal(outputs["fp32"][1], outputs["rounded"][1])
    (x32, *rest32), kwargs32, pool32 = make_inputs(case, torch.float32, torch.float32)
    y_exact = OPS.ssd_scan(x32, *rest32, ssm_states=pool32.clone(), **kwargs32)
    y_rounded = OPS.ssd_scan(x32, *rest32, ssm_states=pool32.clone(), products="rounded", **kwargs32)
    assert torch.equal(y_exact, y_rounded)


def test_rejects_an_unknown_precision_mode():
    OPS.require("products_switch")
    case = Case(lengths=(5,))
    args, kwargs, pool = make_inputs(case, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"products: expected 'fp32' or 'rounded', got 'bf16'"):
        OPS.ssd_scan(*args, ssm_states=pool, products="bf16", **kwargs)


@pytest.mark.vendored_only("our scan's launch structures")
def test_stage_4_rows_may_not_exceed_the_cb_tiles(monkeypatch):
    import importlib
    module = importlib.import_module("vendored.ops.ssd_scan")
    chosen = module._block_sizes
    monkeypatch.setattr(module, "_block_sizes", lambda *args: chosen(*args)._replace(scan_m=2 * chosen(*args).m))
    with pytest.raises(ValueError, match=r"stage 4's rows \(\d+\) exceed the C·Bᵀ tile"):
        check_against_twin(Case(lengths=(70,), initial="none", chunk_size=72))


@pytest.mark.parametrize("initial", ["none", "all"])
def test_packed_sequences_all_or_no_initial_states(initial):
    check_against_twin(Case(lengths=PACKED["inside-chunks"], initial=initial))


@pytest.mark.parametrize("n_heads, n_groups", [pytest.param(6, 1, id="H6-G1"), pytest.param(4, 4, id="G4-equals-H")])
def test_groups(n_heads, n_groups):
    # G=2 (two heads per group, where interleaved and tiled differ) is the default of every other case. Six heads
    # fill the interpreter's 4-head blocks one and a half times.
    check_against_twin(Case(lengths=PACKED["inside-chunks"], n_heads=n_heads, n_groups=n_groups))


@pytest.mark.parametrize("missing", ["z", "D", "dt_bias"])
def test_without_optional_input(missing):
    check_against_twin(Case(lengths=PACKED["chunk-edges"], **{f"has_{missing}": False}))


def test_dt_limit_clamps_both_ends():
    case = Case(lengths=PACKED["chunk-edges"], dt_limit=(0.1, 0.3))
    (_, dt, _, _, _), kwargs, _ = make_inputs(case, torch.float32, torch.float32)
    unclamped = discretize_dt(dt, kwargs["dt_bias"], True, (0.0, math.inf))
    assert (unclamped < 0.1).any() and (unclamped > 0.3).any(), "the limit must clamp for this test to mean anything"
    check_against_twin(case)


def test_dt_without_softplus():
    check_against_twin(Case(lengths=PACKED["chunk-edges"], dt_softplus=False))


@pytest.mark.parametrize("chunk_size", [
    pytest.param(8, id="Q8-below-block"), pytest.param(24, id="Q24-not-power-of-2"),
    pytest.param(128, id="Q128-two-row-blocks"), pytest.param(192, id="Q192-four-row-blocks-padded"),
])
def test_chunk_sizes(chunk_size):
    check_against_twin(Case(lengths=(70, 150), chunk_size=chunk_size))


def test_16bit_input_with_fp32_state_pool():
    # fp16 x, B, C, z (the interpreter runs fp16, not bf16) with an fp32 pool: the final states must keep fp32
    # precision, not be rounded to the input's dtype on the way into the pool.
    check_against_twin(Case(lengths=PACKED["inside-chunks"]), torch.float16, torch.float32)


def test_empty_sequence_stores_its_initial_state_or_zeros():
    # sequence 1 is empty with an initial state (stored back unchanged), sequence 2 empty without one (zeros)
    check_against_twin(Case(lengths=(5, 0, 0, 12), initial="mixed"))


def projection_views(x, dt, B, C, z, row: int | None = None):
    """Copies of x, dt, B, C, z side by side in one (T, row) buffer laid out like an in_proj output
    [z | x | B | C | dt | unused], returned as views of it: (x, dt, B, C, z), token stride `row`, in x's dtype."""
    H, P = x.shape[1:]
    widths = [H * P, H * P, B[0].numel(), C[0].numel(), H]
    buffer = torch.empty(x.shape[0], row or sum(widths), dtype=x.dtype, device=x.device)     # (T, row)
    used = buffer[:, : sum(widths)]
    used.copy_(torch.cat([z.flatten(1), x.flatten(1), B.flatten(1), C.flatten(1), dt.to(x.dtype)], dim=1))
    z_v, x_v, B_v, C_v, dt_v = used.split(widths, dim=1)
    return (x_v.unflatten(1, (H, P)), dt_v, B_v.unflatten(1, B.shape[1:]), C_v.unflatten(1, C.shape[1:]),
            z_v.unflatten(1, (H, P)))


def test_strided_inputs_from_one_projection():
    """x, z, B, C and dt as column views of one in_proj output, as an engine passes them: same y, same states."""
    case = Case(lengths=PACKED["inside-chunks"])
    (x, dt, A, B, C), kwargs, pool = make_inputs(case, torch.float32, torch.float32)
    x_v, dt_v, B_v, C_v, z_v = projection_views(x, dt, B, C, kwargs["z"])
    assert not x_v.is_contiguous()
    states_strided, states = pool.clone(), pool.clone()
    y_strided = OPS.ssd_scan(x_v, dt_v, A, B_v, C_v, ssm_states=states_strided, **{**kwargs, "z": z_v})
    y = OPS.ssd_scan(x, dt, A, B, C, ssm_states=states, **kwargs)
    assert torch.equal(y_strided, y)
    assert torch.equal(states_strided, states)


def test_rejects_groups_that_do_not_divide_heads():
    OPS.require("input_errors")
    args, kwargs, pool = make_inputs(Case(lengths=(4,), n_groups=3, n_heads=4), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="G = 3"):
        OPS.ssd_scan(*args, ssm_states=pool, **kwargs)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name, bad, message", [
    ("cu_seqlens", (0, 6, 5), r"cu_seqlens: expected non-decreasing from 0 to T = 9, got \[0, 6, 5\]"),
    ("cu_seqlens", (0, 4, 8), r"cu_seqlens: expected non-decreasing from 0 to T = 9"),
    ("state_indices", (3, 3), r"state_indices: expected distinct slots in \[0, 5\), got \[3, 3\]"),
    ("state_indices", (-1, 3), r"state_indices: expected distinct slots in \[0, 5\)"),
], ids=["cu_seqlens_decreasing", "cu_seqlens_short_of_T", "duplicate_slots", "negative_slot"])
def test_rejects_bad_index_values(name, bad, message):
    OPS.require("index_checks")
    args, kwargs, pool = make_inputs(Case(lengths=(4, 5)), torch.float32, torch.float32)
    with pytest.raises(ValueError, match=message):
        OPS.ssd_scan(*args, ssm_states=pool, **{**kwargs, name: _i32(*bad)})


@pytest.mark.parametrize("check_indices", [True, False], ids=["checked", "unchecked"])
def test_slot_past_the_pool_is_never_touched(check_indices):
    # The values are checked after the kernels are queued (or not at all, for a caller that vouches for them), so the
    # kernels must keep a slot outside the pool from reaching memory: here the row just past the pool's end.
    OPS.require("index_checks" if check_indices else "slot_bounds")
    args, kwargs, pool = make_inputs(Case(lengths=(4, 5), initial="all"), torch.float32, torch.float32)
    backing = torch.cat([pool, torch.randn_like(pool[:1])])          # pool = rows 0..4, row 5 just past its end
    before = backing.clone()
    call = dict(kwargs, state_indices=_i32(5, 1), check_indices=check_indices)
    if check_indices:
        with pytest.raises(ValueError, match=r"state_indices: expected distinct slots in \[0, 5\), got \[5, 1\]"):
            OPS.ssd_scan(*args, ssm_states=backing[:5], **call)
    else:
        OPS.ssd_scan(*args, ssm_states=backing[:5], **call)
    assert torch.equal(backing[5], before[5]), "ssm_states: the row past the pool was read into or written"
    assert torch.equal(backing[[0, 2, 3, 4]], before[[0, 2, 3, 4]]), "ssm_states: a slot not named was written"
    assert not torch.equal(backing[1], before[1]), "ssm_states: the named slot in the pool was not written"


# ---------------------------------------------------------------------------------------------------------------
# A chunked fp64 twin for inputs too long for the sequential one, checked against it here
# ---------------------------------------------------------------------------------------------------------------

def ssd_scan_chunked_torch(x, dt, A, B, C, *, chunk_size, D, dt_bias, z, cu_seqlens, ssm_states, state_indices,
                           has_initial_state, dt_softplus=True, dt_limit=(0.0, math.inf)):
    """ssd_scan_ref's equations by the chunked algorithm in plain torch, in the promoted dtype of x and the pool.

    Chunks are cut from each sequence's start. Exact up to rounding; fast enough on a GPU for 100K tokens.
    """
    n_heads, n_groups = x.shape[1], B.shape[1]
    dtype = torch.promote_types(x.dtype, ssm_states.dtype)
    group = group_of_head(n_heads, n_groups, x.device)                               # (H,)
    delta = discretize_dt(dt.to(dtype), dt_bias, dt_softplus, dt_limit).to(dtype)     # (T, H)
    A = A.to(dtype)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)                            # (T, H, P)
    starts = cu_seqlens.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        if bool(has_initial_state[b]):
            state = ssm_states[slot].to(dtype)                                        # (H, P, N)
        else:
            state = torch.zeros(ssm_states.shape[1:], dtype=dtype, device=x.device)
        for c0 in range(starts[b], starts[b + 1], chunk_size):
            tok = slice(c0, min(c0 + chunk_size, starts[b + 1]))
            x_c = x[tok].to(dtype)                                                    # (L, H, P)
            B_c, C_c = B[tok].to(dtype)[:, group], C[tok].to(dtype)[:, group]         # (L, H, N)
            dx = delta[tok, :, None] * x_c                                            # (L, H, P)
            cs = torch.cumsum(delta[tok] * A, dim=0)                                  # (L, H)
            causal = torch.ones(len(cs), len(cs), dtype=torch.bool, device=x.device).tril()   # (L, L)
            decay = torch.exp((cs[:, None] - cs[None, :]).masked_fill(~causal[..., None], -math.inf))  # (L, L, H)
            scores = torch.einsum("thn,shn->tsh", C_c, B_c) * decay                   # (L, L, H)
            y[tok] = torch.einsum("tsh,shp->thp", scores, dx) \
                + torch.einsum("thn,hpn->thp", C_c, state) * torch.exp(cs)[..., None]
            to_end = torch.exp(cs[-1] - cs)                                            # (L, H)
            state = torch.exp(cs[-1])[:, None, None] * state \
                + torch.einsum("sh,shp,shn->hpn", to_end, dx, B_c)                   # (H, P, N)
        ssm_states[slot] = state.to(ssm_states.dtype)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y


def test_chunked_torch_twin_matches_sequential_twin():
    case = Case(lengths=PACKED["chunk-edges"] + PACKED["inside-chunks"])
    args, kwargs, pool = make_inputs(case, torch.float32, torch.float32)
    y_seq, states_seq = run_twin(ssd_scan_ref, args, kwargs, pool, torch.float64)
    y_chunked, states_chunked = run_twin(ssd_scan_chunked_torch, args, kwargs, pool, torch.float64)
    torch.testing.assert_close(y_chunked, y_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states_chunked, states_seq, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# GPU: Bamba-9B shapes in 16-bit and fp32, and a long input whose offsets pass 2^31
# ---------------------------------------------------------------------------------------------------------------

def random_lengths(n_tokens: int, n_seqs: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(n_tokens - 1, generator=gen)[: n_seqs - 1].add(1).tolist())
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, n_tokens]))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype, state_dtype, n_tokens", [
    pytest.param(torch.bfloat16, torch.float32, 2048, id="bf16-state_fp32-T2048"),
    pytest.param(torch.bfloat16, torch.float32, 8192, id="bf16-state_fp32-T8192"),
    pytest.param(torch.bfloat16, torch.bfloat16, 8192, id="bf16-state_bf16-T8192"),
    pytest.param(torch.float16, torch.float32, 8192, id="fp16-state_fp32-T8192"),
    pytest.param(torch.float16, torch.bfloat16, 2048, id="fp16-state_bf16-T2048"),
    pytest.param(torch.float32, torch.float32, 4096, id="fp32-state_fp32-T4096"),
])
def test_bamba_9b_shapes(dtype, state_dtype, n_tokens):
    check_against_twin(Case(lengths=random_lengths(n_tokens, 8, seed=n_tokens), **BAMBA_9B), dtype, state_dtype)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype, state_dtype, n_tokens, n_seqs", [
    pytest.param(torch.bfloat16, torch.float32, 2048, 1, id="bf16-state_fp32-T2048-1seq"),
    pytest.param(torch.bfloat16, torch.float32, 8192, 8, id="bf16-state_fp32-T8192"),
    pytest.param(torch.bfloat16, torch.bfloat16, 8192, 8, id="bf16-state_bf16-T8192"),
    pytest.param(torch.float16, torch.float32, 8192, 8, id="fp16-state_fp32-T8192"),
])
def test_bamba_9b_shapes_rounded_products(dtype, state_dtype, n_tokens, n_seqs):
    check_against_twin(Case(lengths=random_lengths(n_tokens, n_seqs, seed=n_tokens), **BAMBA_9B), dtype, state_dtype,
                       products="rounded")


@gpu
@needs_gpu
@pytest.mark.xdist_group("large-gpu-memory")                           # ~30 GB (conftest.py)
def test_long_input_offsets_past_int32():
    """72,000 tokens with x, z, B, C, dt as views of one bf16 buffer whose rows are 32,768 wide: token offsets reach
    72,000·32,768 > 2^31, so any pointer offset computed in int32 lands elsewhere. Against the chunked torch twin."""
    case = Case(lengths=random_lengths(72_000, 8, seed=7), **BAMBA_9B)
    n_tokens, row = sum(case.lengths), 32_768
    assert n_tokens * row > 2**31
    (x, dt, A, B, C), kwargs, pool = make_inputs(case, torch.bfloat16, torch.float32)
    x_v, dt_v, B_v, C_v, kwargs["z"] = projection_views(x, dt, B, C, kwargs["z"], row=row)
    del x, dt, B, C
    check_call(case, (x_v, dt_v, A, B_v, C_v), kwargs, pool, twin=ssd_scan_chunked_torch)


def logical_chunks_torch(cu_seqlens: torch.Tensor, chunk_size: int, n_tokens: int):
    """_logical_chunks' meaning in plain torch: chunk c of the NC = T // Q + B slots belongs to sequence b when
    first_b <= c < first_b + ceil(L_b / Q); slots past the real count have start 0 and length 0."""
    cu = cu_seqlens.long().cpu()
    n_seqs = cu.numel() - 1
    counts = [(int(cu[b + 1] - cu[b]) + chunk_size - 1) // chunk_size for b in range(n_seqs)]
    firsts = [sum(counts[:b]) for b in range(n_seqs + 1)]
    start, length = [0] * (n_tokens // chunk_size + n_seqs), [0] * (n_tokens // chunk_size + n_seqs)
    for b in range(n_seqs):
        for i in range(counts[b]):
            start[firsts[b] + i] = int(cu[b]) + i * chunk_size
            length[firsts[b] + i] = min(chunk_size, int(cu[b + 1]) - start[firsts[b] + i])
    return start, length, firsts


@pytest.mark.parametrize("lengths, chunk_size", [
    ((5,), 16), ((16,), 16), ((17, 0, 33), 16), ((0, 0), 16), ((1,) * 70, 16), ((3, 100, 0, 256, 257), 256),
    (tuple(range(130)), 16),
])
@pytest.mark.vendored_only("our scan's chunk table (stage 0)")
def test_logical_chunks_match_their_definition(lengths, chunk_size):
    """Stage 0 (one kernel) against the definition, every slot: empty sequences own no chunk, more sequences than one
    block of the kernel (70 and 130) carry the running count across blocks."""
    from vendored.ops.ssd_scan import _logical_chunks
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    chunk_start, chunk_len, seq_chunks = _logical_chunks(cu, chunk_size, sum(lengths))
    start, length, firsts = logical_chunks_torch(cu, chunk_size, sum(lengths))
    assert chunk_start.tolist() == start
    assert chunk_len.tolist() == length
    assert seq_chunks.tolist() == firsts


@triton.jit
def _split_kernel(v_ptr, bits_ptr, N: tl.constexpr):
    """The three bf16 pieces of each v, stored as their bits."""
    offs = tl.arange(0, N)
    hi, mid, lo = _bf16x3(tl.load(v_ptr + offs))
    tl.store(bits_ptr + offs, hi.to(tl.int16, bitcast=True))
    tl.store(bits_ptr + N + offs, mid.to(tl.int16, bitcast=True))
    tl.store(bits_ptr + 2 * N + offs, lo.to(tl.int16, bitcast=True))


@pytest.mark.vendored_only("our scan's bf16x3 split")
def test_bf16x3_pieces_sum_exactly_to_the_fp32_input():
    """The split behind every tensor-core product of an fp32 operand (GPU only, so checked here on its own): the
    three bf16 pieces of v sum to v exactly, across exponents, signs, zero and the largest float; a subnormal v to
    within bf16's spacing there (2^-133), as no sum of bf16 values can hold an fp32 subnormal's low bits."""
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -3e-39, 3.4e38, -3.4e38, 1 + 2**-23, 1 - 2**-24])
    v = torch.cat([special, torch.randn(1014, generator=gen) * torch.exp(20 * torch.randn(1014, generator=gen))])
    v = v.float().to(DEVICE)
    bits = torch.empty(3 * v.numel(), dtype=torch.int16, device=DEVICE)
    _split_kernel[(1,)](v, bits, N=v.numel())
    total = bits.view(torch.bfloat16).view(3, -1).double().sum(0).cpu()
    allowed = torch.where(v.abs().cpu() < 2**-126, 2.0**-133, 0.0)
    wrong = ((total - v.double().cpu()).abs() > allowed).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} values not split exactly, e.g. {v[wrong[0]].item()!r}"
