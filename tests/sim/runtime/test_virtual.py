"""Virtual time: the same coroutines, no waiting; and the comparison's fidelity to live runs."""

from __future__ import annotations

import asyncio
import configparser
import hashlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import pytest
from packaging.specifiers import SpecifierSet

from sim.__main__ import run
from sim.harness.experiment import CompareConfig
from sim.runtime import virtual as virtual_module
from sim.runtime.virtual import TESTED_PYTHONS, VirtualClock, VirtualDeadlock, VirtualTimeLoop, run_virtual
from tests.support import REPO


def test_sleeps_advance_virtual_time_in_deadline_order_without_waiting() -> None:
    order: list[tuple[float, str]] = []

    async def sleeper(name: str, delays: list[float]) -> None:
        clock = VirtualClock()
        for d in delays:
            await asyncio.sleep(d)
            order.append((round(clock.now(), 9), name))

    async def main() -> float:
        await asyncio.gather(sleeper("a", [1.0, 2.0]), sleeper("b", [0.5, 1.0, 5.0]))
        return asyncio.get_running_loop().time()

    wall = time.perf_counter()
    end = run_virtual(main, charge_cpu=False)
    assert time.perf_counter() - wall < 1.0  # 6.5 virtual seconds, no waiting
    assert end == pytest.approx(6.5)
    assert order == [(0.5, "b"), (1.0, "a"), (1.5, "b"), (3.0, "a"), (6.5, "b")]


def test_sleep_until_is_absolute() -> None:
    async def main() -> float:
        clock = VirtualClock()
        await clock.sleep_until(10.0)
        await clock.sleep_until(3.0)  # already past: returns at once
        return clock.now()

    assert run_virtual(main, charge_cpu=False) == 10.0


def test_clock_sleeps_interleave_with_asyncio_sleeps_in_deadline_order() -> None:
    """`VirtualClock.sleep_until` wakes its task from the timer itself (one callback, not two):
    tasks still wake in deadline order, whichever way they sleep."""
    order: list[tuple[float, str]] = []

    async def sleeper(name: str, deadlines: list[float], clock_sleeps: bool) -> None:
        clock = VirtualClock()
        for deadline in deadlines:
            if clock_sleeps:
                await clock.sleep_until(deadline)
            else:
                await asyncio.sleep(deadline - clock.now())
            order.append((round(clock.now(), 9), name))

    async def main() -> None:
        await asyncio.gather(sleeper("a", [1.0, 3.0], True), sleeper("b", [1.5, 2.5], False), sleeper("c", [2.0], True))

    run_virtual(main, charge_cpu=False)
    assert order == [(1.0, "a"), (1.5, "b"), (2.0, "c"), (2.5, "b"), (3.0, "a")]


@pytest.mark.parametrize("how", ["cancel", "wait_for", "timeout"])
def test_a_clock_sleep_can_be_cancelled(how: str) -> None:
    """Cancelled while it waits, the task gets CancelledError at once (with the message), and the
    abandoned timer wakes nothing later."""

    async def main() -> tuple[float, str]:
        clock = VirtualClock()
        loop = asyncio.get_running_loop()
        if how == "cancel":
            task = loop.create_task(clock.sleep_until(10.0))
            await asyncio.sleep(2.0)
            task.cancel("enough")
            try:
                await task
            except asyncio.CancelledError as exc:
                message = str(exc)
        elif how == "wait_for":
            try:
                await asyncio.wait_for(clock.sleep_until(10.0), timeout=2.0)
            except TimeoutError:
                message = "timed out"
        else:
            try:
                async with asyncio.timeout(2.0):
                    await clock.sleep_until(10.0)
            except TimeoutError:
                message = "timed out"
        cancelled_at = clock.now()
        await asyncio.sleep(20.0)  # past the abandoned deadline: nothing may wake or fail
        return cancelled_at, message

    assert run_virtual(main, charge_cpu=False) == (2.0, "enough" if how == "cancel" else "timed out")


def test_a_task_waiting_forever_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(VirtualDeadlock, match=r"^no task is ready and no timer is pending$"):
        run_virtual(main, charge_cpu=False)


def test_cpu_work_is_charged_when_asked() -> None:
    async def busy() -> float:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)
        return asyncio.get_running_loop().time()

    assert run_virtual(busy, charge_cpu=True) >= 0.05
    assert run_virtual(busy, charge_cpu=False) == 0.0
    loop = VirtualTimeLoop()
    loop.close()


@pytest.mark.parametrize("debug", [False, True], ids=["lean-iteration", "asyncio-iteration"])
def test_charged_cpu_delays_a_timer_only_past_its_deadline_as_on_a_real_clock(debug: bool) -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        loop.set_debug(debug)
        fired: list[float] = []
        loop.call_at(0.01, lambda: fired.append(loop.time()))  # due during the work below
        loop.call_at(0.5, lambda: fired.append(loop.time()))  # due well after it
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(1.0)
        return fired

    early, late = run_virtual(main, charge_cpu=True)
    assert 0.05 <= early < 0.5  # fires when the work is done, not 0.01 after it
    # The work is part of the wait, not added to it (that would be >= 0.55); the callback reads
    # the clock a few microseconds into its iteration, which is charged too.
    assert 0.5 <= late < 0.54


def test_cancelled_timers_never_fire_and_the_rest_fire_once_at_their_times() -> None:
    fired: list[tuple[int, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handles = [loop.call_at(1.0 + i, lambda i=i: fired.append((i, loop.time()))) for i in range(300)]
        for i, handle in enumerate(handles):
            if i % 4:  # three quarters cancelled: past half of >100 timers, asyncio's bulk clean-up,
                handle.cancel()  # in the iteration where the first live one (at 1.0) is due
        await asyncio.sleep(400.0)
        late = [loop.call_at(500.0 + i, lambda i=i: fired.append((1000 + i, loop.time()))) for i in range(3)]
        late[0].cancel()  # at the head of a small heap: dropped from the head
        await asyncio.sleep(200.0)

    run_virtual(main, charge_cpu=False)
    assert fired == [(i, 1.0 + i) for i in range(0, 300, 4)] + [(1001, 501.0), (1002, 502.0)]


def test_real_descriptors_are_read_before_time_jumps_to_the_next_timer() -> None:
    import socket

    async def main() -> tuple[bytes, float, float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            sleeper = asyncio.create_task(asyncio.sleep(100.0))
            receiving = asyncio.create_task(loop.sock_recv(a, 16))
            await asyncio.sleep(0)  # the receiver found nothing and waits on the descriptor
            b.send(b"ping")
            data = await receiving
            got_at = loop.time()
            await sleeper
            return data, got_at, loop.time()
        finally:
            a.close()
            b.close()

    assert run_virtual(main, charge_cpu=False) == (b"ping", 0.0, 100.0)


def test_a_debug_loop_runs_asyncios_own_iteration_in_virtual_time() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        clock, times = VirtualClock(), []
        for deadline in (0.5, 2.0, 2.0, 7.25):
            await clock.sleep_until(deadline)
            times.append(loop.time())
        return times

    assert run_virtual(main, charge_cpu=False) == [0.5, 2.0, 2.0, 7.25]


SMALL = CompareConfig.of(rollouts=2, tool_calls=6, tool_time_s=0.05, profile="hosted")


def test_virtual_results_are_deterministic_for_a_seed() -> None:
    runs = [run(SMALL, virtual=True, free_cpu=True) for _ in range(2)]
    times = [[r.completion_s for r in result.rollouts] for result in runs]
    assert times[0] == times[1]
    ttfts = [[t.ttft_s for r in result.rollouts for t in r.turns] for result in runs]
    assert ttfts[0] == ttfts[1]
    assert runs[0].summary == runs[1].summary


# Virtual time leaves out live costs that only add time (docs/fidelity.md, "Live costs virtual
# time leaves out": timer wake-ups, work right after a wait, the stream's end), so a virtual turn
# is shorter than a live one by a few percent on the hosted profile's ten or so waits a turn: the
# bound is one-sided, wide below and tight above.
FASTER: Final = 0.08  # how much shorter than live a virtual median may be
SLOWER: Final = 0.02  # how much longer (none of what is left out makes virtual time slower)


@pytest.mark.slow
@pytest.mark.wire_unchecked  # times live clients: no per-event validation on their path
def test_virtual_time_agrees_with_live_loopback() -> None:
    """Each mode's median turn (the median over every turn, so one preemption of the live process
    on a shared machine does not decide) and its median rollout, live against virtual: virtual at
    most `FASTER` shorter and `SLOWER` longer."""
    live, virtual = run(SMALL, virtual=False), run(SMALL, virtual=True)

    def median_turn(result: Any, mode: str) -> float:
        return statistics.median(t.e2e_s for r in result.rollouts if r.mode == mode for t in r.turns)

    for a_mode, b_mode in zip(live.summary, virtual.summary, strict=True):
        for what, a, b in (
            ("median turn", median_turn(live, a_mode.mode), median_turn(virtual, b_mode.mode)),
            ("median rollout", a_mode.completion_p50_s, b_mode.completion_p50_s),
        ):
            assert -FASTER <= b / a - 1 <= SLOWER, (a_mode.mode, what, a, b)


def test_an_in_process_channel_keeps_order_survives_a_cancelled_get_and_has_one_consumer() -> None:
    from sim.runtime.inprocess import _Channel

    async def main() -> list[object]:
        channel: _Channel[int] = _Channel()
        got: list[object] = []
        channel.put_nowait(1)
        got.append(await channel.get())  # ready: no wait
        waiting = asyncio.create_task(channel.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await channel.get()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        later = asyncio.create_task(channel.get())
        await asyncio.sleep(1.0)
        channel.put_nowait(2)
        channel.put_nowait(3)
        got.append(await later)
        got.append(await channel.get())
        got.append(asyncio.get_running_loop().time())
        return got

    assert run_virtual(main, charge_cpu=False) == [1, 2, 3, 1.0]


def test_charged_time_moves_inside_a_callback_by_the_work_done_there() -> None:
    """Two clock reads around a piece of work in one callback (no await between them): with
    CPU charged the second read is later by at least the work's duration; with CPU free the
    clock stands still. Outside the running loop the clock stands still either way."""

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    async def main() -> tuple[float, float]:
        clock = VirtualClock()
        await asyncio.sleep(1.0)
        before = clock.now()
        spin(0.02)
        return before, clock.now()

    before, after = run_virtual(main, charge_cpu=True)
    assert before >= 1.0 and after - before >= 0.02
    before, after = run_virtual(main, charge_cpu=False)
    assert (before, after) == (1.0, 1.0)
    loop = VirtualTimeLoop(charge_cpu=True)
    try:
        loop.run_until_complete(asyncio.sleep(0.5))
        stopped = loop.time()
        spin(0.01)
        assert loop.time() == stopped  # not running: no callback is doing work
        loop.run_until_complete(asyncio.sleep(0))
        assert stopped <= loop.time() < stopped + 0.01  # the gap between runs is not charged
    finally:
        loop.close()


@pytest.mark.parametrize("debug", [False, True], ids=["lean-iteration", "asyncio-iteration"])
def test_with_cpu_charged_work_on_a_thread_is_waited_for_in_real_time_and_charged(debug: bool) -> None:
    """A job on an executor thread (the live server's render thread) takes virtual time as it
    takes wall time: the loop waits for it rather than jumping to its next timer, a timer due
    while the thread works fires when it is due, and one due after the job fires on time."""

    def work(seconds: float) -> float:
        """Hashing for `seconds` (hashlib releases the GIL over large buffers, as the BPE does)."""
        data, end = bytes(1 << 20), time.perf_counter() + seconds
        while time.perf_counter() < end:
            hashlib.sha256(data)
        return seconds

    async def main() -> tuple[float, float, list[float]]:
        loop = asyncio.get_running_loop()
        loop.set_debug(debug)
        fired: list[float] = []
        loop.call_at(0.01, lambda: fired.append(loop.time()))  # due while the thread works
        loop.call_at(1.0, lambda: fired.append(loop.time()))  # due well after it
        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, work, 0.05)
        done = loop.time()
        await asyncio.sleep(2.0)
        return done, loop.time(), fired

    wall = time.perf_counter()
    done, end, (during, after) = run_virtual(main, charge_cpu=True)
    assert time.perf_counter() - wall < 1.0  # the 2 s sleep is still virtual
    assert 0.05 <= done < 0.5
    assert 0.01 <= during < done  # the loop ran it while it waited for the thread
    assert 1.0 <= after < 1.05 and end >= 2.05


def test_the_loop_refuses_an_untested_python_naming_the_supported_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    for untested in ((3, 10), (3, 14), (4, 0)):
        monkeypatch.setattr(virtual_module, "_running_python", lambda v=untested: v)
        with pytest.raises(RuntimeError) as refused:
            VirtualTimeLoop()
        message = str(refused.value)
        assert f"not {untested[0]}.{untested[1]}" in message
        assert "supports Python 3.11, 3.12, 3.13" in message and "private BaseEventLoop._run_once" in message
        with pytest.raises(RuntimeError, match="supports Python 3.11, 3.12, 3.13"):
            run_virtual(lambda: asyncio.sleep(0), charge_cpu=False)


def test_this_python_is_tested_and_runs_the_loop() -> None:
    assert sys.version_info[:2] in TESTED_PYTHONS
    virtual_module.check_python()
    assert run_virtual(asyncio.sleep(1.0, result="slept"), charge_cpu=False) == "slept"


def test_python_requires_admits_exactly_the_tested_versions() -> None:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requires = SpecifierSet(setup["options"]["python_requires"])
    admitted = [(3, minor) for minor in range(30) if f"3.{minor}" in requires]
    assert admitted == list(TESTED_PYTHONS)
