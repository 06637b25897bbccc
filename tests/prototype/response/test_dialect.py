"""A response's pause dialect (`prototype.response.dialect`) on its own: what each dialect answers
at a turn's end, what it tells the core, and which one each connection core's pause class names.
The whole run under each dialect is `test_run.py`'s; here the stream is fed by hand and the core
is a recorder."""

from __future__ import annotations

import json
from collections import deque

import pytest
from msgspec import Raw

from prototype.context.conversation import CreateRequest, Item, normalize_create, parse_items
from prototype.ids import IdFactory
from prototype.model import ItemFinished, ItemStarted, ModelRequest, SamplingFinished
from prototype.response.dialect import AppendResponse, BetaResponse, ResponseDialect, TurnEnd
from prototype.response.stream import ResponseStream, Start, StreamError
from prototype.wire.schemas import RequiredInput, Response, decode_create_params
from prototype.ws.pauses import AppendDialect, BetaDialect, CreateDialect, PauseDialect


class Core:
    """Records what a dialect tells the connection core; `handed`: what `turn_ended` returns."""

    def __init__(self, handed: tuple[Item, ...] = ()) -> None:
        self.handed = handed
        self.called_for: list[RequiredInput] = []
        self.paused_for: list[tuple[RequiredInput, ...]] = []

    def called(self, call: RequiredInput) -> None:
        self.called_for.append(call)

    def turn_ended(self) -> tuple[Item, ...]:
        return self.handed

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.paused_for.append(required)


class Deciding:
    """A `DecidesAsync` model stub: records what it was asked and answers `decision`."""

    def __init__(self, decision: bool) -> None:
        self.decision = decision
        self.asked: list[tuple[int, ...]] = []

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        self.asked.append(outstanding)
        return self.decision


class Plain:
    """A model that does not decide (no `decodes_on`)."""


def create(tools: list[dict[str, object]]) -> CreateRequest:
    body = {"model": "sim", "input": "go", "tools": tools}
    return normalize_create(decode_create_params(json.dumps(body)), websocket=True)


TOOLS = [
    {"type": "function", "name": "sync", "parameters": {"type": "object", "properties": {}}},
    {"type": "function", "name": "slow", "parameters": {"type": "object", "properties": {}}, "async": True},
]


def stream_of(dialect: ResponseDialect, *calls: str) -> ResponseStream:
    """The dialect's stream after a turn that made `calls`, each reported to the dialect as it finished."""
    template = Response(id="resp_1", created_at=1767225600, status="in_progress", model="sim")
    stream = dialect.stream(template, IdFactory(0), create(TOOLS), holds_calls=True)
    stream.receive(Start(1))
    for turn_index, name in enumerate(calls):
        stream.receive(ItemStarted("function_call", name))
        stream.receive(ItemFinished())
        dialect.item_done(stream, turn_index)
    return stream


def output_of(call_id: str) -> Item:
    (item,) = parse_items([Raw(json.dumps({"type": "function_call_output", "call_id": call_id, "output": "ok"}))])
    return item


def names(required: tuple[RequiredInput, ...]) -> list[str]:
    return [r.name for r in required]


def test_the_null_dialect_ends_owing_every_call_and_never_pauses() -> None:
    dialect = ResponseDialect()
    stream = stream_of(dialect, "sync", "slow")
    end = dialect.turn_end(stream, SamplingFinished("stop"))
    assert end.waits_for == () and names(end.owed) == ["sync", "slow"]
    assert dialect.turn_end(stream, SamplingFinished("max_output_tokens")) == TurnEnd()  # cut short: owes nothing
    assert not dialect.holds_kv and not dialect.may_decode_on(Deciding(True))  # type: ignore[arg-type]
    with pytest.raises(StreamError, match="never pauses"):
        dialect.paused(end.owed)
    with pytest.raises(StreamError, match="does not decode on"):
        dialect.turn_ended()


def test_append_waits_for_every_call_and_tells_the_core_only_when_it_pauses() -> None:
    core = Core()
    dialect = AppendResponse(core)
    stream = stream_of(dialect, "sync", "slow")
    assert core.called_for == []  # append mode reports no call before the pause
    end = dialect.turn_end(stream, SamplingFinished("stop"))
    assert names(end.waits_for) == ["sync", "slow"] and end.owed == ()
    assert dialect.turn_end(stream, SamplingFinished("max_output_tokens")) == TurnEnd()
    dialect.paused(end.waits_for)
    assert core.paused_for == [end.waits_for] and dialect.holds_kv


def test_a_pausing_dialect_needs_a_core() -> None:
    with pytest.raises(ValueError, match="needs a connection core"):
        AppendResponse()


def test_the_beta_waits_only_for_async_calls_and_a_sync_call_ends_the_response() -> None:
    core = Core()
    dialect = BetaResponse(core)
    waiting = stream_of(dialect, "slow")
    assert names(tuple(core.called_for)) == ["slow"]  # answerable from the moment it was emitted
    assert names(dialect.turn_end(waiting, SamplingFinished("stop")).waits_for) == ["slow"]
    other = BetaResponse(Core())
    end = other.turn_end(stream_of(other, "slow", "sync"), SamplingFinished("stop"))
    assert end.waits_for == () and names(end.owed) == ["sync"]


def test_the_beta_asks_a_deciding_model_about_the_turns_still_outstanding() -> None:
    core = Core()
    dialect = BetaResponse(core)
    stream_of(dialect, "slow", "slow")  # two async calls, made at turns 0 and 1
    model = Deciding(True)
    assert dialect.may_decode_on(model) and not dialect.may_decode_on(Plain())  # type: ignore[arg-type]
    requests: list[int] = []

    def next_request() -> ModelRequest:
        requests.append(1)
        return None  # type: ignore[return-value]  # the stub model does not read it

    core.handed = (output_of(core.called_for[0].call_id),)  # the first call's output came meanwhile
    assert dialect.turn_ended() == core.handed
    assert dialect.decodes_on(model, next_request) and model.asked == [(1,)] and requests == [1]
    dialect.resumed()  # every output came: nothing is outstanding, the model is not asked
    assert not dialect.decodes_on(model, next_request) and model.asked == [(1,)]


@pytest.mark.parametrize(
    ("core", "responses"),
    [(CreateDialect, ResponseDialect), (AppendDialect, AppendResponse), (BetaDialect, BetaResponse)],
)
def test_each_connection_dialect_names_the_dialect_its_responses_run_in(
    core: type[PauseDialect], responses: type[ResponseDialect]
) -> None:
    assert core(lambda out: None, deque()).responses is responses
    assert responses.name == core.name
