"""The strict wire checks (tests/strict.py, installed by conftest.py) and the pinned spec.

Three kinds of test: the oracles reject what they must (negative controls on payloads
with one rule broken); every client path the suite uses is actually checked (counts per
kind after real traffic, and a bad payload from a stand-in server fails on each path);
and the exceptions list holds only what is needed (each entry is broken by the spec's own
example, or by a value the server really sends, and nothing passes without it).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import websockets.sync.client
from aiohttp import web

from tests import strict, support
from tests.support import EXEC_TOOL, Live, live_server

BODY: dict[str, Any] = {"model": "sim", "input": "hello", "tools": [EXEC_TOOL]}


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=1) as server:
        yield server


async def _create(live: Live) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(live.base_url + "/responses", json=BODY) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


def _example(component: str) -> Any:
    schema = strict.spec()["components"]["schemas"][component]
    if "example" in schema:
        return copy.deepcopy(schema["example"])
    return json.loads(schema["x-oaiMeta"]["example"])


# --------------------------------------------------------------------------- the pinned spec


def test_pinned_extract_matches_its_recorded_hash_and_source() -> None:
    provenance = json.loads((strict.DATA / "openapi-responses.source.json").read_text())
    assert provenance["repository"] == "openai/openai-openapi" and len(provenance["commit"]) == 40
    assert hashlib.sha256(strict.SPEC_FILE.read_bytes()).hexdigest() == provenance["extract_sha256"]
    schemas = strict.spec()["components"]["schemas"]
    assert set(provenance["roots"]) <= set(schemas)
    # Closed under $ref: every schema the roots reach is in the extract.
    assert all(ref in schemas for ref in _refs(schemas))


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_unions_dispatch_on_type_in_the_spec_and_the_sdk() -> None:
    """Every event type the server sends has one branch in each union, in both oracles."""
    sent = {"response.created", "response.in_progress", "response.completed", "response.failed"}
    sent |= {"response.incomplete", "response.output_item.added", "response.output_item.done"}
    sent |= {"response.content_part.added", "response.content_part.done", "response.output_text.delta"}
    sent |= {"response.output_text.done", "response.function_call_arguments.delta", "error"}
    sent |= {"response.function_call_arguments.done"}
    for union in (strict.STREAM_EVENT, strict.WS_EVENT):
        assert sent <= strict.event_types(union)
        assert sent <= set(strict._SDK_UNIONS[union])


# --------------------------------------------------------------------------- negative controls


async def test_a_response_without_cache_write_tokens_fails_both_oracles(live: Live) -> None:
    body = await _create(live)
    assert strict.sdk_errors(strict.RESPONSE, body) == [] and strict.spec_errors(strict.RESPONSE, body) == []
    del body["usage"]["input_tokens_details"]["cache_write_tokens"]
    sdk, spec = strict.sdk_errors(strict.RESPONSE, body), strict.spec_errors(strict.RESPONSE, body)
    assert sdk and "usage.input_tokens_details.cache_write_tokens" in sdk[0] and "Field required" in sdk[0]
    assert spec and "'cache_write_tokens' is a required property" in spec[0]


@pytest.mark.parametrize(
    "mutation",
    [
        lambda e: e.pop("item_id"),  # a required field gone
        lambda e: e.update(output_index="0"),  # a string where the API has an integer
        lambda e: e.update(type="response.output_text.deltas"),  # no such event
        lambda e: e.update(logprobs=None),  # null where the API has an array
    ],
    ids=["missing-field", "wrong-type", "unknown-event", "null-array"],
)
def test_a_broken_event_fails_both_oracles(mutation: Any) -> None:
    event = {
        "type": "response.output_text.delta",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "hi",
        "logprobs": [],
        "sequence_number": 3,
    }
    for kind in (strict.STREAM_EVENT, strict.WS_EVENT):
        assert strict.sdk_errors(kind, event) == [] and strict.spec_errors(kind, event) == []
        broken = copy.deepcopy(event)
        mutation(broken)
        assert strict.spec_errors(kind, broken) and strict.sdk_errors(kind, broken)


def test_an_error_body_must_be_the_api_envelope() -> None:
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert strict.sdk_errors(strict.ERROR, good) == [] and strict.spec_errors(strict.ERROR, good) == []
    for bad in ({"message": "m"}, {"error": {"message": "m", "type": "x"}}, {"error": "m"}):
        assert strict.spec_errors(strict.ERROR, bad) or strict.sdk_errors(strict.ERROR, bad)


def test_an_sse_event_name_must_match_its_data() -> None:
    checker = strict.Checker()
    tap = strict.SSETap(checker, "test")
    data = json.dumps({"type": "error", "code": None, "message": "m", "param": None, "sequence_number": 0})
    tap.feed(f"event: error\ndata: {data}\n\n".encode())
    assert checker.counts[strict.STREAM_EVENT] == 1 and not checker.violations
    with pytest.raises(strict.WireViolation, match="does not match"):
        tap.feed(f"event: response.failed\ndata: {data}\n\n".encode())


# --------------------------------------------------------------------------- the exceptions list


def test_each_spec_exception_is_broken_by_the_specs_own_example() -> None:
    for rule in strict.exceptions()["spec_stricter_than_api"]:
        example = _example(rule["example"])
        for kind in rule["kinds"]:
            marker = f"at {rule['path']}:"
            unexcused = strict.spec_errors(kind, example, excuse=False)
            assert any(marker in line for line in unexcused), (rule["path"], unexcused)
            assert not any(marker in line for line in strict.spec_errors(kind, example)), rule["path"]


def _set(payload: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(payload)
    *parents, leaf = path.split(".")
    node = out
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value
    return out


async def test_each_value_the_spec_predates_is_the_sdks_and_only_it_passes(live: Live) -> None:
    """A value newer than the pinned spec: the spec rejects it and the SDK's types take it, so
    the exception excuses exactly what the SDK allows (a made-up value still fails both)."""
    response = {**await _create(live), "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}
    for rule in strict.exceptions()["spec_older_than_sdk"]:
        for kind in rule["kinds"]:
            base = (
                response
                if kind == strict.RESPONSE
                else {"type": "response.completed", "sequence_number": 1, "response": response}
            )
            assert strict.spec_errors(kind, base) == [] and strict.sdk_errors(kind, base) == []
            for value in rule["values"]:
                newer = _set(base, rule["path"], value)
                assert strict.spec_errors(kind, newer, excuse=False) and strict.sdk_errors(kind, newer) == []
                assert strict.spec_errors(kind, newer) == []
            made_up = _set(base, rule["path"], "made_up")
            assert strict.spec_errors(kind, made_up) and strict.sdk_errors(kind, made_up)


def _incomplete(response: dict[str, Any], reason: str) -> dict[str, Any]:
    ended = {**response, "status": "incomplete", "incomplete_details": {"reason": reason}}
    return {"type": "response.incomplete", "sequence_number": 9, "response": ended}


def _failed(response: dict[str, Any], code: str) -> dict[str, Any]:
    ended = {**response, "status": "failed", "error": {"code": code, "message": "m"}}
    return {"type": "response.failed", "sequence_number": 9, "response": ended}


# How to put an extension value where the server puts it; every entry's path needs one.
CARRIERS = {"response.incomplete_details.reason": _incomplete, "response.error.code": _failed}


async def test_each_extension_value_is_needed_and_only_it_passes(live: Live) -> None:
    response = await _create(live)
    for rule in strict.exceptions()["extension_values"]:
        carry = CARRIERS[rule["path"]]
        for kind in rule["kinds"]:
            for value in rule["values"]:
                event = carry(response, value)
                assert strict.spec_errors(kind, event, excuse=False) and strict.sdk_errors(kind, event, excuse=False)
                assert strict.spec_errors(kind, event) == [] and strict.sdk_errors(kind, event) == []
            made_up = carry(response, "made_up")
            assert strict.spec_errors(kind, made_up) and strict.sdk_errors(kind, made_up)


def test_extension_events_are_not_api_events() -> None:
    for name in strict.exceptions()["extension_events"]:
        assert name not in strict.event_types(strict.WS_EVENT)
        assert name not in strict._SDK_UNIONS[strict.WS_EVENT]


# --------------------------------------------------------------------------- every client path is checked


async def test_real_traffic_is_checked_on_every_client_path(live: Live, wire: strict.Checker) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(live.base_url + "/responses", json={**BODY, "stream": True}) as r:
            async for _ in r.content.iter_any():
                pass
        assert wire.counts[strict.STREAM_EVENT] > 3
        created = await _create(live)
        async with s.get(f"{live.base_url}/responses/{created['id']}") as r:
            await r.read()
        async with s.get(f"{live.base_url}/responses/resp_nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
        assert wire.counts[strict.RESPONSE] == 2 and wire.counts[strict.ERROR] == 1
        async with s.ws_connect(live.ws_url) as ws:
            await ws.send_json({"type": "response.create", **BODY})
            while (await support.receive_event(ws))["type"] != "response.completed":
                pass
        aiohttp_ws = wire.counts[strict.WS_EVENT]
        assert aiohttp_ws > 3

    async with openai.AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=10) as client:
        before = wire.counts.copy()
        await client.responses.create(**BODY)
        async for _ in await client.responses.create(**BODY, stream=True):
            pass
        async with client.responses.connect() as conn:
            await conn.response.create(**BODY)
            async for event in conn:
                if event.type == "response.completed":
                    break
        assert wire.counts[strict.RESPONSE] == before[strict.RESPONSE] + 1
        assert wire.counts[strict.STREAM_EVENT] > before[strict.STREAM_EVENT] + 3
        assert wire.counts[strict.WS_EVENT] > aiohttp_ws + 3

    def sync_socket() -> int:
        seen = 0
        with websockets.sync.client.connect(live.ws_url, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "response.create", **BODY}))
            while json.loads(ws.recv())["type"] != "response.completed":
                seen += 1
        return seen

    before_sync = wire.counts[strict.WS_EVENT]
    seen = await asyncio.to_thread(sync_socket)
    assert wire.counts[strict.WS_EVENT] == before_sync + seen + 1
    assert not wire.violations


DELTA_WITHOUT_ITEM = {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "x"}
DELTA_WITHOUT_ITEM |= {"logprobs": [], "sequence_number": 0}


@pytest.fixture
async def impostor() -> AsyncIterator[str]:
    """A stand-in server at /v1/responses that sends one payload the API would not."""

    async def create(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"event: response.output_text.delta\ndata: {json.dumps(DELTA_WITHOUT_ITEM)}\n\n".encode())
            return resp
        return web.json_response({"id": "resp_1", "object": "response"})

    async def socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive(timeout=support.RECEIVE_TIMEOUT_S)
        await ws.send_str(json.dumps(DELTA_WITHOUT_ITEM))
        await ws.receive(timeout=support.RECEIVE_TIMEOUT_S)  # until the client goes
        return ws

    app = web.Application()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses", socket)
    async with support.served(app) as port:
        yield f"127.0.0.1:{port}"


async def test_a_bad_payload_fails_on_every_client_path(impostor: str, wire: strict.Checker) -> None:
    async def caught(what: str, run: Any) -> None:
        before = len(wire.violations)
        with pytest.raises(Exception) as info:
            await run()
        assert len(wire.violations) == before + 1, (what, info.value)
        assert "item_id" in wire.violations[-1] or "required" in wire.violations[-1], what

    async with aiohttp.ClientSession() as s:

        async def json_body() -> None:
            async with s.post(f"http://{impostor}/v1/responses", json={}) as r:
                await r.json()

        async def sse_body() -> None:
            async with s.post(f"http://{impostor}/v1/responses", json={"stream": True}) as r:
                async for _ in r.content:
                    pass

        async def ws_frame() -> None:
            async with s.ws_connect(f"ws://{impostor}/v1/responses") as ws:
                await ws.send_str("{}")
                await ws.receive(timeout=support.RECEIVE_TIMEOUT_S)

        for what, run in (("aiohttp JSON", json_body), ("aiohttp SSE", sse_body), ("aiohttp WS", ws_frame)):
            await caught(what, run)

    async with openai.AsyncOpenAI(api_key="k", base_url=f"http://{impostor}/v1", max_retries=0, timeout=10) as c:

        async def sdk_json() -> None:
            await c.responses.create(model="m", input="x")

        async def sdk_sse() -> None:
            async for _ in await c.responses.create(model="m", input="x", stream=True):
                pass

        async def sdk_ws() -> None:
            async with c.responses.connect() as conn:
                await conn.response.create(model="m", input="x")
                await conn.recv()

        for what, run in (("SDK JSON", sdk_json), ("SDK SSE", sdk_sse), ("SDK WS", sdk_ws)):
            await caught(what, run)

    wire.violations.clear()  # caught on purpose: the autouse check must not fail this test


async def test_a_receive_without_a_timeout_gets_the_default(
    impostor: str, monkeypatch: pytest.MonkeyPatch, wire: strict.Checker
) -> None:
    """A frame that never comes fails the read (support.RECEIVE_TIMEOUT_S), not the run."""
    monkeypatch.setattr(support, "RECEIVE_TIMEOUT_S", 0.2)
    async with aiohttp.ClientSession() as s, s.ws_connect(f"ws://{impostor}/v1/responses") as ws:
        with pytest.raises(asyncio.TimeoutError):
            await ws.receive()  # the stand-in answers only after a client frame
