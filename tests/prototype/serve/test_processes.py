"""Server processes: a restart on SQLite, and two processes on one port sharing a Redis store.

Each server is `python -m prototype.server` in a subprocess (`processes.start_server`:
readiness is its stdout line, a watchdog bounds its life, it is always killed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from prototype.server import PID_HEADER
from tests.processes import free_port as _free_port
from tests.processes import start_server
from tests.support import EXEC_TOOL

TERMINAL: Final = {"response.completed", "response.failed", "response.incomplete", "error"}
MAX_FRESH_CONNECTIONS: Final = 64
"""Turns over fresh connections until both processes have answered; the kernel spreads
SO_REUSEPORT connections by a hash of the 4-tuple, so all 64 landing on one process has
probability 2**-63."""


async def ws_turn(ws: aiohttp.ClientWebSocketResponse, **body: Any) -> dict[str, Any]:
    await ws.send_str(json.dumps({"type": "response.create", "model": "sim", **body}))
    while True:
        event: dict[str, Any] = json.loads((await ws.receive(timeout=30)).data)
        if event["type"] in TERMINAL:
            return event


def tool_output(response: dict[str, Any]) -> list[dict[str, str]]:
    return [{"type": "function_call_output", "call_id": response["output"][0]["call_id"], "output": "ok"}]


@pytest.mark.slow
async def test_sqlite_restart_keeps_stored_responses_and_drops_connection_caches(tmp_path: Path) -> None:
    args = ("--port", "0", "--tps", "0", "--tool-calls", "3", "--store", f"sqlite:{tmp_path / 'responses.sqlite3'}")
    with start_server(*args) as before:
        async with aiohttp.ClientSession() as session, session.ws_connect(before.base_url + "/responses") as ws:
            kept = (await ws_turn(ws, input="kept", tools=[EXEC_TOOL], store=True))["response"]
            unkept = (await ws_turn(ws, input="not kept", tools=[EXEC_TOOL], store=False))["response"]
        assert before.terminate() == 0, before.log
    assert kept["status"] == unkept["status"] == "completed"

    with start_server(*args) as after:  # the same seed: stored ids must not be reissued
        url = after.base_url + "/responses"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/{unkept['id']}") as resp:
                assert resp.status == 404
            async with session.ws_connect(url) as ws:
                hydrated = await ws_turn(
                    ws, input=tool_output(kept), previous_response_id=kept["id"], tools=[EXEC_TOOL]
                )
                assert hydrated["type"] == "response.completed", hydrated
                assert hydrated["response"]["longrun"]["connection_cache"] == "miss"  # loaded from the store
                assert hydrated["response"]["usage"]["input_tokens"] > kept["usage"]["input_tokens"]
                assert hydrated["response"]["id"] not in (kept["id"], unkept["id"])
                error = await ws_turn(ws, input=tool_output(unkept), previous_response_id=unkept["id"])
                assert error["status"] == 400 and error["error"]["code"] == "previous_response_not_found"
            async with session.get(f"{url}/{kept['id']}") as resp:  # survived the restart and the new writes
                assert resp.status == 200
                assert await resp.json() == {k: v for k, v in kept.items() if k != "longrun"}


@pytest.mark.slow
@pytest.mark.redis
async def test_two_processes_on_one_port_share_http_prev_through_redis(redis_server: str) -> None:
    port = str(_free_port())
    args = ("--port", port, "--reuse-port", "--tps", "0", "--tool-calls", "1000", "--store", redis_server)
    with start_server(*args) as one, start_server(*args) as two:
        pids = {one.proc.pid, two.proc.pid}
        base = f"http://127.0.0.1:{port}/v1"
        served: list[tuple[str, str]] = []  # (process, response id), in order
        previous: dict[str, Any] | None = None
        for _ in range(MAX_FRESH_CONNECTIONS):
            body: dict[str, Any] = {"model": "sim", "tools": [EXEC_TOOL], "input": "fix the test"}
            if previous is not None:
                body |= {"input": tool_output(previous), "previous_response_id": previous["id"]}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.post(base + "/responses", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    previous = await resp.json()
                    pid = resp.headers[PID_HEADER]
            assert previous is not None and previous["status"] == "completed"
            served.append((pid, previous["id"]))
            if len(served) >= 2 and served[-1][0] != served[-2][0]:
                break
        # A response created on one process was continued on the other, and every turn chained.
        assert served[-1][0] != served[-2][0], served
        assert {int(p) for p, _ in served} == pids
        assert previous is not None and previous["usage"]["input_tokens"] > 0
        assert len(previous["tools"]) == 1 and previous["previous_response_id"] == served[-2][1]

        # A WebSocket stays on the process that accepted it: a chain on its connection cache.
        async with aiohttp.ClientSession() as session, session.ws_connect(base + "/responses") as ws:
            upgrade_pid = ws._response.headers[PID_HEADER]
            assert int(upgrade_pid) in pids
            first = (await ws_turn(ws, input="go", tools=[EXEC_TOOL], store=False))["response"]
            second = await ws_turn(
                ws, input=tool_output(first), previous_response_id=first["id"], tools=[EXEC_TOOL], store=False
            )
            assert second["type"] == "response.completed"
            assert second["response"]["longrun"]["connection_cache"] == "hit"
        assert one.terminate() == 0 and two.terminate() == 0


@pytest.mark.slow
@pytest.mark.redis
async def test_two_processes_on_one_port_share_agents_sessions_through_redis(redis_server: str) -> None:
    """docs/agents-api.md#sessions-in-the-store: one id space, and a session created on one process
    is read (and listed) on the other."""
    port = str(_free_port())
    args = ("--port", port, "--reuse-port", "--tps", "0", "--tool-calls", "0", "--store", redis_server)
    beta = {"OpenAI-Beta": "agents=v1"}
    body = {"environment": {"type": "none"}, "agent": {"model": "sim"}, "input": "hi"}
    with start_server(*args) as one, start_server(*args) as two:
        pids = {one.proc.pid, two.proc.pid}
        base = f"http://127.0.0.1:{port}/v1/agents/sessions"
        created: dict[str, int] = {}  # session id -> the process that created it
        read_by: dict[str, set[int]] = {}
        for _ in range(MAX_FRESH_CONNECTIONS):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.post(base, headers=beta, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    created[(await resp.json())["id"]] = int(resp.headers[PID_HEADER])
            if set(created.values()) == pids:
                break
        assert set(created.values()) == pids and len(created) == len(set(created))
        for _ in range(MAX_FRESH_CONNECTIONS):
            for sid in created:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                    async with session.get(f"{base}/{sid}", headers=beta) as resp:
                        assert resp.status == 200 and (await resp.json())["id"] == sid
                        read_by.setdefault(sid, set()).add(int(resp.headers[PID_HEADER]))
            if all(len(by) == 2 for by in read_by.values()):
                break
        # Each session was read on the process that did not create it too.
        assert all(by == pids for by in read_by.values()), read_by
        async with aiohttp.ClientSession() as session, session.get(f"{base}?limit=100", headers=beta) as resp:
            assert {s["id"] for s in (await resp.json())["data"]} == set(created)
        assert one.terminate() == 0 and two.terminate() == 0
