"""The Agents API's bounded event streams (prototype/serve/feeds.py, docs/agents-api.md#limits):
a subscriber that falls behind by more than `max_subscriber_bytes` gets `subscriber_too_slow` and
its end while the turn and the other subscribers run on; past `max_subscribers` a GET gets a 429."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
from aiohttp import web_protocol

from prototype.config import MAX_SUBSCRIBER_BYTES, ServerConfig
from prototype.serve.app import AGENTS
from prototype.serve.feeds import SUBSCRIBER_TOO_SLOW, EventFeed, too_slow_frame
from sim.model.policy import PlannedItem, ScriptPolicy
from tests.processes import start_server
from tests.support import AGENT_EVENT_MODELS as EVENT_MODELS
from tests.support import EXEC_COMMAND_SCHEMA, live_server

pytestmark = pytest.mark.timeout(60)

BETA: Final = {"OpenAI-Beta": "agents=v1"}
TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": EXEC_COMMAND_SCHEMA,
}
LONG_TOKENS: Final = 60_000
LONG_TEXT: Final = "word " * LONG_TOKENS
"""The issue's turn: about 22 MB of SSE frames, over five times the default bound."""
STALLED: Final = 10
TRANSPORT_BOUND: Final = 1 << 20
"""Bytes the server's transport may hold for a socket that does not drain (as for the Responses
API's slow consumer, tests/prototype/serve/test_faults.py): the writer waits for the drain once
the transport passes its high-water mark."""


def _create(**extra: Any) -> dict[str, Any]:
    return {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [TOOL]}, "input": "hi", **extra}


def _events(raw: bytes) -> list[dict[str, Any]]:
    """The events of SSE bytes that hold whole frames."""
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


# -- the feed ----------------------------------------------------------------------------------------


def _feed(limit: int | None) -> EventFeed:
    return EventFeed(limit=limit, dropped_frame=lambda n: too_slow_frame("sess_1", "event_x", n))


async def test_a_subscriber_past_its_bound_gets_the_error_and_its_end() -> None:
    reader, stalled, unbounded = _feed(1000), _feed(1000), _feed(None)
    frames = [str(i).encode() * 300 for i in range(10)]  # 300 bytes each: the fourth passes 1000
    got = []
    for frame in frames:
        for feed in (reader, stalled, unbounded):
            feed.put(frame)
        got.append(await reader.get())
        if not stalled.dropped:
            assert stalled.queued <= 1000
    assert got == frames and not reader.dropped and reader.queued == 0
    assert stalled.dropped and stalled.closed
    final = await stalled.get()  # the queue was cleared: the error is next, then the end
    assert final is not None and final.startswith(b"event: error\n")
    (event,) = _events(final)
    EVENT_MODELS["error"].model_validate(event)  # the SDK's AgentSessionErrorEvent
    assert event["session_id"] == "sess_1" and event["error"]["code"] == SUBSCRIBER_TOO_SLOW
    assert "1000 bytes" in event["error"]["message"]
    assert await stalled.get() is None
    stalled.put(b"later")  # published after the drop: nothing
    assert await stalled.get() is None
    assert not unbounded.dropped and unbounded.queued == 3000
    reader.put(None)
    assert await reader.get() is None


async def test_a_writer_takes_one_batch_at_a_time() -> None:
    feed = _feed(None)
    for frame in (b"a" * 300, b"b" * 300, b"c" * 300, b"d" * 900):
        feed.put(frame)
    feed.put(None)
    assert await feed.get(max_bytes=650) == b"a" * 300 + b"b" * 300
    assert await feed.get(max_bytes=650) == b"c" * 300  # the next frame does not fit
    assert await feed.get(max_bytes=650) == b"d" * 900  # a frame larger than a batch goes alone
    assert feed.queued == 0 and await feed.get() is None


# -- over loopback -----------------------------------------------------------------------------------


async def _stalled_subscriber(port: int, session_id: str) -> socket.socket:
    """`GET .../events` on a socket with a small receive buffer that reads the response's head
    (the server has subscribed it then) and nothing more."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # no autotuning to tens of MB
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    request = f"GET /v1/agents/sessions/{session_id}/events HTTP/1.1\r\nHost: x\r\nOpenAI-Beta: agents=v1\r\n\r\n"
    await loop.sock_sendall(sock, request.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await loop.sock_recv(sock, 4096)
        assert chunk, "the server closed the event stream before its head"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


async def _read_to_end(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while not out.endswith(b"0\r\n\r\n"):  # the chunked body's end
        chunk = await loop.sock_recv(sock, 1 << 16)
        assert chunk, "the connection closed before the stream's end"
        out += chunk
    return bytes(out)


async def _until_call(resp: aiohttp.ClientResponse) -> tuple[str, dict[str, Any]]:
    """Reads the create's stream up to the first function call: (the session id, the call)."""
    buf = b""
    session_id = ""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            (event,) = _events(frame + b"\n")
            if event["type"] == "agent.session.created":
                session_id = event["session"]["id"]
            item = event.get("item")
            if event["type"] == "agent.session.turn.item.added" and item["type"] == "function_call":
                return session_id, item
    raise AssertionError("the stream ended before the call")


def _result(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "events": [
            {
                "type": "agent.session.input.tool_result",
                "turn_id": item["turn_id"],
                "call_id": item["call_id"],
                "success": True,
                "output": "ok",
            }
        ]
    }


async def _long_turn(base_url: str, port: int, stalled: int) -> tuple[list[dict[str, Any]], list[socket.socket], str]:
    """A session's turn that calls a tool, then (once `stalled` subscribers that never read are
    subscribed and the result is posted) answers `LONG_TOKENS` tokens. The create's stream is read
    to its end: its events, the stalled sockets, the session id."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        resp = await http.post(f"{base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
        assert resp.status == 200
        session_id, call = await _until_call(resp)
        sockets = [await _stalled_subscriber(port, session_id) for _ in range(stalled)]
        posted = await http.post(f"{base_url}/agents/sessions/{session_id}/events", headers=BETA, json=_result(call))
        assert posted.status == 202
        events = _events(await resp.read())
    return events, sockets, session_id


def _script() -> ScriptPolicy:
    return ScriptPolicy(
        [PlannedItem("function_call", "exec_command", '{"cmd":"ls"}'), PlannedItem("message", "", LONG_TEXT)]
    )


def record_peaks(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The most bytes any feed held, and the server's write-buffer bytes each time a writer had
    to wait for its peer."""
    feed_peak = [0]
    waits: list[int] = []
    put, drain_helper = EventFeed.put, web_protocol.RequestHandler._drain_helper

    def record_put(self: EventFeed, frame: bytes | None) -> None:
        put(self, frame)
        feed_peak[0] = max(feed_peak[0], self.queued)

    async def record_drain(self: web_protocol.RequestHandler) -> None:
        if self._paused and self.transport is not None:
            waits.append(self.transport.get_write_buffer_size())
        await drain_helper(self)

    monkeypatch.setattr(EventFeed, "put", record_put)
    monkeypatch.setattr(web_protocol.RequestHandler, "_drain_helper", record_drain)
    return feed_peak, waits


async def test_stalled_subscribers_are_dropped_while_a_reader_gets_the_whole_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed_peak, waits = record_peaks(monkeypatch)
    async with live_server(policy=_script()) as live:
        events, sockets, session_id = await _long_turn(live.base_url, live.port, STALLED)
        # The reader, which kept up, has every token and the turn's end; no error.
        deltas = [e["delta"] for e in events if e["type"] == "agent.session.turn.output_text.delta"]
        assert "".join(deltas) == LONG_TEXT
        assert [e["type"] for e in events[-2:]] == ["agent.session.turn.completed", "agent.session.idle"]
        assert "error" not in {e["type"] for e in events}
        # Each stalled subscriber was dropped: its feed holds only its last frames.
        runner = live.app[AGENTS].runners[session_id]
        assert len(runner.feeds) == STALLED and all(feed.dropped for feed in runner.feeds)
        assert all(feed.queued < 1024 for feed in runner.feeds)
        # What the server held for any subscriber stayed within the feed's bound plus the transport's.
        assert MAX_SUBSCRIBER_BYTES / 2 < feed_peak[0] <= MAX_SUBSCRIBER_BYTES
        assert waits and max(waits) <= TRANSPORT_BOUND
        # A stalled subscriber that reads at last gets what was sent, the error, then its end.
        for sock in sockets:
            with sock:
                raw = await _read_to_end(sock)
            tail = raw[raw.rindex(b"event: ") :]
            assert tail.startswith(b"event: error\n")
            (error,) = _events(tail)
            EVENT_MODELS["error"].model_validate(error)
            assert error["error"]["code"] == SUBSCRIBER_TOO_SLOW and error["session_id"] == session_id


async def test_without_the_bound_a_stalled_subscriber_holds_the_whole_turn() -> None:
    """`--max-subscriber-bytes none`: the same stalled subscriber is never dropped; its feed
    keeps every frame it has not read (what the bound above stops)."""
    async with live_server(policy=_script(), config=ServerConfig(max_subscriber_bytes=None)) as live:
        events, sockets, session_id = await _long_turn(live.base_url, live.port, 1)
        assert events[-1]["type"] == "agent.session.idle"
        (feed,) = live.app[AGENTS].runners[session_id].feeds
        assert not feed.dropped and feed.queued > 4 * MAX_SUBSCRIBER_BYTES
        sockets[0].close()


async def test_subscribers_past_the_limit_get_a_429() -> None:
    config = ServerConfig(max_subscribers=2)
    async with live_server(policy=_script(), config=config) as live, aiohttp.ClientSession() as http:
        create = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
        session_id, _ = await _until_call(create)  # the create's stream is the first subscriber
        url = f"{live.base_url}/agents/sessions/{session_id}/events"
        second = await http.get(url, headers=BETA)
        assert second.status == 200
        third = await http.get(url, headers=BETA)
        assert third.status == 429
        assert (await third.json())["error"] == {
            "type": "rate_limit_error",
            "code": "too_many_subscribers",
            "message": f"Session '{session_id}' has 2 open event streams; at most 2 are allowed.",
            "param": None,
        }
        second.close()
        create.close()


# -- the acceptance check: a server process's memory -----------------------------------------


def _memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


async def _server_memory(script: Path, stalled: int, *options: str) -> tuple[int, int]:
    with start_server("--port", "0", "--tps", "0", "--script", str(script), *options) as server:
        events, sockets, _ = await _long_turn(server.base_url, server.port, stalled)
        assert events[-1]["type"] == "agent.session.idle"
        memory = _memory_kib(server.proc.pid)
        for sock in sockets:
            sock.close()
        return memory


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
async def test_stalled_subscribers_keep_the_servers_memory_within_1_5x(tmp_path: Path) -> None:
    """The issue's acceptance check, on a server process: its RSS after a 60,000-token turn with
    10 subscribers that never read is within 1.5 times the same run without them."""
    script = tmp_path / "long.jsonl"
    lines = [{"tool_call": {"name": "exec_command", "arguments": {"cmd": "ls"}}}, {"text": LONG_TEXT}]
    script.write_text("".join(json.dumps(line) + "\n" for line in lines))
    alone, _ = await _server_memory(script, 0)
    with_stalled, peak = await _server_memory(script, STALLED)
    print(f"server RSS after the turn: {alone} KiB alone, {with_stalled} KiB with {STALLED} stalled (peak {peak} KiB)")
    assert with_stalled <= 1.5 * alone
