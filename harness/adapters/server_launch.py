"""A server the harness starts itself: a command template filled in with a free loopback port and the scenario's
knobs, started in its own process group with its output in a log file, waited for, and always stopped (when the
engine closes, and at interpreter exit for anything left running)."""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .subprocess_worker import exception_lines, tail

_running: set["LaunchedServer"] = set()


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchError(RuntimeError):
    """The launched server exited, or did not answer within its start-up deadline."""


class LaunchedServer:
    """template: a command line with {port}, {host} and other fields from `fields` (missing ones are an error)."""

    def __init__(self, template: str, fields: dict[str, Any], *, timeout: float) -> None:
        self.port = free_loopback_port()
        self.host = "127.0.0.1"
        self.base_url = f"http://{self.host}:{self.port}"
        self.timeout = timeout
        try:
            self.command = shlex.split(template.format(**{**fields, "port": self.port, "host": self.host}))
        except KeyError as err:
            raise LaunchError(f"launch template: unknown field {{{err.args[0]}}} (known: "
                              f"{', '.join(sorted({*fields, 'port', 'host'}))})") from None
        self._log_dir = Path(tempfile.mkdtemp(prefix="bamba-server-"))
        self.log_path = self._log_dir / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=tempfile.gettempdir())
        _running.add(self)

    def _failure(self, problem: str) -> LaunchError:
        causes = exception_lines(self.log_path)
        return LaunchError(f"launched server `{shlex.join(self.command)}` (pid {self.proc.pid}) {problem}; the last "
                           f"lines of its log ({self.log_path}):\n{tail(self.log_path) or '(empty)'}"
                           + ("\nexceptions in the log:\n" + "\n".join(causes) if causes else ""))

    def wait_until_ready(self, probe: Callable[[], Any], poll: float = 1.0) -> None:
        """Call `probe` until it returns without raising; LaunchError when the server exits or the deadline passes
        (the server is stopped then)."""
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop(keep_log=True)
                raise self._failure(f"exited with status {self.proc.returncode} before it answered")
            try:
                probe()
                return
            except Exception as err:  # noqa: BLE001 - not up yet; the last error goes into the message
                last = err
            time.sleep(poll)
        self.stop(keep_log=True)
        raise self._failure(f"did not answer within {self.timeout:.0f} s (stopped; last error: {last})")

    def stop(self, grace: float = 15.0, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace` s; idempotent."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)          # children the server left behind
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()
        _running.discard(self)
        if not keep_log:
            shutil.rmtree(self._log_dir, ignore_errors=True)


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()
