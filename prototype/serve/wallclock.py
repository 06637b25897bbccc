"""The wall clock: `prototype.clock.Clock` on the running asyncio event loop.

`now()` is the loop's own clock, the one `loop.call_at` schedules on, so a
deadline computed from `now()` is honoured without conversion. On asyncio's loops
and uvloop that clock is the system's monotonic clock; uvloop reads it in whole
milliseconds, cached per loop iteration, so there `now()` reads the same clock
directly (`time.monotonic()`, sub-microsecond): a stage or a first token timed
on it is not rounded to a millisecond. Deadlines are absolute: a wake-up that
comes late does not push later deadlines back, which is what keeps paced
decoding at its exact long-run rate.

The server's own clock, so it lives beside the server: `prototype/server.py` runs on it, and
so does every live run of sim/ (the virtual clock is sim/runtime/virtual.py's).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import Any

__all__ = ["AsyncioClock"]

_MONOTONIC: dict[type[Any], bool] = {}  # loop type -> its `time()` is `time.monotonic()`, rounded or not


def _reads_monotonic(kind: type[Any]) -> bool:
    """asyncio's loops read `time.monotonic()`; uvloop reads the same clock in whole
    milliseconds. uvloop is looked up where it is already loaded (the entry points choose it)."""
    uv = sys.modules.get("uvloop")
    return kind.time is asyncio.BaseEventLoop.time or (uv is not None and kind.time is uv.Loop.time)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled meanwhile
        future.set_result(None)


class AsyncioClock:
    """`Clock` on the running event loop. Holds no loop reference, so it may be
    built before the loop exists (e.g. before uvloop is installed).

    With ``tick_s`` (the servers use 1 ms, uvloop's timer resolution) concurrent
    sleeps share timers: while another sleep is in progress, a deadline waits for the
    end of its tick, and one loop timer per tick wakes every sleeper of that tick. A
    hundred streams paced at 1000 tokens/s then cost one timer per millisecond, not a
    hundred, for at most one tick of extra lateness; a lone sleeper keeps an exact timer.
    Never early.
    """

    def __init__(self, *, tick_s: float | None = None) -> None:
        if tick_s is not None and not tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self.tick_s = tick_s
        self._ticks: dict[tuple[asyncio.AbstractEventLoop, int], list[asyncio.Future[None]]] = {}
        self._sleeping = 0  # sleeps in progress: a lone sleeper keeps its own exact timer

    def now(self) -> float:
        loop = asyncio.get_running_loop()
        kind = type(loop)
        fine = _MONOTONIC.get(kind)
        if fine is None:
            fine = _MONOTONIC[kind] = _reads_monotonic(kind)
        return time.monotonic() if fine else loop.time()

    def time(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now() >= deadline`; at once, without yielding, if it already is."""
        loop = asyncio.get_running_loop()
        # A loop: call_at may fire up to one clock resolution early.
        while self.now() < deadline:
            future: asyncio.Future[None] = loop.create_future()
            self._sleeping += 1
            try:
                if self.tick_s is not None and self._sleeping > 1:  # others sleep too: share their ticks
                    key = (loop, math.ceil(deadline / self.tick_s))
                    waiters = self._ticks.get(key)
                    if waiters is None:
                        waiters = self._ticks[key] = []
                        loop.call_at(max(key[1] * self.tick_s, deadline), self._wake_tick, key)
                    waiters.append(future)
                    await future  # cancelled: the tick's callback skips it
                    continue
                handle = loop.call_at(deadline, _wake, future)
                try:
                    await future
                finally:
                    handle.cancel()  # no-op once fired; frees the timer if we were cancelled
            finally:
                self._sleeping -= 1

    def _wake_tick(self, key: tuple[asyncio.AbstractEventLoop, int]) -> None:
        for future in self._ticks.pop(key):
            _wake(future)
