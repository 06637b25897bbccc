"""Servers in subprocesses for the tests: `python -m prototype.server` (`start_server`) and a
redis-server a test can stop and start again (`RedisProcess`, behind conftest.py's fixtures).

Readiness is each process's own stdout line, read event-driven (a selector and raw reads); no
sleeps, no port polling.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

REDIS_READY_LINE = "Ready to accept connections"
"""What redis-server (6.x and 7.x) logs once it listens; readiness is this line, not a poll."""
REDIS_START_TIMEOUT_S = 10.0
"""Upper bound on startup. redis-server is ready in milliseconds; this only turns
a wedged start into a test error instead of a hung run."""
READ_CHUNK = 1 << 16
"""Bytes per read from redis's stdout (one pipe buffer)."""
REDIS_STOP_TIMEOUT_S = 10.0
"""How long SIGTERM gets before SIGKILL. With `--save ''` shutdown writes nothing."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; tiny race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisProcess:
    """One redis-server on a fixed port that a test can stop and start again,
    e.g. to check that a client recovers from an outage. Not persistent:
    `--save '' --appendonly no`, so a restart comes back empty."""

    def __init__(self, executable: str, port: int) -> None:
        self.executable = executable
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self.log: list[str] = []

    @property
    def running(self) -> bool:
        return self._proc is not None

    def start(self) -> None:
        """Start redis-server and return once it logged that it accepts connections."""
        assert self._proc is None, "already running"
        options = {
            "--port": str(self.port),
            "--bind": "127.0.0.1",
            "--save": "",  # no RDB snapshots: nothing written to disk, fast shutdown
            "--appendonly": "no",
            # redis acts on SIGTERM from its periodic cron (default 10 Hz), so stopping
            # took ~100 ms per test; 100 Hz makes it ~10 ms at negligible idle cost.
            "--hz": "100",
        }
        proc = subprocess.Popen(
            [self.executable, *(part for option in options.items() for part in option)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            bufsize=0,  # raw pipe: see _wait_ready
        )
        assert proc.stdout is not None
        self._proc = proc
        try:
            self._wait_ready(proc)
        except BaseException:
            self.stop()
            raise
        # Keep draining stdout so redis never blocks on a full pipe; the lines are
        # kept for diagnosing a failing test.
        self._drain = threading.Thread(target=self._drain_stdout, args=(proc,), daemon=True)
        self._drain.start()

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        pending = b""
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                # Blocks until redis writes something (or the deadline): event-driven, no polling.
                if remaining <= 0 or not selector.select(timeout=remaining):
                    raise RuntimeError(f"redis-server not ready after {REDIS_START_TIMEOUT_S} s: {self.log}")
                # Raw os.read, not a buffered readline: a buffered reader could swallow
                # the ready line into its buffer, and the selector would never fire again.
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    raise RuntimeError(f"redis-server exited during startup: {self.log}")
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    self.log.append(line)
                    if REDIS_READY_LINE in line:
                        return

    def _drain_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, READ_CHUNK):
            self.log.extend(chunk.decode(errors="replace").splitlines())

    def stop(self) -> None:
        """Terminate redis-server and wait for it to exit (port free again)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=REDIS_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._drain is not None:
            self._drain.join()  # EOF once the process is gone
            self._drain = None
        assert proc.stdout is not None
        proc.stdout.close()


REPO: Final = Path(__file__).resolve().parents[1]
READY: Final = re.compile(rb"longrun server listening on (http://127\.0\.0\.1:(\d+)/v1)")
START_TIMEOUT_S: Final = 15.0
"""Upper bound on startup (imports + tokenizer load); normally well under a second."""
STOP_TIMEOUT_S: Final = 10.0
"""How long SIGTERM gets to end the process."""
DEADLINE_S: Final = 30.0
"""Watchdog: the server is killed if a test keeps it alive longer than this."""


class ServerProcess:
    """`python -m prototype.server ARGS` with stdout+stderr captured for diagnostics."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.output = bytearray()
        self.base_url = ""
        self.port = 0
        self.killed_by_watchdog = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self._watchdog: threading.Timer | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None
        return self._proc

    def start(self) -> ServerProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "prototype.server", *self.args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            bufsize=0,  # raw pipe: a buffered reader could swallow the ready line (see RedisProcess)
        )
        self._watchdog = threading.Timer(DEADLINE_S, self._on_deadline)
        self._watchdog.daemon = True
        self._watchdog.start()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        self._drain = threading.Thread(target=self._drain_output, daemon=True)
        self._drain.start()
        return self

    def _on_deadline(self) -> None:
        self.killed_by_watchdog = True
        self.proc.kill()

    def _wait_ready(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        deadline = time.monotonic() + START_TIMEOUT_S
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                # Blocks until the server writes something (or the deadline): event-driven.
                if remaining <= 0 or not selector.select(timeout=remaining):
                    raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s: {self.log}")
                chunk = os.read(fd, READ_CHUNK)
                if not chunk:
                    raise RuntimeError(f"server exited during startup (rc={self.proc.wait()}): {self.log}")
                self.output += chunk
                match = READY.search(self.output)
                if match:
                    self.base_url = match.group(1).decode()
                    self.port = int(match.group(2))
                    return

    def _drain_output(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while chunk := os.read(stdout.fileno(), READ_CHUNK):
            self.output += chunk

    @property
    def log(self) -> str:
        return self.output.decode(errors="replace")

    def terminate(self) -> int:
        """SIGTERM, then the exit code (bounded wait)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        finally:
            self.kill()

    def kill(self) -> None:
        """Idempotent cleanup: kill if still running, join the drain, close the pipe, stop the watchdog."""
        proc = self._proc
        if proc is None:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._drain is not None:
            self._drain.join()
            self._drain = None
        assert proc.stdout is not None
        proc.stdout.close()
        self._proc = None


@contextlib.contextmanager
def start_server(*args: str) -> Iterator[ServerProcess]:
    server = ServerProcess(*args).start()
    try:
        yield server
    finally:
        server.kill()
        assert not server.killed_by_watchdog, f"test exceeded {DEADLINE_S} s; server log:\n{server.log}"
