"""`sim.client.websocket`: each WebSocket mode's driver over a scripted socket (no server): the
frames each sends, where each ends a turn, and the public methods a reconnecting client uses
(`forget_pause`, `WSSocket.reopen`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import pytest

from prototype.wire.schemas import (
    FunctionCall,
    OutputItemDone,
    RequiredInput,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ServerEvent,
    encode,
)
from sim.client.client import WS_DRIVERS, open_client, ws_client
from sim.client.lanes import TextSocket
from sim.client.steer import SteerDriver
from sim.client.websocket import AppendDriver, AsyncDriver, ChainDriver, InjectDriver, WSClient, WSSocket, share_socket
from sim.rollout.result import WS_MODES, Mode
from sim.runtime.virtual import VirtualClock, run_virtual

TOOL = {"type": "function", "name": "exec", "parameters": {}}
SETTINGS: dict[str, Any] = {"model": "sim", "tools": [TOOL]}
TASK = [{"type": "message", "role": "user", "content": "go"}]
OUTPUT = [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}]


def _response(rid: str, status: str = "in_progress") -> Response:
    return Response(id=rid, created_at=0, status=status, model="sim")


def _call(*, is_async: bool) -> FunctionCall:
    call = FunctionCall(id="fc_1", status="completed", arguments="{}", call_id="call_1", name="exec")
    return msgspec.structs.replace(call, is_async=True) if is_async else call


class _Wire:
    """A `TextSocket` whose server answers each frame with the next scripted events."""

    def __init__(self, replies: list[list[ServerEvent]]) -> None:
        self.replies = replies
        self.sent: list[dict[str, Any]] = []
        self.inbox: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self.closed = 0

    async def send_str(self, data: str) -> None:
        self.sent.append(json.loads(data))
        for event in self.replies.pop(0):
            self.inbox.put_nowait(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, encode(event).decode(), None))

    async def receive(self) -> aiohttp.WSMessage:
        return await self.inbox.get()

    async def close(self) -> None:
        self.closed += 1


class _Scripted(WSSocket):
    def __init__(self, mode: Mode, replies: list[list[ServerEvent]]) -> None:
        super().__init__("http://example.test/v1", VirtualClock(), mode=mode)
        self.wire = _Wire(replies)
        self.connects = 0

    async def connect(self) -> TextSocket:
        self.connects += 1
        return self.wire


def _driver(mode: Mode, replies: list[list[ServerEvent]]) -> tuple[WSClient, _Wire]:
    socket = _Scripted(mode, replies)
    return ws_client(socket), socket.wire


@pytest.mark.parametrize("mode", WS_MODES)
def test_each_websocket_mode_has_its_own_driver_and_dialect(mode: Mode) -> None:
    expected = {"ws": ChainDriver, "append": AppendDriver, "inject": InjectDriver, "async": AsyncDriver}
    client = open_client(mode, "https://example.test/v1", VirtualClock())
    assert type(client) is expected.get(mode, SteerDriver) is WS_DRIVERS[mode]
    assert isinstance(client, WSClient) and client.mode == mode
    query = {"ws": "", "append": "?mode=append"}.get(mode, "?mode=beta")
    assert client.socket.url == "wss://example.test/v1/responses" + query


def test_a_mode_without_a_websocket_is_refused() -> None:
    with pytest.raises(ValueError, match="'http' is not a WebSocket mode"):
        WSSocket("http://example.test", VirtualClock(), mode="http")


def test_ws_chains_each_create_to_the_last_response() -> None:
    client, wire = _driver("ws", [[ResponseCompleted(sequence_number=0, response=_response("r1", "completed"))]] * 2)

    async def go() -> None:
        await client.turn(TASK, **SETTINGS)
        await client.turn(OUTPUT, **SETTINGS)

    run_virtual(go, charge_cpu=False)
    assert [(f["type"], f["previous_response_id"]) for f in wire.sent] == [
        ("response.create", None),
        ("response.create", "r1"),
    ]
    assert wire.sent[0]["tools"] == [TOOL] and "parallel_tool_calls" not in wire.sent[0]


def test_append_resumes_the_paused_response_and_creates_after_forget_pause() -> None:
    paused = [
        ResponseCreated(sequence_number=0, response=_response("r1")),
        ResponseDone(sequence_number=1, response=_response("r1"), required_input=[RequiredInput("call_1", "exec")]),
    ]
    client, wire = _driver("append", [paused, paused, paused])

    async def go() -> list[str]:
        first = await client.turn(TASK, **SETTINGS)
        assert client.paused_id == "r1" and first.response.id == "r1"
        await client.turn(OUTPUT, **SETTINGS)
        client.forget_pause()
        await client.turn(OUTPUT, **SETTINGS)
        return [frame["type"] for frame in wire.sent]

    assert run_virtual(go, charge_cpu=False) == ["response.create", "response.append", "response.create"]
    assert wire.sent[1] == {"type": "response.append", "response_id": "r1", "input": OUTPUT}
    assert wire.sent[2]["previous_response_id"] == "r1"


@pytest.mark.parametrize("mode", ["inject", "async"])
def test_the_beta_ends_a_turn_at_an_async_call_and_injects_the_outputs(mode: Mode) -> None:
    created = ResponseCreated(sequence_number=0, response=_response("r1"))
    plain = OutputItemDone(sequence_number=1, output_index=0, item=_call(is_async=False))
    waits = OutputItemDone(sequence_number=2, output_index=0, item=_call(is_async=True))
    done = ResponseCompleted(sequence_number=3, response=_response("r1", "completed"))
    client, wire = _driver(mode, [[created, plain, waits], [done]])

    async def go() -> None:
        first = await client.turn(TASK, **SETTINGS)
        assert first.response.status == "in_progress" and client.paused_id == "r1"
        assert first.events == 3  # a call not declared async does not end the turn
        last = await client.turn(OUTPUT, **SETTINGS)
        assert last.response.status == "completed" and client.paused_id is None

    run_virtual(go, charge_cpu=False)
    create, inject = wire.sent
    assert create["tools"] == [{**TOOL, "async": True}]
    assert create.get("parallel_tool_calls") == (False if mode == "inject" else None)  # async: calls overlap
    assert inject == {"type": "response.inject", "response_id": "r1", "input": OUTPUT}


def test_reopen_closes_the_socket_and_opens_the_next() -> None:
    socket = _Scripted("ws", [[ResponseCompleted(sequence_number=0, response=_response("r1", "completed"))]])
    client = ws_client(socket)

    async def go() -> None:
        await client.turn(TASK, **SETTINGS)
        await socket.reopen()

    run_virtual(go, charge_cpu=False)
    assert socket.connects == 2 and socket.wire.closed == 1 and socket.ws is socket.wire


def test_shared_socket_lanes_name_their_stream_in_each_create() -> None:
    sockets = [_Scripted("ws", []) for _ in range(3)]
    clients = [ws_client(socket) for socket in sockets]
    shared = share_socket(clients)
    assert all(socket.lanes is shared for socket in sockets)
    body = sockets[2].create(SETTINGS, TASK, None)
    assert body["stream_id"] == "lane-2" and list(body)[-1] == "stream_id"
