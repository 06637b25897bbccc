"""`prototype.serve.wallclock` and the live server's keepalives: the timers on the virtual clock
(a frame moves the deadline, a stop ends them), aiohttp's pings at `--ws-ping-interval-s`, SSE
comments at `sse_keepalive_s`, and the idle timeout refused by the live server in one line."""

from __future__ import annotations

import math

import aiohttp
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.serve.app import LIVE_IDLE_TIMEOUT, make_app
from prototype.serve.wallclock import SSE_COMMENT, AsyncioClock, IdleCut, IdleWatch, Keepalive
from prototype.server import main
from prototype.store.memory import MemoryStore
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.runtime.virtual import VirtualClock, run_virtual
from tests.support import RECEIVE_TIMEOUT_S, live_server, served


async def _watch_and_pings() -> tuple[list[IdleCut], list[float]]:
    clock = VirtualClock()
    cuts: list[IdleCut] = []
    watch = IdleWatch(10.0, cuts.append, kind="websocket", mode="ws")
    pings: list[float] = []
    keepalive = Keepalive(4.0, lambda: pings.append(clock.now()))
    await clock.sleep_until(6.0)
    watch.frame()  # the deadline moves to 16
    keepalive.heard()  # the next ping to 10
    await clock.sleep_until(15.9)
    assert cuts == []
    await clock.sleep_until(29.0)
    keepalive.stop()
    await clock.sleep_until(60.0)
    return cuts, pings


def test_a_frame_moves_the_deadline_and_a_keepalive_follows_the_last_one_heard() -> None:
    cuts, pings = run_virtual(_watch_and_pings(), charge_cpu=False)
    assert cuts == [IdleCut(kind="websocket", mode="ws", opened_s=0.0, last_frame_s=6.0, cut_s=16.0)]
    assert pings == [4.0, 10.0, 14.0, 18.0, 22.0, 26.0]  # none after the stop


def test_intervals_must_be_positive() -> None:
    async def make() -> None:
        with pytest.raises(ValueError):
            IdleWatch(0.0, lambda _: None, kind="sse", mode="http")
        with pytest.raises(ValueError):
            Keepalive(0.0, lambda: None)

    run_virtual(make(), charge_cpu=False)


async def test_the_live_server_pings_a_silent_websocket_at_its_interval() -> None:
    config = ServerConfig(websocket=WebSocketConfig(ping_interval_s=0.05))
    async with live_server(config=config) as live, aiohttp.ClientSession() as session:
        async with session.ws_connect(live.ws_url, autoping=False) as ws:
            msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg.type is aiohttp.WSMsgType.PING
            await ws.pong(msg.data)


async def test_without_an_interval_the_live_server_sends_no_ping() -> None:
    async with live_server() as live, aiohttp.ClientSession() as session:
        async with session.ws_connect(live.ws_url, autoping=False) as ws:
            # A frame the server answers: anything before it would be a ping.
            await ws.send_str("not json")
            msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg.type is aiohttp.WSMsgType.TEXT and '"error"' in msg.data


async def test_a_live_sse_stream_silent_before_its_first_token_carries_comments() -> None:
    clock = AsyncioClock()
    model = SimulatedModel(
        clock=clock, policy=DefaultPolicy(tool_calls=0), seed=0, decode_tok_per_s=math.inf, model_latency_s=0.3
    )
    config = ServerConfig(sse_keepalive_s=0.05)
    app = make_app(model=model, store=MemoryStore(), clock=clock, config=config)
    async with served(app) as port, aiohttp.ClientSession() as session:
        body = {"model": "sim", "input": "hi", "stream": True}
        async with session.post(f"http://127.0.0.1:{port}/v1/responses", json=body) as resp:
            text = await resp.read()
    assert SSE_COMMENT in text
    # A comment is a whole chunk between events, and the stream still ends with its terminal event.
    assert b"\n\n" + SSE_COMMENT in text and b"response.completed" in text.rsplit(SSE_COMMENT, 1)[1]


def test_the_live_server_refuses_an_idle_timeout_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--idle-timeout-s", "40"]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m prototype.server: invalid option: {LIVE_IDLE_TIMEOUT}\n"
    with pytest.raises(ValueError, match="intermediary"):
        make_app(
            model=SimulatedModel(clock=AsyncioClock(), policy=DefaultPolicy(tool_calls=0)),
            store=MemoryStore(),
            clock=AsyncioClock(),
            config=ServerConfig(idle_timeout_s=40.0),
        )
