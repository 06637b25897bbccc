"""Timing frames (`responsesapi.websocket_timing`): only on request, before each terminal (or
pause) event, with the fields Codex CLI reads and numbers that add up (docs/protocol.md,
"Timing frames")."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from prototype.wire.schemas import TimingMetrics
from prototype.ws.timing import TIMING_HEADER, wants_timing
from tests.support import EXEC_TOOL, Live, live_server

# The six fields openai/codex's SessionTelemetry reads from `timing_metrics`
# (codex-rs/otel: record_responses_websocket_timing_metrics), each a millisecond duration.
CODEX_FIELDS = {
    "responses_duration_excl_engine_and_client_tool_time_ms",
    "engine_service_total_ms",
    "engine_iapi_ttft_total_ms",
    "engine_service_ttft_total_ms",
    "engine_iapi_tbt_across_engine_calls_ms",
    "engine_service_tbt_across_engine_calls_ms",
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


async def _turns(ws: aiohttp.ClientWebSocketResponse, *, append: bool, turns: int) -> list[list[dict[str, Any]]]:
    """Run a tool loop of `turns` model turns; the frames of each turn, in order."""
    out: list[list[dict[str, Any]]] = []
    await ws.send_str(
        json.dumps({"type": "response.create", "model": "sim", "input": "go", "tools": [EXEC_TOOL], "store": False})
    )
    previous = None
    for _ in range(turns):
        frames: list[dict[str, Any]] = []
        while True:
            msg = await asyncio.wait_for(ws.receive(), 30)
            assert msg.type is aiohttp.WSMsgType.TEXT, msg
            frames.append(json.loads(msg.data))
            if frames[-1]["type"] in TERMINAL or frames[-1]["type"] == "response.done":
                break
        out.append(frames)
        last = frames[-1]
        if last["type"] != "response.done" and not any(
            f["type"] == "response.output_item.done" and f["item"]["type"] == "function_call" for f in frames
        ):
            break
        calls = [
            f["item"]["call_id"]
            for f in frames
            if f["type"] == "response.output_item.done" and f["item"]["type"] == "function_call"
        ]
        outputs = [{"type": "function_call_output", "call_id": c, "output": "ok"} for c in calls]
        if append:
            frame = {"type": "response.append", "response_id": last["response"]["id"], "input": outputs}
        else:
            previous = last["response"]["id"]
            frame = {
                "type": "response.create",
                "model": "sim",
                "previous_response_id": previous,
                "input": outputs,
                "tools": [EXEC_TOOL],
                "store": False,
            }
        await ws.send_str(json.dumps(frame))
    return out


@pytest.fixture
async def live() -> Any:
    async with live_server(tool_calls=2) as server:
        yield server


def _check(timing: dict[str, Any]) -> TimingMetrics:
    assert set(timing) == {"type", "timing_metrics"} and timing["type"] == "responsesapi.websocket_timing"
    metrics = timing["timing_metrics"]
    assert set(metrics) == CODEX_FIELDS
    assert all(isinstance(v, float | int) and v >= 0 for v in metrics.values()), metrics
    m = TimingMetrics(**metrics)
    assert m.engine_service_ttft_total_ms <= m.engine_iapi_ttft_total_ms
    assert m.engine_service_ttft_total_ms <= m.engine_service_total_ms
    return m


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "True", "1"])
async def test_frames_come_before_every_terminal_when_asked(live: Live, value: str) -> None:
    headers = {TIMING_HEADER: value}
    async with aiohttp.ClientSession() as session, session.ws_connect(live.ws_url, headers=headers) as ws:
        turns = await _turns(ws, append=False, turns=3)
    assert len(turns) == 3
    for frames in turns:
        kinds = [f["type"] for f in frames]
        assert kinds.count("responsesapi.websocket_timing") == 1
        assert kinds[-2] == "responsesapi.websocket_timing", kinds  # right before the terminal
        m = _check(frames[-2])
        report = frames[-1]["response"]["longrun"]
        engine_s = sum(report["stages_s"].get(k, 0.0) for k in ("queue", "prefill", "decode"))
        assert m.engine_service_total_ms == pytest.approx(1000 * engine_s)
        total_ms = m.engine_service_total_ms + m.responses_duration_excl_engine_and_client_tool_time_ms
        assert total_ms == pytest.approx(1000 * report["server_s"], rel=1e-6)  # engine + API = the server's time


@pytest.mark.parametrize("headers", [{}, {TIMING_HEADER: "false"}, {TIMING_HEADER: ""}])
async def test_no_frames_unless_asked(live: Live, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(live.ws_url, headers=headers) as ws:
        turns = await _turns(ws, append=False, turns=3)
    assert all(f["type"] != "responsesapi.websocket_timing" for frames in turns for f in frames)


async def test_a_paused_response_gets_its_parts_that_add_up(live: Live) -> None:
    url = live.ws_url + "?mode=append"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers={TIMING_HEADER: "true"}) as ws:
        turns = await _turns(ws, append=True, turns=3)
    assert [t[-1]["type"] for t in turns] == ["response.done", "response.done", "response.completed"]
    parts = [_check(t[-2]) for t in turns]
    final = turns[-1][-1]["response"]["longrun"]
    engine_s = sum(final["stages_s"].get(k, 0.0) for k in ("queue", "prefill", "decode"))
    # One response: its frames are its segments, and they add up to its whole.
    assert sum(p.engine_service_total_ms for p in parts) == pytest.approx(1000 * engine_s)
    assert sum(
        p.engine_service_total_ms + p.responses_duration_excl_engine_and_client_tool_time_ms for p in parts
    ) == pytest.approx(1000 * final["server_s"], rel=1e-6)


def test_the_header_value() -> None:
    assert wants_timing("true") and wants_timing(" TRUE ") and wants_timing("1")
    assert not wants_timing(None) and not wants_timing("false") and not wants_timing("yes please")
