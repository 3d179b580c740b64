"""The vendored engine (vendored/engine on the kernels of vendored/ops) as a harness engine.

Honours max_num_batched_tokens, long_prefill_token_threshold, max_num_seqs, num_kv_blocks and kv_block_size (a small
K/V cache forces preemption), ssm_state_dtype, allow_long_context, cuda_graphs (on a CUDA device: decode-only steps
padded to captured sizes and replayed), tensor_parallel_size, pipeline_parallel_size (worker processes: gloo on the
CPU, one CUDA device per rank with NCCL) and arrival steps. engine_args: parallel_timeout_s; batch_invariant (1 or 0:
the engine's batch-invariant mode, vendored/engine/invariant.py). The engine is built per run, sized for the longest
request of that run (max_model_len) and with no more state slots than it has requests (default_max_num_seqs), so a
scenario's memory is what its requests need. A model that cannot
be split over the asked ranks (heads not divisible by tp, ...) is reported unsupported; CUDA graphs are for one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engine import (FLAG_VALUES, Engine, EngineOptions, Request, RequestResult, UnsupportedOptions, dtype_name,
                      engine_flag, result_from_logprobs, result_from_top)
from ..schedule import DEFAULT_KV_BLOCK_SIZE

# What the engine does when a scenario leaves a knob at None: no chunking for these prompt sizes, 64 in flight.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 64


def default_max_num_seqs(num_requests: int) -> int:
    """The state slots of a run whose scenario leaves max_num_seqs at None: 64 in flight, but no more slots than the
    run has requests. The schedule is the same (every request of a run of at most 64 is admitted as it arrives), and
    the engine's SSM-state pool and K/V cache, sized by max_num_seqs, hold what the run can use: at Bamba-9B width
    the 64 slots and the padding slot of fp32 state are 7.9 GB, where a run of five requests needs 0.7."""
    return max(1, min(DEFAULT_MAX_NUM_SEQS, num_requests))


class VendoredEngine(Engine):
    name = "vendored"
    default_dtype = torch.float32
    families = ("bamba", "granitemoehybrid")
    engine_arg_names = frozenset({"parallel_timeout_s", "batch_invariant"})
    batch_invariance = "--engine-arg batch_invariant=1"      # how its batch-invariant mode is turned on
    has_scheduler = True
    samples = True                                      # seeded sampling: vendored/engine/sampling.py
    default_ssm_state_dtype = "float32"                 # vendored/engine: the state pool is fp32 unless told
    slow_on_cpu = True          # the Triton interpreter: the generic matrix runs it under `slow`; tests/engine do not
    # Called after every engine step (a progress bar's tick; harness/runner.py sets it); it sees nothing of the step.
    step_callback: Callable[[], None] | None = None

    @classmethod
    def dependency_problem(cls) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as err:
            return f"triton is not installed ({err})"
        return None

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = []
        ranks = options.tensor_parallel_size * options.pipeline_parallel_size
        if ranks > 1 and device.type == "cuda" and ranks > torch.cuda.device_count():
            reasons.append(f"tensor_parallel_size × pipeline_parallel_size = {ranks}: needs {ranks} CUDA devices, "
                           f"this machine has {torch.cuda.device_count()}")
        if options.cuda_graphs and ranks > 1:
            reasons.append(f"cuda_graphs with {ranks} ranks: decode graphs are captured for a single rank")
        if options.cuda_graphs and device.type != "cuda":
            reasons.append(f"cuda_graphs on {device.type}: nothing to capture without a CUDA device (the engine's "
                           "padded graph step runs eagerly there: tests/engine/test_cudagraph.py)")
        invariant = options.engine_args.get("batch_invariant", False)
        if engine_flag(invariant) is None:
            reasons.append(f"batch_invariant: expected one of {', '.join(FLAG_VALUES)}, got {invariant!r}")
        elif engine_flag(invariant) and ranks > 1:
            reasons.append(f"batch_invariant with {ranks} ranks: the engine's batch-invariant mode runs on one rank")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype {dtype_name(dtype)}: the kernels run float32, bfloat16 or float16")
        elif device.type == "cpu" and dtype != torch.float32:
            reasons.append(f"dtype {dtype_name(dtype)} on cpu: the Triton interpreter runs float32 only")
        return reasons

    def _load(self) -> None:
        from vendored.engine import LLMEngine
        from vendored.engine.sharding import parallel_problems
        from vendored.engine.weights import read_config

        opts = self.options
        problems = parallel_problems(read_config(self.checkpoint), self.cfg.intermediate_size,
                                     opts.tensor_parallel_size, opts.pipeline_parallel_size)
        if problems:
            raise UnsupportedOptions(self.name, problems)
        self._engine_class = LLMEngine
        self.engine = None

    def _build(self, max_model_len: int, num_requests: int):
        opts = self.options
        return self._engine_class(
            self.checkpoint, dtype=dtype_name(self.dtype), device=self.device,
            max_num_batched_tokens=opts.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=opts.max_num_seqs or default_max_num_seqs(num_requests), max_model_len=max_model_len,
            num_kv_blocks=opts.num_kv_blocks, block_size=opts.kv_block_size or DEFAULT_KV_BLOCK_SIZE,
            long_prefill_token_threshold=opts.long_prefill_token_threshold,
            ssm_state_dtype=opts.ssm_state_dtype or "float32", allow_long_context=opts.allow_long_context,
            cuda_graphs=opts.cuda_graphs,
            tensor_parallel_size=opts.tensor_parallel_size, pipeline_parallel_size=opts.pipeline_parallel_size,
            parallel_timeout_s=float(opts.engine_args.get("parallel_timeout_s", 600.0)),
            batch_invariant=bool(engine_flag(opts.engine_args.get("batch_invariant", False))))

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        self._close_engine()
        self.engine = self._build(max(len(r.prompt) + r.max_new_tokens for r in requests), len(requests))
        if self.step_callback is not None:
            self.engine.step = _counted(self.engine.step, self.step_callback)
        from vendored.engine import SamplingParams

        def entry(r: Request) -> tuple:
            return (r.request_id, list(r.prompt), r.max_new_tokens,
                    SamplingParams(r.temperature, r.seed) if r.samples else None)

        now = [entry(r) for r in requests if r.arrival_step == 0]
        later: dict[int, list] = {}
        for r in requests:
            if r.arrival_step > 0:
                later.setdefault(r.arrival_step, []).append(entry(r))
        top_k = max(r.top_k for r in requests)
        # Full rows only when a request wants its distributions; otherwise the engine returns the top-k of every
        # position, computed on its device (a GPU's rows of a 128K vocabulary never come to the host).
        full = any(r.full_distributions for r in requests)
        outputs = {o.request_id: o for o in self.engine.generate(now, arrivals=later, top_k=top_k, keep_rows=full,
                                                                   prompt_top=not full)}
        results = []
        for r in requests:
            out = outputs[r.request_id]
            if full:
                rows = out.rows if out.rows is not None else torch.empty(0, self.cfg.vocab_size)  # a 1-token prompt
                results.append(result_from_logprobs(r, rows, out.output_ids))
            else:
                results.append(result_from_top(r, out.prompt_logprobs + out.output_logprobs,
                                               out.prompt_top + out.output_top, out.output_ids))
        return results

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()             # joins a parallel engine's workers; frees the weights and caches
            self.engine.__dict__.pop("step", None)      # the step counter's closure: a cycle back to the engine
            self.engine = None

    def close(self) -> None:
        self._close_engine()
        super().close()


def _counted(step: Callable[[], list], tick: Callable[[], None]) -> Callable[[], list]:
    """`step` that calls `tick` after each step it runs (LLMEngine.generate drives its loop through self.step)."""
    def counted_step() -> list:
        outputs = step()
        tick()
        return outputs
    return counted_step
