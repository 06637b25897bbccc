"""Limits, isolation between connections, auth and the default bind (issue 8)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.context.cache import CacheEntry
from prototype.context.conversation import Context, Item, Preamble
from prototype.model import ModelEvent, ModelRequest
from prototype.options import struct_from_args
from prototype.pipeline import Optimization
from prototype.serve.app import SLOTS, make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.server import build_parser
from prototype.store.memory import MemoryStore
from prototype.wire.requests import InputItemView
from prototype.wire.schemas import Response
from prototype.ws.connection import Connection
from prototype.ws.events import SendFrame, StartJob
from prototype.ws.lanes import CS
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from tests.support import Live, connect, last, live_server, read_response, served, turn


def create(**fields: object) -> str:
    return json.dumps({"type": "response.create", "model": "sim", "input": "hi", **fields})


def frames(outputs: Sequence[object]) -> list[dict[str, Any]]:
    return [json.loads(o.data) for o in outputs if isinstance(o, SendFrame)]


def entry(response_id: str, *, raw_bytes: int = 0, tokens: int = 0) -> CacheEntry:
    ctx = Context()
    ctx.extend([Item(b"x" * raw_bytes, InputItemView(role="user"))], [np.zeros(tokens, dtype=np.uint32)])
    return CacheEntry(
        Response(id=response_id, created_at=0, status="completed", model="sim"),
        ctx,
        1,
        Preamble(b"key", np.zeros(2, dtype=np.uint32)),
        store=False,
    )


# -- the core: queued creates and cache bytes ---------------------------------------------------------


def test_queued_creates_over_the_limit_get_a_429_and_the_connection_goes_on() -> None:
    c = Connection(max_queued=2)
    c.receive_text(create())
    [first] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    c.receive_text(create(input="q1"))
    c.receive_text(create(input="q2"))
    assert c.outputs_to_send() == [] and len(c.queue) == 2
    c.receive_text(create(input="q3"))
    [err] = frames(c.outputs_to_send())
    assert err["status"] == 429 and err["error"]["code"] == "queued_requests_limit_reached"
    assert err["error"]["type"] == "rate_limit_error" and "at most 2" in err["error"]["message"]
    assert c.state is CS.ACTIVE and len(c.queue) == 2
    c.response_ended(first, entry("resp_a"))
    assert [type(o) for o in c.outputs_to_send()] == [StartJob]
    c.receive_text(create(input="q4"))  # room again behind the one in flight
    assert c.outputs_to_send() == [] and len(c.queue) == 2


def test_queue_refusal_evicts_the_referenced_cache_entry() -> None:
    c = Connection(max_queued=0)
    c.receive_text(create())
    [job] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    c.response_ended(job, entry("resp_a"))
    c.receive_text(create(previous_response_id="resp_a"))
    c.outputs_to_send()
    c.receive_text(create(previous_response_id="resp_a"))  # nothing may wait: refused
    assert frames(c.outputs_to_send())[0]["error"]["code"] == "queued_requests_limit_reached"
    assert c.cache is None  # a failed turn evicts the id it named (docs/protocol.md)


def test_cache_entry_bytes_count_items_tokens_and_preamble() -> None:
    assert entry("resp_a", raw_bytes=100, tokens=10).nbytes == 100 + 40 + 3 + 8
    grown = entry("resp_b", raw_bytes=100, tokens=10)
    grown.context.extend([Item(b"y" * 7, InputItemView(role="user"))], [np.zeros(5, dtype=np.uint32)])
    assert grown.nbytes == 100 + 40 + 3 + 8  # the entry holds its first item only
    assert grown.context.held_bytes == 100 + 40 + 7 + 20


def test_an_entry_over_the_cache_limit_is_not_cached() -> None:
    c = Connection(max_cache_bytes=1000)
    c.receive_text(create())
    [job] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    c.response_ended(job, entry("resp_small", raw_bytes=500))
    assert c.cache is not None and c.cache.response_id == "resp_small"
    c.receive_text(create(previous_response_id="resp_small"))
    [job] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    assert job.cached is not None
    c.response_ended(job, entry("resp_big", raw_bytes=1000))
    assert c.cache is None and c.cache_refused == 1  # neither the big entry nor the one it replaced
    c.receive_text(create(previous_response_id="resp_big"))
    [job] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    assert job.cached is None and c.cache_misses == 1


# -- over real sockets --------------------------------------------------------------------------------


class GatedModel:
    """The simulator behind a gate: sampling waits until the test opens it."""

    def __init__(self, inner: SimulatedModel) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        self.entered.set()
        await self.gate.wait()
        async for event in self.inner.sample(request):
            yield event

    def release(self, conversation_id: str) -> None:
        self.inner.release(conversation_id)


@contextlib.asynccontextmanager
async def gated_server(config: ServerConfig) -> AsyncIterator[tuple[Live, GatedModel]]:
    clock = AsyncioClock()
    inner = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=0), seed=0, decode_tok_per_s=math.inf)
    model = GatedModel(inner)
    app = make_app(model=model, store=MemoryStore(), clock=clock, config=config)
    async with served(app) as port:
        yield Live(app, port, inner), model


async def test_queue_limit_over_websocket_is_an_error_event_and_the_socket_stays_open() -> None:
    async with gated_server(ServerConfig(websocket=WebSocketConfig(max_queued=1))) as (server, model):
        session, ws = await connect(server)
        async with session, ws:
            await ws.send_str(create(input="first"))
            await model.entered.wait()  # the first response is in flight, held at the gate
            await ws.send_str(create(input="queued"))
            await ws.send_str(create(input="one too many"))
            started = await read_response(ws)  # the first response's opening events, then the refusal
            refused = last(started)
            assert refused["status"] == 429 and refused["error"]["code"] == "queued_requests_limit_reached"
            assert [e["type"] for e in started[:-1]] == ["response.created", "response.in_progress"]
            model.gate.set()
            events = await read_response(ws)
            assert last(events)["type"] == "response.completed"
            assert last(await read_response(ws))["type"] == "response.completed"  # the queued one ran
            assert last(await turn(ws, input="later"))["type"] == "response.completed"


async def test_connection_limit_refuses_the_upgrade_with_503_and_a_json_body() -> None:
    async with live_server(config=ServerConfig(websocket=WebSocketConfig(max_connections=1))) as server:
        session, ws = await connect(server)
        async with session, ws:
            upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
            upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
            async with session.get(server.ws_url, headers=upgrade) as refused:
                assert refused.status == 503
                body = await refused.json()
                assert body["error"]["code"] == "too_many_connections"
                assert body["error"]["type"] == "server_error" and "at most 1" in body["error"]["message"]
            assert server.app[SLOTS].taken == 1  # the refused upgrade took no slot
            assert last(await turn(ws, input="still served"))["type"] == "response.completed"


async def test_cache_byte_limit_over_websocket_falls_back_to_the_store() -> None:
    async with live_server(config=ServerConfig(websocket=WebSocketConfig(max_cache_bytes=1))) as server:
        session, ws = await connect(server)
        async with session, ws:
            first = last(await turn(ws, input="hello", store=True))["response"]
            nxt = last(await turn(ws, input="more", store=True, previous_response_id=first["id"]))["response"]
            assert nxt["longrun"]["connection_cache"] == "miss"  # hydrated from the store, not the cache
            gone = last(await turn(ws, input="x", store=False))["response"]
            err = last(await turn(ws, input="y", store=False, previous_response_id=gone["id"]))
            assert err["error"]["code"] == "previous_response_not_found"


# -- isolation -----------------------------------------------------------------------------------------


async def test_a_connection_never_reaches_another_connections_cache() -> None:
    async with live_server(tool_calls=0) as server:
        sa, a = await connect(server)
        sb, b = await connect(server)
        async with sa, a, sb, b:
            private = last(await turn(a, input="secret plan", store=False))["response"]
            # B, while A is open and caches `private`: no cache, no store fallback.
            err = last(await turn(b, input="tell me", store=False, previous_response_id=private["id"]))
            assert err["status"] == 400 and err["error"]["code"] == "previous_response_not_found"
            err = last(await turn(b, input="tell me", store=True, previous_response_id=private["id"]))
            assert err["error"]["code"] == "previous_response_not_found"
            async with sb.get(f"{server.base_url}/responses/{private['id']}") as got:
                assert got.status == 404
            # B's failed turn evicted nothing of A's: A still continues from its cache.
            own = last(await turn(a, input="go on", store=False, previous_response_id=private["id"]))["response"]
            assert own["longrun"]["connection_cache"] == "hit"
            # store:true is the protocol's way across connections: B hydrates from the store.
            shared = last(await turn(a, input="public", store=True))["response"]
            hydrated = last(await turn(b, input="next", previous_response_id=shared["id"]))["response"]
            assert hydrated["status"] == "completed" and hydrated["longrun"]["connection_cache"] == "miss"


# -- auth and bind -------------------------------------------------------------------------------------


async def test_auth_covers_upgrade_get_and_delete() -> None:
    async with live_server(config=ServerConfig(api_key="sk-right"), tool_calls=0) as server:
        good = {"Authorization": "Bearer sk-right"}
        async with aiohttp.ClientSession() as session:
            upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
            upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
            async with session.get(server.ws_url, headers=upgrade) as refused:  # no key at all
                assert refused.status == 401
                assert (await refused.json())["error"]["code"] == "invalid_api_key"
            body = {"model": "sim", "input": "hi", "store": True}
            async with session.post(server.base_url + "/responses", json=body, headers=good) as r:
                assert r.status == 200
                rid = (await r.json())["id"]
            url = f"{server.base_url}/responses/{rid}"
            for method in ("GET", "DELETE"):
                for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
                    async with session.request(method, url, headers=headers) as r:
                        assert r.status == 401, (method, headers)
                        assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with session.get(url, headers=good) as r:
                assert r.status == 200 and (await r.json())["id"] == rid
            async with session.delete(url, headers=good) as r:
                assert r.status == 200 and (await r.json())["deleted"] is True
            async with session.get(server.base_url.removesuffix("/v1") + "/healthz") as r:
                assert r.status == 200  # outside /v1: no key needed


def test_default_bind_is_loopback_and_help_lists_the_limits() -> None:
    parser = build_parser()
    args = parser.parse_args([])
    assert args.host == "127.0.0.1"
    config = struct_from_args(args, ServerConfig)
    assert config == ServerConfig() and (config.websocket.max_queued, config.websocket.max_connections) == (64, 1024)
    text = parser.format_help()
    for option in ("--max-message-bytes", "--max-queued-creates", "--max-cache-bytes", "--max-connections"):
        assert option in text


def test_server_options_reach_the_config_tree_whole() -> None:
    """Every option is generated from `ServerConfig` and lands in its sub-struct; `none` lifts
    a limit; a list is comma-separated."""
    args = build_parser().parse_args(
        ["--max-cache-bytes", "none", "--max-queued-creates", "3", "--connection-lifetime-s", "60",
         "--context-window", "9000", "--disable", "state_cache,token_cache", "--steer-boundary", "token"]
    )  # fmt: skip
    config = struct_from_args(args, ServerConfig)
    assert config.websocket == WebSocketConfig(max_cache_bytes=None, max_queued=3, lifetime_s=60.0)
    assert config.model.context_window == 9000 and config.steer_boundary == "token"
    assert config.disable == {Optimization.STATE_CACHE, Optimization.TOKEN_CACHE}
    assert Optimization.STATE_CACHE not in config.optimizations
    with pytest.raises(msgspec.ValidationError, match="max_queued"):
        struct_from_args(build_parser().parse_args(["--max-queued-creates", "-1"]), ServerConfig)
