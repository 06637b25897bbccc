"""One Agents API session (beta, `OpenAI-Beta: agents=v1`) as a sans-IO state machine.

Theory of operation
-------------------
Rules (docs/agents-api.md; the sources are openai-python 3.63's session types and helpers and
OpenAI's Agents API guides):

1. A session is `idle`, `in_progress` (a turn runs) or `requires_action` (the turn is paused
   at function calls). A message to an idle session starts a turn; its first message starts
   the session's first turn. Turns run one at a time.
2. A turn is one Responses-API response run by the engine in the `append` pause dialect: it
   pauses at every step that ends in function calls and resumes when each call has its
   result, so the paused turn keeps its KV as an append-mode response does. A turn is
   `queued` -> `in_progress` <-> `waiting` -> `completed` | `failed` | `cancelled`
   (`TURN_TRANSITIONS`). A turn continues the previous one (`previous_response_id`).
3. A `function_call` is announced by `agent.session.turn.item.added` once its arguments are
   whole, and it is registered then: from that event on a tool result for it is accepted
   (and held until the step ends). A result naming a call not (yet) registered gets the 400
   `Unknown pending tool call: <call_id>`, the one openai-python's tool dispatcher retries on.
4. When the step ends in calls still unanswered the turn waits: `agent.session.requires_action`
   with the session's `required_actions`. When every call has its result the turn resumes
   (`agent.session.in_progress`, `agent.session.turn.in_progress`).
5. Steering: a message posted while a turn is active is queued and committed at the turn's
   next step boundary, the resume after its calls are answered (the outputs first, then the
   messages); one POST's events are one step (`apply`), so a message that comes with the results
   completing a step is committed at that boundary. A turn that ends without another step hands
   the queued messages to a new turn.
6. Cancel ends the active turn `cancelled` (its queued messages are dropped with it); on an
   idle session it is a no-op. The turn's response is cancelled in the engine and its
   outputs stay out of the next turn's context.
7. The root turn's end (`turn.completed` / `turn.failed` / `turn.cancelled`) is followed by
   `agent.session.idle`, unless queued messages start the next turn at once.
8. A turn that waits past the pause timeout (append mode's, `WebSocketConfig.append_timeout_s`)
   ends `failed` with `request_timeout`: the adapter aborts its paused response.
9. `Idempotency-Key`: a POST of input events replayed with a key already applied is accepted
   (202) and not applied again; the same key with a different body is refused (400
   `idempotency_key_reused`, longrun's code).

The core reads no clock and does no I/O. The adapter (`prototype/serve/agents_api.py`) feeds it input events
(after `check`), the engine's Responses events for the running turn (`response_events`), and
"turn paused" / "turn ended" inputs; then drains `outputs_to_send()`: events to publish, a turn
to start, resume or cancel. Every legal (state, input) pair is a row of `TRANSITIONS`; anything
else raises `AgentStateError`. The core decides; two parts it holds do one job each: `SessionWire`
makes the wire objects (events with their ids, the items a turn's Responses events and the
client's inputs become) and `IdempotencyKeys` keeps rule 9's digests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType, structs

from ..ids import IdFactory
from ..wire.errors import ProtocolError
from ..wire.schemas import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCall,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputTextDelta,
    OutputTextDone,
    Response,
    ResponseDone,
    ServerEvent,
    Usage,
    encode,
)
from . import wire as w
from .events import (
    ENGINE_INPUTS,
    SS,
    TURN_ERROR_CODES,
    AgentStateError,
    AllAnswered,
    CallAdded,
    CancelReceived,
    CancelTurn,
    DeleteReceived,
    Input,
    MessageReceived,
    Output,
    Publish,
    ResumeTurn,
    StartTurn,
    ToolResultReceived,
    TurnEnded,
    TurnPaused,
    TurnRecord,
)

__all__ = [
    "CONTEXT_LOST",
    "IdempotencyKeys",
    "SessionCore",
    "SessionWire",
    "TRANSITIONS",
    "output_item",
    "unknown_call",
]

CONTEXT_LOST: Final = (
    "The session's context is lost: the response its turns continue ({}) is no longer in the store, "
    "and the server process running the session has no copy of it."
)


@dataclass(slots=True)
class _Call:
    view: w.RequiredFunctionCall
    item: int  # its `function_call` item's place in `SessionCore.items`
    output_index: int
    result: bytes | None = None  # the function_call_output item, once answered


def unknown_call(call_id: str, index: int) -> ProtocolError:
    """The registration-race 400 (rule 3); openai-python matches its code and message exactly."""
    return ProtocolError(
        f"Unknown pending tool call: {call_id}",
        code="invalid_request_error",
        param=f"events[{index}].call_id",
        type="invalid_request_error",
    )


def answered_twice(call_id: str, index: int) -> ProtocolError:
    """The 400 for a second result of one call."""
    return ProtocolError(
        f"Tool call {call_id} already has a result.",
        code="invalid_request_error",
        param=f"events[{index}].call_id",
        type="invalid_request_error",
    )


def usage_out(usage: Usage | None) -> w.TokenUsageOut | None:
    if usage is None:
        return None
    return w.TokenUsageOut(
        input_tokens=usage.input_tokens,
        input_tokens_details=w.InputTokensDetailsOut(cached_tokens=usage.input_tokens_details.cached_tokens),
        output_tokens=usage.output_tokens,
        output_tokens_details=w.OutputTokensDetailsOut(reasoning_tokens=usage.output_tokens_details.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


def _add_usage(a: w.TokenUsageOut | None, b: w.TokenUsageOut | None) -> w.TokenUsageOut | None:
    if a is None or b is None:
        return a or b
    return w.TokenUsageOut(
        input_tokens=a.input_tokens + b.input_tokens,
        input_tokens_details=w.InputTokensDetailsOut(
            cached_tokens=a.input_tokens_details.cached_tokens + b.input_tokens_details.cached_tokens
        ),
        output_tokens=a.output_tokens + b.output_tokens,
        output_tokens_details=w.OutputTokensDetailsOut(
            reasoning_tokens=a.output_tokens_details.reasoning_tokens + b.output_tokens_details.reasoning_tokens
        ),
        total_tokens=a.total_tokens + b.total_tokens,
    )


def output_item(call_id: str, result: w.InputToolResult) -> bytes:
    """The Responses `function_call_output` a tool result becomes in the turn's context."""
    output: str | list[Raw]
    if result.success:
        output = result.output if result.output is not None else ""
    else:
        output = result.error if result.error is not None else "Tool call failed."
    return encode({"type": "function_call_output", "call_id": call_id, "output": output})


def _ext(response: Response | None) -> w.LongrunExt | UnsetType:
    """The `longrun` extension field: the response trimmed of its output, tools and instructions."""
    if response is None:
        return UNSET
    return w.LongrunExt(structs.replace(response, output=[], tools=[], instructions=None))


class IdempotencyKeys:
    """Rule 9: the digest of the body each `Idempotency-Key` applied, by key."""

    __slots__ = ("digests",)

    def __init__(self, digests: dict[str, bytes] | None = None) -> None:
        self.digests = dict(digests or {})

    def replayed(self, key: str | None, body: bytes) -> bool:
        """Whether a POST with this key was applied already (raises for the same key with another body)."""
        if key is None:
            return False
        digest = hashlib.sha256(body).digest()
        seen = self.digests.get(key)
        if seen is None:
            return False
        if seen != digest:
            raise ProtocolError(
                "This Idempotency-Key was already used with a different request body.",
                code="idempotency_key_reused",
                param="Idempotency-Key",
            )
        return True

    def remember(self, key: str | None, body: bytes) -> bool:
        """Keep the body's digest under `key`; whether there was a key to keep."""
        if key is None:
            return False
        self.digests[key] = hashlib.sha256(body).digest()
        return True


class SessionWire:
    """The session's wire objects: its events (each stamped with a fresh event id) and the items
    it makes of the running turn's Responses events and of the client's inputs. It keeps no
    session state: what is committed, published or registered is the core's decision."""

    __slots__ = ("ids",)

    def __init__(self, ids: IdFactory) -> None:
        self.ids = ids

    def event(self, kind: type[Any], **fields: Any) -> Any:
        return kind(event_id=self.ids.new("event"), **fields)

    def response_event(self, ev: ServerEvent, sid: str, tid: str) -> Any | None:
        """The session event a Responses event of turn `tid` becomes, or None. A function call's
        item and the response's end are inputs of the core, not rendered here; everything else
        (the response's lifecycle, argument deltas, compaction) has no session event of its own:
        the turn's lifecycle comes from the core's inputs."""
        if isinstance(ev, OutputItemAdded) and isinstance(ev.item, OutputMessage):
            item = w.MessageItemOut(id=ev.item.id, content=[], role="assistant", status="in_progress", turn_id=tid)
            return self.event(w.ItemAdded, item=item, output_index=ev.output_index, session_id=sid, turn_id=tid)
        if isinstance(ev, ContentPartAdded | ContentPartDone):
            part = w.ContentOut(text=ev.part.text)
            kind = w.ContentPartAdded if isinstance(ev, ContentPartAdded) else w.ContentPartDone
            return self.event(
                kind,
                content_index=ev.content_index,
                item_id=ev.item_id,
                output_index=ev.output_index,
                part=part,
                session_id=sid,
                turn_id=tid,
            )
        if isinstance(ev, OutputTextDelta):
            return self.event(
                w.OutputTextDelta,
                content_index=ev.content_index,
                delta=ev.delta,
                item_id=ev.item_id,
                output_index=ev.output_index,
                session_id=sid,
                turn_id=tid,
            )
        if isinstance(ev, OutputTextDone):
            return self.event(
                w.OutputTextDone,
                content_index=ev.content_index,
                item_id=ev.item_id,
                output_index=ev.output_index,
                session_id=sid,
                text=ev.text,
                turn_id=tid,
            )
        if isinstance(ev, OutputItemDone) and isinstance(ev.item, OutputMessage):
            content = [Raw(encode(w.ContentOut(text=part.text))) for part in ev.item.content]
            done = w.MessageItemOut(id=ev.item.id, content=content, role="assistant", status="completed", turn_id=tid)
            return self.event(w.ItemDone, item=done, output_index=ev.output_index, session_id=sid, turn_id=tid)
        return None

    def call(self, call: FunctionCall, tid: str) -> tuple[w.RequiredFunctionCall, w.FunctionCallItemOut]:
        """A function call of turn `tid`: what `required_actions` shows of it, and its item."""
        view = w.RequiredFunctionCall(arguments=call.arguments, call_id=call.call_id, name=call.name, turn_id=tid)
        item = w.FunctionCallItemOut(
            id=call.id,
            arguments=call.arguments,
            call_id=call.call_id,
            name=call.name,
            status="in_progress",
            turn_id=tid,
        )
        return view, item

    def tool_output(
        self, result: w.InputToolResult, status: Literal["completed", "failed"], tid: str
    ) -> w.FunctionCallOutputItemOut:
        """A tool result's item (a fresh `fco_` id)."""
        return w.FunctionCallOutputItemOut(
            id=self.ids.new("fco"),
            call_id=result.call_id,
            error=None if result.success else result.error,
            output=result.output if result.success else None,
            status=status,
            turn_id=tid,
        )

    def user_message(self, data: bytes, tid: str) -> w.MessageItemOut:
        """An input message's item (a fresh `msg_` id)."""
        message = msgspec.json.decode(data, type=w.MessageIn)
        return w.MessageItemOut(
            id=self.ids.new("msg"), content=message.content, role="user", status="completed", turn_id=tid
        )


Action = Callable[["SessionCore", Any], None]


class SessionCore:
    """Feed it with `receive`; after each, drain `outputs_to_send()` and act on every output in
    order. `check` validates input events against the current state without applying them."""

    def __init__(
        self,
        session_id: str,
        agent: w.AgentOut,
        *,
        ids: IdFactory,
        now: float,
        metadata: dict[str, str] | None = None,
        prompt_cache_ttl: str | None = None,
    ) -> None:
        self.id = session_id
        self.agent = agent
        self.ids = ids
        self.state = SS.IDLE
        self.created = now
        self.created_at = self.last_active_at = int(now)
        self.metadata = dict(metadata or {})
        self.prompt_cache_ttl = prompt_cache_ttl
        self.usage: w.TokenUsageOut | None = None
        self.turns: list[TurnRecord] = []
        self.items: list[tuple[str, w.SessionItem]] = []  # (turn id, item), in commit order
        self.active: TurnRecord | None = None
        self.calls: dict[str, _Call] = {}  # the active turn's registered calls, by call id
        self.paused = False
        self.steers: list[bytes] = []  # messages queued for the active turn's next step boundary
        self.last_response_id: str | None = None  # the response the next turn continues
        self.keys = IdempotencyKeys()
        self.wire = SessionWire(ids)
        self._paused_as: Response | None = None  # the running turn's response at its latest pause
        self._in_batch = False  # applying one POST's events: the step boundary waits for the whole batch
        self.revision = 0  # counts the changes the stored record has to follow
        self.error: str | None = None  # why the session failed (`SS.FAILED`)
        self._out: list[Output] = []

    # -- the public surface ------------------------------------------------------------------------

    def outputs_to_send(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    def receive(self, event: Input, *, at: float | None = None) -> None:
        if isinstance(event, ENGINE_INPUTS) and event.turn_id is not None and not self._is_active(event.turn_id):
            return  # about a turn that has ended already (cancelled): the turn's end was one step
        row = TRANSITIONS.get((self.state, type(event)))
        if row is None:
            raise AgentStateError(f"{type(event).__name__} in state {self.state.name}")
        self.revision += 1
        action, after = row
        if at is not None:
            self.last_active_at = int(at)
        self.state = after
        action(self, event)

    def _is_active(self, turn_id: str) -> bool:
        return self.active is not None and self.active.id == turn_id

    def apply(self, inputs: Sequence[Input], *, at: float | None = None) -> None:
        """One POST's input events, in order, as one step: messages that come with the results
        completing a step are committed at that boundary, after the results (rule 5)."""
        self._in_batch = True
        try:
            for event in inputs:
                self.receive(event, at=at)
        finally:
            self._in_batch = False
        if self._answered():
            self.receive(AllAnswered(), at=at)

    def _answered(self) -> bool:
        """The turn waits and every call of its step has its result."""
        waiting = self.state is SS.REQUIRES_ACTION and self.paused
        return waiting and all(c.result is not None for c in self.calls.values())

    def replayed(self, key: str | None, body: bytes) -> bool:
        """Whether a POST of input events with this Idempotency-Key was applied already
        (raises for the same key with another body)."""
        return self.keys.replayed(key, body)

    def remember(self, key: str | None, body: bytes) -> None:
        if self.keys.remember(key, body):
            self.revision += 1

    def check(self, events: Sequence[w.InputEvent]) -> None:
        """Refuse the whole batch (nothing applied) if one event cannot be taken now."""
        answered: set[str] = set()
        for index, event in enumerate(events):
            if self.state is SS.FAILED and isinstance(event, w.InputMessage):
                raise ProtocolError(
                    f"The session failed and takes no more messages ({self.error}). Create a new session.",
                    code="session_failed",
                    param=f"events[{index}]",
                )
            if isinstance(event, w.InputToolResult):
                call = self.calls.get(event.call_id)
                if self.active is None or call is None or event.turn_id != self.active.id:
                    raise unknown_call(event.call_id, index)
                if call.result is not None or event.call_id in answered:
                    raise answered_twice(event.call_id, index)
                answered.add(event.call_id)

    def response_events(self, turn_id: str, events: Sequence[ServerEvent]) -> None:
        """The running turn's Responses events, rendered as session events (rule 3 for calls);
        events of a turn that has ended (a cancelled turn's response winding down) are dropped."""
        turn = self.active
        if turn is None or turn.id != turn_id or self.state is SS.DELETED:
            return
        for ev in events:
            if isinstance(ev, OutputItemDone) and isinstance(ev.item, FunctionCall):
                self.receive(CallAdded(ev.item, ev.output_index, turn_id))
            elif isinstance(ev, ResponseDone):
                self._paused_as = ev.response  # the pause: `TurnPaused` follows
            elif (out := self.wire.response_event(ev, self.id, turn_id)) is not None:
                if isinstance(out, w.ItemDone):  # an assistant message, whole: committed
                    self.items.append((turn_id, out.item))
                    self.revision += 1
                self._out.append(Publish(out))

    def announce(self) -> None:
        """`agent.session.created`, once, before the first turn."""
        self._publish(w.SessionCreated, session=self.snapshot())

    def snapshot(self) -> w.AgentSessionOut:
        status = "idle" if self.state in (SS.IDLE, SS.DELETED) else self.state.value
        ttl = self.prompt_cache_ttl
        required = [c.view for c in self.calls.values() if c.result is None] if self.state is SS.REQUIRES_ACTION else []
        return w.AgentSessionOut(
            id=self.id,
            agent=self.agent,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            metadata=self.metadata,
            required_actions=required,
            error=self.error,
            status=status,  # type: ignore[arg-type]
            usage=self.usage,
            prompt_cache_options=None if ttl is None else w.PromptCacheOptionsOut(ttl),
        )

    def items_list(self) -> list[w.SessionItem]:
        return [item for _, item in self.items]

    def turn_view(self, turn: TurnRecord) -> w.TurnOut:
        return turn.view(self.id, self.agent.id)

    # -- actions -----------------------------------------------------------------------------------

    def _start(self, event: MessageReceived) -> None:
        """Create a turn, commit its messages, and start its response (continuing the last turn's)."""
        turn = TurnRecord(self.ids.new("turn"), self.last_active_at)
        self.turns.append(turn)
        self.active, self.calls, self.paused, self.steers = turn, {}, False, []
        self._publish(w.TurnCreated, session_id=self.id, turn=self.turn_view(turn), turn_id=turn.id)
        self._commit_messages(event.messages)
        turn.move("start")
        turn.started_at = self.last_active_at
        self._publish(w.SessionInProgress, session=self.snapshot())
        self._publish(w.TurnInProgress, session_id=self.id, turn=self.turn_view(turn), turn_id=turn.id)
        self._out.append(StartTurn(turn.id, event.messages, self.last_response_id))

    def _steer(self, event: MessageReceived) -> None:
        """Queue the messages for the active turn's next step boundary (rule 5)."""
        self.steers.extend(event.messages)

    def _call_added(self, event: CallAdded) -> None:
        """Register the call (results are accepted from now on) and announce it with `turn.item.added`."""
        turn = self.active
        assert turn is not None
        view, item = self.wire.call(event.call, turn.id)
        self.calls[view.call_id] = _Call(view, len(self.items), event.output_index)
        self.items.append((turn.id, item))
        self._publish(w.ItemAdded, item=item, output_index=event.output_index, session_id=self.id, turn_id=turn.id)

    def _tool_result(self, event: ToolResultReceived) -> None:
        """Hold the result for its call; once the turn waits and every call is answered, resume."""
        result, turn = event.result, self.active
        assert turn is not None
        call = self.calls[result.call_id]  # `check` made sure
        call.result = output_item(result.call_id, result)
        status: Literal["completed", "failed"] = "completed" if result.success else "failed"
        done = self._settle(call, status)
        self._publish(w.ItemDone, item=done, output_index=call.output_index, session_id=self.id, turn_id=turn.id)
        output = self.wire.tool_output(result, status, turn.id)
        self.items.append((turn.id, output))
        self._publish(w.ItemAdded, item=output, output_index=None, session_id=self.id, turn_id=turn.id)
        if not self._in_batch and self._answered():
            self.receive(AllAnswered())

    def _paused(self, event: TurnPaused) -> None:
        """The step ended in calls: `requires_action`, or resume at once if every result came already."""
        turn = self.active
        assert turn is not None
        missing = [r.call_id for r in event.required if r.call_id not in self.calls]
        if missing:
            raise AgentStateError(f"the turn paused for unregistered calls {missing}")
        self.paused = True
        turn.move("pause")
        if all(c.result is not None for c in self.calls.values()):
            self.receive(AllAnswered())  # every result came while the step was still running
        else:
            self._publish(w.SessionRequiresAction, session=self.snapshot(), longrun=_ext(self._paused_as))

    def _resume(self, event: AllAnswered) -> None:
        """Hand the outputs and the queued messages to the paused response; the turn runs again."""
        turn = self.active
        assert turn is not None
        outputs = tuple(c.result for c in self.calls.values() if c.result is not None)
        steers, self.steers = tuple(self.steers), []
        self.calls, self.paused = {}, False
        turn.move("resume")
        self._commit_messages(steers)
        self._publish(w.SessionInProgress, session=self.snapshot())
        self._publish(w.TurnInProgress, session_id=self.id, turn_id=turn.id, turn=self.turn_view(turn))
        self._out.append(ResumeTurn(turn.id, outputs + steers))

    def _cancel(self, event: CancelReceived) -> None:
        """End the turn `cancelled` now, and ask the adapter to stop its response. The end is this
        one step whatever the turn's task has done (it may not have run yet): what the engine says
        of the turn afterwards is dropped (`receive`)."""
        turn = self.active
        assert turn is not None
        self._out.append(CancelTurn(turn.id))
        self._ended(TurnEnded("cancelled", usage=self._paused_as.usage if self._paused_as else None))

    def _nothing(self, event: object) -> None:
        """Nothing to do."""
        return None

    def _ended(self, event: TurnEnded) -> None:
        """Close the turn (`completed`, `failed` or `cancelled`), then `idle`, or start a turn with queued messages."""
        turn = self.active
        assert turn is not None
        usage = usage_out(event.usage)
        turn.usage, turn.completed_at = usage, self.last_active_at
        self.usage = _add_usage(self.usage, usage)
        if event.stored and event.response_id is not None:
            self.last_response_id = event.response_id
        for call in self.calls.values():  # calls the turn ended without: never answered
            if call.result is None:
                self._settle(call, "incomplete")
        steers = tuple(self.steers)
        self.active, self.calls, self.paused, self.steers = None, {}, False, []
        view: Callable[[], w.TurnOut] = lambda: self.turn_view(turn)  # noqa: E731
        ext = _ext(event.response)
        self._paused_as = None
        if event.status == "completed":
            turn.move("complete")
            self._publish(w.TurnCompleted, session_id=self.id, turn=view(), turn_id=turn.id, usage=usage, longrun=ext)
        elif event.status == "cancelled":
            turn.move("cancel")
            steers = ()  # rule 6
            self._publish(w.TurnCancelled, session_id=self.id, turn=view(), turn_id=turn.id, usage=usage, longrun=ext)
        else:
            code = TURN_ERROR_CODES.get(event.reason or "", "server_error")
            message = event.message or f"The turn ended {event.status} ({event.reason or 'no reason given'})."
            turn.error = w.TurnErrorOut(code=code, message=message)
            turn.move("fail")
            error = w.SessionErrorOut(code=code, message=message, param=None, type="server_error")
            self._publish(w.ErrorEvent, error=error, session_id=self.id)
            self._publish(w.TurnFailed, session_id=self.id, turn=view(), turn_id=turn.id, usage=usage, longrun=ext)
        if event.reason == "previous_response_not_found":  # the context the next turn needs is gone
            self.state, self.error = SS.FAILED, CONTEXT_LOST.format(self.last_response_id)
            self._publish(w.SessionFailed, session=self.snapshot())
        elif steers:
            self.state = SS.IN_PROGRESS
            self._start(MessageReceived(steers))
        else:
            self._publish(w.SessionIdle, session=self.snapshot())

    def _delete_active(self, event: DeleteReceived) -> None:
        """Cancel the active turn's response; the session is gone."""
        turn = self.active
        assert turn is not None
        self._out.append(CancelTurn(turn.id))

    # -- helpers -----------------------------------------------------------------------------------

    def _settle(self, call: _Call, status: Literal["completed", "failed", "incomplete"]) -> w.FunctionCallItemOut:
        """The call's saved item, no longer `in_progress`."""
        turn_id, item = self.items[call.item]
        assert isinstance(item, w.FunctionCallItemOut)
        done = structs.replace(item, status=status)
        self.items[call.item] = (turn_id, done)
        return done

    def _commit_messages(self, messages: Sequence[bytes]) -> None:
        turn = self.active
        assert turn is not None
        for data in messages:
            item = self.wire.user_message(data, turn.id)
            self.items.append((turn.id, item))
            self._publish(w.ItemAdded, item=item, output_index=None, session_id=self.id, turn_id=turn.id)

    def _publish(self, kind: type[Any], **fields: Any) -> None:
        self._out.append(Publish(self.wire.event(kind, **fields)))


C = SessionCore
TRANSITIONS: Final[dict[tuple[SS, type], tuple[Action, SS]]] = {
    (SS.IDLE, MessageReceived): (C._start, SS.IN_PROGRESS),
    (SS.IN_PROGRESS, MessageReceived): (C._steer, SS.IN_PROGRESS),
    (SS.REQUIRES_ACTION, MessageReceived): (C._steer, SS.REQUIRES_ACTION),
    (SS.IN_PROGRESS, CallAdded): (C._call_added, SS.IN_PROGRESS),
    (SS.IN_PROGRESS, ToolResultReceived): (C._tool_result, SS.IN_PROGRESS),
    (SS.REQUIRES_ACTION, ToolResultReceived): (C._tool_result, SS.REQUIRES_ACTION),
    (SS.IN_PROGRESS, TurnPaused): (C._paused, SS.REQUIRES_ACTION),
    (SS.REQUIRES_ACTION, AllAnswered): (C._resume, SS.IN_PROGRESS),
    (SS.IDLE, CancelReceived): (C._nothing, SS.IDLE),
    (SS.IN_PROGRESS, CancelReceived): (C._cancel, SS.IDLE),
    (SS.REQUIRES_ACTION, CancelReceived): (C._cancel, SS.IDLE),
    (SS.IN_PROGRESS, TurnEnded): (C._ended, SS.IDLE),
    (SS.REQUIRES_ACTION, TurnEnded): (C._ended, SS.IDLE),
    (SS.IDLE, DeleteReceived): (C._nothing, SS.DELETED),
    (SS.IN_PROGRESS, DeleteReceived): (C._delete_active, SS.DELETED),
    (SS.REQUIRES_ACTION, DeleteReceived): (C._delete_active, SS.DELETED),
    (SS.FAILED, CancelReceived): (C._nothing, SS.FAILED),
    (SS.FAILED, DeleteReceived): (C._nothing, SS.DELETED),
    (SS.DELETED, TurnEnded): (C._nothing, SS.DELETED),
    (SS.DELETED, CancelReceived): (C._nothing, SS.DELETED),
    (SS.DELETED, TurnPaused): (C._nothing, SS.DELETED),
}
del C
