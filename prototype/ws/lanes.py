"""A lane of a WebSocket connection: its state, its FIFO of creates, its response in flight and
what it keeps for that response (docs/lanes.md).

A lane is what h2 calls a stream: the unit the connection multiplexes. Its legal moves are the
rows of the connection's table (connection.py), keyed by `CS`; the records here are the state
those moves read and write. The lane's `stream_id` rules (the spec's pattern, the per-connection
limit) live here too, since a lane is opened by the first create that names one.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Final

import msgspec

from ..context.cache import CacheEntry, tag_stream
from ..context.conversation import Item
from ..wire.errors import ProtocolError, ws_error_event
from ..wire.schemas import SteerRef
from .events import CreateReceived, Job, SendFrame

__all__ = [
    "CS",
    "INVALID_STREAM_ID",
    "OPEN",
    "STREAM_ID_MAX",
    "STREAM_LIMIT",
    "ConnectionStateError",
    "Lane",
    "Parked",
    "Pause",
    "QueuedSteer",
    "error_frame",
    "valid_stream_id",
]

STREAM_ID_MAX: Final = 256
_STREAM_ID_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")


class CS(enum.Enum):
    """The state of one lane (the connection is the set of its lanes)."""

    # Members are singletons that compare by identity: hashed by identity too, in C, not by
    # `Enum.__hash__` (a Python call) at each lookup of the transition table.
    __hash__ = object.__hash__

    IDLE = enum.auto()
    ACTIVE = enum.auto()  # one response in flight on the lane, sampling
    PAUSED = enum.auto()  # append mode: the in-flight response waits for tool outputs
    DRAINING = enum.auto()  # lifetime limit reached while the lane's response was in flight
    EXPIRED = enum.auto()  # limit reached and nothing in flight on the lane
    CLOSED = enum.auto()


OPEN: Final = (CS.IDLE, CS.ACTIVE, CS.PAUSED, CS.DRAINING, CS.EXPIRED)


class ConnectionStateError(Exception):
    """An input the connection cannot take in its state: a bug in the adapter."""


@dataclass(frozen=True, slots=True)
class QueuedSteer:
    """A queued steer: its id and target, the raw input (echoed if it fails), its items."""

    ref: SteerRef
    input: msgspec.Raw
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class Parked:
    """What the next create continuing `parent` on the lane starts with: outputs injected for the
    parent's async calls it ended without taking (beta), then the steers queued for it."""

    parent: str
    steers: list[QueuedSteer]
    committed: tuple[Item, ...]

    def items(self) -> tuple[Item, ...]:
        return self.committed + tuple(item for steer in self.steers for item in steer.items)


@dataclass(slots=True)
class Pause:
    """Bookkeeping of the paused response: which calls still wait, what was committed."""

    job: Job
    pending: dict[str, str]  # call_id -> function name
    committed: list[Item] = field(default_factory=list)
    last_at: float = 0.0  # the last committing frame's arrival and size
    last_bytes: int = 0


@dataclass(slots=True)
class Lane:
    """One lane: its state, its FIFO of creates, its response in flight, its cache entry."""

    stream_id: str | None
    prefix: bytes | None  # `stream_prefix(stream_id)`: tags the lane's frames
    state: CS = CS.IDLE
    queue: collections.deque[tuple[int, CreateReceived]] = field(default_factory=collections.deque)
    in_flight: Job | None = None
    pause: Pause | None = None
    cache: CacheEntry | None = None
    cache_used: int = 0  # when `cache` was last set or hit (for LRU eviction across lanes)
    last_ended: str | None = None  # the lane's last ended response (an append without `response_id`)
    steers: list[QueuedSteer] = field(default_factory=list)  # queued for the response in flight
    parked: Parked | None = None  # input waiting for the create that continues a parent

    def owns(self, response_id: str | None) -> bool:
        """Whether `response_id` is the lane's response in flight."""
        return self.in_flight is not None and self.in_flight.response_id == response_id


def error_frame(err: ProtocolError, lane: Lane | None) -> SendFrame:
    """An `error` event; on a named lane it carries the lane's `stream_id`."""
    return SendFrame(tag_stream(ws_error_event(err), lane.prefix if lane is not None else None))


INVALID_STREAM_ID: Final = ProtocolError(
    "The 'stream_id' field must be a non-empty string with at most 256 characters and may only contain "
    "letters, numbers, underscores, hyphens, and periods.",
    code="invalid_stream_id",
    param="stream_id",
)
STREAM_LIMIT: Final = ProtocolError(
    "This WebSocket connection has reached its stream limit.",
    code="websocket_stream_limit_reached",
    param="stream_id",
)


def valid_stream_id(value: object) -> bool:
    """1 to 256 ASCII letters, digits, `_`, `-` or `.` (the OpenAPI spec's pattern for `stream_id`)."""
    return isinstance(value, str) and 0 < len(value) <= STREAM_ID_MAX and _STREAM_ID_CHARS.issuperset(value)
