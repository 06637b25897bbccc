"""`sim.runtime.inprocess`: the in-process server's run mode is its own setting, passed down to
what it composes and to its transports, never read off the event loop."""

from __future__ import annotations

import math

import pytest

from prototype.config import ServerConfig
from prototype.store.memory import MemoryStore
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import LiveCosts, VirtualClock, run_virtual
from tests.support import EXEC_TOOL

# A request's live cost far above any CPU work a turn does here: charged or not is plain.
COSTS = LiveCosts(http_request=1_000.0, http_request_after_wait=1_000.0)


def _server(clock: VirtualClock, *, charge_cpu: bool) -> InProcessServer:
    model = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=0), seed=5, decode_tok_per_s=math.inf)
    config = ServerConfig(render_threads=2)
    return InProcessServer(
        config, model=model, store=MemoryStore(), clock=clock, seed=5, charge_cpu=charge_cpu, live_costs=COSTS
    )


async def _one_turn(*, charge_cpu: bool) -> tuple[float, bool]:
    """One HTTP turn's time, and whether the server tokenizes on render threads."""
    clock = VirtualClock()
    server = _server(clock, charge_cpu=charge_cpu)
    client = server.client("http", clock)
    try:
        result = await client.turn([{"role": "user", "content": "hi"}], model="sim", tools=[EXEC_TOOL])
    finally:
        await client.close()
        await server.close()
    return result.e2e_s, server.engine.render_executor is not None


def test_on_a_loop_that_charges_cpu_the_servers_setting_decides_what_is_charged() -> None:
    charged, threads = run_virtual(_one_turn(charge_cpu=True), charge_cpu=True)
    assert charged >= COSTS.http_request and threads
    free, threads = run_virtual(_one_turn(charge_cpu=False), charge_cpu=True)
    assert free < COSTS.http_request and not threads


def test_a_setting_that_contradicts_the_loop_is_refused_not_ignored() -> None:
    with pytest.raises(RuntimeError, match="only where CPU is charged"):
        run_virtual(_one_turn(charge_cpu=True), charge_cpu=False)
