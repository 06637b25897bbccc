"""`sim.client.agents_client`: a tool that outlives the server's pause timeout, through the Agents
API's routes (the in-process transport) on a virtual clock. The turn fails with `request_timeout`
while the tool runs; the rollout reports that, not the refusal of the results posted after it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.store.memory import MemoryStore
from sim.client.agents_client import AgentsClient
from sim.client.loop import run_rollout
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.result import ClientError, RolloutResult, error_line
from sim.rollout.spec import make_spec
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual

PAUSE_S = 5.0


Outcome = tuple[RolloutResult | ClientError, dict[str, Any] | None]


def _run(tool_s: float) -> Outcome:
    """One `agents` rollout of two calls of `tool_s` each against a server whose pause times out
    after `PAUSE_S`: what it returned or raised, and then the last turn as the server keeps it."""
    clock = VirtualClock()
    model = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=2), seed=3, decode_tok_per_s=math.inf)
    config = ServerConfig(websocket=WebSocketConfig(append_timeout_s=PAUSE_S))
    server = InProcessServer(config, model=model, store=MemoryStore(), clock=clock, seed=3)
    client = server.client("agents", clock)
    assert isinstance(client, AgentsClient)
    spec = make_spec(3, 0, max_turns=2, tool_time_median_s=tool_s, tool_time_sigma=0.0, tool_output_median_tokens=50)

    async def go() -> Outcome:
        try:
            outcome: RolloutResult | ClientError = await run_rollout(client, clock, spec, model="sim")
        except ClientError as exc:
            outcome = exc
        try:
            assert client.session_id is not None and client.turn_id is not None
            return outcome, await client._turn(client.session_id, client.turn_id)
        finally:
            await client.close()
            await server.close()

    return run_virtual(go(), charge_cpu=False)


def test_a_tool_past_the_pause_timeout_reports_the_turns_request_timeout() -> None:
    outcome, turn = _run(tool_s=2 * PAUSE_S)
    assert isinstance(outcome, ClientError)
    line = error_line(outcome)
    assert line.startswith("400 request_timeout: turn ") and "Unknown pending tool call" not in line
    assert turn is not None and turn["status"] == "failed"  # the server's record of the turn agrees
    assert turn["error"]["code"] == "request_timeout" and turn["error"]["message"] in outcome.body["message"]


def test_a_tool_within_the_pause_timeout_completes_the_rollout() -> None:
    outcome, turn = _run(tool_s=PAUSE_S / 2)
    assert isinstance(outcome, RolloutResult)
    assert [t.response.status for t in outcome.turns] == ["in_progress", "in_progress", "completed"]
    assert turn is not None and turn["status"] == "completed"


@pytest.mark.parametrize("status", [404, 409])
def test_any_other_refusal_of_the_results_is_reported_as_it_came(status: int) -> None:
    """Only the unknown-call refusal is read as the turn's end; nothing else is reinterpreted."""
    refused = ClientError(status, {"error": {"type": "invalid_request_error", "code": "x", "message": "no"}})
    client = AgentsClient("http://localhost:1/v1", VirtualClock())
    assert run_virtual(client._ended_under(refused), charge_cpu=False) is refused
