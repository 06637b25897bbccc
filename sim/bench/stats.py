"""The cost of precision: wall time of the default compare and of a sweep, this code against a
baseline checkout (`--stats-baseline DIR`, e.g. one without intervals and common random
numbers), each as a subprocess with that checkout first on PYTHONPATH, interleaved (baseline,
this, this, baseline, ...) so drift on a shared machine hits both alike.

Rows: the default `python -m sim compare` (whatever each side's defaults are: that is the
cost a user sees), a sweep at each side's default rollouts, and the same sweep at equal
rollouts (the cost of the intervals and per-turn draws alone). A sweep measures `points`
points of a 1,000-point grid and scales to 1,000, as the `virtual` target does.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from .grid import GRID_POINTS, sample

__all__ = ["stats"]

REPO: Final = Path(__file__).resolve().parents[2]


def _timed(root: Path, argv: list[str], scratch: Path) -> float:
    # A run's default folder goes to the scratch directory, not the checkout's runs/; a sweep's
    # table is removed first, since this side refuses to overwrite one.
    (scratch / "sweep.csv").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root), "LONGRUN_RUNS": str(scratch / "runs")}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sim", *argv], cwd=root, env=env, check=True, capture_output=True)
    return time.perf_counter() - t


def _sweep_argv(points: int, out: Path, rollouts: int | None) -> tuple[list[str], int]:
    tps, calls, tools = sample(points)
    argv = [
        "sweep",
        "--tps",
        ",".join(f"{x:g}" for x in tps),
        "--tool-calls",
        ",".join(map(str, calls)),
        "--tool-time-s",
        ",".join(f"{x:g}" for x in tools),
        "--workers",
        "2",
        "--quiet",
        "--out",
        str(out),
    ]
    if rollouts is not None:
        argv += ["--rollouts", str(rollouts)]
    return argv, len(tps) * len(calls) * len(tools)


def stats(
    report: Callable[[str, str, float, float, float, str, bool | None], None],
    baseline: str | None,
    *,
    rounds: int,
    compare_rounds: int,
    points: int,
    equal_rollouts: int,
) -> None:
    """`rounds` runs of each side per sweep row, `compare_rounds` of the default compare
        (0 skips it: it runs live, minutes per round).
    `report(target, figure, value, floor, ratio, goal, ok)` one row per measurement: this
        code's median wall time as the value, the baseline's as the floor, their ratio."""
    if not baseline:
        report("stats", "skipped: needs --stats-baseline DIR (a checkout to compare against)", 0.0, 0.0, 0.0, "-", None)
        return
    old, new = Path(baseline).resolve(), REPO
    pinned = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if pinned is not None:  # the children get every core (the bench pins itself to one)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        _measure(
            report, old, new, rounds=rounds, compare_rounds=compare_rounds, points=points, equal_rollouts=equal_rollouts
        )
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


def _measure(
    report: Callable[[str, str, float, float, float, str, bool | None], None],
    old: Path,
    new: Path,
    *,
    rounds: int,
    compare_rounds: int,
    points: int,
    equal_rollouts: int,
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        jobs: list[tuple[str, list[str], float, int]] = []
        if compare_rounds > 0:
            jobs.append(("default compare s", ["compare", "--quiet"], 1.0, compare_rounds))
        for label, rollouts in (("default rollouts", None), (f"{equal_rollouts} rollouts both", equal_rollouts)):
            argv, measured = _sweep_argv(points, Path(scratch) / "sweep.csv", rollouts)
            figure = f"{GRID_POINTS}-pt sweep s, {label} (ran {measured})"
            jobs.append((figure, argv, GRID_POINTS / measured, rounds))
        for figure, argv, scale, runs in jobs:
            # By side, not by path: the two sides may be one checkout (a smoke run).
            times: dict[str, list[float]] = {"base": [], "this": []}
            sides = (("base", old), ("this", new))
            for k in range(runs):
                for side, root in sides if k % 2 == 0 else sides[::-1]:
                    times[side].append(_timed(root, argv, Path(scratch)) * scale)
            value, floor = statistics.median(times["this"]), statistics.median(times["base"])
            report("stats", f"{figure}, this / base", value, floor, value / floor, "report", None)
