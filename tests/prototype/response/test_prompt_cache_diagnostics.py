"""`prompt_cache_diagnostics` on the Response (openai-python 3.63 `types/responses/response.py`),
requested by `prompt_cache_options.comparison_response_id`: what longrun's own caches know of the
prompt's reuse against the compared response (docs/contract.md#prompt-cache-diagnostics). Every
body and frame here passes the strict wire checker (the 3.63 types)."""

from __future__ import annotations

from typing import Any, Final

import aiohttp
import pytest

from tests import strict
from tests.support import Live, live_server, turn

pytestmark = pytest.mark.timeout(60)

TOOL: Final = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
OTHER_TOOL: Final = {"type": "function", "name": "read_file", "parameters": {"type": "object"}}


@pytest.fixture
async def live() -> Any:
    async with live_server(tool_calls=0, seed=3) as server:
        yield server


async def _post(session: aiohttp.ClientSession, live: Live, **body: Any) -> dict[str, Any]:
    payload = {"model": "sim", "input": "Fix the failing test.", "tools": [TOOL], **body}
    async with session.post(f"{live.base_url}/responses", json=payload) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


def _compare(response_id: str) -> dict[str, Any]:
    return {"prompt_cache_options": {"comparison_response_id": response_id}}


async def test_diagnostics_over_http(live: Live, wire: strict.Checker) -> None:
    async with aiohttp.ClientSession() as session:
        first = await _post(session, live)
        assert "prompt_cache_diagnostics" not in first  # not requested
        # Continuing the compared response with the same settings: its whole prompt is reused.
        hit = await _post(session, live, previous_response_id=first["id"], **_compare(first["id"]))
        assert hit["prompt_cache_diagnostics"] == {"type": "cache_hit"}
        # Changed tools: the preamble (instructions, tools) leads the prompt, so nothing is reusable.
        tools = await _post(
            session, live, previous_response_id=first["id"], tools=[OTHER_TOOL], **_compare(first["id"])
        )
        diag = tools["prompt_cache_diagnostics"]
        assert diag["type"] == "cache_miss" and diag["reason"] == "tools_changed"
        assert diag["comparison_reusable_tokens"] == 0
        assert 0 < diag["cache_missed_tokens"] <= tools["usage"]["input_tokens"]
        model = await _post(session, live, previous_response_id=first["id"], model="sim-2", **_compare(first["id"]))
        assert model["prompt_cache_diagnostics"]["reason"] == "model_changed"
        instructions = await _post(session, live, instructions="Be brief.", **_compare(first["id"]))
        assert instructions["prompt_cache_diagnostics"]["reason"] == "input_changed"
        # An unrelated context with the same settings: longrun does not compare contexts it did not chain.
        unrelated = await _post(session, live, **_compare(first["id"]))
        assert unrelated["prompt_cache_diagnostics"] == {"type": "unavailable"}
        missing = await _post(session, live, **_compare("resp_0000000000000000000000000000dead"))
        assert missing["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    assert not wire.violations and wire.counts


async def test_diagnostics_find_the_compared_response_in_the_connection_cache(live: Live, wire: strict.Checker) -> None:
    """`store: false`: the compared response is only in the WebSocket connection's cache."""
    async with aiohttp.ClientSession() as session, session.ws_connect(live.ws_url) as ws:
        body = {"model": "sim", "input": "Fix the failing test.", "tools": [TOOL], "store": False}
        first = (await turn(ws, **body))[-1]["response"]
        rid = first["id"]
        hit = (await turn(ws, **body, previous_response_id=rid, **_compare(rid)))[-1]["response"]
        assert hit["prompt_cache_diagnostics"] == {"type": "cache_hit"}
        # Not continued, a `store: false` response is nowhere longrun looks it up.
        created = (await turn(ws, **body, **_compare(hit["id"])))[0]["response"]
        assert created["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    assert not wire.violations


async def test_the_response_echoes_the_applied_prompt_cache_options(live: Live, wire: strict.Checker) -> None:
    """The Response's `prompt_cache_options` are the options applied: the request's, with the spec's
    defaults (`implicit`, `30m`) filled in, and the comparison named; absent when the request sets none."""
    async with aiohttp.ClientSession() as session:
        plain = await _post(session, live)
        assert "prompt_cache_options" not in plain
        empty = await _post(session, live, prompt_cache_options={})
        assert empty["prompt_cache_options"] == {"mode": "implicit", "ttl": "30m", "comparison_response_id": None}
        chosen = await _post(
            session,
            live,
            prompt_cache_options={"mode": "explicit", "ttl": "12h", "comparison_response_id": plain["id"]},
        )
        assert chosen["prompt_cache_options"] == {
            "mode": "explicit",
            "ttl": "12h",
            "comparison_response_id": plain["id"],
        }
        fetched_url = f"{live.base_url}/responses/{chosen['id']}"
        async with session.get(fetched_url) as resp:
            assert (await resp.json())["prompt_cache_options"] == chosen["prompt_cache_options"]
    assert not wire.violations and wire.counts


async def test_diagnostics_follow_the_explicit_mode(live: Live, wire: strict.Checker) -> None:
    """`explicit` with no breakpoint uses no prompt caching: a continuation is no `cache_hit`;
    with a breakpoint in the conversation it is."""
    marked = {
        "role": "user",
        "content": [{"type": "input_text", "text": "Fix it.", "prompt_cache_breakpoint": {"mode": "explicit"}}],
    }
    async with aiohttp.ClientSession() as session:
        explicit = {"mode": "explicit"}
        first = await _post(session, live, prompt_cache_options=explicit)
        plain = await _post(
            session,
            live,
            previous_response_id=first["id"],
            prompt_cache_options={**explicit, "comparison_response_id": first["id"]},
        )
        assert plain["prompt_cache_diagnostics"] == {"type": "unavailable"}
        assert plain["usage"]["input_tokens_details"]["cached_tokens"] == 0
        second = await _post(session, live, input=[marked], prompt_cache_options=explicit)
        hit = await _post(
            session,
            live,
            previous_response_id=second["id"],
            prompt_cache_options={**explicit, "comparison_response_id": second["id"]},
        )
        assert hit["prompt_cache_diagnostics"] == {"type": "cache_hit"}
        assert hit["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert not wire.violations
