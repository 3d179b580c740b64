"""transformers' BambaForCausalLM as an engine (its PyTorch path: no mamba_ssm / causal_conv1d kernels here).

Requests are run in groups of up to max_num_seqs (all at once by default) as one left-padded batch: the attention
mask zeroes the padding's mamba inputs and hides it from attention, and position ids count real tokens only. One
forward over the padded prompts gives the teacher-forced prompt logprobs and the first greedy token; each later
token is one decode step with the model's cache.

It cannot honour a prefill token budget, tensor/pipeline parallelism, CUDA graphs or an SSM state dtype, and it has
no scheduler steps: unsupported() says so. Numerics finding: its gated RMSNorm normalises over all H·P channels,
where Bamba (and the oracle) normalise per group of H·P/G, so it disagrees with the oracle whenever G > 1.
"""

from __future__ import annotations

import torch

from ..engine import Engine, EngineOptions, Request, RequestResult, log_softmax, result_from_logprobs


class TransformersEngine(Engine):
    name = "transformers"
    default_dtype = torch.float32

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
        if options.max_num_batched_tokens is not None:
            reasons.append(f"max_num_batched_tokens = {options.max_num_batched_tokens}: transformers prefills each "
                           "prompt in one forward (no chunked prefill)")
        if options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1:
            reasons.append(f"tensor_parallel_size = {options.tensor_parallel_size}, pipeline_parallel_size = "
                           f"{options.pipeline_parallel_size}: the adapter runs on one device")
        if options.cuda_graphs:
            reasons.append("cuda_graphs: the adapter runs eagerly")
        if options.ssm_state_dtype is not None:
            reasons.append(f"ssm_state_dtype = {options.ssm_state_dtype}: transformers keeps the SSM state in its "
                           "own dtype")
        return reasons

    def _load(self) -> None:
        from transformers import BambaForCausalLM

        self.model = BambaForCausalLM.from_pretrained(self.checkpoint, dtype=self.dtype).to(self.device).eval()

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
