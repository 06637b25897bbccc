"""Steering mid-decode at the token boundary (`steer_boundary="token"`, docs/beta.md#steering)
and the comparison's interjections (docs/experiments.md, "Interjections"): a steer accepted while
the model decodes stops the response at the next token boundary, the item in flight ends
`incomplete` and is not owed, and the automatic successor plans that turn afresh with the steer
in its context. The default item boundary is in tests/prototype/ws/test_steering.py."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Final

import aiohttp
import msgspec
import numpy as np
import pytest
from openai import AsyncOpenAI

from prototype.config import ServerConfig
from prototype.context.cache import CacheEntry
from prototype.context.conversation import Context, Preamble
from prototype.wire.schemas import IncompleteDetails, Response
from prototype.ws.connection import Connection
from prototype.ws.events import AckSteer, StartJob
from sim.__main__ import run
from sim.harness import experiment
from sim.harness.experiment import CompareConfig
from sim.model.policy import PlannedItem, ScriptPolicy
from sim.rollout.result import RolloutResult, tool_outputs
from sim.rollout.spec import EXEC_TOOL as EXEC_TOOL_SPEC
from sim.runtime.inprocess import InProcessServer
from tests import strict
from tests.support import EXEC_TOOL, live_server, receive_event
from tests.support import STEER_COMPARE_BASE as BASE
from tests.support import completed_items as _completed_items
from tests.support import output_tokens as _output_tokens

MODEL: Final = "sim"
SEED: Final = 7
TOOL_CALLS: Final = 4
BETA_HEADERS: Final = {"OpenAI-Beta": "responses_multi_agent=v1"}
ASYNC_TOOL: Final = {**EXEC_TOOL, "async": True}
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
STEER_TEXT: Final = "Also check whether test_cache.py fails the same way."
TIMEOUT_S: Final = 30.0
TOKEN_BOUNDARY: Final = ServerConfig(steer_boundary="token")


@pytest.mark.slow
async def test_official_python_beta_client_steers_mid_decode(wire: strict.Checker) -> None:
    """openai-python's beta client, unchanged: the steer goes out on the first argument delta of
    the second call; that call ends `incomplete` (never answered), the response `steered`, and
    the successor makes the same call in full, then the loop runs to its answer."""
    async with (
        live_server(tool_calls=TOOL_CALLS, seed=SEED, decode_tok_per_s=400, config=TOKEN_BOUNDARY) as live,
        asyncio.timeout(TIMEOUT_S),
        AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0) as client,
        client.beta.responses.connect(extra_headers=BETA_HEADERS) as conn,
    ):
        await conn.response.create(model=MODEL, input=PROMPT, tools=[ASYNC_TOOL])  # type: ignore[list-item]
        seen: list[str] = []
        created: list[Any] = []
        ended: list[Any] = []
        done_calls: list[Any] = []  # every call's output_item.done, complete or not
        answered: list[str] = []
        current = ""
        steered = False
        async for event in conn:
            seen.append(event.type)
            if event.type == "response.created":
                created.append(event.response)
                current = event.response.id
            elif event.type == "response.function_call_arguments.delta" and len(done_calls) == 1 and not steered:
                steered = True  # mid-decode: the second call has started streaming its arguments
                await conn.response.steer(previous_response_id=current, input=STEER_TEXT)
            elif event.type == "response.output_item.done" and event.item.type == "function_call":
                done_calls.append(event.item)
                if event.item.status == "completed":
                    answered.append(event.item.call_id)
                    output = {"type": "function_call_output", "call_id": event.item.call_id, "output": "ok"}
                    await conn.response.inject(response_id=current, input=[output])  # type: ignore[list-item]
            elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                ended.append(event.response)
                if event.type != "response.incomplete":
                    break
    assert [r.status for r in ended] == ["incomplete", "completed"], seen
    parent, successor = ended
    assert parent.incomplete_details.reason == "steered"
    assert [r.id for r in created] == [parent.id, successor.id] and created[1].previous_response_id == parent.id
    cut = done_calls[1]
    assert cut.status == "incomplete" and cut.call_id not in answered  # not owed, never answered
    assert parent.output[-1].status == "incomplete" and parent.output[-1].call_id == cut.call_id
    # The successor re-plans that turn: the same call, the cut arguments a prefix of its own.
    redo = done_calls[2]
    assert redo.status == "completed" and redo.arguments.startswith(cut.arguments) and redo.arguments != cut.arguments
    assert [c.status for c in done_calls].count("completed") == TOOL_CALLS == len(answered)
    assert successor.output[-1].type == "message"
    extra = parent.model_extra or {}
    assert extra["longrun"]["tokens_discarded"] > 0
    assert seen.count("response.steer.accepted") == 1 and "response.steer.failed" not in seen
    assert seen.count("response.inject.created") == TOOL_CALLS
    assert wire.counts[strict.BETA_WS_EVENT] == len(seen) and not wire.violations


# -- the comparison's interjections ------------------------------------------------------------------

INTERJECTED = msgspec.structs.replace(BASE, interjections=2, interjection_window_s=0.2)


def _reference_rollout_loop(
    client: Any, clock: Any, spec: Any, *, model: str, tools: Any, store: Any, context_management: Any = None
) -> Any:
    """The comparison's rollout loop without interjections (and without compaction), written out
    here: the switch off must leave every mode's results exactly as this loop gives them."""
    assert context_management is None

    async def loop() -> RolloutResult:
        settings = {"model": model, "instructions": spec.instructions, "tools": [EXEC_TOOL_SPEC], "store": store}
        result = RolloutResult(client.mode, spec.index, clock.now(), 0.0)
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": spec.task}]
        for turn in range(len(spec.tool_times_s) + 1):
            outcome = await client.turn(items, **settings)
            result.turns.append(outcome)
            if turn == len(spec.tool_times_s) or not outcome.call_ids:
                break
            output, tool_s = await tools.run(clock, float(spec.tool_times_s[turn]), spec.tool_outputs[turn])
            result.tool_time_s += tool_s
            items = tool_outputs(outcome, output)
        result.finished_at = clock.now()
        return result

    return loop()


@pytest.mark.slow
def test_interjections_off_leave_every_mode_as_the_plain_rollout_loop_gives_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    off = run(BASE, virtual=True, free_cpu=True)
    assert all(not r.interjections and r.successors == 0 and r.tokens_discarded == 0 for r in off.rollouts)
    assert all(s.interjections == 0 and math.isnan(s.interjection_latency_s) for s in off.summary)
    assert all(math.isnan(p.interjection_latency_difference_s) for p in off.pairs)
    monkeypatch.setattr(experiment, "run_rollout", _reference_rollout_loop)
    plain = run(BASE, virtual=True, free_cpu=True)
    assert msgspec.to_builtins(off.summary) == msgspec.to_builtins(plain.summary)
    assert msgspec.to_builtins(off.pairs) == msgspec.to_builtins(plain.pairs)
    key = [(r.mode, r.index, r.completion_s, [t.bytes_sent for t in r.turns]) for r in off.rollouts]
    assert key == [(r.mode, r.index, r.completion_s, [t.bytes_sent for t in r.turns]) for r in plain.rollouts]
    # steer mode without interjections is inject mode: same requests, same times
    times = {(r.mode, r.index): r.completion_s for r in off.rollouts}
    for i in range(BASE.rollouts):  # (the same durations at other clock times: equal to rounding)
        assert times[("steer", i)] == pytest.approx(times[("inject", i)], rel=1e-9)


@pytest.mark.slow
def test_interjections_keep_every_models_tokens_and_steer_answers_them_sooner() -> None:
    off = run(BASE, virtual=True, free_cpu=True)
    on = run(INTERJECTED, virtual=True, free_cpu=True)
    before = {(r.mode, r.index): r for r in off.rollouts}
    steered_turns = 0
    for r in on.rollouts:
        plain = before[(r.mode, r.index)]
        assert len(r.interjections) == 2 and all(x.latency_s is not None and x.latency_s > 0 for x in r.interjections)
        # Every model turn decodes the same tokens as without interjections (the plan depends on the
        # seed, the conversation and the turn index, not on the message): all the completed items
        # are the same, in the same order; nothing fell back to an extra turn.
        assert _completed_items(r) == _completed_items(plain)
        assert len(r.turns) == len(plain.turns) == BASE.tool_calls + 1
        if r.mode != "steer":
            assert {x.via for x in r.interjections} == {"next_turn"} and r.successors == r.tokens_discarded == 0
            assert _output_tokens(r) == _output_tokens(plain)
            continue
        assert {x.via for x in r.interjections} == {"steer"}
        # Only the steered turns differ: the cut item's tokens are decoded once more, in full, by
        # the successor; the cut text is a prefix of what the successor says in that turn.
        assert _output_tokens(r) == _output_tokens(plain) + r.tokens_discarded
        items = [i for t in r.turns for i in t.output_items]
        for k, item in enumerate(items):
            if item.get("status") == "incomplete":
                steered_turns += 1
                nxt = items[k + 1]
                cut = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
                full = nxt["arguments"] if nxt["type"] == "function_call" else nxt["content"][0]["text"]
                assert nxt["type"] == item["type"] and full.startswith(cut)
        assert r.successors >= 1
    assert steered_turns > 0
    summary = {s.mode: s for s in on.summary}
    assert {m: s.interjections for m, s in summary.items()} == dict.fromkeys(BASE.modes, 8)
    assert summary["steer"].successors_per_rollout > 0 and summary["steer"].tokens_discarded_per_rollout > 0
    assert summary["inject"].successors_per_rollout == 0 == summary["ws"].tokens_discarded_per_rollout
    pair = next(p for p in on.pairs if (p.base, p.other) == ("inject", "steer"))
    assert pair.n == 4 and pair.interjection_latency_difference_s < 0
    assert pair.interjection_latency_difference_ci_low <= pair.interjection_latency_difference_s
    assert pair.interjection_latency_difference_s <= pair.interjection_latency_difference_ci_high


def test_negative_control_steer_mode_without_steering_waits_like_inject(monkeypatch: pytest.MonkeyPatch) -> None:
    """With its steering switched off the steer client holds the message like every other mode:
    its latencies are then exactly inject's, rollout by rollout (the gain is the steer's)."""
    config = msgspec.structs.replace(INTERJECTED, modes=("inject", "steer"))
    on = run(config, virtual=True, free_cpu=True)
    client = InProcessServer.client

    def no_steering(self: InProcessServer, mode: Any, clock: Any) -> Any:
        made = client(self, mode, clock)
        if mode == "steer":
            made.steering = False  # type: ignore[attr-defined]
        return made

    monkeypatch.setattr(InProcessServer, "client", no_steering)
    off = run(config, virtual=True, free_cpu=True)
    latency = {(r.mode, r.index): [x.latency_s for x in r.interjections] for r in off.rollouts}
    for i in range(config.rollouts):
        assert latency[("steer", i)] == pytest.approx(latency[("inject", i)], abs=1e-9)
    assert all(r.successors == 0 and {x.via for x in r.interjections} == {"next_turn"} for r in off.rollouts)
    pair = off.pairs[0]
    assert pair.interjection_latency_difference_s == pytest.approx(0, abs=1e-9)
    steered = next(p for p in on.pairs if p.other == "steer")
    assert steered.interjection_latency_difference_ci_high < 0  # with steering: sooner, clearly


@pytest.mark.slow
def test_interjections_run_live_over_sockets_and_pass_the_beta_wire_checker(wire: strict.Checker) -> None:
    config = msgspec.structs.replace(INTERJECTED, rollouts=2, modes=("inject", "steer"))
    result = run(config, virtual=False)
    steer = [r for r in result.rollouts if r.mode == "steer"]
    assert sum(r.successors for r in steer) >= 1
    assert all(x.latency_s is not None for r in result.rollouts for x in r.interjections)
    assert all(_completed_items(a) == _completed_items(b) for a, b in zip(steer, result.rollouts[:2], strict=True))
    assert wire.counts[strict.BETA_WS_EVENT] > 0 and not wire.violations


@pytest.mark.slow
async def test_nothing_is_decoded_after_the_cut_and_the_successor_holds_the_steer(wire: strict.Checker) -> None:
    """The model's generator is closed at the boundary: every token the accelerator decoded is in a
    response's usage (the cut ones in the parent's), and the successor's prompt has the steer."""
    long_answer = " ".join(f"word{k}" for k in range(400))
    # Turn 1 says something else: the successor saying turn 0 again shows the cut message is not in
    # its context (the context counts model turns by the items it holds).
    policy = ScriptPolicy([PlannedItem("message", "", long_answer), PlannedItem("message", "", "something else")])
    async with (
        live_server(policy=policy, seed=SEED, decode_tok_per_s=400, config=TOKEN_BOUNDARY) as live,
        aiohttp.ClientSession() as session,
        await session.ws_connect(live.ws_url, headers=BETA_HEADERS) as ws,
    ):
        create = {"type": "response.create", "model": MODEL, "input": PROMPT, "tools": [ASYNC_TOOL]}
        await ws.send_str(json.dumps(create))
        events = [await receive_event(ws)]
        rid = events[0]["response"]["id"]
        while sum(e["type"] == "response.output_text.delta" for e in events) < 5:
            events.append(await receive_event(ws))
        await ws.send_str(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": STEER_TEXT}))
        while events[-1]["type"] != "response.incomplete":
            events.append(await receive_event(ws))
        parent = events[-1]["response"]
        successor = [await receive_event(ws)]
        while successor[-1]["type"] != "response.completed":
            successor.append(await receive_event(ws))
    done = successor[-1]["response"]
    cut = parent["usage"]["output_tokens"]
    assert 5 <= cut < done["usage"]["output_tokens"] and parent["longrun"]["tokens_discarded"] == cut
    assert live.model.statistics().output_tokens == cut + done["usage"]["output_tokens"]
    # The successor's prompt is the parent's (without the cut message) plus the steer.
    assert done["usage"]["input_tokens"] > parent["usage"]["input_tokens"]
    assert done["output"][0]["content"][0]["text"] == long_answer  # the turn, planned again, in full
    assert not wire.violations


def test_a_steered_incomplete_response_takes_the_successor_row_of_the_lane_table() -> None:
    """The per-lane table needs no new row: a response that ended `incomplete` (steered) with a
    queued steer and nothing owed starts the automatic successor with the steer's input."""
    c = Connection(beta=True)
    create = {"type": "response.create", "model": MODEL, "input": "x", "instructions": "Be brief."}
    c.receive_text(json.dumps(create), at=1.0)
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    rid = start.job.response_id
    c.receive_text(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": STEER_TEXT}))
    (ack,) = c.outputs_to_send()
    assert isinstance(ack, AckSteer)
    entry = CacheEntry(
        Response(
            id=rid,
            created_at=0,
            status="incomplete",
            model=MODEL,
            incomplete_details=IncompleteDetails(reason="steered"),
        ),
        Context(),
        0,
        Preamble(b"", np.zeros(0, dtype=np.uint32)),
        True,
        None,
        0,
    )
    c.response_ended(start.job, entry, at=7.5)
    (successor,) = c.outputs_to_send()
    assert isinstance(successor, StartJob)
    # The server sent it when the parent ended: its stages count from then, not from the parent's arrival.
    assert start.job.arrived_at == 1.0 and successor.job.arrived_at == 7.5
    request = successor.job.request
    assert request.previous_response_id == rid and request.params.instructions == "Be brief."
    assert [json.loads(bytes(i.raw))["content"] for i in request.items] == [STEER_TEXT]
    assert successor.job.cached is entry


def test_steering_with_compaction_is_refused_before_anything_runs() -> None:
    """The beta does not steer a response that compacts automatically, so the comparison refuses
    the combination up front instead of measuring steers that all fail."""
    config = CompareConfig(modes=("inject", "steer"), interjections=1, compact_threshold=20_000)
    with pytest.raises(ValueError, match="compact_threshold"):
        experiment.check(config, virtual=True)
    experiment.check(msgspec.structs.replace(config, compact_threshold=0), virtual=True)
    experiment.check(msgspec.structs.replace(config, modes=("inject",)), virtual=True)


def test_a_successors_stages_count_from_its_parents_end() -> None:
    """The automatic successor arrives when its parent ends: its `network` stage is its own
    segments' uploads, no more than the whole unsteered response's on the same rollout (counted
    from the parent's arrival it would hold the parent's whole life)."""
    config = CompareConfig(modes=("inject", "steer"), rollouts=3, tool_calls=5, interjections=1)
    result = experiment.compare(config, virtual=True, free_cpu=True)

    def network(mode: str, index: int) -> float:
        (rollout,) = [r for r in result.rollouts if r.mode == mode and r.index == index]
        reports = [t.response.longrun for t in rollout.turns if isinstance(t.response.longrun, msgspec.Struct)]
        return float(reports[-1].stages_s["network"])  # type: ignore[union-attr]

    steered = {r.index for r in result.rollouts if r.mode == "steer" and r.successors}
    assert steered
    for index in steered:
        assert 0 < network("steer", index) <= network("inject", index)
