"""Faults over real loopback sockets: disconnects, a Redis outage, a slow consumer (a restart on
SQLite and several processes are in test_processes.py).

Cleanup is checked by awaiting the server's own tasks (every task started since the
client connected) and then looking at what is left: tasks, sessions, open model
loops, pinned KV and decode slots. No wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web_protocol

from prototype.config import ServerConfig, WebSocketConfig
from prototype.context.tokenizer import get_tokenizer
from prototype.model import ModelEvent, ModelRequest
from prototype.serve.app import ENGINE, SOCKETS, WebSocketSession
from prototype.serve.wallclock import AsyncioClock
from prototype.store.redis import RedisStore
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy, PlannedItem, ScriptPolicy
from tests.processes import RedisProcess
from tests.support import EXEC_TOOL, Live, live_server

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "response.done", "error"}
SETTLE_TIMEOUT_S = 30.0
"""Bound on awaiting the server's tasks: turns a leaked task into a failure instead of a hang."""


class Tracked:
    """Wraps the simulator: counts open `sample` loops and records which task closed each one."""

    def __init__(self, inner: SimulatedModel) -> None:
        self.inner = inner
        self.open = 0
        self.closed_elsewhere = 0  # loops finalized by a task other than the one that ran them

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        runner = asyncio.current_task()
        self.open += 1
        try:
            async with contextlib.aclosing(self.inner.sample(request)) as events:
                async for event in events:
                    yield event
        finally:
            self.open -= 1
            if asyncio.current_task() is not runner:
                self.closed_elsewhere += 1

    def release(self, conversation_id: str) -> None:
        self.inner.release(conversation_id)


@contextlib.asynccontextmanager
async def paced_server(**kw: Any) -> AsyncGenerator[tuple[Live, Tracked], None]:
    """A live server whose model decodes 100 tokens/s on one decode slot, wrapped in `Tracked`."""
    async with live_server(**kw) as live:
        model = SimulatedModel(
            clock=AsyncioClock(), policy=DefaultPolicy(tool_calls=3), decode_tok_per_s=100.0, decode_slots=1
        )
        tracked = Tracked(model)
        live.app[ENGINE].model = tracked
        yield live, tracked


async def settle(before: set[asyncio.Task[Any]]) -> None:
    """Await every task started since `before`: the server's handlers and whatever they spawned."""
    me = asyncio.current_task()
    while new := asyncio.all_tasks() - before - {me}:
        _, pending = await asyncio.wait(new, timeout=SETTLE_TIMEOUT_S)
        assert not pending, f"server tasks still running: {pending}"


async def read_until(
    ws: aiohttp.ClientWebSocketResponse, stop: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    events = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        events.append(json.loads(msg.data))
        if stop(events[-1]):
            return events


def of_type(*types: str) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["type"] in types


def outputs_for(done: dict[str, Any]) -> list[dict[str, str]]:
    return [{"type": "function_call_output", "call_id": r["call_id"], "output": "ok"} for r in done["required_input"]]


async def send(ws: aiohttp.ClientWebSocketResponse, **frame: Any) -> None:
    await ws.send_str(json.dumps(frame))


# -- disconnects -----------------------------------------------------------------------------------


async def ws_mid_stream(live: Live, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(live.ws_url) as ws:
        await send(ws, type="response.create", model="sim", input="write", store=False)
        await read_until(ws, of_type("response.output_text.delta"))


async def append_mid_stream(live: Live, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(live.ws_url + "?mode=append") as ws:
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL], store=False)
        await read_until(ws, of_type("response.function_call_arguments.delta"))


async def append_mid_pause(live: Live, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(live.ws_url + "?mode=append") as ws:
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL], store=False)
        await read_until(ws, of_type("response.done"))


async def append_mid_append(live: Live, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(live.ws_url + "?mode=append") as ws:
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL], store=False)
        done = (await read_until(ws, of_type("response.done")))[-1]
        await send(ws, type="response.append", input=outputs_for(done))
        resumed = await read_until(ws, of_type("response.function_call_arguments.delta"))
        assert resumed[0]["type"] == "response.in_progress"  # the resumed segment is sampling now


async def sse_mid_stream(live: Live, session: aiohttp.ClientSession) -> None:
    body = {"model": "sim", "input": "write", "stream": True, "store": False}
    async with session.post(live.base_url + "/responses", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"response.output_text.delta"' in line:
                break


@pytest.mark.slow
@pytest.mark.parametrize(
    "disconnect", [ws_mid_stream, append_mid_stream, append_mid_pause, append_mid_append, sse_mid_stream]
)
async def test_disconnect_cancels_sampling_and_frees_everything(
    disconnect: Callable[[Live, aiohttp.ClientSession], Awaitable[None]],
) -> None:
    async with paced_server() as (live, model):
        before = asyncio.all_tasks()
        async with aiohttp.ClientSession() as session:
            await disconnect(live, session)  # returns with the socket closed by the client
        await settle(before)
        assert model.open == 0  # every sampling loop stopped ...
        assert model.closed_elsewhere == 0  # ... closed by the response's own task, not by the GC later
        assert model.inner.statistics().kv.pinned_blocks == 0  # append's held KV released
        assert not live.app[SOCKETS]
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, WebSocketSession)]  # with its cache and pause
        # The decode slot is free at once: the next request does not queue behind the dropped turn.
        async with aiohttp.ClientSession() as session:
            body = {"model": "sim", "input": "next", "max_output_tokens": 16, "store": False}
            async with session.post(live.base_url + "/responses", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["longrun"]["stages_s"]["queue"] == 0.0


@pytest.mark.parametrize("ending", ["append_timeout", "connection_limit"])
async def test_pause_timeout_and_lifetime_limit_release_the_held_kv(ending: str) -> None:
    # The server's real timers: long enough that the pause's KV is still held when the client has
    # read `response.done` (a process's first request, or a loaded machine, takes a few hundred ms).
    config = (
        ServerConfig(websocket=WebSocketConfig(append_timeout_s=1.0))
        if ending == "append_timeout"
        else ServerConfig(websocket=WebSocketConfig(lifetime_s=1.5))
    )
    async with live_server(config=config, tool_calls=3) as live:  # unpaced: the pause comes at once
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(live.ws_url + "?mode=append") as ws:
                await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL], store=False)
                await read_until(ws, of_type("response.done"))
                assert live.model.statistics().kv.pinned_blocks > 0  # held across the pause
                end = (await read_until(ws, of_type("response.incomplete")))[-1]  # the server's timer fires
                assert end["response"]["incomplete_details"] == {"reason": ending}
                assert live.model.statistics().kv.pinned_blocks == 0
                assert live.app[ENGINE].statistics().kv_idle_token_s > 0


# -- Redis outage ----------------------------------------------------------------------------------

STORE_DOWN = {
    "type": "server_error",
    "code": "store_unavailable",
    "message": "The response store is unavailable. Please retry.",
    "param": None,
}


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.redis
async def test_redis_outage_is_a_clear_503_and_the_server_recovers(redis_process: RedisProcess) -> None:
    async with (
        live_server(store=RedisStore(redis_process.url), tool_calls=0) as live,
        aiohttp.ClientSession() as session,
    ):
        url = live.base_url + "/responses"

        async def post(body: dict[str, Any]) -> tuple[int, str]:
            async with session.post(url, json={"model": "sim", "input": "x", **body}) as resp:
                return resp.status, await resp.text()

        status, text = await post({})
        assert status == 200
        first = json.loads(text)["id"]

        redis_process.stop()
        for body in ({}, {"previous_response_id": first}):  # the write after sampling; the load before
            status, text = await post(body)
            assert (status, json.loads(text)) == (503, {"error": STORE_DOWN}), text
        for method in (session.get, session.delete):
            async with method(f"{url}/{first}") as resp:
                assert (resp.status, await resp.json()) == (503, {"error": STORE_DOWN})
        status, text = await post({"stream": True})  # after the stream started: response.failed
        events = sse_events(text)
        assert status == 200 and events[-1]["type"] == "response.failed"
        # Response.error.code is a closed set: server_error, with the store's message.
        assert events[-1]["response"]["error"] == {"code": "server_error", "message": STORE_DOWN["message"]}
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "Traceback" not in text and str(redis_process.port) not in text
        assert (await post({"store": False}))[0] == 200  # what needs no store keeps working

        async with session.ws_connect(live.ws_url) as ws:
            await send(ws, type="response.create", model="sim", input="x")
            failed = (await read_until(ws, of_type(*TERMINAL)))[-1]
            assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "server_error"
            await send(ws, type="response.create", model="sim", input="x", previous_response_id=first)
            error = (await read_until(ws, of_type(*TERMINAL)))[-1]
            assert error == {"type": "error", "status": 503, "error": STORE_DOWN}
            redis_process.start()  # back (empty: the fixture's redis keeps nothing on disk)
            await send(ws, type="response.create", model="sim", input="x")  # the same socket recovers
            assert (await read_until(ws, of_type(*TERMINAL)))[-1]["type"] == "response.completed"

        status, text = await post({})
        assert status == 200
        second = json.loads(text)["id"]
        async with session.get(f"{url}/{second}") as resp:
            assert resp.status == 200
        status, _ = await post({"previous_response_id": second})
        assert status == 200


@pytest.mark.redis
async def test_redis_lost_under_an_agents_session_is_a_503_then_a_404_never_a_session_stuck(
    redis_process: RedisProcess,
) -> None:
    """docs/agents-api.md#sessions-in-the-store: Redis stops while a session's turn waits for a
    tool result, then comes back empty. Every answer is the API's error (503 while it is down,
    404 once the session is gone), and a new session works on the same server."""
    beta = {"OpenAI-Beta": "agents=v1"}
    tool = {key: EXEC_TOOL[key] for key in ("type", "name", "description", "parameters")}
    body = {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [tool]}, "input": "go"}
    async with (
        live_server(store=RedisStore(redis_process.url), tool_calls=1) as live,
        aiohttp.ClientSession() as session,
    ):
        base = live.base_url + "/agents/sessions"
        async with session.post(base, headers=beta, json={**body, "stream": True}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: ") and b'"agent.session.requires_action"' in line:
                    waiting = json.loads(line[6:])["session"]
                    break
        (call,) = waiting["required_actions"]
        result = {"type": "agent.session.input.tool_result", "success": True, "output": "ok"}
        result |= {"turn_id": call["turn_id"], "call_id": call["call_id"]}
        redis_process.stop()
        async with session.post(f"{base}/{waiting['id']}/events", headers=beta, json={"events": [result]}) as resp:
            text = await resp.text()
            assert (resp.status, json.loads(text)) == (503, {"error": STORE_DOWN})
        async with session.get(f"{base}/{waiting['id']}", headers=beta) as resp:
            assert (resp.status, await resp.json()) == (503, {"error": STORE_DOWN})
        async with session.post(base, headers=beta, json=body) as resp:
            assert (resp.status, await resp.json()) == (503, {"error": STORE_DOWN})
        redis_process.start()  # back, empty
        for path in ("", "/turns", "/items"):
            async with session.get(f"{base}/{waiting['id']}{path}", headers=beta) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        async with session.post(base, headers=beta, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:  # the new session's turn runs to its tool call
                assert b"Traceback" not in line and str(redis_process.port).encode() not in line
                if b'"agent.session.requires_action"' in line:
                    break
            else:
                raise AssertionError("the new session's stream ended before its turn paused")


# -- slow consumer ---------------------------------------------------------------------------------

SLOW_TOKENS = 60_000
"""A reply of about 11 MB of delta frames: more than the kernel buffers between the two sockets
(the client's receive buffer is pinned small below; the server's send buffer is at most 4 MiB)."""
SERVER_BUFFER_BOUND = 1 << 20
"""Bytes the server may hold for a socket that does not drain: aiohttp writes up to its
256 KiB chunk limit past the transport's 64 KiB high-water mark, then waits for the drain."""


def small_receive_buffer(addr_info: Any) -> socket.socket:
    """The client's socket with a 64 KiB receive buffer (no autotuning to tens of MB)."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return sock


def record_drain_waits(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], asyncio.Event]:
    """The server's write-buffer bytes each time a writer had to wait for the peer, and an
    event set at the first such wait."""
    waits: list[int] = []
    waited = asyncio.Event()
    drain_helper = web_protocol.RequestHandler._drain_helper

    async def record_and_drain(self: web_protocol.RequestHandler) -> None:
        if self._paused and self.transport is not None:
            waits.append(self.transport.get_write_buffer_size())
            waited.set()
        await drain_helper(self)

    monkeypatch.setattr(web_protocol.RequestHandler, "_drain_helper", record_and_drain)
    return waits, waited


@pytest.mark.slow
async def test_slow_websocket_consumer_is_bounded_then_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    waits, waited = record_drain_waits(monkeypatch)
    text = "word " * SLOW_TOKENS
    policy = ScriptPolicy([PlannedItem("message", "", text)])
    connector = aiohttp.TCPConnector(socket_factory=small_receive_buffer)
    async with live_server(policy=policy) as live, aiohttp.ClientSession(connector=connector) as session:
        async with session.ws_connect(live.ws_url) as ws:
            await send(ws, type="response.create", model="sim", input="a long answer", store=False)
            await asyncio.wait_for(waited.wait(), SETTLE_TIMEOUT_S)  # the client reads nothing until the server waits
            assert live.model.statistics().output_tokens < len(get_tokenizer().encode_list(text)) / 2  # not run ahead
            events = await read_until(ws, of_type(*TERMINAL))
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = sum(e["type"] == "response.output_text.delta" for e in events)
    assert deltas == events[-1]["response"]["usage"]["output_tokens"] == len(get_tokenizer().encode_list(text))
    assert waits and max(waits) <= SERVER_BUFFER_BOUND


@pytest.mark.slow
async def test_slow_sse_consumer_is_bounded_then_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same over HTTP streaming: SSE frames are batched per wake-up (`BatchedSSE`) and a
    batch waits for the peer to drain, so a client that reads nothing holds the server to a bound."""
    waits, waited = record_drain_waits(monkeypatch)
    text = "word " * SLOW_TOKENS
    policy = ScriptPolicy([PlannedItem("message", "", text)])
    connector = aiohttp.TCPConnector(socket_factory=small_receive_buffer)
    body = {"model": "sim", "input": "a long answer", "store": False, "stream": True}
    async with live_server(policy=policy) as live, aiohttp.ClientSession(connector=connector) as session:
        async with session.post(f"{live.base_url}/responses", json=body) as resp:
            assert resp.status == 200
            await asyncio.wait_for(waited.wait(), SETTLE_TIMEOUT_S)  # the client reads nothing until the server waits
            assert live.model.statistics().output_tokens < len(get_tokenizer().encode_list(text)) / 2  # not run ahead
            raw = await resp.read()
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text and len(deltas) == events[-1]["response"]["usage"]["output_tokens"]
    assert waits and max(waits) <= SERVER_BUFFER_BOUND
