"""Real clients that multiplex WebSocket lanes (`stream_id`) against the server on loopback, unchanged.

- openai-node 7.60.0 (`ResponsesWebSocketSession`, tests/node/lanes.mjs, run with `node`): two named
  lanes run concurrent tool loops on one socket, and one lane's response is forked onto a new lane.
- openai-python (`AsyncResponsesWebSocketSession` lanes, and `stream_id` on a plain connection).
- pydantic-ai (`OpenAIResponsesModel` with `openai_transport='websocket'` and `stream_id` lanes on).

The contract checked, from the WebSocket-mode guide, the `ResponseWsError`/`ResponsesWebSocketStreamEvent`
schemas of the OpenAI OpenAPI spec and the SDKs' WebSocket types: every event of a response created on
a named lane carries that `stream_id`, nothing arrives without one, the responses of one lane run in
order and different lanes run at the same time. Content is checked against the transport-independent
invariant of test_openai_sdk.py: with one seed the model sees the same tokens however the context
arrives, so every turn on every lane, the fork included, must equal a plain HTTP request that resends
that turn's whole history.

A client that is not installed fails the test under CI=true (.ci/run installs them) and skips it
elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
from openai import AsyncOpenAI

from tests.support import CLIENT_TIMEOUT_S, EXEC_TOOL, Live, Seen, live_server, missing, run_node

MODEL: Final = "sim"
SEED: Final = 11
TOOL_CALLS: Final = 3
"""The simulated agent calls `exec_command` this many times, then answers in text."""
TURNS: Final = TOOL_CALLS + 1
DECODE_TOK_PER_S: Final = 2000.0
"""Paced decoding, so that a response lasts long enough for lanes that run concurrently to overlap
(served one after the other, no two lanes' responses could ever interleave)."""
TERMINAL: Final = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
STREAM_LIMIT: Final = 32
"""Distinct named lanes one connection accepts (WebSocket-mode guide)."""
STREAM_LIMIT_MESSAGE: Final = "This WebSocket connection has reached its stream limit."
"""The `websocket_stream_limit_reached` message of the spec's `ResponseWsError` example."""

Items = list[dict[str, Any]]


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=TOOL_CALLS, seed=SEED, decode_tok_per_s=DECODE_TOK_PER_S) as server:
        yield server


@pytest.fixture
async def client(live: Live) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


@pytest.fixture
async def replay() -> AsyncIterator[AsyncOpenAI]:
    """HTTP on a second, unpaced server with the same seed: the same tokens for the same history
    (test_openai_sdk.py checks that), without waiting for paced decoding."""
    async with (
        live_server(tool_calls=TOOL_CALLS, seed=SEED) as other,
        AsyncOpenAI(api_key="sk-test", base_url=other.base_url, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c,
    ):
        yield c


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


PROMPTS: Final = {
    "alpha": "The test suite fails on test_store.py; find out why and fix it.",
    "beta.2": "Profile the importer: which function dominates the run time?",
}
FORK: Final[dict[str, Any]] = {"from": "alpha", "afterTurn": 1, "id": "alpha-fork_1", "turns": TURNS - 1, "tag": "fork"}


def args(input_items: Items | str, **extra: Any) -> dict[str, Any]:
    """Keyword arguments of one `responses.create` (plain dicts, as the tests build them)."""
    return {"model": MODEL, "input": input_items, **extra}


def tool_output(tag: str, turn: int, arguments: str) -> str:
    """The same fake tool result tests/node/lanes.mjs sends."""
    cmd = json.loads(arguments)["cmd"]
    return f"$ {cmd}\nProcess exited with code 0\nOutput:\n{tag} line {turn}.1\n{tag} line {turn}.2\n"


# -- what a client saw, in one shape for every client ---------------------------------------------------


def seen(response: dict[str, Any]) -> Seen:
    item = response["output"][-1]
    is_call = item["type"] == "function_call"
    text = None
    if not is_call:
        text = "".join(part["text"] for part in item["content"] if part["type"] == "output_text")
    return Seen(
        kind=item["type"],
        name=item["name"] if is_call else None,
        arguments=item["arguments"] if is_call else None,
        text=text,
        input_tokens=response["usage"]["input_tokens"],
        output_tokens=response["usage"]["output_tokens"],
    )


def split_responses(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A lane's events cut into responses; a lane runs one response at a time, so they must not overlap."""
    responses: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] | None = None
    for ev in events:
        if ev["type"] == "response.created":
            assert current is None, f"a response started on the lane before the previous one ended: {ev}"
            current = []
            responses.append(current)
        assert current is not None, f"event outside any response on its lane: {ev}"
        current.append(ev)
        if ev["type"] in TERMINAL:
            current = None
    assert current is None, "the lane's last response has no terminal event"
    return responses


def check_response_events(events: list[dict[str, Any]], stream_id: str, response_id: str) -> None:
    assert all(ev["stream_id"] == stream_id for ev in events), events
    assert events[0]["type"] == "response.created" and events[0]["response_id"] == response_id
    assert events[-1]["type"] == "response.completed" and events[-1]["response_id"] == response_id
    assert sum(ev["type"] in TERMINAL for ev in events) == 1
    numbers = [ev["sequence_number"] for ev in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers


def check_chain(turns: list[dict[str, Any]], first_prev: str | None) -> None:
    """Completed turns, each continuing the one before; tool calls then one text answer."""
    prev = first_prev
    for t in turns:
        assert t.get("error") is None, t["error"]
        resp = t["response"]
        assert resp["status"] == "completed", resp
        assert t["previous_response_id"] == prev and resp.get("previous_response_id") == prev, t
        prev = resp["id"]
    kinds = [seen(t["response"]).kind for t in turns]
    assert kinds == ["function_call"] * (len(turns) - 1) + ["message"], kinds


async def replay_over_http(client: AsyncOpenAI, history: Items, turns: list[dict[str, Any]], what: str) -> None:
    """Each turn equals a plain HTTP request resending that turn's whole history (same seed, same tokens)."""
    histories: list[Items] = []
    history = list(history)
    for t in turns:
        history.extend(t["input"])
        histories.append(list(history))
        history.extend(t["response"]["output"])
    expected = await asyncio.gather(*(client.responses.create(**args(h, tools=[EXEC_TOOL])) for h in histories))
    for t, e in zip(turns, expected, strict=True):
        assert seen(t["response"]) == seen(e.model_dump(mode="json")), f"{what}: turn {t['turn']} differs"


def prefix(turns: list[dict[str, Any]], upto: int) -> Items:
    """The whole history a lane had after its turn `upto`: every input and output so far."""
    history: Items = []
    for t in turns:
        if t["turn"] > upto:
            break
        history.extend(t["input"])
        history.extend(t["response"]["output"])
    return history


def overlapped(raw: list[dict[str, Any]], a: str, b: str) -> bool:
    """Whether an event of lane `b` arrived while a response of lane `a` was in flight."""
    open_a = False
    for ev in raw:
        if ev["stream_id"] == a:
            open_a = ev["type"] not in TERMINAL
        elif ev["stream_id"] == b and open_a:
            return True
    return False


# -- openai-node ------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_node_two_lanes_run_concurrent_tool_loops_and_a_fork(live: Live, replay: AsyncOpenAI) -> None:
    plan = {
        "baseURL": live.base_url,
        "model": MODEL,
        "tools": [EXEC_TOOL],
        "store": False,  # continuation and the fork come from the connection-local cache only
        "lanes": [
            {"id": "alpha", "prompt": PROMPTS["alpha"], "turns": TURNS},
            {"id": "beta.2", "prompt": PROMPTS["beta.2"], "turns": TURNS, "final": True},
        ],
        "fork": FORK,
        "timeoutMs": int(CLIENT_TIMEOUT_S * 1000),
    }
    report = await run_node(plan)
    raw: list[dict[str, Any]] = report["raw"]
    lanes = {"alpha", "beta.2", FORK["id"]}

    # Every event the socket delivered belongs to a named lane; the default lane received nothing.
    assert report["unrouted"] == []
    assert {ev["stream_id"] for ev in raw} == lanes, {ev["stream_id"] for ev in raw}

    alpha, beta, fork = report["lanes"]["alpha"], report["lanes"]["beta.2"], report["fork"]["turns"]
    check_chain(alpha, None)
    check_chain(beta, None)
    parent = alpha[FORK["afterTurn"] - 1]["response"]["id"]
    assert report["fork"]["parent"] == parent
    check_chain(fork, parent)  # the fork's first response continues the source lane's response
    assert len(alpha) == len(beta) == TURNS and len(fork) == FORK["turns"]

    # Each lane got exactly its own events, in the order the socket delivered them, one response at a time.
    for lane_id, turns in (("alpha", alpha), ("beta.2", beta), (FORK["id"], fork)):
        on_lane = [ev for ev in raw if ev["stream_id"] == lane_id]
        if lane_id != "beta.2":  # beta.2 reads with finalResponse(), the others with receive()
            assert [ev for t in turns for ev in t["events"]] == on_lane, lane_id
        responses = split_responses(on_lane)
        assert len(responses) == len(turns), lane_id
        for events, t in zip(responses, turns, strict=True):
            check_response_events(events, lane_id, t["response"]["id"])

    # The lanes ran at the same time: their responses interleaved on the socket.
    assert overlapped(raw, "alpha", "beta.2") or overlapped(raw, "beta.2", "alpha"), "lanes never overlapped"
    assert overlapped(raw, "alpha", FORK["id"]) or overlapped(raw, FORK["id"], "alpha"), "fork never overlapped"

    # Content: each lane saw its own conversation; the fork saw the source lane's history up to its parent.
    await replay_over_http(replay, [], alpha, "alpha")
    await replay_over_http(replay, [], beta, "beta.2")
    await replay_over_http(replay, prefix(alpha, FORK["afterTurn"]), fork, "fork")
    assert fork[0]["input"][0]["output"] != alpha[FORK["afterTurn"]]["input"][0]["output"]  # a real divergence


# -- openai-python ----------------------------------------------------------------------------------------


def python_session_types() -> tuple[Any, Any, Any]:
    try:
        from openai.lib.responses_websocket import (
            AsyncResponsesWebSocketSession,
            ResponsesWebSocketError,
            ResponsesWebSocketLimits,
        )
    except ImportError:
        missing("openai-python has no lane session (openai[realtime]>=3.57 is in the dev extra)")
    return AsyncResponsesWebSocketSession, ResponsesWebSocketLimits, ResponsesWebSocketError


def dump(obj: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = obj.model_dump(mode="json", exclude_none=True)
    return dumped


def brief(event: Any) -> dict[str, Any]:
    response = getattr(event, "response", None)
    return {
        "type": event.type,
        "stream_id": getattr(event, "stream_id", None),
        "sequence_number": getattr(event, "sequence_number", None),
        "response_id": getattr(response, "id", None),
    }


async def drain(lane: Any) -> list[dict[str, Any]]:
    """Everything a lane receives until its session closes."""
    received: list[dict[str, Any]] = []
    try:
        while True:
            received.append(brief(await lane.recv()))
    except EOFError:
        return received


async def python_lane_loop(
    lane: Any,
    *,
    tag: str,
    first_input: Items,
    first_prev: str | None,
    first_turn: int,
    turns: int,
    use_final: bool,
    after_turn: dict[int, Any] | None = None,
    started: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """The same tool loop as tests/node/lanes.mjs, on one openai-python lane."""
    result: list[dict[str, Any]] = []
    new_items, prev = first_input, first_prev
    for k in range(first_turn, first_turn + turns):
        request: dict[str, Any] = {
            "type": "response.create",
            "model": MODEL,
            "input": new_items,
            "tools": [EXEC_TOOL],
            "store": False,
        }
        if prev is not None:
            request["previous_response_id"] = prev
        await lane.send(request)
        events: list[dict[str, Any]] = []
        if use_final and started is None:
            response = dump(await lane.get_final_response())
        else:
            while True:
                ev = await lane.recv()
                events.append(brief(ev))
                if ev.type == "response.in_progress" and started is not None:
                    started.set()
                if ev.type in TERMINAL:
                    assert ev.type == "response.completed", dump(ev)
                    response = dump(ev.response)
                    break
        result.append(
            {"turn": k, "input": new_items, "previous_response_id": prev, "response": response, "events": events}
        )
        call = response["output"][-1]
        if call["type"] != "function_call" or k == first_turn + turns - 1:
            break
        output = {
            "type": "function_call_output",
            "call_id": call["call_id"],
            "output": tool_output(tag, k, call["arguments"]),
        }
        if after_turn is not None and k in after_turn:
            await after_turn[k](response, call)
        new_items, prev = [output], response["id"]
    return result


@pytest.mark.slow
async def test_python_session_lanes_run_concurrent_tool_loops_and_a_fork(
    client: AsyncOpenAI, replay: AsyncOpenAI
) -> None:
    session_type, limits_type, _ = python_session_types()
    limits = limits_type(
        max_lanes=8, max_events_per_lane=100_000, max_events=100_000, max_bytes_per_lane=1 << 28, max_bytes=1 << 28
    )
    fork_turns: list[dict[str, Any]] = []
    fork_tasks: list[asyncio.Task[list[dict[str, Any]]]] = []
    async with asyncio.timeout(CLIENT_TIMEOUT_S):
        connection = await client.responses.connect(websocket_connection_options={"max_size": None}).enter()
        async with session_type(connection, limits=limits) as session:
            alpha_lane, beta_lane = session.lane("alpha"), session.lane("beta.2")
            fork_lane = session.lane(FORK["id"])
            watcher = asyncio.create_task(drain(session.default))

            async def fork_after(parent: dict[str, Any], call: dict[str, Any]) -> None:
                started = asyncio.Event()
                k = FORK["afterTurn"]
                output = {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": tool_output("fork", k, call["arguments"]),
                }
                task = asyncio.create_task(
                    python_lane_loop(
                        fork_lane,
                        tag="fork",
                        first_input=[output],
                        first_prev=parent["id"],
                        first_turn=k + 1,
                        turns=FORK["turns"],
                        use_final=False,
                        started=started,
                    )
                )
                fork_tasks.append(task)
                # The guide's barrier for store=false: advance the source lane once the fork is in progress.
                waiter = asyncio.create_task(started.wait())
                done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if task in done:
                    task.result()

            alpha, beta = await asyncio.gather(
                python_lane_loop(
                    alpha_lane,
                    tag="alpha",
                    first_input=[user(PROMPTS["alpha"])],
                    first_prev=None,
                    first_turn=1,
                    turns=TURNS,
                    use_final=False,
                    after_turn={FORK["afterTurn"]: fork_after},
                ),
                python_lane_loop(
                    beta_lane,
                    tag="beta.2",
                    first_input=[user(PROMPTS["beta.2"])],
                    first_prev=None,
                    first_turn=1,
                    turns=TURNS,
                    use_final=True,
                ),
            )
            fork_turns = await fork_tasks[0]
        unrouted = await watcher  # the session closed: the default lane's reader ends
    assert unrouted == []  # every event named one of the three lanes
    check_chain(alpha, None)
    check_chain(beta, None)
    check_chain(fork_turns, alpha[FORK["afterTurn"] - 1]["response"]["id"])
    for lane_id, turns in (("alpha", alpha), (FORK["id"], fork_turns)):
        for t in turns:
            check_response_events(t["events"], lane_id, t["response"]["id"])
    await replay_over_http(replay, [], alpha, "alpha")
    await replay_over_http(replay, [], beta, "beta.2")
    await replay_over_http(replay, prefix(alpha, FORK["afterTurn"]), fork_turns, "fork")


async def test_python_connection_stream_id_events_echo_their_lane(client: AsyncOpenAI, replay: AsyncOpenAI) -> None:
    """Plain `connection.response.create(stream_id=...)`: two lanes at once, every event names its lane."""
    async with asyncio.timeout(CLIENT_TIMEOUT_S), client.responses.connect() as conn:
        for stream_id, prompt in PROMPTS.items():
            await conn.response.create(**args([user(prompt)], tools=[EXEC_TOOL], store=False, stream_id=stream_id))
        events: list[Any] = []
        while sum(ev.type in TERMINAL for ev in events) < len(PROMPTS):
            events.append(await conn.recv())
    briefs = [brief(ev) for ev in events]
    assert {b["stream_id"] for b in briefs} == set(PROMPTS), briefs
    for stream_id, prompt in PROMPTS.items():
        (response,) = split_responses([b for b in briefs if b["stream_id"] == stream_id])
        terminal = next(ev for ev in events if ev.type in TERMINAL and ev.stream_id == stream_id)
        check_response_events(response, stream_id, terminal.response.id)
        expected = await replay.responses.create(**args([user(prompt)], tools=[EXEC_TOOL]))
        assert seen(dump(terminal.response)) == seen(dump(expected))
    assert overlapped(briefs, *PROMPTS) or overlapped(briefs, *reversed(PROMPTS)), "lanes never overlapped"


async def test_python_connection_bad_lane_input_leaves_the_running_lane_alone(client: AsyncOpenAI) -> None:
    """While lane `alpha` runs, a malformed `stream_id` and a fork of an unknown id onto a new lane are each
    refused with an `error` event; `alpha`'s response goes on and completes. openai-python's plain connection
    sends `stream_id` unchecked (its lane session would refuse the bad id before sending)."""
    unknown = "resp_" + "0" * 32
    async with asyncio.timeout(CLIENT_TIMEOUT_S), client.responses.connect() as conn:
        await conn.response.create(**args([user(PROMPTS["alpha"])], tools=[EXEC_TOOL], store=False, stream_id="alpha"))
        first: Any = await conn.recv()
        await conn.response.create(**args("hi", store=False, stream_id="not a lane!"))
        await conn.response.create(**args("hi", store=False, stream_id="fork", previous_response_id=unknown))
        events: list[Any] = [first]
        while not (events[-1].type in TERMINAL and getattr(events[-1], "stream_id", None) == "alpha"):
            events.append(await conn.recv())
        errors: list[Any] = [ev for ev in events if ev.type == "error"]
        while len(errors) < 2:
            errors.append(await conn.recv())
    assert first.type == "response.created" and first.stream_id == "alpha"
    on_alpha = [brief(ev) for ev in events if ev.type != "error"]
    (response,) = split_responses(on_alpha)
    check_response_events(response, "alpha", events[-1].response.id)
    bad_id, bad_fork = sorted(errors, key=lambda ev: str(ev.error.code))
    assert (bad_id.status, bad_id.error.type, bad_id.error.code, bad_id.error.param) == (
        400,
        "invalid_request_error",
        "invalid_stream_id",
        "stream_id",
    )
    assert bad_id.stream_id is None  # the refused id names no lane
    assert (bad_fork.status, bad_fork.error.code, bad_fork.error.param) == (
        400,
        "previous_response_not_found",
        "previous_response_id",
    )
    assert bad_fork.stream_id == "fork"  # a request error on a named lane carries its id


@pytest.mark.slow
async def test_python_session_33rd_lane_gets_the_stream_limit_error(client: AsyncOpenAI) -> None:
    """32 named lanes per connection; the 33rd create is refused on its own lane and the others keep working."""
    session_type, limits_type, error_type = python_session_types()
    limits = limits_type(
        max_lanes=STREAM_LIMIT + 2,
        max_events_per_lane=10_000,
        max_events=100_000,
        max_bytes_per_lane=1 << 26,
        max_bytes=1 << 28,
    )
    request = {"type": "response.create", "model": MODEL, "input": "hi", "store": False, "max_output_tokens": 16}
    async with asyncio.timeout(CLIENT_TIMEOUT_S):
        connection = await client.responses.connect().enter()
        async with session_type(connection, limits=limits) as session:
            lanes = [session.lane(f"lane-{i}") for i in range(STREAM_LIMIT + 1)]
            for lane in lanes[:STREAM_LIMIT]:
                await lane.send(request)
            finals = [await lane.get_final_response() for lane in lanes[:STREAM_LIMIT]]
            await lanes[STREAM_LIMIT].send(request)
            with pytest.raises(error_type) as refused:
                await lanes[STREAM_LIMIT].get_final_response()
            # A lane already counted still works after the refusal.
            await lanes[0].send({**request, "previous_response_id": finals[0].id})
            again = await lanes[0].get_final_response()
    assert all(f.status in ("completed", "incomplete") for f in finals)
    event = refused.value.event
    assert event.type == "error" and event.status == 400
    assert event.stream_id == f"lane-{STREAM_LIMIT}"
    assert (event.error.type, event.error.code, event.error.param) == (
        "invalid_request_error",
        "websocket_stream_limit_reached",
        "stream_id",
    )
    assert event.error.message == STREAM_LIMIT_MESSAGE
    assert again.previous_response_id == finals[0].id


# -- pydantic-ai -------------------------------------------------------------------------------------------


def agent_with_tool(agent_type: Any, model: Any, calls: list[str], tag: str) -> Any:
    """A pydantic-ai agent with one `exec_command` tool that records its calls."""

    def exec_command(cmd: str, workdir: str | None = None) -> str:
        """Run a shell command and return its output."""
        calls.append(cmd)
        return f"$ {cmd}\nProcess exited with code 0\nOutput:\n{tag} line {len(calls)}\n"

    agent = agent_type(model)
    agent.tool_plain(exec_command)
    return agent


@pytest.mark.slow
async def test_pydantic_ai_concurrent_runs_share_one_socket_on_lanes(live: Live) -> None:
    try:
        import httpx2
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIResponsesModel, OpenAIResponsesModelSettings
        from pydantic_ai.profiles.openai import OpenAIModelProfile
        from pydantic_ai.providers.openai import OpenAIProvider
    except ImportError:
        missing("pydantic-ai is not installed (pydantic-ai-slim[openai] is in the dev extra)")

    http_requests: list[str] = []

    async def count(request: Any) -> None:
        http_requests.append(f"{request.method} {request.url.path}")

    calls: dict[str, list[str]] = {"alpha": [], "beta.2": []}
    async with httpx2.AsyncClient(event_hooks={"request": [count]}, timeout=CLIENT_TIMEOUT_S) as http:
        model = OpenAIResponsesModel(
            MODEL,
            provider=OpenAIProvider(base_url=live.base_url, api_key="sk-test", http_client=http),
            profile=OpenAIModelProfile(openai_responses_supports_websocket_stream_id=True),
            settings=OpenAIResponsesModelSettings(openai_transport="websocket", openai_store=False),
        )
        agents = {name: agent_with_tool(Agent, model, calls[name], name) for name in calls}
        async with asyncio.timeout(CLIENT_TIMEOUT_S), model:
            results = await asyncio.gather(*(agents[name].run(PROMPTS[name]) for name in calls))
    for name, result in zip(calls, results, strict=True):
        assert len(calls[name]) == TOOL_CALLS, (name, calls[name])
        assert isinstance(result.output, str) and result.output.strip(), (name, result.output)
    # Both runs' requests, concurrent from the first turn on, went over the one socket: none fell back to HTTP.
    assert [r for r in http_requests if r.endswith("/responses")] == [], http_requests
