"""The responses_multi_agent beta over WebSocket (docs/beta.md): inject, steering, async tools.

The official openai-python beta client (`client.beta.responses.connect()`), unchanged, drives
a 10-turn tool loop whose tool is `async: true`: one long response waits at each call, the
client injects the output, and one steer mid-rollout ends that response `incomplete`
(`steered`) and is committed by an automatic successor. Every frame is validated against the
SDK's beta event models by conftest's wire checker. Bad input gets the beta's failure events
and loses nothing already committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import pytest
from openai import AsyncOpenAI

from prototype.config import ServerConfig
from prototype.context.cache import CacheEntry
from prototype.context.conversation import Context, Preamble
from prototype.wire.schemas import RequiredInput, Response
from prototype.ws.connection import Connection
from prototype.ws.events import AckInject, AckSteer, ResumeJob, SendFrame, StartJob
from sim.model.policy import PlannedItem, ScriptPolicy
from tests import strict
from tests.support import (
    ASYNC_TOOL,
    BETA_HEADERS,
    EXEC_TOOL,
    NODE_DIR,
    Live,
    beta_socket,
    live_server,
    receive_event,
    run_node,
    until,
)
from tests.support import beta_create as create

MODEL: Final = "sim"
SEED: Final = 7
TOOL_CALLS: Final = 9
PROMPT: Final = "The test suite fails on test_store.py; find out why and fix it."
STEER_TEXT: Final = "Also check whether test_cache.py fails the same way."
TIMEOUT_S: Final = 20.0


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=TOOL_CALLS, seed=SEED) as server:
        yield server


def tool_output(arguments: str) -> str:
    return f"ran {json.loads(arguments).get('cmd', '?')}: ok"


@pytest.mark.slow
async def test_official_python_beta_client_drives_an_inject_loop_with_one_steer(
    live: Live, wire: strict.Checker
) -> None:
    async with (
        asyncio.timeout(TIMEOUT_S),
        AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0) as client,
        client.beta.responses.connect(extra_headers=BETA_HEADERS) as conn,
    ):
        await conn.response.create(model=MODEL, input=PROMPT, tools=[ASYNC_TOOL])  # type: ignore[list-item]
        seen: list[str] = []  # event types, in order
        calls: list[tuple[str, str]] = []  # (response id, call id) of every call answered
        created: list[Any] = []
        ended: list[Any] = []
        steer_id = None
        current = ""
        async for event in conn:
            seen.append(event.type)
            if event.type == "response.created":
                created.append(event.response)
                current = event.response.id
            elif event.type == "response.output_item.done" and event.item.type == "function_call":
                assert event.item.async_ is True  # the call of an async tool says so
                if len(calls) == 2:  # the third call: steer while the response waits on it
                    await conn.response.steer(previous_response_id=current, input=STEER_TEXT)
                calls.append((current, event.item.call_id))
                output = {"type": "function_call_output", "call_id": event.item.call_id}
                await conn.response.inject(
                    response_id=current,
                    input=[{**output, "output": tool_output(event.item.arguments)}],  # type: ignore[list-item]
                )
            elif event.type == "response.steer.accepted":
                steer_id = event.steer.id
                assert event.steer.previous_response_id == current
            elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                ended.append(event.response)
                if event.type != "response.incomplete":
                    break
    assert [r.status for r in ended] == ["incomplete", "completed"], seen
    steered, successor = ended
    # One steer: the waiting response ended at the resume point, its successor committed the steer.
    assert steered.incomplete_details.reason == "steered" and steer_id is not None
    assert [r.id for r in created] == [steered.id, successor.id]
    assert created[1].previous_response_id == steered.id and created[1].tools == created[0].tools
    assert seen.count("response.inject.created") == TOOL_CALLS == len(calls)
    assert seen.count("response.steer.accepted") == 1 and "response.steer.failed" not in seen
    # The first response took three tool outputs in one response; the successor took the other six.
    assert [rid for rid, _ in calls].count(steered.id) == 3 and [rid for rid, _ in calls].count(successor.id) == 6
    assert successor.output[-1].type == "message"
    # The successor's prompt holds the steered response's context (its three outputs) and the steer.
    assert successor.usage.input_tokens > steered.usage.input_tokens
    assert wire.counts[strict.BETA_WS_EVENT] == len(seen) and not wire.violations


@pytest.mark.slow
async def test_official_node_beta_client_drives_the_same_loop(live: Live, wire: strict.Checker) -> None:
    plan = {
        "baseURL": live.base_url,
        "model": MODEL,
        "tools": [ASYNC_TOOL],
        "prompt": PROMPT,
        "steer": STEER_TEXT,
        "steerAtCall": 3,
        "headers": BETA_HEADERS,
        "timeoutMs": int(TIMEOUT_S * 1000),
    }
    report = await run_node(plan, NODE_DIR / "beta.mjs", TIMEOUT_S)
    for event in report["events"]:  # what openai-node received, checked as the Python taps check theirs
        wire.check(strict.BETA_WS_EVENT, event, where="WebSocket /v1/responses (openai-node beta)")
    kinds = [e["type"] for e in report["seen"]]
    assert [(e["type"], e["reason"]) for e in report["ended"]] == [
        ("response.incomplete", "steered"),
        ("response.completed", None),
    ], report["ended"]
    steered, successor = report["ended"]
    assert successor["previous_response_id"] == steered["id"] and successor["last_output"] == "message"
    assert report["calls"] == TOOL_CALLS == kinds.count("response.inject.created")
    assert kinds.count("response.steer.accepted") == 1 and kinds.count("response.created") == 2
    assert "error" not in kinds and not wire.violations


async def test_bad_injects_and_steers_get_the_beta_failures_and_lose_nothing(live: Live, wire: strict.Checker) -> None:
    async with aiohttp.ClientSession() as session, await beta_socket(session, live) as ws:
        await ws.send_str(create(input=PROMPT))
        events = await until(ws, "response.output_item.done")
        rid = events[0]["response"]["id"]
        call = events[-1]["item"]
        assert call["type"] == "function_call" and call["async"] is True
        good = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}

        await ws.send_str(json.dumps({"type": "response.inject", "response_id": "resp_nope", "input": [good]}))
        failed = await receive_event(ws)
        assert failed["type"] == "response.inject.failed" and failed["error"]["code"] == "response_not_found"
        assert failed["input"] == [good]  # the uncommitted input comes back

        wrong = {**good, "call_id": "call_unknown"}
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good, wrong]}))
        error = await receive_event(ws)
        assert error["type"] == "error" and error["error"]["code"] == "unknown_call_id"
        assert error["error"]["param"] == "input[1].call_id"

        for bad_input, param in (
            ([{"type": "message", "role": "assistant", "content": "no"}], "input[0]"),
            ([{"type": "message", "role": "user", "content": "x", "id": "msg_1"}], "input[0]"),
            ([], "input"),
        ):
            await ws.send_str(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": bad_input}))
            refused = await receive_event(ws)
            assert refused["type"] == "response.steer.failed" and refused["error"]["code"] == "invalid_input"
            assert refused["steer"] == {"input": bad_input, "previous_response_id": rid}, param  # no id given

        # Nothing was committed by the refusals: the good output alone resumes the response.
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good]}))
        assert (await receive_event(ws))["type"] == "response.inject.created"
        resumed = await until(ws, "response.in_progress")
        assert [e["type"] for e in resumed] == ["response.in_progress"]
        await ws.send_str(json.dumps({"type": "response.append", "input": [good]}))  # not a beta event
        assert (await until(ws, "error"))[-1]["error"]["code"] == "unsupported_event_type"

    async with aiohttp.ClientSession() as session, await beta_socket(session, live) as ws:
        await ws.send_str(create(input="hi", tools=[]))
        done = await until(ws, "response.completed")
        rid = done[-1]["response"]["id"]
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [good]}))
        late = await receive_event(ws)
        assert late["type"] == "response.inject.failed" and late["error"]["code"] == "response_already_completed"
        await ws.send_str(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "more"}))
        late = await receive_event(ws)
        assert late["type"] == "response.steer.failed" and late["error"]["code"] == "response_already_completed"
        assert late["steer"]["input"] == "more" and "id" not in late["steer"]
    assert wire.counts[strict.BETA_WS_EVENT] > 10 and not wire.violations


LONG_CMD: Final = "grep -rn " + " ".join(f"pattern_{k}" for k in range(150))
TWO_SYNC_CALLS: Final = ScriptPolicy(
    [
        [
            PlannedItem("function_call", "exec_command", json.dumps({"cmd": "ls"})),
            PlannedItem("function_call", "exec_command", json.dumps({"cmd": LONG_CMD})),
        ]
    ]
)


async def test_a_steer_after_a_client_owned_call_is_pending_with_the_calls_stubs(wire: strict.Checker) -> None:
    """A sync tool's call ends the response; a steer accepted once a call of the turn is finished
    cannot stop it (ending it would leave the call unanswered): it is pending with the stubs of
    the turn's calls, and is prepended to the explicit create that answers them."""
    async with (
        live_server(policy=TWO_SYNC_CALLS, seed=SEED, decode_tok_per_s=500) as live,
        aiohttp.ClientSession() as session,
        await beta_socket(session, live) as ws,
    ):
        await ws.send_str(create(input=PROMPT, tools=[EXEC_TOOL]))
        first = await until(ws, "response.output_item.done")
        rid = first[0]["response"]["id"]
        await ws.send_str(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": STEER_TEXT}))
        events = await until(ws, "response.steer.pending")
        kinds = [e["type"] for e in events]
        assert "response.steer.accepted" in kinds and kinds[-2:] == ["response.completed", "response.steer.pending"]
        accepted = next(e for e in events if e["type"] == "response.steer.accepted")
        pending = events[-1]
        calls = events[-2]["response"]["output"]
        assert [c["status"] for c in calls] == ["completed", "completed"] and all("async" not in c for c in calls)
        assert pending["reason"] == "waiting_for_required_input" and pending["steer"] == accepted["steer"]
        assert pending["required_input"] == [
            {"call_id": c["call_id"], "name": c["name"], "type": "function_call_output"} for c in calls
        ]
        assert pending["sequence_number"] == events[-2]["sequence_number"] + 1
        stubs = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls]
        await ws.send_str(create(input=stubs, tools=[EXEC_TOOL], previous_response_id=rid))
        second = await until(ws, "response.completed")
        assert second[0]["response"]["previous_response_id"] == rid
        # The queued steer is in that request's input, ahead of the outputs: the prompt grew by both.
        unsteered_ws = await session.ws_connect(live.ws_url, headers=BETA_HEADERS)
        async with unsteered_ws:
            await unsteered_ws.send_str(create(input=stubs, tools=[EXEC_TOOL], previous_response_id=rid))
            plain = await until(unsteered_ws, "response.completed", "error")
        assert plain[-1]["type"] == "response.completed"  # stored parent, no steer on that socket
        steered_tokens = second[-1]["response"]["usage"]["input_tokens"]
        assert steered_tokens > plain[-1]["response"]["usage"]["input_tokens"]
    assert not wire.violations


@pytest.mark.slow
async def test_a_token_boundary_steer_during_a_final_answer_stops_it_mid_decode_and_the_successor_answers(
    wire: strict.Checker,
) -> None:
    """Under `steer_boundary="token"` (not the default, see tests/prototype/ws/test_steering.py): the message in
    flight ends `incomplete` with its text so far, the response `incomplete`/`steered`; the successor
    inherits the settings, continues from the parent (without the cut message) and answers that turn
    in full: the same tokens, re-planned."""
    async with (
        live_server(tool_calls=0, seed=SEED, decode_tok_per_s=500, config=ServerConfig(steer_boundary="token")) as live,
        aiohttp.ClientSession() as session,
        await beta_socket(session, live) as ws,
    ):
        await ws.send_str(create(input="Say hello.", instructions="Be brief.", stream_id="lane-a"))
        head = await until(ws, "response.output_text.delta")
        rid = head[0]["response"]["id"]
        await ws.send_str(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "In French."}))
        events = head + await until(ws, "response.incomplete")
        assert any(e["type"] == "response.steer.accepted" and e["stream_id"] == "lane-a" for e in events)
        parent = events[-1]["response"]
        assert parent["incomplete_details"] == {"reason": "steered"}
        (cut,) = parent["output"]
        assert cut["status"] == "incomplete" and events[-2] == {**events[-2], "type": "response.output_item.done"}
        partial = cut["content"][0]["text"]
        assert partial == "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert parent["longrun"]["tokens_discarded"] == parent["usage"]["output_tokens"] > 0
        successor = await until(ws, "response.completed")
        assert successor[0]["type"] == "response.created"
        made = successor[0]["response"]
        assert made["previous_response_id"] == rid and made["id"] != rid and made["instructions"] == "Be brief."
        assert all(e["stream_id"] == "lane-a" for e in successor)
        (answer,) = successor[-1]["response"]["output"]
        full = answer["content"][0]["text"]
        assert answer["status"] == "completed" and full.startswith(partial) and len(full) > len(partial)
        # The prompt holds the parent's context and the steer, not the cut message.
        assert successor[-1]["response"]["usage"]["output_tokens"] > parent["usage"]["output_tokens"]
    assert not wire.violations


# -- the core, without sockets -----------------------------------------------------------------------


def _entry(response_id: str) -> CacheEntry:
    import numpy as np

    return CacheEntry(
        Response(id=response_id, created_at=0, status="completed", model="sim"),
        Context(),
        0,
        Preamble(b"", np.zeros(0, dtype=np.uint32)),
        True,
        None,
        0,
    )


def test_an_async_calls_output_injected_while_sampling_is_acknowledged_at_once_and_resumes_at_the_pause() -> None:
    c = Connection(beta=True)
    c.receive_text(create(input="x"))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    job = start.job
    call = RequiredInput(call_id="call_1", name="exec_command")
    c.call_emitted(job, call)
    output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    c.receive_text(json.dumps({"type": "response.inject", "response_id": job.response_id, "input": [output]}))
    (ack,) = c.outputs_to_send()
    assert isinstance(ack, AckInject) and ack.refused is None  # committed while the model decodes
    c.response_paused(job, (call,))
    out = c.outputs_to_send()
    resume = out[-1]
    assert isinstance(resume, ResumeJob) and [i.view.call_id for i in resume.items] == ["call_1"]  # no wait


def test_a_steer_on_a_failed_response_comes_back_with_its_id() -> None:
    c = Connection(beta=True)
    c.receive_text(create(input="x"))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    c.receive_text(json.dumps({"type": "response.steer", "previous_response_id": start.job.response_id, "input": "y"}))
    (ack,) = c.outputs_to_send()
    assert isinstance(ack, AckSteer)
    c.response_ended(start.job, None)
    (frame,) = c.outputs_to_send()
    assert isinstance(frame, SendFrame)
    failed = json.loads(frame.data)
    assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == "response_not_active"
    assert failed["steer"] == {"input": "y", "previous_response_id": start.job.response_id, "id": ack.steer.id}


def test_steers_on_a_completed_response_start_its_successor_with_their_input_in_order() -> None:
    c = Connection(beta=True)
    c.receive_text(create(input="x", instructions="Be brief."))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    rid = start.job.response_id
    for text in ("one", "two"):
        c.receive_text(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": text}))
    c.outputs_to_send()
    c.response_ended(start.job, _entry(rid))
    (successor,) = c.outputs_to_send()
    assert isinstance(successor, StartJob)
    request = successor.job.request
    assert request.previous_response_id == rid and request.params.instructions == "Be brief."
    assert [json.loads(bytes(i.raw))["content"] for i in request.items] == ["one", "two"]
    assert successor.job.cached is not None and successor.job.cached.response_id == rid


def test_steers_parked_for_a_parent_come_back_when_the_lane_continues_another_response() -> None:
    c = Connection(beta=True)
    c.receive_text(create(input="x"))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    rid = start.job.response_id
    c.receive_text(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "later"}))
    (ack,) = c.outputs_to_send()
    assert isinstance(ack, AckSteer)
    owed = (RequiredInput(call_id="call_1", name="exec_command"),)
    c.response_ended(start.job, _entry(rid), owed=owed)
    assert c.outputs_to_send() == [] and c.default.parked is not None  # waits for the explicit create
    c.receive_text(create(input="something else"))  # continues nothing: the steer is not committed
    out = c.outputs_to_send()
    frame = next(o for o in out if isinstance(o, SendFrame))
    failed = json.loads(frame.data)
    assert failed["error"]["code"] == "response_not_active" and failed["steer"]["id"] == ack.steer.id
    started_job = next(o for o in out if isinstance(o, StartJob)).job
    assert [json.loads(bytes(i.raw))["content"] for i in started_job.request.items] == ["something else"]


def test_parked_steers_are_prepended_to_the_create_that_continues_their_parent() -> None:
    c = Connection(beta=True)
    c.receive_text(create(input="x"))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    rid = start.job.response_id
    for text in ("first", "second"):
        c.receive_text(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": text}))
    c.outputs_to_send()
    c.response_ended(start.job, _entry(rid), owed=(RequiredInput(call_id="call_1", name="exec_command"),))
    output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
    c.receive_text(create(input=[output], previous_response_id=rid))
    (next_start,) = c.outputs_to_send()
    assert isinstance(next_start, StartJob)
    items = [i.view for i in next_start.job.request.items]
    assert [(v.type, v.role) for v in items] == [
        ("message", "user"),
        ("message", "user"),
        ("function_call_output", None),
    ]


async def _rollout(ws: aiohttp.ClientWebSocketResponse, resume: str, tool: dict[str, Any]) -> dict[str, Any]:
    """One 10-turn rollout in one response: answer each call with `resume` (append or inject)."""
    await ws.send_str(create(input=PROMPT, tools=[tool]))
    arguments: list[str] = []
    rid = ""
    while True:
        event = await receive_event(ws)
        if event["type"] == "response.output_item.done" and event["item"]["type"] == "function_call":
            call = event["item"]
            arguments.append(call["arguments"])
            output = {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": tool_output(call["arguments"]),
            }
            frame: dict[str, Any] = {"type": resume, "input": [output]}
            if resume == "response.inject":
                frame["response_id"] = rid
            await ws.send_str(json.dumps(frame))
        elif event["type"] == "response.created":
            rid = event["response"]["id"]
        elif event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return {"end": event, "arguments": arguments}


@pytest.mark.slow
async def test_beta_and_append_are_one_machine_same_prompts_and_tokens(live: Live) -> None:
    """The same seeded rollout, paused at each call and resumed by `response.append` (append mode)
    or by `response.inject` (the beta, with the tool declared async): the same calls, the same final
    answer, the same usage, one response each."""
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(live.ws_url + "?mode=append") as ws:
            append = await _rollout(ws, "response.append", EXEC_TOOL)
        async with await beta_socket(session, live) as ws:
            beta = await _rollout(ws, "response.inject", ASYNC_TOOL)
    assert append["end"]["type"] == beta["end"]["type"] == "response.completed"
    assert len(append["arguments"]) == TOOL_CALLS and append["arguments"] == beta["arguments"]
    a, b = append["end"]["response"], beta["end"]["response"]
    # (cached_tokens differ: the second rollout finds the first one's prefix in the model's cache.)
    assert [a["usage"][k] for k in ("input_tokens", "output_tokens")] == [
        b["usage"][k] for k in ("input_tokens", "output_tokens")
    ]
    assert a["output"][-1]["content"] == b["output"][-1]["content"]
    assert [o.get("async") for o in b["output"] if o["type"] == "function_call"] == [True] * TOOL_CALLS
    assert all("async" not in o for o in a["output"])


def test_outputs_injected_for_a_turn_that_ended_the_response_go_to_its_continuation() -> None:
    """A turn with an async call and a client-owned call ends the response; the async call's
    output, injected and acknowledged while the model decoded, is not lost: the create that
    continues the response starts with it."""
    c = Connection(beta=True)
    c.receive_text(create(input="x"))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob)
    job, rid = start.job, start.job.response_id
    c.call_emitted(job, RequiredInput(call_id="call_async", name="exec_command"))
    early = {"type": "function_call_output", "call_id": "call_async", "output": "early"}
    c.receive_text(json.dumps({"type": "response.inject", "response_id": rid, "input": [early]}))
    (ack,) = c.outputs_to_send()
    assert isinstance(ack, AckInject) and ack.refused is None
    c.response_ended(job, _entry(rid), owed=(RequiredInput(call_id="call_sync", name="read_file"),))
    late = {"type": "function_call_output", "call_id": "call_sync", "output": "late"}
    c.receive_text(create(input=[late], previous_response_id=rid))
    (next_start,) = c.outputs_to_send()
    assert isinstance(next_start, StartJob)
    assert [i.view.call_id for i in next_start.job.request.items] == ["call_async", "call_sync"]


def test_the_pinned_beta_extract_matches_its_recorded_hash_and_is_closed() -> None:
    provenance = json.loads((strict.DATA / "openapi-responses.source.json").read_text())
    assert hashlib.sha256(strict.BETA_SPEC_FILE.read_bytes()).hexdigest() == provenance["beta_extract_sha256"]
    schemas = strict.beta_spec()["components"]["schemas"]
    assert set(provenance["beta_roots"]) == set(strict.BETA_SPEC_EVENTS.values()) <= set(schemas)
    text = strict.BETA_SPEC_FILE.read_text()
    refs = {ref.rsplit("/", 1)[1] for ref in re.findall(r'"\$ref": "(#/components/schemas/[^"]+)"', text)}
    assert refs <= set(schemas)  # every $ref resolves inside the extract


async def test_an_output_injected_while_the_model_decodes_on_is_acknowledged_in_sequence(
    wire: strict.Checker,
) -> None:
    """The turn calls the async tool, then keeps decoding a long message; the output injected
    meanwhile is acknowledged among the message's deltas, with sequence numbers in order, and the
    response resumes at the turn's end without waiting."""
    call = PlannedItem("function_call", "exec_command", '{"cmd":"pytest -x"}')
    policy = ScriptPolicy([[call, PlannedItem("message", "", " word" * 300)], PlannedItem("message", "", "done")])
    async with (
        live_server(policy=policy, seed=SEED, decode_tok_per_s=500) as live,
        aiohttp.ClientSession() as session,
        await beta_socket(session, live) as ws,
    ):
        await ws.send_str(create(input=PROMPT))
        events = await until(ws, "response.output_item.done")
        rid = events[0]["response"]["id"]
        done = events[-1]["item"]
        output = {"type": "function_call_output", "call_id": done["call_id"], "output": "1 passed"}
        await ws.send_str(json.dumps({"type": "response.inject", "response_id": rid, "input": [output]}))
        events += await until(ws, "response.completed")
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # in order, no gaps
    ack = kinds.index("response.inject.created")
    message_done = [i for i, k in enumerate(kinds) if k == "response.output_item.done"][1]
    assert ack < message_done  # acknowledged while the message was still being decoded
    resume = kinds.index("response.in_progress", message_done)
    assert resume == message_done + 1  # no wait: the output was already there
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "done"
    assert not wire.violations


def test_a_response_with_automatic_compaction_cannot_be_steered() -> None:
    c = Connection(beta=True)
    managed = [{"type": "compaction", "compact_threshold": 200_000}]
    c.receive_text(create(input="x", context_management=managed))
    (start,) = c.outputs_to_send()
    assert isinstance(start, StartJob) and start.job.request.compact_threshold is not None
    steer = {"type": "response.steer", "previous_response_id": start.job.response_id, "input": "y"}
    c.receive_text(json.dumps(steer))
    (frame,) = c.outputs_to_send()
    assert isinstance(frame, SendFrame)
    failed = json.loads(frame.data)
    assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == "steering_not_supported"
    assert not c.default.steers
