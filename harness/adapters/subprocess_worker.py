"""A child process spoken to in JSON lines, with deadlines, and its log kept for the error message.

Engines whose packages cannot live in the harness's environment (vLLM pins its own torch and transformers) run in a
child process of another interpreter. `WorkerProcess` starts it in its own process group with stdout as the protocol
channel and stderr (every log line of the child and of its children) in a file, waits for each answer with a
deadline, and on a crash, a hang or an error message raises `WorkerError` carrying the last lines of that log.
`close` stops the whole process group, also when the child ignores SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

LOG_TAIL_LINES = 40


class WorkerError(RuntimeError):
    """The worker crashed, hung past its deadline, sent something that is not the protocol, or reported an error."""


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a text file ('' when it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_EXCEPTION = re.compile(r"\b(\w*(?:Error|Exception)): (.*)$")


def exception_lines(path: Path, limit: int = 5) -> list[str]:
    """The distinct 'SomeError: message' lines of a log, last `limit` of them: when several processes log
    tracebacks at once, the root cause is often far above the last lines."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    found = [f"{m.group(1)}: {m.group(2)}" for line in text.splitlines() if (m := _EXCEPTION.search(line))]
    return list(dict.fromkeys(found))[-limit:]


class WorkerProcess:
    """argv runs the worker; env is added to os.environ; `what` names it in messages ("vLLM worker")."""

    def __init__(self, argv: Sequence[str], *, what: str, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.what = what
        self._log_dir = Path(tempfile.mkdtemp(prefix="bamba-worker-"))
        self.log_path = self._log_dir / "worker.log"
        self._log = open(self.log_path, "wb")
        self._buffer = b""
        self.failed = False
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)

    def _failure(self, problem: str) -> WorkerError:
        self.failed = True
        log = tail(self.log_path)
        causes = exception_lines(self.log_path)
        return WorkerError(f"{self.what} (pid {self.proc.pid}) {problem}; the last lines of its log "
                           f"({self.log_path}):\n{log or '(empty)'}"
                           + ("\nexceptions in the log:\n" + "\n".join(causes) if causes else ""))

    def send(self, message: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self.proc.poll()
            raise self._failure(f"cannot be written to ({err}); exit status {self.proc.returncode}") from None

    def receive(self, timeout: float) -> dict:
        """The next message; WorkerError on exit, timeout (the worker is then stopped), bad JSON or an error event."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise self._failure(f"sent no answer within {timeout:.0f} s (stopped)")
            ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                status = self.proc.wait()
                raise self._failure(f"exited with status {status} before answering")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise self._failure(f"sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(message, dict) or "event" not in message:
            raise self._failure(f"sent a message without an event: {line[:200]!r}")
        if message["event"] == "error":
            detail = message.get("traceback") or ""
            raise self._failure(f"reported {message.get('message')}\n{detail}")
        return message

    def request(self, message: dict, timeout: float) -> dict:
        self.send(message)
        return self.receive(timeout)

    def close(self, grace: float = 10.0) -> None:
        """Stop the worker and everything it started: SIGTERM to the process group, SIGKILL after `grace` s."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            # The worker is gone; children it left in its group are not.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        self._log.close()

    def exit(self, grace: float = 30.0) -> None:
        """Ask a healthy worker to exit ({"cmd": "exit"}) and wait up to `grace` s, then cleanup() (which stops it
        if it did not)."""
        if self.proc.poll() is None and not self.failed:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(grace)
            except (WorkerError, subprocess.TimeoutExpired):
                pass
        self.cleanup()

    def cleanup(self) -> None:
        """close(), then delete the log unless something failed (the error message names it)."""
        self.close()
        if not self.failed:
            shutil.rmtree(self._log_dir, ignore_errors=True)
