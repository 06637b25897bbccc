"""The per-response state machine: model events in, Responses stream events out.

Theory of operation
-------------------
One `ResponseStream` turns the model's event grammar (prototype.model) into the
Responses streaming event grammar (docs/protocol.md; the API reference's streaming events):

    response.created, response.in_progress,
    ( output_item.added, [content_part.added], delta*, *.done, [content_part.done],
      output_item.done | compaction )*,
    response.completed | response.incomplete | response.failed

with `sequence_number` starting at 0 and increasing by one per event. The same
core serves SSE, WebSocket and in-process simulation; only the encoder differs.

Invariants:

* `output_item.added` (and `content_part.added` for messages) precede any delta
  of that item (openai-python's stream accumulator raises otherwise).
* The items of `output_item.done` are exactly `response.output` of the terminal
  event (Codex chains incrementally only if they are).
* Nothing follows a terminal event.
* A response may pause for client tool outputs and resume (`response.in_progress`);
  output indices and sequence numbers continue across segments. One machine, two
  renderings of the pause (its *dialect*): append mode announces it with
  `response.done` (non-terminal status `in_progress`); the beta (docs/beta.md) sends
  nothing, since the async calls' `output_item.done` events already told the client.
* Beta: a turn that ends in async calls may be followed by the next turn without a pause
  (`Continue`, docs/beta.md): no wire event, the items go on at the next output index.
* Beta acknowledgements (`response.inject.created`/`.failed`, `response.steer.accepted`)
  are numbered in the stream wherever it is. `response.steer.pending` follows
  `response.completed`, as the beta types say; an inject or steer the core accepted just as
  the response ended is acknowledged after its terminal event too (its input goes to the
  continuation). Nothing else follows a terminal event.
* Beta: a steer accepted while the model decodes stops the response at the next token
  boundary (`Interrupt`): the item in flight, if any, is closed with status `incomplete`
  (its text so far), then `response.incomplete` with reason `steered` (docs/beta.md).
* A server-side compaction (docs/compaction.md) is `output_item.added` (the
  compaction item, content empty), `response.compaction.compacting`, then
  `output_item.done` with the item's content, between model items.

Every legal (state, input) pair is a row of `TRANSITIONS`: the action that makes its
events and the next state. A `SamplingFinished` whose reason is `max_output_tokens` is
its own input kind (`Truncated`), so the incomplete ending is a row too. Anything else
is a bug in the model or the caller and raises `StreamError` without moving the stream;
`abort` then ends it with `response.failed` through the table's `Fail` rows.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from msgspec import UNSET, Raw, structs

from ..ids import IdFactory
from ..model import ItemFinished, ItemStarted, ModelEvent, Prefilled, SamplingFinished, TokensSampled
from ..wire.schemas import (
    ROOT_AGENT,
    CompactionItem,
    ContentPartAdded,
    ContentPartDone,
    FunctionCall,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    IncompleteDetails,
    InjectError,
    InputTokensDetails,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    RequiredInput,
    Response,
    ResponseCompactionCompacting,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInjectCreated,
    ResponseInjectFailed,
    ResponseInProgress,
    ResponseSteerAccepted,
    ResponseSteerPending,
    ServerEvent,
    SteerRef,
    Usage,
)

__all__ = [
    "DIALECTS",
    "TRANSITIONS",
    "CompactionDone",
    "CompactionStarted",
    "Continue",
    "EndIncomplete",
    "SteerAccepted",
    "SteerPending",
    "Fail",
    "InjectAccepted",
    "InjectRefused",
    "Interrupt",
    "Pause",
    "RS",
    "ResponseStream",
    "Resume",
    "Start",
    "StreamError",
    "Truncated",
]


class RS(enum.Enum):
    # Members are singletons that compare by identity: hashed by identity too, in C, not by
    # `Enum.__hash__` (a Python call) at each lookup of the transition table.
    __hash__ = object.__hash__

    QUEUED = enum.auto()
    IN_PROGRESS = enum.auto()  # between items
    IN_ITEM = enum.auto()  # streaming one output item
    PAUSED = enum.auto()  # append mode: waiting for client tool outputs
    COMPACTING = enum.auto()  # server-side compaction: the compaction item is being made
    COMPLETED = enum.auto()
    INCOMPLETE = enum.auto()
    FAILED = enum.auto()


TERMINAL: Final = frozenset({RS.COMPLETED, RS.INCOMPLETE, RS.FAILED})
DIALECTS: Final = ("append", "beta")  # how a pause is rendered on the wire (docs/beta.md)


@dataclass(frozen=True, slots=True)
class Start:
    input_tokens: int
    warm_up: bool = False  # `generate:false`: response.created then straight to response.completed


@dataclass(frozen=True, slots=True)
class Pause:
    pass


@dataclass(frozen=True, slots=True)
class Resume:
    input_tokens: int  # the prompt of the next segment (usage totals every segment's prompt)


@dataclass(frozen=True, slots=True)
class Continue:
    """Beta: the model samples its next turn without waiting for the outputs of its async calls."""

    input_tokens: int  # the prompt of the next segment, as for `Resume`


@dataclass(frozen=True, slots=True)
class Fail:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class EndIncomplete:
    """End a paused or between-items response `incomplete` (e.g. `append_timeout`, `content_filter`)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Beta: stop at this token boundary (a steer is queued): the item in flight ends
    `incomplete`, then the response ends `incomplete` with `reason`."""

    reason: str = "steered"


@dataclass(frozen=True, slots=True)
class InjectAccepted:
    """A `response.inject` committed (append: while paused; beta: also while sampling)."""


@dataclass(frozen=True, slots=True)
class InjectRefused:
    """A `response.inject` for this response, refused."""

    input: list[Raw]
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class SteerAccepted:
    """Beta: a `response.steer` for this response, queued."""

    steer: SteerRef


@dataclass(frozen=True, slots=True)
class SteerPending:
    """Beta: the response completed waiting for client tool outputs; the steer stays queued."""

    steer: SteerRef
    required: tuple[RequiredInput, ...]


@dataclass(frozen=True, slots=True)
class CompactionStarted:
    """Server-side compaction begins: the compaction item is announced (its content comes with `CompactionDone`)."""

    item_id: str


@dataclass(frozen=True, slots=True)
class CompactionDone:
    item: CompactionItem


class Truncated:
    """The input kind of a `SamplingFinished` with reason `max_output_tokens` (never instantiated)."""


StreamInput = (
    Start
    | Pause
    | Resume
    | Continue
    | Fail
    | EndIncomplete
    | Interrupt
    | InjectAccepted
    | InjectRefused
    | SteerAccepted
    | SteerPending
    | CompactionStarted
    | CompactionDone
    | ModelEvent
)

INPUT_TYPES: Final = (
    Start,
    Pause,
    Resume,
    Continue,
    Fail,
    EndIncomplete,
    Interrupt,
    InjectAccepted,
    InjectRefused,
    SteerAccepted,
    SteerPending,
    CompactionStarted,
    CompactionDone,
    Prefilled,
    ItemStarted,
    TokensSampled,
    ItemFinished,
    SamplingFinished,
    Truncated,
)


class StreamError(Exception):
    """An input the state machine cannot take: a bug in the caller or the model."""


class ResponseStream:
    """Produces the event stream of one response.

    After constructing it, call `receive(Start(...))`, then feed every model
    event; append mode adds `Pause`/`Resume`. Each call returns the events to
    send, in order. `response` is the latest snapshot of the Response object.
    """

    def __init__(
        self,
        template: Response,
        ids: IdFactory,
        *,
        dialect: str = "append",
        async_tools: frozenset[str] = frozenset(),
        multi_agent: bool = False,
        holds_calls: bool = True,
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}")
        self.dialect = dialect
        self.async_tools = async_tools if dialect == "beta" else frozenset()  # beta: calls marked `async`
        # Beta `multi_agent: {enabled: true}` (docs/beta.md#hosted-multi-agent): every item is the
        # root agent's, and every function call waits for its injected output (unless the
        # what-if `holds_calls` is off: then a call of a non-async tool ends the response).
        self.multi_agent = multi_agent and dialect == "beta"
        self._holds = self.multi_agent and holds_calls
        self._agent = ROOT_AGENT if self.multi_agent else UNSET
        self.response = template
        self.state = RS.QUEUED
        self.output: list[OutputItem] = []
        self.input_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.segment_start = 0  # index in `output` where the current segment began
        self.item_start_tokens = 0  # `output_tokens` when the item in flight started
        self.discarded_tokens = 0  # tokens of items an `Interrupt` ended incomplete
        self._ids = ids
        # The `sequence_number` source, the stream's alone (inject acknowledgements are its events
        # too): a C iterator, so numbering an event calls no Python function.
        self._next = itertools.count().__next__
        self._item: OutputMessage | FunctionCall | None = None
        self._parts: list[str] = []

    # -- public ------------------------------------------------------------------------------------

    def receive(self, event: StreamInput) -> list[ServerEvent]:
        if self.state is RS.IN_ITEM and type(event) is TokensSampled:  # hot path: the (IN_ITEM, TokensSampled) row
            return self._delta(event)
        kind: type = type(event)
        if kind is SamplingFinished and event.reason == "max_output_tokens":  # type: ignore[union-attr]
            kind = Truncated
        move = TRANSITIONS.get((self.state, kind))
        if move is None:
            raise StreamError(f"can't handle {kind.__name__} in state {self.state.name}")
        action, nxt = move
        out = action(self, event)
        self.state = nxt
        return out

    def end_incomplete(self, reason: str) -> list[ServerEvent]:
        """End a paused or idle-between-items response as incomplete (e.g. `append_timeout`)."""
        return self.receive(EndIncomplete(reason))

    def abort(self, code: str, message: str) -> list[ServerEvent]:
        """`response.failed` from wherever the stream is, unless it already ended. Used after an
        exception (including a `StreamError`, which left the stream where it was)."""
        if self.state in TERMINAL:
            return []
        return self.receive(Fail(code, message))

    def usage(self) -> Usage:
        return Usage(
            input_tokens=self.input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
            output_tokens=self.output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=self.input_tokens + self.output_tokens,
        )

    def segment_output(self) -> list[OutputItem]:
        """Output items of the current segment (since the start or the last resume)."""
        return self.output[self.segment_start :]

    def pending_calls(self) -> list[RequiredInput]:
        """Function calls of the current segment (append mode: what the response waits for)."""
        return [
            RequiredInput(call_id=item.call_id, name=item.name)
            for item in self.segment_output()
            if isinstance(item, FunctionCall)
        ]

    def split_calls(self) -> tuple[list[RequiredInput], list[RequiredInput]]:
        """The segment's calls of async tools, and the others (beta: those end the response)."""
        waits: list[RequiredInput] = []
        owed: list[RequiredInput] = []
        for item in self.segment_output():
            if isinstance(item, FunctionCall):
                (waits if self.waits(item) else owed).append(RequiredInput(call_id=item.call_id, name=item.name))
        return waits, owed

    def waits(self, call: FunctionCall) -> bool:
        """Beta: whether the response waits for this call's output instead of ending owing it."""
        return call.is_async is True or self._holds

    # -- transitions -------------------------------------------------------------------------------

    def _start(self, event: Start) -> list[ServerEvent]:
        """`response.created` and `response.in_progress`."""
        self.input_tokens = event.input_tokens
        snap = self.response
        created = ResponseCreated(sequence_number=self._next(), response=snap)
        if event.warm_up:
            return [created]
        return [created, ResponseInProgress(sequence_number=self._next(), response=snap)]

    def _item_started(self, event: ItemStarted) -> list[ServerEvent]:
        """`response.output_item.added` (and a message's `content_part.added`)."""
        index = len(self.output)
        self._parts = []
        self.item_start_tokens = self.output_tokens
        if event.kind == "message":
            msg = OutputMessage(id=self._ids.new("msg"), status="in_progress", content=[], agent=self._agent)
            self._item = msg
            return [
                OutputItemAdded(sequence_number=self._next(), output_index=index, item=msg),
                ContentPartAdded(
                    sequence_number=self._next(),
                    item_id=msg.id,
                    output_index=index,
                    content_index=0,
                    part=OutputText(text=""),
                ),
            ]
        call = FunctionCall(
            id=self._ids.new("fc"),
            status="in_progress",
            arguments="",
            call_id=self._ids.new("call"),
            name=event.name,
            agent=self._agent,
        )
        if event.name in self.async_tools:
            call = structs.replace(call, is_async=True)
        self._item = call
        return [OutputItemAdded(sequence_number=self._next(), output_index=index, item=call)]

    def _delta(self, event: TokensSampled) -> list[ServerEvent]:
        """A text or arguments delta."""
        self.output_tokens += len(event.token_ids)
        if not event.text:
            return []  # a token ending mid UTF-8 character: its text arrives with the next token
        self._parts.append(event.text)
        item = self._item
        index = len(self.output)
        if isinstance(item, OutputMessage):
            return [
                OutputTextDelta(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=event.text,
                )
            ]
        assert item is not None
        return [
            FunctionCallArgumentsDelta(
                sequence_number=self._next(), item_id=item.id, output_index=index, delta=event.text
            )
        ]

    def _item_finished(self, event: ItemFinished) -> list[ServerEvent]:
        """The item's `.done` events."""
        item = self._item
        assert item is not None
        text = "".join(self._parts)
        index = len(self.output)
        self._item = None
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            done_msg = OutputMessage(id=item.id, status="completed", content=[part], agent=item.agent)
            self.output.append(done_msg)
            return [
                OutputTextDone(
                    sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0, text=text
                ),
                ContentPartDone(
                    sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0, part=part
                ),
                OutputItemDone(sequence_number=self._next(), output_index=index, item=done_msg),
            ]
        done_call = structs.replace(item, status="completed", arguments=text)
        self.output.append(done_call)
        return [
            FunctionCallArgumentsDone(
                sequence_number=self._next(), item_id=item.id, output_index=index, arguments=text, name=item.name
            ),
            OutputItemDone(sequence_number=self._next(), output_index=index, item=done_call),
        ]

    def _interrupt_item(self, event: Interrupt) -> list[ServerEvent]:
        """The item in flight, closed where the decode stopped (status `incomplete`, its text so
        far), then the response's end. A message gets its text and part done events; a call only
        its `output_item.done` (its arguments were never finished, so nothing announces them)."""
        item = self._item
        assert item is not None
        text = "".join(self._parts)
        index = len(self.output)
        self._item = None
        self.discarded_tokens += self.output_tokens - self.item_start_tokens
        out: list[ServerEvent] = []
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            done: OutputItem = OutputMessage(id=item.id, status="incomplete", content=[part], agent=item.agent)
            out += [
                OutputTextDone(
                    sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0, text=text
                ),
                ContentPartDone(
                    sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0, part=part
                ),
            ]
        else:
            done = structs.replace(item, status="incomplete", arguments=text)
        self.output.append(done)
        out.append(OutputItemDone(sequence_number=self._next(), output_index=index, item=done))
        return out + self._end_incomplete(event)

    def _prefilled(self, event: Prefilled) -> list[ServerEvent]:
        """The prompt is prefilled: nothing on the wire."""
        self.cached_tokens += event.cached_tokens  # no wire event: counted in usage.cached_tokens
        return []

    def _complete(self, event: SamplingFinished) -> list[ServerEvent]:
        """`response.completed`."""
        self.response = structs.replace(
            self.response,
            status="completed",
            output=_phased(self.output) if self.multi_agent else list(self.output),
            usage=self.usage(),
            completed_at=self.response.created_at,
        )
        return [ResponseCompleted(sequence_number=self._next(), response=self.response)]

    def _end_incomplete(self, event: EndIncomplete | Interrupt | SamplingFinished) -> list[ServerEvent]:
        """`response.incomplete` with the input's reason: the caller's, `max_output_tokens` (a
        truncation) or `steered` (an interrupt)."""
        self.response = structs.replace(
            self.response,
            status="incomplete",
            incomplete_details=IncompleteDetails(reason=event.reason),
            output=list(self.output),
            usage=self.usage(),
        )
        return [ResponseIncomplete(sequence_number=self._next(), response=self.response)]

    def _pause(self, event: Pause) -> list[ServerEvent]:
        """Append mode: the pause event with `required_input`."""
        self.response = structs.replace(self.response, status="in_progress", output=list(self.output), usage=None)
        if self.dialect == "beta":
            return []  # the beta has no pause event: the async calls' output_item.done said it all
        return [ResponseDone(sequence_number=self._next(), response=self.response, required_input=self.pending_calls())]

    def _resume(self, event: Resume) -> list[ServerEvent]:
        """Append mode: `response.in_progress` again."""
        self.segment_start = len(self.output)
        self.input_tokens += event.input_tokens
        # As every in-progress snapshot (docs/protocol.md): `output: []`. The pause's `response.done`
        # carried the items so far; repeating them here would grow each resume with the rollout.
        snapshot = structs.replace(self.response, output=[])
        return [ResponseInProgress(sequence_number=self._next(), response=snapshot)]

    def _continue(self, event: Continue) -> list[ServerEvent]:
        # A new segment without a pause: nothing to tell the client, who never saw the stream stop.
        """Beta: the model decodes on past async calls; nothing on the wire."""
        self.segment_start = len(self.output)
        self.input_tokens += event.input_tokens
        return []

    def _fail(self, event: Fail) -> list[ServerEvent]:
        """`response.failed`."""
        self.response = structs.replace(
            self.response,
            status="failed",
            error=ResponseError(code=event.code, message=event.message),
            output=list(self.output),
            usage=self.usage(),
        )
        return [ResponseFailed(sequence_number=self._next(), response=self.response)]


# -- the actions that number an event outside the model's items: the beta's acknowledgements
# (numbered wherever the stream is) and a compaction's item -----------------------------------------


def _inject_accepted(stream: ResponseStream, event: InjectAccepted) -> list[ServerEvent]:
    """`response.inject.created`, numbered in this stream."""
    return [ResponseInjectCreated(sequence_number=stream._next(), response_id=stream.response.id)]


def _inject_refused(stream: ResponseStream, event: InjectRefused) -> list[ServerEvent]:
    """`response.inject.failed`, numbered in this stream."""
    error = InjectError(code=event.code, message=event.message)
    return [
        ResponseInjectFailed(
            sequence_number=stream._next(), response_id=stream.response.id, input=event.input, error=error
        )
    ]


def _steer_accepted(stream: ResponseStream, event: SteerAccepted) -> list[ServerEvent]:
    """`response.steer.accepted`, numbered in this stream."""
    return [ResponseSteerAccepted(sequence_number=stream._next(), steer=event.steer)]


def _steer_pending(stream: ResponseStream, event: SteerPending) -> list[ServerEvent]:
    """`response.steer.pending` with the owed calls, after `response.completed`."""
    return [
        ResponseSteerPending(
            sequence_number=stream._next(),
            reason="waiting_for_required_input",
            required_input=list(event.required),
            steer=event.steer,
        )
    ]


def _compaction_started(stream: ResponseStream, event: CompactionStarted) -> list[ServerEvent]:
    # The item is announced with an empty `encrypted_content` (the spec requires the field);
    # `response.output_item.done` carries the content (docs/compaction.md).
    """The compaction item's `output_item.added`."""
    index = len(stream.output)
    announced = CompactionItem(id=event.item_id, encrypted_content="")
    return [
        OutputItemAdded(sequence_number=stream._next(), output_index=index, item=announced),
        ResponseCompactionCompacting(sequence_number=stream._next(), item_id=event.item_id, output_index=index),
    ]


def _compaction_done(stream: ResponseStream, event: CompactionDone) -> list[ServerEvent]:
    """The compaction item's `output_item.done`."""
    index = len(stream.output)
    stream.output.append(event.item)
    return [OutputItemDone(sequence_number=stream._next(), output_index=index, item=event.item)]


def _phased(output: list[OutputItem]) -> list[OutputItem]:
    """A `multi_agent` response's completed output, each message with its phase: the last
    item, when a message, is the root agent's final answer, every other message commentary.
    The streamed `.done` events carry none (the phase is known only at the end)."""
    last = len(output) - 1
    return [
        structs.replace(item, phase="final_answer" if i == last else "commentary")
        if isinstance(item, OutputMessage)
        else item
        for i, item in enumerate(output)
    ]


# -- the table: (state, input kind) -> (action, next state) -------------------------------------------

Action = Callable[[ResponseStream, Any], list[ServerEvent]]
_LIVE: Final = (RS.IN_PROGRESS, RS.IN_ITEM, RS.PAUSED)  # started and not ended
# Beta acknowledgements may also follow the terminal event: input the core accepted just as the
# response ended is carried to its continuation (docs/beta.md), so the acknowledgement stands.
_STARTED: Final = (*_LIVE, RS.COMPLETED, RS.INCOMPLETE, RS.FAILED)
R = ResponseStream
TRANSITIONS: Final[dict[tuple[RS, type], tuple[Action, RS]]] = {
    (RS.QUEUED, Start): (R._start, RS.IN_PROGRESS),
    (RS.IN_PROGRESS, Prefilled): (R._prefilled, RS.IN_PROGRESS),
    (RS.IN_PROGRESS, ItemStarted): (R._item_started, RS.IN_ITEM),
    (RS.IN_ITEM, TokensSampled): (R._delta, RS.IN_ITEM),
    (RS.IN_ITEM, ItemFinished): (R._item_finished, RS.IN_PROGRESS),
    (RS.IN_PROGRESS, SamplingFinished): (R._complete, RS.COMPLETED),
    (RS.IN_PROGRESS, Truncated): (R._end_incomplete, RS.INCOMPLETE),
    (RS.IN_PROGRESS, Pause): (R._pause, RS.PAUSED),
    (RS.PAUSED, Resume): (R._resume, RS.IN_PROGRESS),
    (RS.IN_PROGRESS, Continue): (R._continue, RS.IN_PROGRESS),  # the engine sends it in the beta only
    **{(s, InjectAccepted): (_inject_accepted, s) for s in _STARTED},  # numbered where the stream is
    **{(s, InjectRefused): (_inject_refused, s) for s in _LIVE},
    **{(s, SteerAccepted): (_steer_accepted, s) for s in _STARTED},
    (RS.COMPLETED, SteerPending): (_steer_pending, RS.COMPLETED),  # after response.completed
    (RS.IN_PROGRESS, EndIncomplete): (R._end_incomplete, RS.INCOMPLETE),
    (RS.PAUSED, EndIncomplete): (R._end_incomplete, RS.INCOMPLETE),
    (RS.IN_ITEM, Interrupt): (R._interrupt_item, RS.INCOMPLETE),  # beta: a steer, mid-item
    (RS.IN_PROGRESS, Interrupt): (R._end_incomplete, RS.INCOMPLETE),  # beta: a steer, between items
    (RS.IN_PROGRESS, CompactionStarted): (_compaction_started, RS.COMPACTING),
    (RS.COMPACTING, CompactionDone): (_compaction_done, RS.IN_PROGRESS),
    (RS.COMPACTING, Fail): (R._fail, RS.FAILED),
    (RS.QUEUED, Fail): (R._fail, RS.FAILED),
    (RS.IN_PROGRESS, Fail): (R._fail, RS.FAILED),
    (RS.IN_ITEM, Fail): (R._fail, RS.FAILED),
    (RS.PAUSED, Fail): (R._fail, RS.FAILED),
}
del R
