"""Agents API sessions through the real routes: a cancel that races a message, the runner's own
copy of the last context, sessions kept by the store (a restart, a second process, a store that
lost them). docs/agents-api.md#sessions-in-the-store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import msgspec
import pytest
import redis.asyncio

from prototype.agents.record import decode_record, session_key
from prototype.config import AgentsConfig, ServerConfig
from prototype.serve.app import AGENTS
from prototype.store.memory import MemoryStore
from prototype.store.redis import RedisStore
from prototype.store.sqlite import SqliteStore
from sim.model.policy import PlannedItem, ScriptPolicy
from tests.processes import start_server
from tests.support import EXEC_COMMAND_SCHEMA, live_server

BETA: Final = {"OpenAI-Beta": "agents=v1"}
TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": EXEC_COMMAND_SCHEMA,
}
MESSAGE: Final = {
    "type": "agent.session.input.message",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "go on"}]}],
}
CANCEL: Final = {"type": "agent.session.input.cancel"}
PAIRS: Final = 100

pytestmark = pytest.mark.timeout(120)


def _create(**extra: Any) -> dict[str, Any]:
    return {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [TOOL]}, "input": "hi", **extra}


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            data = b"\n".join(line[6:] for line in frame.split(b"\n") if line.startswith(b"data: "))
            yield json.loads(data)


class Client:
    """The raw routes of one server, each answer's status checked where it is asserted."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http, self.base = http, base_url + "/agents/sessions"

    async def create(self, **extra: Any) -> dict[str, Any]:
        """A session whose first turn has ended (read from its create stream), and that turn's events."""
        async with self.http.post(self.base, headers=BETA, json=_create(stream=True, **extra)) as resp:
            assert resp.status == 200, await resp.text()
            events = [event async for event in _events(resp)]
        return {"id": events[0]["session"]["id"], "events": events}

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.base + path, headers=BETA) as resp:
            return resp.status, await resp.json()

    async def post(self, sid: str, *events: dict[str, Any]) -> tuple[int, bytes]:
        async with self.http.post(f"{self.base}/{sid}/events", headers=BETA, json={"events": list(events)}) as resp:
            return resp.status, await resp.read()

    async def turn(self, sid: str, *events: dict[str, Any]) -> list[dict[str, Any]]:
        """Post `events` with a subscription open, and read until the session is idle, failed or
        waiting for a tool result."""
        async with self.http.get(f"{self.base}/{sid}/events", headers=BETA) as stream:
            assert stream.status == 200, await stream.text()  # a refused stream ends at once, no events
            status, body = await self.post(sid, *events)
            assert status == 202, body
            seen = []
            async for event in _events(stream):
                seen.append(event)
                if event["type"] in ("agent.session.idle", "agent.session.failed", "agent.session.requires_action"):
                    return seen
        raise AssertionError(f"the stream ended before the session was idle: {seen}")

    async def until_idle(self, sid: str) -> dict[str, Any]:
        async with self.http.get(f"{self.base}/{sid}/events", headers=BETA) as stream:
            assert stream.status == 200, await stream.text()
            status, session = await self.get(f"/{sid}")
            assert status == 200
            if session["status"] in ("idle", "failed"):
                return session
            async for event in _events(stream):
                if event["type"] in ("agent.session.idle", "agent.session.failed"):
                    return event["session"]
        raise AssertionError("the stream ended before the session was idle")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # No pool limit: a hundred clients each hold a stream open while they post.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), connector=connector) as session:
        yield session


def _ended(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in events if e["type"].startswith("agent.session.turn.") and "longrun" in e)


# -- no wedged session ---------------------------------------------------------------------------------


async def test_a_hundred_message_and_cancel_pairs_leave_no_session_wedged(http: aiohttp.ClientSession) -> None:
    async with live_server(tool_calls=0, seed=3) as live:
        client = Client(http, live.base_url)
        sids = [s["id"] for s in await asyncio.gather(*(client.create() for _ in range(PAIRS)))]
        half = PAIRS // 2
        # Half as one POST of [message, cancel]; half as two clients posting them at the same moment.
        answers = await asyncio.gather(
            *(client.post(sid, MESSAGE, CANCEL) for sid in sids[:half]),
            *(client.post(sid, MESSAGE) for sid in sids[half:]),
            *(client.post(sid, CANCEL) for sid in sids[half:]),
        )
        assert {status for status, _ in answers} == {202}
        for sid in sids:
            assert (await client.until_idle(sid))["status"] == "idle"
        # Every session takes its next message and runs the turn to its end.
        ends = await asyncio.gather(*(client.turn(sid, MESSAGE) for sid in sids))
        assert all(_ended(events)["type"] == "agent.session.turn.completed" for events in ends)
        for sid in sids[:half]:  # the turn the cancel reached before its first step: cancelled, in order
            status, turns = await client.get(f"/{sid}/turns?order=asc")
            assert status == 200 and [t["status"] for t in turns["data"]] == ["completed", "cancelled", "completed"]


# -- the runner's own context ----------------------------------------------------------------------------


async def test_a_sessions_next_turn_is_served_from_the_runners_copy_even_when_the_store_lost_it(
    http: aiohttp.ClientSession,
) -> None:
    async with live_server(tool_calls=0, seed=3) as live:
        client = Client(http, live.base_url)
        session = await client.create()
        first = _ended(session["events"])["longrun"]["response"]
        assert first["longrun"]["connection_cache"] == "none"
        second = _ended(await client.turn(session["id"], MESSAGE))["longrun"]["response"]
        assert second["previous_response_id"] == first["id"]
        assert second["longrun"]["connection_cache"] == "hit"  # not reloaded from the store
        async with http.delete(f"{live.base_url}/responses/{second['id']}") as resp:
            assert resp.status == 200
        third = _ended(await client.turn(session["id"], MESSAGE))
        assert third["type"] == "agent.session.turn.completed"
        assert third["longrun"]["response"]["longrun"]["connection_cache"] == "hit"


async def test_a_session_without_a_copy_whose_context_is_gone_fails_and_says_so(http: aiohttp.ClientSession) -> None:
    config = ServerConfig(agents=AgentsConfig(max_idle_sessions=0))  # no idle runner kept: no copy
    async with live_server(tool_calls=0, seed=3, config=config) as live:
        client = Client(http, live.base_url)
        session = await client.create()
        first = _ended(session["events"])["longrun"]["response"]
        async with http.delete(f"{live.base_url}/responses/{first['id']}") as resp:
            assert resp.status == 200
        events = await client.turn(session["id"], MESSAGE)
        assert [e["type"] for e in events][-2:] == ["agent.session.turn.failed", "agent.session.failed"]
        status, view = await client.get(f"/{session['id']}")
        assert status == 200 and view["status"] == "failed" and first["id"] in view["error"]
        status, body = await client.post(session["id"], MESSAGE)  # refused, not a 202 that never runs
        assert status == 400 and json.loads(body)["error"]["code"] == "session_failed"


# -- sessions in the store ---------------------------------------------------------------------------------


async def _answered_session(client: Client, **extra: Any) -> dict[str, Any]:
    """A session whose first turn called the tool, got its result, and completed."""
    async with client.http.post(client.base, headers=BETA, json=_create(stream=True, **extra)) as resp:
        sid = ""
        async for event in _events(resp):
            if event["type"] == "agent.session.created":
                sid = event["session"]["id"]
            if event["type"] == "agent.session.requires_action":
                (call,) = event["session"]["required_actions"]
                result = {"type": "agent.session.input.tool_result", "success": True, "output": "ok"}
                status, _ = await client.post(sid, {**result, "turn_id": call["turn_id"], "call_id": call["call_id"]})
                assert status == 202
    status, view = await client.get(f"/{sid}")
    assert status == 200 and view["status"] == "idle"
    return view


async def _paused_session(client: Client) -> dict[str, Any]:
    """A session whose turn waits for a tool result."""
    async with client.http.post(client.base, headers=BETA, json=_create(stream=True)) as resp:
        async for event in _events(resp):
            if event["type"] == "agent.session.requires_action":
                return dict(event["session"])
    raise AssertionError("the turn did not pause")


async def _everything(client: Client, sid: str) -> dict[str, Any]:
    out = {}
    for path in ("", "/turns?order=asc", "/items?order=asc"):
        status, body = await client.get(f"/{sid}{path}")
        assert status == 200, body
        out[path] = body
    return out


@pytest.mark.slow
async def test_a_kill_and_restart_on_sqlite_keeps_every_session_and_ends_the_turn_it_ran(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    args = ("--port", "0", "--tps", "0", "--tool-calls", "1", "--store", f"sqlite:{tmp_path / 'store.sqlite3'}")
    with start_server(*args, "--agents-lease-s", "0.2") as before:
        client = Client(http, before.base_url)
        done = [await _answered_session(client) for _ in range(3)]
        kept = {view["id"]: await _everything(client, view["id"]) for view in done}
        paused = await _paused_session(client)
        before.proc.kill()  # kill -9: no shutdown
        before.proc.wait()
    with start_server(*args, "--agents-lease-s", "0.2") as after:
        client = Client(http, after.base_url)
        for sid, seen in kept.items():  # every completed turn and item, as read before the kill
            assert await _everything(client, sid) == seen
            calls = [i for i in seen["/items?order=asc"]["data"] if i["type"] == "function_call"]
            assert [c["status"] for c in calls] == ["completed"]
        # The turn the killed process ran is no half-written turn: ended failed, the session usable.
        status, view = await client.get(f"/{paused['id']}")
        assert status == 200 and view["status"] == "idle" and view["required_actions"] == []
        status, turns = await client.get(f"/{paused['id']}/turns")
        assert [t["status"] for t in turns["data"]] == ["failed"]
        assert "stopped before it ended" in turns["data"][0]["error"]["message"]
        events = await client.turn(paused["id"], MESSAGE)  # a new turn, which calls the tool again
        assert events[-1]["type"] == "agent.session.requires_action"
        # Ids are random on a store that outlives the process: a new start reissues none.
        fresh = await _paused_session(client)
        assert fresh["id"] not in {*kept, paused["id"]}
        status, listed = await client.get("?limit=100")
        assert {s["id"] for s in listed["data"]} == {*kept, paused["id"], fresh["id"]}


async def test_two_servers_on_one_sqlite_file_share_sessions(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    path = str(tmp_path / "store.sqlite3")
    await _two_servers_share_sessions(lambda: SqliteStore(path), http)


@pytest.mark.redis
async def test_two_servers_on_one_redis_share_sessions(redis_server: str, http: aiohttp.ClientSession) -> None:
    await _two_servers_share_sessions(lambda: RedisStore(redis_server), http)


async def _two_servers_share_sessions(make_store: Any, http: aiohttp.ClientSession) -> None:
    """What a client sees from a process that does not run a session's turn (docs/agents-api.md)."""
    async with (
        live_server(tool_calls=1, random_ids=True, store=make_store()) as one,
        live_server(tool_calls=1, random_ids=True, store=make_store()) as two,
    ):
        a, b = Client(http, one.base_url), Client(http, two.base_url)
        paused = await _paused_session(a)
        (call,) = paused["required_actions"]
        status, view = await b.get(f"/{paused['id']}")  # read from the store
        assert status == 200 and view["status"] == "requires_action" and view["required_actions"] == [call]
        result = {"type": "agent.session.input.tool_result", "success": True, "output": "ok"}
        result |= {"turn_id": call["turn_id"], "call_id": call["call_id"]}
        status, body = await b.post(paused["id"], result)  # the turn runs on the other process
        assert status == 409 and json.loads(body)["error"]["code"] == "session_active_elsewhere"
        async with http.get(f"{b.base}/{paused['id']}/events", headers=BETA) as resp:
            assert resp.status == 409
        assert (await a.post(paused["id"], result))[0] == 202
        await a.until_idle(paused["id"])
        # Idle: either process may run its next turn; the other reads it from the store.
        events = await b.turn(paused["id"], MESSAGE)
        assert _ended(events)["type"] == "agent.session.turn.completed"
        assert _ended(events)["longrun"]["response"]["longrun"]["connection_cache"] == "miss"  # b has no copy
        assert await _everything(a, paused["id"]) == await _everything(b, paused["id"])
        status, turns = await a.get(f"/{paused['id']}/turns")
        assert [t["status"] for t in turns["data"]] == ["completed", "completed"]
        other = await _paused_session(b)
        for client in (a, b):
            status, listed = await client.get("")
            assert {s["id"] for s in listed["data"]} == {paused["id"], other["id"]}


class HeldStore(MemoryStore):
    """A memory store whose next write of a key that starts with a prefix waits until the test
    releases it: a save in flight for as long as the test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}  # prefix -> (entered, released)

    def hold(self, prefix: str) -> tuple[asyncio.Event, asyncio.Event]:
        self.holds[prefix] = (asyncio.Event(), asyncio.Event())
        return self.holds[prefix]

    async def _wait(self, key: str) -> None:
        prefix = next((p for p in self.holds if key.startswith(p)), None)
        if prefix is not None:
            entered, released = self.holds.pop(prefix)
            entered.set()
            await released.wait()

    def stored(self, key: str) -> bytes | None:
        """What the store holds now, read without yielding to the event loop."""
        return self._entries.get(key)

    async def put(self, response_id: str, value: bytes) -> None:
        await self._wait(response_id)
        await super().put(response_id, value)

    async def swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        await self._wait(key)
        return await super().swap(key, expected, value)


async def test_a_read_answers_what_is_stored_when_the_turn_ends_during_its_save(http: aiohttp.ClientSession) -> None:
    """The read's save of the running turn is in flight when the turn ends: the read answers only
    once the end is stored too, so another process reading the store after it never sees less."""
    store = HeldStore()
    async with live_server(tool_calls=1, store=store) as live:
        client, api = Client(http, live.base_url), live.app[AGENTS]
        paused = await _paused_session(client)
        runner = api.runners[paused["id"]]
        (call,) = paused["required_actions"]
        result = {"type": "agent.session.input.tool_result", "success": True, "output": "ok"}
        result |= {"turn_id": call["turn_id"], "call_id": call["call_id"]}
        # The resumed turn stops at storing its response, just before it ends.
        response_entered, response_released = store.hold("resp_")
        assert (await client.post(paused["id"], result))[0] == 202
        await response_entered.wait()
        assert runner.core.active is not None and runner.core.revision != runner.saved_revision  # unsaved
        (turn,) = runner.tasks.values()
        # A read saves what it answers; that save is held while the turn ends.
        save_entered, save_released = store.hold(session_key(paused["id"]))

        async def read() -> tuple[dict[str, Any], dict[str, Any]]:
            reply = await api.retrieve(paused["id"])
            stored = decode_record(store.stored(session_key(paused["id"])) or b"")  # at the moment it answers
            return json.loads(reply.body), json.loads(msgspec.json.encode(stored.session))

        reading = asyncio.create_task(read())
        await save_entered.wait()
        response_released.set()
        await asyncio.wait({turn})
        assert runner.core.active is None  # the turn has ended; its end is not stored yet
        save_released.set()
        answered, stored = await reading
        assert answered["status"] == stored["status"] == "idle"
        assert answered == stored


@pytest.mark.redis
async def test_a_redis_that_lost_its_sessions_answers_404_not_a_session_that_fails(
    redis_server: str, http: aiohttp.ClientSession
) -> None:
    async with live_server(tool_calls=0, random_ids=True, store=RedisStore(redis_server)) as live:
        client = Client(http, live.base_url)
        session = await client.create()
        flush = redis.asyncio.Redis.from_url(redis_server)
        await flush.flushall()  # as a restart without persistence leaves it
        await flush.aclose()
        for path in ("", "/turns", "/items"):
            status, body = await client.get(f"/{session['id']}{path}")
            assert status == 404 and body["error"]["code"] == "not_found"
        status, body = await client.post(session["id"], MESSAGE)
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


async def test_ids_from_an_unseeded_server_never_repeat_across_starts(http: aiohttp.ClientSession) -> None:
    seen: list[str] = []
    for _ in range(2):
        async with live_server(tool_calls=0, random_ids=True) as live:
            session = await Client(http, live.base_url).create()
            seen.append(session["id"])
            seen.extend(e["event_id"] for e in session["events"][:3])
    assert len(set(seen)) == len(seen)


# -- a pending call is never idle ---------------------------------------------------------------------


async def _statuses(client: Client, sid: str) -> tuple[dict[str, Any], str]:
    """The session as `GET /sessions/{id}` reads it, and its status in `GET /sessions`."""
    status, session = await client.get(f"/{sid}")
    assert status == 200, session
    status, listed = await client.get("?limit=100")
    assert status == 200, listed
    (entry,) = [s for s in listed["data"] if s["id"] == sid]
    return session, entry["status"]


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_a_session_with_an_unanswered_call_reads_requires_action_never_idle(
    store: str, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Two calls in one step: from the first call's `item.added` until the last result, the session
    read and listed is busy (`in_progress` before the step ends, `requires_action` after), and one
    answered call of two leaves it `requires_action`; `idle` only once both are answered and the
    turn has ended. In memory and in a store file (whose records the routes read)."""
    two_calls = ScriptPolicy(
        [
            [
                PlannedItem("function_call", "exec_command", json.dumps({"cmd": "ls"})),
                PlannedItem("function_call", "exec_command", json.dumps({"cmd": "pytest -x"})),
            ]
        ]
    )
    kept = SqliteStore(str(tmp_path / "sessions.db")) if store == "sqlite" else None
    async with live_server(policy=two_calls, store=kept) as live:
        client = Client(http, live.base_url)
        sid, seen, pending = "", [], []
        async with http.post(client.base, headers=BETA, json=_create(stream=True)) as resp:
            assert resp.status == 200, await resp.text()
            async for event in _events(resp):
                seen.append(event["type"])
                if event["type"] == "agent.session.created":
                    sid = event["session"]["id"]
                item = event.get("item") or {}
                if event["type"] == "agent.session.turn.item.added" and item.get("type") == "function_call":
                    session, listed = await _statuses(client, sid)
                    assert session["status"] in ("in_progress", "requires_action"), session
                    assert listed == session["status"], (listed, session)
                if event["type"] == "agent.session.requires_action":
                    pending = event["session"]["required_actions"]
                    assert len(pending) == 2, pending
                    session, listed = await _statuses(client, sid)
                    assert session["status"] == listed == "requires_action", (listed, session)
                    assert [a["call_id"] for a in session["required_actions"]] == [a["call_id"] for a in pending]
                    # One call of two answered: the other still waits, and so does the session.
                    first, second = pending
                    result = {"type": "agent.session.input.tool_result", "success": True, "output": "ok"}
                    status, body = await client.post(sid, {**result, **{k: first[k] for k in ("turn_id", "call_id")}})
                    assert status == 202, body
                    session, listed = await _statuses(client, sid)
                    assert session["status"] == listed == "requires_action", (listed, session)
                    assert second["call_id"] in [a["call_id"] for a in session["required_actions"]], session
                    status, body = await client.post(sid, {**result, **{k: second[k] for k in ("turn_id", "call_id")}})
                    assert status == 202, body
        assert pending and seen.count("agent.session.requires_action") == 1, seen
        assert seen[-2:] == ["agent.session.turn.completed", "agent.session.idle"], seen
        session, listed = await _statuses(client, sid)
        assert session["status"] == listed == "idle" and not session["required_actions"], session
