"""Target 5, `virtual`: the virtual path's speed. A 50-turn rollout of each mode on the virtual clock,
paced per token and by turn, each against the JSON work its transport carried (the floor); and the
1,000-point sweep, timed on a sample of the grid on 2 worker processes and scaled to the whole.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from prototype.wire.schemas import decode_client_event, decode_create_params, decode_server_event, encode
from sim.harness.experiment import CompareConfig, run_compare
from sim.harness.sweep import SweepConfig, run_sweep
from sim.runtime.inprocess import Tap
from sim.runtime.virtual import VirtualClock, run_virtual

from . import grid

__all__ = ["virtual"]

Report = Callable[[str, str, float, float, float, str, bool | None], None]


def _json_floor(mode: str, frames: list[tuple[str, bytes]]) -> float:
    """The JSON work of the rollout's transport, and nothing else: decode every body and frame
    it carried with the decoder its receiver uses, and encode the result again (best of 3)."""
    decode_up = decode_create_params if mode in ("http", "http_prev") else decode_client_event
    decoders = {"up": decode_up, "down": decode_server_event}
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for direction, data in frames:
            encode(decoders[direction](data))
        best = min(best, time.perf_counter() - t)
    return best


def _recorder(frames: list[tuple[str, bytes]]) -> Tap:
    return lambda direction, data: frames.append((direction, data))


async def _virtual_rollout(mode: str, pace_by_turn: bool, turns: int, tap: Tap | None = None) -> Any:
    config = CompareConfig(rollouts=1, tool_calls=turns, modes=(mode,), workload="custom")
    return await run_compare(config, VirtualClock(), virtual=True, pace_by_turn=pace_by_turn, memoize=True, tap=tap)


def virtual(report: Report, points: int, turns: int) -> None:
    for mode in ("ws", "append", "http"):
        for by_turn in (False, True):
            frames: list[tuple[str, bytes]] = []
            # The warm-up run records what the transport carries.
            run_virtual(_virtual_rollout(mode, by_turn, turns, _recorder(frames)), charge_cpu=False)
            t = time.perf_counter()
            result = run_virtual(_virtual_rollout(mode, by_turn, turns), charge_cpu=False)
            wall = time.perf_counter() - t
            events = sum(turn.events for r in result.rollouts for turn in r.turns)
            floor = _json_floor(mode, frames)
            ms = wall * 1e3
            mb = sum(len(data) for _, data in frames) / 1e6
            pacing = "by turn" if by_turn else "per token"
            what = f"virtual {turns}-turn rollout ms ({mode}, {pacing}, {events} ev, {mb:.1f} MB of JSON)"
            report("5", what, ms, floor * 1e3, wall / floor, "<= 20 ms", ms <= 20)
    tps, calls, tools = grid.sample(points)  # a sample of the grid, its time scaled to the whole
    sweep = SweepConfig(tps=tps, tool_calls=calls, tool_time_s=tools, base=CompareConfig(rollouts=1))
    grid_n, n = grid.GRID_POINTS, len(tps) * len(calls) * len(tools)
    pinned = _affinity()
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the workers inherit it: both cores, not ours
    t = time.perf_counter()
    try:
        with ProcessPoolExecutor(2) as pool:
            run_sweep(sweep, pool)
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, pinned)
    wall = time.perf_counter() - t
    est = wall * grid_n / n
    report("5", f"{grid_n}-point sweep s, 2 procs (measured {n} points)", est, 60.0, est / 60.0, "< 60 s", est < 60)


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except OSError:
        return set(range(os.cpu_count() or 1))
