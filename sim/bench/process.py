"""The benchmark's server process: `sim.bench.server` started, pinned to a core, stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["bench_process"]


@contextlib.contextmanager
def bench_process(args: Sequence[str], *, core: int, tree: Path | None = None) -> Iterator[int]:
    """A `sim.bench.server` process with `args`, pinned to `core`; yields its port. With `tree`,
    the process runs the code in that directory (its cwd and PYTHONPATH), for A/B runs."""
    command = [sys.executable, "-m", "sim.bench.server", *args]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, {core})
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"bench server did not start: {line!r}")
        yield int(line.split()[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
