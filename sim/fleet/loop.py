"""The fleet's event loop alone, as SimPy's environment is apart from its processes: a clock, a
heap of (time, sequence, kind, session, number) and a handler table by event kind. The parts
(sim/fleet/steps.py, holds.py, routing.py, ledger.py, offload.py) push events and read the clock;
the fleet (sim/fleet/engine.py) owns the handlers. Same time, first pushed first: the sequence
number breaks ties, so a run is a pure function of its inputs."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from enum import IntEnum

__all__ = ["Event", "EventLoop", "Handler"]


class Event(IntEnum):
    """What happens at an event's time; `session` and `number` say to whom (see each handler)."""

    ARRIVE = 0  # a session arrives: its first turn is sent
    READY = 1  # a turn's API work is done: it reaches its replica's admission
    FIRST = 2  # free compute: a turn's first token
    FREE = 3  # free compute: a turn's last token (its slot frees)
    END = 4  # the client has the turn's whole answer
    SEND = 5  # the client sends the next turn (its tool has run)
    TTL = 6  # a held paused context's time-to-live ends (`number`: its pause)
    STEP = 7  # priced compute: a replica's step or decode segment ends (`session`: the replica, `number`: its version)
    JOIN = 8  # an offloaded context is back in GPU memory: its turn joins the prefill queue
    COPIED = 9  # a context's copy to host memory ends (`session`: the replica, `number`: its tokens)


Handler = Callable[[float, int, int], None]


class EventLoop:
    """The clock and the event heap. `run` pops events in time order, sets `now` and calls the
    handler of each event's kind; `before` sees every event's time first (the KV integration)."""

    __slots__ = ("heap", "now", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0  # pushes (and the decode heap's ties) so far
        self.now = 0.0

    def push(self, t: float, kind: Event, session: int, number: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, session, number))

    def next_seq(self) -> int:
        """A tie-breaking number from the events' own sequence (a decode heap orders by it too)."""
        self.seq += 1
        return self.seq

    def run(self, handlers: Sequence[Handler], before: Callable[[float], None], until: float = math.inf) -> None:
        """Every event up to `until`, in order; the first one after it stays on the heap."""
        heap = self.heap
        pop = heapq.heappop
        while heap:
            t, _, kind, session, number = heap[0]
            if t > until:
                break
            pop(heap)
            before(t)
            self.now = t
            handlers[kind](t, session, number)
