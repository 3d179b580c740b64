"""llama.cpp as an engine: the checkpoint converted by llama.cpp's own converter, run through llama.h
(llama-cpp-python's low-level binding) in a worker process of its own virtualenv (harness/adapters/llamacpp_worker.py).

llama-cpp-python is built from its sdist (`make llamacpp-venv`, docs/llamacpp.md), which vendors llama.cpp and its
converter (convert_hf_to_gguf.py). The interpreter is $BAMBA_LLAMACPP_PYTHON, else `.venv-llamacpp/bin/python`; the
converter's folder $BAMBA_LLAMACPP_SOURCE, else the one the Makefile unpacked into `.venv-llamacpp/src`.

Conversion is part of the system under test: the checkpoint goes through the converter unchanged, to an f32, f16 or
bf16 GGUF by the run's dtype, cached under $BAMBA_GGUF_CACHE (default .cache/gguf) by the checkpoint's content
hash. A checkpoint the converter refuses raises ConversionError with the converter's own message (the scenario is an
ERROR). engine_args opt in to what is not the converter's plain run, and the report says so (provenance):
- pre_tokenizer=NAME: the documented way past "BPE pre-tokenizer was not recognized" (every tokenizer trained for a
  small model is unknown to the converter): write NAME (e.g. gpt-2) as the tokenizer's pre-tokenizer. Token ids,
  and so what the harness judges, do not depend on it.
- convert_patch=FILE[::FUNCTION]: a finding's converter patch (findings/llamacpp_*.py), which its test applies to
  show a cause.

The scheduler is the harness's (harness/schedule.py, vLLM-like; llama.h has none, its callers schedule): each
planned step is one llama_batch, every piece in the sequence of its request's slot, and one llama_decode. So:
max_num_batched_tokens is the batch size (n_batch; n_ubatch the same unless engine_args n_ubatch splits the batch
inside llama.cpp too), max_num_seqs and the requests in flight give n_seq_max, a preempted request (num_kv_blocks,
kv_block_size) has its sequence removed (llama_memory_seq_rm) and is recomputed from position 0, a finished
request's slot is reused by the next one. Other engine_args: threads (default 1), flash_attn (auto, llama.cpp's
default | on | off), kv_type (f32 | f16; default f32 for an f32 GGUF, else f16), state_roundtrip=1 (after every step
each unfinished sequence is saved with llama_state_seq_get_data, removed and restored: a server swapping a slot
out and back), startup_timeout, run_timeout. Not honoured (skipped with the reason): tensor and pipeline
parallelism, CUDA graphs, a 16-bit SSM state (llama.cpp keeps its recurrent state in f32), CUDA, sampling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from ..engine import Engine, EngineOptions, Request, RequestResult, dtype_name, log_softmax, result_from_logprobs
from ..scenarios import Scenario, batching_shapes, chunked_shapes
from ..schedule import RequestShape, plan_options, plan_steps
from .subprocess_worker import WorkerError, WorkerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV, SOURCE_ENV, CACHE_ENV = "BAMBA_LLAMACPP_PYTHON", "BAMBA_LLAMACPP_SOURCE", "BAMBA_GGUF_CACHE"
DEFAULT_VENV = REPO_ROOT / ".venv-llamacpp"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "gguf"
WORKER_SCRIPT = Path(__file__).with_name("llamacpp_worker.py")
CONVERT_SCRIPT = Path(__file__).with_name("llamacpp_convert.py")

OUTTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FLASH_ATTN = ("auto", "on", "off")
KV_TYPES = ("f32", "f16")
DEFAULT_STARTUP_TIMEOUT = 300.0
DEFAULT_RUN_TIMEOUT = 600.0
CONVERT_TIMEOUT = 3600.0
CTX_ALIGN = 256                      # n_ctx per sequence is rounded up to this many cells
_CHANGELOG_UPDATE = re.compile(r"llama\.cpp to ggml-org/llama\.cpp@([0-9a-f]{7,40})")


class ConversionError(RuntimeError):
    """llama.cpp's converter refused the checkpoint; the message is the converter's own."""


class LoadError(RuntimeError):
    """llama.cpp refused (or aborted on) the GGUF its converter wrote; the message is llama.cpp's own."""


_LOAD_ERROR = re.compile(r"(error loading model: .*|GGML_ASSERT\(.*\) failed|unknown pre-tokenizer type.*)")


def load_error(log_path: Path) -> str | None:
    """llama.cpp's own words for why a model did not load, from a worker's log (its last such line)."""
    try:
        found = _LOAD_ERROR.findall(Path(log_path).read_text(errors="replace"))
    except FileNotFoundError:
        return None
    return found[-1].strip() if found else None


def llamacpp_python() -> Path:
    return Path(os.environ.get(PYTHON_ENV) or DEFAULT_VENV / "bin" / "python")


def llamacpp_source() -> Path | None:
    """The vendored llama.cpp folder (convert_hf_to_gguf.py beside gguf-py/), or None where there is none."""
    if os.environ.get(SOURCE_ENV):
        return Path(os.environ[SOURCE_ENV])
    found = sorted((DEFAULT_VENV / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


def source_provenance(source: Path) -> dict:
    """llama-cpp-python's version (the sdist folder's name) and the llama.cpp commit it vendors (its CHANGELOG's
    latest 'update llama.cpp to ...@COMMIT' line: an sdist carries no git metadata)."""
    sdist = source.parents[1]
    version = sdist.name.removeprefix("llama_cpp_python-")
    commit = None
    changelog = sdist / "CHANGELOG.md"
    if changelog.is_file():
        match = _CHANGELOG_UPDATE.search(changelog.read_text(errors="replace"))
        commit = match.group(1) if match else None
    return {"llama_cpp_python": version, "llama_cpp_commit": commit}


_hashes: dict[tuple, str] = {}


def checkpoint_hash(checkpoint: Path) -> str:
    """sha256 of every file the converter reads (config, weights, tokenizer files), names included; memoised per
    process by (path, size, mtime) of each file."""
    files = sorted(p for p in checkpoint.iterdir() if p.is_file() and not p.name.startswith("."))
    key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _hashes:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(block)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def converter_message(log: str) -> str:
    """What the converter said when it refused: its last exception line, else its last ERROR lines."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    exceptions = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Exit)\b.*:", line)]
    if exceptions:
        return exceptions[-1]
    errors = [line for line in lines if line.startswith("ERROR") or "error" in line.lower()]
    return " | ".join(errors[-3:]) or (lines[-1] if lines else "(no output)")


_refusals: dict[str, str] = {}


def convert(checkpoint: Path, outtype: str, *, pre_tokenizer: str | None = None, patch: str | None = None) -> Path:
    """The GGUF of `checkpoint` as llama.cpp's converter writes it (cached); ConversionError where it refuses.
    patch: FILE or FILE::FUNCTION, a finding's converter patch (llamacpp_convert.py)."""
    source = llamacpp_source()
    patch_text = Path(patch.partition("::")[0]).read_text() + patch.partition("::")[2] if patch else None
    key = hashlib.sha256(json.dumps([checkpoint_hash(checkpoint), outtype, pre_tokenizer, source_provenance(source),
                                     patch_text]).encode()).hexdigest()[:24]
    cache = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
    target = cache / f"{checkpoint.name}-{outtype}-{key}.gguf"
    if target.is_file():
        return target
    if key in _refusals:                      # a refusal is not cached on disk, but is not repeated in one process
        raise ConversionError(_refusals[key])
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache)) / target.name
    argv = [str(llamacpp_python()), str(CONVERT_SCRIPT), str(source), str(checkpoint), str(partial), outtype]
    if pre_tokenizer:
        argv += ["--pre-tokenizer", pre_tokenizer]
    if patch:
        argv += ["--patch", patch]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CONVERT_TIMEOUT,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if done.returncode or not partial.is_file():
            hint = ""
            if "pre-tokenizer was not recognized" in done.stderr:
                hint = (" (the documented way past it, opt-in: --engine-arg pre_tokenizer=gpt-2; token ids, and so "
                        "the logprobs judged, do not depend on it)")
            _refusals[key] = (f"llama.cpp's converter refused {checkpoint} (exit {done.returncode}): "
                              f"{converter_message(done.stderr + done.stdout)}{hint}")
            raise ConversionError(_refusals[key])
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
        partial.parent.rmdir()
    return target


def slot_plan(steps, n_requests: int, total: list[int]) -> tuple[list[int], int]:
    """A sequence id (slot) per request and how many slots the plan needs: a request takes the lowest free slot at
    its first piece and frees it after the step that feeds its last position (total[i] of them), so later requests
    reuse the slots of finished ones, as a server's do."""
    slots, free, used = [-1] * n_requests, [], 0
    for step in steps:
        for piece in step.pieces:
            if slots[piece.request] < 0:
                if free:
                    slots[piece.request] = free.pop(0)
                else:
                    slots[piece.request], used = used, used + 1
        for piece in step.pieces:
            if piece.stop == total[piece.request]:
                free = sorted(free + [slots[piece.request]])
    return slots, max(used, 1)


class LlamaCppEngine(Engine):
    name = "llamacpp"
    families = ("bamba", "granitemoehybrid")
    default_dtype = torch.float32
    engine_arg_names = frozenset({"pre_tokenizer", "convert_patch", "threads", "flash_attn", "kv_type", "n_ubatch",
                                  "state_roundtrip", "startup_timeout", "run_timeout"})
    has_scheduler = True
    opt_in = True
    default_ssm_state_dtype: ClassVar[str | None] = "float32"

    @classmethod
    def dependency_problem(cls) -> str | None:
        python = llamacpp_python()
        if not python.exists():
            return (f"no llama.cpp environment: {python} does not exist (run `make llamacpp-venv`, or point "
                    f"${PYTHON_ENV} at a python that has llama_cpp)")
        source = llamacpp_source()
        if source is None or not (source / "convert_hf_to_gguf.py").is_file():
            return (f"no llama.cpp converter: {source or DEFAULT_VENV / 'src'} holds no convert_hf_to_gguf.py (run "
                    f"`make llamacpp-venv`, or point ${SOURCE_ENV} at a llama.cpp source folder)")
        return None

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons, args = [], options.engine_args
        if dtype not in OUTTYPES:
            reasons.append(f"dtype {dtype_name(dtype)}: llama.cpp's converter writes f32, f16 or bf16 GGUFs")
        if device.type != "cpu":
            reasons.append(f"device {device.type}: the llama.cpp built here (make llamacpp-venv) runs on the CPU")
        if options.tensor_parallel_size > 1 or options.pipeline_parallel_size > 1:
            reasons.append(f"tensor_parallel_size = {options.tensor_parallel_size}, pipeline_parallel_size = "
                           f"{options.pipeline_parallel_size}: llama.cpp splits a model only across GPUs")
        if options.cuda_graphs:
            reasons.append("cuda_graphs: llama.cpp's CUDA backend captures graphs on its own, with no llama.h knob; "
                           "the build here is CPU-only")
        if options.ssm_state_dtype not in (None, "float32", "fp32"):
            reasons.append(f"ssm_state_dtype = {options.ssm_state_dtype}: llama.cpp keeps its recurrent state in f32 "
                           "(llama_context_params has no type for it)")
        if args.get("flash_attn", "auto") not in FLASH_ATTN:
            reasons.append(f"flash_attn: expected one of {', '.join(FLASH_ATTN)}, got {args['flash_attn']!r}")
        if args.get("kv_type", "f32") not in KV_TYPES:
            reasons.append(f"kv_type: expected one of {', '.join(KV_TYPES)}, got {args['kv_type']!r}")
        elif args.get("kv_type") == "f16" and dtype == torch.float32:
            reasons.append("kv_type f16 under an f32 GGUF: a mixed precision that no budget is calibrated for (the "
                           "fp32 one is 100x too tight for f16 keys and values); judge it with --dtype float16")
        for key in ("threads", "n_ubatch"):
            if key in args and not (str(args[key]).isdigit() and int(args[key]) >= 1):
                reasons.append(f"{key}: expected a positive integer, got {args[key]!r}")
        if str(args.get("state_roundtrip", "0")) not in ("0", "1"):
            reasons.append(f"state_roundtrip: expected 0 or 1, got {args['state_roundtrip']!r}")
        if "convert_patch" in args and not Path(args["convert_patch"].partition("::")[0]).is_file():
            reasons.append(f"convert_patch: {args['convert_patch']} is not a file")
        return reasons

    @classmethod
    def engine_scenarios(cls, cfg) -> list[Scenario]:
        """llama.cpp's own knobs, each a scenario whose options set engine_args (docs/llamacpp.md):
        threads 1 and 2 (the same numbers expected: tests/llamacpp checks them bit for bit), flash attention off and
        on (llama.cpp's default, auto, turns it on), K/V cache f32 and f16, n_ubatch below the step's tokens (the
        batch split inside llama.cpp, at W-2, Q-1, Q and Q+1 tokens, mid-piece), and a sequence state saved,
        removed and restored after every step (llama_state_seq_*)."""
        Q, W = cfg.mamba_chunk_size, cfg.mamba_d_conv
        batch, chunked = batching_shapes(Q, W), chunked_shapes(Q, W)
        out = [Scenario(f"threads-{n}", "threads", EngineOptions(engine_args={"threads": str(n)}), batch,
                        f"the batching workload in one batch on {n} thread{'s' if n > 1 else ''}") for n in (1, 2)]
        out += [Scenario(f"flash_attn-{mode}", "flash_attn", EngineOptions(engine_args={"flash_attn": mode}), batch,
                         f"the batching workload in one batch, flash attention {mode} (llama.cpp's default: auto)")
                for mode in ("off", "on")]
        out += [Scenario(f"kv_cache-{kind}", "kv_cache", EngineOptions(engine_args={"kv_type": kind}), batch,
                         f"the batching workload with a {kind} K/V cache") for kind in KV_TYPES]
        step = 3 * Q + 2
        for ubatch in sorted({max(W - 2, 1), Q - 1, Q, Q + 1}):
            options = EngineOptions(max_num_batched_tokens=step, engine_args={"n_ubatch": str(ubatch)})
            out.append(Scenario(f"ubatch{ubatch}-batch{step}-Q{Q}", "ubatch", options, chunked,
                                f"steps of up to {step} tokens, each split by llama.cpp into micro-batches of "
                                f"{ubatch} (n_ubatch): splits inside pieces, beside the harness's own step "
                                "boundaries"))
        roundtrip = EngineOptions(max_num_batched_tokens=Q + 1, engine_args={"state_roundtrip": "1"})
        out.append(Scenario(f"state_restore-budget{Q + 1}-Q{Q}", "state_restore", roundtrip, chunked,
                            f"token budget {Q + 1}; after every step each unfinished sequence is saved "
                            "(llama_state_seq_get_data), removed and restored (llama_state_seq_set_data)"))
        return out

    def _load(self) -> None:
        args = self.options.engine_args
        self.worker: WorkerProcess | None = None
        self.context: dict = {}
        self.context_key: dict = {}
        self.kv_type = args.get("kv_type", "f32" if self.dtype == torch.float32 else "f16")
        self.flash_attn = args.get("flash_attn", "auto")
        self.threads = int(args.get("threads", 1))
        patch = args.get("convert_patch")
        self.gguf = convert(self.checkpoint, OUTTYPES[self.dtype], pre_tokenizer=args.get("pre_tokenizer"),
                            patch=patch)
        source = llamacpp_source()
        self._provenance = {**source_provenance(source), "gguf": self.gguf.name, "outtype": OUTTYPES[self.dtype],
                            "pre_tokenizer_workaround": args.get("pre_tokenizer"),
                            "convert_patch": patch, "kv_type": self.kv_type,
                            "flash_attn": self.flash_attn, "threads": self.threads}

    def oracle_hint(self, cfg, oracle_gated_norm: str) -> str | None:
        """The known reasons (docs/llamacpp.md's findings) why llama.cpp computes another model than this checkpoint
        defines, for a failed report: RoPE (partial, or dropped for GraniteMoeHybrid), Δ's clamp, f16 attention."""
        from ..llamacpp_cases import FINDINGS, oracle_fields_for

        _, findings = oracle_fields_for(cfg)
        if self.flash_attn != "off" and self.dtype == torch.float32:
            findings.append("flash-attention-f16")
        if not findings:
            return None
        return "known llama.cpp findings for this checkpoint (docs/llamacpp.md): " + "; ".join(
            f"{name}: {FINDINGS[name].title}" for name in findings)

    def provenance(self) -> dict:
        return dict(self._provenance, **self.context)

    def _start(self, context: dict) -> None:
        """A worker with a context of these parameters (the running one when they are the same)."""
        if self.worker is not None and context == self.context_key:
            return
        self._stop()
        env = {"OMP_NUM_THREADS": str(self.threads)}
        self.worker = WorkerProcess([str(llamacpp_python()), str(WORKER_SCRIPT)], what="llama.cpp worker", env=env,
                                    cwd=tempfile.gettempdir())
        timeout = float(self.options.engine_args.get("startup_timeout", DEFAULT_STARTUP_TIMEOUT))
        try:
            ready = self.worker.request({"cmd": "load", "gguf": str(self.gguf), "context": context}, timeout)
        except WorkerError as err:
            said = load_error(self.worker.log_path)
            status = self.worker.proc.poll()
            if said is None and status is not None and status < 0:
                said = f"the process loading it died of signal {signal.Signals(-status).name}"
            self._stop()
            if said:
                raise LoadError(f"llama.cpp cannot run {self.gguf.name} (converted from {self.checkpoint}): "
                                f"{said}") from err
            raise
        if ready.get("event") != "ready":
            self._stop()
            raise WorkerError(f"llama.cpp worker: expected a ready message, got {str(ready)[:300]}")
        effective = ready["effective"]
        for key in ("n_batch", "n_ubatch", "n_seq_max"):
            if int(effective[key]) != int(context[key]):
                self._stop()
                raise WorkerError(f"llama.cpp set {key} = {effective[key]}, asked {context[key]}")
        if effective["n_vocab"] < self.cfg.vocab_size:
            self._stop()
            raise WorkerError(f"the GGUF's vocabulary has {effective['n_vocab']} tokens, the checkpoint's "
                              f"{self.cfg.vocab_size}")
        self.context = {**context, "n_vocab": effective["n_vocab"], "system_info": effective["system_info"]}
        self.context_key = context

    def _stop(self) -> None:
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            worker.exit()

    def close(self) -> None:
        self._stop()
        super().close()

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        shapes = [RequestShape(len(r.prompt), r.max_new_tokens, r.arrival_step) for r in requests]
        steps = plan_steps(shapes, **plan_options(self.options))
        total = [len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in requests]
        slots, n_slots = slot_plan(steps, len(requests), total)
        n_batch = max(step.n_tokens for step in steps)
        n_ubatch = min(int(self.options.engine_args.get("n_ubatch", n_batch)), n_batch)
        per_sequence = -(-(max(total) + 1) // CTX_ALIGN) * CTX_ALIGN
        context = {"n_ctx": per_sequence * n_slots, "n_batch": n_batch, "n_ubatch": n_ubatch, "n_seq_max": n_slots,
                   "n_threads": self.threads, "flash_attn": self.flash_attn, "type_k": self.kv_type,
                   "type_v": self.kv_type}
        self._start(context)
        payload = {"cmd": "run", "roundtrip": str(self.options.engine_args.get("state_roundtrip", "0")) == "1",
                   "requests": [{"prompt": list(r.prompt), "max_new_tokens": r.max_new_tokens, "slot": slot}
                                for r, slot in zip(requests, slots)],
                   "steps": [[[p.request, p.start, p.stop] for p in step.pieces] for step in steps]}
        timeout = float(self.options.engine_args.get("run_timeout", DEFAULT_RUN_TIMEOUT))
        answer = self.worker.request(payload, timeout)
        results = answer.get("results", [])
        if answer.get("event") != "result" or len(results) != len(requests):
            raise WorkerError(f"llama.cpp worker: expected {len(requests)} results, got {str(answer)[:300]}")
        return [self._result(r, item) for r, item in zip(requests, results)]

    def _result(self, request: Request, item: dict) -> RequestResult:
        """The worker's logits rows as a result: log-softmax over llama.cpp's whole vocabulary (a GGUF may pad it
        past the checkpoint's: what the padding rows take is part of what llama.cpp computes), the checkpoint's
        tokens kept."""
        n_vocab = self.context["n_vocab"]
        logits = np.frombuffer(base64.b64decode(item["logits"]), dtype=np.float32).reshape(-1, n_vocab)
        logprobs = log_softmax(torch.from_numpy(logits.copy()))[:, :self.cfg.vocab_size]       # (T-1+n, V)
        outside = [t for t in item["output_ids"] if t >= self.cfg.vocab_size]
        if outside:
            raise WorkerError(f"llama.cpp, request {request.request_id!r}: generated token {outside[0]}, a padding "
                              f"entry of the GGUF's vocabulary (the checkpoint's has {self.cfg.vocab_size})")
        return result_from_logprobs(request, logprobs, item["output_ids"])
