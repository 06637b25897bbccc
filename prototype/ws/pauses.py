"""The pause machine of a WebSocket connection, one class per dialect (rules 9-14 of
connection.py; docs/protocol.md for append mode, docs/beta.md for the beta).

A dialect decides what a connection's `response.append` / `response.inject` frames mean and
what a response that waits for client input keeps:

- `CreateDialect`, WebSocket mode: no response waits; append and inject are not event types.
- `AppendDialect`, append mode: a turn that ends in calls pauses its response; `response.append`
  and `response.inject` answer it, refusals are `error` events (append) or
  `response.inject.failed` / a refused acknowledgement (inject).
- `BetaDialect`, `responses_multi_agent=v1`: only async calls wait, each answerable from the
  moment it is emitted; `response.append` is not an event type; inject refusals other than the
  two response-level codes are `error` events; outputs injected for a response that ended anyway
  are carried to the create that continues it.

The connection's table calls the same methods whatever the dialect; a dialect overrides only
where its rule differs. Outputs go to `emit`, in order. Each names the dialect its responses run
in (`responses`, prototype/response/dialect.py): what a response that waits keeps and reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import ClassVar, Final

from ..context.cache import tag_stream
from ..context.conversation import Item, ItemParser, parse_items
from ..response.dialect import AppendResponse, BetaResponse, ResponseDialect
from ..response.stream import InjectRefused
from ..wire.errors import ProtocolError
from ..wire.requests import ResponseAppend, ResponseInject
from ..wire.schemas import InjectError, ResponseInjectFailed, encode
from .events import (
    AbortPause,
    AckInject,
    AppendReceived,
    ArmPauseTimer,
    CallEmitted,
    CloseSocket,
    Output,
    PauseTimedOut,
    ResponsePaused,
    ResumeJob,
    SendFrame,
    TakeInput,
    TurnEnded,
)
from .frames import unsupported
from .lanes import Lane, Pause, error_frame

__all__ = [
    "APPENDABLE_ROLES",
    "CLOSE_BAD_INJECT",
    "AppendDialect",
    "BetaDialect",
    "CreateDialect",
    "PauseDialect",
    "dialect_of",
]

APPENDABLE_ROLES: Final = frozenset({"user", "developer"})
# An inject that does not conform to its schema: a generic 400 `error`, then the server closes the
# socket (the multi-agent guide); the close code is longrun's (policy violation, RFC 6455 7.4.1).
CLOSE_BAD_INJECT: Final = 1008
# The inject failures that are about the response, not the input: `response.inject.failed`
# in the beta (its error code is a closed set of these), so the input can go to another one.
INJECT_FAILURES: Final = frozenset({"response_not_found", "response_already_completed"})


class PauseDialect:
    """The rules every dialect shares: pausing, answering, resuming, timing out."""

    name = "append"
    steering = False  # whether `response.steer` is an event type on the connection
    closes_on_bad_inject = False  # whether a schema-invalid `response.inject` closes the socket
    takes_messages = True  # whether an append or inject may carry user or developer messages
    # The dialect each response on the connection runs in (one object per response).
    responses: ClassVar[type[ResponseDialect]] = AppendResponse

    def __init__(self, emit: Callable[[Output], None], ended_ids: deque[str], parse: ItemParser = parse_items) -> None:
        self.emit = emit
        self.ended_ids = ended_ids  # the connection's recently ended responses (read only)
        self.parse = parse  # the engine's item parser, as a create's items are validated

    # -- a response waits, resumes, or is aborted ----------------------------------------------------

    def paused(self, lane: Lane, event: ResponsePaused) -> None:
        if lane.pause is None or lane.pause.job is not event.job:  # beta: the book of the emitted calls stands
            lane.pause = Pause(event.job, {r.call_id: r.name for r in event.required})
        self.emit(ArmPauseTimer(event.job))

    def resume(self, lane: Lane) -> None:
        assert lane.pause is not None
        pause = lane.pause
        self.emit(ResumeJob(pause.job, tuple(pause.committed), pause.last_at, pause.last_bytes))
        lane.pause = None

    def timed_out(self, lane: Lane, event: PauseTimedOut) -> None:
        lane.pause = None
        self.emit(AbortPause(event.job, "append_timeout"))

    def abort_at_limit(self, lane: Lane) -> None:
        assert lane.pause is not None
        self.emit(AbortPause(lane.pause.job, "connection_limit"))
        lane.pause = None

    def refusal(self, lane: Lane) -> ProtocolError:
        """Why a create on a lane whose response waits is refused (never queued: under FIFO it
        would wait behind a response that waits for the client)."""
        assert lane.pause is not None
        return ProtocolError(
            f"Response '{lane.pause.job.response_id}' is paused waiting for tool outputs; "
            "send response.append, or open another connection.",
            code="response_paused",
            status=409,
        )

    def ended(self, lane: Lane) -> tuple[Item, ...]:
        """The lane's response ended: its pause is gone; what it leaves for the create that
        continues it (nothing, but in the beta)."""
        lane.pause = None
        return ()

    # -- the beta's async calls (reported only under the beta, which overrides neither) --------------

    def called(self, lane: Lane, event: CallEmitted) -> None:
        """An async call is answerable from now on (its output may come before the pause)."""
        if lane.pause is None:
            lane.pause = Pause(event.job, {})
        lane.pause.pending[event.call.call_id] = event.call.name

    def take(self, lane: Lane, event: TurnEnded) -> None:
        """A turn boundary; the input injected so far goes to the response, its calls without an
        output stay pending."""
        committed: tuple[Item, ...] = ()
        if lane.pause is not None:
            committed = tuple(lane.pause.committed)
            lane.pause.committed.clear()
        self.emit(TakeInput(event.job, committed))

    # -- append and inject ---------------------------------------------------------------------------

    def refuse_event(self, append: ResponseAppend | ResponseInject) -> ProtocolError | None:
        """The error for an event type this dialect does not have; None: it has it."""
        return None

    def append(self, lane: Lane, event: AppendReceived) -> None:
        append = event.event
        if (refused := self.refuse_event(append)) is not None:
            self.emit(error_frame(refused, None))
            return
        try:
            # A dialect that closes on a schema-invalid inject checks the schema first.
            parsed = self._parse(append) if self.closes_on_bad_inject else None
            pause = self._target(lane, append.response_id)
            items = self._validate(pause, append, parsed)
        except _SchemaError as err:
            self._close_on(lane, err)
            return
        except ProtocolError as err:
            self._refuse(lane, append, err)
            return
        for item in items:
            if item.view.type == "function_call_output":
                del pause.pending[str(item.view.call_id)]
        pause.committed.extend(items)
        pause.last_at, pause.last_bytes = event.at, event.body_bytes
        if isinstance(append, ResponseInject):
            self.emit(AckInject(pause.job))

    def _target(self, lane: Lane, response_id: str | None) -> Pause:
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

    def _parse(self, append: ResponseAppend | ResponseInject) -> tuple[Item, ...]:
        """The frame's items, validated; a dialect that closes on a bad inject raises `_SchemaError`."""
        try:
            return self.parse(append.input)
        except ProtocolError as err:
            if self.closes_on_bad_inject and isinstance(append, ResponseInject):
                raise _SchemaError(err) from None
            raise

    def _close_on(self, lane: Lane, err: _SchemaError) -> None:
        """A schema-invalid inject: its 400 `error`, then the socket is closed."""
        self.emit(error_frame(err.error, lane if lane.in_flight is not None else None))
        self.emit(CloseSocket(CLOSE_BAD_INJECT, "response.inject does not conform to its schema"))

    def _validate(
        self, pause: Pause, append: ResponseAppend | ResponseInject, parsed: tuple[Item, ...] | None = None
    ) -> tuple[Item, ...]:
        items = parsed if parsed is not None else self.parse(append.input)
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
            elif view.type == "message" and not self.takes_messages and isinstance(append, ResponseInject):
                raise ProtocolError(
                    f"Invalid item in 'input[{index}]': response.inject takes client-owned tool outputs "
                    "(function_call_output items) only.",
                    code="invalid_value",
                    param=f"input[{index}]",
                )
            elif not (view.type == "message" and view.role in APPENDABLE_ROLES):
                raise ProtocolError(
                    f"Invalid item in 'input[{index}]': an append carries function_call_output items "
                    "and user or developer messages only.",
                    code="invalid_value",
                    param=f"input[{index}]",
                )
        return items

    def _refused_as_error(self, append: ResponseAppend | ResponseInject, err: ProtocolError) -> bool:
        """Whether a refusal is an `error` event rather than inject's own failure events."""
        return isinstance(append, ResponseAppend)

    def _refuse(self, lane: Lane, append: ResponseAppend | ResponseInject, err: ProtocolError) -> None:
        on_lane = (
            lane if lane.in_flight is not None and append.response_id in (None, lane.in_flight.response_id) else None
        )
        if self._refused_as_error(append, err):
            self.emit(
                error_frame(
                    err, on_lane if on_lane is not None else (lane if lane.last_ended == append.response_id else None)
                )
            )
            return
        pause = lane.pause
        target = append.response_id or (lane.in_flight.response_id if lane.in_flight else "")
        if pause is not None and target == pause.job.response_id:
            # Numbered in the paused response's own stream (which is idle while paused).
            self.emit(AckInject(pause.job, InjectRefused(append.input, str(err.code), err.message)))
            return
        failed = ResponseInjectFailed(  # belongs to no stream: numbered 0
            sequence_number=0,
            response_id=target,
            input=append.input,
            error=InjectError(code=str(err.code), message=err.message),
        )
        self.emit(SendFrame(tag_stream(encode(failed), on_lane.prefix if on_lane else None)))


class AppendDialect(PauseDialect):
    """Append mode (opt-in: `?mode=append`): the rules above as they are."""


class CreateDialect(PauseDialect):
    """WebSocket mode: no response waits for the client (every call ends its response), so
    append and inject are not event types; steering is."""

    name = "create"
    steering = True
    responses = ResponseDialect

    def refuse_event(self, append: ResponseAppend | ResponseInject) -> ProtocolError | None:
        return unsupported(
            append.__struct_config__.tag,  # type: ignore[arg-type]
            "Append mode is not enabled on this connection (opt in with ?mode=append or "
            "OpenAI-Beta: responses_websockets=2026-02-04).",
        )


class BetaDialect(PauseDialect):
    """`OpenAI-Beta: responses_multi_agent=v1` (docs/beta.md). The beta's inject takes
    client-owned tool outputs only (its SDK type says so); `inject_messages` is the what-if that
    also commits user and developer messages, as append mode does."""

    name = "beta"
    steering = True
    closes_on_bad_inject = True
    responses = BetaResponse

    def __init__(
        self,
        emit: Callable[[Output], None],
        ended_ids: deque[str],
        parse: ItemParser = parse_items,
        *,
        inject_messages: bool = False,
    ) -> None:
        super().__init__(emit, ended_ids, parse)
        self.takes_messages = inject_messages

    def refuse_event(self, append: ResponseAppend | ResponseInject) -> ProtocolError | None:
        if isinstance(append, ResponseAppend):
            return unsupported(
                "response.append", "The responses_multi_agent beta resumes a response with response.inject."
            )
        return None

    def _refused_as_error(self, append: ResponseAppend | ResponseInject, err: ProtocolError) -> bool:
        # `response.inject.failed` is for input another response may take (its two codes); input
        # that is wrong for any response is an `error` (docs/beta.md).
        return err.code not in INJECT_FAILURES

    def ended(self, lane: Lane) -> tuple[Item, ...]:
        # Outputs injected for async calls of a turn that ended the response anyway (it also
        # called a client-owned tool) are acknowledged input: the continuation takes them.
        committed = tuple(lane.pause.committed) if lane.pause is not None else ()
        lane.pause = None
        return committed


class _SchemaError(Exception):
    """An inject whose items do not conform to the schema (in a dialect that closes on it)."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(error.message)
        self.error = error


def dialect_of(
    append_mode: bool,
    beta: bool,
    emit: Callable[[Output], None],
    ended_ids: deque[str],
    *,
    inject_messages: bool = False,
    parse: ItemParser = parse_items,
) -> PauseDialect:
    """`parse`: the engine's item parser, which validates an append's or inject's items."""
    if beta:
        return BetaDialect(emit, ended_ids, parse, inject_messages=inject_messages)
    return (AppendDialect if append_mode else CreateDialect)(emit, ended_ids, parse)
