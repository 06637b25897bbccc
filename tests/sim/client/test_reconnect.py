"""`sim.client.reconnect`: a rollout longer than the connection limit, on a virtual clock with a
short limit (never a wall-clock wait): it continues on new sockets with `store: true`, fails with the
API's `previous_response_not_found` with `store: false`, and each move is recorded."""

from __future__ import annotations

import math
from typing import Any

import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.store.memory import MemoryStore
from prototype.wire.schemas import StageReport
from sim.client.loop import run_rollout
from sim.client.reconnect import RotatingClient
from sim.client.websocket import WSClient
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.result import ClientError, RolloutResult, TurnResult
from sim.rollout.spec import make_spec
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual

LIFETIME_S = 30.0
CALLS = 8
SHORT = WebSocketConfig(lifetime_s=LIFETIME_S)
LONG = WebSocketConfig(lifetime_s=3600.0)


async def _rollout(
    mode: str,
    *,
    store: bool,
    margin_s: float,
    tool_s: float = 10.0,
    assumed_s: float = LIFETIME_S,
    enabled: bool = True,
    server: WebSocketConfig = SHORT,
) -> RolloutResult:
    """One rollout of `CALLS` tool calls of `tool_s` each (8 × 10 s: past the 30 s limit); the
    client takes the limit to be `assumed_s`."""
    clock = VirtualClock()
    model = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=CALLS), seed=3, decode_tok_per_s=math.inf)
    api = InProcessServer(ServerConfig(websocket=server), model=model, store=MemoryStore(), clock=clock, seed=3)
    inner = api.client(mode, clock)  # type: ignore[arg-type]
    assert isinstance(inner, WSClient)
    client = RotatingClient(inner, clock, assumed_s, margin_s, enabled=enabled)
    spec = make_spec(
        3, 0, max_turns=CALLS, tool_time_median_s=tool_s, tool_time_sigma=0.0, tool_output_median_tokens=50
    )
    try:
        return await run_rollout(client, clock, spec, model="sim", store=store)
    finally:
        await client.close()
        await api.close()


def run(mode: str, **kw: Any) -> RolloutResult:
    return run_virtual(_rollout(mode, **kw), charge_cpu=False)


def _rendered(turn: TurnResult) -> int:
    report = turn.response.longrun
    assert isinstance(report, StageReport)
    return report.tokens_rendered


def _completed(result: RolloutResult) -> bool:
    return len(result.turns) == CALLS + 1 and result.turns[-1].response.status == "completed"


@pytest.mark.parametrize("mode", ["ws", "append", "inject"])
@pytest.mark.parametrize("margin_s", [0.0, 15.0])
def test_a_rollout_past_the_limit_completes_on_new_sockets_with_store_true(mode: str, margin_s: float) -> None:
    result = run(mode, store=True, margin_s=margin_s)
    assert result.completion_s > LIFETIME_S and _completed(result)
    # A socket lives at most the limit: one move per 30 s of an 80 s rollout at least.
    assert len(result.reconnects) >= 2
    expected = "rotate" if mode == "ws" else "cut"  # a paused response cannot rotate: the limit cuts it
    assert {r.reason for r in result.reconnects} == {expected}
    if mode != "inject":  # the beta's turns pause without a stage report
        assert all(r.connection_cache == "miss" for r in result.reconnects)  # loaded from the store
    if mode == "ws":  # (an append response's report sums its segments)
        # A cold connection cache: the turn renders the whole context again, the same turn on a
        # socket that lives on only its new items.
        warm = run(mode, store=True, margin_s=margin_s, server=LONG, assumed_s=LONG.lifetime_s)
        assert warm.reconnects == []
        assert all(r.tokens_rendered > _rendered(warm.turns[r.turn]) for r in result.reconnects)


def test_rotation_happens_the_margin_before_the_limit() -> None:
    result = run("ws", store=True, margin_s=15.0)
    assert [round(r.at) for r in result.reconnects] == [20, 40, 60, 80]  # each socket's age ≥ 15 s


@pytest.mark.parametrize("mode", ["ws", "append"])
def test_a_client_unaware_of_the_limit_reconnects_on_its_error(mode: str) -> None:
    result = run(mode, store=True, margin_s=0.0, assumed_s=LONG.lifetime_s, tool_s=11.0)
    assert _completed(result)
    assert {r.reason for r in result.reconnects} == ({"limit"} if mode == "ws" else {"cut"})


def test_a_pause_past_its_timeout_restarts_on_the_same_socket_even_without_the_store() -> None:
    config = WebSocketConfig(lifetime_s=3600.0, append_timeout_s=5.0)
    result = run("append", store=False, margin_s=60.0, assumed_s=3600.0, server=config)
    assert _completed(result)
    assert [r.reason for r in result.reconnects] == ["restart"] * CALLS  # every 10 s tool outlives the 5 s pause
    assert all(r.connection_cache == "hit" for r in result.reconnects)


@pytest.mark.parametrize("mode", ["ws", "append", "inject"])
def test_a_client_that_does_not_reconnect_fails_with_the_limit_not_a_short_rollout(mode: str) -> None:
    with pytest.raises(ClientError) as caught:
        run(mode, store=True, margin_s=15.0, enabled=False)
    assert caught.value.body["code"] == "websocket_connection_limit_reached"


def test_a_rollout_within_the_limit_never_moves() -> None:
    result = run("append", store=False, margin_s=5.0, tool_s=1.0)
    assert _completed(result) and result.reconnects == []


@pytest.mark.parametrize("mode", ["ws", "append", "inject"])
def test_with_store_false_the_chain_ends_as_the_api_says(mode: str) -> None:
    with pytest.raises(ClientError) as caught:
        run(mode, store=False, margin_s=15.0)
    assert caught.value.body["code"] == "previous_response_not_found"
