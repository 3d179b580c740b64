"""The server engine's error paths against a small local fake of /v1/models and /v1/completions.

The fake answers in vLLM's format but its numbers are not a model's: it exists for the error paths only (the
correctness of real servers is judged by make test-vllm). Every failure must be a clear ServerError or LaunchError,
within the timeout, and a launched server must be stopped whatever happens.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from harness.adapters.server import ServerEngine, ServerError, parse_completion
from harness.adapters.server_launch import LaunchError, free_loopback_port
from harness.engine import EngineOptions, Request, UnsupportedOptions

from .conftest import G1_MODEL

V = G1_MODEL.vocab_size
SECRET = "sk-test-do-not-print-4242"


def completion(prompt: list[int], max_tokens: int, k: int) -> dict:
    """A well-formed echo answer: prompt then max_tokens copies of token 1, every logprob -1.5."""
    tokens = prompt + [1] * max_tokens
    tops = [None] + [{f"token_id:{t}": -1.5, **{f"token_id:{j}": -2.0 - j for j in range(10, 10 + k)}}
                     for t in tokens[1:]]
    return {"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                                      "token_logprobs": [None] + [-1.5] * (len(tokens) - 1), "top_logprobs": tops}}]}


class FakeServer:
    """behaviour: ok | wrong_model | not_json | no_logprobs | http_400 | http_500 | slow | token_strings |
    big_vocab | needs_key."""

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.calls = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, payload) -> None:
                body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                if fake.behaviour != "needs_key":
                    return True
                given = self.headers.get("Authorization", "")
                if given != f"Bearer {SECRET}":
                    self._send(401, {"error": f"bad key; you sent {given!r}"})
                    return False
                return True

            def do_GET(self):
                if not self._authorised():
                    return
                name = "another-model" if fake.behaviour == "wrong_model" else "tiny"
                self._send(200, {"data": [{"id": name}]})

            def do_POST(self):
                fake.calls += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorised():
                    return
                prompt = body["prompt"]
                if any(t >= V for t in prompt) and fake.behaviour != "big_vocab":
                    return self._send(400, {"error": {"message": f"Token id {max(prompt)} is out of vocabulary"}})
                b = fake.behaviour
                if b == "not_json":
                    return self._send(200, b"<html>proxy error</html>")
                if b == "no_logprobs":
                    return self._send(200, {"choices": [{"text": "hi"}]})
                if b in ("http_400", "http_500") and body["prompt"][0] == 0:
                    return self._send(int(b[-3:]), {"error": {"message": f"synthetic {b[-3:]} for the test"}})
                if b == "slow" and fake.calls > 2:
                    time.sleep(5)
                answer = completion(prompt, body["max_tokens"], body["logprobs"])
                if b == "token_strings":
                    answer["choices"][0]["logprobs"]["tokens"] = ["a"] * len(answer["choices"][0]["logprobs"]["tokens"])
                self._send(200, answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(behaviour: str = "ok") -> FakeServer:
        servers.append(FakeServer(behaviour))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def engine(checkpoint, **engine_args) -> ServerEngine:
    return ServerEngine(checkpoint, options=EngineOptions(engine_args={"timeout": 2, "retries": 1, **engine_args}))


# Prompts start with token 0 so that the vocabulary probe (which starts with 3) is not hit by the HTTP error modes.
REQUESTS = [Request("a", (0, 4, 5), 2, 3), Request("b", (0, 9), 1, 3)]


def test_a_well_formed_server_gives_results(fake, g1_checkpoint):
    with engine(g1_checkpoint, base_url=fake().url) as server:
        results = server.run(REQUESTS)
    assert [r.output_ids for r in results] == [[1, 1], [1]]
    assert results[0].prompt_logprobs.tolist() == [-1.5, -1.5]
    assert results[0].prompt_top_ids[:, 0].tolist() == [4, 5]


def test_unreachable(g1_checkpoint):
    url = f"http://127.0.0.1:{free_loopback_port()}"
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"server {url} is unreachable \(GET /v1/models, 2 attempts\)"):
        engine(g1_checkpoint, base_url=url)
    assert time.monotonic() - start < 30


def test_wrong_model(fake, g1_checkpoint):
    with pytest.raises(ServerError, match=r"serves \['another-model'\], not the expected model 'tiny'"):
        engine(g1_checkpoint, base_url=fake("wrong_model").url, model="tiny")


def test_a_larger_vocabulary_is_another_model(fake, g1_checkpoint):
    with pytest.raises(ServerError, match=f"accepted token id {V}: its vocabulary is larger"):
        engine(g1_checkpoint, base_url=fake("big_vocab").url)


@pytest.mark.parametrize("behaviour, message", [
    ("not_json", r"malformed response to POST /v1/completions \(not JSON\): b'<html>proxy error</html>'"),
    ("no_logprobs", r"malformed response to POST /v1/completions \(request 'probe'\): 'logprobs'"),
    ("token_strings", r"token 'a' is not of the form 'token_id:N'"),
])
def test_malformed_responses(fake, g1_checkpoint, behaviour, message):
    with pytest.raises(ServerError, match=message):
        engine(g1_checkpoint, base_url=fake(behaviour).url)


@pytest.mark.parametrize("code", [400, 500])
def test_http_errors(fake, g1_checkpoint, code):
    with engine(g1_checkpoint, base_url=fake(f"http_{code}").url) as server:
        with pytest.raises(ServerError, match=rf"answered HTTP {code} to POST /v1/completions: .*synthetic {code}"):
            server.run(REQUESTS)


def test_timeout(fake, g1_checkpoint):
    with engine(g1_checkpoint, base_url=fake("slow").url, timeout=1) as server:
        start = time.monotonic()
        with pytest.raises(ServerError, match=r"did not answer POST /v1/completions within 1 s"):
            server.run(REQUESTS)
        assert time.monotonic() - start < 4.5


def test_the_api_key_is_sent_and_never_printed(fake, g1_checkpoint, monkeypatch):
    monkeypatch.setenv("MY_KEY", SECRET)
    server = fake("needs_key")
    with engine(g1_checkpoint, base_url=server.url, api_key_env="MY_KEY") as client:
        assert len(client.run(REQUESTS)) == 2
        assert SECRET not in repr(client.__dict__.get("options"))
    monkeypatch.setenv("MY_KEY", SECRET + "-wrong")
    with pytest.raises(ServerError) as err:
        engine(g1_checkpoint, base_url=server.url, api_key_env="MY_KEY")
    assert "HTTP 401" in str(err.value) and SECRET not in str(err.value) and "***" in str(err.value)


def test_knobs_of_a_running_server_are_unsupported():
    reasons = ServerEngine.unsupported(EngineOptions(max_num_batched_tokens=16, engine_args={"base_url": "http://x"}),
                                       dtype=torch.float32, device="cpu")
    assert reasons == ["max_num_batched_tokens = 16: the server runs with the flags it was started with (give a "
                       "launch template to set it)"]


def test_parse_rejects_an_echo_of_other_ids():
    answer = completion([0, 4, 6], 1, 2)
    with pytest.raises(ValueError, match=r"the echoed prompt \[0, 4, 6\] differs from the ids sent \[0, 4, 5\]"):
        parse_completion(Request("a", (0, 4, 5), 1, 2), answer, "echo")


# ---- launching -------------------------------------------------------------------------------------------------

FAKE_SERVER_SCRIPT = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    port, mode = int(sys.argv[1]), sys.argv[2]
    print(f"fake server starting on {port} in mode {mode}", flush=True)
    if mode == "crash":
        print("RuntimeError: no model here", flush=True)
        sys.exit(5)
    if mode == "hang":
        time.sleep(600)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            body = json.dumps({"data": [{"id": "tiny"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if max(req["prompt"]) >= int(sys.argv[3]):
                self.send_response(400); self.send_header("Content-Length", "0"); self.end_headers(); return
            toks = req["prompt"] + [1] * req["max_tokens"]
            tops = [None] + [{f"token_id:{t}": -1.0, "token_id:2": -3.0, "token_id:3": -4.0} for t in toks[1:]]
            body = json.dumps({"choices": [{"logprobs": {"tokens": [f"token_id:{t}" for t in toks],
                               "token_logprobs": [None] + [-1.0] * (len(toks) - 1), "top_logprobs": tops}}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def launch_template(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER_SCRIPT)
    return lambda mode: f"{sys.executable} {script} {{port}} {mode} {V} --budget {{max_num_batched_tokens}}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_launched_server_is_used_and_stopped(launch_template, g1_checkpoint):
    options = EngineOptions(max_num_batched_tokens=7, engine_args={"launch": launch_template("ok"), "timeout": 5})
    with ServerEngine(g1_checkpoint, options=options) as server:
        assert server.server.command[-1] == "7", "the scenario's knob was not filled into the template"
        assert server.run([Request("a", (0, 4), 1, 2)])[0].output_ids == [1]
        proc = server.server.proc
    assert proc.poll() is not None and not _alive(proc.pid), "the launched server outlived the engine"


@pytest.mark.parametrize("mode, message", [("crash", r"exited with status 5 before it answered[\s\S]*no model here"),
                                           ("hang", r"did not answer within 3 s")])
def test_a_launch_that_fails_is_reported_and_stopped(launch_template, g1_checkpoint, mode, message):
    options = EngineOptions(engine_args={"launch": launch_template(mode), "launch_timeout": 3, "timeout": 1})
    start = time.monotonic()
    with pytest.raises(LaunchError, match=message) as err:
        ServerEngine(g1_checkpoint, options=options)
    assert "fake server starting on" in str(err.value) and f"in mode {mode}" in str(err.value)
    assert time.monotonic() - start < 60


def test_a_knob_missing_from_the_template_is_unsupported(launch_template, g1_checkpoint):
    options = EngineOptions(max_num_seqs=1, engine_args={"launch": launch_template("ok")})
    with pytest.raises(UnsupportedOptions, match=r"max_num_seqs = 1: the launch template has no \{max_num_seqs\}"):
        ServerEngine(g1_checkpoint, options=options)
