"""openai-agents' `OpenAIHostedMultiAgentModel` (the Agents SDK's experimental client of the
responses_multi_agent beta, `agents/extensions/experimental/hosted_multi_agent/model.py`) against
the server, unchanged.

The model opens one beta WebSocket (`OpenAI-Beta: responses_multi_agent=v1`), sends one
`response.create` with `multi_agent: {enabled: true}`, treats each function call's
`output_item.done` as a pause, runs the tool, and resumes the same response with
`response.inject`; it keeps only the root agent's `final_answer` message as the run's output.
If an inject gets `response.inject.failed` with `response_already_completed`, it continues with
a new `response.create` naming the completed response as `previous_response_id` and the failed
input. Both paths run here: the default (the response waits at each call: one response) and the
what-if `multi_agent_holds_calls=False` (each call ends the response: every inject fails and the
SDK falls back, one response per call plus the answer). docs/beta.md#hosted-multi-agent.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

import pytest

from prototype.config import ServerConfig
from prototype.serve.app import ENGINE
from prototype.ws.connection import Connection
from tests import strict
from tests.support import beta_socket, live_server, receive_event, until

TOOL_CALLS: Final = 3
PROMPT: Final = "Fix the failing test in module 3."

agents = pytest.importorskip("agents", reason="openai-agents is not installed (setup.cfg's dev extra has it)")
hosted = pytest.importorskip("agents.extensions.experimental.hosted_multi_agent")


class _Recorder:
    """Every frame the SDK's beta connection sends and receives (the SDK's own connection
    class, wrapped only to look)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from openai.resources.beta.responses.responses import AsyncResponsesConnection

        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        send, recv = AsyncResponsesConnection.send, AsyncResponsesConnection.recv
        recorder = self

        async def recording_send(self: Any, event: Any) -> None:
            recorder.sent.append(dict(event))
            await send(self, event)

        async def recording_recv(self: Any) -> Any:
            event = await recv(self)
            recorder.received.append(event.model_dump(mode="json", exclude_unset=True))
            return event

        monkeypatch.setattr(AsyncResponsesConnection, "send", recording_send)
        monkeypatch.setattr(AsyncResponsesConnection, "recv", recording_recv)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.received if e.get("type") == kind]


def _ends(monkeypatch: pytest.MonkeyPatch) -> asyncio.Queue[str]:
    """The id of each response as the server's connection core records its end (the moment an
    inject naming it gets `response_already_completed`): the core's own method, wrapped to look."""
    ended: asyncio.Queue[str] = asyncio.Queue()
    response_ended = Connection.response_ended

    def recording(self: Connection, job: Any, *args: Any, **kwargs: Any) -> None:
        response_ended(self, job, *args, **kwargs)
        ended.put_nowait(job.response_id)

    monkeypatch.setattr(Connection, "response_ended", recording)
    return ended


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the SDK would export traces to api.openai.com


async def _run(tool: Any, config: ServerConfig | None = None) -> tuple[Any, Any]:
    """The SDK's hosted model runs an agent with `tool` against a live server, unchanged: its
    result and the server's statistics."""
    from openai import AsyncOpenAI

    async with live_server(tool_calls=TOOL_CALLS, config=config) as live:
        client = AsyncOpenAI(base_url=live.base_url, api_key="sk-longrun")
        model = hosted.OpenAIHostedMultiAgentModel("sim", openai_client=client)
        agent = agents.Agent(name="fixer", instructions="Fix the test.", tools=[tool], model=model)
        try:
            result = await agents.Runner.run(agent, PROMPT, max_turns=TOOL_CALLS + 2)
        finally:
            await model.close()
            await client.close()
        return result, live.app[ENGINE].statistics()


@pytest.mark.slow
async def test_the_hosted_model_runs_its_tool_loop_in_one_paused_response(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = _Recorder(monkeypatch)
    calls: list[str] = []

    @agents.function_tool
    def exec_command(cmd: str) -> str:
        """Run a shell command and return its output."""
        calls.append(cmd)
        return f"ran {len(cmd)} characters: ok"

    result, stats = await _run(exec_command)

    assert len(calls) == TOOL_CALLS
    # What the SDK sent: one create with multi_agent, then one inject per call, nothing else.
    creates = [f for f in frames.sent if f["type"] == "response.create"]
    injects = [f for f in frames.sent if f["type"] == "response.inject"]
    assert len(creates) == 1 and creates[0]["multi_agent"] == {"enabled": True}
    assert len(injects) == TOOL_CALLS and len(frames.sent) == TOOL_CALLS + 1
    response_id = frames.of("response.created")[0]["response"]["id"]
    assert all(i["response_id"] == response_id for i in injects)
    assert [i["input"][0]["type"] for i in injects] == ["function_call_output"] * TOOL_CALLS
    # Every inject acknowledged, none failed; one response, paused at each call.
    assert len(frames.of("response.inject.created")) == TOOL_CALLS and not frames.of("response.inject.failed")
    assert stats.responses == stats.responses_websocket == 1 and stats.pauses == TOOL_CALLS
    # Every output item is the root agent's; the final message is its final answer.
    done = [e["item"] for e in frames.of("response.output_item.done")]
    assert all(item["agent"] == {"agent_name": "/root"} for item in done)
    (completed,) = frames.of("response.completed")
    final = completed["response"]["output"][-1]
    assert final["type"] == "message" and final["phase"] == "final_answer"
    assert result.final_output == final["content"][0]["text"] and result.final_output
    outputs = [i for i in result.to_input_list() if i.get("type") == "function_call_output"]
    assert len(outputs) == TOOL_CALLS and all("ok" in json.dumps(o["output"]) for o in outputs)


@pytest.mark.slow
async def test_the_hosted_model_falls_back_when_an_inject_finds_the_response_completed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What-if `multi_agent_holds_calls=False`: each call ends its response `completed`. The
    tool returns only once the server's connection core has recorded that response's end, so every inject
    names a completed response: `response.inject.failed` (`response_already_completed`, with the
    input), and the SDK continues with `previous_response_id` and that input."""
    frames = _Recorder(monkeypatch)
    ended = _ends(monkeypatch)
    calls: list[str] = []

    @agents.function_tool
    async def exec_command(cmd: str) -> str:
        """Run a shell command and return its output."""
        await ended.get()  # the response that made this call has ended
        calls.append(cmd)
        return f"ran {len(cmd)} characters: ok"

    result, stats = await _run(exec_command, ServerConfig(multi_agent_holds_calls=False))

    assert len(calls) == TOOL_CALLS
    failed = frames.of("response.inject.failed")
    assert len(failed) == TOOL_CALLS and not frames.of("response.inject.created")
    assert all(f["error"]["code"] == "response_already_completed" for f in failed)
    assert all(f["input"][0]["type"] == "function_call_output" for f in failed)
    creates = [f for f in frames.sent if f["type"] == "response.create"]
    ids = [e["response"]["id"] for e in frames.of("response.created")]
    assert len(creates) == TOOL_CALLS + 1 and len(ids) == TOOL_CALLS + 1
    # Each fallback create continues the response its inject failed on, with the failed input.
    for create, previous, fail in zip(creates[1:], ids[:-1], failed, strict=True):
        assert create["previous_response_id"] == previous == fail["response_id"]
        assert create["input"] == fail["input"]
    assert stats.responses == stats.responses_websocket == TOOL_CALLS + 1 and stats.pauses == 0
    final = frames.of("response.completed")[-1]["response"]["output"][-1]
    assert final["phase"] == "final_answer" and result.final_output == final["content"][0]["text"]


# -- the wire the model relies on, raw (strict-checked against openai 3.63's beta types) ----------------


def _multi_agent_create(**fields: Any) -> str:
    return json.dumps(
        {
            "type": "response.create",
            "model": "sim",
            "input": PROMPT,
            "tools": [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}],
            "multi_agent": {"enabled": True, "max_concurrent_subagents": 2},
            **fields,
        }
    )


async def test_a_multi_agent_response_waits_at_each_call_and_marks_its_items(wire: strict.Checker) -> None:
    import aiohttp

    async with live_server(tool_calls=1, seed=4) as live, aiohttp.ClientSession() as session:
        async with await beta_socket(session, live) as ws:
            await ws.send_str(_multi_agent_create())
            events = await until(ws, "response.output_item.done")
            rid, call = events[0]["response"]["id"], events[-1]["item"]
            assert call["type"] == "function_call" and call["agent"] == {"agent_name": "/root"}
            assert "async" not in call  # the tool is not async: the call waits because of multi_agent
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
            await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [output]}))
            assert (await receive_event(ws))["type"] == "response.inject.created"
            done = (await until(ws, "response.completed"))[-1]["response"]
    assert done["id"] == rid and [item["type"] for item in done["output"]] == ["function_call", "message"]
    assert done["output"][-1]["phase"] == "final_answer" and done["output"][-1]["agent"]["agent_name"] == "/root"
    assert not wire.violations


async def test_multi_agent_is_a_parameter_of_the_beta_socket_only(wire: strict.Checker) -> None:
    import aiohttp

    async with live_server(tool_calls=1) as live, aiohttp.ClientSession() as session:
        async with session.ws_connect(live.ws_url) as ws:  # plain WebSocket mode
            await ws.send_str(_multi_agent_create())
            error = await receive_event(ws)
        assert error["type"] == "error" and error["error"]["code"] == "unknown_parameter"
        assert error["error"]["param"] == "multi_agent"
        body = json.loads(_multi_agent_create())
        del body["type"]
        async with session.post(f"{live.base_url}/responses", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "multi_agent"
        async with await beta_socket(session, live) as ws:
            await ws.send_str(_multi_agent_create(multi_agent={"enabled": True, "max_concurrent_subagents": 0}))
            error = await receive_event(ws)
        assert error["error"]["param"] == "multi_agent.max_concurrent_subagents"
    assert not wire.violations
