"""A server that accepts connections and never answers costs its timeout once per process, not once per scenario.

The silent server here is a bare TCP socket on 127.0.0.1 that accepts every connection and holds it open without a
byte in reply: each HTTP request to it waits out the adapter's timeout. After the first such wait the adapter knows
the URL is silent and every later engine on it (the next scenario) fails at once with the same message.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from harness.adapters.server import REMEMBERED_NOTE, ServerEngine, ServerError
from harness.adapters.server_launch import free_loopback_port
from harness.engine import EngineOptions

TIMEOUT_S = 0.5


class SilentServer:
    """Accepts connections on a free loopback port and never answers; counts the connections it got."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:                        # closed by close()
                return
            self.connections.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def silent():
    servers = []

    def start() -> SilentServer:
        servers.append(SilentServer())
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def _engine(checkpoint, url: str) -> ServerEngine:
    return ServerEngine(checkpoint, options=EngineOptions(engine_args={"base_url": url, "timeout": TIMEOUT_S,
                                                                       "retries": 1}))


def _failure(checkpoint, url: str) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(ServerError) as caught:
        _engine(checkpoint, url)
    return str(caught.value), time.monotonic() - started


def test_a_silent_server_costs_its_timeout_once(silent, g1_checkpoint):
    server = silent()
    first, first_s = _failure(g1_checkpoint, server.url)
    assert first == f"server {server.url} did not answer GET /v1/models within {TIMEOUT_S:g} s (timed out)"
    assert first_s >= TIMEOUT_S
    asked = len(server.connections)
    for _ in range(3):                              # the next scenarios
        again, again_s = _failure(g1_checkpoint, server.url)
        assert again == first + REMEMBERED_NOTE
        assert again_s < TIMEOUT_S / 2
    assert len(server.connections) == asked, "the silent server was asked again"


def test_the_memory_is_per_url(silent, g1_checkpoint):
    """Another silent server is found silent by its own timeout; the first one's finding says nothing of it."""
    one, other = silent(), silent()
    _failure(g1_checkpoint, one.url)
    message, seconds = _failure(g1_checkpoint, other.url)
    assert message.startswith(f"server {other.url} did not answer") and REMEMBERED_NOTE not in message
    assert seconds >= TIMEOUT_S


def test_an_unreachable_server_is_remembered_too(g1_checkpoint):
    """Nothing listens: refused connections are retried once (with a pause) the first time, never again after."""
    url = f"http://127.0.0.1:{free_loopback_port()}"
    first, _ = _failure(g1_checkpoint, url)
    assert first.startswith(f"server {url} is unreachable (GET /v1/models, 2 attempts)")
    again, again_s = _failure(g1_checkpoint, url)
    assert again == first + REMEMBERED_NOTE and again_s < 0.2
