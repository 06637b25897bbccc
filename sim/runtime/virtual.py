"""Virtual time for asyncio: the same coroutines, no waiting.

Theory of operation
-------------------
An asyncio loop iteration (`asyncio.BaseEventLoop._run_once`) computes how long it
may block (the time to its next timer), blocks that long in its selector, then runs
the timers due and the callbacks ready. `VirtualTimeLoop` runs the same iteration
but never blocks: when no callback is ready it *advances the loop's clock* to the
next timer instead of waiting for it (after polling the real file descriptors with
timeout 0, if any besides the loop's self-pipe are registered). So `asyncio.sleep`,
`loop.call_at` and everything built on them (the simulator's absolute-deadline
pacing, the cost profile's modeled waits, tool times) run in virtual time, in the
same order as on a real clock, without sleeping (SimPy's
RealtimeEnvironment/Environment split, trio's autojump clock).

Real CPU work still matters: the API service's rendering and classification are
real work whose duration the comparison measures. With `charge_cpu=True` (the
default) the wall time the loop spends running callbacks is virtual time: `time()`
is the virtual time at the start of the running callback plus the wall time that
callback has taken so far, so code that reads the clock before and after a piece of
work (the engine's stage timer) sees it take as long as it takes, and the work
stays inside the stage where it runs. Between iterations that time is added to the
loop's clock before it moves on, so a timer due during the work fires when it is
done and one due later fires on time, as on a real clock, and a virtual run takes as
long, in virtual seconds, as a live run on this machine would, minus the waiting
(docs/fidelity.md lists what else a live run spends that virtual time leaves out).
With `charge_cpu=False` CPU work is free, `time()` moves only when the loop jumps to a
timer, and results are exactly reproducible.

Work a real thread does for the loop (`run_in_executor`: the live server's render thread)
is charged the same way: while such work is in flight and no callback is ready, a charged
loop waits for it in real time, as a live loop would (in its selector, up to the next
timer), and the wall time waited is virtual time. The thread's own cost (the hop to it and
back, its priority, a core whose caches are cold) is then the one a live run pays on this
machine.

What an in-process run does not do at all, the live transport's work (aiohttp's request
and response handling, the kernel's loopback, a WebSocket frame's way through both ends),
can be charged as measured: `LiveCosts` holds those per-operation costs as
`python -m sim fidelity --calibrate` measures them on this machine, and the in-process
transports (`sim.runtime.inprocess`) charge each where the live run pays it, with `charge`: the
clock moves as if the running callback had done that work. Never with CPU free.

A loop with nothing ready and no timer would wait forever on a real clock; here
that is a deadlock and raises `VirtualDeadlock` instead of hanging.

The loop's iteration replaces asyncio's private `BaseEventLoop._run_once` and reads the
loop's private state, so it runs only on the Python versions it is tested with
(`TESTED_PYTHONS`); constructing it on another raises `RuntimeError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import heapq
import selectors
import sys
import time
from asyncio import format_helpers
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Final, Self, TypeVar

import msgspec

from prototype.clock import Clock

__all__ = [
    "TESTED_PYTHONS",
    "LiveCosts",
    "VirtualClock",
    "VirtualDeadlock",
    "VirtualTimeLoop",
    "check_python",
    "load_live_costs",
    "run_virtual",
]

T = TypeVar("T")

_MAX_WAIT_S = 86_400.0  # asyncio's MAXIMUM_SELECT_TIMEOUT: the most one iteration waits
_MIN_SCHEDULED = 100  # asyncio's _MIN_SCHEDULED_TIMER_HANDLES
_CANCELLED_FRACTION = 0.5  # asyncio's _MIN_CANCELLED_TIMER_HANDLES_FRACTION

EPOCH_S = 1_767_225_600.0  # 2026-01-01T00:00:00Z: `time()` of virtual t = 0


# The (major, minor) Python versions `VirtualTimeLoop._run_once` is written against and tested on
# (setup.cfg's python_requires matches): it replaces asyncio's private `BaseEventLoop._run_once`
# and reads the loop's private state (`_ready`, `_scheduled`, `_stopping`, `_timer_cancelled_count`,
# `_clock_resolution`, `_process_events`), which another version may change without notice.
TESTED_PYTHONS: Final[tuple[tuple[int, int], ...]] = ((3, 11), (3, 12), (3, 13))


def _running_python() -> tuple[int, int]:
    return sys.version_info.major, sys.version_info.minor


def check_python() -> None:
    """Raise RuntimeError, naming the supported versions, unless this Python is in `TESTED_PYTHONS`."""
    version = _running_python()
    if version not in TESTED_PYTHONS:
        supported = ", ".join(f"{major}.{minor}" for major, minor in TESTED_PYTHONS)
        raise RuntimeError(
            f"VirtualTimeLoop supports Python {supported}, not {version[0]}.{version[1]}: it overrides asyncio's "
            "private BaseEventLoop._run_once and reads the loop's private state, as those versions have them "
            "(sim/runtime/virtual.py, TESTED_PYTHONS)"
        )


_new_handle: Final = object.__new__  # a `Handle` whose fields `call_soon` sets

IDLE_S: Final = 0.001  # a loop that skipped this much virtual time has slept: its next work runs "after a wait"


class LiveCosts(msgspec.Struct, frozen=True, kw_only=True):
    """What the live transport costs per operation beyond what the in-process one does (seconds,
    medians on this machine: `python -m sim fidelity --calibrate` writes them). Each comes back to
    back and "after the loop slept": live, work that follows a wait runs slower (the process
    slept, its caches went cold, its core went to other work), and a turn's request follows the
    tool's time."""

    http_request: float = 0.0  # a POST: the client's call until the server's handler holds the body
    http_request_after_wait: float = 0.0
    http_response: float = 0.0  # its response: headers, the SSE stream's first event and its end
    http_response_after_wait: float = 0.0
    ws_message: float = 0.0  # a WebSocket message: the client's send until the server's handler holds it
    ws_message_after_wait: float = 0.0


def load_live_costs(path: str | Path) -> LiveCosts:
    """The costs in a calibration file (JSON: `LiveCosts` fields; other keys are ignored)."""
    return msgspec.json.decode(Path(path).read_bytes(), type=LiveCosts)


class VirtualDeadlock(RuntimeError):
    """Nothing can ever run again: every task waits on something no timer will bring."""


class _VirtualSelector(selectors.BaseSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self.polled = False  # a descriptor besides the loop's self-pipe is registered
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = self._real.register(fileobj, events, data)
        self.polled = len(self._real.get_map()) > 1
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = self._real.unregister(fileobj)
        self.polled = len(self._real.get_map()) > 1
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """asyncio's own iteration (a debug loop) asks to wait `timeout` from the time it read
        just before this call, which includes the charged CPU work: the clock moves that far."""
        loop = self._loop
        loop._charge()  # `timeout` was computed from `time()`, which counted the last callbacks' work
        if loop._threads:  # wait for the thread in real time, charged
            ready = self._real.select(timeout)
            loop._charge()
            loop._restart_mark()
            return ready
        ready = self._real.select(0)
        if not ready:
            if timeout is None:
                raise VirtualDeadlock("no task is ready and no timer is pending")
            loop.virtual_now += timeout
        loop._restart_mark()
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose `time()` is virtual and which never blocks (on `TESTED_PYTHONS` only)."""

    def __new__(cls, *, charge_cpu: bool = True) -> Self:
        # Checked before the loop exists: a loop whose __init__ raised fails again in asyncio's __del__.
        check_python()
        return super().__new__(cls)

    def __init__(self, *, charge_cpu: bool = True) -> None:
        self.virtual_now = 0.0
        self._charge_cpu = charge_cpu
        self._cpu_mark = 0.0  # perf_counter at the start of the work not yet added to `virtual_now`
        self._in_loop = False  # the loop is running (outside it, its clock stands still)
        self._threads = 0  # executor jobs in flight (counted only when CPU is charged)
        self._charged_s = 0.0  # live costs charged so far (`charge`)
        self._virtual_selector = _VirtualSelector(self)
        super().__init__(selector=self._virtual_selector)
        if charge_cpu:  # chosen once: a free-CPU loop's `time()` stays a bare attribute read
            self.time = self._charged_time  # type: ignore[method-assign]

    @property
    def charge_cpu(self) -> bool:
        return self._charge_cpu

    def time(self) -> float:
        return self.virtual_now

    def _charged_time(self) -> float:
        """The virtual time now: the loop's clock plus the wall time the running callbacks
        have taken so far (not yet added to it)."""
        if not self._in_loop:
            return self.virtual_now
        return self.virtual_now + (time.perf_counter() - self._cpu_mark)

    def charge(self, seconds: float) -> None:
        """Move the clock on by `seconds` of work a live run does here and this one does not (a
        `LiveCosts` entry), as if the running callback had done it: nothing else runs meanwhile.
        Only on a loop that charges CPU."""
        if not self._charge_cpu:
            raise RuntimeError("a live cost is charged only where CPU is charged")
        self.virtual_now += seconds
        self._charged_s += seconds

    def mark(self) -> tuple[float, float, float]:
        """A point to measure `idle_since` from."""
        return self.time(), time.perf_counter(), self._charged_s

    def idle_since(self, mark: tuple[float, float, float]) -> float:
        """The virtual time since `mark` that the loop skipped (jumping to a timer) rather than
        spent on work or charged costs: > 0 when it slept meanwhile."""
        at, wall, charged = mark
        return (self.time() - at) - (time.perf_counter() - wall) - (self._charged_s - charged)

    def _charge(self) -> None:
        """Add the wall time since the mark to the loop's clock (it stays what `time()` read)."""
        if self._charge_cpu and self._in_loop:
            now = time.perf_counter()
            self.virtual_now += now - self._cpu_mark
            self._cpu_mark = now

    def _restart_mark(self) -> None:
        if self._charge_cpu:
            self._cpu_mark = time.perf_counter()

    def call_soon(  # type: ignore[override]  # the same call; typeshed's is variadic-generic
        self, callback: Callable[..., object], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        """As asyncio's (every task's wake-up comes through here), in one call when debug is off:
        the `Handle`'s fields are set here, as its `__init__` sets them without debug (on
        `TESTED_PYTHONS`: asyncio's `Handle` slots)."""
        base: Any = self  # asyncio's private loop state
        if base._debug:
            return super().call_soon(callback, *args, context=context)
        if base._closed:
            raise RuntimeError("Event loop is closed")  # asyncio's `_check_closed`
        handle: Any = _new_handle(asyncio.Handle)
        handle._context = contextvars.copy_context() if context is None else context
        handle._loop = self
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        handle._repr = None
        handle._source_traceback = None
        base._ready.append(handle)
        return handle  # type: ignore[no-any-return]

    def run_in_executor(  # type: ignore[override]  # the same call; typeshed's is variadic-generic
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """As asyncio's; with CPU charged the job is counted in flight until its result is back
        on the loop, so that the loop waits for it in real time rather than jumping ahead."""
        future = super().run_in_executor(executor, func, *args)
        if self._charge_cpu:
            self._threads += 1
            future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: object) -> None:
        self._threads -= 1

    def _wait_for_threads(self, scheduled: list[Any]) -> list[tuple[selectors.SelectorKey, int]]:
        """Block in the real selector (the self-pipe wakes it when a thread's result is queued)
        up to the next timer; the wall time it blocks is charged with the next callbacks."""
        timeout = min(max(0.0, scheduled[0]._when - self.virtual_now), _MAX_WAIT_S) if scheduled else None
        return self._virtual_selector._real.select(timeout)

    def run_forever(self) -> None:
        """Charged work is what runs inside the loop: the wall time before it starts and after
        it stops (between `run_until_complete` calls) is no virtual time."""
        self._restart_mark()
        self._in_loop = True
        try:
            super().run_forever()
        finally:
            self._charge()
            self._in_loop = False

    def _run_once(self) -> None:
        """One iteration of `asyncio.BaseEventLoop._run_once` (CPython 3.11-3.13), leaner: the
        real file descriptors are polled only when no callback is ready and something besides
        the self-pipe is registered (asyncio polls them every iteration; the self-pipe only
        wakes a blocked selector, and `call_soon_threadsafe` queues its callback before
        writing to it), and each callback run in place (`Handle._run`'s body; no asyncio handle
        overrides it). Same timers, same order. With debug on, asyncio's own iteration runs
        (it times slow callbacks) over `_VirtualSelector`."""
        base: Any = self  # asyncio's private loop state, which its stubs do not (all) declare
        if base._debug:
            base_run_once: Callable[[], None] = super()._run_once  # type: ignore[misc]
            base_run_once()
            return
        scheduled: list[Any] = base._scheduled  # TimerHandles, a heap on `_when`
        ready: collections.deque[Any] = base._ready
        if base._timer_cancelled_count:
            scheduled = self._drop_cancelled(scheduled)
        selector = self._virtual_selector
        charging = self._charge_cpu
        if charging:  # the last callbacks took this long: `time()` already counted it
            now = time.perf_counter()
            self.virtual_now += now - self._cpu_mark
        if not ready and not base._stopping:
            events: list[tuple[selectors.SelectorKey, int]] | None
            if self._threads:  # only counted when charging, so `now` is set: the wait is charged
                events = self._wait_for_threads(scheduled)
                self.virtual_now += time.perf_counter() - now
            else:
                events = selector._real.select(0) if selector.polled else None
            if events:
                base._process_events(events)
            elif self._threads:
                pass  # the timer's time has come in real time (charged above), or the selector woke early
            elif scheduled:
                wait = scheduled[0]._when - self.virtual_now
                if wait > 0:
                    self.virtual_now += wait if wait < _MAX_WAIT_S else _MAX_WAIT_S
            else:
                raise VirtualDeadlock("no task is ready and no timer is pending")
        if charging:
            self._cpu_mark = time.perf_counter()
        end = self.virtual_now + base._clock_resolution
        while scheduled and scheduled[0]._when < end:
            timer = heapq.heappop(scheduled)
            timer._scheduled = False
            ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                try:  # `Handle._run`, in place
                    handle._context.run(handle._callback, *handle._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self._callback_failed(handle, exc)
        handle = None  # breaks cycles when a callback raised

    def _callback_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """`Handle._run`'s report of a callback that raised, to the loop's exception handler."""
        run: Any = handle  # asyncio's private Handle state, which its stubs do not declare
        source = format_helpers._format_callback_source(run._callback, run._args)
        context: dict[str, Any] = {"message": f"Exception in callback {source}", "exception": exc, "handle": handle}
        if run._source_traceback:
            context["source_traceback"] = run._source_traceback
        self.call_exception_handler(context)

    def _drop_cancelled(self, scheduled: list[Any]) -> list[Any]:
        """asyncio's clean-up of cancelled timers: all of them once they are half of many (into a
        new heap, returned), else those at the head."""
        base: Any = self
        count = len(scheduled)
        if count > _MIN_SCHEDULED and base._timer_cancelled_count / count > _CANCELLED_FRACTION:
            kept = []
            for timer in scheduled:
                if timer._cancelled:
                    timer._scheduled = False
                else:
                    kept.append(timer)
            heapq.heapify(kept)
            base._scheduled = kept
            base._timer_cancelled_count = 0
            return kept
        while scheduled and scheduled[0]._cancelled:
            base._timer_cancelled_count -= 1
            heapq.heappop(scheduled)._scheduled = False
        return scheduled


class VirtualClock:
    """The `Clock` of code running on a `VirtualTimeLoop` (or any of asyncio's own loops: it reads
    the loop's time and sets its timers on the loop's timer heap). A `VirtualTimeLoop` that does
    not charge CPU has its clock for its time: that is read in place (the engine reads the clock a
    few times a token)."""

    def now(self) -> float:
        loop = _get_running_loop()
        if type(loop) is VirtualTimeLoop and not loop._charge_cpu:
            return loop.virtual_now
        return loop.time()

    def time(self) -> float:
        return EPOCH_S + self.now()

    async def sleep_until(self, deadline: float) -> None:
        loop = _get_running_loop()
        if deadline > (loop.virtual_now if type(loop) is VirtualTimeLoop and not loop._charge_cpu else loop.time()):
            await _Alarm(loop, deadline)


_get_running_loop: Final = asyncio.get_running_loop  # read per clock reading: one lookup less


class _Alarm(asyncio.TimerHandle):
    """What `VirtualClock.sleep_until` awaits: the loop's timer and, in the same object, the
    future-like object the waiting task waits on (asyncio's duck-typed protocol:
    ``_asyncio_future_blocking``, ``add_done_callback``, ``result``, ``cancel``; with no
    ``get_loop`` the task reads ``_loop``). The task's wake-up is the timer's callback.
    `asyncio.sleep` costs two callbacks in two loop iterations (the timer sets a future, whose
    callback then wakes the task) and a timer and a future to make; this costs one callback and one
    object, and a virtual rollout waits 7 times a turn (its engine once a token). The task wakes
    at the same virtual time as with `asyncio.sleep`.

    The timer part is a `TimerHandle` as `loop.call_at` makes one, its fields set here (on
    `TESTED_PYTHONS`: asyncio's `Handle` and `TimerHandle` slots) and pushed on the loop's timer
    heap once the task's wake-up is known. Its `cancel` and `cancelled` are the future's: the
    timer is cancelled through `TimerHandle.cancel`."""

    __slots__ = ("_aborted", "_asyncio_future_blocking", "_message")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float) -> None:  # not TimerHandle's: see the class
        timer: Any = self  # asyncio's private Handle state, which its stubs do not declare
        timer._loop = loop
        timer._when = when
        timer._callback = None  # the task's wake-up (`add_done_callback`)
        timer._args = None
        timer._context = None
        timer._cancelled = False  # the timer's (its heap skips it)
        timer._scheduled = False
        timer._repr = None
        timer._source_traceback = None
        self._asyncio_future_blocking = False
        self._aborted = False  # the future's: the task was cancelled while it waited
        self._message: object = None

    def __lt__(self, other: asyncio.TimerHandle) -> bool:
        """Its place in the loop's timer heap, which holds timers only (TimerHandle's also checks that)."""
        return self._when < other._when  # type: ignore[attr-defined, no-any-return]

    def __await__(self) -> Generator[_Alarm, None, None]:
        self._asyncio_future_blocking = True
        yield self  # the task calls add_done_callback(its wake-up); result() raises if cancelled

    def add_done_callback(self, fn: Callable[[_Alarm], object], *, context: contextvars.Context | None = None) -> None:
        timer: Any = self
        if timer._callback is not None or timer._cancelled:
            raise RuntimeError("an alarm wakes one task, once")
        timer._callback, timer._args = fn, (self,)
        timer._context = contextvars.copy_context() if context is None else context
        heapq.heappush(timer._loop._scheduled, self)
        timer._scheduled = True

    def remove_done_callback(self, fn: Callable[[_Alarm], object]) -> int:
        timer: Any = self
        if timer._callback is None or fn != timer._callback:
            return 0
        asyncio.TimerHandle.cancel(self)
        return 1

    def result(self) -> None:
        if self._aborted:
            raise asyncio.CancelledError(*(() if self._message is None else (self._message,)))

    def cancelled(self) -> bool:
        return self._aborted

    def cancel(self, msg: object = None) -> bool:  # type: ignore[override]  # the future's (see the class)
        """The task is being cancelled while it waits (its wake-up has not run: then it would not
        wait any more): wake it now, with `CancelledError`."""
        timer: Any = self
        wake, context = timer._callback, timer._context
        if self._aborted or wake is None:
            return False
        asyncio.TimerHandle.cancel(self)
        self._aborted, self._message = True, msg
        timer._loop.call_soon(wake, self, context=context)
        return True


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]] | Awaitable[T], *, charge_cpu: bool = True) -> T:
    """Run a coroutine to completion on a fresh `VirtualTimeLoop`."""
    loop = VirtualTimeLoop(charge_cpu=charge_cpu)
    try:
        coro = main() if callable(main) else main
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


_: Clock = VirtualClock()  # VirtualClock implements the Clock protocol
