"""One response's run (`prototype.response.run.ResponseRun`) with no transport: one test per boundary rule.

No socket, no aiohttp, no session, no connection core: an `Engine` on a manual clock
(`sim.runtime.clock.ManualClock`: a wait jumps to its deadline), a scripted
`TokenModel` written here (its turns are fixed item by item, one token per character), and a fake
`Channel` standing in for the connection core. The fake records what the run tells the core
(`called`, `turn_ended`, `paused`) and answers from a script: the items handed over at a turn's
end, the decision that ends a pause, acknowledgements put in the run's `Inbox` at a chosen event
(as the core would while the run's send awaits). Events are read as the wire carries them
(encoded and decoded), and the rules are those of docs/beta.md and docs/protocol.md (append mode).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import pytest
from msgspec import Raw

from prototype.config import SteerBoundary
from prototype.context.conversation import CreateRequest, Item, normalize_create, parse_items
from prototype.context.tokenizer import get_tokenizer
from prototype.ids import IdFactory
from prototype.model import (
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokensSampled,
)
from prototype.response.dialect import AppendResponse, BetaResponse, ResponseDialect
from prototype.response.engine import Engine
from prototype.response.finish import Outcome
from prototype.response.run import Aborted, Inbox, Resumed
from prototype.response.stream import InjectAccepted, SteerAccepted
from prototype.store.base import StoreUnavailable
from prototype.store.memory import MemoryStore
from prototype.wire.errors import INTERNAL_ERROR
from prototype.wire.schemas import RequiredInput, ServerEvent, SteerRef, decode_create_params, decode_stored, encode
from sim.runtime.clock import ManualClock

TOOL: Final = {"type": "function", "name": "exec", "parameters": {"type": "object", "properties": {}}}
ASYNC_TOOL: Final = {**TOOL, "name": "exec_async", "async": True}
STEER: Final = SteerRef(id="steer_1", previous_response_id="resp_x")

# The connection cores' dialects by name, as their `PauseDialect.responses` name them.
DIALECTS: Final[dict[str, type[ResponseDialect]]] = {
    "create": ResponseDialect,
    "append": AppendResponse,
    "beta": BetaResponse,
}

Planned = tuple[Literal["message", "function_call"], str, str]  # (kind, function name or "", text or arguments)


def message(text: str) -> Planned:
    return ("message", "", text)


def call(name: str = "exec", arguments: str = "{}") -> Planned:
    return ("function_call", name, arguments)


class ScriptedModel:
    """A `TokenModel` that samples turn k of its script at its k-th call, one token per character.
    `fail_after`: raise after that many tokens of the first turn."""

    def __init__(self, *turns: Sequence[Planned], fail_after: int | None = None) -> None:
        self.turns = turns
        self.fail_after = fail_after
        self.requests: list[ModelRequest] = []
        self.tokens_yielded = 0
        self.closed_early = 0  # generators the service closed before `SamplingFinished`

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        self.requests.append(request)
        finished = False
        try:
            yield Prefilled(cached_tokens=0)
            for kind, name, text in self.turns[len(self.requests) - 1]:
                yield ItemStarted(kind, name)
                for char in text:
                    if self.fail_after is not None and self.tokens_yielded == self.fail_after:
                        raise RuntimeError("accelerator lost: secret detail")
                    self.tokens_yielded += 1
                    yield TokensSampled((self.tokens_yielded,), char)
                yield ItemFinished()
            finished = True
            yield SamplingFinished("stop")
        finally:
            self.closed_early += not finished

    def release(self, conversation_id: str) -> None:
        pass


class DecidingModel(ScriptedModel):
    """A `DecidesAsync` model: decodes on past its async calls when `decisions` says so, turn by turn."""

    def __init__(self, *turns: Sequence[Planned], decisions: Sequence[bool]) -> None:
        super().__init__(*turns)
        self.decisions = list(decisions)
        self.asked: list[tuple[int, tuple[int, ...]]] = []  # (turn_index, outstanding turns)

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        self.asked.append((request.turn_index, outstanding))
        return self.decisions.pop(0)


def answer_every_call(required: tuple[RequiredInput, ...]) -> Resumed | Aborted:
    return Resumed(tuple(output_of(r.call_id) for r in required))


class FakeChannel:
    """The connection core's side of a WebSocket response: records what the run tells it and
    answers from its script. `decide`: the decision put in the inbox when the run pauses for
    `required` (by default an output for each call); `hand`: what `turn_ended` returns (by
    default nothing was injected)."""

    def __init__(
        self,
        dialect: str,
        *,
        decide: Callable[[tuple[RequiredInput, ...]], Resumed | Aborted] = answer_every_call,
        hand: Callable[[FakeChannel], tuple[Item, ...]] = lambda channel: (),
    ) -> None:
        self.dialect = DIALECTS[dialect]
        self.inbox = Inbox()
        self.decide = decide
        self.hand = hand
        self.called_for: list[RequiredInput] = []
        self.turns_ended = 0
        self.paused_for: list[tuple[RequiredInput, ...]] = []
        self.queued: list[SteerRef] = []

    def called(self, call: RequiredInput) -> None:
        self.called_for.append(call)

    def turn_ended(self) -> tuple[Item, ...]:
        self.turns_ended += 1
        return self.hand(self)

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.paused_for.append(required)
        self.inbox.decide(self.decide(required))

    def steers(self) -> tuple[SteerRef, ...]:
        return tuple(self.queued)

    def steer(self, ref: SteerRef) -> None:
        """A steer queued for the response and acknowledged in its stream, as the core does."""
        self.queued.append(ref)
        self.inbox.acknowledge(SteerAccepted(ref))


class Wire:
    """The run's `emit`: every event as the client would read it. `at(n, put)`: call `put` while
    the n-th event (0-based) is being sent, as the core does when a frame arrives meanwhile."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.hooks: dict[int, Callable[[], None]] = {}

    async def emit(self, events: list[ServerEvent]) -> None:
        for event in events:
            self.events.append(json.loads(encode(event)))
            hook = self.hooks.pop(len(self.events) - 1, None)
            if hook is not None:
                hook()
            await asyncio.sleep(0)

    def at(self, n: int, put: Callable[[], None]) -> None:
        self.hooks[n] = put

    @property
    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def index(self, kind: str, nth: int = 0) -> int:
        return [i for i, t in enumerate(self.types) if t == kind][nth]

    @property
    def terminal(self) -> dict[str, Any]:
        ends = [e for e in self.events if e["type"] in ("response.completed", "response.incomplete", "response.failed")]
        assert len(ends) == 1, self.types
        response: dict[str, Any] = ends[0]["response"]
        return response

    def assert_numbered_in_order(self) -> None:
        assert [e["sequence_number"] for e in self.events] == list(range(len(self.events)))


def make_engine(model: ScriptedModel, *, store: MemoryStore | None = None, steer: SteerBoundary = "item") -> Engine:
    return Engine(
        model=model,
        store=store or MemoryStore(),
        clock=ManualClock(),
        tokenizer=get_tokenizer(),
        ids=IdFactory(1),
        steer_boundary=steer,
    )


def create(*, tools: Sequence[dict[str, Any]] = (TOOL,), **fields: Any) -> CreateRequest:
    body = {"model": "sim", "input": "Fix the failing test.", "tools": list(tools), **fields}
    return normalize_create(decode_create_params(json.dumps(body)), websocket=True)


def output_of(call_id: str, text: str = "ok") -> Item:
    (item,) = parse_items([Raw(json.dumps({"type": "function_call_output", "call_id": call_id, "output": text}))])
    return item


async def run(engine: Engine, request: CreateRequest, wire: Wire, channel: FakeChannel | None = None) -> Outcome:
    started = await engine.start(request, None, wire.emit, channel=channel)
    return started if isinstance(started, Outcome) else await started.run()


def calls_in(response: dict[str, Any]) -> list[RequiredInput]:
    return [
        RequiredInput(call_id=o["call_id"], name=o["name"]) for o in response["output"] if o["type"] == "function_call"
    ]


@pytest.mark.slow
def test_these_tests_load_no_transport() -> None:
    """A fresh interpreter imports this module: no aiohttp, no session or connection core, no
    simulated transport or accelerator (sim/ lends only its manual clock)."""
    code = "import json, sys, tests.prototype.response.test_run; print(json.dumps(sorted(sys.modules)))"
    root = Path(__file__).resolve().parents[3]  # the repository (tests.support would load aiohttp)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(done.stdout))
    transport = {
        "aiohttp",
        "prototype.serve.app",
        "prototype.ws.connection",
        "prototype.serve.session",
        "sim.model.accelerator",
        "sim.runtime.inprocess",
        "sim.runtime.virtual",
    }
    assert not loaded & transport, sorted(loaded & transport)
    assert "prototype.response.engine" in loaded  # the check sees what the module imports


# -- a turn's end -------------------------------------------------------------------------------------


class WatchedStore(MemoryStore):
    """Records what the client had been sent when the store write happened."""

    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire
        self.sent_before_write: list[str] = []

    async def put(self, response_id: str, value: bytes) -> None:
        self.sent_before_write = list(self.wire.types)
        await super().put(response_id, value)


async def test_a_turn_without_calls_completes_with_its_usage_stored_before_the_terminal_event() -> None:
    model = ScriptedModel([message("Done.")])
    wire = Wire()
    store = WatchedStore(wire)
    engine = make_engine(model, store=store)
    outcome = await run(engine, create(), wire)
    assert wire.types[:2] == ["response.created", "response.in_progress"]
    assert wire.types.count("response.output_text.delta") == 5
    assert wire.types[-1] == "response.completed"
    wire.assert_numbered_in_order()
    response = wire.terminal
    assert response["status"] == "completed" and response["output"][0]["content"][0]["text"] == "Done."
    assert response["usage"]["output_tokens"] == 5
    assert response["usage"]["input_tokens"] == model.requests[0].prompt_tokens > 0
    assert outcome.ok and outcome.owed == () and outcome.failure is None
    stored = await engine.store.get(response["id"])
    assert stored is not None and decode_stored(stored).response.status == "completed"
    assert store.sent_before_write[-1] == "response.output_item.done"  # read-after-write: stored, then told


async def test_websocket_mode_ends_completed_owing_its_calls() -> None:
    """A `create` connection never pauses: every call is the client's, owed by the completed response."""
    model = ScriptedModel([call(), call(arguments='{"x":1}')])
    channel, wire = FakeChannel("create"), Wire()
    outcome = await run(make_engine(model), create(), wire, channel)
    assert wire.types[-1] == "response.completed"
    assert outcome.owed == tuple(calls_in(wire.terminal)) and len(outcome.owed) == 2
    assert channel.paused_for == [] and channel.called_for == [] and channel.turns_ended == 0
    assert len(model.requests) == 1


# -- append: the pause --------------------------------------------------------------------------------


async def test_append_pauses_at_the_call_and_resumes_with_the_decided_items() -> None:
    model = ScriptedModel([call()], [message("Fixed.")])
    engine, wire = make_engine(model), Wire()
    channel = FakeChannel("append")
    outcome = await run(engine, create(), wire, channel)
    pause = wire.events[wire.index("response.done")]
    (required,) = channel.paused_for
    assert pause["required_input"] == [{"call_id": required[0].call_id, "name": "exec", "type": "function_call_output"}]
    assert pause["response"]["status"] == "in_progress"
    assert wire.types[wire.index("response.done") + 1] == "response.in_progress"  # the resume
    assert wire.types[-1] == "response.completed" and outcome.ok and outcome.owed == ()
    wire.assert_numbered_in_order()
    first, second = model.requests
    assert second.turn_index == first.turn_index + 1 and second.resident_tokens > 0  # its KV was held
    assert engine.statistics().pauses == 1
    stored = await engine.store.get(wire.terminal["id"])
    assert stored is not None
    kinds = [json.loads(bytes(raw))["type"] for raw in decode_stored(stored).context]
    assert kinds[-2:] == ["function_call", "function_call_output"]  # the call, then the appended output
    assert wire.terminal["usage"]["input_tokens"] == first.prompt_tokens + second.prompt_tokens


async def test_an_aborted_pause_ends_incomplete_with_the_reason() -> None:
    model = ScriptedModel([call()], [message("never sampled")])
    channel, wire = FakeChannel("append", decide=lambda required: Aborted("append_timeout")), Wire()
    outcome = await run(make_engine(model), create(), wire, channel)
    assert wire.types[-1] == "response.incomplete"
    assert wire.terminal["incomplete_details"] == {"reason": "append_timeout"}
    assert len(model.requests) == 1 and len(channel.paused_for) == 1
    assert outcome.ok and outcome.owed == ()  # an incomplete response owes nothing
    wire.assert_numbered_in_order()


# -- beta: async tools --------------------------------------------------------------------------------


async def test_beta_waits_only_for_async_calls_and_ends_owing_a_client_owned_call() -> None:
    """Both kinds in one turn: the async call is reported as emitted, the other ends the response."""
    model = ScriptedModel([call("exec_async"), call("exec")], [message("never sampled")])
    channel, wire = FakeChannel("beta"), Wire()
    outcome = await run(make_engine(model), create(tools=[ASYNC_TOOL, TOOL]), wire, channel)
    async_call, owed_call = calls_in(wire.terminal)
    assert channel.called_for == [async_call]  # its output may be injected from then on
    assert wire.types[-1] == "response.completed" and outcome.owed == (owed_call,)
    assert channel.paused_for == [] and len(model.requests) == 1


async def test_beta_waits_at_an_async_call_without_a_pause_event() -> None:
    model = ScriptedModel([call("exec_async")], [message("Fixed.")])
    channel, wire = FakeChannel("beta"), Wire()
    outcome = await run(make_engine(model), create(tools=[ASYNC_TOOL]), wire, channel)
    (async_call,) = channel.called_for
    assert channel.paused_for == [(async_call,)]
    assert channel.turns_ended == 0  # a model that does not decide (`DecidesAsync`) waits: nothing to hand over
    assert "response.done" not in wire.types  # the beta has no pause event
    assert wire.types.count("response.in_progress") == 2  # the start and the resume
    assert wire.types[-1] == "response.completed" and outcome.owed == () and len(model.requests) == 2
    wire.assert_numbered_in_order()


async def test_beta_decodes_on_past_async_calls_and_commits_what_was_handed_after_them() -> None:
    """Turn 0's output is injected during turn 1, which the model decoded on to; at turn 1's end
    the model waits (its next turn is the answer): the handed output is committed at the resume,
    ahead of the decided one."""
    model = DecidingModel([call("exec_async")], [call("exec_async")], [message("Fixed.")], decisions=[True, False])
    # turn 0's output was injected during turn 1: the core hands it over at turn 1's end
    channel = FakeChannel("beta", hand=lambda ch: (output_of(ch.called_for[0].call_id),) if ch.turns_ended == 2 else ())
    engine, wire = make_engine(model), Wire()
    outcome = await run(engine, create(tools=[ASYNC_TOOL]), wire, channel)
    one, two = channel.called_for
    assert model.asked == [(1, (0,)), (2, (1,))]  # outstanding: the turns whose outputs are not in
    assert channel.paused_for == [(two,)] and engine.statistics().pauses == 1
    assert [r.turn_index for r in model.requests] == [0, 1, 2]
    assert wire.types.count("response.in_progress") == 2  # the decode-on has no event; the resume has one
    assert wire.types[-1] == "response.completed" and outcome.owed == ()
    stored = await engine.store.get(wire.terminal["id"])
    assert stored is not None
    context = [json.loads(bytes(raw)) for raw in decode_stored(stored).context]
    assert [(c["type"], c.get("call_id")) for c in context[1:]] == [
        ("function_call", one.call_id),
        ("function_call", two.call_id),
        ("function_call_output", one.call_id),
        ("function_call_output", two.call_id),
    ]


async def test_an_inject_acknowledged_mid_decode_is_numbered_right_after_the_event_it_arrived_at() -> None:
    model = ScriptedModel([call("exec_async", '{"cmd":"make test"}')], [message("Fixed.")])
    channel, wire = FakeChannel("beta"), Wire()
    arrived_at = 6  # created, in_progress, output_item.added, then the fourth arguments delta
    wire.at(arrived_at, lambda: channel.inbox.acknowledge(InjectAccepted()))
    await run(make_engine(model), create(tools=[ASYNC_TOOL]), wire, channel)
    assert wire.types[arrived_at] == "response.function_call_arguments.delta"
    assert wire.types[arrived_at + 1] == "response.inject.created"
    assert wire.types[arrived_at + 2] == "response.function_call_arguments.delta"  # decoding went on
    assert wire.types.count("response.inject.created") == 1 and wire.types[-1] == "response.completed"
    wire.assert_numbered_in_order()


# -- steering -----------------------------------------------------------------------------------------


async def test_a_steer_queued_before_the_first_token_ends_it_before_the_model_is_called() -> None:
    model = ScriptedModel([message("never sampled")])
    channel, wire = FakeChannel("create"), Wire()
    channel.steer(STEER)
    outcome = await run(make_engine(model), create(), wire, channel)
    assert wire.types == ["response.created", "response.in_progress", "response.steer.accepted", "response.incomplete"]
    assert wire.terminal["incomplete_details"] == {"reason": "steered"} and wire.terminal["output"] == []
    assert model.requests == [] and outcome.ok
    wire.assert_numbered_in_order()


async def test_a_steer_mid_decode_lands_at_the_end_of_the_item_by_default() -> None:
    model = ScriptedModel([message("Looking."), message("never sampled")])
    channel, wire = FakeChannel("create"), Wire()
    wire.at(5, lambda: channel.steer(STEER))  # at the message's second delta
    await run(make_engine(model), create(), wire, channel)
    assert wire.types[6] == "response.steer.accepted"
    assert wire.types.count("response.output_text.delta") == len("Looking.")  # the item finished
    response = wire.terminal
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "steered"}
    assert [(o["status"], o["content"][0]["text"]) for o in response["output"]] == [("completed", "Looking.")]
    assert model.tokens_yielded == len("Looking.") and model.closed_early == 1  # no later token decoded
    wire.assert_numbered_in_order()


async def test_a_steer_mid_decode_cuts_at_the_next_token_with_the_token_boundary() -> None:
    model = ScriptedModel([message("Looking."), message("never sampled")])
    channel, wire = FakeChannel("create"), Wire()
    wire.at(5, lambda: channel.steer(STEER))
    await run(make_engine(model, steer="token"), create(), wire, channel)
    assert wire.types[5:7] == ["response.output_text.delta", "response.steer.accepted"]
    assert wire.types.count("response.output_text.delta") == 2  # none after the acknowledgement
    response = wire.terminal
    assert response["incomplete_details"] == {"reason": "steered"}
    assert [(o["status"], o["content"][0]["text"]) for o in response["output"]] == [("incomplete", "Lo")]
    assert response["longrun"]["tokens_discarded"] == 2 and model.closed_early == 1
    wire.assert_numbered_in_order()


async def test_a_steer_after_a_finished_call_waits_for_the_end_then_is_pending() -> None:
    model = ScriptedModel([call(), message("The call is yours.")])
    channel, wire = FakeChannel("create"), Wire()
    wire.at(6, lambda: channel.steer(STEER))  # at the call's output_item.done
    outcome = await run(make_engine(model), create(), wire, channel)
    assert wire.types[6:8] == ["response.output_item.done", "response.steer.accepted"]
    assert wire.types[-2:] == ["response.completed", "response.steer.pending"]  # the turn went on, then ended
    (owed,) = outcome.owed
    assert wire.events[-1]["required_input"] == [
        {"call_id": owed.call_id, "name": "exec", "type": "function_call_output"}
    ]
    assert wire.events[-1]["steer"] == {"id": STEER.id, "previous_response_id": STEER.previous_response_id}
    wire.assert_numbered_in_order()


# -- failures -----------------------------------------------------------------------------------------


class FailingStore(MemoryStore):
    async def put(self, response_id: str, value: bytes) -> None:
        raise StoreUnavailable("redis at 10.0.0.7:6379 refused the connection")


async def test_a_failed_store_write_turns_the_terminal_event_into_response_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = ScriptedModel([message("Done.")])
    wire = Wire()
    with caplog.at_level(logging.ERROR, logger="longrun.engine"):
        outcome = await run(make_engine(model, store=FailingStore()), create(), wire)
    assert wire.types[-1] == "response.failed" and "response.completed" not in wire.types
    wire.assert_numbered_in_order()  # at the terminal event's sequence number
    assert wire.terminal["error"]["code"] == "server_error"
    assert outcome.failure is not None and outcome.failure.code == "store_unavailable" and not outcome.ok
    assert "10.0.0.7" not in json.dumps(wire.events) and "Traceback" not in json.dumps(wire.events)
    assert "10.0.0.7" in caplog.text  # the details go to the log


async def test_a_model_failure_mid_decode_ends_failed_without_details(caplog: pytest.LogCaptureFixture) -> None:
    model = ScriptedModel([message("Working on it.")], fail_after=3)
    wire = Wire()
    with caplog.at_level(logging.ERROR, logger="longrun.engine"):
        outcome = await run(make_engine(model), create(), wire, FakeChannel("create"))
    assert wire.types[-1] == "response.failed" and wire.types.count("response.output_text.delta") == 3
    assert wire.terminal["error"] == {"code": "server_error", "message": INTERNAL_ERROR.message}
    assert outcome.failure is INTERNAL_ERROR and not outcome.ok
    assert "secret detail" not in json.dumps(wire.events) and "Traceback" not in json.dumps(wire.events)
    assert "secret detail" in caplog.text
    wire.assert_numbered_in_order()
