"""`python -m sim record`: openai-python through the recording proxy in front of the real app.

Each client's stream through the proxy is the one it gets without it (a fresh server on the same
seed each time), the capture has a line per request with the mode it saw, and calibration reads
it. Faults: an upstream that is down gives a 502 in the API's shape and a failed line."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from openai import APIError, AsyncOpenAI, BadRequestError, InternalServerError

from prototype.wire.schemas import OutputTextDelta, Response, ResponseCreated, encode
from prototype.wire.sse import encode_event
from sim.__main__ import main
from sim.analysis.records import read_records
from tests.processes import free_port
from tests.recording import (
    Flow,
    check_recording,
    http_flow,
    http_prev_flow,
    lanes_flow,
    normalised,
    recorded_lines,
    recording,
    ws_flow,
)
from tests.support import RECEIVE_TIMEOUT_S, live_server, receive_event


async def _run(flow: Flow, prompt: str, *, out: Path | None) -> list[str]:
    """The client's stream (normalised) on a fresh server of one seed, direct or through the recorder."""
    async with live_server(tool_calls=2, seed=7) as live:
        if out is None:
            base = live.base_url
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
                return normalised(await flow(c, prompt))
        async with recording(f"http://127.0.0.1:{live.port}", out) as (base, _):
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
                return normalised(await flow(c, prompt))


def _lines(out: Path) -> list[dict[str, Any]]:
    return recorded_lines(out, "capture.jsonl")


@pytest.mark.parametrize(
    ("flow", "modes"),
    [
        (http_flow, [["http"] * 3]),
        (http_prev_flow, [["http", "http_prev", "http_prev"]]),
        (ws_flow, [["ws"] * 3]),
        pytest.param(lanes_flow, [["ws"] * 3] * 2, marks=pytest.mark.slow),
    ],
)
async def test_a_client_runs_unchanged_through_the_recorder(tmp_path: Path, flow: Flow, modes: list[list[str]]) -> None:
    direct = await _run(flow, "List the files.", out=None)
    proxied = await _run(flow, "List the files.", out=tmp_path)
    assert proxied == direct  # every event whole, ids and times aside
    assert sum('.delta"' in event for event in direct) > 10  # the streams carried tokens
    conversations = check_recording(tmp_path, modes)
    if flow is lanes_flow:  # each lane its own conversation, both on the one connection
        assert {line["connection"] for conv in conversations for line in conv} == {1}
    # Calibration reads the capture whole.
    records = read_records([tmp_path / "capture.jsonl"])
    assert sorted((r.rollout, r.mode, r.turn) for r in records) == sorted(
        (line["conversation"], "http_prev" if "http_prev" in m else line["mode"], line["turn"])
        for conv, m in zip(conversations, modes, strict=True)
        for line in conv
    )


def test_the_comparison_sees_a_changed_event() -> None:
    """Negative control of `normalised`: ids and times aside, any changed byte of payload shows."""
    event = {"type": "response.output_text.delta", "item_id": "msg_" + "0" * 32, "delta": "Hel", "sequence_number": 3}
    again = {**event, "item_id": "msg_" + "1" * 32}
    assert normalised([event]) == normalised([again])
    assert normalised([event]) != normalised([{**event, "delta": "Hal"}])
    assert normalised([event]) != normalised([{**event, "sequence_number": 4}])
    assert normalised([event, event]) != normalised([event, again])  # one id twice is not two ids


async def test_calibrate_accepts_a_recorded_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with live_server(tool_calls=3, seed=5) as live:
        async with recording(f"http://127.0.0.1:{live.port}", tmp_path) as (base, recorder):
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
                for k in range(4):
                    await http_flow(c, f"Conversation {k}: list the files.")
                    await ws_flow(c, f"Conversation {k}: read the logs.")
                    await http_prev_flow(c, f"Conversation {k}: fix the test.")
    lines = _lines(tmp_path)
    assert len({line["conversation"] for line in lines}) == 12 and len(lines) == 48
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 48 and summary["failed"] == 0
    # An http_prev conversation's first request names no response: the proxy saw it as `http`.
    assert summary["completed_by_mode"] == {"http": 20, "ws": 16, "http_prev": 12}
    assert summary["proxy_request_ms"]["n"] == 48 and summary["proxy_first_byte_ms"]["n"] == 48
    records = read_records([tmp_path / "capture.jsonl"])
    assert sorted({(r.mode, r.rollout) for r in records if r.turn == 0 and r.ttft_s is None}) == sorted(
        {("http_prev", line["conversation"]) for line in lines if line["mode"] == "http_prev"}
    )
    # The fit leaves out the unstreamed first turns, and counts the next turns from their prompts.
    capsys.readouterr()
    assert main(["calibrate", str(tmp_path / "capture.jsonl"), "--holdout", "0.25"]) == 0
    assert "per-turn TTFT" in capsys.readouterr().out


async def test_an_upstream_that_is_down_is_a_502_in_the_apis_shape_and_a_failed_line(tmp_path: Path) -> None:
    async with recording(f"http://127.0.0.1:{free_port()}", tmp_path) as (base, _):
        async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
            with pytest.raises(InternalServerError) as info:
                await c.responses.create(model="sim", input="hello", stream=True)
    assert info.value.status_code == 502
    body: Any = info.value.body
    assert body["type"] == "server_error" and body["code"] == "upstream_unavailable" and body["message"]
    [line] = _lines(tmp_path)
    assert line["failed"] == "upstream unreachable" and line["mode"] == "http" and "usage" not in line
    assert read_records([tmp_path / "capture.jsonl"]) == []  # calibration skips it


@contextlib.asynccontextmanager
async def cut_upstream(*, close: bool) -> AsyncIterator[tuple[str, asyncio.Future[str]]]:
    """An upstream that streams `response.created` and one delta, then closes the connection
    (`close`) or waits for ever; the future says how its handler ended."""
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        started = Response(id="resp_1", created_at=0, status="in_progress", model="sim")
        created = ResponseCreated(sequence_number=0, response=started)
        delta = OutputTextDelta(sequence_number=1, item_id="msg_1", output_index=0, content_index=0, delta="Hel")
        for event in (created, delta):
            await response.write(encode_event(encode(event), event=type(event).__struct_config__.tag))  # type: ignore[arg-type]
        if close:
            assert request.transport is not None
            request.transport.close()
            ended.set_result("closed")
            return response
        try:
            await asyncio.Event().wait()  # until the proxy cancels it
        except asyncio.CancelledError:
            ended.set_result("cancelled")
            raise
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", ended
    finally:
        await runner.cleanup()


async def test_an_upstream_closing_mid_stream_gives_the_client_an_error_event_and_a_failed_line(tmp_path: Path) -> None:
    async with cut_upstream(close=True) as (upstream, _), recording(upstream, tmp_path) as (base, _):
        async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
            stream = await c.responses.create(model="sim", input="hello", stream=True)
            seen: list[str] = []
            with pytest.raises(APIError) as info:  # openai-python raises the stream's `error` event
                async for event in stream:
                    seen.append(event.type)
    assert seen == ["response.created", "response.output_text.delta"]
    body: Any = info.value.body
    assert body["code"] == "upstream_unavailable" and body["type"] == "server_error" and body["message"]
    [line] = _lines(tmp_path)
    assert line["failed"].startswith("upstream closed mid-stream") and line["response_id"] == "resp_1"
    assert line["sent_at"] <= line["first_token_at"] <= line["done_at"]


async def test_a_client_leaving_mid_stream_cancels_the_upstream(tmp_path: Path) -> None:
    async with cut_upstream(close=False) as (upstream, ended), recording(upstream, tmp_path) as (base, _):
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{base}/responses", json={"model": "sim", "input": "hi", "stream": True})
            async for chunk in response.content.iter_any():
                if b"output_text.delta" in chunk:
                    break
            response.close()  # the client goes away mid-stream
        assert await asyncio.wait_for(ended, RECEIVE_TIMEOUT_S) == "cancelled"
    [line] = _lines(tmp_path)
    assert line["failed"] == "client disconnected" and "first_token_at" in line


async def test_an_upstream_closing_a_websocket_mid_response_gives_an_error_frame_and_a_failed_line(
    tmp_path: Path,
) -> None:
    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()  # the create
        started = Response(id="resp_1", created_at=0, status="in_progress", model="sim")
        await ws.send_str(encode(ResponseCreated(sequence_number=0, response=started)).decode())
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/v1/responses", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        upstream = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with recording(upstream, tmp_path) as (base, _), aiohttp.ClientSession() as session:
            async with session.ws_connect(base.replace("http", "ws", 1) + "/responses") as ws:
                await ws.send_str(json.dumps({"type": "response.create", "model": "sim", "input": "hi"}))
                created = await receive_event(ws)
                error = await receive_event(ws)
    finally:
        await runner.cleanup()
    assert created["type"] == "response.created"
    assert error["type"] == "error" and error["status"] == 502
    assert error["error"]["code"] == "upstream_unavailable"
    [line] = _lines(tmp_path)
    assert line["mode"] == "ws" and line["failed"] == "upstream closed mid-response"


async def test_an_upstream_error_status_passes_through_and_its_line_is_failed(tmp_path: Path) -> None:
    async with live_server(tool_calls=0, seed=1) as live:
        async with recording(f"http://127.0.0.1:{live.port}", tmp_path) as (base, _):
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
                with pytest.raises(BadRequestError) as info:
                    await c.responses.create(model="sim", input="hi", previous_response_id="resp_missing")
    body: Any = info.value.body
    assert body["param"] == "previous_response_id"
    [line] = _lines(tmp_path)
    assert line["failed"] == "http 400" and line["mode"] == "http_prev"
