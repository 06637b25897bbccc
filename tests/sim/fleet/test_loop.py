"""The fleet's event loop alone (sim/fleet/loop.py): time order, ties in push order, a handler
per kind, events pushed by a handler run in the same pass, and `until` leaves the rest."""

from __future__ import annotations

from sim.fleet.loop import Event, EventLoop, Handler


def _recording(loop: EventLoop, seen: list[tuple[float, str, int, int]]) -> list[Handler]:
    def handler(name: str) -> Handler:
        def on(t: float, session: int, number: int) -> None:
            assert loop.now == t
            seen.append((t, name, session, number))
            if name == "SEND" and number < 2:  # a handler pushes the next event, as the fleet's do
                loop.push(t + 1.0, Event.SEND, session, number + 1)

        return on

    return [handler(kind.name) for kind in Event]


def test_events_run_in_time_order_and_ties_in_push_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str, int, int]] = []
    befores: list[tuple[float, float]] = []
    loop.push(2.0, Event.END, 1)
    loop.push(1.0, Event.READY, 2)
    loop.push(1.0, Event.ARRIVE, 3)  # same time as READY, pushed after it: runs after it
    loop.push(0.5, Event.SEND, 4, 0)
    loop.run(_recording(loop, seen), lambda t: befores.append((t, loop.now)))
    assert seen == [
        (0.5, "SEND", 4, 0),
        (1.0, "READY", 2, 0),
        (1.0, "ARRIVE", 3, 0),
        (1.5, "SEND", 4, 1),
        (2.0, "END", 1, 0),
        (2.5, "SEND", 4, 2),
    ]
    # `before` sees each event's time while the clock still shows the previous one.
    assert befores == [(0.5, 0.0), (1.0, 0.5), (1.0, 1.0), (1.5, 1.0), (2.0, 1.5), (2.5, 2.0)]
    assert not loop.heap


def test_run_stops_at_until_and_leaves_the_later_events() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str, int, int]] = []
    loop.push(1.0, Event.STEP, 0, 7)
    loop.push(3.0, Event.TTL, 5, 1)
    loop.run(_recording(loop, seen), lambda t: None, until=2.0)
    assert seen == [(1.0, "STEP", 0, 7)]
    assert loop.now == 1.0 and [e[2] for e in loop.heap] == [Event.TTL]


def test_the_sequence_is_shared_with_other_heaps() -> None:
    loop = EventLoop()
    loop.push(0.0, Event.ARRIVE, 0)
    assert loop.next_seq() == 2
    loop.push(0.0, Event.ARRIVE, 1)
    assert sorted(seq for _, seq, _, _, _ in loop.heap) == [1, 3]
