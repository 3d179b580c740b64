"""lm-eval's model `bamba-harness`: any harness engine (reference, transformers, vendored, ...) behind lm-eval's API.

    bamba-harness lm-eval --model_args engine=vendored,checkpoint=DIR,dtype=bfloat16,max_num_batched_tokens=64 \\
        --tasks bamba_tiny --include_path fixtures/tasks

model_args: engine (default reference), checkpoint (default fixtures/tiny-bamba), dtype (the engine's default),
tokenizer (default: the checkpoint directory), max_length (default max_position_embeddings), max_gen_toks (256),
add_bos_token (false); the engine options (every field of harness.engine.EngineOptions: max_num_batched_tokens,
max_num_seqs, tensor_parallel_size, ...); and the engine's own engine_args (e.g. gated_norm=full for the reference).
Any other key is refused in one line, with the nearest known name, before anything is loaded (check_model_args; the
`bamba-harness lm-eval` command checks --model_args before lm-eval even starts indexing its tasks).
lm-eval's --batch_size is the number of requests handed to the engine in one call (the engine batches inside the
call with its own scheduler, max_num_seqs); --device is the engine's device.

Scoring, in the engine interface's terms (harness/engine.py): a loglikelihood request is one teacher-forced prompt
(context + continuation, cut from the left to max_length tokens) whose last len(continuation) prompt logprobs are
summed; is_greedy says whether each continuation token is the top-1 token at its position. loglikelihood_rolling
scores a text in disjoint windows of at most max_length tokens, each window conditioned on the one token before it
(the first on the prefix token), so every token is scored exactly once, as lm-eval's own models do. generate_until
decodes greedily for max_gen_toks tokens, cuts at the first end-of-text token and then at the first stop string
(equal to stopping there, since greedy decoding does not look ahead). Nothing is cached: every request is run.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from .adapters import engine_names, get_engine
from .engine import EngineOptions, Request, RequestResult

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO_ROOT / "fixtures" / "tiny-bamba"
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_GEN_TOKS = 256
# The model's own model_args (BambaHarnessLM's named parameters; lm-eval adds batch_size, max_batch_size, device).
MODEL_ARG_NAMES = ("engine", "checkpoint", "dtype", "device", "tokenizer", "max_length", "max_gen_toks",
                   "add_bos_token", "batch_size", "max_batch_size")
# Every knob a scenario turns is a model_arg too, by its EngineOptions name.
ENGINE_OPTION_NAMES = tuple(f.name for f in fields(EngineOptions) if f.name != "engine_args")
_BOOL_OPTIONS = frozenset(f.name for f in fields(EngineOptions) if isinstance(f.default, bool))
DEFAULT_ENGINE = "reference"
# Generation settings this model understands; greedy decoding is the only kind an engine of the harness does.
GEN_KWARG_NAMES = frozenset({"until", "max_gen_toks", "do_sample", "temperature"})


class LmEvalInputError(ValueError):
    """A request or setting this model cannot serve faithfully (named, never silently adapted)."""


def known_model_args(engine: str) -> list[str]:
    """Every model_arg accepted with `engine`: the model's own, the engine options and the adapter's engine_args."""
    return sorted({*MODEL_ARG_NAMES, *ENGINE_OPTION_NAMES, *get_engine(engine).engine_arg_names})


def _nearest(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def check_model_args(args: Mapping[str, Any]) -> None:
    """LmEvalInputError, in one line, for an unknown engine or a model_arg that neither this model, the engine
    options nor the chosen engine knows, naming the nearest known name. Called before anything is loaded: a
    misspelt option used to surface only once the engine was built, from the adapter, listing only its own
    engine_args (not the option meant, when that was an engine option)."""
    engine = args.get("engine", DEFAULT_ENGINE)
    if engine not in engine_names():
        raise LmEvalInputError(f"model_args engine={engine}: no such engine{_nearest(str(engine), engine_names())}; "
                               f"known: {', '.join(engine_names())}")
    known = known_model_args(engine)
    unknown = sorted(set(args) - set(known))
    if unknown:
        hints = "".join(f"{name}{_nearest(name, known)}, " for name in unknown).removesuffix(", ")
        raise LmEvalInputError(f"model_args {hints}: unknown to bamba-harness with engine {engine}; known: "
                               f"{', '.join(known)}")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LmEvalInputError(f"{name}: expected a positive integer, got {value!r}")
    return value


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], int]]:
    """Disjoint windows over [prefix_token] + tokens: (prompt, n_scored) pairs.

    Each prompt has at most max_length tokens and its last n_scored tokens are scored (n_scored = len(prompt) - 1:
    every token but the first, which only conditions). Consecutive windows share exactly that one token, so every
    token of `tokens` is scored exactly once and the first is conditioned on prefix_token.
    """
    if max_length < 2:
        raise LmEvalInputError(f"max_length: rolling windows need at least 2 tokens, got {max_length}")
    sequence = [prefix_token, *tokens]
    windows, start = [], 0
    while start < len(sequence) - 1:
        prompt = sequence[start:start + max_length]
        windows.append((prompt, len(prompt) - 1))
        start += max_length - 1
    return windows


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """text up to (not including) the earliest occurrence of any stop string."""
    end = len(text)
    for stop in stops:
        if stop:
            found = text.find(stop)
            if found != -1:
                end = min(end, found)
    return text[:end]


@register_model("bamba-harness")
class BambaHarnessLM(TemplateLM):
    """One harness engine as an lm-eval model (see the module docstring for model_args and scoring)."""

    def __init__(self, engine: str = DEFAULT_ENGINE, checkpoint: str | Path = DEFAULT_CHECKPOINT,
                 dtype: str | None = None, device: str | None = None, tokenizer: str | Path | None = None,
                 max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool = False,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, max_batch_size: int | None = None,
                 **options) -> None:
        """options: engine options (ENGINE_OPTION_NAMES) and the engine's engine_args, told apart by name."""
        check_model_args({"engine": engine, **options})
        super().__init__()
        from transformers import AutoTokenizer

        if batch_size is None:
            batch_size = DEFAULT_BATCH_SIZE
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            raise LmEvalInputError(f"batch_size = {batch_size!r}: give a number of requests per engine call (the "
                                   "engine batches inside a call with its own scheduler; see max_num_seqs)")
        self.batch_size = _positive_int("batch_size", int(batch_size))
        if max_batch_size is not None:
            self.batch_size = min(self.batch_size, _positive_int("max_batch_size", max_batch_size))
        knobs = {name: bool(value) if name in _BOOL_OPTIONS else value
                 for name, value in options.items() if name in ENGINE_OPTION_NAMES}
        options = EngineOptions(**knobs, engine_args={k: v for k, v in options.items() if k not in knobs})
        self.engine_name = engine
        self.engine = get_engine(engine)(checkpoint, dtype=dtype, device=device or "cpu", options=options)
        cfg = self.engine.cfg
        self.max_length = cfg.max_position_embeddings if max_length is None else _positive_int("max_length",
                                                                                               max_length)
        if self.max_length > cfg.max_position_embeddings and not options.allow_long_context:
            raise LmEvalInputError(f"max_length = {self.max_length} exceeds max_position_embeddings = "
                                   f"{cfg.max_position_embeddings}; pass allow_long_context=true to go beyond")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self._tokenizer_path = str(tokenizer or checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        if self.tokenizer.eos_token_id is None:
            raise LmEvalInputError(f"tokenizer {self._tokenizer_path}: no eos token (needed as end of text and as "
                                   "the prefix of rolling windows)")
        self._ids = 0

    # ---- what lm-eval asks of a model -----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer_path

    @property
    def device(self):
        return self.engine.device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def close(self) -> None:
        """Free the engine's model."""
        self.engine.close()

    # ---- running requests ---------------------------------------------------------------------------------------
    def _new_id(self, kind: str) -> str:
        self._ids += 1
        return f"{kind}-{self._ids}"

    def _run(self, requests: list[Request], desc: str, disable_tqdm: bool) -> list[RequestResult]:
        """All requests through the engine, batch_size at a time (longest first, so a padded batch wastes little),
        results in request order."""
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i].prompt) + requests[i].max_new_tokens))
        results: list[RequestResult | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc=f"{desc} ({self.engine_name})", unit="req", disable=disable_tqdm) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                for index, result in zip(chunk, self.engine.run([requests[i] for i in chunk])):
                    results[index] = result
                bar.update(len(chunk))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_enc, continuation_enc) triples, as TemplateLM builds them."""
        engine_requests, lengths, keys = [], [], []
        for (context, continuation), context_enc, continuation_enc in requests:
            n = len(continuation_enc)
            if n == 0:
                raise LmEvalInputError(f"continuation {continuation!r} of context {context[-40:]!r} is empty")
            if n >= self.max_length:
                raise LmEvalInputError(f"continuation of {n} tokens does not fit max_length = {self.max_length} "
                                       "with at least one token of context")
            prompt = (list(context_enc) + list(continuation_enc))[-self.max_length:]
            engine_requests.append(Request(self._new_id("ll"), prompt, 0, top_k=1))
            lengths.append(n)
            keys.append((context, continuation))
        out = []
        results = self._run(engine_requests, "loglikelihood", disable_tqdm)
        for request, result, n, key in zip(engine_requests, results, lengths, keys):
            target = list(request.prompt[-n:])
            logprob = float(result.prompt_logprobs[-n:].sum())
            greedy = result.prompt_top_ids[-n:, 0].tolist() == target
            out.append((logprob, greedy))
            self.cache_hook.add_partial("loglikelihood", key, (logprob, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        engine_requests, owner = [], []
        for index, instance in enumerate(requests):
            (text,) = instance.args
            for prompt, _ in rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                engine_requests.append(Request(self._new_id("rolling"), prompt, 0, top_k=1))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, result in zip(owner, self._run(engine_requests, "loglikelihood_rolling", disable_tqdm)):
            totals[index] += float(result.prompt_logprobs.sum())
        for instance, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", instance.args, total)
        return totals

    def _generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int]:
        """(stop strings, max_gen_toks) from a request's gen_kwargs; anything but greedy decoding is refused."""
        unknown = sorted(set(gen_kwargs) - GEN_KWARG_NAMES)
        if unknown:
            raise LmEvalInputError(f"generation kwargs {unknown}: not understood (known: {sorted(GEN_KWARG_NAMES)})")
        if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) != 0.0:
            raise LmEvalInputError(f"do_sample = {gen_kwargs.get('do_sample')}, temperature = "
                                   f"{gen_kwargs.get('temperature')}: the harness engines decode greedily only")
        until = gen_kwargs.get("until") or []
        stops = [until] if isinstance(until, str) else list(until)
        return stops, _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        engine_requests, stops = [], []
        for instance in requests:
            context, gen_kwargs = instance.args
            request_stops, max_new = self._generation_settings(dict(gen_kwargs))
            # The last generated token is never fed back, so prompt + max_new - 1 positions must fit.
            keep = self.max_length - max_new + 1
            if keep < 1:
                raise LmEvalInputError(f"max_gen_toks = {max_new} leaves no room for a prompt in max_length = "
                                       f"{self.max_length}")
            prompt = (self.tok_encode(context) if context else [self.prefix_token_id])[-keep:]
            engine_requests.append(Request(self._new_id("gen"), prompt, max_new, top_k=1))
            stops.append(request_stops)
        out = []
        for instance, result, request_stops in zip(requests, self._run(engine_requests, "generate_until",
                                                                       disable_tqdm), stops):
            ids = result.output_ids
            if self.eot_token_id in ids:
                ids = ids[:ids.index(self.eot_token_id)]
            text = cut_at_stops(self.tokenizer.decode(ids, skip_special_tokens=False), request_stops)
            out.append(text)
            self.cache_hook.add_partial("generate_until", instance.args, text)
        return out


# ---- the command line ---------------------------------------------------------------------------------------------
LM_EVAL_SUBCOMMANDS = ("run", "ls", "validate")


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def lm_eval_argv(argv: Sequence[str]) -> list[str]:
    """lm-eval's arguments with this project's defaults where a run does not set them: --model bamba-harness,
    --device cuda where there is a CUDA device else cpu (lm-eval's own default is cuda:0), --batch_size 64 requests
    per engine call (lm-eval's own default of 1 would hand the engine one request at a time)."""
    import torch

    argv = list(argv)
    is_run = not argv or argv[0] == "run" or argv[0] not in LM_EVAL_SUBCOMMANDS
    if not is_run or not argv or argv in (["run"], ["-h"], ["--help"]):
        return argv
    defaults = {"--model": "bamba-harness", "--device": "cuda" if torch.cuda.is_available() else "cpu",
                "--batch_size": str(DEFAULT_BATCH_SIZE)}
    extra = [part for flag, value in defaults.items() if not _given(argv, flag) for part in (flag, value)]
    return ([argv[0], *extra, *argv[1:]] if argv[0] == "run" else ["run", *extra, *argv])


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in argv (`--flag V` or `--flag=V`; the last one wins, as with argparse), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def run_lm_eval(argv: Sequence[str]) -> int:
    """`bamba-harness lm-eval ...`: lm-eval's own command line (lm_eval.__main__) with the model registered.

    With the bamba-harness model, --model_args are checked first (check_model_args): lm-eval indexes its tasks
    before it builds the model, so a misspelt option would otherwise cost that wait and end in a traceback."""
    import sys

    from lm_eval.utils import simple_parse_args_string

    argv = lm_eval_argv(argv)
    model_args = _flag_value(argv, "--model_args")
    if _flag_value(argv, "--model") == "bamba-harness" and model_args is not None:
        try:
            check_model_args(simple_parse_args_string(model_args))
        except (ValueError, RuntimeError) as err:       # LmEvalInputError, UnknownEngine, EngineUnavailable
            print(f"bamba-harness lm-eval: error: {err}", file=sys.stderr)
            return 2

    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as stop:        # argparse's usage errors and --help
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
    return 0
