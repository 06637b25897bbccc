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
7. Limits (all optional): at most `max_queued` creates wait behind the one in
   flight; one more is refused with 429 `queued_requests_limit_reached` (the
   socket stays open, the referenced cache entry is evicted as for any failed
   turn). A response whose cache entry would hold more than `max_cache_bytes`
   is not cached: the cache is left empty (the entry it would have replaced is
   dropped too), so a continuation from it loads from the store (`store:true`)
   or gets `previous_response_not_found`.

Append mode (opt-in per connection; wire-protocol 11, decisions in the README):

8. When a sampled turn ends in function calls the response *pauses* (PAUSED):
   the engine has sent `response.done` with `required_input`; the core keeps the
   pending call ids and asks the adapter to arm the pause timer.
9. `response.append` / `response.inject` commit items atomically: every item is
   a `function_call_output` for a pending call id or a user/developer message;
   anything else is rejected whole. Partial appends are accepted; the response
   resumes (ACTIVE) once every pending call is answered. Inject is acknowledged
   with `response.inject.created` (numbered in the paused response's sequence)
   and refused with `response.inject.failed`; append has no acknowledgement (the
   resume shows as `response.in_progress`) and is refused with `error` events:
   `response_not_found`, `response_already_completed`, `response_not_paused`,
   `unknown_call_id`.
10. A `response.create` while paused is refused (409 `response_paused`), never
   queued: under FIFO it would wait behind a response that waits for the client.
11. A pause that outlives the pause timeout, or the connection's lifetime, ends
    the response `incomplete` (reasons `append_timeout`, `connection_limit`).

The core reads no clock and does no I/O: the adapter feeds it client frames and
"response paused" / "response ended" / "pause timed out" / "limit reached" /
"disconnected" inputs, then drains `outputs_to_send()`: frames to write, a job
to start, resume, abort or cancel, a pause timer to arm, a close.
All legal moves are in `_TRANSITIONS`; anything else raises `ConnectionStateError`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Final

import msgspec

from .cache import CacheEntry
from .conversation import CreateRequest, Item, ToolCache, normalize_create, parse_items
from .errors import ProtocolError, from_validation_error, ws_error_event
from .ids import IdFactory
from .schemas import (
    InjectError,
    RequiredInput,
    ResponseAppend,
    ResponseCreate,
    ResponseInject,
    ResponseInjectCreated,
    ResponseInjectFailed,
    decode_client_event,
    decode_envelope,
    decode_text,
    encode,
)
from .stream import SequenceCounter

__all__ = [
    "CS",
    "AbortPause",
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


class CS(enum.Enum):
    IDLE = enum.auto()
    ACTIVE = enum.auto()  # one response in flight, sampling
    PAUSED = enum.auto()  # append mode: the in-flight response waits for tool outputs
    DRAINING = enum.auto()  # lifetime limit reached while a response was in flight
    EXPIRED = enum.auto()  # limit reached and nothing in flight: closing with 1001
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


@dataclass(frozen=True, slots=True)
class BadFrame:
    error: ProtocolError
    previous_response_id: str | None = None


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


@dataclass(frozen=True, slots=True)
class LimitReached:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    pass


Input = (
    CreateReceived
    | AppendReceived
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
    counter: SequenceCounter = field(default_factory=SequenceCounter)  # the response's sequence numbers
    arrived_at: float = 0.0  # when its response.create frame arrived
    body_bytes: int = 0


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


@dataclass(frozen=True, slots=True)
class AbortPause:
    job: Job
    reason: str  # `incomplete_details.reason` of the response


Output = SendFrame | StartJob | CancelJob | CloseSocket | ArmPauseTimer | ResumeJob | AbortPause


@dataclass(slots=True)
class _Pause:
    """Bookkeeping of the paused response: which calls still wait, what was committed."""

    job: Job
    pending: dict[str, str]  # call_id -> function name
    committed: list[Item] = field(default_factory=list)


# -- the table --------------------------------------------------------------------------------------

_OPEN: Final = (CS.IDLE, CS.ACTIVE, CS.PAUSED, CS.DRAINING, CS.EXPIRED)

_TRANSITIONS: Final[dict[tuple[CS, type], tuple[str, CS]]] = {
    (CS.IDLE, CreateReceived): ("_enqueue", CS.IDLE),  # then Dequeue starts it
    (CS.ACTIVE, CreateReceived): ("_enqueue", CS.ACTIVE),
    (CS.PAUSED, CreateReceived): ("_refuse_paused", CS.PAUSED),
    (CS.DRAINING, CreateReceived): ("_refuse_expired", CS.DRAINING),
    (CS.EXPIRED, CreateReceived): ("_refuse_expired", CS.EXPIRED),
    (CS.IDLE, Dequeue): ("_start_next", CS.ACTIVE),
    (CS.ACTIVE, ResponsePaused): ("_paused", CS.PAUSED),
    (CS.DRAINING, ResponsePaused): ("_abort_at_limit", CS.DRAINING),
    (CS.PAUSED, AllAnswered): ("_resume", CS.ACTIVE),
    (CS.PAUSED, PauseTimedOut): ("_pause_timed_out", CS.ACTIVE),
    (CS.PAUSED, LimitReached): ("_abort_paused_at_limit", CS.DRAINING),
    (CS.ACTIVE, ResponseEnded): ("_ended", CS.IDLE),
    (CS.DRAINING, ResponseEnded): ("_ended_expired", CS.EXPIRED),
    (CS.IDLE, LimitReached): ("_expire", CS.EXPIRED),
    (CS.ACTIVE, LimitReached): ("_nothing", CS.DRAINING),
    (CS.DRAINING, LimitReached): ("_nothing", CS.DRAINING),
    (CS.EXPIRED, LimitReached): ("_nothing", CS.EXPIRED),
    **{(s, AppendReceived): ("_append", s) for s in _OPEN},
    **{(s, BadFrame): ("_bad_frame", s) for s in _OPEN},
    **{(s, Disconnected): ("_disconnect", CS.CLOSED) for s in _OPEN},
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

    def __init__(
        self,
        *,
        lifetime_s: float = 3600.0,
        reject_concurrent: bool = False,
        append_mode: bool = False,
        ids: IdFactory | None = None,
        max_queued: int | None = None,
        max_cache_bytes: int | None = None,
        reuse_tools: bool = True,
    ) -> None:
        self.state = CS.IDLE
        self.lifetime_s = lifetime_s
        self.reject_concurrent = reject_concurrent
        self.append_mode = append_mode
        self.max_queued = max_queued
        self.max_cache_bytes = max_cache_bytes
        self.ids = ids or IdFactory()
        self.cache: CacheEntry | None = None
        self.queue: collections.deque[CreateReceived] = collections.deque()
        self.in_flight: Job | None = None
        self.pause: _Pause | None = None
        self.ended_ids: collections.deque[str] = collections.deque(maxlen=RECENT_IDS)
        self._jobs = 0
        self._out: list[Output] = []
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_refused = 0  # entries over `max_cache_bytes`, not cached
        self.tools = ToolCache() if reuse_tools else None  # the last validated tool list

    # -- adapter API ---------------------------------------------------------------------------------

    def receive_text(self, data: str | bytes, *, at: float = 0.0) -> None:
        """One text frame from the client."""
        event = self._classify(data)
        if isinstance(event, CreateReceived):
            event = CreateReceived(event.request, at, len(data))
        self.handle(event)

    def response_ended(self, job: Job, entry: CacheEntry | None, error: ProtocolError | None = None) -> None:
        self.handle(ResponseEnded(job, entry, error))

    def response_paused(self, job: Job, required: tuple[RequiredInput, ...]) -> None:
        self.handle(ResponsePaused(job, required))

    def pause_timed_out(self, job: Job) -> None:
        self.handle(PauseTimedOut(job))

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
        elif self.state is CS.PAUSED and self.pause is not None and not self.pause.pending:
            self.handle(AllAnswered())

    def _classify(self, data: str | bytes) -> Input:
        try:
            event = decode_client_event(decode_text(data))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._bad(data, exc)
        if isinstance(event, ResponseCreate):
            params = event.response if event.response is not None else event
            try:
                return CreateReceived(normalize_create(params, websocket=True, tool_cache=self.tools))
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
            self._refuse(
                event,
                ProtocolError(
                    "Another response is in progress on this connection.", code="concurrent_request", status=409
                ),
            )
            return
        if self.state is CS.ACTIVE and self.max_queued is not None and len(self.queue) >= self.max_queued:
            self._refuse(
                event,
                ProtocolError(
                    f"Too many queued response.create events on this connection (at most {self.max_queued} "
                    "wait behind the response in progress). Wait for a response to finish, or open another connection.",
                    code="queued_requests_limit_reached",
                    status=429,
                ),
            )
            return
        self.queue.append(event)

    def _start_next(self, event: Dequeue) -> None:
        if not self.queue:
            raise ConnectionStateError("nothing is queued")
        queued = self.queue.popleft()
        request = queued.request
        self._jobs += 1
        prev = request.previous_response_id
        cached = self.cache if prev is not None and self.cache is not None and self.cache.response_id == prev else None
        if prev is not None:
            if cached is None:
                self.cache_misses += 1
            else:
                self.cache_hits += 1
        self.in_flight = Job(
            self._jobs, request, cached, self.ids.new("resp"), arrived_at=queued.at, body_bytes=queued.body_bytes
        )
        self._out.append(StartJob(self.in_flight))

    def _finish_job(self, event: ResponseEnded) -> None:
        if event.job is not self.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        self.in_flight = None
        self.ended_ids.append(event.job.response_id)
        if event.entry is not None:
            if self.max_cache_bytes is not None and event.entry.nbytes > self.max_cache_bytes:
                self.cache = None
                self.cache_refused += 1
            else:
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

    # -- append mode ---------------------------------------------------------------------------------

    def _check_job(self, job: Job) -> None:
        if job is not self.in_flight:
            raise ConnectionStateError(f"job {job.number} is not the one in flight")

    def _paused(self, event: ResponsePaused) -> None:
        self._check_job(event.job)
        self.pause = _Pause(event.job, {r.call_id: r.name for r in event.required})
        self._out.append(ArmPauseTimer(event.job))

    def _resume(self, event: AllAnswered) -> None:
        assert self.pause is not None
        self._out.append(ResumeJob(self.pause.job, tuple(self.pause.committed)))
        self.pause = None

    def _pause_timed_out(self, event: PauseTimedOut) -> None:
        self._check_job(event.job)
        self.pause = None
        self._out.append(AbortPause(event.job, "append_timeout"))

    def _abort_paused_at_limit(self, event: LimitReached) -> None:
        assert self.pause is not None
        self._out.append(AbortPause(self.pause.job, "connection_limit"))
        self.pause = None

    def _abort_at_limit(self, event: ResponsePaused) -> None:
        self._check_job(event.job)
        self._out.append(AbortPause(event.job, "connection_limit"))

    def _refuse(self, event: CreateReceived, error: ProtocolError) -> None:
        """A create that will not run: an error event, and its previous response is evicted
        from the cache, as for any failed turn."""
        self._evict(event.request.previous_response_id)
        self._error(error)

    def _refuse_paused(self, event: CreateReceived) -> None:
        assert self.pause is not None
        self._refuse(
            event,
            ProtocolError(
                f"Response '{self.pause.job.response_id}' is paused waiting for tool outputs; "
                "send response.append, or open another connection.",
                code="response_paused",
                status=409,
            ),
        )

    def _append(self, event: AppendReceived) -> None:
        append = event.event
        if not self.append_mode:
            self._error(
                ProtocolError(
                    f"Unsupported event type: '{append.__struct_config__.tag}'. Append mode is not enabled "
                    "on this connection (opt in with ?mode=append or OpenAI-Beta: responses_websockets=2026-02-04).",
                    code="unsupported_event_type",
                    param="type",
                )
            )
            return
        try:
            pause = self._target(append.response_id)
            items = self._validate_append(pause, append)
        except ProtocolError as err:
            self._refuse_append(append, err)
            return
        for item in items:
            if item.view.type == "function_call_output":
                del pause.pending[str(item.view.call_id)]
        pause.committed.extend(items)
        if isinstance(append, ResponseInject):
            ack = ResponseInjectCreated(sequence_number=pause.job.counter.next(), response_id=pause.job.response_id)
            self._out.append(SendFrame(encode(ack)))

    def _target(self, response_id: str | None) -> _Pause:
        """The paused response an append is for, or the error that says why there is none."""
        job = self.in_flight
        if response_id is None and job is not None:
            response_id = job.response_id
        if response_id is None and self.ended_ids:
            response_id = self.ended_ids[-1]
        if job is not None and response_id == job.response_id:
            if self.pause is None:
                raise ProtocolError(
                    f"Response '{response_id}' is not paused: it is still sampling.",
                    code="response_not_paused",
                    param="response_id",
                )
            return self.pause
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

    def _refuse_append(self, append: ResponseAppend | ResponseInject, err: ProtocolError) -> None:
        if isinstance(append, ResponseAppend):
            self._error(err)
            return
        pause = self.pause
        target = append.response_id or (self.in_flight.response_id if self.in_flight else "")
        # Numbered in the response's own sequence only while it is paused (its stream is idle
        # then); otherwise the failure belongs to no stream.
        seq = pause.job.counter.next() if pause is not None and target == pause.job.response_id else 0
        failed = ResponseInjectFailed(
            sequence_number=seq,
            response_id=target,
            input=append.input,
            error=InjectError(code=str(err.code), message=err.message),
        )
        self._out.append(SendFrame(encode(failed)))

    def _bad_frame(self, event: BadFrame) -> None:
        self._evict(event.previous_response_id)
        self._error(event.error)

    def _disconnect(self, event: Disconnected) -> None:
        self.pause = None
        if self.in_flight is not None:
            self._out.append(CancelJob(self.in_flight))
            self.in_flight = None
        self.queue.clear()
        self.cache = None
