"""Running a scenario end to end: the oracle's results, the budget's calibration, the candidate, the comparison.

`Oracle` holds the fp64 reference of one checkpoint (and the reference in lower dtypes, for the budget) and memoises
results per request, so scenarios that share requests pay for the oracle once. `check_scenario` judges an engine
against the oracle; `check_relative` judges one engine configuration against another of the same engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from .adapters import get_engine
from .adapters.reference import ReferenceEngine
from .compare import ATOL, DEFAULT_K, Budget, Report, compare_runs
from .engine import Engine, EngineOptions, Request, RequestResult, UnsupportedOptions, dtype_name, parse_dtype
from .scenarios import PromptSource, Scenario

# Full distributions are returned (for exact KL) while one request's rows stay below this many elements.
FULL_DISTRIBUTION_LIMIT = 1 << 24
# The oracle prefills at most this many tokens per step: its attention materialises (Hq, T_piece, T) scores, and
# pieces are exact by construction (tests/harness/test_chunked_reference.py checks chunked == whole).
ORACLE_STEP_TOKENS = 4096


class ScenarioSkipped(Exception):
    """The engine cannot honour the scenario here; `reasons` says why."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


def _key(req: Request) -> tuple:
    return req.prompt, req.max_new_tokens, req.top_k, req.full_distributions


class Oracle:
    """The fp64 reference of one checkpoint. gated_norm: "grouped" (Bamba) or "full" (what transformers computes)."""

    def __init__(self, checkpoint: str | Path, *, device: str | torch.device = "cpu", gated_norm: str = "grouped"):
        self.checkpoint = Path(checkpoint)
        self.device = torch.device(device)
        self.gated_norm = gated_norm
        self._engines: dict[tuple, ReferenceEngine] = {}
        self._results: dict[tuple, RequestResult] = {}
        self._errors: dict[tuple, float] = {}

    def engine(self, dtype: torch.dtype = torch.float64, ssm_state_dtype: str | None = None) -> ReferenceEngine:
        """The reference in `dtype`, ORACLE_STEP_TOKENS per step. With an SSM state dtype it runs one token per
        step, so that its state is rounded to that dtype after every token, as a decode step rounds it: the largest
        storage error that configuration can incur, and so the error a candidate's budget is calibrated on."""
        key = (dtype, ssm_state_dtype)
        if key not in self._engines:
            options = EngineOptions(allow_long_context=True, ssm_state_dtype=ssm_state_dtype,
                                    max_num_batched_tokens=1 if ssm_state_dtype is not None else ORACLE_STEP_TOKENS,
                                    engine_args={"gated_norm": self.gated_norm})
            self._engines[key] = ReferenceEngine(self.checkpoint, dtype=dtype, device=self.device, options=options)
        return self._engines[key]

    def results(self, requests: Sequence[Request]) -> list[RequestResult]:
        """The fp64 oracle's results (every request together), in request order."""
        missing = {_key(r): r for r in requests if _key(r) not in self._results}
        if missing:
            for key, result in zip(missing, self.engine().run(list(missing.values()))):
                self._results[key] = result
        return [replace(self._results[_key(r)], request_id=r.request_id) for r in requests]

    def budget(self, requests: Sequence[Request], dtype: torch.dtype, *, k: float = DEFAULT_K,
               atol: float | None = None, ssm_state_dtype: str | None = None) -> Budget:
        """The budget of a candidate in `dtype` on these requests: k · E + atol, with E the largest error of the
        reference itself in that dtype (and SSM state dtype, where the reference can store its state so, else the
        run dtype alone) over every position of the requests, teacher-forced on the oracle's continuations."""
        atol = ATOL[dtype] if atol is None else atol
        if ssm_state_dtype is not None and (parse_dtype(ssm_state_dtype) == dtype or ReferenceEngine.unsupported(
                EngineOptions(ssm_state_dtype=ssm_state_dtype), dtype=dtype, device=self.device)):
            ssm_state_dtype = None
        if dtype == torch.float64 and ssm_state_dtype is None:
            return Budget(k, atol)
        base = self.results(requests)
        config = (dtype, ssm_state_dtype)
        missing = [(r, b) for r, b in zip(requests, base) if (config, _key(r)) not in self._errors]
        if missing:
            forced = [r.teacher_forced(b.output_ids) for r, b in missing]
            low = self.engine(dtype, ssm_state_dtype).run(forced)
            for (req, b), result in zip(missing, low):
                diff = (result.prompt_logprobs - b.sequence_logprobs()).abs()
                self._errors[config, _key(req)] = float(diff.max()) if diff.numel() else float("nan")
        maxima = [self._errors[config, _key(r)] for r in requests]
        return Budget(k, atol, max((m for m in maxima if not math.isnan(m)), default=0.0))

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def _prepare(engine: str | type[Engine], scenario: Scenario, *, dtype, device, source: PromptSource,
             engine_args: dict | None, top_k: int) -> tuple[type[Engine], EngineOptions, list[Request]]:
    engine_cls = get_engine(engine) if isinstance(engine, str) else engine
    options = replace(scenario.options, engine_args=dict(engine_args or {}))
    longest = max(s.prompt_len + s.max_new_tokens for s in scenario.shapes)
    full = source.vocab_size * longest <= FULL_DISTRIBUTION_LIMIT
    requests = scenario.requests(source, top_k=top_k, full_distributions=full)
    reasons = engine_cls.unsupported(options, dtype=dtype, device=device, requests=requests)
    if scenario.needs_cuda and torch.device(device).type != "cuda":
        reasons.insert(0, f"{scenario.id} needs a CUDA device")
    if reasons:
        raise ScenarioSkipped(reasons)
    return engine_cls, options, requests


def check_scenario(engine: str | type[Engine], scenario: Scenario, *, oracle: Oracle, source: PromptSource,
                   dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   k: float = DEFAULT_K, atol: float | None = None, engine_args: dict | None = None,
                   top_k: int = 5) -> Report:
    """Run `scenario` on `engine` and judge it against the fp64 oracle. Raises ScenarioSkipped with the reasons
    when the engine cannot honour the scenario here."""
    dtype = parse_dtype(dtype)
    engine_cls, options, requests = _prepare(engine, scenario, dtype=dtype, device=device,
                                             source=source, engine_args=engine_args, top_k=top_k)
    baseline = oracle.results(requests)
    budget = oracle.budget(requests, dtype, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype)
    try:
        candidate = engine_cls(oracle.checkpoint, dtype=dtype, device=device, options=options)
    except UnsupportedOptions as err:
        # Some engines learn only when they load that they cannot honour an option (vLLM overriding a knob).
        raise ScenarioSkipped(err.reasons) from err
    with candidate:
        report = compare_runs(scenario=scenario.id, requests=requests, baseline=baseline,
                              candidate=candidate.run(requests), budget=budget, rerun=candidate.run)
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device),
                       options={k_: str(v) for k_, v in options.non_default().items()})
    return report


def check_relative(engine: str | type[Engine], scenario: Scenario, *, baseline_options: EngineOptions,
                   oracle: Oracle, source: PromptSource, dtype: str | torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", k: float = DEFAULT_K, atol: float | None = None,
                   top_k: int = 5) -> Report:
    """Judge `engine` under the scenario's options against the same engine under `baseline_options`, on the
    scenario's requests, with the budget of its dtype (the oracle only calibrates it)."""
    dtype = parse_dtype(dtype)
    engine_cls, options, requests = _prepare(engine, scenario, dtype=dtype, device=device,
                                             source=source, engine_args=None, top_k=top_k)
    budget = oracle.budget(requests, dtype, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype)
    with engine_cls(oracle.checkpoint, dtype=dtype, device=device, options=baseline_options) as engine_a:
        baseline = engine_a.run(requests)
    with engine_cls(oracle.checkpoint, dtype=dtype, device=device, options=options) as engine_b:
        report = compare_runs(scenario=scenario.id, requests=requests, baseline=baseline,
                              candidate=engine_b.run(requests), budget=budget, rerun=engine_b.run,
                              baseline_name=f"{engine_cls.name} {baseline_options.non_default() or 'defaults'}")
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device), relative=True)
    return report
