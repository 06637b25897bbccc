"""The WebSocket connection core, driven without sockets: exact outputs, every (state, input) pair."""

from __future__ import annotations

import itertools
import json

import msgspec
import numpy as np
import pytest

from prototype.context import conversation
from prototype.context.cache import CacheEntry
from prototype.context.conversation import Context, Preamble, normalize_create
from prototype.wire.errors import ProtocolError
from prototype.wire.requests import CreateParams, ResponseSteer
from prototype.wire.schemas import RequiredInput, Response, decode_client_event
from prototype.ws.connection import Connection, limit_message
from prototype.ws.events import (
    INPUT_TYPES,
    AbortPause,
    AckInject,
    AllAnswered,
    AppendReceived,
    ArmPauseTimer,
    BadFrame,
    CallEmitted,
    CancelJob,
    CloseSocket,
    CreateReceived,
    Dequeue,
    Disconnected,
    Job,
    LimitReached,
    PauseTimedOut,
    ResponseEnded,
    ResponsePaused,
    ResumeJob,
    SendFrame,
    StartJob,
    SteerReceived,
    TakeInput,
    TurnEnded,
)
from prototype.ws.lanes import CS, ConnectionStateError, Lane


def create(**fields: object) -> str:
    return json.dumps({"type": "response.create", "model": "sim", "input": "hi", **fields})


def entry(response_id: str) -> CacheEntry:
    return CacheEntry(
        Response(id=response_id, created_at=0, status="completed", model="sim"),
        Context(),
        0,
        Preamble(b"", np.zeros(0, dtype=np.uint32)),
        store=False,
    )


def errors(outputs: list[object]) -> list[dict[str, object]]:
    return [json.loads(o.data) for o in outputs if isinstance(o, SendFrame)]


def started(outputs: list[object]) -> list[Job]:
    return [o.job for o in outputs if isinstance(o, StartJob)]


def test_first_create_starts_at_once() -> None:
    c = Connection()
    c.receive_text(create())
    jobs = started(c.outputs_to_send())
    assert [j.number for j in jobs] == [1] and c.state is CS.ACTIVE
    assert jobs[0].cached is None


def test_creates_queue_fifo_and_never_interleave() -> None:
    c = Connection()
    for i in range(3):
        c.receive_text(create(input=f"m{i}"))
    first = started(c.outputs_to_send())
    assert len(first) == 1 and len(c.queue) == 2
    c.response_ended(first[0], entry("resp_a"))
    second = started(c.outputs_to_send())
    assert [j.request.items[0].raw for j in second] == [b'{"type":"message","role":"user","content":"m1"}']
    c.response_ended(second[0], entry("resp_b"))
    third = started(c.outputs_to_send())
    assert third[0].number == 3
    c.response_ended(third[0], entry("resp_c"))
    assert c.outputs_to_send() == [] and c.state is CS.IDLE and c.cache is not None
    assert c.cache.response_id == "resp_c"


def test_cache_hit_is_resolved_when_the_job_starts() -> None:
    c = Connection()
    c.receive_text(create())
    job = started(c.outputs_to_send())[0]
    # pipelined continuation of the in-flight response: resolved only after it ends
    c.receive_text(create(previous_response_id="resp_a"))
    assert started(c.outputs_to_send()) == []
    c.response_ended(job, entry("resp_a"))
    nxt = started(c.outputs_to_send())[0]
    assert nxt.cached is not None and nxt.cached.response_id == "resp_a"
    assert (c.cache_hits, c.cache_misses) == (1, 0)


def test_miss_is_counted_and_job_gets_no_entry() -> None:
    c = Connection()
    c.receive_text(create(previous_response_id="resp_zzz"))
    job = started(c.outputs_to_send())[0]
    assert job.cached is None and (c.cache_hits, c.cache_misses) == (0, 1)


TOOL = {"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {"p": {"type": "string"}}}}


def test_a_resent_tool_list_is_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real = conversation.check_parameters

    def counting(schema: object, *, function: str, param: str) -> None:
        checked.append(function)
        real(schema, function=function, param=param)

    monkeypatch.setattr(conversation, "check_parameters", counting)
    c = Connection()
    other = {**TOOL, "name": "cat"}
    bad = {**TOOL, "name": "bad", "parameters": {"type": "object", "properties": {"p": {"type": 7}}}}
    tool_lists = [[TOOL], [TOOL], [TOOL, other], [bad], [TOOL, other]]
    refused = []
    for tools in tool_lists:
        c.receive_text(create(tools=tools))
        outputs = c.outputs_to_send()
        refused.append([e["error"]["param"] for e in errors(outputs)])
        for job in started(outputs):
            assert [t.name for t in job.request.tools] == [t["name"] for t in tools]
            c.response_ended(job, entry(f"resp_{len(checked)}"))
    assert refused == [[], [], [], ["tools[0].parameters"], []]  # the bad list is still refused
    # Validated: the first list, the changed list, the bad one; the resends are not.
    assert checked == ["ls", "ls", "cat", "bad"] and c.tools is not None and c.tools.hits == 2

    checked.clear()
    plain = Connection(reuse_tools=False)  # without the state cache (`--disable state_cache`)
    for _ in range(2):
        plain.receive_text(create(tools=[TOOL]))
        for job in started(plain.outputs_to_send()):
            plain.response_ended(job, entry("resp_x"))
    assert checked == ["ls", "ls"]


def test_failed_turn_evicts_referenced_id() -> None:
    c = Connection()
    c.receive_text(create())
    c.response_ended(started(c.outputs_to_send())[0], entry("resp_a"))
    c.receive_text(create(previous_response_id="resp_a"))
    job = started(c.outputs_to_send())[0]
    err = ProtocolError("boom", code="server_error", status=500)
    c.response_ended(job, None, err)
    assert c.cache is None
    assert errors(c.outputs_to_send()) == [
        {
            "type": "error",
            "status": 500,
            "error": {"type": "server_error", "code": "server_error", "message": "boom", "param": None},
        }
    ]


def test_invalid_frame_naming_cached_id_evicts_it() -> None:
    c = Connection()
    c.receive_text(create())
    c.response_ended(started(c.outputs_to_send())[0], entry("resp_a"))
    c.receive_text(create(previous_response_id="resp_a", background=True))
    out = errors(c.outputs_to_send())
    assert out[0]["error"]["param"] == "background" and out[0]["status"] == 400  # type: ignore[index]
    assert c.cache is None and c.state is CS.IDLE


def test_invalid_frame_naming_other_id_keeps_cache() -> None:
    c = Connection()
    c.receive_text(create())
    c.response_ended(started(c.outputs_to_send())[0], entry("resp_a"))
    c.receive_text(create(previous_response_id="resp_b", model=5))
    assert errors(c.outputs_to_send())[0]["error"]["param"] == "model"  # type: ignore[index]
    assert c.cache is not None


def test_append_mode_has_no_steering() -> None:
    c = Connection(append_mode=True)
    c.receive_text('{"type": "response.steer", "previous_response_id": "resp_a", "input": "x"}')
    (err,) = errors(c.outputs_to_send())
    assert err["error"] == {  # type: ignore[comparison-overlap]
        **err["error"],  # type: ignore[dict-item]
        "code": "unsupported_event_type",
        "param": "type",
        "message": "Unsupported event type: 'response.steer'.",
    }


@pytest.mark.parametrize(
    ("frame", "code", "param", "message"),
    [
        ("{not json", "invalid_json", None, None),
        ("[1, 2]", "invalid_json", None, "Each WebSocket message must be a JSON object."),
        ('"hello"', "invalid_json", None, "Each WebSocket message must be a JSON object."),
        ('{"model": "x"}', "missing_required_parameter", "type", "Missing required parameter: 'type'."),
        ('{"type": "response.steer"}', "invalid_value", None, None),  # WebSocket mode steers; this one has no input
        ('{"type": "session.update"}', "unsupported_event_type", "type", "Unsupported event type: 'session.update'."),
        ('{"type": "response.create", "model": "m", "store": "yes"}', "invalid_type", "store", None),
        (
            '{"type": "response.create", "input": "x"}',
            "missing_required_parameter",
            "model",
            "Missing required parameter: 'model'.",
        ),
        ('{"type": "response.append"}', "invalid_value", None, None),
    ],
)
def test_bad_frames_get_error_events_and_socket_stays_open(
    frame: str, code: str, param: str | None, message: str | None
) -> None:
    c = Connection()
    c.receive_text(frame)
    out = c.outputs_to_send()
    assert not any(isinstance(o, CloseSocket) for o in out)
    (err,) = errors(out)
    assert err["status"] == 400 and err["type"] == "error"
    assert err["error"]["code"] == code and err["error"]["param"] == param  # type: ignore[index]
    assert err["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    if message is not None:
        assert err["error"]["message"] == message  # type: ignore[index]
    c.receive_text(create())
    assert started(c.outputs_to_send())


def test_append_without_opt_in_is_unsupported() -> None:
    c = Connection()
    c.receive_text(json.dumps({"type": "response.append", "input": []}))
    (err,) = errors(c.outputs_to_send())
    assert err["error"]["code"] == "unsupported_event_type"  # type: ignore[index]


def test_reject_concurrent_mode() -> None:
    c = Connection(reject_concurrent=True)
    c.receive_text(create())
    c.outputs_to_send()
    c.receive_text(create())
    (err,) = errors(c.outputs_to_send())
    assert err["status"] == 409 and err["error"]["code"] == "concurrent_request"  # type: ignore[index]
    assert not c.queue


def test_limit_idle_sends_exact_error_then_closes_1001() -> None:
    c = Connection(lifetime_s=3600)
    c.limit_reached()
    out = c.outputs_to_send()
    assert errors(out) == [
        {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_connection_limit_reached",
                "message": "Responses websocket connection limit reached (60 minutes). "
                "Create a new websocket connection to continue.",
                "param": None,
            },
        }
    ]
    assert out[-1] == CloseSocket(1001, "connection limit reached")
    assert c.state is CS.EXPIRED


def test_limit_lets_in_flight_finish_and_refuses_later_creates() -> None:
    c = Connection(lifetime_s=2)
    c.receive_text(create())
    job = started(c.outputs_to_send())[0]
    c.receive_text(create())  # queued before the limit
    c.limit_reached()
    assert c.outputs_to_send() == [] and c.state is CS.DRAINING
    c.receive_text(create())  # after the limit: refused at once
    (err,) = errors(c.outputs_to_send())
    assert err["error"]["message"] == limit_message(2)  # type: ignore[index]
    assert "(2 seconds)" in limit_message(2)
    c.response_ended(job, entry("resp_a"))
    out = c.outputs_to_send()
    assert started(out) == []  # the queued create is answered, not started
    assert [e["error"]["code"] for e in errors(out)] == ["websocket_connection_limit_reached"]  # type: ignore[index]
    assert isinstance(out[-1], CloseSocket) and c.state is CS.EXPIRED


def test_disconnect_cancels_and_frees_everything() -> None:
    c = Connection()
    c.receive_text(create())
    c.response_ended(started(c.outputs_to_send())[0], entry("resp_a"))
    c.receive_text(create(previous_response_id="resp_a"))
    job = started(c.outputs_to_send())[0]
    c.receive_text(create())
    c.disconnected()
    assert c.outputs_to_send() == [CancelJob(job)]
    assert c.cache is None and not c.queue and c.in_flight is None and c.state is CS.CLOSED
    c.disconnected()  # idempotent
    assert c.outputs_to_send() == []


def test_response_ended_for_a_stale_job_is_a_bug() -> None:
    c = Connection()
    c.receive_text(create())
    c.outputs_to_send()
    stale = Job(99, normalize_create(CreateParams(model="m", input="x"), websocket=True), None)
    with pytest.raises(ConnectionStateError, match=r"^job 99 is not the one in flight$"):
        c.response_ended(stale, None)


# -- every (state, input) pair, against a table written here -------------------------------------
#
# One row per legal move of a lane, in plain words: (state, input, what the connection puts out,
# next state). Every other (state, input) pair must raise ConnectionStateError and leave the lane
# where it was. The rows are run on the default lane and on a named lane, in both dialects of the
# pause machine (append mode and the beta): one table, whose actions render the wire per dialect.

OPEN = ("idle", "active", "paused", "draining", "expired")
LEGAL: list[tuple[str, str, tuple[str, ...], str]] = [
    ("idle", "create", ("start",), "active"),  # a free lane starts its create at once
    ("active", "create", (), "active"),  # queued behind the one in flight
    ("paused", "create", ("error: response_paused",), "paused"),  # refused, never queued
    ("draining", "create", ("error: websocket_connection_limit_reached",), "draining"),
    ("expired", "create", ("error: websocket_connection_limit_reached",), "expired"),
    ("idle", "dequeue", ("start",), "active"),  # the next queued create starts
    ("active", "paused", ("arm pause timer",), "paused"),
    ("draining", "paused", ("abort: connection_limit",), "draining"),  # no pause after the limit
    ("paused", "all answered", ("resume",), "active"),
    ("paused", "pause timed out", ("abort: append_timeout",), "active"),
    ("paused", "limit", ("abort: connection_limit",), "draining"),
    ("active", "ended", (), "idle"),
    # Nothing left in flight on the connection: the limit is reported once (a connection-level
    # error: no stream_id), then the socket closes.
    ("draining", "ended", ("notice: websocket_connection_limit_reached", "close 1001"), "expired"),
    ("idle", "limit", ("notice: websocket_connection_limit_reached", "close 1001"), "expired"),
    ("active", "limit", (), "draining"),  # the response in flight may finish
    ("draining", "limit", (), "draining"),
    ("expired", "limit", (), "expired"),
    *[(state, "append", ("error",), state) for state in OPEN],  # an append for nothing paused: an error
    # A steer naming no response in flight: `response.steer.failed`, on no lane.
    *[(state, "steer", ("steer failed: response_not_found",), state) for state in OPEN],
    ("active", "call emitted", (), "active"),  # beta: an async call is answerable from now on
    ("draining", "call emitted", (), "draining"),
    ("active", "turn ended", ("take input",), "active"),  # beta: decoding on, the injected outputs go in
    ("draining", "turn ended", ("take input",), "draining"),
    *[(state, "bad frame", ("error: invalid_json",), state) for state in OPEN],
    ("idle", "disconnect", (), "closed"),
    ("active", "disconnect", ("cancel",), "closed"),
    ("paused", "disconnect", ("cancel",), "closed"),
    ("draining", "disconnect", ("cancel",), "closed"),
    ("expired", "disconnect", (), "closed"),
    ("closed", "disconnect", (), "closed"),
]
STATES = {
    "idle": CS.IDLE,
    "active": CS.ACTIVE,
    "paused": CS.PAUSED,
    "draining": CS.DRAINING,
    "expired": CS.EXPIRED,
    "closed": CS.CLOSED,
}
INPUTS = {
    "create": CreateReceived,
    "append": AppendReceived,
    "steer": SteerReceived,
    "call emitted": CallEmitted,
    "turn ended": TurnEnded,
    "bad frame": BadFrame,
    "dequeue": Dequeue,
    "paused": ResponsePaused,
    "all answered": AllAnswered,
    "pause timed out": PauseTimedOut,
    "ended": ResponseEnded,
    "limit": LimitReached,
    "disconnect": Disconnected,
}
REQUIRED = (RequiredInput(call_id="call_1", name="exec_command"),)


def test_the_expected_table_names_every_state_and_input() -> None:
    assert set(STATES.values()) == set(CS) and set(INPUTS.values()) == set(INPUT_TYPES)
    assert len({(row[0], row[1]) for row in LEGAL}) == len(LEGAL)


def lane_in(state: CS, stream_id: str | None, dialect: str = "append") -> tuple[Connection, Lane]:
    c = Connection(lifetime_s=1, append_mode=dialect == "append", beta=dialect == "beta")
    lanes = {} if stream_id is None else {"stream_id": stream_id}
    if stream_id is not None:  # open the lane with one finished response
        c.receive_text(create(**lanes))
        (job,) = started(c.outputs_to_send())
        c.response_ended(job, entry(job.response_id))
    if state in (CS.ACTIVE, CS.DRAINING, CS.PAUSED):
        c.receive_text(create(**lanes))
    lane = c.lanes[stream_id]
    if state is CS.PAUSED:
        assert lane.in_flight is not None
        c.response_paused(lane.in_flight, REQUIRED)
    if state in (CS.DRAINING, CS.EXPIRED):
        c.limit_reached()
    if state is CS.CLOSED:
        c.disconnected()
    c.outputs_to_send()
    assert lane.state is state
    return c, lane


def lane_input(c: Connection, lane: Lane, name: str) -> object:
    request = normalize_create(CreateParams(model="m", input="x", stream_id=lane.stream_id), websocket=True)
    job = lane.in_flight or Job(0, request, None)
    if name == "dequeue":
        lane.queue.append((0, CreateReceived(request)))
    return {
        "create": CreateReceived(request),
        "append": AppendReceived(decode_client_event(append(input=[fco("call_zz")]).encode())),  # type: ignore[arg-type]
        "steer": SteerReceived(ResponseSteer(input=msgspec.Raw(b'"stop"'), previous_response_id="resp_zz")),
        "call emitted": CallEmitted(job, RequiredInput(call_id="call_9", name="exec_command")),
        "turn ended": TurnEnded(job),
        "bad frame": BadFrame(ProtocolError("bad", code="invalid_json"), stream_id=lane.stream_id),
        "dequeue": Dequeue(),
        "ended": ResponseEnded(job, entry("resp_x")),
        "paused": ResponsePaused(job, REQUIRED),
        "all answered": AllAnswered(),
        "pause timed out": PauseTimedOut(job),
        "limit": LimitReached(),
        "disconnect": Disconnected(),
    }[name]


def described(out: object) -> str:
    if isinstance(out, StartJob):
        return "start"
    if isinstance(out, ArmPauseTimer):
        return "arm pause timer"
    if isinstance(out, ResumeJob):
        return "resume"
    if isinstance(out, AbortPause):
        return f"abort: {out.reason}"
    if isinstance(out, CancelJob):
        return "cancel"
    if isinstance(out, TakeInput):
        return "take input"
    if isinstance(out, CloseSocket):
        return f"close {out.code}"
    assert isinstance(out, SendFrame)
    kind = json.loads(out.data)["type"]
    return "steer failed" if kind == "response.steer.failed" else "error"


def expected_words(words: tuple[str, ...]) -> list[str]:
    return [w.split(":")[0].replace("notice", "error") for w in words]


@pytest.mark.parametrize("dialect", ["append", "beta"])
@pytest.mark.parametrize("stream_id", [None, "lane-1"], ids=["default lane", "named lane"])
@pytest.mark.parametrize(
    ("state", "input_name"), list(itertools.product(STATES, INPUTS)), ids=lambda v: str(v).replace(" ", "_")
)
def test_every_state_input_pair(state: str, input_name: str, stream_id: str | None, dialect: str) -> None:
    c, lane = lane_in(STATES[state], stream_id, dialect)
    event = lane_input(c, lane, input_name)
    row = next((r for r in LEGAL if r[0] == state and r[1] == input_name), None)

    def feed() -> None:
        if input_name == "limit":  # connection-wide inputs reach every lane
            c.limit_reached()
        elif input_name == "disconnect":
            c.disconnected()
        else:
            c.handle(lane, event)  # type: ignore[arg-type]

    if row is None:
        with pytest.raises(
            ConnectionStateError, match=rf"^can't handle {type(event).__name__} in state {state.upper()}$"
        ):
            feed()
        assert lane.state is STATES[state] and c.outputs_to_send() == []
        return
    _, _, outputs, nxt = row
    feed()
    out = c.outputs_to_send()
    assert [described(o).split(":")[0] for o in out] == expected_words(outputs)
    for o, words in zip(out, outputs, strict=True):
        if isinstance(o, SendFrame) and ":" in words:
            frame = json.loads(o.data)
            assert frame["error"]["code"] == words.split(": ")[1]
            lane_error = words.startswith("error")  # a lane's own errors carry its id; a notice has none
            assert frame.get("stream_id") == (stream_id if lane_error else None)
    assert lane.state is STATES[nxt]


# -- append mode -----------------------------------------------------------------------------------


def paused(required: tuple[RequiredInput, ...] = REQUIRED) -> tuple[Connection, Job]:
    c = Connection(append_mode=True)
    c.receive_text(create())
    job = started(c.outputs_to_send())[0]
    assert job.response_id.startswith("resp_")
    c.response_paused(job, required)
    assert c.outputs_to_send() == [ArmPauseTimer(job)] and c.state is CS.PAUSED
    return c, job


def fco(call_id: str, output: str = "ok") -> dict[str, str]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def append(**fields: object) -> str:
    return json.dumps({"type": "response.append", **fields})


def test_append_resumes_when_every_call_is_answered() -> None:
    two = (RequiredInput(call_id="call_a", name="f"), RequiredInput(call_id="call_b", name="g"))
    c, job = paused(two)
    c.receive_text(append(input=[fco("call_b", "B")]))
    assert c.outputs_to_send() == [] and c.state is CS.PAUSED  # partial: still waiting for call_a
    c.receive_text(append(response_id=job.response_id, input=[{"role": "user", "content": "hurry"}, fco("call_a")]))
    (resume,) = c.outputs_to_send()
    assert isinstance(resume, ResumeJob) and resume.job is job and c.state is CS.ACTIVE
    assert [json.loads(i.raw).get("call_id") or json.loads(i.raw)["content"] for i in resume.items] == [
        "call_b",
        "hurry",
        "call_a",
    ]


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        (append(input=[fco("call_zzz")]), "unknown_call_id", "input[0].call_id"),
        (append(input=[fco("call_1"), fco("call_1")]), "unknown_call_id", "input[1].call_id"),
        (
            append(input=[{"type": "function_call_output", "output": "x"}]),
            "missing_required_parameter",
            "input[0].call_id",
        ),
        (
            append(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]),
            "invalid_value",
            "input[0]",
        ),
        (append(input=[{"role": "assistant", "content": "x"}]), "invalid_value", "input[0]"),
        (append(response_id="resp_other", input=[fco("call_1")]), "response_not_found", "response_id"),
    ],
)
def test_bad_appends_are_rejected_whole_and_the_pause_holds(frame: str, code: str, param: str) -> None:
    c, _ = paused()
    c.receive_text(frame)
    (err,) = errors(c.outputs_to_send())
    assert err["status"] == 400 and err["error"]["code"] == code and err["error"]["param"] == param  # type: ignore[index]
    assert c.state is CS.PAUSED and c.pause is not None and list(c.pause.pending) == ["call_1"]


def test_append_errors_outside_a_pause() -> None:
    c = Connection(append_mode=True)
    c.receive_text(append(input=[fco("call_1")]))
    assert errors(c.outputs_to_send())[0]["error"]["code"] == "response_not_found"  # type: ignore[index]
    c.receive_text(create())
    job = started(c.outputs_to_send())[0]
    c.receive_text(append(input=[fco("call_1")]))
    assert errors(c.outputs_to_send())[0]["error"]["code"] == "response_not_paused"  # type: ignore[index]
    c.response_ended(job, entry(job.response_id))
    for frame in (append(input=[fco("call_1")]), append(response_id=job.response_id, input=[fco("call_1")])):
        c.receive_text(frame)
        err = errors(c.outputs_to_send())[0]
        assert err["error"] == {
            "type": "invalid_request_error",
            "code": "response_already_completed",
            "message": f"Response '{job.response_id}' has already completed.",
            "param": "response_id",
        }


def test_inject_is_acknowledged_by_the_paused_response_stream() -> None:
    c, job = paused()
    bad = {"type": "response.inject", "response_id": job.response_id, "input": [fco("call_9", "{}")]}
    c.receive_text(json.dumps(bad))
    (refused,) = c.outputs_to_send()
    assert isinstance(refused, AckInject) and refused.job is job and refused.refused is not None
    assert refused.refused.code == "unknown_call_id"
    assert refused.refused.message == f"No pending function call with call_id 'call_9' in response '{job.response_id}'."
    assert [json.loads(bytes(r)) for r in refused.refused.input] == [fco("call_9", "{}")]
    c.receive_text(json.dumps({**bad, "input": [fco("call_1")]}), at=7.5)
    ack, resume = c.outputs_to_send()
    assert ack == AckInject(job) and isinstance(resume, ResumeJob)
    assert (resume.at, resume.body_bytes) == (7.5, len(json.dumps({**bad, "input": [fco("call_1")]})))


def test_inject_for_an_unknown_response_fails_with_its_input_echoed() -> None:
    c = Connection(append_mode=True)
    c.receive_text(json.dumps({"type": "response.inject", "response_id": "resp_123", "input": [fco("call_123")]}))
    (failed,) = errors(c.outputs_to_send())
    assert failed["error"] == {"code": "response_not_found", "message": "Response 'resp_123' not found."}
    assert failed["input"] == [fco("call_123")] and failed["sequence_number"] == 0


def test_create_while_paused_is_refused_not_queued() -> None:
    c, job = paused()
    c.receive_text(create(previous_response_id=job.response_id))
    (err,) = errors(c.outputs_to_send())
    assert err["status"] == 409 and err["error"]["code"] == "response_paused"  # type: ignore[index]
    assert not c.queue and c.state is CS.PAUSED


def test_pause_timeout_aborts_the_response() -> None:
    c, job = paused()
    c.pause_timed_out(job)
    assert c.outputs_to_send() == [AbortPause(job, "append_timeout")] and c.state is CS.ACTIVE
    c.response_ended(job, entry(job.response_id))
    assert c.state is CS.IDLE and c.pause is None


def test_limit_while_paused_ends_the_response_then_closes() -> None:
    c, job = paused()
    c.limit_reached()
    assert c.outputs_to_send() == [AbortPause(job, "connection_limit")] and c.state is CS.DRAINING
    c.response_ended(job, entry(job.response_id))
    out = c.outputs_to_send()
    assert [e["error"]["code"] for e in errors(out)] == ["websocket_connection_limit_reached"]  # type: ignore[index]
    assert isinstance(out[-1], CloseSocket) and c.state is CS.EXPIRED


def test_pause_after_the_limit_is_aborted_at_once() -> None:
    c = Connection(append_mode=True)
    c.receive_text(create())
    job = started(c.outputs_to_send())[0]
    c.limit_reached()
    c.response_paused(job, REQUIRED)
    assert c.outputs_to_send() == [AbortPause(job, "connection_limit")] and c.state is CS.DRAINING


def test_disconnect_while_paused_frees_everything() -> None:
    c, job = paused()
    c.disconnected()
    assert c.outputs_to_send() == [CancelJob(job)]
    assert c.pause is None and c.in_flight is None and c.cache is None and c.state is CS.CLOSED


def test_pause_or_timeout_for_a_stale_job_is_a_bug() -> None:
    c, job = paused()
    stale = Job(99, job.request, None, "resp_stale")
    with pytest.raises(ConnectionStateError, match=r"^job 99 is not the one in flight$"):
        c.pause_timed_out(stale)
    assert c.state is CS.PAUSED


# -- lanes (`stream_id`) ---------------------------------------------------------------------------


def frames(outputs: list[object]) -> list[dict[str, object]]:
    return errors(outputs)


def test_lanes_run_concurrently_and_each_lane_in_order() -> None:
    c = Connection()
    c.receive_text(create(stream_id="a"))
    c.receive_text(create(stream_id="b"))
    c.receive_text(create(stream_id="a", input="second on a"))
    a1, b1 = started(c.outputs_to_send())
    assert (a1.stream_id, b1.stream_id) == ("a", "b") and c.lanes["a"].state is CS.ACTIVE
    assert len(c.lanes["a"].queue) == 1 and c.state is CS.IDLE  # the default lane is untouched
    c.response_ended(b1, entry(b1.response_id))
    assert c.outputs_to_send() == []  # nothing waits on b
    c.response_ended(a1, entry(a1.response_id))
    (a2,) = started(c.outputs_to_send())
    assert a2.stream_id == "a" and json.loads(a2.request.items[0].raw)["content"] == "second on a"


def test_null_stream_id_is_the_default_lane() -> None:
    c = Connection()
    c.receive_text(create(stream_id=None))
    (job,) = started(c.outputs_to_send())
    assert job.stream_id is None and c.in_flight is job and c.named_lanes == 0


def test_at_most_16_in_flight_and_waiting_lanes_start_in_arrival_order() -> None:
    c = Connection()
    for n in range(18):
        c.receive_text(create(stream_id=f"lane-{n}"))
    jobs = started(c.outputs_to_send())
    assert [j.stream_id for j in jobs] == [f"lane-{n}" for n in range(16)] and c.n_in_flight == 16
    c.response_ended(jobs[5], entry(jobs[5].response_id))
    (nxt,) = started(c.outputs_to_send())
    assert nxt.stream_id == "lane-16"  # the earliest waiting, not the lane that freed the slot
    c.response_ended(jobs[0], entry(jobs[0].response_id))
    assert [j.stream_id for j in started(c.outputs_to_send())] == ["lane-17"]


def test_the_33rd_named_lane_is_refused_and_the_others_keep_running() -> None:
    c = Connection()
    for n in range(32):
        c.receive_text(create(stream_id=f"l{n}"))
    jobs = started(c.outputs_to_send())
    assert len(jobs) == 16
    c.receive_text(create(stream_id="one-too-many", previous_response_id="resp_x"))
    assert frames(c.outputs_to_send()) == [
        {
            "stream_id": "one-too-many",
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "websocket_stream_limit_reached",
                "message": "This WebSocket connection has reached its stream limit.",
                "param": "stream_id",
            },
        }
    ]
    assert "one-too-many" not in c.lanes and c.n_in_flight == 16
    c.receive_text(create())  # the default lane does not count
    c.receive_text(create(stream_id="l3"))  # nor does reusing a lane
    assert c.outputs_to_send() == [] and len(c.lanes["l3"].queue) == 1 and len(c.queue) == 1


@pytest.mark.parametrize("bad", ["", "has space", "ü", "x" * 257, 5, ["a"], {"a": 1}])
def test_a_malformed_stream_id_is_refused_without_a_lane(bad: object) -> None:
    c = Connection()
    c.receive_text(create(stream_id="ok"))
    (job,) = started(c.outputs_to_send())
    c.receive_text(create(stream_id=bad))
    (err,) = frames(c.outputs_to_send())
    assert "stream_id" not in err and err["status"] == 400
    assert err["error"] == {  # type: ignore[comparison-overlap]
        "type": "invalid_request_error",
        "code": "invalid_stream_id",
        "message": "The 'stream_id' field must be a non-empty string with at most 256 characters and may only "
        "contain letters, numbers, underscores, hyphens, and periods.",
        "param": "stream_id",
    }
    assert c.lanes["ok"].in_flight is job and set(c.lanes) == {None, "ok"}


def test_the_longest_valid_stream_id_opens_a_lane() -> None:
    c = Connection()
    c.receive_text(create(stream_id="A-z_0." + "x" * 250))
    assert len(started(c.outputs_to_send())) == 1


def test_request_errors_on_a_lane_carry_its_stream_id_and_connection_errors_none() -> None:
    c = Connection()
    c.receive_text(create(stream_id="a", temperature="hot"))  # validation fails: request-scoped
    (err,) = frames(c.outputs_to_send())
    assert err["stream_id"] == "a"
    c.receive_text("{not json")  # connection-level
    (err,) = frames(c.outputs_to_send())
    assert "stream_id" not in err
    c.receive_text(create(stream_id="a", previous_response_id="resp_gone"))
    (job,) = started(c.outputs_to_send())
    not_found = ProtocolError("Previous response not found.", code="previous_response_not_found")
    c.response_ended(job, None, not_found)
    (err,) = frames(c.outputs_to_send())
    assert err["stream_id"] == "a" and err["error"]["code"] == "previous_response_not_found"  # type: ignore[index]


def test_a_new_lane_forks_any_cached_response_and_the_second_taker_copies() -> None:
    c = Connection()
    c.receive_text(create(stream_id="a"))
    (a1,) = started(c.outputs_to_send())
    parent = entry(a1.response_id)
    c.response_ended(a1, parent)
    c.receive_text(create(stream_id="b", previous_response_id=a1.response_id))
    c.receive_text(create(stream_id="a", previous_response_id=a1.response_id))
    fork, cont = started(c.outputs_to_send())
    assert fork.cached is parent and cont.cached is parent and c.cache_hits == 2
    assert fork.exclusive and not cont.exclusive  # one extends the context in place, the other copies


def test_each_lane_keeps_its_own_latest_response() -> None:
    c = Connection()
    ids = {}
    for lane in ("a", "b", "a"):
        c.receive_text(create(stream_id=lane))
        (job,) = started(c.outputs_to_send())
        c.response_ended(job, entry(job.response_id))
        ids.setdefault(lane, []).append(job.response_id)
    assert c.lanes["a"].cache is not None and c.lanes["a"].cache.response_id == ids["a"][1]
    assert c.lanes["b"].cache is not None and c.lanes["b"].cache.response_id == ids["b"][0]


def lane_with_parent(c: Connection, lane: str) -> str:
    c.receive_text(create(stream_id=lane))
    (job,) = started(c.outputs_to_send())
    c.response_ended(job, entry(job.response_id))
    return job.response_id


def test_a_failed_continuation_on_its_lane_evicts_the_parent() -> None:
    c = Connection()
    parent = lane_with_parent(c, "a")
    c.receive_text(create(stream_id="a", previous_response_id=parent))
    (job,) = started(c.outputs_to_send())
    c.response_ended(job, None, ProtocolError("bad", code="server_error", status=500))
    assert c.lanes["a"].cache is None


def test_a_failed_fork_onto_another_lane_keeps_the_parent() -> None:
    c = Connection()
    parent = lane_with_parent(c, "a")
    c.receive_text(create(stream_id="b", previous_response_id=parent))
    (job,) = started(c.outputs_to_send())
    c.response_ended(job, None, ProtocolError("bad", code="server_error", status=500))
    c.receive_text(create(stream_id="c", previous_response_id=parent, temperature="hot"))  # invalid fork
    c.receive_text(create(stream_id="b", previous_response_id=parent, temperature="hot"))
    assert [f["stream_id"] for f in frames(c.outputs_to_send())] == ["b", "c", "b"]
    cached = c.lanes["a"].cache
    assert cached is not None and cached.response_id == parent


def test_cache_bytes_are_bounded_across_lanes_least_recently_used_first() -> None:
    def sized(response_id: str) -> CacheEntry:
        ctx = Context()
        items = normalize_create(CreateParams(model="m", input="x" * 100), websocket=True).items
        ctx.extend(items, [np.zeros(10, np.uint32)])
        return CacheEntry(
            Response(id=response_id, created_at=0, status="completed", model="sim"),
            ctx,
            1,
            Preamble(b"", np.zeros(0, dtype=np.uint32)),
            store=False,
        )

    one = sized("resp_probe").nbytes
    c = Connection(max_cache_bytes=2 * one)
    for lane in ("a", "b", "c"):
        c.receive_text(create(stream_id=lane))
        (job,) = started(c.outputs_to_send())
        c.response_ended(job, sized(job.response_id))
    assert [lane for lane in ("a", "b", "c") if c.lanes[lane].cache is not None] == ["b", "c"]


def test_a_paused_response_holds_only_its_own_lane() -> None:
    c = Connection(append_mode=True)
    c.receive_text(create(stream_id="a"))
    (a1,) = started(c.outputs_to_send())
    c.response_paused(a1, REQUIRED)
    assert c.outputs_to_send() == [ArmPauseTimer(a1)]
    c.receive_text(create(stream_id="b"))
    assert [j.stream_id for j in started(c.outputs_to_send())] == ["b"]
    c.receive_text(create(stream_id="a"))
    (err,) = frames(c.outputs_to_send())
    assert err["stream_id"] == "a" and err["error"]["code"] == "response_paused"  # type: ignore[index]
    c.receive_text(append(response_id=a1.response_id, input=[fco("call_1")]))
    (resume,) = c.outputs_to_send()
    assert isinstance(resume, ResumeJob) and resume.job is a1 and c.lanes["a"].state is CS.ACTIVE


def test_inject_acknowledgements_go_to_the_lane_response() -> None:
    c = Connection(append_mode=True)
    c.receive_text(create(stream_id="a"))
    (a1,) = started(c.outputs_to_send())
    c.response_paused(a1, REQUIRED)
    c.outputs_to_send()
    inject = {"type": "response.inject", "response_id": a1.response_id, "input": [fco("call_1")]}
    c.receive_text(json.dumps(inject))
    ack, _ = c.outputs_to_send()
    assert ack == AckInject(a1) and a1.stream_id == "a"  # sent through lane a's stream


def test_limit_closes_once_every_lane_is_done() -> None:
    c = Connection()
    c.receive_text(create(stream_id="a"))
    c.receive_text(create(stream_id="b"))
    c.receive_text(create(stream_id="b", input="queued"))
    a1, b1 = started(c.outputs_to_send())
    c.limit_reached()
    assert c.outputs_to_send() == []
    c.response_ended(a1, entry(a1.response_id))
    assert c.outputs_to_send() == []  # b is still in flight
    c.response_ended(b1, entry(b1.response_id))
    out = c.outputs_to_send()
    assert [(f.get("stream_id"), f["error"]["code"]) for f in frames(out)] == [  # type: ignore[index]
        ("b", "websocket_connection_limit_reached")  # the create queued on b, refused
    ]
    assert isinstance(out[-1], CloseSocket)
    c.receive_text(create(stream_id="new"))  # a lane opened after the limit refuses at once
    (err,) = frames(c.outputs_to_send())
    assert err["stream_id"] == "new" and err["error"]["code"] == "websocket_connection_limit_reached"  # type: ignore[index]


def test_disconnect_cancels_every_lane() -> None:
    c = Connection()
    c.receive_text(create(stream_id="a"))
    c.receive_text(create(stream_id="b"))
    a1, b1 = started(c.outputs_to_send())
    c.disconnected()
    assert c.outputs_to_send() == [CancelJob(a1), CancelJob(b1)]
    assert all(lane.state is CS.CLOSED and lane.cache is None for lane in c.lanes.values())


def test_a_lane_waiting_for_a_slot_is_busy_for_the_queue_limit() -> None:
    c = Connection(max_in_flight=1, max_queued=1)
    c.receive_text(create(stream_id="a"))
    started(c.outputs_to_send())
    c.receive_text(create(stream_id="b"))  # waits for the slot: b's next create
    c.receive_text(create(stream_id="b"))  # one behind it: allowed
    assert c.outputs_to_send() == [] and len(c.lanes["b"].queue) == 2
    c.receive_text(create(stream_id="b"))  # a second one behind it: over the limit
    (err,) = frames(c.outputs_to_send())
    assert err["stream_id"] == "b" and err["error"]["code"] == "queued_requests_limit_reached"  # type: ignore[index]


@pytest.mark.parametrize("append_mode", [False, True])
def test_a_frame_s_items_go_through_the_engine_s_item_parser(append_mode: bool) -> None:
    """One validation path for both transports: the parser the engine validates an HTTP body's
    items with (a virtual run's item table) also reads a create's items, and the pause dialect's
    (an append's or inject's)."""
    seen: list[object] = []

    def parser(value: str | list[msgspec.Raw]) -> tuple[conversation.Item, ...]:
        seen.append(value)
        return conversation.parse_items(value)

    c = Connection(append_mode=append_mode, item_parser=parser)
    c.receive_text(create(input=[{"type": "message", "role": "user", "content": "hi"}]))
    assert started(c.outputs_to_send()) and len(seen) == 1
    assert c.dialect.parse is parser
