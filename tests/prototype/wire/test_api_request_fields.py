"""Responses-API request fields as openai-python 3.63 types them (`PromptCacheOptions`): the
`12h` cache lifetime, and `prewarm`, a warm-up that generates nothing over either transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
from openai import AsyncOpenAI, BadRequestError
from openai.types.responses import Response

from tests.support import Live, live_server

INPUT: Final = "Summarise the repository layout."


@pytest.fixture
async def client() -> AsyncIterator[tuple[Live, AsyncOpenAI]]:
    async with live_server(tool_calls=0, seed=3) as live:
        async with AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=10) as c:
            yield live, c


async def test_a_12h_cache_lifetime_is_accepted_and_others_refused(client: tuple[Live, AsyncOpenAI]) -> None:
    _, c = client
    response = await c.responses.create(model="sim", input=INPUT, prompt_cache_options={"ttl": "12h"})
    assert response.status == "completed" and response.output_text
    options: Any = {"ttl": "1h"}
    with pytest.raises(BadRequestError) as info:
        await c.responses.create(model="sim", input=INPUT, prompt_cache_options=options)
    assert info.value.body["param"] == "prompt_cache_options.ttl"  # type: ignore[index]


async def test_prewarm_prepares_the_cache_and_generates_nothing(client: tuple[Live, AsyncOpenAI]) -> None:
    live, c = client
    raw = await c.responses.with_raw_response.create(model="sim", input=INPUT, prompt_cache_options={"prewarm": True})
    warm = Response.model_validate_json(raw.text)  # validated, not constructed
    assert warm.status == "completed" and warm.output == []
    assert warm.usage is not None and warm.usage.output_tokens == 0
    # The prompt is in the model's prefix cache now: the same request generating reuses it.
    answer = await c.responses.create(model="sim", input=INPUT)
    assert answer.output_text and answer.usage is not None
    assert answer.usage.input_tokens_details.cached_tokens > 0


async def test_the_typed_websocket_generate_field(client: tuple[Live, AsyncOpenAI]) -> None:
    """openai-python 3.63 types `generate` on the WebSocket create as `Optional[bool]`: `false` is
    the warm-up, `null` and `true` generate. Sent through the SDK's typed connection; every
    completed Response validated against the 3.63 model. HTTP has no such parameter."""
    _, c = client
    outputs: dict[bool | None, int] = {}
    async with c.responses.connect() as connection:
        for generate in (False, None, True):
            await connection.response.create(model="sim", input=INPUT, generate=generate)
            async for event in connection:
                assert event.type not in ("error", "response.failed"), event
                if event.type == "response.completed":
                    done = Response.model_validate(event.response.model_dump(mode="json"), strict=True)
                    assert done.usage is not None
                    outputs[generate] = done.usage.output_tokens
                    break
    assert outputs[False] == 0 and outputs[None] == outputs[True] > 0
    with pytest.raises(BadRequestError) as info:
        await c.responses.create(model="sim", input=INPUT, extra_body={"generate": None})
    assert info.value.body["code"] == "unsupported_parameter"  # type: ignore[index]
