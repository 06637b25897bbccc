"""Steering mid-decode (docs/beta.md, "The mid-decode boundary") and the comparison's
interjections (docs/experiments.md, "Interjections"): a steer accepted while the model decodes
stops the response at the next token boundary, the item in flight ends `incomplete` and is not
owed, and the automatic successor plans that turn afresh with the steer in its context."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from openai import AsyncOpenAI

from . import strict
from .support import EXEC_TOOL, live_server

MODEL: Final = "sim"
SEED: Final = 7
TOOL_CALLS: Final = 4
BETA_HEADERS: Final = {"OpenAI-Beta": "responses_multi_agent=v1"}
ASYNC_TOOL: Final = {**EXEC_TOOL, "async": True}
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
STEER_TEXT: Final = "Also check whether test_cache.py fails the same way."
TIMEOUT_S: Final = 30.0


async def test_official_python_beta_client_steers_mid_decode(wire: strict.Checker) -> None:
    """openai-python's beta client, unchanged: the steer goes out on the first argument delta of
    the second call; that call ends `incomplete` (never answered), the response `steered`, and
    the successor makes the same call in full, then the loop runs to its answer."""
    async with (
        live_server(tool_calls=TOOL_CALLS, seed=SEED, decode_tok_per_s=400) as live,
        asyncio.timeout(TIMEOUT_S),
        AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0) as client,
        client.beta.responses.connect(extra_headers=BETA_HEADERS) as conn,
    ):
        await conn.response.create(model=MODEL, input=PROMPT, tools=[ASYNC_TOOL])  # type: ignore[list-item]
        seen: list[str] = []
        created: list[Any] = []
        ended: list[Any] = []
        done_calls: list[Any] = []  # every call's output_item.done, complete or not
        answered: list[str] = []
        current = ""
        steered = False
        async for event in conn:
            seen.append(event.type)
            if event.type == "response.created":
                created.append(event.response)
                current = event.response.id
            elif event.type == "response.function_call_arguments.delta" and len(done_calls) == 1 and not steered:
                steered = True  # mid-decode: the second call has started streaming its arguments
                await conn.response.steer(previous_response_id=current, input=STEER_TEXT)
            elif event.type == "response.output_item.done" and event.item.type == "function_call":
                done_calls.append(event.item)
                if event.item.status == "completed":
                    answered.append(event.item.call_id)
                    output = {"type": "function_call_output", "call_id": event.item.call_id, "output": "ok"}
                    await conn.response.inject(response_id=current, input=[output])  # type: ignore[list-item]
            elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                ended.append(event.response)
                if event.type != "response.incomplete":
                    break
    assert [r.status for r in ended] == ["incomplete", "completed"], seen
    parent, successor = ended
    assert parent.incomplete_details.reason == "steered"
    assert [r.id for r in created] == [parent.id, successor.id] and created[1].previous_response_id == parent.id
    cut = done_calls[1]
    assert cut.status == "incomplete" and cut.call_id not in answered  # not owed, never answered
    assert parent.output[-1].status == "incomplete" and parent.output[-1].call_id == cut.call_id
    # The successor re-plans that turn: the same call, the cut arguments a prefix of its own.
    redo = done_calls[2]
    assert redo.status == "completed" and redo.arguments.startswith(cut.arguments) and redo.arguments != cut.arguments
    assert [c.status for c in done_calls].count("completed") == TOOL_CALLS == len(answered)
    assert successor.output[-1].type == "message"
    extra = parent.model_extra or {}
    assert extra["longrun"]["tokens_discarded"] > 0
    assert seen.count("response.steer.accepted") == 1 and "response.steer.failed" not in seen
    assert seen.count("response.inject.created") == TOOL_CALLS
    assert wire.counts[strict.BETA_WS_EVENT] == len(seen) and not wire.violations
