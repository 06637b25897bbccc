"""The recording proxy's `--idle-timeout-s` (sim/record/proxy.py): the live path's intermediary. A
silent WebSocket or SSE stream is dropped under its client; the upstream's pings and SSE comments
keep one open. The frames the tests wait for come in milliseconds; each read is bounded."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from prototype.config import ServerConfig, WebSocketConfig
from prototype.serve.app import make_app
from prototype.serve.wallclock import SSE_COMMENT, AsyncioClock
from prototype.store.memory import MemoryStore
from sim.__main__ import main
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.record.proxy import Recorder, make_recorder_app
from tests.support import RECEIVE_TIMEOUT_S, served

IDLE_S = 0.2  # where a cut is expected: the silence lasts ten times as long
KEPT_IDLE_S = 1.0  # where none is: keepalives twenty times as often (a loaded machine's timers run late)
SILENCE_S = 10 * IDLE_S


@contextlib.asynccontextmanager
async def _proxied(
    tmp_path: Path, config: ServerConfig, *, latency_s: float = 0.0, idle_s: float = IDLE_S
) -> AsyncIterator[tuple[int, Recorder]]:
    """A live server (its model `latency_s` before the first token) behind the proxy with an idle timeout."""
    clock = AsyncioClock()
    model = SimulatedModel(
        clock=clock, policy=DefaultPolicy(tool_calls=0), seed=0, decode_tok_per_s=math.inf, model_latency_s=latency_s
    )
    app = make_app(model=model, store=MemoryStore(), clock=clock, config=config)
    async with served(app) as port:
        recorder = Recorder(f"http://127.0.0.1:{port}", tmp_path, idle_timeout_s=idle_s)
        runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield runner.addresses[0][1], recorder
        finally:
            await runner.cleanup()


async def test_a_silent_websocket_is_dropped_under_its_client(tmp_path: Path) -> None:
    async with _proxied(tmp_path, ServerConfig()) as (port, recorder), aiohttp.ClientSession() as session:
        async with session.ws_connect(f"ws://127.0.0.1:{port}/v1/responses") as ws:
            msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR)
            assert ws.close_code == aiohttp.WSCloseCode.ABNORMAL_CLOSURE  # no close frame: the connection dropped
    [cut] = recorder.cuts
    assert cut.kind == "websocket" and cut.cut_s - cut.last_frame_s >= IDLE_S


async def test_the_upstreams_pings_pass_through_and_keep_the_socket_open(tmp_path: Path) -> None:
    config = ServerConfig(websocket=WebSocketConfig(ping_interval_s=KEPT_IDLE_S / 20))
    async with (
        _proxied(tmp_path, config, idle_s=KEPT_IDLE_S) as (port, recorder),
        aiohttp.ClientSession() as session,
    ):
        async with session.ws_connect(f"ws://127.0.0.1:{port}/v1/responses", autoping=False) as ws:
            for _ in range(40):  # two timeouts' worth of pings
                msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
                assert msg.type is aiohttp.WSMsgType.PING
                await ws.pong(msg.data)
            await ws.send_str("not json")  # still open: the server answers
            msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
            while msg.type is aiohttp.WSMsgType.PING:
                msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg.type is aiohttp.WSMsgType.TEXT and json.loads(msg.data)["type"] == "error"
    assert recorder.cuts == []


async def test_an_sse_stream_silent_before_its_first_token_is_cut_unless_the_server_sends_comments(
    tmp_path: Path,
) -> None:
    body = {"model": "sim", "input": "hi", "stream": True}
    async with _proxied(tmp_path, ServerConfig(), latency_s=SILENCE_S) as (port, recorder):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/responses", json=body) as resp:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
        assert [c.kind for c in recorder.cuts] == ["sse"]
    line = json.loads((tmp_path / "capture.jsonl").read_text().splitlines()[-1])
    assert line["failed"] == "idle timeout"
    config = ServerConfig(sse_keepalive_s=KEPT_IDLE_S / 20)
    async with _proxied(tmp_path / "kept", config, latency_s=SILENCE_S, idle_s=KEPT_IDLE_S) as (port, recorder):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/responses", json=body) as resp:
                text = await resp.read()
        assert SSE_COMMENT in text and b"response.completed" in text and recorder.cuts == []


def test_a_negative_timeout_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["record", "--upstream", "http://127.0.0.1:9", "--out", "unused", "--idle-timeout-s", "-1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
