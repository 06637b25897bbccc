"""pydantic-ai's on-demand compaction (`OpenAICompaction` in stateless mode) against the server,
unchanged: the capability calls `POST /v1/responses/compact` when its trigger is met, keeps the
returned `compaction` item in the history as a `CompactionPart`, and an agent run under
`openai_previous_response_id='auto'` goes on across it: the request after the compaction sends the
item (the compacted response's id is not a `previous_response_id`), the one after that chains on
the response that request made.

The source read for this (pydantic-ai-slim 2.78.0): `models/openai/_compaction.py` (the trigger,
`before_model_request` asking for compaction, `compact_history`), `models/openai/_responses_model.py`
(`compact_messages`, `_responses_compact`, `_get_previous_response_id_and_new_messages` breaking the
`auto` chain at a compaction boundary).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

import pytest

from tests.support import CLIENT_TIMEOUT_S, live_server, missing

MODEL: Final = "sim"
TOOL_CALLS: Final = 3
"""The default policy calls the tool on the first three turns, then answers in text: four requests."""
THRESHOLD: Final = 3
"""Compact once the history holds more than this many messages: before the third model request."""


@pytest.mark.slow
async def test_pydantic_ai_compacts_on_demand_and_chains_auto_across_the_compaction_item() -> None:
    try:
        import httpx2
        from pydantic_ai import Agent
        from pydantic_ai.messages import CompactionPart, ModelMessage, ModelResponse
        from pydantic_ai.models.openai import OpenAICompaction, OpenAIResponsesModel, OpenAIResponsesModelSettings
        from pydantic_ai.providers.openai import OpenAIProvider
    except ImportError:
        missing("pydantic-ai is not installed (pydantic-ai-slim[openai] is in the dev extra)")

    def compacted(messages: list[ModelMessage]) -> bool:
        return any(
            isinstance(part, CompactionPart) for m in messages if isinstance(m, ModelResponse) for part in m.parts
        )

    def once_past_threshold(messages: list[ModelMessage]) -> bool:
        # Once: a trigger that held on every later request would compact before each of them,
        # and no request would continue from the one after the compaction.
        return len(messages) > THRESHOLD and not compacted(messages)

    sent: list[tuple[str, dict[str, Any]]] = []

    async def record(request: Any) -> None:
        await request.aread()
        sent.append((request.url.path, json.loads(request.content)))

    calls: list[str] = []

    async with (
        live_server(tool_calls=TOOL_CALLS) as live,
        httpx2.AsyncClient(event_hooks={"request": [record]}, timeout=CLIENT_TIMEOUT_S) as http,
    ):
        model = OpenAIResponsesModel(
            MODEL,
            provider=OpenAIProvider(base_url=live.base_url, api_key="sk-test", http_client=http),
            settings=OpenAIResponsesModelSettings(openai_previous_response_id="auto", openai_store=True),
        )
        agent = Agent(
            model,
            instructions="You are a coding agent.",
            capabilities=[OpenAICompaction(trigger=once_past_threshold)],
        )

        @agent.tool_plain
        def exec_command(cmd: str, workdir: str | None = None) -> str:
            """Run a shell command and return its output."""
            calls.append(cmd)
            return f"$ {cmd}\nProcess exited with code 0\nOutput:\nline {len(calls)}\n"

        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            result = await agent.run("The test suite fails; find out why.")

    assert len(calls) == TOOL_CALLS, calls
    assert isinstance(result.output, str) and result.output.strip(), result.output

    create, compact = "/v1/responses", "/v1/responses/compact"
    paths = [path for path, _ in sent]
    assert paths == [create, create, compact, create, create], paths
    bodies = [body for _, body in sent]

    # Before the compaction, `auto` chains: the second request and the compaction continue stored
    # responses. The compaction then replaces the history before the turn it was asked at.
    assert "previous_response_id" not in bodies[0], bodies[0]
    assert str(bodies[1]["previous_response_id"]).startswith("resp_"), bodies[1]
    assert bodies[2]["model"] == MODEL and bodies[2]["input"], bodies[2]
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    compaction = responses[0]
    (part,) = compaction.parts
    assert isinstance(part, CompactionPart), result.all_messages()
    assert (compaction.provider_details or {}).get("compaction") is True  # the stateless endpoint's

    # The request after it: no `previous_response_id` (a compacted response's id is none), the
    # server's item in its input.
    after, chained = bodies[3], bodies[4]
    assert "previous_response_id" not in after, after
    items = [item for item in after["input"] if item.get("type") == "compaction"]
    assert len(items) == 1 and items[0]["encrypted_content"], after["input"]
    # ... and the `auto` chain picks up again from the response that request made (the one whose
    # tool call the last request answers), across the compaction item, which is not resent.
    made = responses[-2]
    assert made is not compaction and made.provider_response_id is not None
    assert chained["previous_response_id"] == made.provider_response_id, (chained, made)
    assert not any(item.get("type") == "compaction" for item in chained["input"]), chained["input"]
