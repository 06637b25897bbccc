"""The Vercel AI SDK (`ai` with `@ai-sdk/openai`'s Responses model) and the OpenAI Agents SDK for
JavaScript (`@openai/agents`) against the server, unchanged; pinned in tests/node/package.json.

tests/node/sdks.mjs runs one agent loop per client: `generateText` and `streamText` with a tool
and `stopWhen`, and an `Agent` under `run`, over HTTP and over the Agents SDK's WebSocket
transport. The default policy calls the tool on the first turns and then answers in text, so
each run checks the SDK's whole loop: its tool schema reaches the model, the SDK runs each call
with the model's arguments, sends the output back and stops at the text. One seed: every client
ends with the same text. The server counts the responses and the transport they came over.
"""

from __future__ import annotations

import json
from typing import Final

import pytest

from prototype.serve.app import ENGINE
from tests.support import NODE_DIR, live_server, node_executable, run_client

TOOL_CALLS: Final = 3
SCRIPT: Final = NODE_DIR / "sdks.mjs"
CLIENT_TIMEOUT_S: Final = 60.0
"""Upper bound on one client run, so a client waiting for an event that never comes fails the test."""
CLIENTS: Final = ("vercel-generate", "vercel-stream", "agents-http", "agents-websocket")


async def _run(client: str) -> tuple[dict[str, object], int, int]:
    node = node_executable()
    async with live_server(tool_calls=TOOL_CALLS) as live:
        code, out, err = await run_client(
            node, str(SCRIPT), live.base_url, client, cwd=NODE_DIR, timeout_s=CLIENT_TIMEOUT_S
        )
        stats = live.app[ENGINE].statistics()
    assert code == 0, f"{client} exited {code}:\n{err.decode(errors='replace')[-4000:]}"
    return json.loads(out.decode().strip().splitlines()[-1]), stats.responses, stats.responses_websocket


@pytest.mark.slow
async def test_vercel_ai_sdk_and_agents_js_run_the_same_tool_loop() -> None:
    if not (NODE_DIR / "node_modules" / "ai" / "package.json").is_file():
        pytest.skip("the Vercel AI SDK is not installed: run `npm ci --prefix tests/node`")
    reports = {client: await _run(client) for client in CLIENTS}
    texts = set()
    for client, (report, responses, websocket) in reports.items():
        calls, text = report["calls"], report["text"]
        assert isinstance(calls, list) and len(calls) == TOOL_CALLS, (client, report)
        assert isinstance(text, str) and text, (client, report)
        assert responses == TOOL_CALLS + 1, (client, responses)
        assert websocket == (responses if client.endswith("websocket") else 0), (client, websocket)
        texts.add(text)
    assert len(texts) == 1, reports  # one seed, one conversation: the same answer through every SDK


STEER_SCRIPT: Final = NODE_DIR / "steer.mjs"
STEER_TEXT: Final = "Run the tests of module 4 too."


def _user_texts(items: object) -> list[str]:
    assert isinstance(items, list), items
    texts = []
    for item in items:
        if item.get("role") == "user":
            content = item["content"]
            texts.extend([content] if isinstance(content, str) else [part["text"] for part in content])
    return texts


@pytest.mark.slow
async def test_vercel_ai_sdk_interrupting_steer_remakes_the_model_call_with_the_message() -> None:
    """The AI SDK's own steering (client-side: `@ai-sdk/openai` has no Responses WebSocket mode,
    so no `response.steer`): `steer(..., {interrupt: true})` while the second model call has its
    headers and no output. The SDK aborts that call, makes it again in the same step with the
    message added, and the run goes on to the same tool loop's end."""
    if not (NODE_DIR / "node_modules" / "ai" / "package.json").is_file():
        pytest.skip("the Vercel AI SDK is not installed: run `npm ci --prefix tests/node`")
    node = node_executable()
    async with live_server(tool_calls=TOOL_CALLS) as live:
        code, out, err = await run_client(
            node, str(STEER_SCRIPT), live.base_url, cwd=NODE_DIR, timeout_s=CLIENT_TIMEOUT_S
        )
        stats = live.app[ENGINE].statistics()
    assert code == 0, f"steer.mjs exited {code}:\n{err.decode(errors='replace')[-4000:]}"
    report = json.loads(out.decode().strip().splitlines()[-1])
    requests = report["requests"]
    # Every model call reached the server, the aborted one too; only the second was aborted.
    assert [r["aborted"] for r in requests] == [False, True, False, False, False], requests
    assert stats.responses == len(requests) == TOOL_CALLS + 2, (stats.responses, requests)
    assert all(r["url"] == f"{live.base_url}/responses" for r in requests), requests
    assert report["outcome"] == {
        "type": "delivered",
        "id": "steer-1",
        "message": {"role": "user", "content": STEER_TEXT},
        "stepNumber": 1,
    }, report["outcome"]
    # The remade call is the aborted one's input with the message after it; every later call keeps it.
    aborted, remade = requests[1]["input"], requests[2]["input"]
    assert STEER_TEXT not in _user_texts(aborted)
    assert remade[: len(aborted)] == aborted and _user_texts(remade[len(aborted) :]) == [STEER_TEXT], remade
    assert all(_user_texts(r["input"]).count(STEER_TEXT) == 1 for r in requests[2:]), requests
    # The step was redone, not counted again: the tool loop still has its calls and its answer.
    assert report["steps"] == [
        {"finishReason": "tool-calls", "steering": 0},
        {"finishReason": "tool-calls", "steering": 1},
        {"finishReason": "tool-calls", "steering": 0},
        {"finishReason": "stop", "steering": 0},
    ], report["steps"]
    assert len(report["calls"]) == TOOL_CALLS and report["text"], report
