"""`AsyncioClock(tick_s=...)`: concurrent sleeps share one loop timer per tick, never wake early,
and a cancelled sleeper leaves its tick's other sleepers (and no bookkeeping) behind."""

from __future__ import annotations

import asyncio

import pytest

from sim.realtime import AsyncioClock


async def test_sleepers_of_a_tick_share_one_timer_and_never_wake_early() -> None:
    clock = AsyncioClock(tick_s=0.001)
    loop = asyncio.get_running_loop()
    base = loop.time()
    deadlines = [base + 0.002 + i * 0.0001 for i in range(20)]  # 20 deadlines within 2 ms
    late: list[float] = []

    async def sleeper(deadline: float) -> None:
        await clock.sleep_until(deadline)
        late.append(loop.time() - deadline)

    tasks = [asyncio.create_task(sleeper(d)) for d in deadlines]
    await asyncio.sleep(0)  # every sleeper armed
    assert 1 <= len(clock._ticks) <= 3  # one timer per tick, not one per sleeper
    await asyncio.gather(*tasks)
    assert len(late) == 20 and min(late) >= 0.0
    assert not clock._ticks


async def test_a_cancelled_sleeper_leaves_the_rest_of_its_tick() -> None:
    clock = AsyncioClock(tick_s=0.001)
    deadline = clock.now() + 0.003
    first = asyncio.create_task(clock.sleep_until(deadline))
    second = asyncio.create_task(clock.sleep_until(deadline))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert clock.now() >= deadline and not clock._ticks


def test_tick_must_be_positive() -> None:
    with pytest.raises(ValueError):
        AsyncioClock(tick_s=0.0)


async def test_a_lone_sleeper_keeps_its_own_timer() -> None:
    clock = AsyncioClock(tick_s=0.001)
    deadline = clock.now() + 0.002
    task = asyncio.create_task(clock.sleep_until(deadline))
    await asyncio.sleep(0)
    assert not clock._ticks  # no tick rounding without company
    await task
    assert clock.now() >= deadline
