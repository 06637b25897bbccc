"""One WebSocket connection in WebSocket mode, as a sans-IO state machine.

Theory of operation
-------------------
Rules (wire-protocol sections 2, 3, 6, 7, 8; the Guide's launch semantics):

1. One response in flight per connection. A `response.create` that arrives
   mid-flight is queued FIFO and started after the terminal event of the one
   before it; responses are never interleaved. (Optionally rejected with 409
   `concurrent_request` instead, as the vLLM PR does.)
2. A connection-local cache keeps exactly one entry: the most recent response
   that ended `completed` or `incomplete` (including a `generate:false`
   warm-up), with its input and output items, tools and rendered tokens. A
   `previous_response_id` is looked up in the cache, then in the store.
3. "If a turn fails (4xx or 5xx), the service evicts the referenced
   `previous_response_id` from the connection-local cache." That includes a
   frame that fails validation but still names a `previous_response_id`.
4. Request-level problems are `error` events (with `status`); the socket stays
   open. Only socket-level violations close it (binary frame 1003, bad UTF-8 1007
   — both decided by the adapter, which sees frames).
5. Lifetime: at the limit an idle socket gets `websocket_connection_limit_reached`
   and is closed with 1001; an in-flight response is allowed to finish, and every
   create after the limit (queued or new) gets that error instead of starting.
6. A disconnect (including Codex's abrupt 1006) cancels the in-flight response
   and frees the cache and the queue.

The core reads no clock and does no I/O: the adapter feeds it client frames and
"response ended" / "limit reached" / "disconnected" inputs, then drains
`outputs_to_send()`: frames to write, a job to start, a job to cancel, a close.
All legal moves are in `_TRANSITIONS`; anything else raises `ConnectionStateError`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import Final

import msgspec

from .conversation import CreateRequest, normalize_create
from .engine import CacheEntry
from .errors import ProtocolError, from_validation_error, ws_error_event
from .schemas import ResponseAppend, ResponseCreate, ResponseInject, decode_client_event, decode_envelope

__all__ = [
    "CS",
    "AppendReceived",
    "BadFrame",
    "CancelJob",
    "CloseSocket",
    "Connection",
    "ConnectionStateError",
    "CreateReceived",
    "Dequeue",
    "Disconnected",
    "Job",
    "LimitReached",
    "ResponseEnded",
    "SendFrame",
    "StartJob",
]

CLOSE_GOING_AWAY: Final = 1001  # server shutdown or lifetime limit; triggers openai-python's auto-reconnect


class CS(enum.Enum):
    IDLE = enum.auto()
    ACTIVE = enum.auto()  # one response in flight
    DRAINING = enum.auto()  # lifetime limit reached while a response was in flight
    EXPIRED = enum.auto()  # limit reached and nothing in flight: closing with 1001
    CLOSED = enum.auto()


# -- inputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateReceived:
    request: CreateRequest


@dataclass(frozen=True, slots=True)
class AppendReceived:
    event: ResponseAppend | ResponseInject


@dataclass(frozen=True, slots=True)
class BadFrame:
    error: ProtocolError
    previous_response_id: str | None = None


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Internal: start the next queued create."""


@dataclass(frozen=True, slots=True)
class ResponseEnded:
    job: Job
    entry: CacheEntry | None  # the new cache entry; None if the turn failed
    error: ProtocolError | None = None  # a request error to report as an `error` event


@dataclass(frozen=True, slots=True)
class LimitReached:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    pass


Input = CreateReceived | AppendReceived | BadFrame | Dequeue | ResponseEnded | LimitReached | Disconnected
INPUT_TYPES: Final = (CreateReceived, AppendReceived, BadFrame, Dequeue, ResponseEnded, LimitReached, Disconnected)

# -- outputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    number: int  # 1, 2, … per connection
    request: CreateRequest
    cached: CacheEntry | None  # the cache entry the job may continue from (matched by id at start)


@dataclass(frozen=True, slots=True)
class SendFrame:
    data: bytes


@dataclass(frozen=True, slots=True)
class StartJob:
    job: Job


@dataclass(frozen=True, slots=True)
class CancelJob:
    job: Job


@dataclass(frozen=True, slots=True)
class CloseSocket:
    code: int
    reason: str


Output = SendFrame | StartJob | CancelJob | CloseSocket

# -- the table --------------------------------------------------------------------------------------

_TRANSITIONS: Final[dict[tuple[CS, type], tuple[str, CS]]] = {
    (CS.IDLE, CreateReceived): ("_enqueue", CS.IDLE),  # then Dequeue starts it
    (CS.ACTIVE, CreateReceived): ("_enqueue", CS.ACTIVE),
    (CS.DRAINING, CreateReceived): ("_refuse_expired", CS.DRAINING),
    (CS.EXPIRED, CreateReceived): ("_refuse_expired", CS.EXPIRED),
    (CS.IDLE, Dequeue): ("_start_next", CS.ACTIVE),
    (CS.ACTIVE, ResponseEnded): ("_ended", CS.IDLE),
    (CS.DRAINING, ResponseEnded): ("_ended_expired", CS.EXPIRED),
    (CS.IDLE, LimitReached): ("_expire", CS.EXPIRED),
    (CS.ACTIVE, LimitReached): ("_nothing", CS.DRAINING),
    (CS.DRAINING, LimitReached): ("_nothing", CS.DRAINING),
    (CS.EXPIRED, LimitReached): ("_nothing", CS.EXPIRED),
    **{(s, AppendReceived): ("_append_unsupported", s) for s in (CS.IDLE, CS.ACTIVE, CS.DRAINING, CS.EXPIRED)},
    **{(s, BadFrame): ("_bad_frame", s) for s in (CS.IDLE, CS.ACTIVE, CS.DRAINING, CS.EXPIRED)},
    **{(s, Disconnected): ("_disconnect", CS.CLOSED) for s in (CS.IDLE, CS.ACTIVE, CS.DRAINING, CS.EXPIRED)},
    (CS.CLOSED, Disconnected): ("_nothing", CS.CLOSED),
}


class ConnectionStateError(Exception):
    """An input the connection cannot take in its state: a bug in the adapter."""


def limit_message(lifetime_s: float) -> str:
    if lifetime_s >= 60 and lifetime_s % 60 == 0:
        span = f"{int(lifetime_s // 60)} minutes"
    else:
        span = f"{lifetime_s:g} seconds"
    return f"Responses websocket connection limit reached ({span}). Create a new websocket connection to continue."


class Connection:
    """Feed it with `receive_text` and the `response_ended` / `limit_reached` /
    `disconnected` calls; after each, drain `outputs_to_send()` and act on every
    output in order."""

    def __init__(self, *, lifetime_s: float = 3600.0, reject_concurrent: bool = False) -> None:
        self.state = CS.IDLE
        self.lifetime_s = lifetime_s
        self.reject_concurrent = reject_concurrent
        self.cache: CacheEntry | None = None
        self.queue: collections.deque[CreateRequest] = collections.deque()
        self.in_flight: Job | None = None
        self._jobs = 0
        self._out: list[Output] = []
        self.cache_hits = 0
        self.cache_misses = 0

    # -- adapter API ---------------------------------------------------------------------------------

    def receive_text(self, data: str | bytes) -> None:
        """One text frame from the client."""
        self.handle(self._classify(data))

    def response_ended(self, job: Job, entry: CacheEntry | None, error: ProtocolError | None = None) -> None:
        self.handle(ResponseEnded(job, entry, error))

    def limit_reached(self) -> None:
        self.handle(LimitReached())

    def disconnected(self) -> None:
        self.handle(Disconnected())

    def outputs_to_send(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    # -- the machine ---------------------------------------------------------------------------------

    def handle(self, event: Input) -> None:
        try:
            method, nxt = _TRANSITIONS[(self.state, type(event))]
        except KeyError:
            raise ConnectionStateError(f"can't handle {type(event).__name__} in state {self.state.name}") from None
        getattr(self, method)(event)
        self.state = nxt
        if self.state is CS.IDLE and self.queue:
            self.handle(Dequeue())

    def _classify(self, data: str | bytes) -> Input:
        try:
            event = decode_client_event(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._bad(data, exc)
        if isinstance(event, ResponseCreate):
            params = event.response if event.response is not None else event
            try:
                return CreateReceived(normalize_create(params, websocket=True))
            except ProtocolError as err:
                return BadFrame(err, params.previous_response_id)
        return AppendReceived(event)

    def _bad(self, data: str | bytes, exc: msgspec.ValidationError | msgspec.DecodeError) -> BadFrame:
        try:
            env = decode_envelope(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            if not isinstance(exc, msgspec.ValidationError):  # malformed JSON (ValidationError subclasses DecodeError)
                return BadFrame(from_validation_error(exc))
            return BadFrame(
                ProtocolError("Each WebSocket message must be a JSON object.", code="invalid_json", param=None)
            )
        if env.type is None:
            err = ProtocolError("Missing required parameter: 'type'.", code="missing_required_parameter", param="type")
        elif env.type not in ("response.create", "response.append", "response.inject"):
            err = ProtocolError(f"Unsupported event type: '{env.type}'.", code="unsupported_event_type", param="type")
        else:
            err = from_validation_error(exc)
        return BadFrame(err, env.previous_response_id if env.type == "response.create" else None)

    def _error(self, err: ProtocolError) -> None:
        self._out.append(SendFrame(ws_error_event(err)))

    def _evict(self, response_id: str | None) -> None:
        if response_id is not None and self.cache is not None and self.cache.response_id == response_id:
            self.cache = None

    def _nothing(self, event: Input) -> None:
        pass

    def _enqueue(self, event: CreateReceived) -> None:
        if self.state is CS.ACTIVE and self.reject_concurrent:
            self._evict(event.request.previous_response_id)
            self._error(
                ProtocolError(
                    "Another response is in progress on this connection.", code="concurrent_request", status=409
                )
            )
            return
        self.queue.append(event.request)

    def _start_next(self, event: Dequeue) -> None:
        if not self.queue:
            raise ConnectionStateError("nothing is queued")
        request = self.queue.popleft()
        self._jobs += 1
        prev = request.previous_response_id
        cached = self.cache if prev is not None and self.cache is not None and self.cache.response_id == prev else None
        if prev is not None:
            if cached is None:
                self.cache_misses += 1
            else:
                self.cache_hits += 1
        self.in_flight = Job(self._jobs, request, cached)
        self._out.append(StartJob(self.in_flight))

    def _finish_job(self, event: ResponseEnded) -> None:
        if event.job is not self.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        self.in_flight = None
        if event.entry is not None:
            self.cache = event.entry
        else:
            self._evict(event.job.request.previous_response_id)
            if event.error is not None:
                self._error(event.error)

    def _ended(self, event: ResponseEnded) -> None:
        self._finish_job(event)

    def _ended_expired(self, event: ResponseEnded) -> None:
        self._finish_job(event)
        self._expire(event)

    def _expire(self, event: Input) -> None:
        err = ProtocolError(limit_message(self.lifetime_s), code="websocket_connection_limit_reached")
        for _ in range(max(1, len(self.queue))):
            self._error(err)
        self.queue.clear()
        self._out.append(CloseSocket(CLOSE_GOING_AWAY, "connection limit reached"))

    def _refuse_expired(self, event: CreateReceived) -> None:
        self._error(ProtocolError(limit_message(self.lifetime_s), code="websocket_connection_limit_reached"))

    def _append_unsupported(self, event: AppendReceived) -> None:
        self._error(
            ProtocolError(
                f"Unsupported event type: '{event.event.__struct_config__.tag}'. Append mode is not enabled "
                "on this connection (opt in with ?mode=append or OpenAI-Beta: responses_websockets=2026-02-04).",
                code="unsupported_event_type",
                param="type",
            )
        )

    def _bad_frame(self, event: BadFrame) -> None:
        self._evict(event.previous_response_id)
        self._error(event.error)

    def _disconnect(self, event: Disconnected) -> None:
        if self.in_flight is not None:
            self._out.append(CancelJob(self.in_flight))
            self.in_flight = None
        self.queue.clear()
        self.cache = None
