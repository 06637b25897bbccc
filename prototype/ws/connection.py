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
to start, resume, abort or cancel, a pause timer to arm, a close (events.py).
Every input goes to one lane (lanes.py); each lane's legal moves are the rows of
`TRANSITIONS`, whose actions are the methods that carry out the move. Anything else raises
`ConnectionStateError`. The connection keeps the table and the lifetime and hands each other
rule set to its unit, as h2 splits a connection: the multiplexing (which lane an input is for,
the lanes' FIFOs, the in-flight cap: mux.py), frame classification (frames.py), the connection
cache's budget, LRU and forks (conncache.py), the pause machine per dialect (pauses.py) and
steering, automatic successors included (steering.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Final

from msgspec import structs

from ..config import WebSocketConfig
from ..context.cache import CacheEntry, stream_prefix, tag_stream
from ..context.conversation import ItemParser, ToolCache, parse_items
from ..ids import IdFactory
from ..wire.errors import ProtocolError, ws_error_event
from ..wire.schemas import RequiredInput, SteerRef
from .conncache import ConnectionCache
from .events import (
    AbortPause,
    AllAnswered,
    AppendReceived,
    BadFrame,
    CallEmitted,
    CancelJob,
    CloseSocket,
    CreateReceived,
    Dequeue,
    Disconnected,
    Input,
    Job,
    LimitReached,
    Output,
    PauseTimedOut,
    ResponseEnded,
    ResponsePaused,
    SendFrame,
    StartJob,
    SteerReceived,
    TurnEnded,
)
from .frames import FrameClassifier
from .lanes import CS, OPEN, ConnectionStateError, Lane, Pause, error_frame
from .mux import LaneMux
from .pauses import CLOSE_BAD_INJECT, PauseDialect, dialect_of
from .steering import UNSTEERABLE_MODELS, Steering

__all__ = ["CLOSE_GOING_AWAY", "RECENT_IDS", "TRANSITIONS", "Connection", "limit_message"]

CLOSE_GOING_AWAY: Final = 1001  # server shutdown or lifetime limit; triggers openai-python's auto-reconnect
RECENT_IDS: Final = 64  # ended response ids remembered per connection, for `response_already_completed`


def limit_message(lifetime_s: float) -> str:
    if lifetime_s >= 60 and lifetime_s % 60 == 0:
        span = f"{int(lifetime_s // 60)} minutes"
    else:
        span = f"{lifetime_s:g} seconds"
    return f"Responses websocket connection limit reached ({span}). Create a new websocket connection to continue."


def limit_error(lifetime_s: float) -> ProtocolError:
    return ProtocolError(limit_message(lifetime_s), code="websocket_connection_limit_reached")


Action = Callable[["Connection", Lane, Any], None]


class Connection:
    """Feed it with `receive_text` and the `response_ended` / `response_paused` /
    `pause_timed_out` / `limit_reached` / `disconnected` calls; after each, drain
    `outputs_to_send()` and act on every output in order."""

    def __init__(
        self,
        limits: WebSocketConfig | None = None,
        *,
        append_mode: bool = False,
        beta: bool = False,
        ids: IdFactory | None = None,
        reuse_tools: bool = True,
        open_responses: bool = False,
        unsteerable_models: tuple[str, ...] = UNSTEERABLE_MODELS,
        item_parser: ItemParser = parse_items,
        **overrides: Any,
    ) -> None:
        """`limits` whole (the server's `ServerConfig.websocket`); `overrides` replace single
        fields of it (`Connection(lifetime_s=1)`), as the core's tests build one."""
        self.limits = structs.replace(limits or WebSocketConfig(), **overrides)
        self.ids = ids or IdFactory()
        self.mux = LaneMux(self.limits)
        self.default = self.mux.default
        self.lanes = self.mux.lanes  # the mux's own map, read by the units
        self.ended_ids: collections.deque[str] = collections.deque(maxlen=RECENT_IDS)
        self.expired = False  # the lifetime limit was reached
        self.closing = False  # CloseSocket was emitted
        self.expiry_errors = 0  # limit errors sent for refused creates
        self._jobs = 0
        self._out: list[Output] = []
        emit = self._out.append
        # The pause machine's dialect: WebSocket mode (`create`), append mode, or the beta. Items
        # are validated by `item_parser` (the engine's) in every frame, as in an HTTP body.
        inject = self.limits.inject_messages
        self.dialect: PauseDialect = dialect_of(
            append_mode, beta, emit, self.ended_ids, inject_messages=inject, parse=item_parser
        )
        self.steering = Steering(emit, self.ids, self.ended_ids, unsteerable_models)
        self.cache_book = ConnectionCache(self.lanes, self.limits.max_cache_bytes)
        self.tools = ToolCache() if reuse_tools else None  # the last validated tool list
        steering = self.dialect.steering
        self.frames = FrameClassifier(
            steering=steering, tools=self.tools, open_responses=open_responses, multi_agent=beta, parse=item_parser
        )

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
    def pause(self) -> Pause | None:
        return self.default.pause

    @property
    def n_in_flight(self) -> int:
        return self.mux.in_flight

    @property
    def named_lanes(self) -> int:
        return self.mux.named

    @property
    def cache_hits(self) -> int:
        return self.cache_book.hits

    @property
    def cache_misses(self) -> int:
        return self.cache_book.misses

    @property
    def cache_refused(self) -> int:
        return self.cache_book.refused

    # -- adapter API ---------------------------------------------------------------------------------

    def receive_text(self, data: str | bytes, *, at: float = 0.0) -> None:
        """One text frame from the client."""
        event = self.frames.classify(data, self.mux.fits, at)
        if isinstance(event, CreateReceived):  # a valid create opens its lane
            self.mux.open(event.request.params.stream_id, self.expired)
        self.handle(self.mux.lane_of(event), event)

    def call_emitted(self, job: Job, call: RequiredInput) -> None:
        # `lane_of_job` checks the job is its lane's in flight (for `_called` and `_take` too).
        self.handle(self.mux.lane_of_job(job), CallEmitted(job, call))

    def turn_ended(self, job: Job) -> None:
        self.handle(self.mux.lane_of_job(job), TurnEnded(job))

    def response_ended(
        self,
        job: Job,
        entry: CacheEntry | None,
        error: ProtocolError | None = None,
        owed: tuple[RequiredInput, ...] = (),
        *,
        at: float = 0.0,
    ) -> None:
        self.handle(self.mux.lane_of_job(job), ResponseEnded(job, entry, error, owed, at))

    def response_paused(self, job: Job, required: tuple[RequiredInput, ...]) -> None:
        self.handle(self.mux.lane_of_job(job), ResponsePaused(job, required))

    def queued_steers(self, job: Job) -> tuple[SteerRef, ...]:
        """The steers queued for `job`'s response (read by its run: where it may stop)."""
        steers = self.mux.lane_of_job(job).steers
        return tuple(steer.ref for steer in steers) if steers else ()

    def pause_timed_out(self, job: Job) -> None:
        self.handle(self.mux.lane_of_job(job), PauseTimedOut(job))

    def limit_reached(self) -> None:
        for lane in list(self.lanes.values()):
            self.handle(lane, LimitReached())

    def disconnected(self) -> None:
        for lane in list(self.lanes.values()):
            self.handle(lane, Disconnected())

    def outputs_to_send(self) -> list[Output]:
        out = self._out.copy()
        self._out.clear()  # one list for the connection's life: its units emit into it
        return out

    # -- the machine ---------------------------------------------------------------------------------

    def handle(self, lane: Lane, event: Input) -> None:
        """One input to one lane: the table's row says what to do and where the lane goes."""
        try:
            action, nxt = TRANSITIONS[(lane.state, type(event))]
        except KeyError:
            raise ConnectionStateError(f"can't handle {type(event).__name__} in state {lane.state.name}") from None
        action(self, lane, event)
        lane.state = nxt
        if nxt is CS.PAUSED and lane.pause is not None and not lane.pause.pending:
            self.handle(lane, AllAnswered())
        # Queued creates start on idle lanes while responses in flight are under the cap.
        while (ready := self.mux.next_ready()) is not None:
            self.handle(ready, Dequeue())
        if self.expired and not self.closing and all(lane.state is CS.EXPIRED for lane in self.lanes.values()):
            self.closing = True
            if self.expiry_errors == 0:  # nothing was refused: the limit itself is reported once
                self._out.append(error_frame(limit_error(self.limits.lifetime_s), None))
            self._out.append(CloseSocket(CLOSE_GOING_AWAY, "connection limit reached"))

    # -- actions (the table's callables) -------------------------------------------------------------

    def _nothing(self, lane: Lane, event: Input) -> None:
        """Nothing to do in this state."""

    def _drain(self, lane: Lane, event: LimitReached) -> None:
        """The limit, with the lane's response in flight: it may finish; nothing new starts."""
        self.expired = True

    def _enqueue(self, lane: Lane, event: CreateReceived) -> None:
        """Queue the create behind the lane's response (or refuse it: `concurrent_request`,
        `queued_requests_limit_reached`)."""
        refusal = self.mux.refusal(lane)
        if refusal is not None:
            self._refuse(lane, event, refusal)
        else:
            self.mux.enqueue(lane, event)

    def _start_next(self, lane: Lane, event: Dequeue) -> None:
        """Start the lane's next queued create: its cache entry is resolved now, and input
        parked for its parent goes first."""
        _, queued = self.mux.dequeue(lane)
        request = self.steering.continuing(lane, queued.request)
        self._jobs += 1
        cached, exclusive = self.cache_book.take(request.previous_response_id)
        job = Job(
            self._jobs,
            request,
            cached,
            self.ids.new("resp"),
            arrived_at=queued.at,
            body_bytes=queued.body_bytes,
            exclusive=exclusive,
        )
        self.mux.started(lane, job)
        self._out.append(StartJob(job))

    def _ended(self, lane: Lane, event: ResponseEnded) -> None:
        """The response in flight ended: cache entry stored (or its parent evicted), queued steers resolved."""
        if event.job is not lane.in_flight:
            raise ConnectionStateError(f"job {event.job.number} is not the one in flight")
        self.mux.stopped(lane)
        committed = self.dialect.ended(lane)
        lane.last_ended = event.job.response_id
        self.ended_ids.append(event.job.response_id)
        if event.entry is not None:
            self.cache_book.store(lane, event.entry)
        else:
            self.cache_book.evict(lane, event.job.request.previous_response_id)
            if event.error is not None:
                self._out.append(error_frame(event.error, lane))
        successor = self.steering.ended(lane, event, committed, expired=self.expired)
        if successor is not None:
            self.mux.enqueue(lane, successor, first=True)

    def _ended_expired(self, lane: Lane, event: ResponseEnded) -> None:
        """The response in flight ended after the limit: as `_ended`, then the lane expires."""
        self._ended(lane, event)
        self._expire(lane, event)

    def _expire(self, lane: Lane, event: Input) -> None:
        """The lane's queued creates will not run: each gets the limit error."""
        self.expired = True
        err = limit_error(self.limits.lifetime_s)
        for _ in range(self.mux.dropped(lane)):
            self._out.append(error_frame(err, lane))
            self.expiry_errors += 1

    def _refuse_expired(self, lane: Lane, event: CreateReceived) -> None:
        """Refuse the create with `websocket_connection_limit_reached`."""
        self._out.append(error_frame(limit_error(self.limits.lifetime_s), lane))
        self.expiry_errors += 1

    def _refuse(self, lane: Lane, event: CreateReceived, error: ProtocolError) -> None:
        """A create that will not run: an error event, and its previous response is evicted
        from the lane's cache entry, as for any failed turn."""
        self.cache_book.evict(lane, event.request.previous_response_id)
        self._out.append(error_frame(error, lane))

    def _bad_frame(self, lane: Lane, event: BadFrame) -> None:
        """An `error` event for the frame; a failed continuation on its own lane evicts its parent."""
        if lane.stream_id == event.stream_id:  # a failed fork onto a lane not opened yet keeps its parent
            self.cache_book.evict(lane, event.previous_response_id)
        # The error names the lane the frame named; an invalid id or a frame without one: none.
        self._out.append(SendFrame(tag_stream(ws_error_event(event.error), stream_prefix(event.stream_id))))
        if event.event_type == "response.inject" and self.dialect.closes_on_bad_inject:
            self._out.append(CloseSocket(CLOSE_BAD_INJECT, "response.inject does not conform to its schema"))

    def _disconnect(self, lane: Lane, event: Disconnected) -> None:
        """Cancel the response in flight, drop the queue and the cache entry."""
        lane.pause = None
        if lane.in_flight is not None:
            self._out.append(CancelJob(lane.in_flight))
            self.mux.stopped(lane)
        self.mux.dropped(lane)
        lane.cache = None

    # -- the pause machine and steering (their units decide; the lane's state is the table's) -------

    def _paused(self, lane: Lane, event: ResponsePaused) -> None:
        """The response waits for client input: arm its pause timer (the dialect keeps the pending calls)."""
        self.dialect.paused(lane, event)

    def _resume(self, lane: Lane, event: AllAnswered) -> None:
        """Every pending call is answered: resume the response with what was committed."""
        self.dialect.resume(lane)

    def _pause_timed_out(self, lane: Lane, event: PauseTimedOut) -> None:
        """The pause outlived its timeout: end the response `incomplete` (`append_timeout`)."""
        self.dialect.timed_out(lane, event)

    def _abort_paused_at_limit(self, lane: Lane, event: LimitReached) -> None:
        """The limit, while the response waits: end it `incomplete` (`connection_limit`)."""
        self.expired = True
        self.dialect.abort_at_limit(lane)

    def _abort_at_limit(self, lane: Lane, event: ResponsePaused) -> None:
        """A pause after the limit: end the response `incomplete` (`connection_limit`) at once."""
        self._out.append(AbortPause(event.job, "connection_limit"))

    def _refuse_paused(self, lane: Lane, event: CreateReceived) -> None:
        """Refuse the create with `response_paused` (never queued behind a waiting response)."""
        self._refuse(lane, event, self.dialect.refusal(lane))

    def _append(self, lane: Lane, event: AppendReceived) -> None:
        """An append or inject, by the connection's dialect: committed atomically or refused whole."""
        self.dialect.append(lane, event)

    def _called(self, lane: Lane, event: CallEmitted) -> None:
        """Beta: an async call was emitted; its output may be injected from now on."""
        self.dialect.called(lane, event)

    def _take(self, lane: Lane, event: TurnEnded) -> None:
        """Beta: a turn ended in async calls; hand the response what was injected so far."""
        self.dialect.take(lane, event)

    def _steer(self, lane: Lane, event: SteerReceived) -> None:
        """A steer: queued and acknowledged on the response it names, or refused."""
        self.steering.receive(lane, event.event)


# -- the table: (lane state, input) -> (action, next lane state) ----------------------------------------

C = Connection
TRANSITIONS: Final[dict[tuple[CS, type], tuple[Action, CS]]] = {
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
    **{(s, AppendReceived): (C._append, s) for s in OPEN},
    **{(s, SteerReceived): (C._steer, s) for s in OPEN},
    (CS.ACTIVE, CallEmitted): (C._called, CS.ACTIVE),
    (CS.DRAINING, CallEmitted): (C._called, CS.DRAINING),
    (CS.ACTIVE, TurnEnded): (C._take, CS.ACTIVE),
    (CS.DRAINING, TurnEnded): (C._take, CS.DRAINING),
    **{(s, BadFrame): (C._bad_frame, s) for s in OPEN},
    **{(s, Disconnected): (C._disconnect, CS.CLOSED) for s in OPEN},
    (CS.CLOSED, Disconnected): (C._nothing, CS.CLOSED),
}
del C
