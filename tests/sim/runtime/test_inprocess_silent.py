"""`sim.runtime.inprocess` with an intermediary's idle timeout and the server's keepalives, on
the virtual clock: a silent socket is cut at the stated time, a keepalive prevents it, and a
stream that carries frames is never cut however long it lasts."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.serve.wallclock import IdleCut
from prototype.store.memory import MemoryStore
from sim.client.loop import run_rollout
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.result import Mode, RolloutResult
from sim.rollout.spec import RolloutSpec
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual

IDLE_S = 40.0
TOOL_S = 50.0  # one tool call, longer than the idle timeout


def _spec(tool_s: float = TOOL_S) -> RolloutSpec:
    return RolloutSpec(index=0, seed=0, task="Fix the failing test.", tool_times_s=(tool_s,), tool_outputs=("ok",))


async def _rollout(
    mode: Mode, config: ServerConfig, *, tool_s: float = TOOL_S, **model: Any
) -> tuple[RolloutResult | BaseException, InProcessServer, float]:
    """One rollout of one tool call: its result or the error it ended in, the server, the time it ended."""
    clock = VirtualClock()
    sim = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=1), seed=1, **model)
    server = InProcessServer(config, model=sim, store=MemoryStore(), clock=clock, seed=1)
    client = server.client(mode, clock)
    outcome: RolloutResult | BaseException
    try:
        outcome = await run_rollout(client, clock, _spec(tool_s), model="sim")
    except (aiohttp.ClientError, OSError) as exc:
        outcome = exc
    finally:
        await client.close()
        await server.close()
    return outcome, server, clock.now()


def _run(mode: Mode, config: ServerConfig, **kw: Any) -> tuple[RolloutResult | BaseException, InProcessServer, float]:
    return run_virtual(_rollout(mode, config, **kw), charge_cpu=False)


@pytest.mark.parametrize("mode", ["ws", "append", "inject"])
def test_a_socket_silent_through_a_tool_call_is_cut_at_the_timeout(mode: Mode) -> None:
    outcome, server, ended = _run(mode, ServerConfig(idle_timeout_s=IDLE_S))
    [cut] = server.cuts
    assert (cut.kind, cut.mode) == ("websocket", mode)
    assert cut.cut_s - cut.last_frame_s == IDLE_S  # exactly, on the virtual clock
    # The client finds out when it sends the tool's output, as aiohttp's and websockets' do.
    assert isinstance(outcome, aiohttp.ClientConnectionResetError)
    assert ended == pytest.approx(cut.last_frame_s + TOOL_S, abs=1e-6)


@pytest.mark.parametrize("mode", ["ws", "append"])
def test_server_pings_keep_a_silent_socket_open(mode: Mode) -> None:
    config = ServerConfig(idle_timeout_s=IDLE_S, websocket=WebSocketConfig(ping_interval_s=20.0))
    outcome, server, _ = _run(mode, config)
    assert isinstance(outcome, RolloutResult) and len(outcome.turns) == 2
    assert server.cuts == []
    assert server.keepalives == 2  # 20 s and 40 s into the 50 s tool call; none while frames flow


def test_a_tool_call_shorter_than_the_timeout_is_not_cut() -> None:
    outcome, server, _ = _run("ws", ServerConfig(idle_timeout_s=IDLE_S), tool_s=IDLE_S - 1)
    assert isinstance(outcome, RolloutResult) and server.cuts == []


def test_an_http_request_that_streams_deltas_is_not_cut_however_long_it_lasts() -> None:
    # 1 token/s: the turn's stream lasts well past the timeout, a delta at least every second.
    outcome, server, _ = _run("http", ServerConfig(idle_timeout_s=5.0), tool_s=IDLE_S * 2, decode_tok_per_s=1.0)
    assert isinstance(outcome, RolloutResult) and len(outcome.turns) == 2
    assert outcome.turns[0].e2e_s > 5.0 * 2
    assert server.cuts == []  # and the tool time between requests holds no stream open


def test_an_http_stream_silent_past_the_timeout_is_cut_and_sse_comments_prevent_it() -> None:
    # 60 s before the first token: the stream carries response.created, then nothing.
    outcome, server, _ = _run("http", ServerConfig(idle_timeout_s=IDLE_S), model_latency_s=60.0)
    assert isinstance(outcome, aiohttp.ClientPayloadError)
    [cut] = server.cuts
    assert (cut.kind, cut.cut_s - cut.last_frame_s) == ("sse", IDLE_S)
    outcome, server, _ = _run("http", ServerConfig(idle_timeout_s=IDLE_S, sse_keepalive_s=15.0), model_latency_s=60.0)
    assert isinstance(outcome, RolloutResult) and server.cuts == []
    assert server.keepalives >= 60.0 // 15.0


def test_an_agents_session_stream_silent_through_a_tool_call_is_cut_and_comments_prevent_it() -> None:
    outcome, server, _ = _run("agents", ServerConfig(idle_timeout_s=IDLE_S))
    assert isinstance(outcome, aiohttp.ClientPayloadError)
    assert [c.kind for c in server.cuts] == ["sse"]
    outcome, server, _ = _run("agents", ServerConfig(idle_timeout_s=IDLE_S, sse_keepalive_s=15.0))
    assert isinstance(outcome, RolloutResult) and server.cuts == []


def test_without_the_switch_nothing_is_watched() -> None:
    outcome, server, _ = _run("ws", ServerConfig(), tool_s=600.0)
    assert isinstance(outcome, RolloutResult) and server.cuts == [] and server.keepalives == 0


def test_a_cut_is_a_record_with_named_fields() -> None:
    cut = IdleCut(kind="websocket", mode="ws", opened_s=0.0, last_frame_s=1.0, cut_s=41.0)
    assert cut.cut_s - cut.last_frame_s == IDLE_S
