"""The connection's lanes as h2 keeps its streams: which lane an input or a job is for, the lanes
a connection may open, the in-flight cap and the FIFO of each lane (docs/lanes.md, rules 1 and 8
of connection.py).

The connection's table decides what an input does to its lane; this unit decides which lane it is
and when a lane's next create may start. It keeps the count of responses in flight as they start
and end (the connection reports both), so a turn costs no walk over the lanes unless a create waits.
"""

from __future__ import annotations

from typing import Final

from ..config import WebSocketConfig
from ..context.cache import stream_prefix
from ..wire.errors import ProtocolError
from .events import AppendReceived, BadFrame, CreateReceived, Input, Job, SteerReceived
from .lanes import CS, ConnectionStateError, Lane

__all__ = ["CONCURRENT_REQUEST", "LaneMux", "queued_limit"]

CONCURRENT_REQUEST: Final = ProtocolError(
    "Another response is in progress on this connection.", code="concurrent_request", status=409
)


def queued_limit(max_queued: int) -> ProtocolError:
    return ProtocolError(
        f"Too many queued response.create events on this connection (at most {max_queued} "
        "wait behind the response in progress). Wait for a response to finish, or open another connection.",
        code="queued_requests_limit_reached",
        status=429,
    )


class LaneMux:
    """The lanes by `stream_id` (`lanes`, the default lane under None), opened by the first valid
    create that names one; `limits`: the connection's (its in-flight cap, named lanes and queue)."""

    def __init__(self, limits: WebSocketConfig) -> None:
        self.limits = limits
        self.default = Lane(None, None)
        self.lanes: dict[str | None, Lane] = {None: self.default}
        self.in_flight = 0  # lanes whose response is in flight
        self.waiting = 0  # creates queued on any lane
        self._arrivals = 0  # creates queued: their order across lanes

    @property
    def named(self) -> int:
        return len(self.lanes) - 1

    def fits(self, stream_id: str | None) -> bool:
        """Whether a create may run on the lane `stream_id` names: it exists, or one more fits."""
        return stream_id in self.lanes or len(self.lanes) - 1 < self.limits.max_named_lanes

    def open(self, stream_id: str | None, expired: bool) -> None:
        """The lane a valid create names, opened if it is new (expired already after the limit)."""
        if stream_id not in self.lanes:
            self.lanes[stream_id] = Lane(stream_id, stream_prefix(stream_id), CS.EXPIRED if expired else CS.IDLE)

    def lane_of(self, event: Input) -> Lane:
        """The lane an input from the client is for: the lane a create or a bad frame names, the
        lane whose response (in flight, else last ended) an append or a steer names; else the default."""
        if isinstance(event, CreateReceived):
            return self.lanes[event.request.params.stream_id]  # `open` made sure it exists
        if isinstance(event, BadFrame):
            return self.lanes.get(event.stream_id, self.default)
        target = None
        if isinstance(event, AppendReceived):
            target = event.event.response_id
        elif isinstance(event, SteerReceived):
            target = event.event.previous_response_id
        if target is not None:
            for lane in self.lanes.values():
                if lane.owns(target):
                    return lane
            for lane in self.lanes.values():
                if lane.last_ended == target:
                    return lane
        return self.default

    def lane_of_job(self, job: Job) -> Lane:
        """The lane whose response in flight `job` is (else `ConnectionStateError`)."""
        lane = self.lanes.get(job.stream_id)
        if lane is None or job is not lane.in_flight:
            raise ConnectionStateError(f"job {job.number} is not the one in flight")
        return lane

    # -- in flight and queued ------------------------------------------------------------------------

    def started(self, lane: Lane, job: Job) -> None:
        lane.in_flight = job
        self.in_flight += 1

    def stopped(self, lane: Lane) -> None:
        """The lane's response is no longer in flight (ended or cancelled)."""
        if lane.in_flight is not None:
            lane.in_flight = None
            self.in_flight -= 1

    def refusal(self, lane: Lane) -> ProtocolError | None:
        """Why a create may not queue on `lane` (`concurrent_request`, `queued_requests_limit_reached`),
        or None. A lane is busy while its response runs, and also while its next create waits
        for one of the connection's in-flight slots (an idle lane with a queue)."""
        busy = lane.state is CS.ACTIVE or bool(lane.queue)
        if not busy:
            return None
        if self.limits.reject_concurrent:
            return CONCURRENT_REQUEST
        max_queued = self.limits.max_queued
        waiting = len(lane.queue) - (0 if lane.state is CS.ACTIVE else 1)  # creates behind the lane's next one
        if max_queued is not None and waiting >= max_queued:
            return queued_limit(max_queued)
        return None

    def enqueue(self, lane: Lane, create: CreateReceived, *, first: bool = False) -> None:
        """`create` behind the lane's queued ones (`first`: ahead of them), numbered in arrival order."""
        self._arrivals += 1
        if first:
            lane.queue.appendleft((self._arrivals, create))
        else:
            lane.queue.append((self._arrivals, create))
        self.waiting += 1

    def dequeue(self, lane: Lane) -> tuple[int, CreateReceived]:
        if not lane.queue:
            raise ConnectionStateError("nothing is queued")
        self.waiting -= 1
        return lane.queue.popleft()

    def dropped(self, lane: Lane) -> int:
        """Empty the lane's queue (its creates will not run); how many there were."""
        n = len(lane.queue)
        lane.queue.clear()
        self.waiting -= n
        return n

    def next_ready(self) -> Lane | None:
        """The idle lane whose next create arrived first, while responses in flight are under the
        cap; None: none may start."""
        if not self.waiting or self.in_flight >= self.limits.max_in_flight:
            return None
        ready = [lane for lane in self.lanes.values() if lane.state is CS.IDLE and lane.queue]
        return min(ready, key=lambda lane: lane.queue[0][0]) if ready else None
