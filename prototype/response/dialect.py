"""The pause dialect of one response: one object per response, answering what its run asks about
waiting for the client (docs/protocol.md for append mode, docs/beta.md for the beta).

- `ResponseDialect`, the null dialect: a response that never waits for the client (HTTP, and
  WebSocket mode's `create`). Every call ends it owing the call's output; its KV is ordinary
  prefix cache.
- `AppendResponse`, append mode (and the Agents API's turns): a turn that ends in calls pauses the
  response until the core resumes it with their outputs; the model holds its KV meanwhile.
- `BetaResponse`, `responses_multi_agent=v1`: only async calls wait, each answerable from the
  moment it is emitted; a turn that ends in them may decode on past them (the model decides).

The connection core's pause classes (`prototype.ws.pauses`) name the dialect their responses run
in (`PauseDialect.responses`); a `run.Channel` carries it to the run, which builds one object of
it per response. The dialect keeps what is per response (the beta's unanswered async calls) and
tells the core, through the channel, what only it reports (`Pauses`); the run keeps the flow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..context.conversation import CreateRequest, Item
from ..ids import IdFactory
from ..model import DecidesAsync, ModelRequest, SamplingFinished, TokenModel
from ..wire.schemas import FunctionCall, RequiredInput, Response
from .stream import ResponseStream, StreamError

__all__ = ["AppendResponse", "BetaResponse", "Pauses", "ResponseDialect", "TurnEnd"]


class Pauses(Protocol):
    """What a pausing dialect tells the connection core (the rest of the `run.Channel`)."""

    def called(self, call: RequiredInput) -> None:
        """Beta: an async call was emitted; its output may be injected from now on."""
        ...

    def turn_ended(self) -> tuple[Item, ...]:
        """Beta: the run's turn ended in async calls; returns what was injected so far, before
        the run decides whether its model decodes on."""
        ...

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        """The response paused for `required`; the decision arrives in the channel's inbox."""
        ...


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """What a segment that finished sampling leads to: a pause for `waits_for` (not empty), or
    the response's end, owing the client the outputs of `owed`."""

    waits_for: tuple[RequiredInput, ...] = ()
    owed: tuple[RequiredInput, ...] = ()


ENDS: TurnEnd = TurnEnd()  # the response ends owing nothing


class ResponseDialect:
    """The null dialect: no response waits for the client (HTTP; WebSocket mode, where steers
    wait for the outputs of the calls the response ended with)."""

    name: ClassVar[str] = "create"
    holds_kv: ClassVar[bool] = False  # whether the model keeps the response's KV across its pauses

    __slots__ = ()

    def __init__(self, pauses: Pauses | None = None) -> None:
        """`pauses`: the response's channel to its connection core (None over HTTP)."""

    def stream(self, template: Response, ids: IdFactory, request: CreateRequest, holds_calls: bool) -> ResponseStream:
        """The response's event stream, rendering this dialect's pauses."""
        return ResponseStream(template, ids)

    def turn_end(self, stream: ResponseStream, done: SamplingFinished) -> TurnEnd:
        """Every call is the client's: the response ends owing them (unless it was cut short)."""
        return TurnEnd(owed=tuple(stream.pending_calls())) if done.reason == "stop" else ENDS

    def item_done(self, stream: ResponseStream, turn_index: int) -> None:
        """An output item finished (`stream.output[-1]`): nothing to tell the core."""

    def may_decode_on(self, model: TokenModel) -> bool:
        """Whether a turn that waits asks the model to decode on past its calls instead."""
        return False

    def decodes_on(self, model: TokenModel, next_request: Callable[[], ModelRequest]) -> bool:
        """The model's decision for the next turn, asked after `turn_ended`."""
        return False

    def turn_ended(self) -> tuple[Item, ...]:
        raise StreamError(f"a response of the {self.name} dialect does not decode on past calls")

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        raise StreamError(f"a response of the {self.name} dialect never pauses")

    def resumed(self) -> None:
        """The core resumed the response with an output for every call it waited for."""


class AppendResponse(ResponseDialect):
    """Append mode: a turn that ends in calls pauses the response; the core resumes it with
    their outputs (and appended messages) or ends it `incomplete`."""

    name = "append"
    holds_kv = True

    __slots__ = ("pauses",)

    def __init__(self, pauses: Pauses | None = None) -> None:
        if pauses is None:
            raise ValueError(f"the {self.name} dialect needs a connection core to pause with")
        self.pauses = pauses

    def stream(self, template: Response, ids: IdFactory, request: CreateRequest, holds_calls: bool) -> ResponseStream:
        multi_agent = request.params.multi_agent is not None and request.params.multi_agent.enabled
        return ResponseStream(
            template,
            ids,
            dialect=self.name,
            async_tools=frozenset(tool.name for tool in request.tools if tool.is_async),
            multi_agent=multi_agent,
            holds_calls=holds_calls,
        )

    def turn_end(self, stream: ResponseStream, done: SamplingFinished) -> TurnEnd:
        """A turn that ends in calls waits for all of them."""
        required = stream.pending_calls()
        return TurnEnd(waits_for=tuple(required)) if required and done.reason == "stop" else ENDS

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.pauses.paused(required)


class BetaResponse(AppendResponse):
    """The beta's async tools: only async calls make the response wait; any other call ends it
    (docs/beta.md). Each async call is answerable from the moment it is emitted, and the model
    may decode on past the calls of a turn instead of pausing."""

    name = "beta"

    __slots__ = ("open_calls",)

    def __init__(self, pauses: Pauses | None = None) -> None:
        super().__init__(pauses)
        self.open_calls: dict[str, int] = {}  # unanswered async calls: call_id -> the turn that made them

    def turn_end(self, stream: ResponseStream, done: SamplingFinished) -> TurnEnd:
        required, owed = stream.split_calls()
        if owed or not required or done.reason != "stop":
            return TurnEnd(owed=tuple(owed))
        return TurnEnd(waits_for=tuple(required))

    def item_done(self, stream: ResponseStream, turn_index: int) -> None:
        """A call the response waits for: its output may be injected from now on, while the
        model decodes on."""
        call = stream.output[-1]
        if isinstance(call, FunctionCall) and stream.waits(call):
            self.open_calls[call.call_id] = turn_index
            self.pauses.called(RequiredInput(call_id=call.call_id, name=call.name))

    def turn_ended(self) -> tuple[Item, ...]:
        """What the core hands over at the turn's end; the calls it answers are no longer open."""
        taken = self.pauses.turn_ended()
        for item in taken:
            if item.view.type == "function_call_output":
                self.open_calls.pop(str(item.view.call_id), None)
        return taken

    def resumed(self) -> None:
        self.open_calls.clear()  # the core resumes once every pending call has its output

    # -- decoding on past a call (docs/beta.md#async-tools-that-overlap-decoding) -------------------

    def may_decode_on(self, model: TokenModel) -> bool:
        """Only a model that decides (`DecidesAsync`) is asked."""
        return isinstance(model, DecidesAsync)

    def decodes_on(self, model: TokenModel, next_request: Callable[[], ModelRequest]) -> bool:
        """The model's decision (`DecidesAsync.decodes_on`) for the next turn, given the turns
        whose outputs are still outstanding. Nothing outstanding: the pause resumes at once, as
        when every output came during the turn. The request is the next turn's as the context
        stands (its calls in; what was handed over joins it if the model decodes on)."""
        outstanding = tuple(sorted(set(self.open_calls.values())))
        if not outstanding or not isinstance(model, DecidesAsync):
            return False
        return model.decodes_on(next_request(), outstanding)
