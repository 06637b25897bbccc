"""The server on each persistent store, and a model that fails mid-stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prototype.model import ItemStarted, ModelEvent, ModelRequest, TokensSampled
from prototype.serve.app import ENGINE
from prototype.store.redis import RedisStore
from prototype.store.sqlite import SqliteStore
from tests.support import EXEC_TOOL, Live, live_server, receive_event


async def post(live: Live, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(live.base_url + "/responses", json=body) as r:
        return r.status, await r.json()


async def chain_across_servers(make_store: Any) -> None:
    """A response created on one server process is retrievable and chainable on another."""
    async with live_server(store=make_store(), tool_calls=2) as a:
        _, first = await post(a, {"model": "sim", "input": "fix it", "tools": [EXEC_TOOL]})
    call = first["output"][0]
    fco = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
    # Another process draws other ids (prototype/server.py ids randomly on a persistent store).
    async with live_server(store=make_store(), tool_calls=2, seed=1) as b:
        async with aiohttp.ClientSession() as s, s.get(f"{b.base_url}/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json()) == {k: v for k, v in first.items() if k != "longrun"}
        status, second = await post(
            b, {"model": "sim", "input": [fco], "previous_response_id": first["id"], "tools": [EXEC_TOOL]}
        )
        assert status == 200 and second["status"] == "completed"
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        assert second["id"] != first["id"]
        async with aiohttp.ClientSession() as s, s.get(f"{b.base_url}/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["id"] == first["id"]  # not overwritten


async def test_sqlite_store_survives_a_server_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    await chain_across_servers(lambda: SqliteStore(path))


@pytest.mark.redis
async def test_redis_store_serves_http_prev_across_servers(redis_server: str) -> None:
    await chain_across_servers(lambda: RedisStore(redis_server))


class Exploding:
    """A TokenModel whose accelerator dies after two tokens."""

    async def sample(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        yield ItemStarted("message")
        yield TokensSampled((1,), "a")
        yield TokensSampled((2,), "b")
        raise RuntimeError("accelerator fell over (secret detail)")


async def test_mid_stream_failure_ends_with_response_failed_and_no_detail() -> None:
    async with live_server() as live:
        live.app[ENGINE].model = Exploding()
        async with aiohttp.ClientSession() as s:
            async with s.post(live.base_url + "/responses", json={"model": "m", "input": "x", "stream": True}) as r:
                text = await r.text()
            frames = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
            assert [f["type"] for f in frames][-1] == "response.failed"
            assert frames[-1]["response"]["error"]["code"] == "server_error"
            assert "secret" not in text and "Traceback" not in text
            assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
            async with s.post(live.base_url + "/responses", json={"model": "m", "input": "x"}) as r:
                assert r.status == 500 and (await r.json())["error"]["code"] == "server_error"
            # WebSocket: response.failed, the referenced id is evicted, the socket stays usable
            async with s.ws_connect(live.ws_url) as ws:
                await ws.send_str(json.dumps({"type": "response.create", "model": "m", "input": "x"}))
                types = []
                while not types or types[-1] not in ("response.failed", "response.completed"):
                    types.append((await receive_event(ws))["type"])
                assert types[-1] == "response.failed"
                await ws.send_str(
                    json.dumps({"type": "response.create", "model": "m", "input": "x", "generate": False})
                )
                assert (await receive_event(ws))["type"] == "response.created"
