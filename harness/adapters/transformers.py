"""transformers' BambaForCausalLM (and GraniteMoeHybridForCausalLM, by the checkpoint's model_type) as an engine (its
PyTorch path: no mamba_ssm / causal_conv1d kernels here).

Requests are run in groups of up to max_num_seqs (all at once by default) as one left-padded batch: the attention
mask zeroes the padding's mamba inputs and hides it from attention, and position ids count real tokens only. One
forward over the padded prompts gives the teacher-forced prompt logprobs and the first greedy token; each later
token is one decode step with the model's cache.

It cannot honour a prefill token budget, tensor/pipeline parallelism, CUDA graphs or an SSM state dtype, and it has
no scheduler steps: unsupported() says so. A pure-Mamba2 checkpoint (no attention layer) is unsupported too:
transformers cannot build the attention mask from a cache without attention layers (a pinned finding,
tests/reference/test_against_transformers.py), and every forward here uses the cache.

Numerics finding: its gated RMSNorm normalises over all H·P channels, where Bamba (and the default oracle) normalise
per group of H·P/G, so it disagrees with that oracle whenever G > 1 and agrees with the oracle made with
--gated-norm full (Oracle(gated_norm="full")). Loading such a checkpoint logs that once (gated_norm_note), and
oracle_hint gives the line for a report judged against a grouped oracle. Its GraniteMoeHybrid also rotates the whole
attention head whatever rope_parameters.partial_rotary_factor says (the oracle and vLLM honour the factor), and for
both families its cached decode step does not clamp Δ to time_step_limit: two more known causes of a FAIL that
oracle_hint names.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from reference.config import ModelConfig

from ..engine import (Engine, EngineOptions, Request, RequestResult, UnsupportedOptions, log_softmax,
                      result_from_logprobs)

log = logging.getLogger(__name__)
# Checkpoints whose gated-norm note was logged already: one line per checkpoint and process, not one per scenario.
_noted: set[Path] = set()


def gated_norm_note(cfg: ModelConfig) -> str | None:
    """The one-line note for a checkpoint with G > 1 (None for G = 1, where both norms are the same)."""
    G = cfg.mamba_n_groups
    if G == 1:
        return None
    return (f"transformers normalises the gated RMSNorm over all H·P = {cfg.mamba_inner} channels, Bamba per group "
            f"of H·P/G = {cfg.mamba_inner // G}: with mamba_n_groups = {G} it agrees only with the oracle made with "
            "--gated-norm full (Oracle(gated_norm=\"full\")), not with the default grouped one")


def rotary_note(cfg: ModelConfig) -> str | None:
    """The note for a GraniteMoeHybrid checkpoint with RoPE on part of the head (None otherwise)."""
    if not (cfg.granite and cfg.rope and cfg.partial_rotary_factor != 1.0):
        return None
    return (f"transformers' GraniteMoeHybrid rotates all {cfg.attn_head_dim} dims of each attention head, whatever "
            f"partial_rotary_factor = {cfg.partial_rotary_factor} says (the oracle and vLLM rotate "
            f"{cfg.rotary_dim})")


def dt_limit_note(cfg: ModelConfig) -> str | None:
    """The note for a checkpoint whose time_step_limit clamps Δ (None when it is (0, inf))."""
    lo, hi = cfg.time_step_limit
    if lo == 0.0 and hi == float("inf"):
        return None
    return (f"transformers' cached one-token decode does not clamp Δ to time_step_limit = ({lo}, {hi}) (its prefill "
            "does): generated positions differ from the oracle's")


class TransformersEngine(Engine):
    name = "transformers"
    default_dtype = torch.float32
    families = ("bamba", "granitemoehybrid")

    @classmethod
    def dependency_problem(cls) -> str | None:
        try:
            from transformers import BambaForCausalLM  # noqa: F401
        except ImportError as err:
            return f"transformers with Bamba support is not installed ({err})"
        return None

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = []
        for knob in ("max_num_batched_tokens", "long_prefill_token_threshold"):
            if getattr(options, knob) is not None:
                reasons.append(f"{knob} = {getattr(options, knob)}: transformers prefills each prompt in one forward "
                               "(no chunked prefill)")
        for knob in ("num_kv_blocks", "kv_block_size"):
            if getattr(options, knob) is not None:
                reasons.append(f"{knob} = {getattr(options, knob)}: transformers has no paged K/V cache (no "
                               "preemption)")
        if options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1:
            reasons.append(f"tensor_parallel_size = {options.tensor_parallel_size}, pipeline_parallel_size = "
                           f"{options.pipeline_parallel_size}: the adapter runs on one device")
        if options.cuda_graphs:
            reasons.append("cuda_graphs: the adapter runs eagerly")
        if options.ssm_state_dtype is not None:
            reasons.append(f"ssm_state_dtype = {options.ssm_state_dtype}: transformers keeps the SSM state in its "
                           "own dtype")
        return reasons

    @classmethod
    def oracle_hint(cls, cfg: ModelConfig, oracle_gated_norm: str) -> str | None:
        """Why this engine fails against an oracle with this gated norm, when it is known to (None otherwise): for a
        report's meta, so that a FAIL of every scenario says what to change."""
        notes = [gated_norm_note(cfg) if oracle_gated_norm == "grouped" else None, rotary_note(cfg),
                 dt_limit_note(cfg)]
        return "; ".join(n for n in notes if n) or None

    def _load(self) -> None:
        import transformers
        from transformers import BambaForCausalLM, GraniteMoeHybridForCausalLM

        if not self.cfg.attn_layer_indices:
            raise UnsupportedOptions(self.name, [
                f"a pure-Mamba2 checkpoint (attn_layer_indices = []): transformers {transformers.__version__} cannot "
                "build the attention mask from a cache without attention layers (get_seq_length fails), and the "
                "adapter runs every forward with its cache"])
        note = gated_norm_note(self.cfg)
        if note is not None and self.checkpoint.resolve() not in _noted:
            _noted.add(self.checkpoint.resolve())
            log.warning(note)
        model_class = GraniteMoeHybridForCausalLM if self.cfg.granite else BambaForCausalLM
        self.model = model_class.from_pretrained(self.checkpoint, dtype=self.dtype).to(self.device).eval()

    # The largest single tensor the adapter lets transformers' PyTorch SSD path allocate (see cannot_run).
    MAX_TENSOR_BYTES = 16 * 2**30

    def cannot_run(self, requests) -> list[str]:
        # torch_forward multiplies the decay between every pair of chunks into every chunk's state, one tensor of
        # (L/Q + 1)² · H · P · N elements for an L-token prompt (O(L²) memory; the mamba_ssm kernels it would use on
        # a GPU with them installed are not here). Past MAX_TENSOR_BYTES the request is declared unsupported rather
        # than left to run out of memory.
        cfg = self.cfg
        longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=0)
        chunks = -(-longest // cfg.mamba_chunk_size) + 1
        size = chunks ** 2 * cfg.mamba_inner * cfg.mamba_d_state * self.dtype.itemsize
        if size > self.MAX_TENSOR_BYTES:
            return [f"a {longest}-token sequence: transformers' PyTorch SSD path would allocate a {size / 2**30:.0f} GiB "
                    f"tensor ((L/Q + 1)²·H·P·N elements; limit {self.MAX_TENSOR_BYTES / 2**30:.0f} GiB)"]
        return []

    def close(self) -> None:
        self.model = None
        super().close()

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        group = self.options.max_num_seqs or len(requests)
        results = []
        for start in range(0, len(requests), group):
            results += self._run_group(requests[start:start + group])
        return results

    @torch.no_grad()
    def _run_group(self, requests: list[Request]) -> list[RequestResult]:
        lengths = [len(r.prompt) for r in requests]
        width = max(lengths)
        ids = torch.zeros(len(requests), width, dtype=torch.long)                      # (B, L), left-padded
        mask = torch.zeros_like(ids)
        for b, req in enumerate(requests):
            ids[b, width - lengths[b]:] = torch.tensor(req.prompt)
            mask[b, width - lengths[b]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)                                   # (B, L)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        logprobs = log_softmax(out.logits)                                              # (B, L, V)
        rows = [[logprobs[b, width - lengths[b]:]] for b in range(len(requests))]      # (T, V) each
        outputs: list[list[int]] = [[] for _ in requests]
        steps = max(r.max_new_tokens for r in requests)
        last, cache = logprobs[:, -1], out.past_key_values                              # (B, V)
        for step in range(steps):
            tokens = last.argmax(-1)                                                    # (B,)
            for b, req in enumerate(requests):
                if step < req.max_new_tokens:
                    outputs[b].append(int(tokens[b]))
            if step + 1 == steps:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True)
            last, cache = log_softmax(out.logits[:, -1]), out.past_key_values
            for b in range(len(requests)):
                rows[b].append(last[b:b + 1])
        results = []
        for req, req_rows, out_ids in zip(requests, rows, outputs):
            keep = len(req.prompt) - 1 + len(out_ids)
            results.append(result_from_logprobs(req, torch.cat(req_rows)[:keep], out_ids))
        return results
