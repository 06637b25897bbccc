"""The official openai-python SDK (AsyncOpenAI) against the real server on loopback.

Each transport drives the same 10-turn agent loop (turns 1-9 call `exec_command`,
turn 10 answers in text) twice: chained with `previous_response_id` (only new
items sent) and resending the full history every turn. The key invariant: with
the same seed, the model sees the same tokens whatever the transport and however
the context arrived, so every variant produces, turn by turn, the same calls,
arguments, final text and `usage.input_tokens` as a non-streaming chained
baseline run on the same server. (The SDK serializes WebSocket frames with
`json.dumps` spacing and HTTP bodies compactly; the server renders tool schemas
canonically so that whitespace never reaches the prompt.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.responses.responses_server_event import ResponseWsError

from tests.support import EXEC_TOOL, Live, Seen, live_server

MODEL: Final = "sim"
SEED: Final = 7
TOOL_CALLS: Final = 9
TURNS: Final = TOOL_CALLS + 1
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
FIRST_INPUT: Final[list[dict[str, Any]]] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}
]
TERMINAL: Final = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
REQUEST_TIMEOUT_S: Final = 10.0
"""Per-request bound: the simulator is unpaced, so a turn takes milliseconds."""
CONVERSATION_TIMEOUT_S: Final = 20.0
"""Upper bound on a whole test body, so a wedged stream fails instead of hanging."""

Items = list[dict[str, Any]]


@dataclass(frozen=True)
class Turn:
    """One model turn as a client saw it: the final Response and, if streamed, its events."""

    response: Any  # openai Response (a ParsedResponse for the stream helper, an unchecked model over WS)
    events: list[Any] | None = None


TurnFn = Callable[[Items, "str | None"], Awaitable[Turn]]


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=TOOL_CALLS, seed=SEED) as server:
        yield server


@pytest.fixture
async def client(live: Live) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


# -- one turn per transport -------------------------------------------------------------------------


def _common(input_items: Items, prev: str | None, **extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": MODEL, "input": input_items, "tools": [EXEC_TOOL], **extra}
    if prev is not None:
        kw["previous_response_id"] = prev
    return kw


def create_turn(client: AsyncOpenAI) -> TurnFn:
    async def turn(input_items: Items, prev: str | None) -> Turn:
        return Turn(await client.responses.create(**_common(input_items, prev)))

    return turn


def sse_turn(client: AsyncOpenAI) -> TurnFn:
    async def turn(input_items: Items, prev: str | None) -> Turn:
        stream = await client.responses.create(stream=True, **_common(input_items, prev))
        async with stream:
            events = [ev async for ev in stream]
        assert events, "empty SSE stream"
        terminal = events[-1]
        assert terminal.type == "response.completed", terminal
        return Turn(terminal.response, events)

    return turn


def helper_turn(client: AsyncOpenAI) -> TurnFn:
    async def turn(input_items: Items, prev: str | None) -> Turn:
        # The accumulator raises if output_item.added / content_part.added are missing.
        async with client.responses.stream(**_common(input_items, prev)) as stream:
            events = [ev async for ev in stream]
            final = await stream.get_final_response()
        assert events and events[-1].type == "response.completed", events[-1:]
        completed = events[-1].response
        assert final.id == completed.id
        assert final.status == completed.status
        assert [_dump(i) for i in final.output] == [_dump(i) for i in completed.output]
        return Turn(final, events)

    return turn


def ws_turn(conn: Any, *, store: bool) -> TurnFn:
    async def turn(input_items: Items, prev: str | None) -> Turn:
        await conn.response.create(**_common(input_items, prev, store=store))
        events = await read_ws_response(conn)
        terminal = events[-1]
        assert terminal.type == "response.completed", terminal
        return Turn(terminal.response, events)

    return turn


async def read_ws_response(conn: Any) -> list[Any]:
    """Events up to and including the terminal one (`recv()`, so no async generator is left open)."""
    events = []
    while True:
        ev = await asyncio.wait_for(conn.recv(), REQUEST_TIMEOUT_S)
        events.append(ev)
        if ev.type in TERMINAL:
            return events


# -- the agent loop -----------------------------------------------------------------------------------


def fake_output(turn: int, arguments: str) -> str:
    cmd = json.loads(arguments)["cmd"]
    return f"$ {cmd}\nProcess exited with code 0\nOutput:\nline {turn}.1\nline {turn}.2\n"


def _dump(item: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = item.model_dump(mode="json", exclude_none=True)
    return dumped


async def drive(turn_fn: TurnFn, *, chained: bool, turns: int = TURNS) -> list[Turn]:
    """Run the agent loop: answer every call with a function_call_output, stop after `turns` turns."""
    history: Items = list(FIRST_INPUT)  # everything the model has seen so far, as the client holds it
    new_items: Items = list(FIRST_INPUT)
    prev: str | None = None
    result: list[Turn] = []
    for k in range(1, turns + 1):
        t = await turn_fn(new_items if chained else history, prev if chained else None)
        check_turn(k, t, prev if chained else None, result[-1] if result else None)
        result.append(t)
        resp = t.response
        if k == turns:
            break
        call = resp.output[-1]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": fake_output(k, call.arguments)}
        history = [*history, *(_dump(i) for i in resp.output), output]
        new_items = [output]
        prev = resp.id
    return result


def check_turn(k: int, t: Turn, prev: str | None, before: Turn | None) -> None:
    resp = t.response
    assert resp.status == "completed", (k, resp.status, resp.error)
    assert resp.id.startswith("resp_")
    assert resp.previous_response_id == prev
    assert len(resp.output) == 1, (k, resp.output)
    item = resp.output[0]
    assert item.status == "completed"
    if k <= TOOL_CALLS:
        assert item.type == "function_call", (k, item)
        assert item.name == "exec_command"
        assert item.id.startswith("fc_") and item.call_id.startswith("call_")
        arguments = json.loads(item.arguments)
        assert isinstance(arguments, dict) and isinstance(arguments.get("cmd"), str), item.arguments
    else:
        assert item.type == "message", (k, item)
        assert item.role == "assistant"
        assert _text(item).strip(), item
    usage = resp.usage
    assert usage is not None
    assert usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    if before is not None:
        assert usage.input_tokens > before.response.usage.input_tokens, k
        assert resp.id != before.response.id
    if t.events is not None:
        check_events(t.events)


def check_events(events: list[Any]) -> None:
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert sum(ev.type in TERMINAL for ev in events) == 1
    done = [_dump(ev.item) for ev in events if ev.type == "response.output_item.done"]
    assert done == [_dump(i) for i in events[-1].response.output]
    added = [ev.output_index for ev in events if ev.type == "response.output_item.added"]
    assert added == list(range(len(done)))


def _text(item: Any) -> str:
    return "".join(part.text for part in item.content if part.type == "output_text")


def seen(turns: list[Turn]) -> list[Seen]:
    out = []
    for t in turns:
        item = t.response.output[-1]
        is_call = item.type == "function_call"
        out.append(
            Seen(
                kind=item.type,
                name=item.name if is_call else None,
                arguments=item.arguments if is_call else None,
                text=None if is_call else _text(item),
                input_tokens=t.response.usage.input_tokens,
                output_tokens=t.response.usage.output_tokens,
            )
        )
    return out


def assert_same(expected: list[Seen], got: list[Seen], what: str) -> None:
    assert len(got) == len(expected), what
    for k, (e, g) in enumerate(zip(expected, got, strict=True), start=1):
        assert g == e, f"{what}: turn {k} differs"


# -- conversations per transport ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["create", "sse", "stream_helper"])
async def test_http_conversation_chained_and_full_resend_agree(client: AsyncOpenAI, transport: str) -> None:
    make = {"create": create_turn, "sse": sse_turn, "stream_helper": helper_turn}[transport]
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        baseline = seen(await drive(create_turn(client), chained=True))
        chained = seen(await drive(make(client), chained=True))
        resend = seen(await drive(make(client), chained=False))
    assert [s.kind for s in baseline] == ["function_call"] * TOOL_CALLS + ["message"]
    assert_same(baseline, chained, f"{transport} chained vs non-streaming chained")
    assert_same(baseline, resend, f"{transport} full resend vs non-streaming chained")


@pytest.mark.slow
async def test_websocket_conversation_chained_and_full_resend_agree(client: AsyncOpenAI) -> None:
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        baseline = seen(await drive(create_turn(client), chained=True))
        # store=False: continuation can only come from the connection-local cache.
        async with client.responses.connect() as conn:
            chained_turns = await drive(ws_turn(conn, store=False), chained=True)
        async with client.responses.connect() as conn:
            resend_turns = await drive(ws_turn(conn, store=False), chained=False)
    chained = seen(chained_turns)
    assert [s.kind for s in chained] == ["function_call"] * TOOL_CALLS + ["message"]
    assert_same(chained, seen(resend_turns), "ws full resend vs ws chained")
    assert_same(baseline, chained, "ws chained vs non-streaming chained")
    cached = [t.response.usage.input_tokens_details.cached_tokens for t in chained_turns]
    assert cached[0] < cached[1]  # turn 1 may hit the prefix cache of earlier conversations on this server
    assert all(c > 0 for c in cached[1:]), cached


@pytest.mark.slow
async def test_same_seed_same_tokens_on_another_server(client: AsyncOpenAI) -> None:
    """A second server with the same seed: SSE chained on one equals a stream-helper full resend on the other."""
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        sse = seen(await drive(sse_turn(client), chained=True))
        async with (
            live_server(tool_calls=TOOL_CALLS, seed=SEED) as other,
            AsyncOpenAI(api_key="sk-test", base_url=other.base_url, max_retries=0, timeout=REQUEST_TIMEOUT_S) as c2,
        ):
            helper = seen(await drive(helper_turn(c2), chained=False))
    assert_same(sse, helper, "server A sse chained vs server B stream-helper full resend")


# -- stored responses and errors ----------------------------------------------------------------------


async def test_retrieve_then_delete(client: AsyncOpenAI) -> None:
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        created: Any = (await create_turn(client)(FIRST_INPUT, None)).response
        streamed = (await sse_turn(client)(FIRST_INPUT, None)).response
        for original in (created, streamed):
            got = await client.responses.retrieve(original.id)
            assert got.id == original.id
            assert got.status == "completed"
            assert [_dump(i) for i in got.output] == [_dump(i) for i in original.output]
            assert got.usage is not None and got.usage.input_tokens == original.usage.input_tokens

        await client.responses.delete(created.id)  # the SDK returns None
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
        # A deleted response can no longer be continued.
        call = created.output[0]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
        with pytest.raises(openai.BadRequestError) as excinfo:
            await client.responses.create(**_common([output], created.id))
        assert excinfo.value.code == "previous_response_not_found"
        # The other stored response is untouched.
        assert (await client.responses.retrieve(streamed.id)).id == streamed.id


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_previous_response_id_is_bad_request(client: AsyncOpenAI, stream: bool) -> None:
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        with pytest.raises(openai.BadRequestError) as excinfo:
            await client.responses.create(**_common(list(FIRST_INPUT), "resp_doesnotexist", stream=stream))
    err = excinfo.value
    assert err.status_code == 400
    assert err.code == "previous_response_not_found"
    assert isinstance(err.body, dict)
    assert err.body["code"] == "previous_response_not_found"
    assert err.body["param"] == "previous_response_id"
    assert err.body["type"] == "invalid_request_error"


async def test_ws_store_false_id_is_unknown_on_a_new_connection(client: AsyncOpenAI) -> None:
    """openai-python 3.57 surfaces a WS `error` event as a `ResponseWsError` from recv()/iteration
    (no exception); the socket stays usable and a full resend then succeeds."""
    async with asyncio.timeout(CONVERSATION_TIMEOUT_S):
        async with client.responses.connect() as conn:
            baseline = seen(await drive(ws_turn(conn, store=False), chained=True, turns=2))
        async with client.responses.connect() as conn:
            first = await ws_turn(conn, store=False)(FIRST_INPUT, None)
        call = first.response.output[0]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": fake_output(1, call.arguments)}

        async with client.responses.connect() as conn:
            await conn.response.create(**_common([output], first.response.id, store=False))
            events = await read_ws_response(conn)
            assert len(events) == 1, events
            err = events[0]
            assert isinstance(err, ResponseWsError), err
            assert err.type == "error"
            assert err.status == 400
            assert err.error.code == "previous_response_not_found"
            assert err.error.param == "previous_response_id"
            assert err.error.type == "invalid_request_error"

            history = [*FIRST_INPUT, *(_dump(i) for i in first.response.output), output]
            second = await ws_turn(conn, store=False)(history, None)
        check_turn(2, second, None, first)

        # store=False was never persisted: HTTP cannot see or continue it either.
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.response.id)
        with pytest.raises(openai.BadRequestError) as excinfo:
            await client.responses.create(**_common([output], first.response.id))
        assert excinfo.value.code == "previous_response_not_found"
    assert_same(baseline, seen([first, second]), "ws recovery vs ws chained")
