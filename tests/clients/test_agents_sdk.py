"""openai-python's Agents API helpers (`client.beta.agents.sessions`), unchanged, against the
real server on loopback: `create(..., stream=True, tool_handlers=...)` and
`sessions.stream(..., tool_handlers=...)` run the whole tool loop (the SDK runs each handler
when `turn.item.added` carries its call, posts the result with an Idempotency-Key, and ends at
the root turn's `agent.session.idle`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.sessions.turn import Turn

from tests.support import AGENT_EVENT_MODELS as EVENT_MODELS
from tests.support import AGENT_ITEM_MODELS as ITEM_MODELS
from tests.support import EXEC_COMMAND_SCHEMA, NODE_DIR, Live, live_server, run_node

SEED: Final = 11
TOOL_CALLS: Final = 4
TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command and return its output.",
    "parameters": EXEC_COMMAND_SCHEMA,
}
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
REQUEST_TIMEOUT_S: Final = 10.0

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=TOOL_CALLS, seed=SEED) as server:
        yield server


@pytest.fixture
async def client(live: Live) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def _has_agents() -> bool:
    return hasattr(openai.resources.beta, "agents")


async def test_create_stream_runs_the_tool_loop(client: AsyncOpenAI) -> None:
    assert _has_agents(), f"openai {openai.__version__} has no client.beta.agents"
    calls: list[dict[str, Any]] = []

    def exec_command(arguments: dict[str, Any]) -> str:
        calls.append(arguments)
        return f"ran: {arguments['cmd'][:20]}"

    stream = await client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "sim", "tools": [TOOL]},  # type: ignore[list-item]
        input=PROMPT,
        stream=True,
        tool_handlers={"exec_command": exec_command},
    )
    result = await stream.get_final_result()
    assert result.turn.status == "completed"
    assert result.output_text  # the final answer's text
    assert len(calls) == TOOL_CALLS and all(isinstance(c["cmd"], str) for c in calls)

    session = await client.beta.agents.sessions.retrieve(result.session_id)
    assert session.status == "idle" and session.required_actions == []
    assert session.usage is not None and session.usage.output_tokens > 0

    items = [item async for item in client.beta.agents.sessions.items.list(result.session_id, order="asc")]
    kinds = [item.type for item in items]
    assert kinds == ["message", *["function_call", "function_call_output"] * TOOL_CALLS, "message"]
    outputs = [item for item in items if item.type == "function_call_output"]
    assert [o.output for o in outputs] == [f"ran: {c['cmd'][:20]}" for c in calls]

    turns = [turn async for turn in client.beta.agents.sessions.turns.list(result.session_id)]
    assert [t.id for t in turns] == [result.turn_id] and turns[0].status == "completed"


async def test_sessions_stream_runs_a_second_turn(client: AsyncOpenAI) -> None:
    assert _has_agents(), f"openai {openai.__version__} has no client.beta.agents"
    seen: list[str] = []

    def exec_command(arguments: dict[str, Any]) -> str:
        seen.append(arguments["cmd"])
        return "ok"

    first = await client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "sim", "tools": [TOOL]},  # type: ignore[list-item]
        input=PROMPT,
        stream=True,
        tool_handlers={"exec_command": exec_command},
    )
    done = await first.get_final_result()
    assert len(seen) == TOOL_CALLS

    events: list[str] = []
    async with client.beta.agents.sessions.stream(
        done.session_id, input="Summarize what you changed.", tool_handlers={"exec_command": exec_command}
    ) as turn:
        async for event in turn:
            events.append(event.type)
    assert events[0] == "agent.session.turn.created"
    assert events[-2:] == ["agent.session.turn.completed", "agent.session.idle"]

    turns = [t async for t in client.beta.agents.sessions.turns.list(done.session_id, order="asc")]
    assert [t.status for t in turns] == ["completed", "completed"]
    second = await client.beta.agents.sessions.turns.retrieve(turns[1].id, session_id=done.session_id)
    # The second turn continued the first: its prompt holds everything the first turn output.
    assert second.usage is not None and turns[0].usage is not None
    assert second.usage.input_tokens > turns[0].usage.output_tokens


async def test_tool_handler_failure_reaches_the_model_as_a_failed_result(client: AsyncOpenAI) -> None:
    def broken(arguments: dict[str, Any]) -> str:
        raise RuntimeError("secret detail")

    stream = await client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "sim", "tools": [TOOL]},  # type: ignore[list-item]
        input=PROMPT,
        stream=True,
        tool_handlers={"exec_command": broken},
    )
    result = await stream.get_final_result()
    items = [item async for item in client.beta.agents.sessions.items.list(result.session_id, order="asc")]
    failed = [item for item in items if item.type == "function_call_output"]
    assert len(failed) == TOOL_CALLS
    assert all(item.status == "failed" and item.error == "Tool handler failed." for item in failed)


async def test_openai_node_runs_the_same_tool_loop(live: Live) -> None:
    """openai-node 7.60's `sessions.create({stream: true, toolHandlers})` then `sessions.stream`
    (tests/node/agents.mjs); what it received is checked against openai-python's models."""
    plan = {
        "baseURL": live.base_url,
        "model": "sim",
        "tool": TOOL,
        "prompt": PROMPT,
        "followUp": "Summarize what you changed.",
    }
    report = await run_node(plan, NODE_DIR / "agents.mjs", 60.0)
    assert len(report["calls"]) == TOOL_CALLS and report["firstStatus"] == "completed" and report["firstText"]
    events = [EVENT_MODELS[e["type"]].model_validate(e) for e in report["events"]]
    assert events[0].type == "agent.session.turn.created"
    assert [e.type for e in events[-2:]] == ["agent.session.turn.completed", "agent.session.idle"]
    items = [ITEM_MODELS[i["type"]].model_validate(i) for i in report["items"]]
    kinds = [item.type for item in items]
    assert kinds == [
        "message",
        *["function_call", "function_call_output"] * TOOL_CALLS,
        "message",
        "message",
        "message",
    ]
    assert [Turn.model_validate(t).status for t in report["turns"]] == ["completed", "completed"]
    assert AgentSession.model_validate(report["session"]).status == "idle"
