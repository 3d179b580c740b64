"""One interface for every engine: requests in, teacher-forced prompt logprobs and continuations out (greedy, or
sampled where a request gives a temperature and the engine can sample).

An engine is built from (checkpoint directory, dtype, device, `EngineOptions`), used as a context manager that frees
its model on exit, and driven by `run(requests)`. The options are the knobs a scenario turns (docs/design.md §3). An
adapter that cannot honour an option lists the reason in `unsupported(...)`; constructing it with such an option
raises `UnsupportedOptions`, so an option is never silently ignored.

Positions: a request's tokens are numbered 0..T-1 (prompt) then T..T+n-1 (generated). Row i of every per-position
array below is the prediction of the token at position i+1, so the prompt rows cover positions 1..T-1 and the output
rows positions T..T+n-1. Shape letters: T prompt tokens, n generated tokens, V vocabulary, K top-k.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from reference.config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "fp64": torch.float64,
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; anything else is a ValueError listing the choices."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
FLAG_VALUES = _ON + _OFF


def engine_flag(value) -> bool | None:
    """An on/off engine arg (`--engine-arg KEY=VALUE` gives a string; code may pass a bool or 0/1): True, False, or
    None when it is neither."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in _ON else False if text in _OFF else None


class EngineInputError(ValueError):
    """A request no engine can process: empty prompt, token id outside the vocabulary, position past the limit."""


class UnsupportedOptions(RuntimeError):
    """An engine was asked for options it cannot honour; `reasons` says which and why."""

    def __init__(self, engine: str, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        super().__init__(f"{engine}: " + "; ".join(self.reasons))


@dataclass(frozen=True)
class Request:
    """One request. prompt: token ids (T,); top_k: alternatives returned per position (prompt and output);
    arrival_step: the engine step from which a scheduler may admit it (engines without steps refuse values > 0);
    full_distributions: also return every position's full log-softmax (engines that cannot leave them None);
    temperature: 0 decodes greedily, > 0 samples each new token at that temperature with `seed` (engines that cannot
    sample refuse it); the logprobs returned are always the model's own (untempered) ones."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int = 0
    top_k: int = 5
    arrival_step: int = 0
    full_distributions: bool = False
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise EngineInputError(f"request {self.request_id!r}: temperature = {t!r}, expected a finite "
                                   "number >= 0")

    @property
    def samples(self) -> bool:
        """Whether its continuation is sampled (it has tokens to generate and a temperature above 0)."""
        return self.temperature > 0 and self.max_new_tokens > 0

    def teacher_forced(self, continuation: Sequence[int]) -> "Request":
        """The same request with `continuation` appended to the prompt and nothing to generate."""
        return Request(self.request_id, self.prompt + tuple(continuation), 0, self.top_k, 0, self.full_distributions)


@dataclass
class RequestResult:
    """What an engine returns for one request (all tensors on the CPU, logprobs in float64).

    prompt_logprobs (T-1,): log p(prompt[t] | prompt[:t]) for t = 1..T-1.
    prompt_top_ids, prompt_top_logprobs (T-1, K): the K most likely tokens at each of those positions.
    output_ids (n,): greedy tokens; output_logprobs (n,) their logprobs; output_top_* (n, K).
    prompt_dists (T-1, V), output_dists (n, V): full log-softmax rows when the request asked and the engine can.
    output_near_ids, output_near_logprobs (n, N): the N most likely tokens at each generated position, N much larger
    than K, where an engine provides them (the oracle does: NEAR_TIE_K), so that a judge can look up its logprob of
    a different greedy token a candidate chose without whole rows.
    """

    request_id: str
    prompt_logprobs: torch.Tensor
    prompt_top_ids: torch.Tensor
    prompt_top_logprobs: torch.Tensor
    output_ids: list[int]
    output_logprobs: torch.Tensor
    output_top_ids: torch.Tensor
    output_top_logprobs: torch.Tensor
    prompt_dists: torch.Tensor | None = None
    output_dists: torch.Tensor | None = None
    output_near_ids: torch.Tensor | None = None
    output_near_logprobs: torch.Tensor | None = None

    def sequence_logprobs(self) -> torch.Tensor:
        """Logprobs of positions 1..T+n-1: prompt then output, (T-1+n,)."""
        return torch.cat([self.prompt_logprobs, self.output_logprobs])


@dataclass
class RowSummary:
    """What a result keeps of n log-softmax rows, on the host in float64: each row's logprob of its target token
    (n,), its top-k ids (n, k) and logprobs (n, k), and the whole rows (n, V) only when they were asked for."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor
    dists: torch.Tensor | None = None

    @classmethod
    def join(cls, parts: Sequence["RowSummary"], order: Sequence[int] | None = None) -> "RowSummary":
        """The parts' rows one after another, then (if given) taken in `order` (indices into the joined rows)."""
        joined = cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("chosen", "top_ids", "top_values")),
                     torch.cat([p.dists for p in parts]) if parts and all(p.dists is not None for p in parts) else None)
        if order is None:
            return joined
        index = torch.as_tensor(list(order), dtype=torch.long)
        return cls(joined.chosen[index], joined.top_ids[index], joined.top_values[index],
                   None if joined.dists is None else joined.dists[index])


def summarise_rows(rows: torch.Tensor, targets: Sequence[int], top_k: int, *, full: bool) -> RowSummary:
    """Reduce log-softmax rows (n, V) where they are (a GPU's rows of a 128K vocabulary stay there): the logprob of
    targets[i] in row i and each row's top-k (ties: lower token id first, top_k_lower_index); only what the
    summary holds comes to the host, in float64 (exact for float32 and 16-bit rows), whole rows only if `full`."""
    rows = rows.detach()
    if rows.device.type == "cpu":
        rows = rows.double()
    if rows.shape[0] != len(targets):
        raise ValueError(f"{rows.shape[0]} logprob rows for {len(targets)} target tokens")
    host = dict(device="cpu", dtype=torch.float64)
    index = torch.tensor([int(t) for t in targets], dtype=torch.long, device=rows.device)
    chosen = rows.gather(1, index[:, None])[:, 0].to(**host)
    top_values, top_ids = top_k_lower_index(rows, min(top_k, rows.shape[1]))
    return RowSummary(chosen, top_ids.cpu(), top_values.to(**host), rows.to(**host) if full else None)


def top_k_lower_index(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of each row's k largest entries, largest first, equal values in ascending id order.

    torch.topk does not fix the order of equal values, and on a GPU which of several equal values is kept at the
    k-th place can vary between runs; a result must not. The k + 1 largest are found with topk; rows whose k-th and
    (k+1)-th values are equal are ranked by a full stable sort; the k kept are put in (value desc, id asc) order."""
    n, width = rows.shape
    if k >= width:
        ranked = rows.sort(dim=-1, descending=True, stable=True)
        return ranked.values, ranked.indices
    values, ids = rows.topk(k + 1, dim=-1)
    tied = (values[:, k] == values[:, k - 1]) if k else torch.zeros(n, dtype=torch.bool, device=rows.device)
    values, ids = values[:, :k], ids[:, :k]
    by_id = ids.sort(dim=-1, stable=True).indices                  # secondary key first: ids ascending ...
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.sort(dim=-1, descending=True, stable=True).indices      # ... then values descending, stably
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    redo = tied.nonzero()[:, 0]
    if len(redo):
        ranked = rows[redo].sort(dim=-1, descending=True, stable=True)
        values[redo], ids[redo] = ranked.values[:, :k], ranked.indices[:, :k]
    return values, ids


def result_from_summary(request: Request, summary: RowSummary, output_ids: Sequence[int]) -> RequestResult:
    """A RequestResult from the summary of rows 0..T-2+n (row i predicts the token at position i+1: prompt tokens
    1..T-1, then the n outputs)."""
    n_prompt = len(request.prompt) - 1
    output_ids = [int(t) for t in output_ids]
    if len(summary.chosen) != n_prompt + len(output_ids):
        raise ValueError(f"request {request.request_id!r}: {len(summary.chosen)} logprob rows, expected "
                         f"{n_prompt} prompt + {len(output_ids)} output rows")
    dists = summary.dists
    return RequestResult(
        request_id=request.request_id,
        prompt_logprobs=summary.chosen[:n_prompt],
        prompt_top_ids=summary.top_ids[:n_prompt],
        prompt_top_logprobs=summary.top_values[:n_prompt],
        output_ids=output_ids,
        output_logprobs=summary.chosen[n_prompt:],
        output_top_ids=summary.top_ids[n_prompt:],
        output_top_logprobs=summary.top_values[n_prompt:],
        prompt_dists=dists[:n_prompt] if dists is not None else None,
        output_dists=dists[n_prompt:] if dists is not None else None,
    )


def result_from_logprobs(request: Request, logprobs: torch.Tensor, output_ids: Sequence[int]) -> RequestResult:
    """Build a RequestResult from an engine's log-softmax rows.

    logprobs (T-1+n, V): row i predicts the token at position i+1 (prompt tokens 1..T-1, then the n outputs).
    Reduced where the rows are (summarise_rows); the whole rows come to the host only when the request asked for
    full distributions.
    """
    n_prompt = len(request.prompt) - 1
    output_ids = [int(t) for t in output_ids]
    if logprobs.shape[0] != n_prompt + len(output_ids):
        raise ValueError(f"request {request.request_id!r}: {logprobs.shape[0]} logprob rows, expected "
                         f"{n_prompt} prompt + {len(output_ids)} output rows")
    targets = list(request.prompt[1:]) + output_ids
    return result_from_summary(request, summarise_rows(logprobs, targets, request.top_k,
                                                       full=request.full_distributions), output_ids)


def result_from_top(request: Request, chosen: Sequence[float], top: Sequence[Sequence[tuple[int, float]]],
                    output_ids: Sequence[int]) -> RequestResult:
    """Build a RequestResult from per-position lists: chosen[i] the logprob of the token at position i+1 (prompt
    tokens 1..T-1, then the n outputs), top[i] its (token, logprob) alternatives, most likely first, at least
    request.top_k of them. ValueError when the lengths disagree."""
    n_prompt, k = len(request.prompt) - 1, request.top_k
    output_ids = [int(t) for t in output_ids]
    n_rows = n_prompt + len(output_ids)
    if len(chosen) != n_rows or len(top) != n_rows:
        raise ValueError(f"request {request.request_id!r}: {len(chosen)} logprobs and {len(top)} top-k lists, "
                         f"expected {n_prompt} prompt + {len(output_ids)} output positions")
    short = [i for i, entry in enumerate(top) if len(entry) < k]
    if short:
        raise ValueError(f"request {request.request_id!r}: {len(top[short[0]])} alternatives at position "
                         f"{short[0] + 1}, expected top_k = {k}")
    chosen_t = torch.tensor([float(x) for x in chosen], dtype=torch.float64)
    ids = torch.tensor([[int(t) for t, _ in entry[:k]] for entry in top], dtype=torch.long).reshape(n_rows, k)
    values = torch.tensor([[float(v) for _, v in entry[:k]] for entry in top], dtype=torch.float64).reshape(n_rows, k)
    return RequestResult(request.request_id, chosen_t[:n_prompt], ids[:n_prompt], values[:n_prompt], output_ids,
                         chosen_t[n_prompt:], ids[n_prompt:], values[n_prompt:])


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax in at least fp32, as engines compute sampling logprobs from low-precision logits."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


@dataclass(frozen=True)
class EngineOptions:
    """The configuration knobs scenarios turn (docs/design.md §3). None / 1 / False are "the engine's plain default".

    max_num_batched_tokens: token budget of one engine step (prefill pieces and decodes together): chunked prefill.
    long_prefill_token_threshold: the most tokens one request's prefill piece takes in a step (vLLM's knob), so that
    several prompts advance, each continuing from its saved state, in one step. num_kv_blocks, kv_block_size: the
    K/V cache's capacity in blocks of that many tokens (a small cache forces preemption and recomputation).
    max_num_seqs: requests in flight at once. ssm_state_dtype: dtype the SSM state is stored in between steps.
    allow_long_context: accept positions past max_position_embeddings. engine_args: adapter-specific settings
    (an adapter that does not know a key reports it as unsupported).
    Request order is not an option: it is part of the workload (a scenario shuffles its requests).
    """

    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    num_kv_blocks: int | None = None
    kv_block_size: int | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    cuda_graphs: bool = False
    ssm_state_dtype: str | None = None
    allow_long_context: bool = False
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "long_prefill_token_threshold", "num_kv_blocks", "kv_block_size",
                     "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        if self.ssm_state_dtype is not None:
            parse_dtype(self.ssm_state_dtype)

    def non_default(self) -> dict[str, Any]:
        """The options that differ from the defaults, by name."""
        default = EngineOptions()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def check_requests(requests: Sequence[Request], cfg: ModelConfig, *, allow_long_context: bool) -> None:
    """Raise EngineInputError naming the request (and position) of the first request no engine can process."""
    seen: set[str] = set()
    for req in requests:
        rid = req.request_id
        if rid in seen:
            raise EngineInputError(f"request {rid!r}: duplicate request_id")
        seen.add(rid)
        if not req.prompt:
            raise EngineInputError(f"request {rid!r}: empty prompt (at least one token is needed)")
        for pos, token in enumerate(req.prompt):
            if not 0 <= token < cfg.vocab_size:
                raise EngineInputError(f"request {rid!r}: token id {token} at position {pos} is outside the "
                                       f"vocabulary [0, {cfg.vocab_size})")
        if req.max_new_tokens < 0 or req.top_k < 1 or req.arrival_step < 0:
            raise EngineInputError(f"request {rid!r}: max_new_tokens = {req.max_new_tokens}, top_k = {req.top_k}, "
                                   f"arrival_step = {req.arrival_step}; expected >= 0, >= 1, >= 0")
        # The last generated token is returned, never fed back, so it needs no position of its own.
        last = len(req.prompt) - 1 + max(req.max_new_tokens - 1, 0)
        if last >= cfg.max_position_embeddings and not allow_long_context:
            raise EngineInputError(
                f"request {rid!r}: position {last} (prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new) "
                f"exceeds max_position_embeddings = {cfg.max_position_embeddings}; set "
                "EngineOptions(allow_long_context=True) to go beyond")


class Engine(abc.ABC):
    """Base of every adapter. Subclasses set `name`, `default_dtype`, `engine_arg_names`, `has_scheduler` and
    implement `_load`, `_run` and `_unsupported` (and `dependency_problem` where a package may be missing); they free
    their model in `close`."""

    name: ClassVar[str]
    default_dtype: ClassVar[torch.dtype] = torch.float32
    engine_arg_names: ClassVar[frozenset[str]] = frozenset()
    has_scheduler: ClassVar[bool] = False
    # True for engines that take many seconds per scenario without a GPU (Triton interpreter): their pytest cases
    # are marked slow on machines without CUDA.
    slow_on_cpu: ClassVar[bool] = False
    # True for engines that drive something outside this process (another virtualenv, a server): pytest runs their
    # cases only when named with --engine, never as part of "every available engine".
    opt_in: ClassVar[bool] = False
    # The SSM state dtype the engine keeps when options.ssm_state_dtype is None; None: its run dtype. The excess
    # test's noise floor keeps the reference's state so (harness/compare.py).
    default_ssm_state_dtype: ClassVar[str | None] = None
    # The model families (config.json model_type) the engine serves; a checkpoint of another is refused at once.
    families: ClassVar[tuple[str, ...]] = ("bamba",)
    # True for engines that sample a request with a temperature (seeded); the others refuse such requests.
    samples: ClassVar[bool] = False
    # How the engine's batch-invariant mode is turned on, in one line ("--engine-arg batch_invariant=1"), for an
    # engine that promises bit-identical results for a request whatever shares its batch, however its prefill is
    # chunked and after a preemption; None: it promises nothing, and the opt-in `invariance` scenario skips it
    # unless an engine arg `batch_invariant` is given (harness/runner.py, check_invariance).
    batch_invariance: ClassVar[str | None] = None

    def __init__(self, checkpoint: str | Path, *, dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu", options: EngineOptions | None = None) -> None:
        self.checkpoint = Path(checkpoint)
        if not self.checkpoint.is_dir():
            raise FileNotFoundError(f"{self.checkpoint}: checkpoint directory does not exist")
        self.cfg = ModelConfig.from_json(self.checkpoint)
        if self.cfg.model_type not in self.families:
            raise UnsupportedOptions(self.name, [f"model_type {self.cfg.model_type!r}: {self.name} serves "
                                                 f"{' and '.join(self.families)} checkpoints only"])
        self.dtype = parse_dtype(dtype) if dtype is not None else self.default_dtype
        self.device = torch.device(device)
        self.options = options or EngineOptions()
        reasons = self.unsupported(self.options, dtype=self.dtype, device=self.device)
        if reasons:
            raise UnsupportedOptions(self.name, reasons)
        self._load()

    @classmethod
    def dependency_problem(cls) -> str | None:
        """Why this engine cannot run on this machine at all (a missing package), or None."""
        return None

    @classmethod
    def engine_scenarios(cls, cfg: ModelConfig) -> list:
        """Scenarios of this engine's own knobs (harness.scenarios.Scenario, their options' engine_args set), added
        to the common matrix for this engine; [] for most."""
        return []

    @classmethod
    def unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: str | torch.device,
                    requests: Iterable[Request] = ()) -> list[str]:
        """Why this engine cannot honour `options` (and the requests' arrival steps) on dtype/device; [] if it can."""
        device = torch.device(device)
        reasons = []
        if device.type == "cuda" and not torch.cuda.is_available():
            reasons.append("device cuda: no CUDA device on this machine")
        unknown = sorted(set(options.engine_args) - cls.engine_arg_names)
        if unknown:
            known = ", ".join(sorted(cls.engine_arg_names)) or "none"
            reasons.append(f"engine_args {unknown}: unknown to {cls.name} (it knows: {known})")
        requests = list(requests)
        staggered = [r.request_id for r in requests if r.arrival_step > 0]
        if staggered and not cls.has_scheduler:
            reasons.append(f"arrival_step > 0 for requests {staggered[:4]}: {cls.name} has no scheduler steps")
        sampled = [r.request_id for r in requests if r.samples]
        if sampled and not cls.samples:
            reasons.append(f"temperature > 0 for requests {sampled[:4]}: {cls.name} decodes greedily only")
        return reasons + cls._unsupported(options, dtype=dtype, device=device)

    @classmethod
    @abc.abstractmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        """The adapter's own reasons (options it cannot honour)."""

    @abc.abstractmethod
    def _load(self) -> None:
        """Build the model on self.device in self.dtype with self.options."""

    @abc.abstractmethod
    def _run(self, requests: list[Request]) -> list[RequestResult]:
        """Decode the (already checked) requests, greedily or as each samples; results in the order of `requests`."""

    def run(self, requests: Sequence[Request]) -> list[RequestResult]:
        """Teacher-forced prompt logprobs and continuations, one result per request, in request order."""
        requests = list(requests)
        check_requests(requests, self.cfg, allow_long_context=self.options.allow_long_context)
        reasons = self.unsupported(self.options, dtype=self.dtype, device=self.device, requests=requests)
        reasons += self.cannot_run(requests)
        if reasons:
            raise UnsupportedOptions(self.name, reasons)
        return self._run(requests) if requests else []

    def cannot_run(self, requests: Sequence[Request]) -> list[str]:
        """Why this loaded engine cannot run these requests (say, a prompt too long for the memory its algorithm
        needs), beyond the options; [] if it can."""
        return []

    def provenance(self) -> dict:
        """What a report should record of this engine beyond the harness's own versions (the build and the files it
        ran, the settings it settled on); {} where there is nothing more."""
        return {}

    def close(self) -> None:
        """Free the model (subclasses drop their references and call super().close())."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
