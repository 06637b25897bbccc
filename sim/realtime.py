"""The real-time clock: `prototype.clock.Clock` on the running asyncio event loop.

This is the only module in `sim/` that imports asyncio. `now()` is the loop's
own clock (`loop.time()`, monotonic), the same one `loop.call_at` schedules on,
so a deadline computed from `now()` is honoured without conversion. Deadlines
are absolute: a wake-up that comes late does not push later deadlines back,
which is what keeps paced decoding at its exact long-run rate.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["AsyncioClock"]


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled meanwhile
        future.set_result(None)


class AsyncioClock:
    """`Clock` on the running event loop. Holds no loop reference, so it may be
    built before the loop exists (e.g. before uvloop is installed)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def time(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now() >= deadline`; at once, without yielding, if it already is."""
        loop = asyncio.get_running_loop()
        # A loop: call_at may fire up to one clock resolution early.
        while loop.time() < deadline:
            future: asyncio.Future[None] = loop.create_future()
            handle = loop.call_at(deadline, _wake, future)
            try:
                await future
            finally:
                handle.cancel()  # no-op once fired; frees the timer if we were cancelled
