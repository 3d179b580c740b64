"""The cases of bench/kernels.py: inputs, how each implementation is called on them, and what each call must move.

A case builds its inputs once; every implementation (ours, vllm, mamba_ssm) gets the very same tensors, except the
state pools it writes, which each gets a fresh copy of. `Impl.prepare()` returns `(run, read)`: `run()` is the call
that is timed, `read()` returns the outputs of the last call, (y, states of the named slots), for the cross-check.

Peers' conventions, matched here so that the three compute the same thing:
- Δ = softplus(dt + dt_bias) (dt_softplus=True) everywhere; A, D, dt_bias are per head. The decode kernels of both
  peers take per-channel dt (B, H, P), A (H, P, N), D and dt_bias (H, P): they get the per-head values broadcast
  with stride 0 (how vLLM's and HF's mixers call them), which puts them on their per-head (TIE_HDIM) path.
- Groups: heads [g·H/G, (g+1)·H/G) read group g in all three (the smoke shape has G = 2 to exercise it).
- States (S, H, P, N) in all three. vLLM writes final scan states into a pool by slot (final_states_out), as we do;
  mamba_ssm returns them (one per sequence). Slot 0 is never used: it is vLLM's null block (padding).
- vLLM's conv takes channel-last (C, T) views and (S, C, W-1) state views whose channel stride is 1; we take the same
  memory, as (T, C) and the same state view.
- z (gating) is not passed to the scan or decode (Bamba gates in the norm); rms_norm_gated gets z with
  norm_before_gate=False, one group per B/C group (group size H·P/G).
- mamba_ssm has no Triton causal conv (its conv is a CUDA extension), so conv cases have one peer.
- Neither peer checks the values of cu_seqlens and the slots; ours are called as the engine calls them,
  check_indices=False (no device-to-host copy and wait; bench/latency.py times the checked call too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from reference.ops import ssd_scan_ref
from vendored.ops import causal_conv1d, causal_conv1d_update, rms_norm_gated, selective_state_update, ssd_scan


@dataclass(frozen=True)
class Shape:
    """Mixer sizes (docs/design.md §2 letters)."""
    H: int
    P: int
    N: int
    G: int
    Q: int
    W: int = 4

    @property
    def conv_channels(self) -> int:
        return self.H * self.P + 2 * self.G * self.N


BAMBA_9B = Shape(H=128, P=64, N=128, G=1, Q=256)
SMOKE = Shape(H=4, P=16, N=16, G=2, Q=16)


class Counts(NamedTuple):
    """Bytes one call must move between the GPU and its memory, and the floating-point operations it must do."""
    bytes: int
    flops: int


class Impl(NamedTuple):
    prepare: Callable[[], tuple[Callable[[], object], Callable[[], tuple[torch.Tensor, ...]]]]


@dataclass
class Case:
    """One benchmark case. `build()` allocates the inputs and returns {implementation name: Impl}."""
    op: str
    name: str
    counts: Counts
    timing: str                                   # "bench": do_bench, L2 flushed; "graph": CUDA-graph replay
    build: Callable[[], dict[str, Impl]]
    params: dict


# ---------------------------------------------------------------------------------------------------------------
# What is counted (docs/kernels.md, "How it measures", repeats this)
# ---------------------------------------------------------------------------------------------------------------

def scan_counts(s: Shape, n_tokens: int, n_seqs: int, esz: int, state_esz: int) -> Counts:
    """Compulsory traffic: x read and y written (T·H·P each), B and C read (T·G·N each), dt read (fp32), final
    states written, A, D, dt_bias read. Chunk states that an implementation round-trips through memory are not
    counted (ours and both peers do: 2·H·P·N·4 bytes per chunk, about as much again as the rest at Bamba-9B).
    FLOPs of the SSD algorithm per token, with Q the chunk size and the causal Q×Q products counted whole, as tensor
    cores run them: chunk state 2PN and state read-out 2NP per head, (C·Bᵀ∘L)·x 2QP per head, C·Bᵀ 2QN per group."""
    H, P, N, G, Q = s.H, s.P, s.N, s.G, s.Q
    nbytes = (2 * n_tokens * H * P * esz + 2 * n_tokens * G * N * esz + n_tokens * H * 4
              + n_seqs * H * P * N * state_esz + 3 * H * 4)
    return Counts(nbytes, n_tokens * (H * (4 * P * N + 2 * Q * P) + G * 2 * Q * N))


def ssu_counts(s: Shape, batch: int, esz: int, state_esz: int) -> Counts:
    """State read and written, x read and y written (in x's dtype), B, C, dt read, A, D, dt_bias read. FLOPs: 5 per
    state element (decay multiply; Δ·x·B multiply-add; C·S multiply-add)."""
    H, P, N, G = s.H, s.P, s.N, s.G
    nbytes = batch * (2 * H * P * N * state_esz + 2 * H * P * esz + 2 * G * N * esz + H * 4) + 3 * H * 4
    return Counts(nbytes, 5 * batch * H * P * N)


def conv_counts(s: Shape, n_tokens: int, n_seqs: int, n_initial: int, esz: int, state_esz: int) -> Counts:
    """x read and out written (T·C each), weight and bias read, final windows written (W-1 per channel and
    sequence), initial windows read for the sequences that have one. FLOPs: 2·W per output (multiply-add per tap)."""
    C, W = s.conv_channels, s.W
    nbytes = 2 * n_tokens * C * esz + C * (W + 1) * esz + (n_seqs + n_initial) * C * (W - 1) * state_esz
    return Counts(nbytes, 2 * W * C * n_tokens)


def conv_update_counts(s: Shape, batch: int, esz: int, state_esz: int) -> Counts:
    """Window read and written (W-1 per channel and row), x read and out written, weight and bias read."""
    C, W = s.conv_channels, s.W
    return Counts(batch * C * (2 * (W - 1) * state_esz + 2 * esz) + C * (W + 1) * esz, 2 * W * C * batch)


def rms_counts(s: Shape, n_tokens: int, esz: int) -> Counts:
    """x and z read, out written, weight read. FLOPs: 9 per element (gate x·z·σ(z): 5 with exp, add and divide;
    sum of squares 2; scaling by 1/rms and weight 2)."""
    D = s.H * s.P
    return Counts(3 * n_tokens * D * esz + D * esz, 9 * n_tokens * D)


# ---------------------------------------------------------------------------------------------------------------
# Inputs, on Bamba's scales: dt_bias = softplus⁻¹(U[1e-3, 1e-1]) and A = -U[1, 16] as Mamba2 initialises them
# ---------------------------------------------------------------------------------------------------------------

class Setup(NamedTuple):
    shape: Shape
    device: torch.device
    dtype: torch.dtype                             # x, B, C, z, y, conv weights
    seed: int


def _generator(setup: Setup, *key: int) -> torch.Generator:
    return torch.Generator().manual_seed(setup.seed * 1_000_003 + hash(key) % 1_000_000_007)


def _head_params(s: Shape, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    dt0 = torch.exp(torch.rand(s.H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return dict(
        dt_bias=(dt0 + torch.log(-torch.expm1(-dt0))).to(device),    # (H,) fp32
        A=-(1 + 15 * torch.rand(s.H, generator=gen)).to(device),       # (H,)
        D=torch.rand(s.H, generator=gen).to(device),                   # (H,)
    )


def _slots(n: int, n_slots: int, gen: torch.Generator, device) -> torch.Tensor:
    """n distinct slots in [1, n_slots), shuffled (slot 0 is vLLM's null block)."""
    return (torch.randperm(n_slots - 1, generator=gen)[:n] + 1).to(device=device, dtype=torch.int32)


def _cu_seqlens(n_tokens: int, n_seqs: int, gen: torch.Generator, device) -> torch.Tensor:
    """Sequence lengths within ±50% of the mean, summing to n_tokens; (B+1,) int32."""
    weights = torch.rand(n_seqs, generator=gen) + 0.5
    lengths = [max(1, int(w)) for w in (weights / weights.sum() * n_tokens).tolist()]
    lengths[-1] = n_tokens - sum(lengths[:-1])
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _esz(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# the scan's fp64 twin runs one token at a time (two tensor ops a token): ~1 s at 32K tokens on a GPU
TWIN_MAX_TOKENS = 32768


def scan_case(setup: Setup, peers: dict, n_tokens: int, n_seqs: int, state_dtype: torch.dtype,
              check_indices: bool = False) -> Case:
    s, device, dtype, _ = setup

    def build() -> dict[str, Impl]:
        gen = _generator(setup, 1, n_tokens, n_seqs)
        x = torch.randn(n_tokens, s.H, s.P, generator=gen).to(device, dtype)                 # (T, H, P)
        B = (torch.randn(n_tokens, s.G, s.N, generator=gen) * s.N ** -0.5).to(device, dtype)  # (T, G, N)
        C = (torch.randn(n_tokens, s.G, s.N, generator=gen) * s.N ** -0.5).to(device, dtype)
        dt = (torch.randn(n_tokens, s.H, generator=gen) * 0.5).to(device)                    # (T, H) fp32
        p = _head_params(s, gen, device)
        cu = _cu_seqlens(n_tokens, n_seqs, gen, device)                                      # (B+1,)
        slots = _slots(n_seqs, n_seqs + 2, gen, device)                                      # (B,)
        pool = torch.zeros(n_seqs + 2, s.H, s.P, s.N, dtype=state_dtype, device=device)      # (S, H, P, N)
        slots64 = slots.long()

        no_initial = torch.zeros(n_seqs, dtype=torch.bool, device=device)                        # (B,)

        def ours(products="fp32"):
            states, out = pool.clone(), {}

            def run():
                out["y"] = ssd_scan(x, dt, p["A"], B, C, chunk_size=s.Q, D=p["D"], dt_bias=p["dt_bias"], z=None,
                                    cu_seqlens=cu, ssm_states=states, state_indices=slots,
                                    has_initial_state=no_initial, check_indices=check_indices, products=products)
            return run, lambda: (out["y"], states[slots64])

        def twin64():
            # the oracle in fp64 on the same (bf16) inputs: not timed, the yardstick of every implementation's error
            out = {}

            def run():
                states = pool.double()
                out["y"] = ssd_scan_ref(x.double(), dt.double(), p["A"].double(), B.double(), C.double(),
                                        chunk_size=s.Q, D=p["D"].double(), dt_bias=p["dt_bias"].double(), z=None,
                                        cu_seqlens=cu, ssm_states=states, state_indices=slots,
                                        has_initial_state=no_initial)
                out["states"] = states[slots64]
            return run, lambda: (out["y"], out["states"])

        def vllm():
            v = peers["vllm"]
            states, y = pool.clone(), torch.empty_like(x)
            cu_chunks, last_chunks, seq_of_chunk = v.chunk_metadata(cu, s.Q, device)       # host-built, as vLLM does

            def run():
                v.mamba_chunk_scan_combined_varlen(
                    x, dt, p["A"], B, C, s.Q, cu, cu_chunks, last_chunks, seq_of_chunk, y, D=p["D"],
                    dt_bias=p["dt_bias"], dt_softplus=True, state_dtype=state_dtype, final_states_out=states,
                    final_state_indices=slots)
            return run, lambda: (y, states[slots64])

        def mamba_ssm():
            m, out = peers["mamba_ssm"], {}
            seq_idx = torch.repeat_interleave(torch.arange(n_seqs, dtype=torch.int32, device=device),
                                              cu.diff().long())[None]                     # (1, T)
            extra = (dict(return_final_states=True) if n_seqs == 1
                     else dict(seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True))

            def run():
                out["y"], out["states"] = m.mamba_chunk_scan_combined(
                    x[None], dt[None], p["A"], B[None], C[None], s.Q, D=p["D"], dt_bias=p["dt_bias"],
                    dt_softplus=True, **extra)
            return run, lambda: (out["y"][0], out["states"])

        def fla():
            # fla's scalar-gated linear attention is the SSD recurrence with q = C, k = B, v = x·Δ, log decay
            # g = Δ·A; it has no groups (B and C expanded to every head) and no D (added after). What the SSD op does
            # inside (softplus, the expansion, x·Δ, D·x) is timed with it. State layout (seq, H, P, N): V first.
            f, out, cu64 = peers["fla"], {}, cu.long()

            def heads(t):                                                                 # (T, G, N) -> (1, T, H, N)
                return t.repeat_interleave(s.H // s.G, dim=1)[None].contiguous()

            def run():
                delta = torch.nn.functional.softplus(dt + p["dt_bias"])                   # (T, H) fp32
                v = (x * delta[..., None]).to(dtype)[None]                                # (1, T, H, P)
                o, final = f.chunk_simple_gla(heads(C), heads(B), v, g=(delta * p["A"])[None], scale=1.0,
                                              output_final_state=True, state_v_first=True, cu_seqlens=cu64)
                out["y"], out["states"] = (o[0] + x * p["D"][:, None].to(dtype)).to(dtype), final
            return run, lambda: (out["y"], out["states"])

        impls = dict(ours=ours, ours_rounded=lambda: ours("rounded"), vllm=vllm, mamba_ssm=mamba_ssm, fla=fla)
        if n_tokens <= TWIN_MAX_TOKENS:
            impls["twin64"] = twin64
        return _available(impls, peers)

    counts = scan_counts(s, n_tokens, n_seqs, _esz(dtype), _esz(state_dtype))
    return Case("ssd_scan", f"T{n_tokens}-seqs{n_seqs}", counts, "bench", build,
                dict(tokens=n_tokens, seqs=n_seqs, state_dtype=str(state_dtype).removeprefix("torch."),
                     check_indices=check_indices))


def ssu_case(setup: Setup, peers: dict, batch: int, state_dtype: torch.dtype) -> Case:
    s, device, dtype, _ = setup

    def build() -> dict[str, Impl]:
        gen = _generator(setup, 2, batch, _esz(state_dtype))
        n_slots = batch + 2
        pool = (torch.randn(n_slots, s.H, s.P, s.N, generator=gen) * 0.5).to(device, state_dtype)   # (S, H, P, N)
        x = torch.randn(batch, s.H, s.P, generator=gen).to(device, dtype)                          # (B, H, P)
        B = (torch.randn(batch, s.G, s.N, generator=gen) * s.N ** -0.5).to(device, dtype)           # (B, G, N)
        C = (torch.randn(batch, s.G, s.N, generator=gen) * s.N ** -0.5).to(device, dtype)
        dt = (torch.randn(batch, s.H, generator=gen) * 0.5).to(device)                              # (B, H)
        p = _head_params(s, gen, device)
        slots = _slots(batch, n_slots, gen, device)
        slots64 = slots.long()
        # the peers' per-channel views of the per-head values (stride 0: their TIE_HDIM path)
        dt_hp = dt[:, :, None].expand(batch, s.H, s.P)
        A_hpn = p["A"][:, None, None].expand(s.H, s.P, s.N)
        D_hp, dt_bias_hp = p["D"][:, None].expand(s.H, s.P), p["dt_bias"][:, None].expand(s.H, s.P)

        # One state buffer and one y for every implementation, reset to the pool before each one's first call:
        # where a 4 MB-a-slot pool lands in memory moved a batch-8 call by up to 6% from one allocation to the next
        # (consistently over every round of a run), which separate copies would charge to whichever got the worse one.
        states, y = torch.empty_like(pool), torch.empty_like(x)

        def fresh():
            states.copy_(pool)

        def ours():
            # y in x's dtype through `out`, as the engine calls it and as the peers write theirs (returned, y would
            # be fp32 beside an fp32 pool: twice the bytes the counts and the peers write)
            fresh()

            def run():
                selective_state_update(states, x, dt, p["A"], B, C, D=p["D"], dt_bias=p["dt_bias"], z=None,
                                       state_indices=slots, out=y)
            return run, lambda: (y, states[slots64])

        def vllm():
            fresh()

            def run():
                peers["vllm"].selective_state_update(states, x, dt_hp, A_hpn, B, C, D_hp, dt_bias_hp, z=None,
                                                     dt_softplus=True, state_batch_indices=slots, out=y)
            return run, lambda: (y, states[slots64])

        def mamba_ssm():
            fresh()
            out = {}

            def run():
                out["y"] = peers["mamba_ssm"].selective_state_update(
                    states, x, dt_hp, A_hpn, B, C, D=D_hp, z=None, dt_bias=dt_bias_hp, dt_softplus=True,
                    state_batch_indices=slots)
            return run, lambda: (out["y"], states[slots64])

        return _available(dict(ours=ours, vllm=vllm, mamba_ssm=mamba_ssm), peers)

    sd = str(state_dtype).removeprefix("torch.")
    return Case("selective_state_update", f"batch{batch}-state_{sd}", ssu_counts(s, batch, _esz(dtype),
                _esz(state_dtype)), "graph", build, dict(batch=batch, state_dtype=sd))


def _conv_weights(setup: Setup, gen: torch.Generator):
    s, device, dtype, _ = setup
    weight = (torch.randn(s.conv_channels, s.W, generator=gen) * 0.5).to(device, dtype)        # (C, W)
    bias = (torch.randn(s.conv_channels, generator=gen) * 0.1).to(device, dtype)               # (C,)
    return weight, bias


def _conv_pool(setup: Setup, n_slots: int, state_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(S, C, W-1) view of (S, W-1, C) memory, vLLM's layout (channel stride 1)."""
    s, device, _, _ = setup
    return torch.randn(n_slots, s.W - 1, s.conv_channels, generator=gen).to(device, state_dtype).transpose(1, 2)


def _clone_pool(pool: torch.Tensor) -> torch.Tensor:
    return pool.transpose(1, 2).clone().transpose(1, 2)               # same strides as the original view


def conv_case(setup: Setup, peers: dict, n_tokens: int, n_seqs: int, check_indices: bool = False) -> Case:
    s, device, dtype, _ = setup
    has_initial_list = [b % 2 == 1 for b in range(n_seqs)]          # every other sequence continues a window

    def build() -> dict[str, Impl]:
        gen = _generator(setup, 3, n_tokens, n_seqs)
        x = torch.randn(n_tokens, s.conv_channels, generator=gen).to(device, dtype)               # (T, C)
        weight, bias = _conv_weights(setup, gen)
        cu = _cu_seqlens(n_tokens, n_seqs, gen, device)
        pool = _conv_pool(setup, n_seqs + 2, dtype, gen)                                           # (S, C, W-1)
        slots = _slots(n_seqs, n_seqs + 2, gen, device)
        slots64 = slots.long()
        has_initial = torch.tensor(has_initial_list, device=device)

        def ours():
            states, out = _clone_pool(pool), {}

            def run():
                out["y"] = causal_conv1d(x, weight, bias, states, cu, slots, has_initial, activation="silu",
                                         check_indices=check_indices)
            return run, lambda: (out["y"], states[slots64])

        def vllm():
            v, states, out = peers["vllm"], _clone_pool(pool), {}
            metadata = v.conv1d_metadata(cu, device)                                # host-built, as vLLM does

            def run():
                out["y"] = v.causal_conv1d_fn(x.t(), weight, bias, states, cu, cache_indices=slots,
                                              has_initial_state=has_initial, activation="silu", metadata=metadata)
            return run, lambda: (out["y"].t(), states[slots64])

        return _available(dict(ours=ours, vllm=vllm), peers)

    counts = conv_counts(s, n_tokens, n_seqs, sum(has_initial_list), _esz(dtype), _esz(dtype))
    return Case("causal_conv1d", f"T{n_tokens}-seqs{n_seqs}", counts, "bench", build,
                dict(tokens=n_tokens, seqs=n_seqs, check_indices=check_indices))


def conv_update_case(setup: Setup, peers: dict, batch: int, state_dtype: torch.dtype) -> Case:
    s, device, dtype, _ = setup

    def build() -> dict[str, Impl]:
        gen = _generator(setup, 4, batch, _esz(state_dtype))
        x = torch.randn(batch, s.conv_channels, generator=gen).to(device, dtype)                  # (B, C)
        weight, bias = _conv_weights(setup, gen)
        pool = _conv_pool(setup, batch + 2, state_dtype, gen)
        slots = _slots(batch, batch + 2, gen, device)
        slots64 = slots.long()

        def ours():
            states, out = _clone_pool(pool), {}

            def run():
                out["y"] = causal_conv1d_update(x, states, weight, bias, slots, activation="silu")
            return run, lambda: (out["y"], states[slots64])

        def vllm():
            states, y = _clone_pool(pool), torch.empty_like(x)

            def run():
                peers["vllm"].causal_conv1d_update(x, states, weight, bias, activation="silu",
                                                   conv_state_indices=slots, out=y)
            return run, lambda: (y, states[slots64])

        return _available(dict(ours=ours, vllm=vllm), peers)

    sd = str(state_dtype).removeprefix("torch.")
    return Case("causal_conv1d_update", f"batch{batch}-state_{sd}",
                conv_update_counts(s, batch, _esz(dtype), _esz(state_dtype)), "graph", build,
                dict(batch=batch, state_dtype=sd))


def rms_case(setup: Setup, peers: dict, n_tokens: int, eps: float = 1e-5) -> Case:
    s, device, dtype, _ = setup
    group_size = s.H * s.P // s.G

    def build() -> dict[str, Impl]:
        gen = _generator(setup, 5, n_tokens)
        x = torch.randn(n_tokens, s.H * s.P, generator=gen).to(device, dtype)                     # (T, H·P)
        z = torch.randn(n_tokens, s.H * s.P, generator=gen).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(s.H * s.P, generator=gen)).to(device, dtype)             # (H·P,)

        def call(fn):
            out = {}

            def run():
                out["y"] = fn()
            return run, lambda: (out["y"],)

        def ours():
            return call(lambda: rms_norm_gated(x, z, weight, eps=eps, group_size=group_size, norm_before_gate=False))

        def vllm():
            return call(lambda: peers["vllm"].rms_norm_gated(x, weight, None, z=z, eps=eps, group_size=group_size,
                                                             norm_before_gate=False))

        def mamba_ssm():
            return call(lambda: peers["mamba_ssm"].rmsnorm_fn(x, weight, None, z=z, eps=eps, group_size=group_size,
                                                              norm_before_gate=False))

        return _available(dict(ours=ours, vllm=vllm, mamba_ssm=mamba_ssm), peers)

    return Case("rms_norm_gated", f"T{n_tokens}", rms_counts(s, n_tokens, _esz(dtype)), "bench", build,
                dict(tokens=n_tokens, group_size=group_size))


def copy_case(setup: Setup, batch: int, state_dtype: torch.dtype) -> Case:
    """Device-to-device copy of a decode state pool of `batch` rows (read it all, write it all): the bandwidth
    selective_state_update at that batch is held to."""
    s, device = setup.shape, setup.device
    n_bytes = batch * s.H * s.P * s.N * _esz(state_dtype)

    def build() -> dict[str, Impl]:
        src = torch.ones(n_bytes, dtype=torch.uint8, device=device)

        def torch_copy():
            dst = torch.empty_like(src)
            return (lambda: dst.copy_(src)), lambda: (dst[:1],)

        return dict(torch=Impl(torch_copy))

    sd = str(state_dtype).removeprefix("torch.")
    return Case("d2d_copy", f"batch{batch}-state_{sd}", Counts(2 * n_bytes, 0), "bench", build,
                dict(batch=batch, state_dtype=sd, bytes=n_bytes))


def _available(impls: dict[str, Callable], peers: dict) -> dict[str, Impl]:
    return {name: Impl(prepare) for name, prepare in impls.items()
            if name.startswith(("ours", "twin")) or name in peers}
