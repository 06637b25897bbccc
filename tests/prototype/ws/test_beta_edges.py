"""The beta's inject edges as OpenAI's material states them (docs/beta.md): an inject that does
not conform to its schema gets a 400 `error` and the server closes the socket; an inject takes
client-owned tool outputs only (the SDK's docstring), messages being the `inject_messages`
what-if, off by default."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.ws.pauses import CLOSE_BAD_INJECT
from tests import strict
from tests.support import Live, beta_socket, live_server, receive_event, until
from tests.support import beta_create as create

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=3, seed=4) as server:
        yield server


async def _waiting(ws: aiohttp.ClientWebSocketResponse) -> tuple[str, dict[str, Any]]:
    """Create a response and read to its async call: its id and a good output for the call."""
    await ws.send_str(create(input="Fix the failing test."))
    events = await until(ws, "response.output_item.done")
    call = events[-1]["item"]
    assert call["type"] == "function_call" and call["async"] is True
    return events[0]["response"]["id"], {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}


async def _closed(ws: aiohttp.ClientWebSocketResponse) -> int | None:
    msg = await ws.receive(timeout=10)
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING), msg
    return ws.close_code


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param({"type": "response.inject", "response_id": 7, "input": []}, id="response_id-not-a-string"),
        pytest.param({"type": "response.inject", "input": "x"}, id="input-not-a-list"),
        pytest.param(
            {"type": "response.inject", "response_id": "RID", "input": [{"type": "function_call_output"}]},
            id="item-missing-fields",
        ),
    ],
)
async def test_a_schema_invalid_inject_gets_a_400_and_the_socket_is_closed(
    live: Live, wire: strict.Checker, frame: dict[str, Any]
) -> None:
    async with aiohttp.ClientSession() as session, await beta_socket(session, live) as ws:
        rid, _ = await _waiting(ws)
        await ws.send_str(json.dumps(frame).replace('"RID"', json.dumps(rid)))
        error = await until(ws, "error")
        assert error[-1]["status"] == 400 and error[-1]["error"]["type"] == "invalid_request_error"
        assert await _closed(ws) == CLOSE_BAD_INJECT
    assert not wire.violations


async def test_an_inject_takes_tool_outputs_only(live: Live, wire: strict.Checker) -> None:
    message = {"type": "message", "role": "user", "content": "also check CI"}
    async with aiohttp.ClientSession() as session, await beta_socket(session, live) as ws:
        rid, good = await _waiting(ws)
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good, message]}))
        error = await receive_event(ws)
        assert error["type"] == "error" and error["error"]["code"] == "invalid_value"
        assert error["error"]["param"] == "input[1]"
        # The socket stays open and nothing was committed: the output alone resumes the response.
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good]}))
        assert (await receive_event(ws))["type"] == "response.inject.created"
        assert (await until(ws, "response.in_progress"))[-1]["type"] == "response.in_progress"
    assert not wire.violations


async def test_the_inject_messages_what_if_commits_messages() -> None:
    config = ServerConfig(websocket=WebSocketConfig(inject_messages=True))
    message = {"type": "message", "role": "user", "content": "also check CI"}
    async with live_server(tool_calls=3, seed=4, config=config) as live:
        async with aiohttp.ClientSession() as session, await beta_socket(session, live) as ws:
            rid, good = await _waiting(ws)
            await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good, message]}))
            assert (await receive_event(ws))["type"] == "response.inject.created"


def test_the_what_if_is_off_by_default() -> None:
    assert WebSocketConfig().inject_messages is False
    assert ServerConfig().websocket.inject_messages is False
