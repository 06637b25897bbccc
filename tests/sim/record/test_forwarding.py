"""The recorder forwards byte for byte and as bytes arrive (sim/record/proxy.py), checked against an
upstream that records what it was sent: the request's raw path and query, its headers (repeated
ones too) and body reach the upstream as the client sent them; the response's status, headers and
body reach the client as the upstream sent them; an SSE stream's bytes (comments, CRLF line ends)
pass unchanged, each event before the upstream writes the next."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from prototype.wire.schemas import (
    InputTokensDetails,
    OutputTextDelta,
    OutputTokensDetails,
    Response,
    ResponseCompleted,
    ResponseCreated,
    Usage,
    encode,
)
from tests.recording import recorded_lines, recording
from tests.support import RECEIVE_TIMEOUT_S

BODY: Final = b'{"object":"file" ,  "id":"file/1","name":"caf\xc3\xa9 \\u00e9"}\n'
REQUEST: Final = b'{ "model": "sim",\n  "input": "h\\u00e9llo",   "stream": true }'


def _event(event: Any) -> bytes:
    """An SSE event with CRLF line ends (the spec allows CR, LF or CRLF; a proxy must not rewrite them)."""
    return b"event: %s\r\ndata: %s\r\n\r\n" % (type(event).__struct_config__.tag.encode(), encode(event))


_USAGE: Final = Usage(
    input_tokens=5,
    input_tokens_details=InputTokensDetails(),
    output_tokens=1,
    output_tokens_details=OutputTokensDetails(),
    total_tokens=6,
)
_STARTED: Final = Response(id="resp_1", created_at=0, status="in_progress", model="sim")
CREATED: Final = _event(ResponseCreated(sequence_number=0, response=_STARTED))
DELTA: Final = _event(
    OutputTextDelta(sequence_number=1, item_id="msg_1", output_index=0, content_index=0, delta="H\u00e9")
)
DONE: Final = _event(
    ResponseCompleted(sequence_number=2, response=msgspec.structs.replace(_STARTED, status="completed", usage=_USAGE))
)
SSE: Final = (b": keep-alive\r\n\r\n" + CREATED, DELTA + DONE)


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[tuple[str, dict[str, Any], asyncio.Event]]:
    """An upstream that keeps what each request brought; its stream's second part waits for the gate."""
    seen: dict[str, Any] = {}
    gate = asyncio.Event()

    async def whole(request: web.Request) -> web.Response:
        seen.update(path=request.raw_path, headers=list(request.headers.items()), body=await request.read())
        response = web.Response(status=201, body=BODY, content_type="application/json")
        response.headers.add("X-Multi", "one")
        response.headers.add("X-Multi", "two")
        return response

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.update(path=request.raw_path, headers=list(request.headers.items()), body=await request.read())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": "req_9"})
        await response.prepare(request)
        await response.write(SSE[0])
        await asyncio.wait_for(gate.wait(), RECEIVE_TIMEOUT_S)  # until the client has the first part
        await response.write(SSE[1])
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", stream)
    app.router.add_route("*", "/v1/files/{tail:.*}", whole)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen, gate
    finally:
        await runner.cleanup()


def _sent(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in headers if k.lower().startswith("x-") or k.lower() == "authorization"]


async def test_a_request_and_its_response_pass_byte_for_byte(tmp_path: Path) -> None:
    path = "/v1/files/file%2F1?purpose=a%20b&x=%2F&x=2"
    headers = [("Authorization", "Bearer sk-x"), ("X-Multi", "a"), ("X-Multi", "b"), ("X-Client", "é")]
    results = []
    async with upstream() as (origin, seen, _):
        for base in (origin, None):
            async with contextlib.AsyncExitStack() as stack:
                if base is None:
                    base = (await stack.enter_async_context(recording(origin, tmp_path)))[0].removesuffix("/v1")
                session = await stack.enter_async_context(aiohttp.ClientSession(auto_decompress=False))
                url = aiohttp.client.URL(base + path, encoded=True)
                async with session.put(url, data=b"\x00raw\xff", headers=aiohttp.client.CIMultiDict(headers)) as r:
                    results.append((r.status, r.headers.getall("X-Multi"), r.content_type, await r.read()))
                results.append((seen["path"], _sent(seen["headers"]), seen["body"]))
    direct, proxied = results[:2], results[2:]
    assert proxied == direct
    assert direct == [
        (201, ["one", "two"], "application/json", BODY),
        (path, [(k.lower(), v) for k, v in headers], b"\x00raw\xff"),
    ]
    assert not (tmp_path / "capture.jsonl").read_text()  # not a create: no line


async def test_an_sse_stream_passes_byte_for_byte_each_part_as_it_comes(tmp_path: Path) -> None:
    async with upstream() as (origin, seen, gate), recording(origin, tmp_path) as (base, _):
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{base}/responses", data=REQUEST, headers={"Content-Type": "application/json"}
            ) as r:
                got = b""
                while not got.endswith(b"\r\n\r\n" + CREATED):  # the first part, while the upstream holds the rest
                    got += await asyncio.wait_for(r.content.readany(), RECEIVE_TIMEOUT_S)
                gate.set()
                got += await asyncio.wait_for(r.content.read(), RECEIVE_TIMEOUT_S)
                assert r.headers["X-Request-Id"] == "req_9" and r.content_type == "text/event-stream"
    assert got == SSE[0] + SSE[1]
    assert seen["body"] == REQUEST
    [line] = recorded_lines(tmp_path, "capture.jsonl")
    assert line["response_id"] == "resp_1" and line["usage"]["input_tokens"] == 5 and "failed" not in line
    assert line["request_bytes"] == len(REQUEST) and line["sent_at"] <= line["first_token_at"] <= line["done_at"]
