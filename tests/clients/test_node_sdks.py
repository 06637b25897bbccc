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
