"""Target 9 of `python -m sim.bench`: the fleet model's speed (docs/performance.md, docs/capacity.md).

One capacity point of `agentic` sessions in append mode under the default fleet (its largest KV budget), timed in this
process. Floor: the same number of events (four a turn: ready, first token, free, end) pushed
and popped on a bare `heapq` in the same run, the cost of any discrete-event loop over these
turns before it does any bookkeeping. Building the sessions (planning and tokenizing each
output, as the server does) is timed beside it, and the two give the time of a 10,000-session
point of every default variant (the capacity job's `variants`).

Then the large point, measured whole: `big_sessions` (100,000) sessions built as arrays
(`array_sessions`: no text, outputs resampled from the policy's own) and served once in append
(hold, preemption) under the default fleet and its largest budget at `BIG_POINT_LOAD`
sessions/s, priced compute; its time is build plus one variant.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

import msgspec
import numpy as np

from prototype.pipeline import load_profile
from sim.fleet.engine import simulate
from sim.fleet.sessions import array_sessions, workload_sessions
from sim.harness.capacity import CapacityConfig, arrivals, variants
from sim.rollout.workload import WORKLOADS

__all__ = ["LARGE_POINT_SESSIONS", "fleet"]

VARIANTS = len(variants(CapacityConfig()))  # http, http_prev, ws, append's hold policies and preemption
BIG_POINT_SESSIONS = 10_000
LARGE_POINT_SESSIONS = 100_000
BIG_POINT_LOAD = 0.5


def _heap_floor(events: int, seed: int) -> float:
    times = np.random.default_rng(seed).random(events).tolist()
    heap: list[tuple[float, int, int, int, int]] = []
    t = time.perf_counter()
    for i, at in enumerate(times):
        heapq.heappush(heap, (at, i, 0, 0, 0))
        if len(heap) > 512:
            heapq.heappop(heap)
    while heap:
        heapq.heappop(heap)
    return time.perf_counter() - t


def fleet(
    report: Callable[[str, str, float, float, float, str, bool | None], None],
    sessions: int,
    big_sessions: int = LARGE_POINT_SESSIONS,
) -> None:
    config = CapacityConfig(sessions=sessions)
    t = time.perf_counter()
    built = workload_sessions(WORKLOADS[config.workload], 0, sessions)
    build_s = time.perf_counter() - t
    turns = sum(s.turns for s in built)
    times = arrivals(0, sessions, 2.0)
    t = time.perf_counter()
    fleet_config = msgspec.structs.replace(config.fleet, kv_budget_tokens=max(config.kv_budgets))
    simulate("append", load_profile(config.profile), fleet_config, built, arrivals=times)
    engine_s = time.perf_counter() - t
    floor_s = _heap_floor(4 * turns, 0)
    rate, floor_rate = turns / engine_s, turns / floor_s
    report(
        "9",
        f"fleet turns/CPU s (append, {sessions} sessions, {turns} turns)",
        rate,
        floor_rate,
        engine_s / floor_s,
        ">= 20,000",
        rate >= 20_000,
    )
    per_turn = build_s / turns + VARIANTS * engine_s / turns
    big = per_turn * turns * BIG_POINT_SESSIONS / sessions
    report(
        "9",
        f"{BIG_POINT_SESSIONS:,}-session point s, {VARIANTS} variants, 1 core (est.)",
        big,
        300.0,
        big / 300.0,
        "< 300 s",
        big < 300,
    )
    if big_sessions > 0:
        _large_point(report, config, big_sessions)


def _large_point(
    report: Callable[[str, str, float, float, float, str, bool | None], None], config: CapacityConfig, n: int
) -> None:
    t = time.perf_counter()
    built = array_sessions(WORKLOADS[config.workload], 0, n)
    build_s = time.perf_counter() - t
    turns = sum(s.turns for s in built)
    fleet_config = msgspec.structs.replace(config.fleet, kv_budget_tokens=max(config.kv_budgets))
    times = arrivals(0, n, BIG_POINT_LOAD)
    t = time.perf_counter()
    simulate("append", load_profile(config.profile), fleet_config, built, arrivals=times)
    total = build_s + time.perf_counter() - t
    report(
        "9",
        f"{n:,}-session point s (array sessions {build_s:.0f} s, {turns:,} turns, append, 1 variant, 1 core)",
        total,
        300.0,
        total / 300.0,
        "< 300 s",
        total < 300,
    )
