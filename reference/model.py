"""The oracle: a readable Bamba (and GraniteMoeHybrid) forward pass with an explicit per-sequence state.

One entry point, `BambaReference.forward_batch(pieces, states)`: each piece is the next tokens of one sequence, each
state what that sequence has seen so far; it returns each piece's logits and the new states (the inputs are not
modified). Processing a sequence whole or in any number of pieces gives the same logits, because every mixer carries
its full state: the mamba conv window and SSM state, and the attention keys/values. The pieces of one call are packed
into one token stream, the way an engine batches, and each mixer keeps the sequences apart by `cu_seqlens`.

Runs in fp64 by default (fp32 or lower on request), on any device torch supports.

Weights resident or streamed. Resident (a dict of tensors): every weight converted once and held. Streamed (a
LazyWeights, `from_pretrained(path, streamed=True)`): each call reads one layer's weights from the memory-mapped
safetensors, converts them to the model's dtype on its device, runs that layer over every sequence of the call, and
frees them before the next layer; the embedding and the head likewise, each in its turn. Peak memory is then one
layer's weights (or the embedding's) plus the activations and states of the call, whatever the depth, at the price
of reading the checkpoint once per call (on a GPU, from page-locked host copies of the stored tensors when they fit
half the host memory available: host_copies_fit). Both run the same operations on the same converted values, so they
give the same bits on the same device (tests/reference/test_streamed.py).

GraniteMoeHybrid is the same network with a different feed-forward block and a few scalars (reference/README.md):
its embedding, residual branches and logits are scaled by config multipliers, its attention scale is a config value,
its attention may have no RoPE at all, and its feed-forward is a shared SwiGLU plus, optionally, a mixture of routed
SwiGLU experts. One class computes both; `cfg.model_type` chooses the block and the names.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import LazyWeights, check_weights, expected_shapes, key_names, load_checkpoint
from .config import ModelConfig
from .ops import (
    causal_conv1d_ref,
    gqa_attention_ref,
    moe_ref,
    rms_norm_gated_ref,
    rms_norm_ref,
    rotary_ref,
    ssd_scan_ref,
    swiglu_ref,
)


class InputError(ValueError):
    """A request the model cannot process: an empty piece, an unknown token id, a position past the limit."""


@dataclass
class SequenceState:
    """Everything a sequence carries between pieces.

    conv[i] (C, W-1): last W-1 inputs of layer i's conv (pre-activation x|B|C), zeros before the first token.
    ssm[i] (H, P, N): layer i's SSM state.  keys[i], values[i] (L, Hkv, Dh): attention layer i's cache, keys
    after RoPE.  length: tokens seen so far, i.e. the position of the next token.
    """

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0


class BambaReference:
    """Bamba or GraniteMoeHybrid in plain PyTorch. weights: Hugging Face key -> tensor (checked against the config)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
        gated_norm: str = "grouped",
        allow_long_context: bool = False,
        scan_dtype: torch.dtype | None = None,
    ) -> None:
        """gated_norm: "grouped" normalises y·silu(z) per group of H·P/G channels, as Bamba was trained (mamba_ssm's
        fused kernel) and as vLLM serves it; "full" normalises over all H·P channels, as transformers' PyTorch path
        does. The two agree when G = 1. allow_long_context: accept positions past max_position_embeddings.
        scan_dtype: the dtype of the SSM recurrence and of the state it carries between pieces (default: dtype).
        A wider one (float32 with a bfloat16 model) is how engines run a 16-bit model: the scan reads its 16-bit
        inputs, computes and keeps its state in float32, and hands its output back in the model's dtype."""
        if gated_norm not in ("grouped", "full"):
            raise ValueError(f"gated_norm: expected 'grouped' or 'full', got {gated_norm!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.allow_long_context = allow_long_context
        self.norm_group_size = cfg.gated_norm_group_size if gated_norm == "grouped" else cfg.mamba_inner
        self.scan_dtype = dtype if scan_dtype is None else scan_dtype
        # Routing probes (harness/routing.py): layer -> (T,) bool of the packed tokens of the next call whose last
        # chosen expert is traded for the best one left out (moe_ref's swap); when a dict, layer -> the router
        # logits (T, E) of each call are appended to it.
        self.route_swaps: dict[int, torch.Tensor] = {}
        self.router_record: dict[int, list[torch.Tensor]] | None = None
        if isinstance(weights, LazyWeights):
            self.w: _Resident | _Streamed = _Streamed(weights, dtype, self.device)
        else:
            weights = check_weights(cfg, weights)
            self.w = _Resident({k: _converted(v, self.device, dtype) for k, v in weights.items()})
        shapes = expected_shapes(cfg)
        self._layer_keys = [[k for k in shapes if k.startswith(f"model.layers.{i}.")]
                            for i in range(cfg.num_hidden_layers)]

    @classmethod
    def from_pretrained(cls, path: str | Path, *, streamed: bool = False, **kwargs) -> "BambaReference":
        """streamed: read each layer's weights from the checkpoint when a call reaches it (module docstring)."""
        if streamed:
            cfg = ModelConfig.from_json(Path(path) / "config.json")
            store = LazyWeights(path, cfg)
            device = torch.device(kwargs.get("device", "cpu"))
            store.host_copies = device.type == "cuda" and host_copies_fit(store.stored_bytes)
            return cls(cfg, store, **kwargs)
        cfg, weights = load_checkpoint(path)
        return cls(cfg, weights, **kwargs)

    @property
    def streamed(self) -> bool:
        return isinstance(self.w, _Streamed)

    @property
    def peak_weight_bytes(self) -> int:
        """The most bytes of converted weights held at once so far (resident: all of them)."""
        return self.w.peak_bytes

    # ---- state -------------------------------------------------------------------------------------------
    def initial_state(self) -> SequenceState:
        cfg, kw = self.cfg, dict(dtype=self.dtype, device=self.device)
        state = SequenceState()
        for i, kind in enumerate(cfg.layer_types):
            if kind == "mamba":
                state.conv[i] = torch.zeros(cfg.conv_dim, cfg.mamba_d_conv - 1, **kw)
                state.ssm[i] = torch.zeros(cfg.mamba_n_heads, cfg.mamba_head_dim, cfg.mamba_d_state,
                                           dtype=self.scan_dtype, device=self.device)
            else:
                state.keys[i] = torch.zeros(0, cfg.num_key_value_heads, cfg.attn_head_dim, **kw)
                state.values[i] = torch.zeros(0, cfg.num_key_value_heads, cfg.attn_head_dim, **kw)
        return state

    # ---- the forward pass --------------------------------------------------------------------------------
    def forward(self, token_ids, state: SequenceState | None = None) -> tuple[torch.Tensor, SequenceState]:
        """One piece of one sequence. token_ids (T,); returns logits (T, V) and the new state."""
        logits, states = self.forward_batch([token_ids], [state or self.initial_state()])
        return logits[0], states[0]

    @torch.no_grad()
    def forward_batch(
        self, pieces: list, states: list[SequenceState]
    ) -> tuple[list[torch.Tensor], list[SequenceState]]:
        """Pieces of several sequences in one packed step. pieces[b] (T_b,) token ids; states[b] that sequence's
        state. Returns logits[b] (T_b, V) and the new states; the given states are left untouched."""
        if len(pieces) != len(states):
            raise InputError(f"{len(pieces)} pieces but {len(states)} states")
        tokens = [self._check_piece(b, p, s) for b, (p, s) in enumerate(zip(pieces, states))]
        lengths = [len(t) for t in tokens]
        cu_seqlens = torch.tensor([0] + lengths, device=self.device).cumsum(0)       # (B+1,)
        new_states = [SequenceState(length=s.length + n) for s, n in zip(states, lengths)]

        cfg, names = self.cfg, key_names(self.cfg)
        m_r = cfg.residual_multiplier                                                # 1 for Bamba
        with self._progress(len(lengths), sum(lengths)) as bar:
            with self.w.scope(["model.embed_tokens.weight"]):
                h = F.embedding(torch.cat(tokens), self.w["model.embed_tokens.weight"]) * cfg.embedding_multiplier
            for i, kind in enumerate(cfg.layer_types):                                   # h (T, D)
                p = f"model.layers.{i}."
                with self.w.scope(self._layer_keys[i]):
                    normed = rms_norm_ref(h, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
                    if kind == "mamba":
                        h = h + m_r * self._mamba(i, normed, cu_seqlens, states, new_states)
                    else:
                        h = h + m_r * self._attention(i, normed, cu_seqlens, states, new_states)
                    normed = rms_norm_ref(h, self.w[p + names["ffn_norm"]], cfg.rms_norm_eps)
                    h = h + m_r * (self._granite_ffn(i, normed) if cfg.granite else self._mlp(i, normed))
                bar.update(1)
            with self.w.scope([names["final_norm"], "lm_head.weight"]):
                h = rms_norm_ref(h, self.w[names["final_norm"]], cfg.rms_norm_eps)
                logits = F.linear(h, self.w["lm_head.weight"]) / cfg.logits_scaling       # (T, V)
        return list(logits.split(lengths)), new_states

    def _progress(self, n_seqs: int, n_tokens: int):
        """Streamed: a bar of the call's layers (layer i of L, the ETA), shown once a call has run two seconds (a
        decode step of a small model never shows one); resident: none."""
        if not self.streamed:
            return contextlib.nullcontext(_NoBar())
        return tqdm(total=self.cfg.num_hidden_layers, desc=f"streamed oracle: {n_seqs} seqs, {n_tokens} tokens",
                    unit="layer", leave=False, delay=2.0)

    def _check_piece(self, b: int, piece, state: SequenceState) -> torch.Tensor:
        ids = torch.as_tensor(piece, dtype=torch.long).reshape(-1).to(self.device)
        if ids.numel() == 0:
            raise InputError(f"request {b}: empty prompt or piece (at least one token is needed)")
        bad = ((ids < 0) | (ids >= self.cfg.vocab_size)).nonzero()
        if len(bad):
            pos = int(bad[0])
            raise InputError(f"request {b}: token id {int(ids[pos])} at position {state.length + pos} is outside "
                             f"the vocabulary [0, {self.cfg.vocab_size})")
        end = state.length + ids.numel()
        if end > self.cfg.max_position_embeddings and not self.allow_long_context:
            raise InputError(f"request {b}: positions up to {end - 1} exceed max_position_embeddings = "
                             f"{self.cfg.max_position_embeddings}; pass allow_long_context=True to go beyond")
        return ids

    def _mamba(self, i, x, cu_seqlens, states, new_states) -> torch.Tensor:
        cfg, p = self.cfg, f"model.layers.{i}.mamba."
        H, P, G, N = cfg.mamba_n_heads, cfg.mamba_head_dim, cfg.mamba_n_groups, cfg.mamba_d_state
        T = x.shape[0]
        zxbcdt = F.linear(x, self.w[p + "in_proj.weight"], self.w.get(p + "in_proj.bias"))
        z, xBC, dt = zxbcdt.split([H * P, cfg.conv_dim, H], dim=-1)            # (T, HP), (T, C), (T, H)

        n_seq = len(states)
        slots = torch.arange(n_seq, device=self.device)
        everyone = torch.ones(n_seq, dtype=torch.bool, device=self.device)
        conv_pool = torch.stack([s.conv[i] for s in states])                    # (B, C, W-1)
        ssm_pool = torch.stack([s.ssm[i] for s in states])                      # (B, H, P, N)

        xBC = causal_conv1d_ref(xBC, self.w[p + "conv1d.weight"][:, 0], self.w.get(p + "conv1d.bias"),
                                conv_pool, cu_seqlens, slots, everyone, activation="silu")
        xs, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
        s = self.scan_dtype                                                      # the recurrence's own precision
        y = ssd_scan_ref(
            xs.reshape(T, H, P).to(s), dt.to(s), -torch.exp(self.w[p + "A_log"].to(s)),
            B.reshape(T, G, N).to(s), C.reshape(T, G, N).to(s),
            chunk_size=cfg.mamba_chunk_size, D=self.w[p + "D"].to(s), dt_bias=self.w[p + "dt_bias"].to(s), z=None,
            cu_seqlens=cu_seqlens, ssm_states=ssm_pool, state_indices=slots, has_initial_state=everyone,
            dt_softplus=True, dt_limit=cfg.time_step_limit,
        ).to(self.dtype)                                                         # (T, H, P)
        y = rms_norm_gated_ref(y.reshape(T, H * P), z, self.w[p + "norm.weight"], eps=cfg.rms_norm_eps,
                               group_size=self.norm_group_size, norm_before_gate=False)
        for b, s in enumerate(new_states):
            s.conv[i], s.ssm[i] = conv_pool[b], ssm_pool[b]
        return F.linear(y, self.w[p + "out_proj.weight"], self.w.get(p + "out_proj.bias"))

    def _attention(self, i, x, cu_seqlens, states, new_states) -> torch.Tensor:
        cfg, p = self.cfg, f"model.layers.{i}.self_attn."
        Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attn_head_dim
        q = F.linear(x, self.w[p + "q_proj.weight"], self.w.get(p + "q_proj.bias")).reshape(-1, Hq, Dh)
        k = F.linear(x, self.w[p + "k_proj.weight"], self.w.get(p + "k_proj.bias")).reshape(-1, Hkv, Dh)
        v = F.linear(x, self.w[p + "v_proj.weight"], self.w.get(p + "v_proj.bias")).reshape(-1, Hkv, Dh)
        out = torch.empty_like(q)                                                # (T, Hq, Dh)
        for b, (state, new) in enumerate(zip(states, new_states)):
            start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            positions = torch.arange(state.length, state.length + end - start, device=self.device)
            q_b, k_b = q[start:end], k[start:end]
            if cfg.rope:                                                        # NoPE: positions enter nowhere
                q_b = rotary_ref(q_b, positions, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
                k_b = rotary_ref(k_b, positions, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
            new.keys[i] = torch.cat([state.keys[i], k_b])                         # (L, Hkv, Dh)
            new.values[i] = torch.cat([state.values[i], v[start:end]])
            out[start:end] = gqa_attention_ref(q_b, new.keys[i], new.values[i], scale=cfg.attention_scale)
        return F.linear(out.reshape(-1, Hq * Dh), self.w[p + "o_proj.weight"], self.w.get(p + "o_proj.bias"))

    def _mlp(self, i, x) -> torch.Tensor:
        p = f"model.layers.{i}.feed_forward."
        w = self.w
        return swiglu_ref(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"],
                          w.get(p + "gate_proj.bias"), w.get(p + "up_proj.bias"), w.get(p + "down_proj.bias"))

    def _granite_ffn(self, i, x) -> torch.Tensor:
        """GraniteMoeHybrid's feed-forward: the shared SwiGLU, plus the routed experts when there are any."""
        p = f"model.layers.{i}."
        gate, up = self.w[p + "shared_mlp.input_linear.weight"].chunk(2)           # gate rows first
        out = swiglu_ref(x, gate, up, self.w[p + "shared_mlp.output_linear.weight"])
        if self.cfg.num_local_experts:
            out = out + moe_ref(x, self.w[p + "block_sparse_moe.router.layer.weight"],
                                self.w[p + "block_sparse_moe.input_linear.weight"],
                                self.w[p + "block_sparse_moe.output_linear.weight"], top_k=self.cfg.num_experts_per_tok,
                                swap=self.route_swaps.get(i),
                                record=None if self.router_record is None else self.router_record.setdefault(i, []))
        return out

    # ---- conveniences built on forward --------------------------------------------------------------------
    def prompt_logprobs(self, token_ids) -> torch.Tensor:
        """log p(token_t | tokens_<t) for t = 1..T-1 (teacher forcing), shape (T-1,)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        logits, _ = self.forward(ids)
        logprobs = torch.log_softmax(logits[:-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        return logprobs.gather(1, ids[1:, None].to(self.device))[:, 0]

    def greedy(self, token_ids, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation: the new token ids and the full log-softmax at each step, (max_new_tokens, V)."""
        logits, state = self.forward(token_ids)
        last = logits[-1]
        tokens, steps = [], []
        for step in range(max_new_tokens):
            logprobs = torch.log_softmax(last.to(torch.promote_types(last.dtype, torch.float32)), dim=-1)
            token = int(logprobs.argmax())
            tokens.append(token)
            steps.append(logprobs)
            if step + 1 < max_new_tokens:
                logits, state = self.forward(torch.tensor([token]), state)
                last = logits[-1]
        return tokens, torch.stack(steps) if steps else torch.empty(0, self.cfg.vocab_size)


def _converted(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stored weight on the model's device in the model's dtype: moved as stored, then converted there. One
    `tensor.to(device=, dtype=)` would convert on the CPU before the copy (torch does so for a host-to-device copy
    that changes the dtype), writing and copying four times the bytes of a bf16 checkpoint for an fp64 model, once
    per layer per call when streamed. Resident and streamed weights both come through here, so they hold the same
    bits."""
    return weight.to(device=device).to(dtype=dtype)


HOST_COPY_SHARE = 0.5      # of the host memory available when a streamed model opens


def host_copies_fit(nbytes: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether a streamed model on a GPU keeps page-locked host copies of its stored weights (LazyWeights'
    host_copies): when they take at most HOST_COPY_SHARE of the host memory available now (MemAvailable; never
    where it cannot be read)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return False
    return nbytes <= HOST_COPY_SHARE * available


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


class _Resident(dict):
    """Every weight converted once and held (BambaReference's default)."""

    @property
    def peak_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.values()}.values())

    def scope(self, keys):
        return contextlib.nullcontext()


class _Streamed:
    """The weights of the scope being computed, read from a LazyWeights and converted as the resident model converts
    them (`_converted`), freed when the scope ends. Asking for a weight outside its scope is a
    KeyError that says so: the forward pass must name what each part reads."""

    def __init__(self, store: LazyWeights, dtype: torch.dtype, device: torch.device) -> None:
        self.store, self.dtype, self.device = store, dtype, device
        self._held: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0

    @contextlib.contextmanager
    def scope(self, keys):
        self._held = {k: _converted(self.store.load(k), self.device, self.dtype) for k in keys}
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in self._held.values()))
        try:
            yield
        finally:
            self._held = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._held:
            raise KeyError(f"{key}: not among the weights loaded for the part being computed (streamed oracle)")
        return self._held[key]

    def get(self, key: str, default=None):
        return self[key] if key in self.store else default
