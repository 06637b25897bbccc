"""The clock interface. Time is injected everywhere: the same service code runs
on a real event-loop clock (`AsyncioClock`, for the server) and on a virtual
clock (`sim/`), so simulations run faster than real time."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Clock"]


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds. Only differences mean anything."""
        ...

    def time(self) -> float:
        """Unix epoch seconds, for `created_at` stamps."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now() >= deadline` (at once if it already is)."""
        ...
