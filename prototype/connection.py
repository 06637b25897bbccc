"""One WebSocket connection in WebSocket mode, as a sans-IO state machine with lanes.

Theory of operation
-------------------
Rules (docs/lanes.md for lanes, docs/protocol.md for the rest; the public WebSocket-mode
guide and the SDKs' WebSocket types are the sources):

1. Lanes. A `response.create` runs on the lane its `stream_id` names (absent or null:
   the default lane). Creates on one lane run in order, one at a time: one that arrives
   while its lane is busy is queued FIFO behind it (or, with `reject_concurrent`, refused
   with 409 `concurrent_request`). Different lanes run concurrently, up to
   `MAX_IN_FLIGHT` (16) responses per connection; a lane whose next create finds them all
   taken waits, and waiting lanes start in arrival order. At most `MAX_NAMED_LANES` (32)
   distinct named lanes per connection, counted until it closes: a create naming a 33rd
   gets `websocket_stream_limit_reached`; a malformed id gets `invalid_stream_id`.
2. Every frame about a response on a named lane carries its `stream_id` (the adapter
   tags the engine's events; the core tags its own request-scoped `error` events);
   connection-level errors carry none.
3. The connection cache holds one entry per lane: the lane's most recent response that
   ended `completed` or `incomplete` (including a `generate:false` warm-up). A
   `previous_response_id` is looked up in every lane's entry (a new lane may fork any
   cached response), then in the store. With `max_cache_bytes` the entries together hold
   at most that many bytes: an entry larger than the limit is not cached (its lane's entry
   is dropped too), and a new entry evicts the least recently used other lanes' entries
   until the total fits.
4. "If a turn fails (4xx or 5xx), the service evicts the referenced
   `previous_response_id` from the connection-local cache": a failed continuation on
   the lane that holds the parent evicts it; a failed fork onto another lane keeps it.
   That includes a frame that fails validation but still names a `previous_response_id`.
5. Request-level problems are `error` events (with `status`); the socket stays open.
   Only socket-level violations close it (binary frame 1003, bad UTF-8 1007, decided
   by the adapter, which sees frames).
6. Lifetime: at the limit idle lanes refuse what they queued with
   `websocket_connection_limit_reached`, responses in flight are allowed to finish, every
   later create gets that error instead of starting, and once nothing is in flight the
   socket is closed with 1001.
7. A disconnect (including Codex's abrupt 1006) cancels every response in flight and
   frees the caches and the queues.
8. `max_queued`: at most that many creates wait per lane behind the one in flight; one
   more is refused with 429 `queued_requests_limit_reached` (the referenced cache entry
   is evicted as for any failed turn).

Append mode (opt-in per connection; docs/protocol.md):

9. When a sampled turn ends in function calls the response *pauses* (its lane PAUSED):
   the engine has sent `response.done` with `required_input`; the core keeps the
   pending call ids and asks the adapter to arm the pause timer. A paused response
   holds only its own lane.
10. `response.append` / `response.inject` commit items atomically: every item is
   a `function_call_output` for a pending call id or a user/developer message;
   anything else is rejected whole. Partial appends are accepted; the response
   resumes (ACTIVE) once every pending call is answered. An append names its response
   with `response_id` (without one: the default lane's). Inject is acknowledged
   with `response.inject.created` (numbered in the paused response's sequence)
   and refused with `response.inject.failed`; append has no acknowledgement (the
   resume shows as `response.in_progress`) and is refused with `error` events:
   `response_not_found`, `response_already_completed`, `response_not_paused`,
   `unknown_call_id`.
11. A `response.create` on a paused lane is refused (409 `response_paused`), never
   queued: under FIFO it would wait behind a response that waits for the client.
12. A pause that outlives the pause timeout, or the connection's lifetime, ends
    the response `incomplete` (reasons `append_timeout`, `connection_limit`).

The beta dialect (`OpenAI-Beta: responses_multi_agent=v1`; docs/beta.md) is the same
pause machine with its own wire:

13. Only calls of `async: true` function tools make a response wait; the engine reports
    each such call as it is emitted (`CallEmitted`), so a `response.inject` may answer it
    while the response is still sampling (acknowledged at once, committed at the turn's
    end). Any other call ends the response as in WebSocket mode. At the end of a turn
    with such calls (`TurnEnded`) what was injected so far is handed to the response
    (`TakeInput`) and the calls still unanswered stay pending: its model may decode on
    without them, or pause until they are answered.
14. `response.inject` for an unknown or ended response gets `response.inject.failed`
    (`response_not_found`, `response_already_completed`); items that do not fit (an
    unknown call id, a non-message item) get an `error` event; nothing is committed.
    `response.append` is not part of the beta.
15. `response.steer` queues user messages for the in-flight response named by
    `previous_response_id` (`response.steer.accepted`, numbered in its stream). It is
    part of the stable WebSocket mode too (a `create` connection steers the same way;
    only append mode has no steering), for models that support it. When the
    response ends `completed` or `incomplete` with no client call owed, the core starts
    an automatic successor on the lane: the parent's request with the queued input as its
    input and the parent as `previous_response_id`. When it ends owing client calls, the
    engine has sent `response.steer.pending`; the queued input is prepended to the next
    create on the lane that continues the parent. Bad input gets `response.steer.failed`.

The core reads no clock and does no I/O: the adapter feeds it client frames and
"response paused" / "response ended" / "pause timed out" / "limit reached" /
"disconnected" inputs, then drains `outputs_to_send()`: frames to write, a job
to start, resume, abort or cancel, a pause timer to arm, a close.
Every input goes to one lane; each lane's legal moves are the rows of `_TRANSITIONS`,
whose actions are the functions that carry out the move. Anything else raises
`ConnectionStateError`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from msgspec import structs

from .cache import CacheEntry, stream_prefix, tag_stream
from .conversation import CreateRequest, Item, ToolCache, normalize_create, parse_items
from .errors import ProtocolError, from_validation_error, ws_error_event
from .ids import IdFactory
from .schemas import (
    InjectError,
    RequiredInput,
    ResponseAppend,
    ResponseCreate,
    ResponseInject,
    ResponseInjectFailed,
    ResponseSteer,
    ResponseSteerFailed,
    SteerError,
    SteerRef,
    SteerSubmission,
    decode_client_event,
    decode_envelope,
    decode_text,
    encode,
)
from .stream import InjectRefused

__all__ = [
    "CS",
    "AbortPause",
    "AckInject",
    "AckSteer",
    "CallEmitted",
    "SteerReceived",
    "TakeInput",
    "TurnEnded",
    "AllAnswered",
    "ArmPauseTimer",
    "PauseTimedOut",
    "ResponsePaused",
    "ResumeJob",
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
RECENT_IDS: Final = 64  # ended response ids remembered per connection, for `response_already_completed`
APPENDABLE_ROLES: Final = frozenset({"user", "developer"})
MAX_PENDING_STEERS: Final = 8  # queued steers per response; more: `too_many_pending_steers`
STEER_MESSAGE_KEYS: Final = frozenset({"type", "role", "content"})
# Model families the steering guide says do not steer (GPT-5.6 and earlier), matched as name
# prefixes; any other name (GPT-6, the simulator's own) steers. docs/beta.md#steering.
UNSTEERABLE_MODELS: Final = ("gpt-3", "gpt-4", "gpt-5", "o1", "o3", "o4", "chatgpt-", "codex-")


MAX_IN_FLIGHT: Final = 16  # responses in flight per connection, across lanes; more wait
MAX_NAMED_LANES: Final = 32  # distinct `stream_id`s per connection (the default lane does not count)
STREAM_ID_MAX: Final = 256
_STREAM_ID_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")


class CS(enum.Enum):
    """The state of one lane (the connection is the set of its lanes)."""

    IDLE = enum.auto()
    ACTIVE = enum.auto()  # one response in flight on the lane, sampling
    PAUSED = enum.auto()  # append mode: the in-flight response waits for tool outputs
    DRAINING = enum.auto()  # lifetime limit reached while the lane's response was in flight
    EXPIRED = enum.auto()  # limit reached and nothing in flight on the lane
    CLOSED = enum.auto()


# -- inputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateReceived:
    request: CreateRequest
    at: float = 0.0  # when the frame arrived (adapter's clock)
    body_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AppendReceived:
    event: ResponseAppend | ResponseInject
    at: float = 0.0  # when the frame arrived (adapter's clock)
    body_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SteerReceived:
    event: ResponseSteer


@dataclass(frozen=True, slots=True)
class CallEmitted:
    """Beta: the in-flight response emitted a call of an async tool (it may be answered now)."""

    job: Job
    call: RequiredInput


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """Beta: the in-flight response's turn ended in async calls; it takes what was injected so
    far (into its next turn's context if its model decodes on, else at its resume)."""

    job: Job


@dataclass(frozen=True, slots=True)
class BadFrame:
    error: ProtocolError
    previous_response_id: str | None = None
    stream_id: str | None = None  # the lane the frame named (its error carries it); None: the default lane


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Internal: start the next queued create."""


@dataclass(frozen=True, slots=True)
class ResponsePaused:
    job: Job
    required: tuple[RequiredInput, ...]


@dataclass(frozen=True, slots=True)
class AllAnswered:
    """Internal: every pending call of the paused response has an output."""


@dataclass(frozen=True, slots=True)
class PauseTimedOut:
    job: Job


@dataclass(frozen=True, slots=True)
class ResponseEnded:
    job: Job
    entry: CacheEntry | None  # the new cache entry; None if the turn failed
    error: ProtocolError | None = None  # a request error to report as an `error` event
    owed: tuple[RequiredInput, ...] = ()  # beta: client calls the ended response left unanswered
    at: float = 0.0  # when it ended (adapter's clock): an automatic successor arrives then


@dataclass(frozen=True, slots=True)
class LimitReached:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    pass


Input = (
    CreateReceived
    | AppendReceived
    | SteerReceived
    | CallEmitted
    | TurnEnded
    | BadFrame
    | Dequeue
    | ResponsePaused
    | AllAnswered
    | PauseTimedOut
    | ResponseEnded
    | LimitReached
    | Disconnected
)
INPUT_TYPES: Final = (
    CreateReceived,
    AppendReceived,
    SteerReceived,
    CallEmitted,
    TurnEnded,
    BadFrame,
    Dequeue,
    ResponsePaused,
    AllAnswered,
    PauseTimedOut,
    ResponseEnded,
    LimitReached,
    Disconnected,
)

# -- outputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    number: int  # 1, 2, … per connection
    request: CreateRequest
    cached: CacheEntry | None  # the cache entry the job may continue from (matched by id at start)
    response_id: str = ""
    arrived_at: float = 0.0  # when its response.create frame arrived
    body_bytes: int = 0
    exclusive: bool = True  # False: another job already took `cached`'s context, so copy it (a fork)

    @property
    def stream_id(self) -> str | None:
        """The lane (`None`: the default lane)."""
        return self.request.params.stream_id


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


@dataclass(frozen=True, slots=True)
class ArmPauseTimer:
    job: Job


@dataclass(frozen=True, slots=True)
class ResumeJob:
    job: Job
    items: tuple[Item, ...]  # everything committed while paused, in arrival order
    at: float = 0.0  # arrival of the append that answered the last pending call
    body_bytes: int = 0  # and its size


@dataclass(frozen=True, slots=True)
class TakeInput:
    """Beta: what was injected into the response since its last boundary, in arrival order, for
    its next turn's context (the response did not pause)."""

    job: Job
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class AckInject:
    """Acknowledge an inject in the paused response's own stream (accepted, or refused)."""

    job: Job
    refused: InjectRefused | None = None


@dataclass(frozen=True, slots=True)
class AckSteer:
    """Beta: acknowledge a queued steer in the target response's own stream."""

    job: Job
    steer: SteerRef


@dataclass(frozen=True, slots=True)
class AbortPause:
    job: Job
    reason: str  # `incomplete_details.reason` of the response


Output = (
    SendFrame
    | StartJob
    | CancelJob
    | CloseSocket
    | ArmPauseTimer
    | ResumeJob
    | AbortPause
    | AckInject
    | AckSteer
    | TakeInput
)


@dataclass(frozen=True, slots=True)
class _Parked:
    """Beta: what the next create continuing `parent` on the lane starts with: outputs injected
    for the parent's async calls it ended without taking, then the steers queued for it."""

    parent: str
    steers: list[_Steer]
    committed: tuple[Item, ...]

    def items(self) -> tuple[Item, ...]:
        return self.committed + tuple(item for steer in self.steers for item in steer.items)


@dataclass(frozen=True, slots=True)
class _Steer:
    """A queued steer: its id and target, the raw input (echoed if it fails), its items."""

    ref: SteerRef
    input: msgspec.Raw
    items: tuple[Item, ...]


@dataclass(slots=True)
class _Pause:
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
    pause: _Pause | None = None
    cache: CacheEntry | None = None
    cache_used: int = 0  # when `cache` was last set or hit (for LRU eviction across lanes)
    last_ended: str | None = None  # the lane's last ended response (an append without `response_id`)
    steers: list[_Steer] = field(default_factory=list)  # beta: queued for the response in flight
    parked: _Parked | None = None  # beta: input waiting for the create that continues a parent


# -- lanes -------------------------------------------------------------------------------------------

_OPEN: Final = (CS.IDLE, CS.ACTIVE, CS.PAUSED, CS.DRAINING, CS.EXPIRED)
_BUSY: Final = (CS.ACTIVE, CS.PAUSED, CS.DRAINING)  # the lane has a response in flight


class ConnectionStateError(Exception):
    """An input the connection cannot take in its state: a bug in the adapter."""


def limit_message(lifetime_s: float) -> str:
    if lifetime_s >= 60 and lifetime_s % 60 == 0:
        span = f"{int(lifetime_s // 60)} minutes"
    else:
        span = f"{lifetime_s:g} seconds"
    return f"Responses websocket connection limit reached ({span}). Create a new websocket connection to continue."


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


def _unsupported(event_type: str) -> ProtocolError:
    return ProtocolError(f"Unsupported event type: '{event_type}'.", code="unsupported_event_type", param="type")


def valid_stream_id(value: object) -> bool:
    """1 to 256 ASCII letters, digits, `_`, `-` or `.` (the OpenAPI spec's pattern for `stream_id`)."""
    return isinstance(value, str) and 0 < len(value) <= STREAM_ID_MAX and _STREAM_ID_CHARS.issuperset(value)


Action = Callable[["Connection", Lane, Any], None]


class Connection:
    """Feed it with `receive_text` and the `response_ended` / `response_paused` /
    `pause_timed_out` / `limit_reached` / `disconnected` calls; after each, drain
    `outputs_to_send()` and act on every output in order."""

    def __init__(
        self,
        *,
        lifetime_s: float = 3600.0,
        reject_concurrent: bool = False,
        append_mode: bool = False,
        beta: bool = False,
        ids: IdFactory | None = None,
        max_queued: int | None = None,
        max_cache_bytes: int | None = None,
        reuse_tools: bool = True,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_named_lanes: int = MAX_NAMED_LANES,
        open_responses: bool = False,
        unsteerable_models: tuple[str, ...] = UNSTEERABLE_MODELS,
    ) -> None:
        self.lifetime_s = lifetime_s
        self.reject_concurrent = reject_concurrent
        self.append_mode = append_mode
        self.beta = beta  # the beta dialect of the pause machine (docs/beta.md)
        # `response.steer` is part of WebSocket mode and of the beta; append mode has no steering.
        self.steering = not append_mode or beta
        self.unsteerable_models = unsteerable_models
        self.max_queued = max_queued
        self.max_cache_bytes = max_cache_bytes
        self.max_in_flight = max_in_flight
        self.max_named_lanes = max_named_lanes
        self.open_responses = open_responses  # the Open Responses dialect's request fields
        self.ids = ids or IdFactory()
        self.default = Lane(None, None)
        self.lanes: dict[str | None, Lane] = {None: self.default}
        self.ended_ids: collections.deque[str] = collections.deque(maxlen=RECENT_IDS)
        self.expired = False  # the lifetime limit was reached
        self.closing = False  # CloseSocket was emitted
        self.expiry_errors = 0  # limit errors sent for refused creates
        self._jobs = 0
        self._arrivals = 0  # creates received: their order across lanes
        self._ticks = 0  # cache uses: LRU order across lanes
        self._handed: set[str] = set()  # cached response ids whose context a job already took
        self._out: list[Output] = []
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_refused = 0  # entries over `max_cache_bytes`, not cached
        self.tools = ToolCache() if reuse_tools else None  # the last validated tool list

    # -- the default lane (a connection without `stream_id`s is exactly that lane) --------------------

    @property
    def state(self) -> CS:
        return self.default.state

    @property
    def cache(self) -> CacheEntry | None:
        return self.default.cache

    @property
    def queue(self) -> collections.deque[tuple[int, CreateReceived]]:
        return self.default.queue

    @property
    def in_flight(self) -> Job | None:
        return self.default.in_flight

    @property
    def pause(self) -> _Pause | None:
        return self.default.pause

    @property
    def n_in_flight(self) -> int:
        return sum(1 for lane in self.lanes.values() if lane.in_flight is not None)

    @property
    def named_lanes(self) -> int:
        return len(self.lanes) - 1

    # -- adapter API ---------------------------------------------------------------------------------

    def receive_text(self, data: str | bytes, *, at: float = 0.0) -> None:
        """One text frame from the client."""
        event = self._classify(data)
        if isinstance(event, CreateReceived):
            event = CreateReceived(event.request, at, len(data))
        elif isinstance(event, AppendReceived):
            event = AppendReceived(event.event, at, len(data))
        self.handle(self._lane_of(event), event)

    def call_emitted(self, job: Job, call: RequiredInput) -> None:
        self.handle(self._lane_of_job(job), CallEmitted(job, call))

    def turn_ended(self, job: Job) -> None:
        self.handle(self._lane_of_job(job), TurnEnded(job))

    def response_ended(
        self,
        job: Job,
        entry: CacheEntry | None,
        error: ProtocolError | None = None,
        owed: tuple[RequiredInput, ...] = (),
        *,
        at: float = 0.0,
    ) -> None:
        self.handle(self._lane_of_job(job), ResponseEnded(job, entry, error, owed, at))

    def response_paused(self, job: Job, required: tuple[RequiredInput, ...]) -> None:
        self.handle(self._lane_of_job(job), ResponsePaused(job, required))

    def pause_timed_out(self, job: Job) -> None:
        self.handle(self._lane_of_job(job), PauseTimedOut(job))

    def limit_reached(self) -> None:
        for lane in list(self.lanes.values()):
            self.handle(lane, LimitReached())

    def disconnected(self) -> None:
        for lane in list(self.lanes.values()):
            self.handle(lane, Disconnected())

    def outputs_to_send(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    # -- the machine ---------------------------------------------------------------------------------

    def handle(self, lane: Lane, event: Input) -> None:
        """One input to one lane: the table's row says what to do and where the lane goes."""
        try:
            action, nxt = _TRANSITIONS[(lane.state, type(event))]
        except KeyError:
            raise ConnectionStateError(f"can't handle {type(event).__name__} in state {lane.state.name}") from None
        action(self, lane, event)
        lane.state = nxt
        if lane.state is CS.PAUSED and lane.pause is not None and not lane.pause.pending:
            self.handle(lane, AllAnswered())
        self._start_waiting()
        self._close_if_done()

    def _start_waiting(self) -> None:
        """Start queued creates on idle lanes while responses in flight are under the cap,
        the earliest arrival first."""
        while self.n_in_flight < self.max_in_flight:
            ready = [lane for lane in self.lanes.values() if lane.state is CS.IDLE and lane.queue]
            if not ready:
                return
            self.handle(min(ready, key=lambda lane: lane.queue[0][0]), Dequeue())

    def _close_if_done(self) -> None:
        if self.expired and not self.closing and all(lane.state is CS.EXPIRED for lane in self.lanes.values()):
            self.closing = True
            if self.expiry_errors == 0:  # nothing was refused: the limit itself is reported once
                self._error(self._limit_error(), None)
            self._out.append(CloseSocket(CLOSE_GOING_AWAY, "connection limit reached"))

    def _lane_of(self, event: Input) -> Lane:
        if isinstance(event, CreateReceived):
            return self.lanes[event.request.params.stream_id]  # `_classify` made sure it exists
        if isinstance(event, BadFrame):
            return self.lanes.get(event.stream_id, self.default)
        target = None
        if isinstance(event, AppendReceived):
            target = event.event.response_id
        elif isinstance(event, SteerReceived):
            target = event.event.previous_response_id
        if target is not None:
            for lane in self.lanes.values():
                if lane.in_flight is not None and lane.in_flight.response_id == target:
                    return lane
            for lane in self.lanes.values():
                if lane.last_ended == target:
                    return lane
        return self.default

    def _lane_of_job(self, job: Job) -> Lane:
        lane = self.lanes.get(job.stream_id)
        if lane is None or job is not lane.in_flight:
            raise ConnectionStateError(f"job {job.number} is not the one in flight")
        return lane

    # -- classifying a frame -------------------------------------------------------------------------

    def _classify(self, data: str | bytes) -> Input:
        try:
            event = decode_client_event(decode_text(data))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._bad(data, exc)
        if isinstance(event, ResponseCreate):
            params = event.response if event.response is not None else event
            if params.stream_id is None and event.stream_id is not None:  # the lane named on the envelope
                params = structs.replace(params, stream_id=event.stream_id)
            stream_id = params.stream_id
            if stream_id is not None and not valid_stream_id(stream_id):
                return BadFrame(INVALID_STREAM_ID)
            if stream_id is not None and stream_id not in self.lanes:
                if self.named_lanes >= self.max_named_lanes:
                    return BadFrame(STREAM_LIMIT, None, stream_id)  # a refused fork keeps its parent
            try:
                request = normalize_create(
                    params, websocket=True, tool_cache=self.tools, open_responses=self.open_responses
                )
            except ProtocolError as err:
                return BadFrame(err, params.previous_response_id, stream_id)
            if stream_id not in self.lanes:  # a valid create opens its lane
                self.lanes[stream_id] = Lane(
                    stream_id, stream_prefix(stream_id), CS.EXPIRED if self.expired else CS.IDLE
                )
            return CreateReceived(request)
        if isinstance(event, ResponseSteer):
            return SteerReceived(event) if self.steering else BadFrame(_unsupported("response.steer"))
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
        if env.type == "response.steer" and not self.steering:
            return BadFrame(_unsupported(env.type))  # not an event type of append mode
        if env.type is None:
            err = ProtocolError("Missing required parameter: 'type'.", code="missing_required_parameter", param="type")
        elif env.type not in ("response.create", "response.append", "response.inject", "response.steer"):
            err = ProtocolError(f"Unsupported event type: '{env.type}'.", code="unsupported_event_type", param="type")
        elif env.type == "response.create" and "$.stream_id" in str(exc):
            return BadFrame(INVALID_STREAM_ID)  # not a string: no lane to answer on, nothing to evict
        else:
            err = from_validation_error(exc)
        if env.type != "response.create":
            return BadFrame(err)
        # The frame still names its lane (if that lane exists) and the response it continued.
        stream_id = env.stream_id if isinstance(env.stream_id, str) and valid_stream_id(env.stream_id) else None
        return BadFrame(err, env.previous_response_id, stream_id)

    # -- actions (the table's callables) -------------------------------------------------------------

    def _error(self, err: ProtocolError, lane: Lane | None) -> None:
        """An `error` event; on a named lane it carries the lane's `stream_id`."""
        self._out.append(SendFrame(tag_stream(ws_error_event(err), lane.prefix if lane is not None else None)))

    def _limit_error(self) -> ProtocolError:
        return ProtocolError(limit_message(self.lifetime_s), code="websocket_connection_limit_reached")

    def _evict(self, lane: Lane, response_id: str | None) -> None:
        """A failed turn evicts its parent from its own lane's entry (a failed fork keeps it)."""
        if response_id is not None and lane.cache is not None and lane.cache.response_id == response_id:
            lane.cache = None

    def _nothing(self, lane: Lane, event: Input) -> None:
        pass

    def _drain(self, lane: Lane, event: LimitReached) -> None:
        """The limit, with the lane's response in flight: it may finish; nothing new starts."""
        self.expired = True

    def _enqueue(self, lane: Lane, event: CreateReceived) -> None:
        # A lane is busy while its response runs, and also while its next create waits for one
        # of the connection's in-flight slots (an idle lane with a queue).
        busy = lane.state is CS.ACTIVE or bool(lane.queue)
        waiting = len(lane.queue) - (0 if lane.state is CS.ACTIVE else 1)  # creates behind the lane's next one
        if busy and self.reject_concurrent:
            self._refuse(
                lane,
                event,
                ProtocolError(
                    "Another response is in progress on this connection.", code="concurrent_request", status=409
                ),
            )
            return
        if busy and self.max_queued is not None and waiting >= self.max_queued:
            self._refuse(
                lane,
                event,
                ProtocolError(
                    f"Too many queued response.create events on this connection (at most {self.max_queued} "
                    "wait behind the response in progress). Wait for a response to finish, or open another connection.",
                    code="queued_requests_limit_reached",
                    status=429,
                ),
            )
            return
        self._arrivals += 1
        lane.queue.append((self._arrivals, event))

    def _cached(self, response_id: str) -> CacheEntry | None:
        """The cache entry of `response_id` on any lane (its own lane's first)."""
        for lane in self.lanes.values():
            if lane.cache is not None and lane.cache.response_id == response_id:
                self._ticks += 1
                lane.cache_used = self._ticks
                return lane.cache
        return None

    def _start_next(self, lane: Lane, event: Dequeue) -> None:
        if not lane.queue:
            raise ConnectionStateError("nothing is queued")
        _, queued = lane.queue.popleft()
        request = queued.request
        if lane.parked is not None and lane.parked.parent == request.previous_response_id:
            # Beta: steers queued for a parent that stopped for client tool outputs are
            # prepended, in submission order, to the create that continues it.
            request = dataclasses.replace(request, items=lane.parked.items() + request.items)
            lane.parked = None
        else:
            self._unpark(lane)
        self._jobs += 1
        prev = request.previous_response_id
        cached = self._cached(prev) if prev is not None else None
        exclusive = True
        if prev is not None:
            if cached is None:
                self.cache_misses += 1
            else:
                self.cache_hits += 1
                exclusive = prev not in self._handed
                self._handed.add(prev)
        lane.in_flight = Job(
            self._jobs,
            request,
            cached,
            self.ids.new("resp"),
            arrived_at=queued.at,
            body_bytes=queued.body_bytes,
            exclusive=exclusive,
        )
        self._out.append(StartJob(lane.in_flight))

    def _store_entry(self, lane: Lane, entry: CacheEntry) -> None:
        limit = self.max_cache_bytes
        if limit is not None and entry.nbytes > limit:
            lane.cache = None
            self.cache_refused += 1
            return
        lane.cache = entry
        self._ticks += 1
        lane.cache_used = self._ticks
        if limit is None:
            return
        others = sorted(
            (o for o in self.lanes.values() if o is not lane and o.cache is not None), key=lambda o: o.cache_used
        )
        total = sum(o.cache.nbytes for o in others if o.cache is not None) + entry.nbytes
        for other in others:
            if total <= limit:
                break
            assert other.cache is not None
            total -= other.cache.nbytes
            other.cache = None

    def _finish_job(self, lane: Lane, event: ResponseEnded) -> None:
        if event.job is not lane.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        lane.in_flight = None
        # Beta: outputs injected for async calls of a turn that ended the response anyway (it also
        # called a client-owned tool) are acknowledged input: the continuation takes them.
        committed = tuple(lane.pause.committed) if self.beta and lane.pause is not None else ()
        lane.pause = None
        lane.last_ended = event.job.response_id
        self.ended_ids.append(event.job.response_id)
        if event.entry is not None:
            self._store_entry(lane, event.entry)
        else:
            self._evict(lane, event.job.request.previous_response_id)
            if event.error is not None:
                self._error(event.error, lane)
        steers, lane.steers = lane.steers, []
        if not steers and not committed:
            return
        if event.entry is None:
            for steer in steers:  # nothing to continue from: the input comes back
                self._steer_failed(
                    lane,
                    steer.input,
                    steer.ref.previous_response_id,
                    "response_not_active",
                    "The response ended before the steering input could be committed.",
                    steer.ref.id,
                )
        elif event.owed or not steers:
            self._unpark(lane)
            # With steers, the engine sent response.steer.pending for each.
            lane.parked = _Parked(event.job.response_id, steers, committed)
        elif not self.expired:
            self._successor(lane, event, _Parked(event.job.response_id, steers, committed).items())
        else:
            for steer in steers:  # past the lifetime limit no successor can start
                self._steer_failed(
                    lane,
                    steer.input,
                    steer.ref.previous_response_id,
                    "successor_creation_failed",
                    "The connection reached its lifetime limit before the successor could be created.",
                    steer.ref.id,
                )

    def _unpark(self, lane: Lane) -> None:
        """Parked steers whose parent the lane no longer continues come back, with their ids."""
        if lane.parked is None:
            return
        parent, steers = lane.parked.parent, lane.parked.steers
        lane.parked = None
        for steer in steers:
            self._steer_failed(
                lane,
                steer.input,
                parent,
                "response_not_active",
                f"The lane no longer continues response '{parent}'; its queued steering input was not committed.",
                steer.ref.id,
            )

    def _successor(self, lane: Lane, ended: ResponseEnded, items: tuple[Item, ...]) -> None:
        """The automatic successor: the parent's settings, the queued input, the parent as its
        `previous_response_id`; it runs next on the lane (its `response.created` commits the steers).
        It arrives when the parent ended: the server, not the client, sent it."""
        parent = ended.job
        request = parent.request
        params = structs.replace(request.params, previous_response_id=parent.response_id)
        successor = dataclasses.replace(request, params=params, items=items, generate=True)
        self._arrivals += 1
        lane.queue.appendleft((self._arrivals, CreateReceived(successor, ended.at)))

    def _ended(self, lane: Lane, event: ResponseEnded) -> None:
        self._finish_job(lane, event)

    def _ended_expired(self, lane: Lane, event: ResponseEnded) -> None:
        self._finish_job(lane, event)
        self._expire(lane, event)

    def _expire(self, lane: Lane, event: Input) -> None:
        """The lane's queued creates will not run: each gets the limit error."""
        self.expired = True
        err = self._limit_error()
        for _ in lane.queue:
            self._error(err, lane)
            self.expiry_errors += 1
        lane.queue.clear()

    def _refuse_expired(self, lane: Lane, event: CreateReceived) -> None:
        self._error(self._limit_error(), lane)
        self.expiry_errors += 1

    def _refuse(self, lane: Lane, event: CreateReceived, error: ProtocolError) -> None:
        """A create that will not run: an error event, and its previous response is evicted
        from the lane's cache entry, as for any failed turn."""
        self._evict(lane, event.request.previous_response_id)
        self._error(error, lane)

    def _bad_frame(self, lane: Lane, event: BadFrame) -> None:
        if lane.stream_id == event.stream_id:  # a failed fork onto a lane not opened yet keeps its parent
            self._evict(lane, event.previous_response_id)
        # The error names the lane the frame named; an invalid id or a frame without one: none.
        self._out.append(SendFrame(tag_stream(ws_error_event(event.error), stream_prefix(event.stream_id))))

    def _disconnect(self, lane: Lane, event: Disconnected) -> None:
        lane.pause = None
        if lane.in_flight is not None:
            self._out.append(CancelJob(lane.in_flight))
            lane.in_flight = None
        lane.queue.clear()
        lane.cache = None

    # -- append mode ---------------------------------------------------------------------------------

    def _paused(self, lane: Lane, event: ResponsePaused) -> None:
        if lane.pause is None or lane.pause.job is not event.job:  # beta: the book of the emitted calls stands
            lane.pause = _Pause(event.job, {r.call_id: r.name for r in event.required})
        self._out.append(ArmPauseTimer(event.job))

    def _resume(self, lane: Lane, event: AllAnswered) -> None:
        assert lane.pause is not None
        pause = lane.pause
        self._out.append(ResumeJob(pause.job, tuple(pause.committed), pause.last_at, pause.last_bytes))
        lane.pause = None

    def _pause_timed_out(self, lane: Lane, event: PauseTimedOut) -> None:
        lane.pause = None
        self._out.append(AbortPause(event.job, "append_timeout"))

    def _abort_paused_at_limit(self, lane: Lane, event: LimitReached) -> None:
        assert lane.pause is not None
        self.expired = True
        self._out.append(AbortPause(lane.pause.job, "connection_limit"))
        lane.pause = None

    def _abort_at_limit(self, lane: Lane, event: ResponsePaused) -> None:
        self._out.append(AbortPause(event.job, "connection_limit"))

    def _refuse_paused(self, lane: Lane, event: CreateReceived) -> None:
        assert lane.pause is not None
        self._refuse(
            lane,
            event,
            ProtocolError(
                f"Response '{lane.pause.job.response_id}' is paused waiting for tool outputs; "
                "send response.append, or open another connection.",
                code="response_paused",
                status=409,
            ),
        )

    def _append(self, lane: Lane, event: AppendReceived) -> None:
        append = event.event
        if self.beta and isinstance(append, ResponseAppend):
            self._error(
                ProtocolError(
                    "Unsupported event type: 'response.append'. The responses_multi_agent beta resumes a "
                    "response with response.inject.",
                    code="unsupported_event_type",
                    param="type",
                ),
                None,
            )
            return
        if not (self.append_mode or self.beta):
            self._error(
                ProtocolError(
                    f"Unsupported event type: '{append.__struct_config__.tag}'. Append mode is not enabled "
                    "on this connection (opt in with ?mode=append or OpenAI-Beta: responses_websockets=2026-02-04).",
                    code="unsupported_event_type",
                    param="type",
                ),
                None,
            )
            return
        try:
            pause = self._target(lane, append.response_id)
            items = self._validate_append(pause, append)
        except ProtocolError as err:
            self._refuse_append(lane, append, err)
            return
        for item in items:
            if item.view.type == "function_call_output":
                del pause.pending[str(item.view.call_id)]
        pause.committed.extend(items)
        pause.last_at, pause.last_bytes = event.at, event.body_bytes
        if isinstance(append, ResponseInject):
            self._out.append(AckInject(pause.job))

    def _called(self, lane: Lane, event: CallEmitted) -> None:
        """Beta: an async call is answerable from now on (its output may come before the pause)."""
        if event.job is not lane.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        if lane.pause is None:
            lane.pause = _Pause(event.job, {})
        lane.pause.pending[event.call.call_id] = event.call.name

    def _take(self, lane: Lane, event: TurnEnded) -> None:
        """Beta: a turn boundary; the input injected so far goes to the response, its calls
        without an output stay pending."""
        if event.job is not lane.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        committed: tuple[Item, ...] = ()
        if lane.pause is not None:
            committed = tuple(lane.pause.committed)
            lane.pause.committed.clear()
        self._out.append(TakeInput(event.job, committed))

    def _steer(self, lane: Lane, event: SteerReceived) -> None:
        steer = event.event
        target = steer.previous_response_id
        job = lane.in_flight
        owner = lane if (job is not None and job.response_id == target) or lane.last_ended == target else None
        try:
            items = self._steer_items(steer.input)
        except ProtocolError as err:
            self._steer_failed(owner, steer.input, target, "invalid_input", err.message)
            return
        if job is None or job.response_id != target:
            if target in self.ended_ids:
                self._steer_failed(
                    owner,
                    steer.input,
                    target,
                    "response_already_completed",
                    f"Response '{target}' has already completed and no longer accepts steering input.",
                )
            else:
                self._steer_failed(
                    None,
                    steer.input,
                    target,
                    "response_not_found",
                    f"Response '{target}' is not active on this connection.",
                )
            return
        if job.request.model.lower().startswith(self.unsteerable_models):
            self._steer_failed(
                lane,
                steer.input,
                target,
                "steering_not_supported",
                f"The model '{job.request.model}' does not support steering.",
            )
            return
        if job.request.compact_threshold is not None:
            # The beta's steer event: responses using automatic compaction do not support steering.
            self._steer_failed(
                lane,
                steer.input,
                target,
                "steering_not_supported",
                "Steering is not supported for responses that use automatic compaction (context_management).",
            )
            return
        if len(lane.steers) >= MAX_PENDING_STEERS:
            self._steer_failed(
                lane,
                steer.input,
                target,
                "too_many_pending_steers",
                f"At most {MAX_PENDING_STEERS} steering submissions may wait for one response.",
            )
            return
        ref = SteerRef(id=self.ids.new("steer"), previous_response_id=target)
        lane.steers.append(_Steer(ref, steer.input, items))
        self._out.append(AckSteer(job, ref))

    def _steer_items(self, value: msgspec.Raw) -> tuple[Item, ...]:
        """User messages only, each with only `type`, `role` and `content` (the beta's rule)."""
        try:
            decoded = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise ProtocolError("Invalid 'input'.", code="invalid_value", param="input") from None
        if isinstance(decoded, str):
            return parse_items(decoded)
        if not isinstance(decoded, list) or not decoded:
            raise ProtocolError(
                "'input' must be a string or a non-empty array of user messages.", code="invalid_value", param="input"
            )
        for index, message in enumerate(decoded):
            if (
                not isinstance(message, dict)
                or message.get("role") != "user"
                or message.get("type", "message") != "message"
                or not STEER_MESSAGE_KEYS.issuperset(message)
            ):
                raise ProtocolError(
                    f"Invalid 'input[{index}]': steering accepts only user messages with type, role and content.",
                    code="invalid_value",
                    param=f"input[{index}]",
                )
        return parse_items([msgspec.Raw(msgspec.json.encode(m)) for m in decoded])

    def _steer_failed(
        self, lane: Lane | None, value: msgspec.Raw, target: str, code: str, message: str, steer_id: str | None = None
    ) -> None:
        submission = SteerSubmission(input=value, previous_response_id=target)
        if steer_id is not None:
            submission = SteerSubmission(input=value, previous_response_id=target, id=steer_id)
        failed = ResponseSteerFailed(  # belongs to no running stream: numbered 0
            sequence_number=0, error=SteerError(code=code, message=message), steer=submission
        )
        self._out.append(SendFrame(tag_stream(encode(failed), lane.prefix if lane is not None else None)))

    def _target(self, lane: Lane, response_id: str | None) -> _Pause:
        """The paused response an append is for, or the error that says why there is none."""
        job = lane.in_flight
        if response_id is None and job is not None:
            response_id = job.response_id
        if response_id is None:
            response_id = lane.last_ended
        if job is not None and response_id == job.response_id:
            if lane.pause is None:
                raise ProtocolError(
                    f"Response '{response_id}' is not paused: it is still sampling.",
                    code="response_not_paused",
                    param="response_id",
                )
            return lane.pause
        if response_id in self.ended_ids:
            raise ProtocolError(
                f"Response '{response_id}' has already completed.",
                code="response_already_completed",
                param="response_id",
            )
        shown = f"'{response_id}'" if response_id else "to append to"
        raise ProtocolError(f"Response {shown} not found.", code="response_not_found", param="response_id")

    def _validate_append(self, pause: _Pause, append: ResponseAppend | ResponseInject) -> tuple[Item, ...]:
        items = parse_items(append.input)
        answered: set[str] = set()
        for index, item in enumerate(items):
            view = item.view
            if view.type == "function_call_output":
                call_id = str(view.call_id)
                if call_id not in pause.pending or call_id in answered:
                    raise ProtocolError(
                        f"No pending function call with call_id '{call_id}' in response '{pause.job.response_id}'.",
                        code="unknown_call_id",
                        param=f"input[{index}].call_id",
                    )
                answered.add(call_id)
            elif not (view.type == "message" and view.role in APPENDABLE_ROLES):
                raise ProtocolError(
                    f"Invalid item in 'input[{index}]': an append carries function_call_output items "
                    "and user or developer messages only.",
                    code="invalid_value",
                    param=f"input[{index}]",
                )
        return items

    def _refuse_append(self, lane: Lane, append: ResponseAppend | ResponseInject, err: ProtocolError) -> None:
        pause = lane.pause
        on_lane = (
            lane if lane.in_flight is not None and append.response_id in (None, lane.in_flight.response_id) else None
        )
        beta_failure = err.code in ("response_not_found", "response_already_completed")
        if isinstance(append, ResponseAppend) or (self.beta and not beta_failure):
            # Beta: `response.inject.failed` is for input another response may take (its two
            # codes); input that is wrong for any response is an `error` (docs/beta.md).
            self._error(
                err, on_lane if on_lane is not None else (lane if lane.last_ended == append.response_id else None)
            )
            return
        target = append.response_id or (lane.in_flight.response_id if lane.in_flight else "")
        if pause is not None and target == pause.job.response_id:
            # Numbered in the paused response's own stream (which is idle while paused).
            self._out.append(AckInject(pause.job, InjectRefused(append.input, str(err.code), err.message)))
            return
        failed = ResponseInjectFailed(  # belongs to no stream: numbered 0
            sequence_number=0,
            response_id=target,
            input=append.input,
            error=InjectError(code=str(err.code), message=err.message),
        )
        self._out.append(SendFrame(tag_stream(encode(failed), on_lane.prefix if on_lane else None)))


# -- the table: (lane state, input) -> (action, next lane state) ----------------------------------------

C = Connection
_TRANSITIONS: Final[dict[tuple[CS, type], tuple[Action, CS]]] = {
    (CS.IDLE, CreateReceived): (C._enqueue, CS.IDLE),  # then Dequeue starts it, if a slot is free
    (CS.ACTIVE, CreateReceived): (C._enqueue, CS.ACTIVE),
    (CS.PAUSED, CreateReceived): (C._refuse_paused, CS.PAUSED),
    (CS.DRAINING, CreateReceived): (C._refuse_expired, CS.DRAINING),
    (CS.EXPIRED, CreateReceived): (C._refuse_expired, CS.EXPIRED),
    (CS.IDLE, Dequeue): (C._start_next, CS.ACTIVE),
    (CS.ACTIVE, ResponsePaused): (C._paused, CS.PAUSED),
    (CS.DRAINING, ResponsePaused): (C._abort_at_limit, CS.DRAINING),
    (CS.PAUSED, AllAnswered): (C._resume, CS.ACTIVE),
    (CS.PAUSED, PauseTimedOut): (C._pause_timed_out, CS.ACTIVE),
    (CS.PAUSED, LimitReached): (C._abort_paused_at_limit, CS.DRAINING),
    (CS.ACTIVE, ResponseEnded): (C._ended, CS.IDLE),
    (CS.DRAINING, ResponseEnded): (C._ended_expired, CS.EXPIRED),
    (CS.IDLE, LimitReached): (C._expire, CS.EXPIRED),
    (CS.ACTIVE, LimitReached): (C._drain, CS.DRAINING),
    (CS.DRAINING, LimitReached): (C._nothing, CS.DRAINING),
    (CS.EXPIRED, LimitReached): (C._nothing, CS.EXPIRED),
    **{(s, AppendReceived): (C._append, s) for s in _OPEN},
    **{(s, SteerReceived): (C._steer, s) for s in _OPEN},
    (CS.ACTIVE, CallEmitted): (C._called, CS.ACTIVE),
    (CS.DRAINING, CallEmitted): (C._called, CS.DRAINING),
    (CS.ACTIVE, TurnEnded): (C._take, CS.ACTIVE),
    (CS.DRAINING, TurnEnded): (C._take, CS.DRAINING),
    **{(s, BadFrame): (C._bad_frame, s) for s in _OPEN},
    **{(s, Disconnected): (C._disconnect, CS.CLOSED) for s in _OPEN},
    (CS.CLOSED, Disconnected): (C._nothing, CS.CLOSED),
}
del C
