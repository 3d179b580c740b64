"""Op providers for tests/kernels: the code under test behind our op signatures, chosen by `pytest --ops NAME`.

    pytest tests/kernels                      vendored: our ops (vendored/ops), the default
    pytest tests/kernels --ops vllm           vLLM's Triton ops, the release bench/fetch_peers.py pins (0.33.0)
    pytest tests/kernels --ops vllm-0.7.3     an older vLLM release: vllm-0.7.3 (the first with Bamba), vllm-0.10.2
    pytest tests/kernels --ops mamba_ssm      mamba_ssm 2.3.2.post1's Triton ops
    pytest tests/kernels --ops fla            fla-core 0.6.0's chunk_simple_gla, for the scan only

The peers load from the pinned, vendored copies that `make fetch-peers` writes to .peers (or $BAMBA_PEERS); nothing
is installed and their code is not modified. Each peer op is called here the way that release's own engine calls it
(vLLM's Mamba2 mixer of the same release; mamba_ssm's and fla's documented APIs), so that a test written for our op
runs unchanged against theirs and a failure is theirs, not a mis-call: the slot pool is gathered into initial states
with torch.where and the final states scattered back where that release's mixer does so, its chunk metadata is built
by the definition its metadata builder implements, per-head A, D and dt_bias are passed as the stride-0 per-channel
views its decode path takes.

What a peer cannot take is skipped with the reason, never passed: a test that needs a capability the peer lacks
(`OPS.require("index_checks")`), an argument it has no parameter for (dt_limit in decode), an op it does not have
(rotary, decode attention: the whole module), or our launch internals (tests marked `vendored_only`). Every skip names
the provider, so a conformance table can count them.

Precision: our scan takes `products="fp32"` (default) or `"rounded"`, the peers' precision class. A peer is judged
by the bound of the precision it has: its scan's `products` is "rounded" whatever the test asks
(Provider.scan_products), so 16-bit inputs get the rounding allowance the test derives for that class; fp32 inputs
are the same computation either way. Within that class a peer rounds the chunk-state product B·decay·Δ to the
input's dtype once (`b = b.to(x dtype)` before tl.dot, as mamba_ssm's SSD does), where our rounded mode keeps it
as two bf16 pieces (Provider.scan_stage2_rounds_once): in bf16 the peers' final states may be off by 2^-8 of their
terms, ours by 2^-15.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PEER_NAMES = ("vendored", "vllm", "vllm-0.10.2", "vllm-0.7.3", "mamba_ssm", "fla")
_ACTIVE: "Provider | None" = None


def peers_dir() -> Path:
    return Path(os.environ.get("BAMBA_PEERS") or ROOT / ".peers").resolve()


class Unsupported(Exception):
    """A call a provider cannot make: the test is skipped with this reason."""


class Provider:
    """Our op signatures (vendored/ops docstrings are the contract). Subclasses override what their peer has."""

    name = "vendored"
    features: frozenset[str] = frozenset()
    scan_products: str | None = None          # None: the products the test asks for
    scan_stage2_rounds_once = False           # products="rounded": B·decay·Δ rounded once to x's dtype (the peers)

    def require(self, *features: str) -> None:
        missing = [f for f in features if f not in self.features]
        if missing:
            pytest.skip(f"{self.name}: no {', '.join(missing)} ({FEATURES[missing[0]]})")

    def internal(self, what: str) -> None:
        """Skip under a peer: the test (or this parametrization of it) exercises our kernels' internals."""
        if self.name != "vendored":
            pytest.skip(f"{self.name}: tests {what}, ours alone")

    def skip(self, why: str):
        pytest.skip(f"{self.name}: {why}")

    def call(self, op: str, *args, **kwargs):
        try:
            return getattr(self, "_" + op)(*args, **kwargs)
        except Unsupported as err:
            self.skip(str(err))

    def ssd_scan(self, *args, **kwargs):
        return self.call("ssd_scan", *args, **kwargs)

    def selective_state_update(self, *args, **kwargs):
        return self.call("selective_state_update", *args, **kwargs)

    def causal_conv1d(self, *args, **kwargs):
        return self.call("causal_conv1d", *args, **kwargs)

    def causal_conv1d_update(self, *args, **kwargs):
        return self.call("causal_conv1d_update", *args, **kwargs)

    def rms_norm_gated(self, *args, **kwargs):
        return self.call("rms_norm_gated", *args, **kwargs)

    def _missing(self, op):
        def fail(*args, **kwargs):
            raise Unsupported(f"has no {op}")
        return fail

    def __getattr__(self, name):
        if name.startswith("_") and name[1:] in OPS_NAMES:
            return self._missing(name[1:])
        raise AttributeError(name)


OPS_NAMES = ("ssd_scan", "selective_state_update", "causal_conv1d", "causal_conv1d_update", "rms_norm_gated")
FEATURES = {
    "index_checks": "it does not check cu_seqlens and slot values on the host; a bad value is the caller's to avoid",
    "products_switch": "our products= precision switch is ours alone",
    "out_any_dtype": "an `out` of another dtype than x, rounded once, is ours alone",
    "input_errors": "our ValueError messages for misshapen inputs are ours alone",
    "slot_bounds": "our kernels guard a slot past the pool, which the peers' engines never pass",
}


class Vendored(Provider):
    name = "vendored"
    features = frozenset(FEATURES)

    def __init__(self):
        from vendored import ops
        self.ops = ops

    def _ssd_scan(self, *args, **kwargs):
        return self.ops.ssd_scan(*args, **kwargs)

    def _selective_state_update(self, *args, **kwargs):
        return self.ops.selective_state_update(*args, **kwargs)

    def _causal_conv1d(self, *args, **kwargs):
        return self.ops.causal_conv1d(*args, **kwargs)

    def _causal_conv1d_update(self, *args, **kwargs):
        return self.ops.causal_conv1d_update(*args, **kwargs)

    def _rms_norm_gated(self, *args, **kwargs):
        return self.ops.rms_norm_gated(*args, **kwargs)


# ---- shared pieces of the peers' calling conventions ---------------------------------------------------------------

def _loader():
    folder = peers_dir()
    if not (folder / "peer_loader.py").is_file():
        raise pytest.UsageError(f"--ops: {folder}/peer_loader.py is missing; fetch the peers first (`make fetch-peers`, "
                                "or set BAMBA_PEERS to the folder it wrote)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    os.environ.setdefault("PEERS_VENDOR", str(folder / "vendor"))
    import peer_loader
    if os.environ.get("TRITON_INTERPRET") == "1":
        peer_loader.patch_torch_for_interpreter()
    return peer_loader


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _prune(loader, modules) -> None:
    """Under the interpreter, one autotune config per kernel (it would time them all, through a GPU driver it does not
    have), in every module of the peer that is loaded, helpers included."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        loaded = [m for k, m in list(sys.modules.items()) if k.startswith(("mamba_ssm.ops", "vllm.model_executor",
                                                                           "fla.ops"))]
        loader.prune_autotune_for_interpreter(*modules, *loaded)


def _per_channel(t: torch.Tensor | None, *trailing: int) -> torch.Tensor | None:
    """A per-head (H,) value as the stride-0 (H, *trailing) view the peers' decode kernels take (their TIE_HDIM path,
    how vLLM's mixer passes A, D and dt_bias)."""
    if t is None:
        return None
    return t.reshape(t.shape[0], *([1] * len(trailing))).expand(t.shape[0], *trailing)


def _initial_states(pool, slots, has_initial):
    """What vLLM's mixer hands its scan: slot states where has_initial_state, zeros elsewhere (never reading the
    others' values into the result: torch.where selects, a NaN slot not selected stays out)."""
    gathered = pool[slots.long()]
    return torch.where(has_initial[:, None, None, None], gathered, torch.zeros((), dtype=pool.dtype,
                                                                               device=pool.device))


def _seq_idx(cu_seqlens, n_tokens: int):
    """(1, T) int32: each token's sequence."""
    lengths = cu_seqlens.diff().long()
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32, device=cu_seqlens.device),
                                   lengths, output_size=n_tokens)[None]


def chunk_indices_offsets(cu_seqlens, chunk_size: int, n_tokens: int):
    """The logical chunks of vLLM 0.8-0.10's scan, by their definition: the packed token axis is cut every chunk_size
    tokens and at every sequence start; a logical chunk is (physical chunk = start // Q, offset = start % Q) for each
    cut start in [0, T). Returns int32 (chunk_indices, chunk_offsets)."""
    starts = {int(s) for s in cu_seqlens.tolist()[:-1] if 0 <= int(s) < n_tokens}
    cuts = sorted(starts | set(range(0, n_tokens, chunk_size)))
    device = cu_seqlens.device
    return (torch.tensor([c // chunk_size for c in cuts], dtype=torch.int32, device=device),
            torch.tensor([c % chunk_size for c in cuts], dtype=torch.int32, device=device))


def _store_final(pool, slots, final):
    pool[slots.long()] = final.to(pool.dtype)


class _Peer(Provider):
    scan_products = "rounded"
    scan_stage2_rounds_once = True
    features = frozenset()

    def _check_common(self, check_indices=True, products="fp32", x=None, cu_seqlens=None):
        if products not in ("fp32", "rounded"):
            raise Unsupported(f"products={products!r}: no such precision switch")
        if x is not None and x.dtype == torch.bfloat16 and _interpreted():
            raise Unsupported("bf16 under the Triton interpreter, whose bf16 stores truncate (ours round on purpose, "
                              "vendored/ops/_rounding.py); the GPU run judges it")
        if cu_seqlens is not None and bool((cu_seqlens.diff() == 0).any()):
            raise Unsupported("an empty sequence in a prefill batch (its engine never schedules one)")

    def _rms_norm_gated(self, x, gate, weight, *, eps, group_size, norm_before_gate=False):
        fn = self.rms_norm_fn
        if fn is None:
            raise Unsupported("has no gated RMSNorm")
        return fn(x, weight, None, z=gate, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)

    rms_norm_fn = None


def _ssu_contract(ssm_states, x, dt_limit, D, dt_bias) -> None:
    """What the peers' selective_state_update has no parameter or contract for."""
    if tuple(dt_limit) != (0.0, math.inf):
        raise Unsupported("selective_state_update has no dt_limit parameter")
    if D is None or dt_bias is None:
        raise Unsupported("selective_state_update is always given D and dt_bias by its mixer")
    if torch.promote_types(x.dtype, ssm_states.dtype) != x.dtype:
        raise Unsupported("its decode y is in x's dtype, ours in x's promoted with the pool's")
    if x.dtype == torch.bfloat16 and _interpreted():
        raise Unsupported("bf16 under the Triton interpreter, whose bf16 stores truncate; the GPU run judges it")


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y, or y copied into our op's `out` (the peers write y in x's dtype: an `out` of another dtype is ours alone)."""
    if out is None:
        return y
    if out.dtype != y.dtype:
        raise Unsupported("an `out` of another dtype than x is ours alone")
    return out.copy_(y)


# ---- vLLM ----------------------------------------------------------------------------------------------------------

class VllmProvider(_Peer):
    """vLLM `version`: 0.33.0 (varlen scan with per-sequence chunks and final_states_out), 0.10.2 (the batch-1 scan
    with seq_idx, chunk_indices/offsets and return_varlen_states, as its V1 mixer calls it), 0.7.3 (the batch-1 scan
    with seq_idx and cu_seqlens, no chunk metadata; its causal conv is a compiled CUDA op)."""

    def __init__(self, version: str):
        loader = _loader()
        self.version = version
        self.name = f"vllm-{version}"
        self.peer = loader.load_vllm(version)
        self.modules = self.peer.modules
        _prune(loader, list(self.modules.values()))
        self.loader = loader
        norm = self.modules.get("layernorm_gated")
        self.rms_norm_fn = None if norm is None else norm.rms_norm_gated

    # scan
    def _ssd_scan(self, x, dt, A, B, C, *, chunk_size, D, dt_bias, z, cu_seqlens, ssm_states, state_indices,
                  has_initial_state, dt_softplus=True, dt_limit=(0.0, math.inf), check_indices=True,
                  products="fp32"):
        self._check_common(check_indices, products, x, cu_seqlens)
        if self.version != "0.7.3" and chunk_size & (chunk_size - 1):
            raise Unsupported(f"chunk_size {chunk_size}: it asserts a power of 2")
        n_tokens = x.shape[0]
        combined = self.modules["ssd_combined"]
        if self.version == self.loader.VLLM_VERSION:
            cu_chunks, last_chunks, seq_of_chunk = self.loader.vllm_chunk_metadata(cu_seqlens, chunk_size, x.device)
            initial = _initial_states(ssm_states, state_indices, has_initial_state) \
                if bool(has_initial_state.any()) else None
            y = torch.empty_like(x)
            combined.mamba_chunk_scan_combined_varlen(
                x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunks, last_chunks, seq_of_chunk, y, D=D, z=z,
                dt_bias=dt_bias, initial_states=initial, dt_softplus=dt_softplus, dt_limit=dt_limit,
                state_dtype=ssm_states.dtype, final_states_out=ssm_states, final_state_indices=state_indices)
            return y
        seq_idx = _seq_idx(cu_seqlens, n_tokens)
        extra = {}
        initial = None
        if bool(has_initial_state.any()):
            initial = _initial_states(ssm_states, state_indices, has_initial_state)
            if self.version == "0.7.3" and x.is_cuda and initial.dtype != x.dtype:
                # its chunk scan points one variable at the chunk states (x's dtype) or the initial states: Triton's
                # compiler rejects two pointer types there (the interpreter does not check); its cache held x's dtype
                raise Unsupported(f"{self.name}: initial states in {initial.dtype} with {x.dtype} inputs do not "
                                  "compile on a GPU (its states between chunks are in the inputs' dtype)")
            if self.version != "0.7.3":
                extra["chunk_indices"], extra["chunk_offsets"] = chunk_indices_offsets(cu_seqlens, chunk_size,
                                                                                       n_tokens)
        if self.version != "0.7.3":
            extra["out"] = y = torch.empty_like(x)[None]
            extra["state_dtype"] = ssm_states.dtype
        result = combined.mamba_chunk_scan_combined(
            x[None], dt[None], A, B[None], C[None], chunk_size=chunk_size, D=D, z=None if z is None else z[None],
            dt_bias=dt_bias, seq_idx=seq_idx, cu_seqlens=cu_seqlens, initial_states=initial,
            return_varlen_states=True, return_final_states=False, dt_softplus=dt_softplus, dt_limit=dt_limit,
            **extra)
        if self.version == "0.7.3":
            y, final = result
        else:
            final = result
        _store_final(ssm_states, state_indices, final)
        return y[0]

    # decode
    def _selective_state_update(self, ssm_states, x, dt, A, B, C, *, D, dt_bias, z, state_indices,
                                dt_softplus=True, dt_limit=(0.0, math.inf), pad_slot_id=-1, out=None):
        _ssu_contract(ssm_states, x, dt_limit, D, dt_bias)
        H, P, N = ssm_states.shape[1:]
        batch = x.shape[0]
        args = (ssm_states, x, dt[:, :, None].expand(batch, H, P), _per_channel(A, P, N), B, C,
                _per_channel(D, P), z, _per_channel(dt_bias, P))
        fn = self.modules["mamba_ssm"].selective_state_update
        if self.version == self.loader.VLLM_VERSION:
            # 0.33 marks padding rows by a null block id (its engine's 0); ours is pad_slot_id
            y = torch.zeros_like(x)
            fn(*args[:6], args[6], args[8], z=z, dt_softplus=dt_softplus, state_batch_indices=state_indices,
               null_block_id=pad_slot_id, out=y)
        elif self.version == "0.10.2":
            y = torch.zeros_like(x)
            fn(*args[:6], D=args[6], z=z, dt_bias=args[8], dt_softplus=dt_softplus,
               state_batch_indices=state_indices, pad_slot_id=pad_slot_id, out=y)
        else:
            y = fn(*args[:6], D=args[6], z=z, dt_bias=args[8], dt_softplus=dt_softplus,
                   state_batch_indices=state_indices, pad_slot_id=pad_slot_id)
        # its padding rows' outputs are left as they were (its engine never reads them); ours are zero
        y[state_indices == pad_slot_id] = 0
        return _into(out, y)

    # conv
    def _conv_module(self):
        if self.version == "0.7.3":
            raise Unsupported("causal_conv1d is a compiled CUDA op in this release (vllm._custom_ops), not Triton")
        return self.modules["causal_conv1d"]

    def _causal_conv1d(self, x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial_state,
                       activation="silu", *, check_indices=True):
        module = self._conv_module()
        if self.version != self.loader.VLLM_VERSION and _interpreted():
            raise Unsupported("its prefill conv builds its launch tables in the grid callback, from device tensors "
                              "the Triton interpreter cannot index; the GPU run judges it")
        if x.dtype == torch.bfloat16 and _interpreted():
            raise Unsupported("bf16 under the Triton interpreter, whose bf16 stores truncate; the GPU run judges it")
        # vLLM's layout: x as (C, T) with the channel stride 1, states (S, C, W-1) with the channel stride 1
        x_ct = x.contiguous().t()
        states = _channel_last(conv_states)
        extra = {}
        if self.version == self.loader.VLLM_VERSION:
            extra["metadata"] = self.loader.vllm_conv1d_metadata(cu_seqlens, x.device)
            extra["null_block_id"] = -2                    # our slot 0 is a real slot; no slot is the null block
        out = module.causal_conv1d_fn(x_ct, weight, bias, states, cu_seqlens, cache_indices=state_indices,
                                      has_initial_state=has_initial_state, activation=activation, **extra)
        conv_states.copy_(states)
        return out.t()

    def _causal_conv1d_update(self, x, conv_states, weight, bias, state_indices, activation="silu",
                              pad_slot_id=-1):
        module = self._conv_module()
        states = _channel_last(conv_states)
        extra = dict(null_block_id=pad_slot_id) if self.version == self.loader.VLLM_VERSION \
            else dict(pad_slot_id=pad_slot_id)
        # it writes its output over x (its mixer's buffer): hand it a copy
        out = module.causal_conv1d_update(x.clone(), states, weight, bias, activation=activation,
                                          conv_state_indices=state_indices, **extra)
        conv_states.copy_(states)
        out[state_indices == pad_slot_id] = 0        # left as x there (its engine never reads them); ours are zero
        return out


def _channel_last(pool: torch.Tensor) -> torch.Tensor:
    """`pool` itself when its channel stride is 1, else a copy laid out so (the caller copies it back)."""
    if pool.stride(1) == 1:
        return pool
    return pool.transpose(1, 2).contiguous().transpose(1, 2)


# ---- mamba_ssm -----------------------------------------------------------------------------------------------------

class MambaSsmProvider(_Peer):
    """mamba_ssm: mamba_chunk_scan_combined (batch-1 varlen with seq_idx and cu_seqlens, which takes no per-sequence
    initial states; one sequence runs as a batch of one with initial_states), selective_state_update (no padding rows,
    no dt_limit), rmsnorm_fn. Its causal conv is the CUDA package causal-conv1d, not Triton."""

    def __init__(self):
        loader = _loader()
        self.peer = loader.load_mamba_ssm()
        self.name = self.peer.name
        _prune(loader, list(self.peer.modules.values()))
        self.rms_norm_fn = self.peer.rmsnorm_fn

    def _ssd_scan(self, x, dt, A, B, C, *, chunk_size, D, dt_bias, z, cu_seqlens, ssm_states, state_indices,
                  has_initial_state, dt_softplus=True, dt_limit=(0.0, math.inf), check_indices=True,
                  products="fp32"):
        self._check_common(check_indices, products, x, cu_seqlens)
        n_seqs = len(state_indices)
        common = dict(D=D, z=None if z is None else z[None], dt_bias=dt_bias, dt_softplus=dt_softplus,
                      dt_limit=dt_limit)
        fn = self.peer.mamba_chunk_scan_combined
        if n_seqs == 1:
            if x.shape[0] == 0:
                raise Unsupported("an empty sequence")
            initial = _initial_states(ssm_states, state_indices, has_initial_state) \
                if bool(has_initial_state.any()) else None
            y, final = fn(x[None], dt[None], A, B[None], C[None], chunk_size, initial_states=initial,
                          return_final_states=True, **common)
        else:
            if bool(has_initial_state.any()):
                raise Unsupported("its varlen scan takes no per-sequence initial states")
            y, final = fn(x[None], dt[None], A, B[None], C[None], chunk_size, seq_idx=_seq_idx(cu_seqlens, x.shape[0]),
                          cu_seqlens=cu_seqlens, return_varlen_states=True, **common)
        _store_final(ssm_states, state_indices, final)
        return y[0].to(x.dtype)

    def _selective_state_update(self, ssm_states, x, dt, A, B, C, *, D, dt_bias, z, state_indices,
                                dt_softplus=True, dt_limit=(0.0, math.inf), pad_slot_id=-1, out=None):
        _ssu_contract(ssm_states, x, dt_limit, D, dt_bias)
        if bool((state_indices == pad_slot_id).any()):
            raise Unsupported("selective_state_update has no padding rows")
        H, P, N = ssm_states.shape[1:]
        y = self.peer.selective_state_update(
            ssm_states, x, dt[:, :, None].expand(x.shape[0], H, P), _per_channel(A, P, N), B, C,
            D=_per_channel(D, P), z=z, dt_bias=_per_channel(dt_bias, P), dt_softplus=dt_softplus,
            state_batch_indices=state_indices)
        return _into(out, y)


# ---- fla -----------------------------------------------------------------------------------------------------------

class FlaProvider(_Peer):
    """fla-core's chunk_simple_gla as the SSD scan (scalar-gated linear attention): q = C and k = B per head (fla has
    no groups), v = x·Δ, log decay g = Δ·A, all in torch before the call (softplus, dt_bias, dt_limit); D·x and the
    z gate after. Its chunk size is its own (64): chunk_size is not a parameter. Per-sequence initial states with
    cu_seqlens, in its (N, H, K, V) layout."""

    def __init__(self):
        self.name = "fla"
        self.peer = None
        if os.environ.get("TRITON_INTERPRET") != "1":
            self.peer = _loader().load_fla()
            self.name = self.peer.name

    def _ssd_scan(self, x, dt, A, B, C, *, chunk_size, D, dt_bias, z, cu_seqlens, ssm_states, state_indices,
                  has_initial_state, dt_softplus=True, dt_limit=(0.0, math.inf), check_indices=True,
                  products="fp32"):
        self._check_common(check_indices, products, x, cu_seqlens)
        if self.peer is None:
            raise Unsupported("fla-core runs on a GPU only (it asks the device driver for its platform, which the "
                              "Triton interpreter has none of)")
        H, G = x.shape[1], B.shape[1]
        dtype = x.dtype
        delta = dt.float() + (0 if dt_bias is None else dt_bias.float())
        if dt_softplus:
            delta = torch.nn.functional.softplus(delta)
        delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])                               # (T, H)

        def heads(t):                                                                       # (T, G, N) -> (1, T, H, N)
            return t.repeat_interleave(H // G, dim=1)[None].contiguous()

        v = (x.float() * delta[..., None]).to(dtype)[None]                                  # (1, T, H, P)
        initial = _initial_states(ssm_states, state_indices, has_initial_state).float() \
            .transpose(-1, -2).contiguous()                                                 # (N_seq, H, N, P)
        o, final = self.peer.chunk_simple_gla(heads(C), heads(B), v, g=(delta * A.float())[None], scale=1.0,
                                              initial_state=initial, output_final_state=True,
                                              cu_seqlens=cu_seqlens.long())
        y = o[0].float()
        if D is not None:
            y = y + D.float()[:, None] * x.float()
        if z is not None:
            y = y * torch.nn.functional.silu(z.float())
        _store_final(ssm_states, state_indices, final.transpose(-1, -2))
        return y.to(dtype)


# ---- choosing -----------------------------------------------------------------------------------------------------

def make(name: str) -> Provider:
    if name not in PEER_NAMES:
        raise pytest.UsageError(f"--ops {name!r}: expected one of {', '.join(PEER_NAMES)}")
    if name == "vendored":
        return Vendored()
    if name.startswith("vllm"):
        return VllmProvider(name.partition("-")[2] or _loader().VLLM_VERSION)
    if name == "mamba_ssm":
        return MambaSsmProvider()
    return FlaProvider()


def activate(name: str) -> Provider:
    global _ACTIVE
    _ACTIVE = make(name)
    return _ACTIVE


def active() -> Provider:
    """The provider of this session (vendored unless --ops said otherwise)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Vendored()
    return _ACTIVE


class _Active:
    """OPS: the active provider, resolved at each use (test modules import it before the session picks one)."""

    def __getattr__(self, name):
        return getattr(active(), name)


OPS = _Active()
