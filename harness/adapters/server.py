"""An OpenAI-compatible completion server as an engine: the harness judges a running deployment (vLLM, SGLang, ...)
exactly as it judges an in-process engine.

Each request is one POST /v1/completions with the prompt as token ids, temperature 0, `max_tokens` new tokens and
`logprobs` top-k alternatives; prompt logprobs come from `echo` (OpenAI's way) or from vLLM's `prompt_logprobs`
extension (`logprobs_mode`). Token ids come back as "token_id:N" (vLLM's `return_tokens_as_token_ids`); a server that
answers with token strings is refused rather than guessed at. Requests go out at most `concurrency` at a time, each
with a timeout, retried on connection errors only. Before any number is trusted the adapter checks that the server
serves the expected model (GET /v1/models) and this checkpoint's vocabulary (a probe prompt holding the last
token id must echo back the very ids sent, and token id V must be refused). A server found unreachable or silent
(a timeout) is remembered by URL for the rest of the process: every later request to it, in this scenario or the
next, fails at once with the same message instead of waiting out the timeout again.

A server's batching knobs live in its launch flags. With `launch` (a command template) the adapter starts the server
itself on a free loopback port, with the scenario's knobs filled in, waits until it answers, and stops it (its whole
process group) when the engine closes; a non-default knob whose placeholder the template lacks is unsupported.
Without `launch` the server runs as it was started, so every non-default knob is unsupported.

engine_args: base_url (or $BAMBA_SERVER_URL), model (the served name; default: the only one served), api_key_env
(the environment variable holding the API key; default BAMBA_SERVER_API_KEY; the key is sent as a bearer token and
never printed), concurrency (default 8), timeout (s per HTTP request, default 120), retries (connection errors,
default 3), logprobs_mode ("echo" default, or "prompt_logprobs"), launch, launch_timeout (s, default 600).
Template fields: {python} (the vLLM interpreter), {checkpoint}, {granite_checkpoint} (converted as the vllm adapter
does), {host}, {port}, {dtype}, {max_num_batched_tokens}, {max_num_seqs}, {tensor_parallel_size},
{pipeline_parallel_size}, {ssm_state_dtype}, {enforce_eager} ("--enforce-eager" or ""),
{long_prefill_token_threshold} (0: off). num_kv_blocks and kv_block_size have no field: a server sizes its own cache.
"""

from __future__ import annotations

import json
import os
import socket
import string
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from typing import Any

import torch

from ..engine import Engine, EngineOptions, Request, RequestResult, dtype_name
from .server_launch import LaunchedServer

URL_ENV = "BAMBA_SERVER_URL"
DEFAULT_API_KEY_ENV = "BAMBA_SERVER_API_KEY"
DEFAULT_CONCURRENCY = 8
DEFAULT_TIMEOUT = 120.0
DEFAULT_RETRIES = 3
PROBE_LENGTH = 6

# Knob -> template field. A launched server honours a knob only if its field is in the template.
_KNOB_FIELDS = {"max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
                "long_prefill_token_threshold": "long_prefill_token_threshold",
                "tensor_parallel_size": "tensor_parallel_size", "pipeline_parallel_size": "pipeline_parallel_size",
                "ssm_state_dtype": "ssm_state_dtype", "cuda_graphs": "enforce_eager"}


class ServerError(RuntimeError):
    """The server is unreachable, serves something else, answers with an HTTP error, malformed JSON or too late."""


# Base URL -> the message that found the server unreachable or silent, for the whole process: a server that took
# the full timeout once (accepting connections and never answering) would otherwise take it again in every scenario
# and every request. HTTP errors and malformed answers are answers: they are not remembered.
_failed_servers: dict[str, str] = {}
_failed_servers_lock = threading.Lock()
REMEMBERED_NOTE = " (found earlier in this process; not asked again)"


def _remember_failure(base_url: str, message: str) -> ServerError:
    with _failed_servers_lock:
        _failed_servers.setdefault(base_url, message)
    return ServerError(message)


def template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


class ServerEngine(Engine):
    name = "server"
    default_dtype = torch.float32
    engine_arg_names = frozenset({"base_url", "model", "api_key_env", "concurrency", "timeout", "retries",
                                  "logprobs_mode", "launch", "launch_timeout"})
    opt_in = True
    samples = True                  # temperature and seed go in the completion request's body

    @classmethod
    def _unsupported(cls, options: EngineOptions, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        args = options.engine_args
        launch = args.get("launch")
        if launch is None and not (args.get("base_url") or os.environ.get(URL_ENV)):
            return [f"no server: give engine_args base_url (or ${URL_ENV}) or a launch command template"]
        if args.get("logprobs_mode", "echo") not in ("echo", "prompt_logprobs"):
            return [f"logprobs_mode: expected 'echo' or 'prompt_logprobs', got {args['logprobs_mode']!r}"]
        fields = template_fields(launch) if launch else set()
        reasons = []
        for knob, value in options.non_default().items():
            if knob in ("engine_args", "allow_long_context"):
                continue
            if launch is None:
                reasons.append(f"{knob} = {value}: the server runs with the flags it was started with (give a launch "
                               "template to set it)")
            elif _KNOB_FIELDS.get(knob) not in fields:
                reasons.append(f"{knob} = {value}: the launch template has no {{{_KNOB_FIELDS.get(knob, knob)}}}")
        return reasons

    # ---- connection ---------------------------------------------------------------------------------------------

    def _load(self) -> None:
        args = self.options.engine_args
        self.concurrency = int(args.get("concurrency", DEFAULT_CONCURRENCY))
        self.timeout = float(args.get("timeout", DEFAULT_TIMEOUT))
        self.retries = int(args.get("retries", DEFAULT_RETRIES))
        self.logprobs_mode = args.get("logprobs_mode", "echo")
        self._api_key = os.environ.get(args.get("api_key_env", DEFAULT_API_KEY_ENV)) or None
        self.server: LaunchedServer | None = None
        if args.get("launch"):
            self.server = LaunchedServer(args["launch"], self._launch_fields(),
                                         timeout=float(args.get("launch_timeout", 600)))
            self.base_url = self.server.base_url
            try:   # refused connections are expected while it starts: not remembered as a failure
                self.server.wait_until_ready(lambda: self._get("/v1/models", retries=0, remember=False))
            except BaseException:
                self.server.stop()
                raise
        else:
            self.base_url = (args.get("base_url") or os.environ[URL_ENV]).rstrip("/")
        try:
            self.model = self._check_model(args.get("model"))
            self._check_vocabulary()
        except BaseException:
            self.close()
            raise

    def _launch_fields(self) -> dict[str, Any]:
        from .vllm import granite_checkpoint, vllm_python

        opts = self.options
        template = self.options.engine_args["launch"]
        fields = {
            "python": str(vllm_python()), "checkpoint": str(self.checkpoint), "host": "127.0.0.1",
            "dtype": dtype_name(self.dtype), "max_num_batched_tokens": opts.max_num_batched_tokens or 8192,
            "max_num_seqs": opts.max_num_seqs or 64, "tensor_parallel_size": opts.tensor_parallel_size,
            "pipeline_parallel_size": opts.pipeline_parallel_size, "ssm_state_dtype": opts.ssm_state_dtype or "auto",
            "enforce_eager": "" if opts.cuda_graphs else "--enforce-eager",
            "long_prefill_token_threshold": opts.long_prefill_token_threshold or 0,      # vLLM: 0 is off
        }
        if "granite_checkpoint" in template_fields(template):
            fields["granite_checkpoint"] = str(granite_checkpoint(self.checkpoint))
        return fields

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop()
            self.server = None
        super().close()

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def _http(self, method: str, path: str, body: dict | None, *, retries: int | None = None,
              remember: bool = True) -> Any:
        """One JSON call with retries on connection errors; ServerError with a clear message otherwise. A server
        already found unreachable or silent fails at once; `remember`: record such a finding here."""
        with _failed_servers_lock:
            known = _failed_servers.get(self.base_url)
        if known is not None:
            raise ServerError(known + REMEMBERED_NOTE)

        def failure(message: str) -> ServerError:
            return _remember_failure(self.base_url, message) if remember else ServerError(message)

        url = self.base_url + path
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = json.dumps(body).encode() if body is not None else None
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as err:
                detail = err.read()[:500].decode(errors="replace")
                raise ServerError(self._redact(f"server {self.base_url} answered HTTP {err.code} to {method} {path}: "
                                               f"{detail}")) from None
            except (TimeoutError, socket.timeout) as err:
                raise failure(f"server {self.base_url} did not answer {method} {path} within {self.timeout:g} s "
                              f"({err})") from None
            except (urllib.error.URLError, ConnectionError, HTTPException, OSError) as err:
                reason = getattr(err, "reason", err)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise failure(f"server {self.base_url} did not answer {method} {path} within "
                                  f"{self.timeout:g} s") from None
                if attempt + 1 == attempts:
                    raise failure(f"server {self.base_url} is unreachable ({method} {path}, {attempts} "
                                  f"attempts): {reason}") from None
                time.sleep(min(0.5 * 2 ** attempt, 5.0))
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(self._redact(f"server {self.base_url}: malformed response to {method} {path} (not "
                                           f"JSON): {raw[:300]!r}")) from None

    def _get(self, path: str, retries: int | None = None, remember: bool = True) -> Any:
        return self._http("GET", path, None, retries=retries, remember=remember)

    def _check_model(self, expected: str | None) -> str:
        listing = self._get("/v1/models")
        try:
            served = [entry["id"] for entry in listing["data"]]
        except (KeyError, TypeError):
            raise ServerError(f"server {self.base_url}: malformed response to GET /v1/models: "
                              f"{str(listing)[:300]}") from None
        if expected is not None:
            if expected not in served:
                raise ServerError(f"server {self.base_url} serves {served}, not the expected model {expected!r}")
            return expected
        if len(served) != 1:
            raise ServerError(f"server {self.base_url} serves {served}: name one with engine_args model")
        return served[0]

    def _check_vocabulary(self) -> None:
        """The last token id must come back as sent (same ids, same vocabulary), and id V must be refused."""
        V = self.cfg.vocab_size
        probe = Request("probe", tuple((7 * i + 3) % V for i in range(PROBE_LENGTH - 1)) + (V - 1,), 1, 1)
        self._complete(probe)
        try:
            self._http("POST", "/v1/completions", self._body(Request("probe-oov", (1, V), 1, 1)), retries=0)
        except ServerError as err:
            if "HTTP 4" in str(err):
                return
            raise
        raise ServerError(f"server {self.base_url} accepted token id {V}: its vocabulary is larger than the "
                          f"checkpoint's ({V}); is it serving another model?")

    # ---- requests -----------------------------------------------------------------------------------------------

    def _body(self, request: Request) -> dict:
        body = {"model": getattr(self, "model", None), "prompt": list(request.prompt), "temperature": 0.0,
                "max_tokens": max(request.max_new_tokens, 1), "logprobs": request.top_k,
                "return_tokens_as_token_ids": True, "ignore_eos": True}
        if request.samples:                              # sampled with the request's seed (OpenAI's `seed`)
            body.update(temperature=float(request.temperature), seed=int(request.seed))
        if self.logprobs_mode == "echo":
            body["echo"] = True
        else:
            body["prompt_logprobs"] = request.top_k
        return body

    def _run(self, requests: list[Request]) -> list[RequestResult]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(self._complete, requests))

    def _complete(self, request: Request) -> RequestResult:
        answer = self._http("POST", "/v1/completions", self._body(request))
        try:
            return parse_completion(request, answer, self.logprobs_mode)
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ServerError(f"server {self.base_url}: malformed response to POST /v1/completions (request "
                              f"{request.request_id!r}): {err}; body: {str(answer)[:300]}") from None


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not of the form 'token_id:N' (the server must support "
                         "return_tokens_as_token_ids)")
    return int(token.removeprefix("token_id:"))


def _ranked(entry: dict) -> tuple[list[int], list[float]]:
    """{token: logprob} or {id: {"logprob": ...}} -> ids and logprobs, most likely first."""
    pairs = []
    for key, value in entry.items():
        token = int(key) if key.isdigit() else _token_id(key)
        pairs.append((token, float(value["logprob"] if isinstance(value, dict) else value)))
    pairs.sort(key=lambda p: -p[1])
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def parse_completion(request: Request, answer: dict, logprobs_mode: str) -> RequestResult:
    """A RequestResult from one /v1/completions answer (KeyError/ValueError/... on anything malformed)."""
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    T, n, k = len(request.prompt), request.max_new_tokens, request.top_k
    tokens = [_token_id(t) for t in logprobs["tokens"]]
    chosen = [None if lp is None else float(lp) for lp in logprobs["token_logprobs"]]
    tops = list(logprobs["top_logprobs"])
    if logprobs_mode == "echo":
        if tokens[:T] != list(request.prompt):
            raise ValueError(f"the echoed prompt {tokens[:T]} differs from the ids sent {list(request.prompt)}")
        prompt_chosen, prompt_tops = chosen[1:T], tops[1:T]
        out_tokens, out_chosen, out_tops = tokens[T:], chosen[T:], tops[T:]
    else:
        entries = choice["prompt_logprobs"][1:]
        if len(entries) != T - 1:
            raise ValueError(f"{len(entries)} prompt_logprobs positions, expected {T - 1}")
        prompt_tops = [{str(tok): e for tok, e in entry.items()} for entry in entries]
        prompt_chosen = [float(_lookup(entry, tok)) for entry, tok in zip(entries, request.prompt[1:])]
        out_tokens, out_chosen, out_tops = tokens, chosen, tops
    out_tokens, out_chosen, out_tops = out_tokens[:n], out_chosen[:n], out_tops[:n]
    if len(out_tokens) != n or len(prompt_chosen) != T - 1 or len(out_tops) != n or len(prompt_tops) != T - 1:
        raise ValueError(f"{len(prompt_chosen)} prompt and {len(out_tokens)} generated positions, expected {T - 1} "
                         f"and {n}")
    ids, lps = [], []
    for entry in prompt_tops + out_tops:
        top_ids, top_lps = _ranked(entry)
        if len(top_ids) < k:
            raise ValueError(f"{len(top_ids)} alternatives at a position, expected at least top_k = {k}")
        ids.append(top_ids[:k])
        lps.append(top_lps[:k])
    values = prompt_chosen + out_chosen
    if any(v is None for v in values):
        raise ValueError("a logprob is null where a number is needed")
    chosen_t = torch.tensor(values, dtype=torch.float64)
    ids_t = torch.tensor(ids, dtype=torch.long).reshape(len(values), k)
    lps_t = torch.tensor(lps, dtype=torch.float64).reshape(len(values), k)
    m = T - 1
    return RequestResult(request.request_id, chosen_t[:m], ids_t[:m], lps_t[:m], out_tokens, chosen_t[m:], ids_t[m:],
                         lps_t[m:])


def _lookup(entry: dict, token: int) -> float:
    value = entry[str(token)]
    return value["logprob"] if isinstance(value, dict) else value
