"""Soak: concurrent rollouts in all four modes, and Agents API sessions beside them, against one
server on loopback, in rounds.

Every event every client receives is kept and checked: each response ends completed, or
failed/incomplete with a reason; sequence numbers are contiguous per response; usage equals
the tokens streamed (the deltas re-tokenized: the simulator's tokens are the encoding of its
text); every `store:true` response is retrievable; every session's turn runs through its tool calls
to `completed`, then the session is deleted. After each round the server's tasks are
awaited and none is left; the traced memory after the second round is within a bound of the
first (equal rounds: same seeds, same conversations).

`SOAK_SECONDS=600 python -m pytest tests/prototype/serve/test_soak.py -q` keeps starting rounds for that long
(a manual soak); by default it runs two rounds.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
import pytest

from prototype.context.tokenizer import get_tokenizer
from prototype.serve.app import AGENTS, SOCKETS
from prototype.serve.wallclock import AsyncioClock
from prototype.wire.schemas import (
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ServerEvent,
    decode_server_event,
)
from sim.client.client import HTTPClient, ws_client
from sim.client.lanes import TextSocket
from sim.client.websocket import WSClient, WSSocket
from sim.rollout.result import MODES, Mode, tool_outputs
from tests.support import EXEC_TOOL, Live, live_server

ROLLOUTS_PER_MODE: Final = 3  # 12 concurrent rollouts per round
TOOL_CALLS: Final = 5  # 6 model turns per rollout
SOAK_SECONDS: Final = float(os.environ.get("SOAK_SECONDS", "0"))
MEMORY_GROWTH_BOUND: Final = 1 << 20
"""Bytes of traced memory a second, equal round may add. What a round legitimately leaves
(stored responses) is deleted before measuring; a leak of one response object or event list
per turn (72 turns of ~10 KiB of events) would exceed it."""
SETTLE_TIMEOUT_S: Final = 60.0
"""Bound on awaiting the server's tasks after a round: a leaked task fails instead of hanging."""
TERMINALS: Final = (ResponseCompleted, ResponseFailed, ResponseIncomplete)
DELTAS: Final = (OutputTextDelta, FunctionCallArgumentsDelta)


class RecordingSocket:
    """A `TextSocket` that keeps every server event it hands to the client."""

    def __init__(self, inner: TextSocket, sink: list[ServerEvent]) -> None:
        self.inner = inner
        self.sink = sink

    async def send_str(self, data: str) -> None:
        await self.inner.send_str(data)

    async def receive(self) -> aiohttp.WSMessage:
        msg = await self.inner.receive()
        if msg.type is aiohttp.WSMsgType.TEXT:
            self.sink.append(decode_server_event(msg.data))
        return msg

    async def close(self) -> Any:
        return await self.inner.close()


class RecordingWS(WSSocket):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.received: list[ServerEvent] = []

    async def connect(self) -> TextSocket:
        return RecordingSocket(await super().connect(), self.received)


class RecordingHTTP(HTTPClient):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.received: list[ServerEvent] = []

    async def _exchange(self, data: bytes) -> AsyncIterator[ServerEvent]:
        async for event in super()._exchange(data):
            self.received.append(event)
            yield event


@dataclass
class Tally:
    responses: int = 0
    completed: int = 0
    tokens: int = 0
    stored: list[str] = field(default_factory=list)


async def rollout(live: Live, mode: Mode, index: int) -> tuple[Mode, list[ServerEvent]]:
    clock = AsyncioClock()
    client: RecordingHTTP | WSClient
    if mode in ("http", "http_prev"):
        client = RecordingHTTP(live.base_url, clock, chained=mode == "http_prev")
        received = client.received
    else:
        socket = RecordingWS(live.base_url, clock, mode=mode)
        client, received = ws_client(socket), socket.received
    settings = {"model": "sim", "tools": [EXEC_TOOL], "instructions": "You are a coding agent.", "store": True}
    items: list[dict[str, Any]] = [{"role": "user", "content": f"Task {index}: fix the failing test."}]
    try:
        for turn in range(TOOL_CALLS + 1):
            result = await client.turn(items, **settings)
            items = tool_outputs(result, f"output of step {turn}\n" * (turn + 1))
            if not items:
                break
        assert not items, f"{mode} rollout {index} did not reach its text answer"
    finally:
        await client.close()
    return mode, received


def check(mode: Mode, events: list[ServerEvent], tally: Tally) -> None:
    """Split one client's events into responses (each starts with response.created) and check each."""
    starts = [i for i, e in enumerate(events) if isinstance(e, ResponseCreated)] + [len(events)]
    assert starts[0] == 0
    for begin, end in zip(starts, starts[1:], strict=False):
        response = events[begin:end]
        seqs = [e.sequence_number for e in response]
        assert seqs == list(range(len(seqs))), (mode, seqs)
        final = response[-1]
        assert isinstance(final, TERMINALS), (mode, type(final).__name__)
        assert not any(isinstance(e, TERMINALS) for e in response[:-1])
        r = final.response
        if isinstance(final, ResponseFailed):
            assert r.error is not None and r.error.code and r.error.message
        elif isinstance(final, ResponseIncomplete):
            assert r.incomplete_details is not None and r.incomplete_details.reason
        else:
            tally.completed += 1
        pauses = sum(isinstance(e, ResponseDone) for e in response)
        assert pauses == (TOOL_CALLS if mode == "append" else 0), (mode, pauses)
        # Usage equals the tokens streamed: each output item's deltas, re-tokenized.
        texts: dict[str, list[str]] = {}
        for e in response:
            if isinstance(e, DELTAS):
                texts.setdefault(e.item_id, []).append(e.delta)
        tokens = sum(len(get_tokenizer().encode_list("".join(parts))) for parts in texts.values())
        assert r.usage is not None and r.usage.output_tokens == tokens, (mode, r.usage, tokens)
        tally.responses += 1
        tally.tokens += tokens
        if r.store:
            tally.stored.append(r.id)


async def settle(before: set[asyncio.Task[Any]]) -> None:
    me = asyncio.current_task()
    while new := asyncio.all_tasks() - before - {me}:
        _, pending = await asyncio.wait(new, timeout=SETTLE_TIMEOUT_S)
        assert not pending, f"server tasks still running: {pending}"


async def session_rollout(http: aiohttp.ClientSession, live: Live) -> str:
    """One Agents API session: its turn answered call by call to its end, then deleted; the
    turn's status."""
    beta = {"OpenAI-Beta": "agents=v1"}
    tool = {key: EXEC_TOOL[key] for key in ("type", "name", "description", "parameters")}
    body = {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [tool]}, "input": "go"}
    base = live.base_url + "/agents/sessions"
    status = ""
    async with http.post(base, headers=beta, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            event = msgspec.json.decode(line[6:])
            if event["type"] == "agent.session.requires_action":
                session = event["session"]
                results = [
                    {"type": "agent.session.input.tool_result", "turn_id": call["turn_id"], "call_id": call["call_id"]}
                    | {"success": True, "output": "ok"}
                    for call in session["required_actions"]
                ]
                async with http.post(f"{base}/{session['id']}/events", headers=beta, json={"events": results}) as r:
                    assert r.status == 202, await r.text()
            elif event["type"].startswith("agent.session.turn.") and "longrun" in event:
                status = event["turn"]["status"]
                sid = event["turn"]["session_id"]
    async with http.delete(f"{base}/{sid}", headers=beta) as resp:
        assert resp.status == 200
    return status


async def one_round(live: Live) -> Tally:
    before = asyncio.all_tasks()
    runs = [rollout(live, mode, i) for i in range(ROLLOUTS_PER_MODE) for mode in MODES]
    async with aiohttp.ClientSession() as http:
        results, statuses = await asyncio.gather(
            asyncio.gather(*runs), asyncio.gather(*(session_rollout(http, live) for _ in range(ROLLOUTS_PER_MODE)))
        )
    assert statuses == ["completed"] * ROLLOUTS_PER_MODE
    tally = Tally()
    for mode, events in results:
        check(mode, events, tally)
    # Nothing lost in the store: every stored response is there, then deleted (a round leaves nothing).
    async with aiohttp.ClientSession() as session:
        for response_id in tally.stored:
            async with session.get(f"{live.base_url}/responses/{response_id}") as resp:
                assert resp.status == 200, response_id
                assert msgspec.json.decode(await resp.read())["id"] == response_id
            async with session.delete(f"{live.base_url}/responses/{response_id}") as resp:
                assert resp.status == 200
    await settle(before)
    return tally


def traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 300)  # a manual soak runs as long as it is asked to
async def test_soak_all_modes_concurrently() -> None:
    per_mode_turns = ROLLOUTS_PER_MODE * (TOOL_CALLS + 1)
    expected_responses = 3 * per_mode_turns + ROLLOUTS_PER_MODE  # append: one response per rollout
    # (the sessions' turns are counted apart: `session_rollout`)
    async with live_server(tool_calls=TOOL_CALLS) as live:
        first = await one_round(live)  # warm-up: tokenizer tables, caches, connection pools
        assert first.responses == first.completed == expected_responses
        tracemalloc.start()
        try:
            baseline = traced_bytes()
            deadline = time.monotonic() + SOAK_SECONDS
            rounds = 0
            while rounds == 0 or time.monotonic() < deadline:
                tally = await one_round(live)
                rounds += 1
                assert tally.responses == tally.completed == expected_responses
                assert tally.tokens == first.tokens  # equal rounds: the same tokens
                growth = traced_bytes() - baseline
                if SOAK_SECONDS:  # the manual soak reports each round (visible with -s)
                    print(f"round {rounds}: {tally.responses} responses, {tally.tokens} tokens, +{growth} B traced")
                assert growth < MEMORY_GROWTH_BOUND, f"round {rounds}: traced memory grew by {growth} bytes"
        finally:
            tracemalloc.stop()
        assert not live.app[SOCKETS] and not live.app[AGENTS].runners  # every session deleted
        assert live.model.statistics().kv.pinned_blocks == 0
