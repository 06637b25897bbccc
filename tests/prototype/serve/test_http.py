"""HTTP and SSE over real loopback sockets: error bodies, store semantics, rebuild paths."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from prototype.config import ModelLimits, ServerConfig
from prototype.context.conversation import Context, parse_items, render_items
from prototype.serve.app import ENGINE
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from prototype.wire.sse import SSEDecoder
from sim.client.client import open_client
from sim.model.config import ModelConfig, build_model
from sim.model.policy import PlannedItem, ScriptPolicy
from sim.rollout.result import ClientError
from sim.runtime.inprocess import InProcessServer
from tests.support import EXEC_TOOL, Live, live_server


@pytest.fixture
async def live() -> Any:
    async with live_server(tool_calls=3) as server:
        yield server


async def post(live: Live, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body).encode()
        async with s.post(live.base_url + "/responses", data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


async def post_sse(live: Live, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, list[Any]]:
    async with aiohttp.ClientSession() as s:
        async with s.post(live.base_url + "/responses", json={**body, "stream": True}) as r:
            decoder = SSEDecoder()
            events = []
            async for chunk in r.content.iter_any():
                events.extend(decoder.feed(chunk))
            events.extend(decoder.close())
            return r, events


@pytest.mark.parametrize(
    ("raw", "status", "code", "param"),
    [
        (b"{nope", 400, "invalid_json", None),
        (b'{"model": 3}', 400, "invalid_type", "model"),
        (b'{"input": "x"}', 400, "missing_required_parameter", "model"),
        (b'{"model": "m", "generate": false}', 400, "unsupported_parameter", "generate"),
        (b'{"model": "m", "background": true}', 400, "unsupported_parameter", "background"),
        (
            b'{"model": "m", "previous_response_id": "resp_nope"}',
            400,
            "previous_response_not_found",
            "previous_response_id",
        ),
        (b'{"model": "m", "previous_response_id": "abc"}', 400, "invalid_value", "previous_response_id"),
        (
            b'{"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}',
            400,
            "missing_required_parameter",
            "input[0].call_id",
        ),
        (
            b'{"model": "m", "input": [{"type": "message", "role": "user"}]}',
            400,
            "missing_required_parameter",
            "input[0].content",
        ),
        (b'{"model": "m", "input": [{"role": "user", "content": 5}]}', 400, "invalid_type", "input[0].content"),
        (b'{"model": "m", "max_output_tokens": 0}', 400, "integer_below_min_value", "max_output_tokens"),
        (b'{"model": "m", "input": "x", "tool_choice": "sometimes"}', 400, "invalid_value", "tool_choice"),
    ],
)
async def test_error_bodies(live: Live, raw: bytes, status: int, code: str, param: str | None) -> None:
    got_status, body = await post(live, None, raw=raw)
    assert got_status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in body["error"]["message"]


async def test_sse_headers_event_lines_and_done_flag() -> None:
    async with live_server(config=ServerConfig(sse_done=True)) as server:
        resp, events = await post_sse(server, {"model": "sim", "input": "hi"})
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-cache" and resp.headers["X-Accel-Buffering"] == "no"
        assert events[-1].data == "[DONE]"
        payloads = [json.loads(e.data) for e in events[:-1]]
        assert [e.event for e in events[:-1]] == [p["type"] for p in payloads]
        assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
        assert payloads[0]["type"] == "response.created" and payloads[-1]["type"] == "response.completed"


async def test_sse_error_before_stream_is_a_json_error(live: Live) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            live.base_url + "/responses", json={"model": "m", "stream": True, "previous_response_id": "resp_x"}
        ) as r:
            assert r.status == 400 and r.content_type == "application/json"
            assert (await r.json())["error"]["code"] == "previous_response_not_found"


async def test_get_and_delete_stored(live: Live) -> None:
    _, created = await post(live, {"model": "sim", "input": "hi"})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{live.base_url}/responses/{created['id']}") as r:
            stored = await r.json()
            # the stored copy is written before the stage timings exist; everything else is identical
            assert r.status == 200 and "longrun" not in stored
            assert stored == {k: v for k, v in created.items() if k != "longrun"}
        async with s.delete(f"{live.base_url}/responses/{created['id']}") as r:
            assert (await r.json()) == {"id": created["id"], "object": "response", "deleted": True}
        async with s.get(f"{live.base_url}/responses/{created['id']}") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
        async with s.delete(f"{live.base_url}/responses/{created['id']}") as r:
            assert r.status == 404


async def test_store_false_is_not_retrievable_nor_chainable_over_http(live: Live) -> None:
    _, created = await post(live, {"model": "sim", "input": "hi", "store": False})
    assert created["store"] is False
    status, body = await post(live, {"model": "sim", "input": "more", "previous_response_id": created["id"]})
    assert status == 400 and body["error"]["code"] == "previous_response_not_found"


async def test_read_after_write(live: Live) -> None:
    """A continuation sent the moment a response completes finds it (LiteLLM #28587)."""
    prev = None
    for _ in range(5):
        status, body = await post(live, {"model": "sim", "input": "go", "previous_response_id": prev})
        assert status == 200, body
        prev = body["id"]


async def test_store_frees_what_it_deletes(live: Live) -> None:
    store = live.app[ENGINE].store
    assert isinstance(store, MemoryStore)
    ids = [(await post(live, {"model": "sim", "input": "x" * 1000}))[1]["id"] for _ in range(5)]
    assert store.statistics().entries == 5 and store.statistics().bytes > 0  # type: ignore[operator]
    async with aiohttp.ClientSession() as s:
        for rid in ids:
            async with s.delete(f"{live.base_url}/responses/{rid}") as r:
                assert r.status == 200
    assert store.statistics().entries == 0 and store.statistics().bytes == 0


async def test_rebuild_keeps_function_calls_outputs_and_roles(live: Live) -> None:
    """vLLM #43244 (tool items dropped on rehydration), SGLang #23662 (roles rewritten), vLLM WS PR
    #35492 (cached items not spliced): the effective context is prev input + prev output + new input."""
    first_input = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "sure"}]},
    ]
    _, first = await post(live, {"model": "sim", "input": first_input, "tools": [EXEC_TOOL]})
    call = first["output"][0]
    assert call["type"] == "function_call"
    fco = {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}
    _, second = await post(
        live, {"model": "sim", "input": [fco], "previous_response_id": first["id"], "tools": [EXEC_TOOL]}
    )
    engine = live.app[ENGINE]
    items = await engine.load(second["id"])  # what a third turn would continue from
    kinds = [(i.view.type, i.view.role) for i in items]
    assert kinds == [
        ("message", "developer"),
        ("message", "user"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
        (second["output"][0]["type"], "assistant" if second["output"][0]["type"] == "message" else None),
    ]
    assert json.loads(items[3].raw) == call  # the server's own item, verbatim
    # Same context, same tokens, as a full resend:
    full = [*first_input, call, fco]
    _, resend = await post(live, {"model": "sim", "input": full, "tools": [EXEC_TOOL]})
    assert resend["usage"]["input_tokens"] == second["usage"]["input_tokens"]
    assert resend["output"][0].get("arguments") == second["output"][0].get("arguments")
    ctx = Context()
    parsed = parse_items([json.dumps(i).encode() for i in full])  # type: ignore[misc]
    ctx.extend(parsed, render_items(parsed, engine.tokenizer))
    assert ctx.turn_index == 1  # an assistant message directly followed by a call is one model turn


async def test_instructions_are_not_inherited(live: Live) -> None:
    _, first = await post(live, {"model": "sim", "input": "x", "instructions": "SECRET RULES " * 50})
    _, second = await post(live, {"model": "sim", "input": "y", "previous_response_id": first["id"]})
    assert second["instructions"] is None
    _, with_instr = await post(
        live, {"model": "sim", "input": "y", "previous_response_id": first["id"], "instructions": "SECRET RULES " * 50}
    )
    assert with_instr["usage"]["input_tokens"] > second["usage"]["input_tokens"] + 50


async def test_string_and_list_input_are_equivalent(live: Live) -> None:
    _, a = await post(live, {"model": "sim", "input": "hello there"})
    _, b = await post(
        live,
        {
            "model": "sim",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}],
        },
    )
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"]
    assert a["output"][0]["content"][0]["text"] == b["output"][0]["content"][0]["text"]


async def test_response_echoes_request_settings(live: Live) -> None:
    body = {
        "model": "sim-1k",
        "input": "x",
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "tool_choice": "none",
        "tools": [EXEC_TOOL],
        "max_output_tokens": 64,
        "parallel_tool_calls": False,
        "user": "u1",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
    }
    _, r = await post(live, body)
    assert r["object"] == "response" and r["id"].startswith("resp_") and isinstance(r["created_at"], int)
    for key in (
        "model",
        "temperature",
        "top_p",
        "metadata",
        "tool_choice",
        "tools",
        "max_output_tokens",
        "parallel_tool_calls",
        "user",
        "text",
    ):
        assert r[key] == body[key], key
    assert r["output"][0]["type"] == "message"  # tool_choice none: no call
    assert r["usage"]["output_tokens"] <= 64


async def test_healthz_and_unknown_routes(live: Live) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(live.base_url.replace("/v1", "/healthz")) as r:
            assert r.status == 200
        async with s.get(live.base_url + "/nope") as r:
            assert r.status == 404


async def test_tool_schema_whitespace_does_not_change_the_prompt(live: Live) -> None:
    """openai-python sends compact JSON over HTTP and json.dumps spacing over WebSocket."""
    counts = set()
    for dumps in (lambda o: json.dumps(o, separators=(",", ":")), json.dumps, lambda o: json.dumps(o, indent=2)):
        raw = dumps({"model": "sim", "input": "hello there", "tools": [EXEC_TOOL]}).encode()
        _, body = await post(live, None, raw=raw)
        counts.add(body["usage"]["input_tokens"])
    assert len(counts) == 1


async def test_sse_frames_of_a_wake_up_go_out_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpaced turn releases its deltas without yielding: they are written in batches
    (`BatchedSSE`), in order, and every non-delta event is written before the next one."""
    writes: list[bytes] = []
    write = web.StreamResponse.write

    async def counting_write(self: web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting_write)
    text = " value" * 3000
    async with live_server(policy=ScriptPolicy([PlannedItem("message", "", text)])) as live:
        async with aiohttp.ClientSession() as session:
            body = {"model": "sim", "input": "go", "stream": True}
            async with session.post(f"{live.base_url}/responses", json=body) as resp:
                raw = await resp.read()
    decoder = SSEDecoder()
    events = [json.loads(e.data) for e in decoder.feed(raw)]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 3000 and "".join(deltas) == text
    assert b"".join(writes) == raw  # nothing written around the batches, nothing reordered
    assert len(writes) < len(events) / 20
    first_delta = next(i for i, w in enumerate(writes) if b"output_text.delta" in w)
    assert b"response.created" in writes[0] and b"output_text.delta" not in writes[0]  # not held for the deltas
    assert b"response.completed" in writes[-1] and first_delta > 0


def test_the_full_history_client_resends_the_items_json_as_first_encoded() -> None:
    """`http` keeps each item's JSON from when it was first recorded; the body is the bytes a
    client re-encoding its whole history would send."""
    from prototype.wire.schemas import Response, encode
    from sim.client.client import HTTPClient
    from sim.rollout.result import TurnResult

    client = HTTPClient("http://127.0.0.1:1", clock=None, chained=False)  # type: ignore[arg-type]
    sent = [{"type": "message", "role": "user", "content": 'héllo "there"'}]
    output = [{"type": "function_call", "call_id": "c1", "name": "exec", "arguments": '{"cmd": "ls"}'}]
    response = Response(id="resp_1", created_at=0, status="completed", model="m")
    client.history.record(sent, TurnResult(response, 0.0, None, 0.0, 0, 0, output_items=output))
    new = [{"type": "function_call_output", "call_id": "c1", "output": "a\nb"}]
    settings = {"model": "m", "tools": []}
    assert client.body(new, settings) == encode({**settings, "input": [*sent, *output, *new], "stream": True})


# -- one exchange, carried live and in process ---------------------------------------------------------


async def _carried(client: Any, body: dict[str, Any]) -> tuple[list[str], tuple[int, Any] | None]:
    """The event types a client's transport yields for one request, and its error, if any."""
    seen: list[str] = []
    try:
        async for event in client._exchange(json.dumps({**body, "stream": True}).encode()):
            seen.append(event.__struct_config__.tag)
    except ClientError as err:
        return seen, (err.status, err.body)
    finally:
        await client.close()
    return seen, None


@pytest.mark.parametrize(
    "case",
    [
        {"input": " word" * 2_100},  # past the window: refused inside the stream it began
        {"input": "hi", "previous_response_id": "resp_missing"},  # refused before the stream
        {"input": "hi", "temperature": 9},  # refused by the contract, before the stream
        {"input": "hi"},  # served
    ],
    ids=["in-stream error", "unknown previous response", "bad parameter", "served"],
)
async def test_live_and_in_process_http_answer_alike(case: dict[str, Any]) -> None:
    """`HTTPExchange` decides what a `POST /v1/responses` gets back, and the aiohttp handler and
    the in-process transport only carry it: the same events and the same error on every path."""
    config = ServerConfig(model=ModelLimits(context_window=3_000, max_output_tokens=1_000))
    policy = ScriptPolicy([PlannedItem("message", "", " word" * 20)])
    body = {"model": "sim", **case}
    async with live_server(policy=policy, config=config) as live:
        over_socket = await _carried(open_client("http", live.base_url, AsyncioClock()), body)
    clock = AsyncioClock()
    model = build_model(ModelConfig(tps=0), clock=clock, policy=policy)
    server = InProcessServer(config, model=model, store=MemoryStore(), clock=clock, seed=0)
    in_process = await _carried(server.client("http", clock), body)
    assert in_process == over_socket
    types, error = over_socket
    if "temperature" in case or "previous_response_id" in case:  # a JSON 400 instead of a stream
        code = "previous_response_not_found" if "previous_response_id" in case else "decimal_above_max_value"
        assert types == [] and error is not None and (error[0], error[1]["error"]["code"]) == (400, code)
    elif len(case["input"]) > 100:
        assert types == ["response.created", "response.in_progress", "error"] and error is None
    else:
        assert types[-1] == "response.completed" and error is None


# -- what aiohttp itself would answer, in the API's shape ----------------------------------------------------


def _api_error(status: int, content_type: str, body: bytes) -> dict[str, Any]:
    assert content_type.startswith("application/json"), (status, content_type, body[:200])
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"type", "code", "message", "param"}
    return error


async def test_routing_errors_are_json_in_the_apis_shape(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{live.base_url}/nope") as resp:
            error = _api_error(resp.status, resp.content_type, await resp.read())
        assert resp.status == 404 and error["message"] == "Invalid URL (GET /v1/nope)."
        assert (error["type"], error["code"]) == ("invalid_request_error", None)
        async with http.put(f"{live.base_url}/responses", json={}) as resp:
            error = _api_error(resp.status, resp.content_type, await resp.read())
            allow = resp.headers.get("Allow", "")
        assert resp.status == 405 and error["code"] == "method_not_allowed" and "POST" in allow
        async with http.delete(f"{live.base_url}/agents/sessions", headers={"OpenAI-Beta": "agents=v1"}) as resp:
            assert resp.status == 405
            _api_error(resp.status, resp.content_type, await resp.read())
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v1/" + b"x" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",  # a request line past aiohttp's 8190 bytes
        b"GET /v1/responses HTTP/1.1\r\nHost: a\r\nX-Big: " + b"y" * 9000 + b"\r\n\r\n",  # a header past it
        b"POST /v1/responses HTTP/1.1\r\nHost: a\r\nContent-Length: nope\r\n\r\n",
        b"GET /v1/responses HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"POST /v1/responses HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"POST /v1/agents/sessions HTTP/1.1\r\nHost: a\r\nOpenAI-Beta: agents=v1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabcdef\r\n0\r\n\r\n",
    ],
    ids=["long-request-line", "long-header", "bad-content-length", "chunked-and-length", "bad-chunk", "long-chunk"],
)
async def test_an_unparsable_request_is_a_json_400_without_a_logged_traceback(
    live: Live, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(request_bytes)
        await writer.drain()
        raw = await reader.read()  # the server closes the connection after the error
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    error = _api_error(status, headers[b"content-type"].decode(), body)
    assert status == 400 and error["code"] == "invalid_http_request"
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_a_body_cut_short_by_the_client_logs_no_traceback(live: Live, caplog: pytest.LogCaptureFixture) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc")
        writer.write_eof()
        assert await reader.read() == b""  # nobody left to answer
    finally:
        writer.close()
    await asyncio.sleep(0)  # the handler's turn to see the reset
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
