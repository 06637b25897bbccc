"""A deterministic virtual clock for tests and offline simulation.

`ManualClock` implements `prototype.clock.Clock` without an event loop: time
moves only when a test calls `advance` or when a coroutine awaits
`sleep_until`, which *autojumps* (after trio's `MockClock(autojump_threshold=0)`):
it sets ``now`` to the deadline at once, so sleep-heavy code runs instantly and
exactly. ``wake_lateness_s`` adds a fixed delay to every wake-up, the way a busy
event loop wakes a sleeper late, so tests can check that code pacing itself by
absolute deadlines does not drift.

Limit: the jump happens as soon as a coroutine sleeps, not when every task is
idle, so with several tasks sleeping concurrently time jumps in call order, not
deadline order. Use it for one consumer at a time; multi-task virtual time
belongs to the simulation engine. No asyncio here (sim/ layering rule): the
``async def`` never suspends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["MANUAL_CLOCK_EPOCH_S", "ManualClock", "Wakeup"]

MANUAL_CLOCK_EPOCH_S: Final = 1_767_225_600.0  # 2026-01-01T00:00:00Z: plausible `created_at` stamps


@dataclass(frozen=True, slots=True)
class Wakeup:
    """One `sleep_until` that actually slept: the deadline asked for and the time it woke."""

    deadline: float
    woke_at: float


class ManualClock:
    """Virtual monotonic time starting at `start` seconds; see the module docstring."""

    def __init__(self, start: float = 0.0, *, wake_lateness_s: float = 0.0) -> None:
        if wake_lateness_s < 0:
            raise ValueError(f"wake_lateness_s must be >= 0, got {wake_lateness_s}")
        self._now = float(start)
        self.wake_lateness_s = wake_lateness_s
        self.wakeups: list[Wakeup] = []  # every sleep that slept, in order

    def now(self) -> float:
        return self._now

    def time(self) -> float:
        """Epoch seconds: `MANUAL_CLOCK_EPOCH_S` + `now()`."""
        return MANUAL_CLOCK_EPOCH_S + self._now

    def advance(self, dt: float) -> None:
        """Move time forward by `dt` >= 0 seconds (time never goes back)."""
        if not dt >= 0:
            raise ValueError(f"cannot advance by {dt}")
        self._now += dt

    async def sleep_until(self, deadline: float) -> None:
        """Jump to `deadline` + `wake_lateness_s` and record a `Wakeup`.

        A deadline not in the future returns at once, with no lateness and no
        record: nothing slept, as with `AsyncioClock`.
        """
        if deadline <= self._now:
            return
        self._now = deadline + self.wake_lateness_s
        self.wakeups.append(Wakeup(deadline, self._now))
