"""`AsyncioClock(tick_s=...)`: concurrent sleeps share one loop timer per tick, never wake early,
and a cancelled sleeper leaves its tick's other sleepers (and no bookkeeping) behind.

The clock's logic is tested on `VirtualTimeLoop` (CPU free): loop timers fire exactly when
due, so wake-up times are exact and bounded above too. On a real loop only "never early"
could be asserted, and a loaded machine would decide how late.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from prototype.serve.wallclock import AsyncioClock
from sim.runtime.virtual import run_virtual

TICK_S = 0.001


def _tick_end(deadline: float) -> float:
    """The end of a deadline's tick (deadlines here stay clear of tick boundaries)."""
    return math.ceil(deadline / TICK_S) * TICK_S


def test_sleepers_of_a_tick_share_one_timer_and_never_wake_early() -> None:
    async def main() -> tuple[dict[float, float], int]:
        clock = AsyncioClock(tick_s=TICK_S)
        loop = asyncio.get_running_loop()
        base = loop.time() + 0.01045
        deadlines = [base + i * 0.0001 for i in range(20)]  # 20 deadlines within 2 ms, none on a boundary
        woke: dict[float, float] = {}

        async def sleeper(deadline: float) -> None:
            await clock.sleep_until(deadline)
            woke[deadline] = loop.time()

        tasks = [asyncio.create_task(sleeper(d)) for d in deadlines]
        await asyncio.sleep(0)  # every sleeper armed
        timers = len(clock._ticks)
        await asyncio.gather(*tasks)
        assert not clock._ticks
        return woke, timers

    woke, timers = run_virtual(main, charge_cpu=False)
    first, *others = sorted(woke)
    assert woke[first] == first  # the first sleeper was alone when it armed: an exact timer
    # The others share the timer of their tick and wake at its end: never early, at most a tick late.
    assert all(woke[d] == _tick_end(d) and 0 <= woke[d] - d <= TICK_S for d in others)
    assert timers == len({math.ceil(d / TICK_S) for d in others}) == 3  # one timer per tick, not per sleeper


def test_a_cancelled_sleeper_leaves_the_rest_of_its_tick() -> None:
    async def main() -> tuple[float, float]:
        clock = AsyncioClock(tick_s=TICK_S)
        deadline = clock.now() + 0.00345
        first = asyncio.create_task(clock.sleep_until(deadline))
        second = asyncio.create_task(clock.sleep_until(deadline))
        third = asyncio.create_task(clock.sleep_until(deadline))
        await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        await asyncio.gather(first, third)
        assert not clock._ticks
        return deadline, clock.now()

    deadline, woke = run_virtual(main, charge_cpu=False)
    assert woke == _tick_end(deadline)  # the third still woke with its tick


def test_tick_must_be_positive() -> None:
    with pytest.raises(ValueError):
        AsyncioClock(tick_s=0.0)


def test_a_lone_sleeper_keeps_its_own_timer() -> None:
    async def main() -> tuple[float, float, int]:
        clock = AsyncioClock(tick_s=TICK_S)
        deadline = clock.now() + 0.00245
        task = asyncio.create_task(clock.sleep_until(deadline))
        await asyncio.sleep(0)
        ticks = len(clock._ticks)
        await task
        return deadline, clock.now(), ticks

    deadline, woke, ticks = run_virtual(main, charge_cpu=False)
    assert ticks == 0 and woke == deadline  # no tick rounding without company


async def test_on_a_real_loop_a_sleeper_never_wakes_early() -> None:
    """The one property the real clock can check: asyncio may fire a timer up to its clock
    resolution early, and `sleep_until` must not return before its deadline regardless."""
    clock = AsyncioClock(tick_s=TICK_S)
    loop = asyncio.get_running_loop()
    deadlines = [loop.time() + 0.002 + i * 0.0003 for i in range(5)]
    late: list[float] = []

    async def sleeper(deadline: float) -> None:
        await clock.sleep_until(deadline)
        late.append(loop.time() - deadline)

    await asyncio.gather(*(sleeper(d) for d in deadlines))
    assert len(late) == 5 and min(late) >= 0.0 and not clock._ticks
