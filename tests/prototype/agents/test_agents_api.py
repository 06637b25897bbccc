"""The Agents API surface (prototype/agents/machine.py, prototype/serve/agents_api.py): the session core's tables,
and the routes over loopback with a raw HTTP client, for what the SDK helpers never show
(errors, the registration race, replays, steering, cancel, the beta header)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import msgspec
import pydantic
import pytest
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agents.sessions.turn import Turn

from prototype.agents import wire as w
from prototype.agents.events import (
    SS,
    TS,
    TURN_TRANSITIONS,
    AgentStateError,
    AllAnswered,
    CallAdded,
    CancelReceived,
    CancelTurn,
    DeleteReceived,
    MessageReceived,
    Publish,
    ResumeTurn,
    StartTurn,
    ToolResultReceived,
    TurnEnded,
    TurnPaused,
)
from prototype.agents.machine import (
    TRANSITIONS,
    SessionCore,
)
from prototype.agents.record import decode_record, encode_record, record_of, restore
from prototype.config import ServerConfig, WebSocketConfig
from prototype.ids import IdFactory
from prototype.serve.app import ENGINE
from prototype.store.base import StoreUnavailable
from prototype.store.memory import MemoryStore
from prototype.wire.errors import ProtocolError
from prototype.wire.schemas import FunctionCall, RequiredInput, encode
from tests.support import AGENT_EVENT_MODELS as EVENT_MODELS
from tests.support import AGENT_ITEM_MODELS as ITEM_MODELS
from tests.support import EXEC_COMMAND_SCHEMA, Live, live_server

BETA: Final = {"OpenAI-Beta": "agents=v1"}
TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": EXEC_COMMAND_SCHEMA,
}
USER: Final = encode({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})

pytestmark = pytest.mark.timeout(60)

# -- the core ----------------------------------------------------------------------------------------


def _core() -> SessionCore:
    agent = w.AgentOut(id="agent_1", instructions=None, model="sim")
    return SessionCore("sess_1", agent, ids=IdFactory(0), now=1000.0)


def _call(n: int) -> FunctionCall:
    return FunctionCall(id=f"fc_{n}", status="completed", arguments='{"cmd":"ls"}', call_id=f"call_{n}", name="t")


def _result(core: SessionCore, n: int) -> ToolResultReceived:
    assert core.active is not None
    return ToolResultReceived(w.InputToolResult(call_id=f"call_{n}", success=True, turn_id=core.active.id, output="x"))


def _published(core: SessionCore) -> list[str]:
    return [out.event.__struct_config__.tag for out in core.outputs_to_send() if isinstance(out, Publish)]  # type: ignore[misc]


def test_a_turn_pauses_at_calls_and_resumes_when_all_are_answered() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    outs = core.outputs_to_send()
    assert isinstance(outs[-1], StartTurn) and outs[-1].previous_response_id is None
    kinds = [o.event.__struct_config__.tag for o in outs if isinstance(o, Publish)]  # type: ignore[misc]
    assert kinds == [
        "agent.session.turn.created",
        "agent.session.turn.item.added",
        "agent.session.in_progress",
        "agent.session.turn.in_progress",
    ]
    core.receive(CallAdded(_call(1), 0))
    core.receive(CallAdded(_call(2), 1))
    core.receive(_result(core, 1))  # before the pause: held
    core.outputs_to_send()
    core.receive(TurnPaused((RequiredInput("call_1", "t"), RequiredInput("call_2", "t"))))
    assert core.state is SS.REQUIRES_ACTION and core.active is not None and core.active.status is TS.WAITING
    assert [a.call_id for a in core.snapshot().required_actions] == ["call_2"]
    assert _published(core) == ["agent.session.requires_action"]
    core.receive(_result(core, 2))
    outs = core.outputs_to_send()
    resume = outs[-1]
    assert isinstance(resume, ResumeTurn) and len(resume.items) == 2
    assert [json.loads(i)["call_id"] for i in resume.items] == ["call_1", "call_2"]
    assert core.state is SS.IN_PROGRESS
    core.receive(TurnEnded("completed", "resp_1", stored=True))
    assert _published(core) == ["agent.session.turn.completed", "agent.session.idle"]
    assert core.state is SS.IDLE and core.last_response_id == "resp_1"


def test_every_result_before_the_pause_resumes_without_requires_action() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(CallAdded(_call(1), 0))
    core.receive(_result(core, 1))
    core.outputs_to_send()
    core.receive(TurnPaused((RequiredInput("call_1", "t"),)))
    outs = core.outputs_to_send()
    assert isinstance(outs[-1], ResumeTurn)
    assert "agent.session.requires_action" not in [
        o.event.__struct_config__.tag  # type: ignore[misc]
        for o in outs
        if isinstance(o, Publish)
    ]


def test_a_result_for_an_unregistered_call_is_the_race_400() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    assert core.active is not None
    early = w.InputToolResult(call_id="call_9", success=True, turn_id=core.active.id, output="x")
    with pytest.raises(ProtocolError) as info:
        core.check([early])
    assert info.value.status == 400 and info.value.code == "invalid_request_error"
    assert info.value.message == "Unknown pending tool call: call_9"
    core.receive(CallAdded(_call(9), 0))
    core.check([early])  # registered now
    with pytest.raises(ProtocolError):
        core.check([early, early])  # one result per call


def test_a_steer_joins_at_the_next_step_boundary() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(CallAdded(_call(1), 0))
    core.outputs_to_send()
    steer = encode({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "also"}]})
    core.receive(MessageReceived((steer,)))  # active turn: queued, no new turn
    assert not any(isinstance(o, StartTurn) for o in core.outputs_to_send())
    core.receive(TurnPaused((RequiredInput("call_1", "t"),)))
    core.receive(_result(core, 1))
    resume = core.outputs_to_send()[-1]
    assert isinstance(resume, ResumeTurn)
    assert [json.loads(i)["type"] for i in resume.items] == ["function_call_output", "message"]


def test_a_steer_left_at_the_turns_end_starts_the_next_turn() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(MessageReceived((USER,)))
    core.outputs_to_send()
    core.receive(TurnEnded("completed", "resp_1", stored=True))
    outs = core.outputs_to_send()
    assert isinstance(outs[-1], StartTurn) and outs[-1].previous_response_id == "resp_1"
    tags = [o.event.__struct_config__.tag for o in outs if isinstance(o, Publish)]  # type: ignore[misc]
    assert "agent.session.idle" not in tags and core.state is SS.IN_PROGRESS and len(core.turns) == 2


def test_cancel_ends_the_turn_and_drops_its_queued_messages() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(CallAdded(_call(1), 0))
    core.receive(TurnPaused((RequiredInput("call_1", "t"),)))
    core.receive(MessageReceived((USER,)))
    core.outputs_to_send()
    turn = core.active
    assert turn is not None
    core.receive(CancelReceived())  # the turn's end is this one step, whatever its task does
    outs = core.outputs_to_send()
    assert outs[0] == CancelTurn(turn.id)
    tags = [o.event.__struct_config__.tag for o in outs[1:] if isinstance(o, Publish)]  # type: ignore[misc]
    assert tags == ["agent.session.turn.cancelled", "agent.session.idle"]
    assert core.turns[0].status is TS.CANCELLED and core.state is SS.IDLE
    call = core.items_list()[1]
    assert isinstance(call, w.FunctionCallItemOut) and call.status == "incomplete"  # never answered
    core.receive(TurnEnded("cancelled", turn_id=turn.id))  # the cancelled task's end: dropped
    core.receive(CancelReceived())  # idle: nothing to cancel
    assert core.outputs_to_send() == []


def test_a_message_and_a_cancel_in_one_step_leave_the_session_idle_for_the_next_turn() -> None:
    core = _core()
    core.apply([MessageReceived((USER,)), CancelReceived()])
    first = core.turns[0]
    outs = core.outputs_to_send()
    assert [type(o) for o in outs if not isinstance(o, Publish)] == [StartTurn, CancelTurn]
    assert first.status is TS.CANCELLED and core.state is SS.IDLE
    # what the cancelled turn's task might still say is about a turn that has ended
    core.receive(CallAdded(_call(1), 0, first.id))
    core.receive(TurnPaused((RequiredInput("call_1", "t"),), first.id))
    core.receive(TurnEnded("completed", "resp_x", stored=True, turn_id=first.id))
    core.response_events(first.id, [])
    assert core.state is SS.IDLE and core.last_response_id is None and core.outputs_to_send() == []
    core.receive(MessageReceived((USER,)))
    assert core.state is SS.IN_PROGRESS and core.active is not None and core.active.id != first.id


def test_an_answered_call_is_completed_in_the_saved_items() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(CallAdded(_call(1), 0))
    core.receive(TurnPaused((RequiredInput("call_1", "t"),)))
    core.receive(_result(core, 1))
    core.receive(TurnEnded("completed", "resp_1", stored=True))
    calls = [i for i in core.items_list() if isinstance(i, w.FunctionCallItemOut)]
    assert [c.status for c in calls] == ["completed"]


def test_a_record_restores_the_session_and_a_turn_no_process_runs_is_ended() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.receive(CallAdded(_call(1), 0))
    core.receive(TurnPaused((RequiredInput("call_1", "t"),)))
    core.receive(_result(core, 1))
    core.receive(TurnEnded("completed", "resp_1", stored=True))
    core.remember("key-1", b"body")
    core.receive(MessageReceived((USER,)))
    record = decode_record(encode_record(record_of(core, owner="proc_a", lease_until=5.0)))
    assert record.active_turn == core.turns[1].id and record.owner == "proc_a"
    back = restore(record, ids=IdFactory(1))
    assert back.snapshot() == core.snapshot()
    assert [back.turn_view(t) for t in back.turns] == [core.turn_view(t) for t in core.turns]
    assert back.items_list() == core.items_list() and back.last_response_id == "resp_1"
    assert back.replayed("key-1", b"body")
    assert back.active is not None and back.state is SS.IN_PROGRESS
    back.receive(TurnEnded("failed", reason="server_error", message="lost", turn_id=back.active.id))
    assert back.state is SS.IDLE and back.turns[1].status is TS.FAILED
    idle = record_of(back, owner="proc_b", lease_until=9.0)
    assert idle.active_turn is None and idle.owner is None


def test_a_failed_turn_says_why_then_the_session_is_idle() -> None:
    core = _core()
    core.receive(MessageReceived((USER,)))
    core.outputs_to_send()
    core.receive(TurnEnded("incomplete", "resp_1", reason="max_output_tokens", stored=True))
    assert _published(core) == ["error", "agent.session.turn.failed", "agent.session.idle"]
    error = core.turns[0].error
    assert error is not None and error.code == "max_output_tokens"


def test_inputs_outside_the_table_raise() -> None:
    core = _core()
    with pytest.raises(AgentStateError):
        core.receive(TurnPaused(()))
    with pytest.raises(AgentStateError):
        core.receive(AllAnswered())
    core.receive(DeleteReceived())
    with pytest.raises(AgentStateError):
        core.receive(MessageReceived((USER,)))
    # Every session row leads to a state of the enum; every turn row to a turn state.
    assert all(after in SS for _, after in TRANSITIONS.values())
    assert {after for after in TURN_TRANSITIONS.values()} <= set(TS)


def test_an_idempotency_key_with_another_body_is_refused() -> None:
    core = _core()
    core.remember("k", b"a")
    assert core.replayed("k", b"a") and not core.replayed("other", b"a") and not core.replayed(None, b"a")
    with pytest.raises(ProtocolError) as info:
        core.replayed("k", b"b")
    assert info.value.code == "idempotency_key_reused"


# -- the routes --------------------------------------------------------------------------------------


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=2, seed=5) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def _frames(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            lines = frame.split(b"\n")
            data = b"\n".join(line[6:] for line in lines if line.startswith(b"data: "))
            event = json.loads(data)
            name = next(line[7:].decode() for line in lines if line.startswith(b"event: "))
            assert name == event["type"]
            EVENT_MODELS[event["type"]].model_validate(event)
            yield event


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    """GET a resource or a page, each object checked against the SDK's model."""
    resp = await http.get(url, headers=BETA)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    for obj in body["data"] if body.get("object") == "list" else [body]:
        if obj.get("object") == "agent.session":
            AgentSession.model_validate(obj)
        elif obj.get("object") == "agent.session.turn":
            Turn.model_validate(obj)
        else:
            ITEM_MODELS[obj["type"]].model_validate(obj)
    return body


def _create(**extra: Any) -> dict[str, Any]:
    return {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [TOOL]}, "input": "hi", **extra}


async def _post_events(
    http: aiohttp.ClientSession, live: Live, sid: str, events: list[dict[str, Any]], key: str | None = None
) -> aiohttp.ClientResponse:
    headers = {**BETA, **({"Idempotency-Key": key} if key else {})}
    return await http.post(f"{live.base_url}/agents/sessions/{sid}/events", headers=headers, json={"events": events})


def _tool_result(item: dict[str, Any], output: str = "ok") -> dict[str, Any]:
    return {
        "type": "agent.session.input.tool_result",
        "turn_id": item["turn_id"],
        "call_id": item["call_id"],
        "success": True,
        "output": output,
    }


async def test_every_route_requires_the_beta_header(live: Live, http: aiohttp.ClientSession) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", json=_create())
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "missing_beta_header"
    resp = await http.get(f"{live.base_url}/agents/sessions/sess_x/events")
    assert resp.status == 400


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (_create(environment={"type": "openai_hosted"}), 400, "unsupported_value", "environment.type"),
        (_create(agent={"model": "sim", "tools": [{"type": "web_search"}]}), 400, "unsupported_value", None),
        (_create(bogus=1), 400, "unknown_parameter", "bogus"),
        (_create(input=None), 400, "missing_required_parameter", "input"),
        (_create(agent_id="agent_nope"), 404, "not_found", "agent_id"),
        (_create(vault_ids=["vault_1"]), 400, "unsupported_value", "vault_ids"),
        (
            _create(input=[{"role": "user", "content": [{"type": "input_text"}]}]),
            400,
            "missing_required_parameter",
            "input[0].content[0].text",
        ),
        (_create(prompt_cache_options={"ttl": "1h"}), 400, None, "prompt_cache_options.ttl"),
    ],
)
async def test_bad_creates_get_the_apis_errors(
    live: Live, http: aiohttp.ClientSession, body: dict[str, Any], status: int, code: str | None, param: str | None
) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


async def test_a_message_part_without_text_is_refused_at_its_path(live: Live, http: aiohttp.ClientSession) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create())
    sid = (await resp.json())["id"]
    message = {"type": "agent.session.input.message", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}
    refused = await _post_events(http, live, sid, [{"type": "agent.session.input.cancel"}, message])
    assert refused.status == 400
    error = (await refused.json())["error"]
    assert error["code"] == "missing_required_parameter"
    assert error["param"] == "events[1].input[0].content[0].text"
    assert error["message"] == "Missing required parameter: 'events[1].input[0].content[0].text'."


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "body",
    [
        '{"environment":{"type":"none"},"input":"hi","agent":{"model":"sim","tools":[{"type":"function",'
        '"name":"f","description":"d","parameters":{"type":"object","properties":{"a":' + _deep(5000) + "}}}]}}",
        '{"environment":{"type":"none"},"input":[{"role":"user","content":' + _deep(5000) + "}]}",
        '{"environment":{"type":"none"},"input":"hi","metadata":' + _deep(5000) + "}",
    ],
    ids=["tool-parameters", "message-content", "metadata"],
)
async def test_deep_nesting_in_a_create_is_a_400_not_a_500(
    live: Live, http: aiohttp.ClientSession, body: str, caplog: pytest.LogCaptureFixture
) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, data=body)
    assert resp.status == 400 and resp.content_type == "application/json"
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] in ("invalid_json", "invalid_type")
    assert not [r for r in caplog.records if r.exc_info], "a client's bad body logged a traceback"


async def test_deep_nesting_in_a_tool_result_is_a_400_and_applies_nothing(
    live: Live, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create())
    sid = (await resp.json())["id"]
    result = '{"type":"agent.session.input.tool_result","turn_id":"t","call_id":"c","success":true,"output":'
    body = '{"events":[' + result + _deep(5000) + "}]}"
    refused = await http.post(f"{live.base_url}/agents/sessions/{sid}/events", headers=BETA, data=body)
    assert refused.status == 400
    error = (await refused.json())["error"]
    assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]
    assert not [r for r in caplog.records if r.exc_info]


async def test_tool_definitions_past_8_mib_are_refused(http: aiohttp.ClientSession) -> None:
    big = {**TOOL, "description": "x" * (8 * 1024 * 1024)}
    body = encode(_create(agent={"model": "sim", "tools": [big]}))
    config = ServerConfig(max_message_bytes=16 * 1024 * 1024)  # so the tool limit is the one that bites
    async with live_server(config=config) as live:
        resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, data=io.BytesIO(body))
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_value" and error["param"] == "agent.tools"


async def test_12h_prompt_cache_ttl_is_echoed(live: Live, http: aiohttp.ClientSession) -> None:
    resp = await http.post(
        f"{live.base_url}/agents/sessions", headers=BETA, json=_create(prompt_cache_options={"ttl": "12h"})
    )
    session = await resp.json()
    assert resp.status == 200 and session["prompt_cache_options"] == {"ttl": "12h"}
    assert session["status"] == "in_progress" and session["object"] == "agent.session"


async def test_the_raw_loop_race_replay_and_idle(live: Live, http: aiohttp.ClientSession) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    seen: list[str] = []
    sid = ""
    async for event in _frames(resp):
        seen.append(event["type"])
        if event["type"] == "agent.session.created":
            sid = event["session"]["id"]
            # A tool result before any call is registered: the race 400.
            early = await _post_events(http, live, sid, [{**_tool_result({"turn_id": "turn_x", "call_id": "call_x"})}])
            assert early.status == 400
            assert (await early.json())["error"] == {
                "type": "invalid_request_error",
                "code": "invalid_request_error",
                "message": "Unknown pending tool call: call_x",
                "param": "events[0].call_id",
            }
        item = event.get("item")
        if event["type"] == "agent.session.turn.item.added" and item["type"] == "function_call":
            json.loads(item["arguments"])  # whole when item.added carries it
            for _ in range(2):  # the same key twice: applied once
                ok = await _post_events(http, live, sid, [_tool_result(item)], key=f"key-{item['call_id']}")
                assert ok.status == 202 and await ok.read() == b""
    assert seen[0] == "agent.session.created" and seen[-2:] == ["agent.session.turn.completed", "agent.session.idle"]
    items = await _get(http, f"{live.base_url}/agents/sessions/{sid}/items?order=asc")
    kinds = [i["type"] for i in items["data"]]
    assert kinds == ["message", *["function_call", "function_call_output"] * 2, "message"]
    assert items["has_more"] is False and items["first_id"] == items["data"][0]["id"]
    page = await _get(http, f"{live.base_url}/agents/sessions/{sid}/items?limit=2")
    assert page["has_more"] is True and [i["type"] for i in page["data"]] == ["message", "function_call_output"]


async def _wait_for(frames: AsyncIterator[dict[str, Any]], kind: str) -> dict[str, Any]:
    async for event in frames:
        if event["type"] == kind:
            return event
    raise AssertionError(f"the stream ended before {kind}")


async def test_steer_and_cancel_over_http(live: Live, http: aiohttp.ClientSession) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create())
    sid = (await resp.json())["id"]
    events = await http.get(f"{live.base_url}/agents/sessions/{sid}/events", headers=BETA)
    frames = _frames(events)
    # The first turn may be waiting already (subscribed after the create), so read its state.
    session = await _get(http, f"{live.base_url}/agents/sessions/{sid}")
    if session["status"] != "requires_action":
        session = (await _wait_for(frames, "agent.session.requires_action"))["session"]
    (action,) = session["required_actions"]
    steer = {
        "type": "agent.session.input.message",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "also check CI"}]}],
    }
    assert (await _post_events(http, live, sid, [steer])).status == 202
    assert (await _post_events(http, live, sid, [_tool_result(action)])).status == 202
    session = (await _wait_for(frames, "agent.session.requires_action"))["session"]
    items = await _get(http, f"{live.base_url}/agents/sessions/{sid}/items?order=asc")
    kinds = [(i["type"], i.get("role")) for i in items["data"]]
    # The steer joined at the step boundary: after the output, before the next call.
    assert kinds[:5] == [
        ("message", "user"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "user"),
        ("function_call", None),
    ]
    assert (await _post_events(http, live, sid, [{"type": "agent.session.input.cancel"}])).status == 202
    cancelled = await _wait_for(frames, "agent.session.turn.cancelled")
    assert cancelled["turn"]["status"] == "cancelled"
    idle = await _wait_for(frames, "agent.session.idle")
    assert idle["session"]["required_actions"] == []
    # The next message starts a new turn; a result for the cancelled turn's call is refused.
    late = await _post_events(http, live, sid, [_tool_result(session["required_actions"][0])])
    assert late.status == 400
    events.close()
    turns = await _get(http, f"{live.base_url}/agents/sessions/{sid}/turns")
    assert [t["status"] for t in turns["data"]] == ["cancelled"]
    deleted = await (await http.delete(f"{live.base_url}/agents/sessions/{sid}", headers=BETA)).json()
    assert deleted == {"id": sid, "deleted": True, "object": "agent.session.deleted"}
    gone = await http.get(f"{live.base_url}/agents/sessions/{sid}", headers=BETA)
    assert gone.status == 404 and (await gone.json())["error"]["code"] == "not_found"


def test_wire_events_decode_as_the_sdk_types() -> None:
    """Every event struct is tagged with its `type` (the SDK's discriminator)."""
    for kind in w.SessionEvent.__args__:  # type: ignore[attr-defined]
        assert msgspec.inspect.type_info(kind).tag_field == "type"  # type: ignore[attr-defined]


def test_the_strict_check_can_fail() -> None:
    """The SDK models do validate: a session event missing its snapshot is refused."""
    with pytest.raises(pydantic.ValidationError):
        EVENT_MODELS["agent.session.idle"].model_validate({"type": "agent.session.idle", "event_id": "e"})


async def test_a_bad_tool_output_is_refused_whole_and_updates_are_not_served(
    live: Live, http: aiohttp.ClientSession
) -> None:
    resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create())
    sid = (await resp.json())["id"]
    events = await http.get(f"{live.base_url}/agents/sessions/{sid}/events", headers=BETA)
    session = await _get(http, f"{live.base_url}/agents/sessions/{sid}")
    if session["status"] != "requires_action":
        session = (await _wait_for(_frames(events), "agent.session.requires_action"))["session"]
    events.close()
    (action,) = session["required_actions"]
    bad = {**_tool_result(action), "output": [{"type": "input_bogus", "text": "x"}]}
    refused = await _post_events(http, live, sid, [bad])
    assert refused.status == 400 and (await refused.json())["error"]["param"].startswith("events[0].output")
    still = await _get(http, f"{live.base_url}/agents/sessions/{sid}")
    assert still["status"] == "requires_action" and still["required_actions"] == [action]  # nothing applied
    update = await http.post(f"{live.base_url}/agents/sessions/{sid}", headers=BETA, json={"metadata": {}})
    assert update.status == 400 and (await update.json())["error"]["code"] == "unsupported_operation"


async def test_a_turn_waiting_past_the_pause_timeout_fails_and_frees_its_kv(http: aiohttp.ClientSession) -> None:
    config = ServerConfig(websocket=WebSocketConfig(append_timeout_s=0.2))
    async with live_server(tool_calls=2, seed=5, config=config) as live:
        resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
        seen: dict[str, dict[str, Any]] = {}
        async for event in _frames(resp):
            seen[event["type"]] = event
        assert "agent.session.requires_action" in seen  # it waited, nobody answered
        failed = seen["agent.session.turn.failed"]["turn"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "request_timeout"
        assert seen["error"]["error"]["code"] == "request_timeout"
        assert live.app[ENGINE].statistics().kv_idle_token_s > 0


class _StoreDown(MemoryStore):
    """A store whose writes of responses fail (`sessions`: and of sessions)."""

    def __init__(self, *, sessions: bool = False) -> None:
        super().__init__()
        self.sessions = sessions

    async def put(self, response_id: str, value: bytes) -> None:
        if self.sessions or response_id.startswith("resp_"):
            raise StoreUnavailable("redis at 10.0.0.7:6379 refused the connection")
        await super().put(response_id, value)


async def test_a_store_outage_fails_the_turn_with_server_error(http: aiohttp.ClientSession) -> None:
    """docs/reliability.md: a turn whose response cannot be stored ends with an `error` event
    `server_error` (the turn error codes' catch-all) carrying the store's message, then
    `agent.session.turn.failed`; a session that cannot be stored is a 503 and runs nothing."""
    async with live_server(store=_StoreDown(), tool_calls=0) as live:
        resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
        events = [event async for event in _frames(resp)]
    kinds = [e["type"] for e in events]
    assert "agent.session.turn.failed" in kinds and "agent.session.turn.completed" not in kinds
    error = next(e for e in events if e["type"] == "error")["error"]
    assert error["code"] == "server_error" and "10.0.0.7" not in json.dumps(events)
    assert error["message"] == "The response store is unavailable. Please retry."
    async with live_server(store=_StoreDown(sessions=True), tool_calls=0) as live:
        resp = await http.post(f"{live.base_url}/agents/sessions", headers=BETA, json=_create(stream=True))
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "store_unavailable"
        assert live.app[ENGINE].statistics().responses == 0  # no turn ran for a session not stored
