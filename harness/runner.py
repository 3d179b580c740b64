"""Running a scenario end to end: the oracle's results, the budget's calibration, the candidate, the comparison.

`Oracle` holds the fp64 reference of one checkpoint (and the reference in lower dtypes, for the budget) and memoises
results per request, so scenarios that share requests pay for the oracle once. `check_scenario` judges an engine
against the oracle (an `invariance` scenario: `check_invariance`, which also compares the engine's runs under
several configurations bit for bit); `check_relative` judges one engine configuration against another of the same
engine; `check_against` judges one engine directly against another (vLLM against the vendored engine, say).

Progress: the checks take an optional `progress(stage, steps)` callback. It is called with steps = 0 when the
scenario enters a stage ("oracle", "budget", the engine's name, ...), and with steps = 1 after every engine step of
that stage where the engine counts its steps (an engine with a `step_callback` attribute: the vendored engine).
Nothing it is given changes what is computed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from reference.checkpoint import parameter_count
from reference.config import ModelConfig

from .adapters import get_engine
from .adapters.reference import ReferenceEngine
from .compare import (ATOL, BUDGET_QUANTILE, BUDGET_RULES, DEFAULT_K, EXCESS_Z, Budget, Failure, NoiseFloor, Report,
                      compare_runs, position_classes)
from .engine import Engine, EngineOptions, Request, RequestResult, UnsupportedOptions, dtype_name, parse_dtype
from .invariance import FIELDS, first_difference
from .routing import routing_ties
from .scenarios import Configuration, PromptSource, Scenario, batching_shapes
from .schedule import RequestShape, plan_options, plan_steps

# Full distributions are returned (for exact KL) while one request's rows stay below this many elements.
FULL_DISTRIBUTION_LIMIT = 1 << 24
# The oracle prefills at most this many tokens per step: its attention materialises (Hq, T_piece, T) scores, and
# pieces are exact by construction (tests/harness/test_chunked_reference.py checks chunked == whole).
ORACLE_STEP_TOKENS = 4096
# The oracle's results also list the NEAR_TIE_K most likely tokens of every generated position (when it does not
# return whole rows): a candidate whose greedy token differs from the oracle's is judged on the oracle's logprob of
# its token, which its top-k alone seldom holds at a large vocabulary (a 9.8B model in bf16 chose the oracle's 6th).
NEAR_TIE_K = 256


Progress = Callable[[str, int], None]
# A reference model on a GPU needs its weights and this much again as a share of them for its activations.
ROOM_FACTOR = 1.25
# A candidate needs its weights twice over: its own caches (an SSM state per slot, fp32 by default, the K/V blocks)
# and its logits come on top. Measured at 9.8B on an H200: the fp64 oracle and its two bf16 twins (118 GB) left
# 32 GB, more than 1.25x the bf16 candidate's 19.6 GB of weights, and batching-together still ran out of memory.
CANDIDATE_ROOM_FACTOR = 2.0
# The budget's E is a maximum over at least this many positions: a workload with fewer (preemption's two requests,
# 34 positions on the tiny models; every other workload has 80 or more) adds the model's batching workload to the
# sample (Oracle.budget). Measured on granite-moe4-top2 in bf16 on an H200: E was 0.086 over preemption's 34
# positions, 0.263 over the batching workload's 103 and 0.958 over chunked prefill's 80, and the vendored engine
# (which passes every other scenario of that model) differed by 0.257 on the preemption workload: 3x that E.
MIN_BUDGET_POSITIONS = 64


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _free_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device, after this process's allocator has returned what it holds unused."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class ScenarioSkipped(Exception):
    """The engine cannot honour the scenario here; `reasons` says why."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


def _key(req: Request) -> tuple:
    return req.prompt, req.max_new_tokens, req.top_k, req.full_distributions


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    """The files that say what a checkpoint computes: its config and its weights (and their index)."""
    return sorted(p for p in Path(checkpoint).iterdir() if p.is_file() and (
        p.name == "config.json" or p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_record(checkpoint: str | Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """File name -> size, mtime_ns and sha256 of each of the checkpoint's files; a file whose size and mtime equal
    `known`'s entry for it keeps that entry's sha256 unhashed (the same file, untouched since it was hashed)."""
    record = {}
    for path in _checkpoint_files(Path(checkpoint)):
        stat = path.stat()
        entry = (known or {}).get(path.name)
        same = entry is not None and (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
        record[path.name] = dict(size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                                 sha256=entry["sha256"] if same else _sha256(path))
    return record


def check_record(record: dict[str, dict] | None, checkpoint: str | Path, what: str) -> dict[str, dict]:
    """The checkpoint's record (checkpoint_record) when its files' contents are those of `record` (an oracle
    cache's); ValueError naming the files that differ, or saying `what` has no record (an older cache)."""
    if record is None:
        raise ValueError(f"{what}: written without a record of its checkpoint's files (an older cache): its results "
                         "cannot be checked against this checkpoint; delete it and they are computed again")
    current = checkpoint_record(checkpoint, known=record)
    differ = sorted(n for n in set(record) | set(current)
                    if (record.get(n) or {}).get("sha256") != (current.get(n) or {}).get("sha256"))
    if differ:
        raise ValueError(f"{what}: computed for other weights than {checkpoint}'s (" + ", ".join(
            f"{n} {'differs' if n in record and n in current else 'absent' if n in record else 'new'}"
            for n in differ) + ")")
    return current


def restamp_cache(path: str | Path, checkpoint: str | Path) -> None:
    """Check an oracle cache against the checkpoint (check_record: ValueError if it is another's) and, where the
    files were written again with the same contents (a model drawn again from its seed on another machine), record
    their new sizes and times, so that the processes loading it next need not hash the weights again."""
    path = Path(path)
    cache = torch.load(path, weights_only=False)
    current = check_record(cache.get("files"), checkpoint, str(path))
    if current != cache["files"]:
        cache["files"] = current
        part = path.with_name(path.name + ".part")
        torch.save(cache, part)
        os.replace(part, path)


class Oracle:
    """The fp64 reference of one checkpoint. gated_norm: "grouped" (Bamba) or "full" (what transformers computes)."""

    def __init__(self, checkpoint: str | Path, *, device: str | torch.device = "cpu", gated_norm: str = "grouped",
                 memory_limit: int | None = None, budget_rule: str = "max",
                 budget_quantile: float = BUDGET_QUANTILE, also_rules: Sequence[str] = (),
                 excess_z: float | None = EXCESS_Z):
        """memory_limit (bytes; --oracle-memory): a reference model whose weights in its dtype, with ROOM_FACTOR
        for its activations, exceed it runs layer-streamed (reference/model.py), else resident; None: resident.
        budget_rule, budget_quantile (--budget-rule, --budget-quantile): how budget() sets each position's
        budget from the reference's own errors (harness/compare.py, BUDGET_RULES). also_rules: other rules each
        scenario is judged by too, on the same candidate run (the verdict stays budget_rule's; report.meta["rules"]
        holds every rule's: judged_by_rules), so that one run measures several rules (mutants.scale).
        excess_z (--excess-z): the paired z an excess class must pass to fail (NoiseFloor.z_limit; None: the ratio
        alone)."""
        self.checkpoint = Path(checkpoint)
        self.device = torch.device(device)
        self.gated_norm = gated_norm
        if memory_limit is not None and memory_limit <= 0:
            raise ValueError(f"memory_limit: expected a positive number of bytes, got {memory_limit}")
        self.memory_limit = memory_limit
        if budget_rule not in BUDGET_RULES:
            raise ValueError(f"budget_rule: expected one of {list(BUDGET_RULES)}, got {budget_rule!r}")
        if isinstance(budget_quantile, bool) or not isinstance(budget_quantile, (int, float)) \
                or not 0.5 <= budget_quantile < 1:
            raise ValueError(f"budget_quantile: expected a number in [0.5, 1), got {budget_quantile!r}")
        self.budget_rule, self.budget_quantile = budget_rule, float(budget_quantile)
        unknown = [r for r in also_rules if r not in BUDGET_RULES]
        if unknown:
            raise ValueError(f"also_rules: expected rules among {list(BUDGET_RULES)}, got {unknown}")
        self.also_rules = tuple(r for r in dict.fromkeys(also_rules) if r != budget_rule)
        if excess_z is not None and (isinstance(excess_z, bool) or not isinstance(excess_z, (int, float))
                                     or not math.isfinite(excess_z)):
            raise ValueError(f"excess_z: expected a finite number or None, got {excess_z!r}")
        self.excess_z = None if excess_z is None else float(excess_z)
        self._engines: dict[tuple, ReferenceEngine] = {}
        self._results: dict[tuple, RequestResult] = {}
        self._errors: dict[tuple, list[float]] = {}
        self._usage: dict[tuple, dict] = {}          # (dtype, ssm_state_dtype) -> what describe() reports of it
        self._device_peak: int | None = None
        self._routing: dict[tuple, list[float]] = {}
        self.routing_notes: list[dict] = []
        self._cfg: ModelConfig | None = None
        self._files: dict[str, dict] | None = None      # checkpoint_record, once a cache is saved or loaded

    def weights_mode(self, dtype: torch.dtype = torch.float64) -> str:
        """"streamed" when the reference in `dtype` would not fit memory_limit resident (weights x ROOM_FACTOR)."""
        if self.memory_limit is None:
            return "resident"
        return "streamed" if parameter_count(self.checkpoint) * dtype.itemsize * ROOM_FACTOR > self.memory_limit \
            else "resident"

    def describe(self) -> dict:
        """What report.json says of the reference models this oracle ran: the cap, and for each (the fp64 oracle,
        the budget's twins) its dtype, whether resident or streamed, its weights' full size and the most bytes of
        weights it held at once; on a GPU the peak device memory while they ran (the whole process's); and each
        fp32 routing near-tie search (routing_allowance): the router error, threshold, ties found, widest allowance."""
        self._note_usage()
        return {"memory_limit_bytes": self.memory_limit, "device_peak_bytes": self._device_peak,
                "models": [dict(u) for u in self._usage.values()], "routing": list(self.routing_notes)}

    def _note_usage(self) -> None:
        for key, engine in self._engines.items():
            model = getattr(engine, "model", None)
            if model is not None:
                usage = self._usage[key]
                usage["peak_weight_bytes"] = max(usage["peak_weight_bytes"], model.peak_weight_bytes)
                if model.streamed:          # the stored weights it keeps in host memory (LazyWeights.host_copies)
                    usage["host_copy_bytes"] = max(usage.get("host_copy_bytes", 0), model.w.store.host_copy_bytes)

    def _run(self, key: tuple, requests: list[Request]) -> list[RequestResult]:
        """The reference model `key` on requests, its device memory peak noted (on a GPU)."""
        engine = self.engine(*key)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()    # (a test may simulate _on_gpu)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        results = engine.run(requests)
        if cuda:
            self._device_peak = max(self._device_peak or 0, torch.cuda.max_memory_allocated(self.device))
        self._note_usage()
        return results

    def engine(self, dtype: torch.dtype = torch.float64, ssm_state_dtype: str | None = None) -> ReferenceEngine:
        """The reference in `dtype`, ORACLE_STEP_TOKENS per step. With an SSM state dtype narrower than `dtype` it
        runs one token per step, so that its state is rounded to that dtype after every token, as a decode step
        rounds it: the largest storage error that configuration can incur, and so the error a candidate's budget is
        calibrated on. A wider one (float32 under bfloat16) runs its scan and keeps its state in it."""
        key = (dtype, ssm_state_dtype)
        if key not in self._engines:
            weights = self.weights_mode(dtype)
            if weights == "resident":
                self._make_room(dtype)
            narrower = ssm_state_dtype is not None and parse_dtype(ssm_state_dtype).itemsize < dtype.itemsize
            options = EngineOptions(allow_long_context=True, ssm_state_dtype=ssm_state_dtype,
                                    max_num_batched_tokens=1 if narrower else ORACLE_STEP_TOKENS,
                                    engine_args={"gated_norm": self.gated_norm, "weights": weights})
            self._engines[key] = ReferenceEngine(self.checkpoint, dtype=dtype, device=self.device, options=options)
            self._usage.setdefault(key, {"dtype": dtype_name(dtype), "ssm_state_dtype": ssm_state_dtype,
                                         "weights": weights, "peak_weight_bytes": 0,
                                         "weight_bytes": parameter_count(self.checkpoint) * dtype.itemsize})
            if key == (torch.float64, None):                # the oracle proper: results() runs it
                self._engines[key].near_k = NEAR_TIE_K
        return self._engines[key]

    def _make_room(self, dtype: torch.dtype) -> None:
        """Before another reference model is loaded on a GPU, the ones loaded are closed (their results and errors
        stay memoised) when the free memory would not hold the new one's weights with a quarter to spare: a 9.8B
        model in fp64 (78 GB) beside its bf16 twins and the candidate does not fit one 141 GB GPU at once."""
        self.make_room(parameter_count(self.checkpoint) * dtype.itemsize)

    def make_room(self, nbytes: float, factor: float = ROOM_FACTOR) -> None:
        """On a GPU, close the reference models held (what they computed stays memoised) when the free memory would
        not hold `factor` times `nbytes` of weights: another reference model's (ROOM_FACTOR), or the candidate's
        (CANDIDATE_ROOM_FACTOR: at 9.8B the fp64 oracle and its two bf16 twins leave a bf16 candidate too little)."""
        if not self._engines or not _on_gpu(self.device):
            return
        if _free_memory(self.device) < factor * nbytes:
            self.close()

    def holds_gpu_models(self) -> bool:
        return bool(self._engines) and _on_gpu(self.device)

    def run_beside(self, engine: Engine, requests: Sequence[Request], dtype: torch.dtype) -> list[RequestResult]:
        """`engine` (a candidate or a baseline) on `requests`, after making room for its weights in `dtype`. Should
        it still run out of GPU memory while reference models are held, they are closed (their results stay) and it
        runs once more: the harness's own models are never why an engine fails."""
        self.make_room(parameter_count(self.checkpoint) * dtype.itemsize, CANDIDATE_ROOM_FACTOR)
        try:
            return engine.run(requests)
        except torch.cuda.OutOfMemoryError:
            if not self.holds_gpu_models():
                raise
        self.close()            # outside the handler: the failed run's frames (and its tensors) are gone by now
        return engine.run(requests)

    def results(self, requests: Sequence[Request]) -> list[RequestResult]:
        """The fp64 oracle's results (every request together), in request order."""
        missing = {_key(r): r for r in requests if _key(r) not in self._results}
        if missing:
            for key, result in zip(missing, self._run((torch.float64, None), list(missing.values()))):
                self._results[key] = result
        return [replace(self._results[_key(r)], request_id=r.request_id) for r in requests]

    def budget(self, requests: Sequence[Request], dtype: torch.dtype, *, k: float = DEFAULT_K,
               atol: float | None = None, ssm_state_dtype: str | None = None,
               calibration: Sequence[Request] = (), rule: str | None = None) -> Budget:
        """The budget of a candidate in `dtype` on these requests: k · E + atol, with E the largest error of the
        reference itself in that dtype (and SSM state dtype, where the reference can store its state so, else the
        run dtype alone) over every position of the requests, teacher-forced on the oracle's continuations; under
        the quantile rule (budget_rule) each position's own, k · max(floor, its error) + atol, the floor the
        budget_quantile of the errors over every position (harness/compare.py). When
        the requests hold fewer than MIN_BUDGET_POSITIONS positions, E is taken over the `calibration` requests
        too (calibration_requests: the model's batching workload): the maximum of a few dozen positions is too
        noisy a sample of the dtype's error level (harness/compare.py). rule: another rule than budget_rule."""
        rule = self.budget_rule if rule is None else rule
        atol = ATOL[dtype] if atol is None else atol
        if ssm_state_dtype is not None and parse_dtype(ssm_state_dtype).itemsize >= dtype.itemsize:
            ssm_state_dtype = None            # the budget is calibrated on the run dtype's error alone
        if dtype == torch.float64 and ssm_state_dtype is None:
            return Budget(k, atol)
        judged = requests
        if sum(len(r.prompt) - 1 + r.max_new_tokens for r in requests) < MIN_BUDGET_POSITIONS:
            requests = [*requests, *calibration]
        rows = self._error_rows(requests, dtype, ssm_state_dtype)
        routing = self.routing_allowance(judged, dtype, k=k)
        maxima = [max(r) if r else float("nan") for r in rows]
        largest = max((m for m in maxima if not math.isnan(m)), default=0.0)
        if rule == "max":
            return Budget(k, atol, largest, routing=routing)
        errors = sorted(e for r in rows for e in r if not math.isnan(e))
        floor = errors[min(len(errors) - 1, math.ceil(self.budget_quantile * len(errors)) - 1)] if errors else 0.0
        return Budget(k, atol, largest, floor=floor,
                      positions={r.request_id: list(row) for r, row in zip(requests, rows)}, routing=routing)

    def routing_allowance(self, requests: Sequence[Request], dtype: torch.dtype, *,
                          k: float = DEFAULT_K) -> dict[str, list[float]] | None:
        """Per request, each position's routing near-tie allowance for a candidate in `dtype` (harness/routing.py),
        on the oracle's teacher-forced sequences; None for a model without routed experts, an fp64 candidate or a
        16-bit one (whose twin trades experts as often as the candidate: the module docstring of harness/routing.py).
        Memoised per request and dtype; self.routing_notes keeps what each workload found."""
        if dtype == torch.float64 or dtype.itemsize < 4 or not self.cfg.num_local_experts:
            return None
        base = self.results(requests)
        missing = [(r, b) for r, b in zip(requests, base) if (dtype, k, _key(r)) not in self._routing]
        if missing:
            sequences = [list(r.prompt) + list(b.output_ids) for r, b in missing]
            found = routing_ties(self.engine(torch.float64).model, self.engine(dtype).model, sequences, k=k)
            for (req, _), row in zip(missing, found.allowance):
                self._routing[dtype, k, _key(req)] = row
            self.routing_notes.append(found.describe())
        return {r.request_id: self._routing[dtype, k, _key(r)] for r in requests}

    @property
    def cfg(self) -> ModelConfig:
        if self._cfg is None:
            self._cfg = ModelConfig.from_json(self.checkpoint / "config.json")
        return self._cfg

    def _error_rows(self, requests: Sequence[Request], dtype: torch.dtype,
                    ssm_state_dtype: str | None) -> list[list[float]]:
        """Per request, |ref_d − ref_fp64| at every position (row i: position i+1): the reference in `dtype` with
        its SSM state in `ssm_state_dtype`, teacher-forced on the oracle's continuations; each run once, memoised
        (the budget takes its maximum, the excess test all of it)."""
        base = self.results(requests)
        config = (dtype, ssm_state_dtype)
        missing = [(r, b) for r, b in zip(requests, base) if (config, _key(r)) not in self._errors]
        if missing:
            forced = [r.teacher_forced(b.output_ids) for r, b in missing]
            for (req, b), result in zip(missing, self._run((dtype, ssm_state_dtype), forced)):
                self._errors[config, _key(req)] = (result.prompt_logprobs - b.sequence_logprobs()).abs().tolist()
        return [self._errors[config, _key(r)] for r in requests]

    def position_errors(self, requests: Sequence[Request], dtype: torch.dtype,
                        ssm_state_dtype: str | None = None) -> dict[str, list[float]]:
        """_error_rows by request id."""
        return {r.request_id: rows for r, rows in zip(requests, self._error_rows(requests, dtype, ssm_state_dtype))}

    def noise_floor(self, requests: Sequence[Request], dtype: torch.dtype, options: EngineOptions,
                    *, atol: float = 0.0, engine_state_dtype: str | None = None,
                    as_run: Sequence[Request] | None = None) -> NoiseFloor:
        """The excess test's noise floor for a candidate in `dtype` under `options` (harness/compare.py): the
        reference in `dtype` with the candidate's SSM state dtype (options.ssm_state_dtype, else the engine's
        default, `engine_state_dtype`, None: `dtype`), and each request's position classes in the scheduler plan
        of `options`. as_run: the requests as the candidate ran them, when `requests` are their teacher-forced
        forms (sampled continuations): the classes follow the candidate's plan, its decode positions included."""
        state = options.ssm_state_dtype or engine_state_dtype
        if state is not None and parse_dtype(state) == dtype:
            state = None
        errors = self.position_errors(requests, dtype, state)
        requests = list(as_run) if as_run is not None else requests
        plan = plan_steps([RequestShape(len(r.prompt), r.max_new_tokens, r.arrival_step) for r in requests],
                          **plan_options(options))
        pieces: list[list[tuple[int, int, bool]]] = [[] for _ in requests]
        for step in plan:
            for piece in step.pieces:
                pieces[piece.request].append((piece.start, piece.stop, piece.decode))
        chunk = json.loads((self.checkpoint / "config.json").read_text())["mamba_chunk_size"]
        classes = {r.request_id: position_classes(len(r.prompt), r.max_new_tokens, pieces[i], chunk)
                   for i, r in enumerate(requests)}
        return NoiseFloor(dtype_name(dtype), errors, classes, atol=atol, z_limit=self.excess_z)

    def save_cache(self, path: str | Path) -> None:
        """Write every result, error and routing allowance computed so far, so that another process (a mutant's,
        say) judges against the same oracle without loading the fp64 model again (load_cache), with the sha256 of
        each of the checkpoint's files (hashed once per process: at 9.8B about 20 GB, some seconds)."""
        if self._files is None:
            self._files = checkpoint_record(self.checkpoint)
        torch.save({"checkpoint": str(self.checkpoint.resolve()), "gated_norm": self.gated_norm,
                    "files": self._files, "results": self._results, "errors": self._errors,
                    "routing": self._routing, "routing_notes": self.routing_notes}, path)

    def load_cache(self, path: str | Path) -> None:
        """Adopt what save_cache wrote for a checkpoint with the same files' contents (wherever it lies) and this
        gated norm; ValueError otherwise, and for a cache without a record of its checkpoint's files."""
        cache = torch.load(path, weights_only=False)
        if cache["gated_norm"] != self.gated_norm:
            raise ValueError(f"{path}: an oracle cache of the {cache['gated_norm']} gated norm, not {self.gated_norm}")
        self._files = check_record(cache.get("files"), self.checkpoint, f"{path} (of {cache['checkpoint']})")
        self._results.update(cache["results"])
        self._errors.update(cache["errors"])
        self._routing.update(cache.get("routing", {}))
        self.routing_notes += [n for n in cache.get("routing_notes", []) if n not in self.routing_notes]

    def close(self) -> None:
        self._note_usage()
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def calibration_requests(oracle: Oracle, source: PromptSource, *, top_k: int = 5) -> list[Request]:
    """The extra sample of a small workload's budget (Oracle.budget): the requests of the model's batching
    workload (scenarios.batching_shapes) with the prompts and settings the batching scenarios give them, so that
    the oracle's memo (by content) serves both; their ids start with "calibration-", apart from any workload's."""
    cfg = json.loads((oracle.checkpoint / "config.json").read_text())
    shapes = batching_shapes(cfg["mamba_chunk_size"], cfg["mamba_d_conv"])
    requests = Scenario("calibration", "batching", EngineOptions(), shapes, "the budget's extra sample").requests(
        source, top_k=top_k, full_distributions=_full_distributions(shapes, source))
    return [replace(r, request_id=f"calibration-{r.request_id}") for r in requests]


def _full_distributions(shapes: Sequence[RequestShape], source: PromptSource) -> bool:
    longest = max(s.prompt_len + s.max_new_tokens for s in shapes)
    return source.vocab_size * longest <= FULL_DISTRIBUTION_LIMIT


def _prepare(engine: str | type[Engine], scenario: Scenario, *, dtype, device, source: PromptSource,
             engine_args: dict | None, top_k: int) -> tuple[type[Engine], EngineOptions, list[Request]]:
    engine_cls = get_engine(engine) if isinstance(engine, str) else engine
    # The scenario's own engine_args (an engine's knob it turns) over the caller's: a scenario is what its id says.
    options = replace(scenario.options, engine_args={**(engine_args or {}), **scenario.options.engine_args})
    requests = scenario.requests(source, top_k=top_k, full_distributions=_full_distributions(scenario.shapes, source))
    reasons = engine_cls.unsupported(options, dtype=dtype, device=device, requests=requests)
    if scenario.needs_cuda and torch.device(device).type != "cuda":
        reasons.insert(0, f"{scenario.id} needs a CUDA device")
    if reasons:
        raise ScenarioSkipped(reasons)
    return engine_cls, options, requests


def _open(engine_cls: type[Engine], checkpoint: Path, *, dtype, device, options: EngineOptions) -> Engine:
    """Build the engine; options it finds it cannot honour only once it sees the checkpoint (a model that does not
    split over the asked ranks) skip the scenario like any other unsupported option."""
    try:
        return engine_cls(checkpoint, dtype=dtype, device=device, options=options)
    except UnsupportedOptions as err:
        raise ScenarioSkipped(err.reasons) from err


def _enter(progress: Progress | None, stage: str, engine: Engine | None = None) -> None:
    """Tell `progress` the scenario entered `stage`; an engine that counts its steps reports each one."""
    if progress is None:
        return
    progress(stage, 0)
    if engine is not None and hasattr(engine, "step_callback"):
        engine.step_callback = lambda: progress(stage, 1)


def check_scenario(engine: str | type[Engine], scenario: Scenario, *, oracle: Oracle, source: PromptSource,
                   dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   k: float = DEFAULT_K, atol: float | None = None, engine_args: dict | None = None,
                   top_k: int = 5, progress: Progress | None = None,
                   candidate_checkpoint: str | Path | None = None) -> Report:
    """Run `scenario` on `engine` and judge it against the fp64 oracle. Raises ScenarioSkipped with the reasons
    when the engine cannot honour the scenario here. candidate_checkpoint: what the engine loads, where it is not
    the oracle's checkpoint: a finding's counterfactual judges an engine against the oracle of the model it is
    believed to compute (the same weights, a config field changed: harness/variants.py). An invariance scenario is
    check_invariance's (so every caller of check_scenario runs every kind)."""
    if scenario.kind == "invariance":
        return check_invariance(engine, scenario, oracle=oracle, source=source, dtype=dtype, device=device, k=k,
                                atol=atol, engine_args=engine_args, top_k=top_k, progress=progress,
                                candidate_checkpoint=candidate_checkpoint)
    dtype = parse_dtype(dtype)
    engine_cls, options, requests = _prepare(engine, scenario, dtype=dtype, device=device,
                                             source=source, engine_args=engine_args, top_k=top_k)
    loaded = Path(candidate_checkpoint) if candidate_checkpoint is not None else oracle.checkpoint
    with _open(engine_cls, loaded, dtype=dtype, device=device, options=options) as candidate:
        reasons = candidate.cannot_run(requests)          # before the oracle's (possibly long) run
        if reasons:
            raise ScenarioSkipped(reasons)
        report, _ = _judged(candidate, scenario, requests, engine_cls.name, oracle=oracle, source=source,
                            dtype=dtype, options=options, engine_cls=engine_cls, k=k, atol=atol, top_k=top_k,
                            progress=progress)
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device),
                       options={k_: str(v) for k_, v in options.non_default().items()})
    return report


def _judged(candidate: Engine, scenario: Scenario, requests: list[Request], stage: str,
            **judging) -> tuple[Report, list[RequestResult] | None]:
    """The candidate's results on `requests` judged against the oracle (sampled requests teacher-forced:
    _judge_sampled), with the engine's provenance and, on a failure, its oracle hint in the report's meta; and the
    results (None for sampled requests). stage: what the progress display calls the candidate's run."""
    oracle, dtype = judging["oracle"], judging["dtype"]
    results = None
    if any(r.samples for r in requests):
        report = _judge_sampled(candidate, scenario, requests, **judging)
    else:
        baseline, budget, noise = _oracle_side(requests, **judging)
        _enter(judging["progress"], stage, candidate)
        results = oracle.run_beside(candidate, requests, dtype)
        rerun = _once(lambda forced: oracle.run_beside(candidate, forced, dtype))
        judge = lambda budget: compare_runs(scenario=scenario.id, requests=requests, baseline=baseline,  # noqa: E731
                                            candidate=results, budget=budget, rerun=rerun, noise=noise)
        report = judged_by_rules(judge, budget, requests, **judging)
    if candidate.provenance():
        report.meta["engine_provenance"] = candidate.provenance()
    hint = getattr(candidate, "oracle_hint", None)        # an engine known to compute another model here
    if hint is not None and not report.passed and (text := hint(candidate.cfg, oracle.gated_norm)):
        report.meta["hint"] = text
    return report, results


def _oracle_side(requests: Sequence[Request], *, oracle: Oracle, source: PromptSource, dtype: torch.dtype,
                 options: EngineOptions, engine_cls: type[Engine], k: float, atol: float | None, top_k: int,
                 progress: Progress | None, as_run: Sequence[Request] | None = None):
    """What a candidate in `dtype` is judged against on `requests`: the oracle's results, the budget, and for a
    16-bit candidate the excess test's noise floor (compare.py); as_run: Oracle.noise_floor's."""
    _enter(progress, "oracle")
    baseline = oracle.results(requests)
    _enter(progress, "budget")
    budget = oracle.budget(requests, dtype, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype,
                           calibration=calibration_requests(oracle, source, top_k=top_k))
    noise = None
    if dtype.itemsize <= 2:
        _enter(progress, "noise floor")
        noise = oracle.noise_floor(requests, dtype, options, atol=budget.atol,
                                   engine_state_dtype=engine_cls.default_ssm_state_dtype, as_run=as_run)
    return baseline, budget, noise


def _judge_sampled(candidate: Engine, scenario: Scenario, requests: list[Request], **judging) -> Report:
    """A scenario whose requests sample: the candidate runs first; its continuations, whatever tokens it drew, are
    judged teacher-forced. Each request becomes prompt + the candidate's tokens with nothing to generate, the
    oracle, budget and noise floor are computed on those, and the candidate's logprobs of its own tokens are
    compared with them at every position like prompt positions (no token choice to judge: a draw is the engine's
    business). The excess test's classes keep the candidate's decode positions as decode (as_run)."""
    _enter(judging["progress"], judging["engine_cls"].name, candidate)
    ran = judging["oracle"].run_beside(candidate, requests, judging["dtype"])
    by_id = {r.request_id: r for r in ran}
    forced = [r.teacher_forced(by_id[r.request_id].output_ids) if r.request_id in by_id else r for r in requests]
    baseline, budget, noise = _oracle_side(forced, as_run=requests, **judging)
    candidate_rows = [as_teacher_forced(r) for r in ran]
    judge = lambda budget: compare_runs(scenario=scenario.id, requests=forced, baseline=baseline,     # noqa: E731
                                        candidate=candidate_rows, budget=budget, noise=noise)
    report = judged_by_rules(judge, budget, forced, **judging)
    report.meta["sampled"] = {r.request_id: {"temperature": r.temperature, "seed": r.seed, "prompt_tokens":
                                             len(r.prompt), "drawn": r.max_new_tokens} for r in requests}
    return report


def _once(rerun: Callable[[list[Request]], list[RequestResult]]) -> Callable[[list[Request]], list[RequestResult]]:
    """rerun, memoised on the requests' ids and tokens: a second judgment of one candidate run reruns nothing."""
    memo: dict[tuple, list[RequestResult]] = {}

    def call(forced: list[Request]) -> list[RequestResult]:
        key = tuple((r.request_id, tuple(r.prompt), r.max_new_tokens) for r in forced)
        if key not in memo:
            memo[key] = rerun(forced)
        return memo[key]

    return call


def judged_by_rules(judge: Callable[[Budget], Report], budget: Budget, requests: Sequence[Request], *,
                    oracle: Oracle, dtype: torch.dtype, options: EngineOptions, k: float, atol: float | None,
                    source: PromptSource, top_k: int, **_) -> Report:
    """judge(budget): the report by the oracle's budget_rule. With oracle.also_rules, the same candidate results
    are judged by each of those rules too, and report.meta["rules"] holds, per rule (the budget_rule's included),
    its verdict: passed, the checks that failed, the first failure, the budget and the largest |Δ| over its
    position's budget."""
    report = judge(budget)
    if not oracle.also_rules:
        return report
    rules = {oracle.budget_rule: report}
    for rule in oracle.also_rules:
        other = oracle.budget(requests, dtype, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype,
                              calibration=calibration_requests(oracle, source, top_k=top_k), rule=rule)
        rules[rule] = judge(other)
    report.meta["rules"] = {rule: {"passed": r.passed, "checks": sorted({f.what for f in r.failures}),
                                   "first_failure": r.failures[0].message()[:300] if r.failures else "",
                                   "budget": r.meta["budget"],
                                   **({"budget_floor": r.meta["budget_floor"]} if "budget_floor" in r.meta else {}),
                                   "k_to_pass": r.meta.get("k_to_pass"),
                                   "max_delta_over_position_budget": r.meta.get(
                                       "max_delta_over_position_budget", r.max_delta / r.meta["budget"]
                                       if r.meta["budget"] else math.inf)}
                            for rule, r in rules.items()}
    return report


def as_teacher_forced(result: RequestResult) -> RequestResult:
    """A result's generated positions as prompt positions: what a teacher-forced run of prompt + its own output
    returns (prompt rows then output rows, nothing generated)."""
    def cat(a, b):
        return None if a is None or b is None else torch.cat([a, b])
    return RequestResult(result.request_id, cat(result.prompt_logprobs, result.output_logprobs),
                         cat(result.prompt_top_ids, result.output_top_ids),
                         cat(result.prompt_top_logprobs, result.output_top_logprobs), [],
                         result.output_logprobs[:0], result.output_top_ids[:0], result.output_top_logprobs[:0],
                         cat(result.prompt_dists, result.output_dists),
                         None if result.output_dists is None else result.output_dists[:0])


def check_invariance(engine: str | type[Engine], scenario: Scenario, *, oracle: Oracle, source: PromptSource,
                     dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     k: float = DEFAULT_K, atol: float | None = None, engine_args: dict | None = None,
                     top_k: int = 5, progress: Progress | None = None,
                     candidate_checkpoint: str | Path | None = None) -> Report:
    """An invariance scenario: the engine runs the scenario's requests under each of its configurations (the first
    the baseline; harness/scenarios.py, invariance_configurations); the baseline's results are judged against the
    fp64 oracle as check_scenario judges any scenario's, and every other configuration's results must be
    bit-identical to the baseline's (harness/invariance.py): the first difference of each configuration that
    differs is a failure naming the request, the position, the field and both configurations. The report fails if
    either part does and shows both (meta "invariance": each configuration's outcome, those left out and why).

    Only an engine that declares a batch-invariant mode (Engine.batch_invariance) is held to the promise; one that
    declares none is skipped, unless engine_args name `batch_invariant` (the user asks for the check anyway). A
    configuration the engine cannot honour here (CUDA graphs without CUDA, an option it lacks) is left out with its
    reasons; the scenario is skipped when the baseline cannot run, or no other configuration can."""
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    engine_cls = get_engine(engine) if isinstance(engine, str) else engine
    declared = getattr(engine_cls, "batch_invariance", None)
    if not declared and "batch_invariant" not in (engine_args or {}):
        raise ScenarioSkipped([f"{engine_cls.name} does not declare a batch-invariant mode (Engine.batch_invariance): "
                               "it promises no bit-identical results across batches, chunking and preemption; "
                               "--engine-arg batch_invariant=VALUE runs the check anyway"])
    if not scenario.configurations:
        raise ValueError(f"{scenario.id}: an invariance scenario without configurations")
    engine_cls, base_options, requests = _prepare(engine_cls, scenario, dtype=dtype, device=device, source=source,
                                                  engine_args=engine_args, top_k=top_k)
    full = _full_distributions(scenario.shapes, source)
    baseline_config, *others = scenario.configurations
    runs: list[tuple[Configuration, EngineOptions, list[Request]]] = []
    left_out: dict[str, list[str]] = {}
    for config in others:
        options = replace(config.options, engine_args={**(engine_args or {}), **config.options.engine_args})
        config_requests = config.requests(requests, source, top_k=top_k, full_distributions=full)
        reasons = engine_cls.unsupported(options, dtype=dtype, device=device, requests=config_requests)
        if config.needs_cuda and device.type != "cuda":
            reasons.insert(0, f"needs a CUDA device, the device is {device}")
        if reasons:
            left_out[config.name] = reasons
        else:
            runs.append((config, options, config_requests))
    if not runs:
        raise ScenarioSkipped([_nothing_to_compare(scenario, baseline_config, left_out)])
    loaded = Path(candidate_checkpoint) if candidate_checkpoint is not None else oracle.checkpoint
    with _open(engine_cls, loaded, dtype=dtype, device=device, options=base_options) as candidate:
        reasons = candidate.cannot_run(requests)          # before the oracle's (possibly long) run
        if reasons:
            raise ScenarioSkipped(reasons)
        report, baseline = _judged(candidate, scenario, requests, f"{engine_cls.name} {baseline_config.name}",
                                   oracle=oracle, source=source, dtype=dtype, options=base_options,
                                   engine_cls=engine_cls, k=k, atol=atol, top_k=top_k, progress=progress)
        hints = [report.meta.pop("hint")] if "hint" in report.meta else []
    oracle_passed = report.passed
    outcomes = {baseline_config.name: {"status": "baseline", "oracle": "PASS" if oracle_passed else "FAIL"}}
    first = None
    for config, options, config_requests in runs:
        try:
            with _open(engine_cls, loaded, dtype=dtype, device=device, options=options) as other:
                reasons = other.cannot_run(config_requests)
                if reasons:
                    left_out[config.name] = reasons
                    continue
                _enter(progress, f"{engine_cls.name} {config.name}", other)
                results = oracle.run_beside(other, config_requests, dtype)
        except ScenarioSkipped as skip:                   # options it refuses only once it sees the checkpoint
            left_out[config.name] = skip.reasons
            continue
        difference = first_difference(requests, baseline, results, baseline_name=baseline_config.name,
                                      other_name=config.name)
        outcomes[config.name] = {"status": "identical" if difference is None else "differs"}
        if difference is not None:
            outcomes[config.name]["first_difference"] = difference.to_dict()
            first = first or difference
            report.failures.append(Failure(scenario.id, difference.request_id, difference.position, difference.where,
                                           "invariance", baseline_name=baseline_config.name,
                                           detail=difference.detail()))
    if len(outcomes) == 1:
        raise ScenarioSkipped([_nothing_to_compare(scenario, baseline_config, left_out)])
    report.meta["invariance"] = {
        "baseline": baseline_config.name, "declared": declared, "oracle_passed": oracle_passed,
        "invariant": first is None, "fields": list(FIELDS),
        "configurations": [_configuration_entry(c, outcomes.get(c.name), left_out.get(c.name))
                           for c in scenario.configurations],
        "left_out": left_out, "first_difference": first.to_dict() if first is not None else None,
    }
    if first is not None and declared:
        hints.append(f"{engine_cls.name} declares its batch-invariant mode as: {declared}; this run's engine args: "
                     f"{dict(engine_args or {}) or 'none'}")
    if hints:
        report.meta["hint"] = "; ".join(hints)
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device),
                       options={k_: str(v) for k_, v in base_options.non_default().items()})
    return report


def _nothing_to_compare(scenario: Scenario, baseline: Configuration, left_out: dict[str, list[str]]) -> str:
    return (f"{scenario.id}: no configuration but the baseline ({baseline.name}) can run here, so there is nothing "
            "to compare it with: " + "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in left_out.items()))


def _configuration_entry(config: Configuration, outcome: dict | None, reasons: list[str] | None) -> dict:
    """One configuration of an invariance report: what it ran and how it came out ("baseline" with the oracle's
    verdict on it, "identical", "differs" with its first difference, or "left out" with the reasons)."""
    entry = {"name": config.name, "about": config.about,
             "options": {k_: str(v) for k_, v in config.options.non_default().items()},
             "neighbours": [s.prompt_len for s in config.neighbours], "order_seed": config.order_seed}
    return entry | (outcome if outcome is not None else {"status": "left out", "reasons": reasons or []})


def _refuse_invariance(scenario: Scenario, mode: str) -> None:
    if scenario.kind == "invariance":
        raise ScenarioSkipped([f"{scenario.id}: {mode} judges results within a budget; an invariance scenario "
                               "compares one engine's runs bit for bit and judges its baseline against the oracle "
                               "(run it without --against)"])


def _refuse_sampled(requests: Sequence[Request], mode: str) -> None:
    if any(r.samples for r in requests):
        raise ScenarioSkipped([f"sampled requests: {mode} compares two runs' own continuations position by "
                               "position, and two runs draw different tokens wherever a draw falls near a tie; "
                               "a sampled scenario is judged against the oracle"])


def check_relative(engine: str | type[Engine], scenario: Scenario, *, baseline_options: EngineOptions,
                   oracle: Oracle, source: PromptSource, dtype: str | torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", k: float = DEFAULT_K, atol: float | None = None,
                   top_k: int = 5) -> Report:
    """Judge `engine` under the scenario's options against the same engine under `baseline_options`, on the
    scenario's requests, with the budget of its dtype (the oracle only calibrates it)."""
    _refuse_invariance(scenario, "a relative check")
    dtype = parse_dtype(dtype)
    engine_cls, options, requests = _prepare(engine, scenario, dtype=dtype, device=device,
                                             source=source, engine_args=None, top_k=top_k)
    _refuse_sampled(requests, "a relative check")
    budget = oracle.budget(requests, dtype, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype,
                           calibration=calibration_requests(oracle, source, top_k=top_k))
    with _open(engine_cls, oracle.checkpoint, dtype=dtype, device=device, options=baseline_options) as engine_a:
        baseline = engine_a.run(requests)
    with _open(engine_cls, oracle.checkpoint, dtype=dtype, device=device, options=options) as engine_b:
        report = compare_runs(scenario=scenario.id, requests=requests, baseline=baseline,
                              candidate=engine_b.run(requests), budget=budget, rerun=engine_b.run,
                              baseline_name=f"{engine_cls.name} {baseline_options.non_default() or 'defaults'}")
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device), relative=True)
    return report


def check_against(engine: str | type[Engine], scenario: Scenario, *, against: str | type[Engine], oracle: Oracle,
                  source: PromptSource, dtype: str | torch.dtype = torch.float32,
                  against_dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
                  k: float = DEFAULT_K, atol: float | None = None, engine_args: dict | None = None,
                  against_args: dict | None = None, top_k: int = 5, progress: Progress | None = None) -> Report:
    """Judge `engine` in `dtype` directly against the engine `against` in `against_dtype` (default: that engine's
    default dtype), both under the scenario's options, on the scenario's requests. Raises ScenarioSkipped where
    either engine cannot honour the scenario (the baseline's reasons say so).

    The budget is the oracle's budget for the candidate's dtype PLUS its budget for the baseline's dtype (same k;
    atol, when given, is the floor of each side). Neither side is exact: each carries its own rounding error, up to
    its own budget away from the fp64 truth, and the two errors may point in opposite directions, so
    |candidate - baseline| <= |candidate - oracle| + |oracle - baseline| is all that two correct engines guarantee.
    A float64 baseline adds (nearly) nothing; two bfloat16 engines get twice the bfloat16 budget."""
    _refuse_invariance(scenario, "a check against another engine")
    dtype = parse_dtype(dtype)
    base_cls = get_engine(against) if isinstance(against, str) else against
    against_dtype = base_cls.default_dtype if against_dtype is None else parse_dtype(against_dtype)
    engine_cls, options, requests = _prepare(engine, scenario, dtype=dtype, device=device,
                                             source=source, engine_args=engine_args, top_k=top_k)
    _refuse_sampled(requests, "a check against another engine")
    try:
        _, base_options, _ = _prepare(base_cls, scenario, dtype=against_dtype, device=device, source=source,
                                      engine_args=against_args, top_k=top_k)
        base_engine = _open(base_cls, oracle.checkpoint, dtype=against_dtype, device=device, options=base_options)
    except ScenarioSkipped as skip:
        raise ScenarioSkipped([f"baseline {base_cls.name}: {r}" for r in skip.reasons]) from skip
    baseline_name = f"{base_cls.name} {dtype_name(against_dtype)}"
    with base_engine:
        reasons = base_engine.cannot_run(requests)
        if reasons:
            raise ScenarioSkipped([f"baseline {base_cls.name}: {r}" for r in reasons])
        _enter(progress, f"baseline {baseline_name}", base_engine)
        baseline = oracle.run_beside(base_engine, requests, against_dtype)
    _enter(progress, "budget")
    calibration = calibration_requests(oracle, source, top_k=top_k)
    own, theirs = (oracle.budget(requests, d, k=k, atol=atol, ssm_state_dtype=options.ssm_state_dtype,
                                 calibration=calibration) for d in (dtype, against_dtype))
    routing = {rid: [a + b for a, b in zip(own.routing.get(rid, []), theirs.routing.get(rid, []))]
               for rid in own.routing} if own.routing and theirs.routing else (own.routing or theirs.routing)
    budget = Budget(k, own.atol + theirs.atol, own.reference_error + theirs.reference_error, routing=routing)
    with _open(engine_cls, oracle.checkpoint, dtype=dtype, device=device, options=options) as candidate:
        reasons = candidate.cannot_run(requests)
        if reasons:
            raise ScenarioSkipped(reasons)
        _enter(progress, engine_cls.name, candidate)
        report = compare_runs(scenario=scenario.id, requests=requests, baseline=baseline,
                              candidate=oracle.run_beside(candidate, requests, dtype), budget=budget,
                              rerun=lambda forced: oracle.run_beside(candidate, forced, dtype),
                              baseline_name=baseline_name)
        if candidate.provenance():
            report.meta["engine_provenance"] = candidate.provenance()
    report.meta.update(engine=engine_cls.name, dtype=dtype_name(dtype), device=str(device), baseline=baseline_name,
                       options={k_: str(v) for k_, v in options.non_default().items()})
    return report
