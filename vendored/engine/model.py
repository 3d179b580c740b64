"""Bamba on our kernels: one packed step holds decode tokens first, then prefill pieces of any length.

Mamba layers send decode rows through causal_conv1d_update + selective_state_update and prefill rows through
causal_conv1d + ssd_scan, all reading and writing the request's state slot. Attention writes the new K/V into the
paged cache and attends over each sequence's cached context with one masked SDPA call for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vendored.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from vendored.ops.rms_norm import add_rms_norm
from vendored.ops.rms_norm_gated import rms_norm_gated
from vendored.ops.rotary import rotary_
from vendored.ops.selective_state_update import selective_state_update
from vendored.ops.silu_mul import silu_mul
from vendored.ops.ssd_scan import ssd_scan

from . import invariant
from .cache import KVCache, StatePool
from .paged_attention import masked_attention, paged_decode_attention
from .ranking import top_k
from .weights import EngineModelConfig


@dataclass
class StepBatch:
    """The tensors of one engine step. T tokens in all: the first `num_decodes` are one token per decoding sequence,
    the rest are prefill pieces. Sequences are in the same order as their tokens (n_seq = decodes + prefills).

    token_ids, positions (T,); decode_slots (num_decodes,); prefill_cu_seqlens (n_prefill+1,) offsets within the
    prefill tokens; prefill_slots, prefill_has_initial_state (n_prefill,); query_start (n_seq+1,) offsets of each
    sequence's tokens in the step; context_lens (n_seq,) tokens in cache after the step; block_tables (n_seq, M);
    kv_slot_mapping (T,) flat K/V position (block·block_size + offset) of each new token; logits_rows: the rows whose
    logits are wanted. static_decode: every row is a decode (padding rows included), every row's logits are wanted
    (logits_rows is all of them) and attention runs over the full block-table width, so that no shape depends on
    the contexts (the CUDA-graph step, vendored/engine/cudagraph.py).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    prefill_slots: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    kv_slot_mapping: torch.Tensor
    logits_rows: torch.Tensor
    static_decode: bool = False


def _merge(w: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], merged: str, *,
           device: torch.device | None = None, dtype: torch.dtype | None = None) -> tuple[int, ...] | None:
    """Put the weights (and biases) of projections that read the same input side by side in one, `prefix + merged`,
    so that one GEMM reads them all (q/k/v; gate/up), and drop the parts. The merged tensor is made on `device` in
    `dtype` (the parts' own by default) and each part copied into its rows: a model loading to a GPU never holds
    the parts there, so the caching allocator is left no part-sized holes (at Bamba-9B width, merging after the
    move left 7.5 GB reserved and unusable). Returns the parts' output widths, or None (nothing merged) when a part
    is missing or only some have a bias."""
    weights = [w.get(prefix + part + ".weight") for part in parts]
    biases = [w.get(prefix + part + ".bias") for part in parts]
    if any(t is None for t in weights) or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    w[prefix + merged + ".weight"] = _stacked(weights, device, dtype)
    if biases[0] is not None:
        w[prefix + merged + ".bias"] = _stacked(biases, device, dtype)
    for part in parts:
        w.pop(prefix + part + ".weight")
        w.pop(prefix + part + ".bias", None)
    return tuple(t.shape[0] for t in weights)


def _stacked(parts: list[torch.Tensor], device: torch.device | None, dtype: torch.dtype | None) -> torch.Tensor:
    """torch.cat(parts) along dim 0, made once on `device` in `dtype` (each part converted as .to would)."""
    out = torch.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), dtype=dtype or parts[0].dtype,
                      device=device or parts[0].device)
    row = 0
    for t in parts:
        out[row:row + t.shape[0]].copy_(t)
        row += t.shape[0]
    return out


# Whether a model on a CPU runs the decoder layer's element-wise ops (add_rms_norm, rotary_, silu_mul) and the
# CUDA-graph step's decode attention (decode_attention, through paged_decode_attention) as the Triton kernels, under
# the interpreter, instead of as torch expressions (the element-wise ones with the same rounding). A CUDA model runs
# the kernels always. Off by default: interpreted, each launch costs ~10-30 ms, about 30% more time for every CPU
# engine test, while the kernels have element-wise tests of their own on both backends; tests/engine/test_fused_ops.py
# turns it on to check the engine's calls of them on the CPU.
FUSED_OPS_ON_CPU = False


def _norm_torch(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, the normalised row rounded to s's dtype before the weight multiplies it."""
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype)


class BambaEngineModel:
    """The model of one engine step. layers: the decoder layers this instance holds (all by default; a pipeline
    stage holds a contiguous range, and `tensors` need only have the weights of those layers). batch_invariant:
    every row's arithmetic independent of the rest of the step (vendored/engine/invariant.py)."""

    def __init__(self, cfg: EngineModelConfig, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype,
                 device: torch.device, max_positions: int, layers: range | None = None,
                 batch_invariant: bool = False) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.batch_invariant = batch_invariant
        self.fused = device.type == "cuda" or FUSED_OPS_ON_CPU or batch_invariant
        self.layers = range(cfg.num_layers) if layers is None else layers
        # q/k/v and gate/up each read by one GEMM: a decode step of a small batch is bound by its launches and
        # weight reads, and one wider GEMM reads the same bytes in one launch (and its output holds q and k side by
        # side for one rotary launch). Merged as they are moved (_merge); the split widths are this instance's (a
        # tensor-parallel rank's shards).
        w = dict(tensors)
        self.qkv_widths: dict[int, tuple[int, ...]] = {}
        self.gate_up_merged: set[int] = set()
        for i in self.layers:
            if i in cfg.attn_layers:
                widths = _merge(w, f"model.layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj",
                                device=device, dtype=dtype)
                if widths is not None:
                    self.qkv_widths[i] = widths
            if _merge(w, f"model.layers.{i}.feed_forward.", ("gate_proj", "up_proj"), "gate_up_proj",
                      device=device, dtype=dtype):
                self.gate_up_merged.add(i)
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in w.items()}
        for i in (i for i in cfg.mamba_layers if i in self.layers):
            p = f"model.layers.{i}.mamba."
            self.w[p + "A"] = -torch.exp(tensors[p + "A_log"].to(device=device, dtype=torch.float32))
            self.w[p + "D"] = tensors[p + "D"].to(device=device, dtype=torch.float32)
            self.w[p + "dt_bias"] = tensors[p + "dt_bias"].to(device=device, dtype=torch.float32)
            self.w[p + "conv_w"] = self.w[p + "conv1d.weight"][:, 0].contiguous()   # (C, W)
        # RoPE table from fp64 angles, stored in fp32: positions in the tens of thousands keep their accuracy.
        R = cfg.rotary_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None]   # (L, R/2)
        self.cos = torch.cat([angles.cos()] * 2, -1).float().to(device)                        # (L, R)
        self.sin = torch.cat([angles.sin()] * 2, -1).float().to(device)

    def forward(self, batch: StepBatch, states: StatePool, kv: KVCache) -> torch.Tensor:
        """Runs the step, updating states and K/V in place. Returns fp32 logits (len(logits_rows), V)."""
        h, ffn = self.run_layers(self.embed(batch), batch, states, kv, last_added=False)
        return self.logits(h, batch, ffn)

    def embed(self, batch: StepBatch) -> torch.Tensor:
        # rows gathered by indexing, not F.embedding: its index_select kernel took 6.2 µs for a decode step's 8
        # rows on an H200 (docs/decode-bench.md); both are copies of the same rows
        h = self.w["model.embed_tokens.weight"][batch.token_ids]                             # (T, D)
        return h * self.cfg.embedding_multiplier if self.cfg.embedding_multiplier != 1 else h

    def run_layers(self, h: torch.Tensor, batch: StepBatch, states: StatePool, kv: KVCache, *,
                   last_added: bool = True):
        """The residual stream h (T, D) through this instance's layers. last_added=False: (h, ffn) before the
        last sublayer's output is added (ffn None when no layer ran), for logits() to add it with the final norm."""
        cfg = self.cfg
        m_r, eps = cfg.residual_multiplier, cfg.rms_norm_eps
        ffn = None                                       # the last sublayer's output, added with the next norm
        for i in self.layers:
            p = f"model.layers.{i}."
            h, x = self._add_norm(h, ffn, self.w[p + "input_layernorm.weight"], eps)
            mixed = self._attention(i, x, batch, kv) if i in cfg.attn_layers else self._mamba(i, x, batch, states)
            h, x = self._add_norm(h, mixed * m_r if m_r != 1 else mixed, self.w[p + cfg.ffn_norm_suffix], eps)
            ffn = self._granite_ffn(i, x, batch) if cfg.granite else self._mlp(i, x)
            ffn = ffn * m_r if m_r != 1 else ffn
        if not last_added:
            return h, ffn
        return h if ffn is None else h + ffn

    def logits(self, h: torch.Tensor, batch: StepBatch, delta: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the rows batch.logits_rows of the residual stream h + delta (delta: the last sublayer's
        output, added by the final norm's launch; the sum rounds as h + delta would). A static decode step wants
        every row: no gather."""
        if not batch.static_decode:
            h = h[batch.logits_rows]
            delta = None if delta is None else delta[batch.logits_rows]
        h = self._add_norm(h, delta, self.w[self.cfg.final_norm_key], self.cfg.rms_norm_eps)[1]
        logits = self._mm(h, self.w["lm_head.weight"]).float()
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1 else logits

    def _mm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x · weightᵀ (+ bias): in batch-invariant mode by tiles of a fixed number of rows (invariant.linear)."""
        return invariant.linear(x, weight, bias) if self.batch_invariant else F.linear(x, weight, bias)

    def _linear(self, x, name):
        return self._mm(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _output_linear(self, x, name):
        """An output projection (out_proj, o_proj, down_proj): the one place where a tensor-parallel shard sums its
        partial products across ranks (vendored/engine/parallel.py overrides it)."""
        return self._linear(x, name)

    def _gated_norm(self, i: int, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of mamba layer i, per group of H·P/G channels. y, z (T, H·P)."""
        cfg = self.cfg
        return rms_norm_gated(y, z, self.w[f"model.layers.{i}.mamba.norm.weight"], eps=cfg.rms_norm_eps,
                              group_size=cfg.n_heads * cfg.head_dim // cfg.n_groups, norm_before_gate=False)

    def _mamba(self, i: int, x: torch.Tensor, batch: StepBatch, states: StatePool) -> torch.Tensor:
        cfg, p = self.cfg, f"model.layers.{i}.mamba."
        H, P, G, N = cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
        T, n_dec = x.shape[0], batch.num_decodes
        zxbcdt = self._linear(x, p + "in_proj")
        z, xBC, dt = zxbcdt.split([H * P, cfg.conv_dim, H], dim=-1)                        # (T, HP), (T, C), (T, H)
        conv_pool, ssm_pool = states.conv[i], states.ssm[i]
        conv_w, conv_b = self.w[p + "conv_w"], self.w.get(p + "conv1d.bias")
        common = dict(D=self.w[p + "D"], dt_bias=self.w[p + "dt_bias"], z=None, dt_softplus=True,
                      dt_limit=cfg.time_step_limit)
        y = torch.empty(T, H, P, dtype=x.dtype, device=x.device)                           # (T, H, P)
        if n_dec:                                        # both kernels take the projection's strided columns
            xbc = causal_conv1d_update(xBC[:n_dec], conv_pool, conv_w, conv_b, batch.decode_slots, "silu",
                                       pad_slot_id=states.pad_slot)
            xs, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
            selective_state_update(ssm_pool, xs.reshape(n_dec, H, P), dt[:n_dec], self.w[p + "A"],
                                   B.reshape(n_dec, G, N), C.reshape(n_dec, G, N), state_indices=batch.decode_slots,
                                   pad_slot_id=states.pad_slot, out=y[:n_dec], **common)
        if T > n_dec and self.batch_invariant:
            self._prefill_token_by_token(i, xBC[n_dec:], dt[n_dec:], y[n_dec:], batch, states, common)
        elif T > n_dec:
            t_pre = T - n_dec
            xbc = causal_conv1d(xBC[n_dec:].contiguous(), conv_w, conv_b, conv_pool, batch.prefill_cu_seqlens,
                                batch.prefill_slots, batch.prefill_has_initial_state, "silu", check_indices=False)
            xs, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
            y[n_dec:] = ssd_scan(
                xs.reshape(t_pre, H, P).contiguous(), dt[n_dec:].contiguous(), self.w[p + "A"],
                B.reshape(t_pre, G, N).contiguous(), C.reshape(t_pre, G, N).contiguous(),
                chunk_size=cfg.chunk_size, cu_seqlens=batch.prefill_cu_seqlens, ssm_states=ssm_pool,
                state_indices=batch.prefill_slots, has_initial_state=batch.prefill_has_initial_state,
                check_indices=False, **common).to(x.dtype)
        y = self._gated_norm(i, y.reshape(T, H * P), z)                                  # z: strided columns
        return self._output_linear(y, p + "out_proj")

    def _prefill_token_by_token(self, i: int, xBC: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
                                batch: StepBatch, states: StatePool, common: dict) -> None:
        """The prefill pieces of mamba layer i as decode steps, one token of every piece at a time, writing y
        (T_prefill, H, P) in place (batch-invariant mode: invariant.py). A piece without an initial state starts
        from a zeroed slot, as the scan starts from zeros."""
        cfg, p = self.cfg, f"model.layers.{i}.mamba."
        H, P, G, N = cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_state
        conv_pool, ssm_pool = states.conv[i], states.ssm[i]
        slots = batch.prefill_slots.long()
        fresh = slots[~batch.prefill_has_initial_state]
        conv_pool[fresh] = 0
        ssm_pool[fresh] = 0
        for rows, pieces in invariant.token_steps(batch.prefill_cu_seqlens.tolist()):
            rows, pieces = rows.to(xBC.device), pieces.to(xBC.device)
            n, row_slots = len(rows), batch.prefill_slots[pieces]
            xbc = causal_conv1d_update(xBC[rows], conv_pool, self.w[p + "conv_w"], self.w.get(p + "conv1d.bias"),
                                       row_slots, "silu", pad_slot_id=states.pad_slot)
            xs, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
            out = torch.empty(n, H, P, dtype=y.dtype, device=y.device)
            selective_state_update(ssm_pool, xs.reshape(n, H, P), dt[rows], self.w[p + "A"], B.reshape(n, G, N),
                                   C.reshape(n, G, N), state_indices=row_slots, pad_slot_id=states.pad_slot, out=out,
                                   **common)
            y[rows] = out

    def _rope(self, t: torch.Tensor, positions: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """NeoX rotate-half on the first R dims of the first `heads` heads (default all; none rotated under NoPE),
        in place. t (T, heads, Dh)."""
        R = self.cfg.rotary_dim
        if R == 0:
            return t
        if self.fused:
            return rotary_(t, positions, self.cos, self.sin, n_rot_heads=heads)
        part = t[:, :heads, :R]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]                # (T, 1, R)
        rot = part.float()
        half = torch.cat([-rot[..., R // 2:], rot[..., : R // 2]], dim=-1)
        part.copy_(rot * cos + half * sin)
        return t

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, RMSNorm(h + delta) · weight); delta None: (h, RMSNorm(h) · weight)."""
        if self.fused:
            return add_rms_norm(h, delta, weight, eps=eps)
        s = h if delta is None else h + delta
        return s, _norm_torch(s, weight, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of a merged [gate | up] projection output."""
        if self.fused:
            return silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (T, Hq, Dh) and k (T, Hkv, Dh) after RoPE, and v (T, Hkv, Dh): views of one GEMM's output when the
        projections are merged (q and k rotated by one launch), else three."""
        cfg, p = self.cfg, f"model.layers.{i}.self_attn."
        Hq, Hkv, Dh = cfg.num_q_heads, cfg.num_kv_heads, cfg.attn_head_dim
        if i in self.qkv_widths:
            qkv = self._linear(x, p + "qkv_proj").reshape(x.shape[0], -1, Dh)               # (T, Hq+2Hkv, Dh)
            self._rope(qkv, positions, Hq + Hkv)
            return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
        q = self._rope(self._linear(x, p + "q_proj").reshape(-1, Hq, Dh), positions)
        k = self._rope(self._linear(x, p + "k_proj").reshape(-1, Hkv, Dh), positions)
        return q, k, self._linear(x, p + "v_proj").reshape(-1, Hkv, Dh)

    def _attention(self, i: int, x: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        cfg, p = self.cfg, f"model.layers.{i}.self_attn."
        Hq, Hkv, Dh = cfg.num_q_heads, cfg.num_kv_heads, cfg.attn_head_dim
        scale = Dh ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        q, k, v = self._qkv(i, x, batch.positions)                                         # (T, H·, Dh) each
        k_cache, v_cache = kv.k[i].view(-1, Hkv, Dh), kv.v[i].view(-1, Hkv, Dh)            # (blocks·bs, Hkv, Dh)
        k_cache.index_copy_(0, batch.kv_slot_mapping, k)
        v_cache.index_copy_(0, batch.kv_slot_mapping, v)
        if batch.static_decode:
            out = paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                         block_size=kv.block_size, scale=scale, fused=self.fused,
                                         batch_invariant=self.batch_invariant)                  # (T, Hq, Dh)
            return self._linear(out.reshape(-1, Hq * Dh), p + "o_proj")
        if self.batch_invariant:                      # every query a decode row over its own position + 1 keys
            q_lens = batch.query_start[1:] - batch.query_start[:-1]
            seq = torch.repeat_interleave(torch.arange(len(q_lens), device=x.device), q_lens)
            out = paged_decode_attention(q, k_cache, v_cache, batch.block_tables[seq], batch.positions + 1,
                                         block_size=kv.block_size, scale=scale, fused=True, batch_invariant=True)
            return self._output_linear(out.reshape(-1, Hq * Dh), p + "o_proj")

        # Gather every sequence's context into a padded (n_seq, L, ...) view and attend with one masked call.
        n_seq = batch.context_lens.shape[0]
        bs = kv.block_size
        L = batch.block_tables.shape[1] * bs
        flat = (batch.block_tables[:, :, None] * bs + torch.arange(bs, device=x.device)).reshape(n_seq, L)
        key_valid = (torch.arange(L, device=x.device)[None] < batch.context_lens[:, None])[:, :, None, None]
        # Zero what lies past each context: a masked NaN would still poison the softmax-weighted sum.
        keys = k_cache[flat].masked_fill(~key_valid, 0.0)                                   # (n_seq, L, Hkv, Dh)
        values = v_cache[flat].masked_fill(~key_valid, 0.0)
        q_lens = batch.query_start[1:] - batch.query_start[:-1]                             # (n_seq,)
        Tq = int(q_lens.max())
        q_idx = batch.query_start[:-1, None] + torch.arange(Tq, device=x.device)[None]      # (n_seq, Tq)
        q_valid = torch.arange(Tq, device=x.device)[None] < q_lens[:, None]
        q_pad = q[q_idx.clamp(max=q.shape[0] - 1)]                                          # (n_seq, Tq, Hq, Dh)
        q_pos = (batch.context_lens - q_lens)[:, None] + torch.arange(Tq, device=x.device)[None]  # (n_seq, Tq)
        key_pos = torch.arange(L, device=x.device)
        allowed = (key_pos[None, None] <= q_pos[:, :, None]) & q_valid[:, :, None]          # (n_seq, Tq, L)
        allowed[..., 0] |= ~q_valid                    # padding queries see one key, never a row of -inf
        out = masked_attention(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), allowed[:, None],
                               scale=scale)                                                 # (n_seq, Hq, Tq, Dh)
        out = out.transpose(1, 2)[q_valid]                                                  # (T, Hq, Dh)
        return self._output_linear(out.reshape(-1, Hq * Dh), p + "o_proj")

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.feed_forward."
        if i in self.gate_up_merged:
            return self._output_linear(self._silu_mul(self._linear(x, p + "gate_up_proj")), p + "down_proj")
        return self._output_linear(F.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"),
                                   p + "down_proj")

    def _granite_ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """GraniteMoeHybrid's feed-forward: the shared SwiGLU plus the routed experts, summed before the one
        output reduction a tensor-parallel rank does (each rank holds a slice of every expert's channels)."""
        p = f"model.layers.{i}."
        gate_up = self._linear(x, p + "shared_mlp.input_linear")                            # gate rows first
        out = self._mm(self._silu_mul(gate_up), self.w[p + "shared_mlp.output_linear.weight"])
        if self.cfg.num_experts:
            out = out + self._experts(i, x, static=batch.static_decode)
        return self._reduce(out)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel output over tensor-parallel ranks (one rank: as it is; parallel.py overrides it)."""
        return partial

    def _experts(self, i: int, x: torch.Tensor, *, static: bool) -> torch.Tensor:
        """The routed experts of layer i. Router logits in fp32; each token's top-k experts weighted by the softmax
        of their k logits. Eagerly only the chosen tokens go through each expert; in a captured decode step
        (static shapes) every expert runs on every row and the unchosen get weight 0."""
        p = f"model.layers.{i}.block_sparse_moe."
        w_in, w_out = self.w[p + "input_linear.weight"], self.w[p + "output_linear.weight"]   # (E, 2I, D), (E, D, I)
        logits = self._mm(x.float(), self.w[p + "router.layer.weight"].float())              # (T, E)
        top_logits, chosen = top_k(logits, self.cfg.experts_per_tok)                         # ties: lower index
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)                               # (T, k)
        out = torch.zeros_like(x)
        for e in range(w_in.shape[0]):
            if static:
                rows = torch.arange(x.shape[0], device=x.device)
                weight = (weights * (chosen == e)).sum(-1)                                   # (T,): 0 if unchosen
            else:
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                weight = weights[rows, slot]
            gate, up = self._mm(x[rows], w_in[e]).chunk(2, dim=-1)
            out.index_add_(0, rows, self._mm(F.silu(gate) * up, w_out[e]) * weight[:, None])
        return out
