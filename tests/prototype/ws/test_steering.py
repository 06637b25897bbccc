"""Steering in the stable WebSocket mode (docs/beta.md#steering), at the default item boundary.

A `create` connection takes `response.steer` without the beta header, as openai-python 3.57's
stable `client.responses.connect()` sends it. Following the steering guide, a steer accepted while
an output item is being decoded lets that item finish: after a message the response ends
`incomplete`/`steered` and an automatic successor follows; after a function call it ends
`completed` owing the call, and the steer is pending until the create that answers it. Models
the guide lists as unable to steer get `steering_not_supported`. The token boundary (a steer cuts
the item in flight) is a switch, tested in tests/sim/harness/test_steer_mode.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

import aiohttp
import msgspec
import pytest
from openai import AsyncOpenAI

from prototype.ws.connection import Connection
from prototype.ws.events import AckSteer, StartJob
from sim.__main__ import run
from sim.harness.experiment import CompareConfig
from sim.model.policy import PlannedItem, ScriptPolicy
from tests import strict
from tests.support import EXEC_TOOL, live_server, until
from tests.support import STEER_COMPARE_BASE as BASE
from tests.support import completed_items as _completed_items
from tests.support import output_tokens as _output_tokens

MODEL: Final = "sim"
SEED: Final = 7
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
STEER_TEXT: Final = "Also check whether test_cache.py fails the same way."
TIMEOUT_S: Final = 20.0
TWO_CALLS: Final = ScriptPolicy(
    [
        [
            PlannedItem("function_call", "exec_command", json.dumps({"cmd": "ls"})),
            PlannedItem(
                "function_call", "exec_command", json.dumps({"cmd": "pytest -x tests/prototype/store/test_store.py"})
            ),
        ]
    ]
)
ENDS: Final = ("response.completed", "response.incomplete", "response.failed")


def create(**fields: Any) -> str:
    return json.dumps({"type": "response.create", "model": MODEL, **fields})


def steer(rid: str, text: str = STEER_TEXT) -> str:
    return json.dumps({"type": "response.steer", "previous_response_id": rid, "input": text})


@pytest.mark.slow
async def test_the_stable_python_client_steers_a_message_which_finishes_before_the_successor(
    wire: strict.Checker,
) -> None:
    """openai-python's stable WebSocket client, no beta header: a steer sent at the answer's first
    delta lets the message finish `completed`, ends the response `incomplete`/`steered`, and the
    automatic successor continues from it with the steer in its context."""
    async with (
        live_server(tool_calls=0, seed=SEED, decode_tok_per_s=500) as live,
        asyncio.timeout(TIMEOUT_S),
        AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0) as client,
        client.responses.connect() as conn,
    ):
        await conn.response.create(model=MODEL, input="Say hello.", instructions="Be brief.")
        seen: list[Any] = []
        ended: list[Any] = []
        deltas: dict[str, str] = {}
        current = ""
        async for event in conn:
            seen.append(event)
            if event.type == "response.created":
                current = event.response.id
            elif event.type == "response.output_text.delta":
                if not deltas:
                    await conn.response.steer(previous_response_id=current, input="In French.")
                deltas[current] = deltas.get(current, "") + event.delta
            elif event.type in ENDS:
                ended.append(event.response)
                if event.type != "response.incomplete":
                    break
    parent, successor = ended
    kinds = [e.type for e in seen]
    (accepted,) = [e for e in seen if e.type == "response.steer.accepted"]
    assert accepted.steer.previous_response_id == parent.id and accepted.steer.id.startswith("steer_")
    assert "response.steer.failed" not in kinds and "response.steer.pending" not in kinds
    assert parent.status == "incomplete" and parent.incomplete_details.reason == "steered"
    (message,) = parent.output
    # The item boundary: the message in flight when the steer came was finished, not cut.
    assert message.status == "completed" and message.content[0].text == deltas[parent.id]
    assert kinds.index("response.steer.accepted") < kinds.index("response.incomplete")
    assert successor.status == "completed" and successor.previous_response_id == parent.id
    assert successor.instructions == "Be brief." and successor.id != parent.id
    assert successor.usage.input_tokens > parent.usage.input_tokens  # the parent's answer and the steer
    assert wire.counts[strict.WS_EVENT] == len(seen) and not wire.violations


async def test_a_steer_while_a_call_is_decoded_lets_it_finish_and_waits_for_the_calls_outputs(
    wire: strict.Checker,
) -> None:
    """A steer accepted while a function call is being decoded: the call (and the rest of the
    turn) finishes, the response ends `completed` owing the calls, the steer is pending with their
    stubs, and the create that answers them carries it ahead of the outputs."""
    async with (
        live_server(policy=TWO_CALLS, seed=SEED, decode_tok_per_s=500) as live,
        aiohttp.ClientSession() as session,
        session.ws_connect(live.ws_url) as ws,
    ):
        await ws.send_str(create(input=PROMPT, tools=[EXEC_TOOL]))
        head = await until(ws, "response.function_call_arguments.delta")
        rid = head[0]["response"]["id"]
        await ws.send_str(steer(rid))
        events = head + await until(ws, "response.steer.pending")
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["response.completed", "response.steer.pending"]
        assert "response.incomplete" not in kinds and "response.steer.accepted" in kinds
        calls = events[-2]["response"]["output"]
        assert [c["status"] for c in calls] == ["completed", "completed"]
        assert [json.loads(c["arguments"])["cmd"] for c in calls] == [
            "ls",
            "pytest -x tests/prototype/store/test_store.py",
        ]
        pending = events[-1]
        assert pending["reason"] == "waiting_for_required_input"
        assert pending["required_input"] == [
            {"call_id": c["call_id"], "name": c["name"], "type": "function_call_output"} for c in calls
        ]
        outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls]
        await ws.send_str(create(input=outputs, tools=[EXEC_TOOL], previous_response_id=rid))
        steered = await until(ws, *ENDS)
        assert steered[0]["response"]["previous_response_id"] == rid
        assert "response.created" not in [e["type"] for e in steered[1:]]  # no automatic successor
        async with session.ws_connect(live.ws_url) as plain_ws:  # the same continuation, no steer queued
            await plain_ws.send_str(create(input=outputs, tools=[EXEC_TOOL], previous_response_id=rid))
            plain = await until(plain_ws, *ENDS)
    assert steered[-1]["response"]["usage"]["input_tokens"] > plain[-1]["response"]["usage"]["input_tokens"]
    assert not wire.violations


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt-5.5", "gpt-4.1-mini", "o3", "GPT-5.6"])
async def test_models_that_cannot_steer_refuse_it_and_the_response_runs_on(model: str, wire: strict.Checker) -> None:
    async with (
        live_server(tool_calls=0, seed=SEED, decode_tok_per_s=500) as live,
        aiohttp.ClientSession() as session,
        session.ws_connect(live.ws_url) as ws,
    ):
        await ws.send_str(json.dumps({"type": "response.create", "model": model, "input": "Say hello."}))
        head = await until(ws, "response.output_text.delta")
        rid = head[0]["response"]["id"]
        await ws.send_str(steer(rid))
        events = head + await until(ws, *ENDS)
        (failed,) = [e for e in events if e["type"] == "response.steer.failed"]
        assert failed["error"]["code"] == "steering_not_supported" and model in failed["error"]["message"]
        assert failed["steer"] == {"input": STEER_TEXT, "previous_response_id": rid}  # never accepted: no id
        assert events[-1]["type"] == "response.completed"
        assert "response.steer.accepted" not in [e["type"] for e in events]
    assert not wire.violations


def test_the_core_steers_on_a_create_connection_and_append_mode_does_not() -> None:
    for append_mode, steers in ((False, True), (True, False)):
        c = Connection(append_mode=append_mode)
        c.receive_text(create(input="hi"))
        (start,) = [o for o in c.outputs_to_send() if isinstance(o, StartJob)]
        c.receive_text(steer(start.job.response_id))
        out = c.outputs_to_send()
        assert any(isinstance(o, AckSteer) for o in out) is steers, (append_mode, out)


def test_at_the_item_boundary_steers_land_where_the_calls_are_answered() -> None:
    """The comparison at the default boundary: a steer that arrives while a call is decoded waits
    for that call (the beta's response then ends at the resume point, after its output is
    injected, and a successor takes the steer), so it comes no sooner than `inject`'s next turn;
    and no decoded token is thrown away."""
    assert CompareConfig().server.steer_boundary == "item"
    config = BASE.updated(modes=("inject", "steer"), interjections=2, interjection_window_s=0.2, steer_boundary="item")
    plain = {
        (r.mode, r.index): r
        for r in run(msgspec.structs.replace(config, interjections=0), virtual=True, free_cpu=True).rollouts
    }
    result = run(config, virtual=True, free_cpu=True)
    for r in result.rollouts:
        assert r.tokens_discarded == 0 and _completed_items(r) == _completed_items(plain[(r.mode, r.index)])
        assert _output_tokens(r) == _output_tokens(plain[(r.mode, r.index)])
    steer = [r for r in result.rollouts if r.mode == "steer"]
    assert all({x.via for x in r.interjections} == {"steer"} for r in steer)
    token = run(config.updated(steer_boundary="token"), virtual=True, free_cpu=True)
    cut = {p.other: p for p in token.pairs}["steer"]
    whole = {p.other: p for p in result.pairs}["steer"]
    assert cut.n == whole.n == config.rollouts
    assert whole.interjection_latency_difference_ci_high > 0  # steer at the item boundary: not sooner
    # The token boundary answers an interjection clearly sooner than the item boundary does.
    assert cut.interjection_latency_difference_ci_high < whole.interjection_latency_difference_ci_low
