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

Silent connections, on the same timers: `Keepalive`, the server's side: a WebSocket ping when
`interval_s` pass with no frame from the client (what aiohttp's `heartbeat` does on the live
server), or an SSE comment line when a stream has been silent that long
(`ServerConfig.sse_keepalive_s`); and `IdleWatch`, what a load balancer in front of the server
does to one WebSocket or one SSE stream when `ServerConfig.idle_timeout_s` is set (a what-if:
OpenAI documents no such timeout): it closes the connection once that many seconds pass with no
frame in either direction. The in-process transport (`sim.runtime.inprocess`) and the recording
proxy (`sim.record.proxy`) put it in front of the server. Both run on the running loop's timers,
so the same code runs on the real loop and on `sim.runtime.virtual.VirtualTimeLoop` (where a
timer is a point in virtual time, never a wait). Neither sleeps: each keeps one timer, and a
frame only moves a timestamp (the timer, when it fires early, re-arms at the new deadline), so
a token stream costs no timer churn.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["SSE_COMMENT", "AsyncioClock", "IdleCut", "IdleWatch", "Keepalive"]

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


# What a keepalive writes on an SSE stream: a comment line, which every SSE parser drops.
SSE_COMMENT: Final = b": keepalive\n\n"


@dataclass(frozen=True, slots=True)
class IdleCut:
    """One connection the intermediary closed: what it carried (`websocket` or an `sse` stream),
    the mode of the client that opened it, when it opened, its last frame and the cut (loop time, s)."""

    kind: Literal["websocket", "sse"]
    mode: str
    opened_s: float
    last_frame_s: float
    cut_s: float


class _Timer:
    """A deadline that moves: `deadline()` says when the callback is due; the single timer
    handle re-arms itself while the deadline lies ahead."""

    __slots__ = ("_handle", "_loop", "_stopped")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._stopped = False

    def arm(self, when: float) -> None:
        if self._handle is None and not self._stopped:
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        when = self.deadline()
        if self._loop.time() < when:
            self._handle = self._loop.call_at(when, self._fire)
            return
        self.due()

    def deadline(self) -> float:
        raise NotImplementedError

    def due(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class IdleWatch(_Timer):
    """The intermediary on one connection: `frame()` for every frame either way; `on_cut` runs
    once, `timeout_s` after the last frame, unless `stop()` (the connection closed) came first."""

    __slots__ = ("cut", "kind", "last", "mode", "on_cut", "opened", "timeout_s")

    def __init__(
        self, timeout_s: float, on_cut: Callable[[IdleCut], None], *, kind: Literal["websocket", "sse"], mode: str
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("an idle timeout is > 0 s")
        super().__init__(asyncio.get_running_loop())
        self.timeout_s, self.on_cut, self.kind, self.mode = timeout_s, on_cut, kind, mode
        self.opened = self.last = self._loop.time()
        self.cut: IdleCut | None = None
        self.arm(self.last + timeout_s)

    def frame(self) -> None:
        self.last = self._loop.time()

    def deadline(self) -> float:
        return self.last + self.timeout_s

    def due(self) -> None:
        self.cut = IdleCut(self.kind, self.mode, self.opened, self.last, self._loop.time())
        self.on_cut(self.cut)


class Keepalive(_Timer):
    """The server's keepalive on one connection: `send()` (a ping, or an SSE comment) once
    `interval_s` pass since the last `heard()` (a frame that resets it: from the client for
    WebSocket pings, as aiohttp's heartbeat; any frame sent for SSE comments). A sent keepalive
    counts as heard (its pong, or the comment itself), so the next follows `interval_s` later."""

    __slots__ = ("interval_s", "last", "send", "sent")

    def __init__(self, interval_s: float, send: Callable[[], None]) -> None:
        if interval_s <= 0:
            raise ValueError("a keepalive interval is > 0 s")
        super().__init__(asyncio.get_running_loop())
        self.interval_s, self.send = interval_s, send
        self.last = self._loop.time()
        self.sent = 0
        self.arm(self.last + interval_s)

    def heard(self) -> None:
        self.last = self._loop.time()

    def deadline(self) -> float:
        return self.last + self.interval_s

    def due(self) -> None:
        self.sent += 1
        self.last = self._loop.time()
        self.send()
        self.arm(self.last + self.interval_s)
