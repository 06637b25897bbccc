"""The lane multiplexer: its kept counts (responses in flight, creates waiting) agree with the lanes
through every way a connection fills and empties them, and waiting lanes start in arrival order."""

from __future__ import annotations

import json

import pytest

from prototype.config import WebSocketConfig
from prototype.ws.connection import Connection
from prototype.ws.events import CreateReceived, StartJob
from prototype.ws.lanes import CS, ConnectionStateError
from prototype.ws.mux import CONCURRENT_REQUEST, LaneMux


def create(**fields: object) -> str:
    return json.dumps({"type": "response.create", "model": "sim", "input": "hi", **fields})


def counted(c: Connection) -> tuple[int, int]:
    """What the mux keeps, recounted from the lanes."""
    lanes = c.lanes.values()
    return sum(lane.in_flight is not None for lane in lanes), sum(len(lane.queue) for lane in lanes)


def agrees(c: Connection) -> bool:
    return (c.mux.in_flight, c.mux.waiting) == counted(c)


def started(c: Connection) -> list[str | None]:
    return [o.job.stream_id for o in c.outputs_to_send() if isinstance(o, StartJob)]


def test_counts_follow_starts_ends_and_the_cap() -> None:
    c = Connection(max_in_flight=2)
    for name in ("a", "b", "c", "a"):
        c.receive_text(create(stream_id=name))
        assert agrees(c)
    assert started(c) == ["a", "b"] and (c.mux.in_flight, c.mux.waiting) == (2, 2)
    c.response_ended(c.lanes["b"].in_flight, None)  # type: ignore[arg-type]
    assert started(c) == ["c"] and agrees(c)  # lane c arrived before a's second create
    c.response_ended(c.lanes["a"].in_flight, None)  # type: ignore[arg-type]
    assert started(c) == ["a"] and agrees(c) and c.mux.waiting == 0


def test_counts_after_limit_and_disconnect() -> None:
    c = Connection(max_in_flight=1)
    for name in ("a", "b", "b"):
        c.receive_text(create(stream_id=name))
    c.limit_reached()  # b's queued creates are refused; a's response may finish
    assert agrees(c) and (c.mux.in_flight, c.mux.waiting) == (1, 0)
    c.disconnected()
    assert agrees(c) and (c.mux.in_flight, c.mux.waiting) == (0, 0)
    assert all(lane.state is CS.CLOSED for lane in c.lanes.values())


def test_next_ready_takes_the_earliest_arrival_under_the_cap() -> None:
    mux = LaneMux(WebSocketConfig(max_in_flight=1))
    for name in ("x", "y"):
        mux.open(name, expired=False)
    frames = Connection().frames
    creates = [frames.classify(create(stream_id=name), mux.fits, 0.0) for name in ("y", "x")]
    assert all(isinstance(e, CreateReceived) for e in creates)
    mux.enqueue(mux.lanes["y"], creates[0])  # type: ignore[arg-type]
    mux.enqueue(mux.lanes["x"], creates[1])  # type: ignore[arg-type]
    assert mux.next_ready() is mux.lanes["y"]
    mux.enqueue(mux.lanes["x"], creates[0], first=True)  # type: ignore[arg-type] # ahead of its lane's queue, but arrived last
    assert mux.next_ready() is mux.lanes["y"]
    _, first = mux.dequeue(mux.lanes["y"])
    assert first is creates[0] and mux.next_ready() is mux.lanes["x"]
    mux.lanes["x"].state = CS.ACTIVE
    assert mux.next_ready() is None  # no idle lane waits


def test_refusals_and_an_empty_dequeue() -> None:
    mux = LaneMux(WebSocketConfig(reject_concurrent=True))
    lane = mux.default
    assert mux.refusal(lane) is None
    lane.state = CS.ACTIVE
    assert mux.refusal(lane) is CONCURRENT_REQUEST
    queued = LaneMux(WebSocketConfig(max_queued=0))
    queued.default.state = CS.ACTIVE
    error = queued.refusal(queued.default)
    assert error is not None and (error.code, error.status) == ("queued_requests_limit_reached", 429)
    with pytest.raises(ConnectionStateError, match="^nothing is queued$"):
        mux.dequeue(lane)
