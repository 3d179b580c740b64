"""The naive twins against independent derivations (fp64): they are the yardstick for every kernel, so they get
checked by something other than themselves."""

import math

import pytest
import torch
import torch.nn.functional as F

from reference.ops import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    group_of_head,
    rms_norm_gated_ref,
    rotary_ref,
    selective_state_update_ref,
    ssd_scan_ref,
)

f64 = dict(dtype=torch.float64)
H, P, G, N, W, C_CH = 4, 3, 2, 5, 4, 7


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_heads_map_to_groups_in_interleaved_blocks():
    assert group_of_head(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert group_of_head(4, 4).tolist() == [0, 1, 2, 3]


def test_conv_matches_torch_conv1d_from_zero_state():
    x = torch.randn(11, C_CH, generator=_gen(0), **f64)
    w, b = torch.randn(C_CH, W, generator=_gen(1), **f64), torch.randn(C_CH, generator=_gen(2), **f64)
    pool = torch.zeros(1, C_CH, W - 1, **f64)
    out = causal_conv1d_ref(x, w, b, pool, torch.tensor([0, 11]), torch.tensor([0]), torch.tensor([False]))
    expected = F.silu(F.conv1d(x.T[None], w[:, None], b, padding=W - 1, groups=C_CH)[0, :, :11].T)
    assert (out - expected).abs().max() <= 1e-12
    assert torch.equal(pool[0], x[-(W - 1):].T)


def test_conv_state_of_a_short_piece_keeps_part_of_the_old_window():
    pool = torch.arange(C_CH * (W - 1), **f64).reshape(1, C_CH, W - 1)
    old = pool[0].clone()
    x = torch.randn(1, C_CH, generator=_gen(3), **f64)
    causal_conv1d_ref(x, torch.randn(C_CH, W, **f64), None, pool, torch.tensor([0, 1]), torch.tensor([0]),
                      torch.tensor([True]))
    assert torch.equal(pool[0], torch.cat([old[:, 1:], x.T], dim=1))


def test_conv_update_steps_equal_the_prefill_conv():
    x = torch.randn(6, C_CH, generator=_gen(4), **f64)
    w, b = torch.randn(C_CH, W, generator=_gen(5), **f64), torch.randn(C_CH, generator=_gen(6), **f64)
    whole_pool = torch.zeros(1, C_CH, W - 1, **f64)
    whole = causal_conv1d_ref(x, w, b, whole_pool, torch.tensor([0, 6]), torch.tensor([0]), torch.tensor([False]))
    pool = torch.zeros(3, C_CH, W - 1, **f64)
    steps = [causal_conv1d_update_ref(x[t:t + 1], pool, w, b, torch.tensor([2]))[0] for t in range(6)]
    assert (torch.stack(steps) - whole).abs().max() <= 1e-12
    assert torch.equal(pool[2], whole_pool[0])
    assert torch.equal(pool[:2], torch.zeros(2, C_CH, W - 1, **f64))


def _scan_inputs(T, seed):
    g = _gen(seed)
    return dict(
        x=torch.randn(T, H, P, generator=g, **f64), dt=torch.randn(T, H, generator=g, **f64),
        A=-torch.rand(H, generator=g, **f64) * 2 - 0.1, B=torch.randn(T, G, N, generator=g, **f64),
        C=torch.randn(T, G, N, generator=g, **f64), D=torch.randn(H, generator=g, **f64),
        dt_bias=torch.randn(H, generator=g, **f64), z=torch.randn(T, H, P, generator=g, **f64))


def _scan_quadratic(x, dt, A, B, C, D, dt_bias, z, initial, dt_limit):
    """The SSD 'attention' form, derived independently of the recurrence:
    y_t = Σ_{s<=t} (C_t·B_s) exp(Σ_{s<r<=t} Δ_r A) Δ_s x_s + C_t exp(Σ_{r<=t} Δ_r A) S_0 + D x_t, gated by silu(z)."""
    delta = F.softplus(dt + dt_bias).clamp(*dt_limit)                   # (T, H)
    grp = torch.arange(H) // (H // G)
    Bh, Ch = B[:, grp], C[:, grp]                                        # (T, H, N)
    cum = torch.cumsum(delta * A, dim=0)                                 # (T, H)
    T = x.shape[0]
    decay = torch.exp(cum[:, None, :] - cum[None, :, :])                 # (t, s, H)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[:, :, None]
    scores = torch.einsum("thn,shn->tsh", Ch, Bh) * torch.where(mask, decay, 0.0)   # (t, s, H)
    y = torch.einsum("tsh,shp->thp", scores, delta[:, :, None] * x)
    y = y + torch.einsum("thn,hpn->thp", Ch * torch.exp(cum)[:, :, None], initial)
    return (y + D[:, None] * x) * F.silu(z)


@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.05, 0.6)], ids=["no-limit", "clamped"])
def test_scan_recurrence_equals_the_quadratic_form(dt_limit):
    inputs = _scan_inputs(13, seed=7)
    initial = torch.randn(H, P, N, generator=_gen(8), **f64)
    pool = torch.stack([torch.full((H, P, N), math.nan, **f64), initial])
    y = ssd_scan_ref(**inputs, chunk_size=4, cu_seqlens=torch.tensor([0, 13]), ssm_states=pool,
                     state_indices=torch.tensor([1]), has_initial_state=torch.tensor([True]), dt_limit=dt_limit)
    assert (y - _scan_quadratic(**inputs, initial=initial, dt_limit=dt_limit)).abs().max() <= 1e-10
    assert pool[0].isnan().all(), "slot 0 was not named but was written"


def test_scan_keeps_packed_sequences_apart():
    inputs = _scan_inputs(10, seed=9)
    pool = torch.randn(3, H, P, N, generator=_gen(10), **f64)
    initial = pool.clone()
    cu = torch.tensor([0, 4, 5, 10])
    y = ssd_scan_ref(**inputs, chunk_size=4, cu_seqlens=cu, ssm_states=pool, state_indices=torch.tensor([2, 0, 1]),
                     has_initial_state=torch.tensor([True, False, True]))
    for b, (slot, has_init) in enumerate([(2, True), (0, False), (1, True)]):
        part = {k: (v[cu[b]:cu[b + 1]] if v.dim() > 1 else v) for k, v in inputs.items()}
        start = initial[slot] if has_init else torch.zeros(H, P, N, **f64)
        expected = _scan_quadratic(**part, initial=start, dt_limit=(0.0, math.inf))
        assert (y[cu[b]:cu[b + 1]] - expected).abs().max() <= 1e-10, f"sequence {b}"


def test_state_update_steps_equal_the_scan_and_skip_padding():
    inputs = _scan_inputs(5, seed=11)
    scan_pool = torch.zeros(1, H, P, N, **f64)
    y_scan = ssd_scan_ref(**inputs, chunk_size=4, cu_seqlens=torch.tensor([0, 5]), ssm_states=scan_pool,
                          state_indices=torch.tensor([0]), has_initial_state=torch.tensor([False]))
    pool = torch.zeros(3, H, P, N, **f64)
    pool[2] = math.nan                                                   # the pad slot: never read or written
    for t in range(5):
        step = {k: (v[t:t + 1].expand(2, *v.shape[1:]) if v.dim() > 1 else v) for k, v in inputs.items()}
        y = selective_state_update_ref(pool, **step, state_indices=torch.tensor([1, 2]), pad_slot_id=2)
        assert (y[0] - y_scan[t]).abs().max() <= 1e-12, f"step {t}"
        assert torch.equal(y[1], torch.zeros(H, P, **f64)), "padding row output must be zero"
    assert (pool[1] - scan_pool[0]).abs().max() <= 1e-12
    assert pool[2].isnan().all()


def test_gated_norm_is_per_group_and_full_width_matches_transformers():
    transformers = pytest.importorskip("transformers")
    x, gate = torch.randn(5, 12, generator=_gen(12), **f64), torch.randn(5, 12, generator=_gen(13), **f64)
    w = torch.randn(12, generator=_gen(14), **f64)
    norm = transformers.models.bamba.modeling_bamba.BambaRMSNormGated(12, eps=1e-5).double()
    norm.weight.data.copy_(w)
    full = rms_norm_gated_ref(x, gate, w, eps=1e-5, group_size=12)
    with torch.no_grad():
        theirs = norm(x, gate)
    assert (full - theirs).abs().max() <= 1e-5        # transformers normalises in fp32 even for fp64 input
    grouped = rms_norm_gated_ref(x, gate, w, eps=1e-5, group_size=4)
    h = (x * F.silu(gate)).reshape(5, 3, 4)
    expected = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(5, 12) * w
    assert (grouped - expected).abs().max() <= 1e-12
    after = rms_norm_gated_ref(x, gate, w, eps=1e-5, group_size=4, norm_before_gate=True)
    h = x.reshape(5, 3, 4)
    expected = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(5, 12) * w * F.silu(gate)
    assert (after - expected).abs().max() <= 1e-12


def test_rotary_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 2, 8, generator=_gen(15), **f64), torch.randn(1, 2, 8, generator=_gen(16), **f64)

    def score(m, n):
        qm = rotary_ref(q, torch.tensor([m]), rotary_dim=4, theta=10000.0)
        kn = rotary_ref(k, torch.tensor([n]), rotary_dim=4, theta=10000.0)
        return (qm * kn).sum(-1)

    assert (score(7, 3) - score(104, 100)).abs().max() <= 1e-10
    assert (score(7, 3) - score(7, 4)).abs().max() > 1e-3
    rotated = rotary_ref(q, torch.tensor([5]), rotary_dim=4, theta=10000.0)
    assert torch.equal(rotated[..., 4:], q[..., 4:]), "dims past the rotary dims must pass through"
    assert torch.equal(rotary_ref(q, torch.tensor([0]), rotary_dim=4, theta=10000.0), q)
