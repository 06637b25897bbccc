"""Admission (`prototype/serve/admission.py`): the API key and a WebSocket upgrade's refusal or terms,
decided once for the live server and the in-process transport, so a virtual run refuses what a
live one refuses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.serve.admission import (
    APPEND_BETA,
    MULTI_AGENT_BETA,
    PLAIN,
    Slots,
    WebSocketTerms,
    admit_websocket,
    authorize,
)
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from prototype.wire.errors import ProtocolError
from prototype.ws.timing import TIMING_HEADER
from sim.client.client import open_client
from sim.harness.experiment import CompareConfig, run_compare
from sim.model.config import ModelConfig, build_model
from sim.model.policy import DefaultPolicy
from sim.rollout.result import ClientError
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual
from tests.support import live_server

REFUSE = ServerConfig(websocket=WebSocketConfig(refuse=True))
KEYED = ServerConfig(api_key="the-right-key")  # the clients send `sk-longrun`
ONE_SOCKET = ServerConfig(websocket=WebSocketConfig(max_connections=1))


def test_refuse_and_the_connection_cap_get_the_real_refusals() -> None:
    with pytest.raises(ProtocolError) as refused:
        admit_websocket(REFUSE, {}, {}, Slots(None))
    assert (refused.value.status, refused.value.code) == (426, "upgrade_required")
    slots = Slots(1)
    assert admit_websocket(ONE_SOCKET, {}, {}, slots) == PLAIN
    with pytest.raises(ProtocolError) as full:
        admit_websocket(ONE_SOCKET, {}, {}, slots)
    assert (full.value.status, full.value.code) == (503, "too_many_connections")
    slots.release()
    assert admit_websocket(ONE_SOCKET, {}, {}, slots) == PLAIN


def test_the_terms_come_from_the_upgrades_header_and_query() -> None:
    config, slots = ServerConfig(), Slots(None)
    assert admit_websocket(config, {"OpenAI-Beta": APPEND_BETA}, {}, slots) == WebSocketTerms(True, False, False)
    assert admit_websocket(config, {}, {"mode": "append"}, slots).append_mode
    assert admit_websocket(config, {"OpenAI-Beta": MULTI_AGENT_BETA}, {}, slots).beta
    assert admit_websocket(config, {}, {"mode": "beta"}, slots).beta
    assert admit_websocket(config, {TIMING_HEADER: "true"}, {}, slots).timing


def test_the_key_guards_v1_routes_only() -> None:
    authorize(KEYED, "/v1/responses", "Bearer the-right-key")
    authorize(KEYED, "/healthz", None)
    authorize(ServerConfig(), "/v1/responses", None)  # no key: nothing to check
    with pytest.raises(ProtocolError) as wrong:
        authorize(KEYED, "/v1/responses", "Bearer sk-longrun")
    assert (wrong.value.status, wrong.value.code) == (401, "invalid_api_key")


async def _refusal(client: Any) -> tuple[int, Any]:
    with pytest.raises(ClientError) as refused:
        await client.turn([{"type": "message", "role": "user", "content": "hi"}], model="sim", tools=[])
    await client.close()
    return refused.value.status, refused.value.body


@contextlib.asynccontextmanager
async def _in_process(config: ServerConfig) -> AsyncIterator[InProcessServer]:
    clock = AsyncioClock()
    model = build_model(ModelConfig(tps=0), clock=clock, policy=DefaultPolicy(tool_calls=1))
    yield InProcessServer(config, model=model, store=MemoryStore(), clock=clock)


@pytest.mark.parametrize(
    ("config", "mode"),
    [(REFUSE, "ws"), (REFUSE, "append"), (REFUSE, "inject"), *((KEYED, mode) for mode in ("ws", "http", "agents"))],
    ids=["refuse-ws", "refuse-append", "refuse-inject", "key-ws", "key-http", "key-agents"],
)
async def test_in_process_and_live_refuse_alike(config: ServerConfig, mode: str) -> None:
    """The same client, carried over loopback sockets or in process: the same refusal (HTTP and
    the Agents API answer a wrong key with the JSON error; a refused upgrade is its status)."""
    async with live_server(config=config) as live:
        over_socket = await _refusal(open_client(mode, live.base_url, AsyncioClock()))  # type: ignore[arg-type]
    async with _in_process(config) as server:
        in_process = await _refusal(server.client(mode, AsyncioClock()))  # type: ignore[arg-type]
    assert in_process == over_socket
    assert over_socket[0] == (426 if config is REFUSE else 401)


async def test_a_second_socket_past_the_cap_is_refused_in_process_as_live() -> None:
    async def second_refused(first: Any, second: Any) -> tuple[int, Any]:
        await first.turn([{"type": "message", "role": "user", "content": "hi"}], model="sim")  # holds the slot
        try:
            return await _refusal(second)
        finally:
            await first.close()

    async with live_server(config=ONE_SOCKET) as live:
        clients = [open_client("ws", live.base_url, AsyncioClock()) for _ in range(2)]
        over_socket = await second_refused(*clients)
    async with _in_process(ONE_SOCKET) as server:
        in_process = await second_refused(*(server.client("ws", AsyncioClock()) for _ in range(2)))
    assert in_process == over_socket == (503, "WebSocket upgrade refused")


def test_a_virtual_comparison_with_websocket_mode_refused_is_refused() -> None:
    """What `python -m sim compare` gets on a server that refuses WebSocket mode: the refusal a
    live client gets (before this was shared, a virtual run ignored `websocket.refuse`), as the
    rollout's failure."""
    config = CompareConfig(rollouts=1, tool_calls=1, modes=("ws",), server=msgspec.structs.replace(REFUSE))
    refused = run_virtual(run_compare(config, VirtualClock(), virtual=True), charge_cpu=False)
    assert refused.rollouts == [] and [f.error for f in refused.failed] == ["426: WebSocket upgrade refused"]
    http = msgspec.structs.replace(config, modes=("http",))
    result = run_virtual(run_compare(http, VirtualClock(), virtual=True), charge_cpu=False)
    assert result.rollouts and result.rollouts[0].turns  # HTTP is still served
