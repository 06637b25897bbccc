"""Shared fixtures: a throwaway redis-server per test, for the response-store tests."""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

REDIS_READY_LINE = "Ready to accept connections"
"""What redis-server (6.x and 7.x) logs once it listens; readiness is this line, not a poll."""

REDIS_START_TIMEOUT_S = 10.0
"""Upper bound on startup. redis-server is ready in milliseconds; this only turns
a wedged start into a test error instead of a hung run."""

READ_CHUNK = 1 << 16
"""Bytes per read from redis's stdout (one pipe buffer)."""

REDIS_STOP_TIMEOUT_S = 10.0
"""How long SIGTERM gets before SIGKILL. With `--save ''` shutdown writes nothing."""


def _free_port() -> int:
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


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A running redis-server with start/stop control, torn down after the test."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not on PATH")
    server = RedisProcess(executable, _free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_process: RedisProcess) -> str:
    """URL (`redis://127.0.0.1:<port>/0`) of a fresh, empty redis-server for this test."""
    return redis_process.url


@pytest.fixture
def unused_redis_url() -> str:
    """A redis URL on a local port where nothing listens: connecting is refused at once."""
    return f"redis://127.0.0.1:{_free_port()}/0"
