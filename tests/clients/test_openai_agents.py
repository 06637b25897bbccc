"""openai-agents (the OpenAI Agents SDK for Python, pinned in setup.cfg) against the server, unchanged.

An `Agent` with one function tool runs to its final answer through `Runner.run`, over HTTP
(`OpenAIResponsesModel` on an `AsyncOpenAI` client whose `base_url` is the server) and over
WebSocket mode (`responses_websocket_session`, the SDK's shared WebSocket provider). The default
policy calls the agent's tool on the first turns and then answers in text, so the run checks the
SDK's whole loop: its tool schema reaches the model, the SDK runs each call with the arguments
the model chose, sends the output back, and stops at the text. The server counts the responses
and the transport they came over.
"""

from __future__ import annotations

import json
from typing import Final

import pytest

from prototype.serve.app import ENGINE
from tests.support import live_server

TOOL_CALLS: Final = 3
PROMPT: Final = "Fix the failing test in module 3."

agents = pytest.importorskip("agents", reason="openai-agents is not installed (setup.cfg's dev extra has it)")


def _agent(calls: list[str], model: object) -> object:
    @agents.function_tool
    def exec_command(cmd: str) -> str:
        """Run a shell command and return its output."""
        calls.append(cmd)
        return f"ran {len(cmd)} characters: ok"

    return agents.Agent(name="fixer", instructions="Fix the test.", tools=[exec_command], model=model)


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the SDK would export traces to api.openai.com


@pytest.mark.slow
async def test_an_agent_runs_its_tool_loop_over_http() -> None:
    from openai import AsyncOpenAI

    calls: list[str] = []
    async with live_server(tool_calls=TOOL_CALLS) as live:
        client = AsyncOpenAI(base_url=live.base_url, api_key="sk-longrun")
        model = agents.OpenAIResponsesModel(model="sim", openai_client=client)
        result = await agents.Runner.run(_agent(calls, model), PROMPT, max_turns=TOOL_CALLS + 2)
        stats = live.app[ENGINE].statistics()
        await client.close()
    assert len(calls) == TOOL_CALLS and all(isinstance(c, str) for c in calls)
    assert isinstance(result.final_output, str) and result.final_output
    assert stats.responses == TOOL_CALLS + 1 and stats.responses_websocket == 0
    outputs = [i for i in result.to_input_list() if i.get("type") == "function_call_output"]
    assert len(outputs) == TOOL_CALLS and all("ok" in json.dumps(o["output"]) for o in outputs)


@pytest.mark.slow
async def test_an_agent_runs_its_tool_loop_over_websocket() -> None:
    calls: list[str] = []
    async with live_server(tool_calls=TOOL_CALLS) as live:
        async with agents.responses_websocket_session(api_key="sk-longrun", base_url=live.base_url) as session:
            result = await session.run(_agent(calls, "sim"), PROMPT, max_turns=TOOL_CALLS + 2)
        stats = live.app[ENGINE].statistics()
    assert len(calls) == TOOL_CALLS
    assert isinstance(result.final_output, str) and result.final_output
    assert stats.responses == stats.responses_websocket == TOOL_CALLS + 1
