"""The WebSocket connection core, driven without sockets: exact outputs, every (state, input) pair."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from prototype import conversation
from prototype.connection import (
    _TRANSITIONS,
    CS,
    INPUT_TYPES,
    AbortPause,
    AllAnswered,
    AppendReceived,
    ArmPauseTimer,
    BadFrame,
    CancelJob,
    CloseSocket,
    Connection,
    ConnectionStateError,
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
    limit_message,
)
from prototype.conversation import Context, Preamble, normalize_create
from prototype.cache import CacheEntry
from prototype.errors import ProtocolError
from prototype.schemas import CreateParams, RequiredInput, Response, ResponseAppend


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


@pytest.mark.parametrize(
    ("frame", "code", "param", "message"),
    [
        ("{not json", "invalid_json", None, None),
        ("[1, 2]", "invalid_json", None, "Each WebSocket message must be a JSON object."),
        ('"hello"', "invalid_json", None, "Each WebSocket message must be a JSON object."),
        ('{"model": "x"}', "missing_required_parameter", "type", "Missing required parameter: 'type'."),
        ('{"type": "response.steer"}', "unsupported_event_type", "type", "Unsupported event type: 'response.steer'."),
        ('{"type": "session.update"}', "unsupported_event_type", "type", "Unsupported event type: 'session.update'."),
        ('{"type": "response.create", "model": "m", "store": "yes"}', "invalid_value", "store", None),
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
    stale = Job(99, normalize_create(CreateParams(model="m"), websocket=True), None)
    with pytest.raises(ConnectionStateError, match=r"^job 99 is not the one in flight$"):
        c.response_ended(stale, None)


# -- every (state, input) pair ---------------------------------------------------------------------


REQUIRED = (RequiredInput(call_id="call_1", name="exec_command"),)


def _conn_in(state: CS) -> Connection:
    c = Connection(lifetime_s=1, append_mode=True)
    if state in (CS.ACTIVE, CS.DRAINING, CS.PAUSED):
        c.receive_text(create())
    if state is CS.PAUSED:
        assert c.in_flight is not None
        c.response_paused(c.in_flight, REQUIRED)
    if state is CS.DRAINING:
        c.limit_reached()
    if state is CS.EXPIRED:
        c.limit_reached()
    if state is CS.CLOSED:
        c.disconnected()
    c.outputs_to_send()
    assert c.state is state
    return c


def event_request() -> object:
    return normalize_create(CreateParams(model="m", input="x"), websocket=True)


def _input(c: Connection, t: type) -> object:
    request = event_request()
    job = c.in_flight or Job(0, request, None)
    return {
        CreateReceived: CreateReceived(request),
        AppendReceived: AppendReceived(ResponseAppend(input=[])),
        BadFrame: BadFrame(ProtocolError("bad", code="invalid_json")),
        Dequeue: Dequeue(),
        ResponseEnded: ResponseEnded(job, entry("resp_x")),
        ResponsePaused: ResponsePaused(job, REQUIRED),
        AllAnswered: AllAnswered(),
        PauseTimedOut: PauseTimedOut(job),
        LimitReached: LimitReached(),
        Disconnected: Disconnected(),
    }[t]


@pytest.mark.parametrize(("state", "input_type"), list(itertools.product(CS, INPUT_TYPES)))
def test_every_state_input_pair(state: CS, input_type: type) -> None:
    c = _conn_in(state)
    move = _TRANSITIONS.get((state, input_type))
    event = _input(c, input_type)
    if input_type is Dequeue and state is CS.IDLE:
        with pytest.raises(ConnectionStateError, match=r"^nothing is queued$"):
            c.handle(event)  # type: ignore[arg-type]
        c.queue.append(CreateReceived(event_request()))  # type: ignore[arg-type]
    if move is None:
        with pytest.raises(ConnectionStateError, match=rf"^can't handle {input_type.__name__} in state {state.name}$"):
            c.handle(event)  # type: ignore[arg-type]
        assert c.state is state
        return
    c.handle(event)  # type: ignore[arg-type]
    expected = move[1]
    if expected is CS.IDLE and input_type is CreateReceived:
        expected = CS.ACTIVE  # the queued create starts at once
    assert c.state is expected


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


def test_inject_is_acknowledged_in_the_paused_sequence() -> None:
    c, job = paused()
    job.counter.value = 8  # the response emitted 0..7 before pausing
    bad = {"type": "response.inject", "response_id": job.response_id, "input": [fco("call_9", "{}")]}
    c.receive_text(json.dumps(bad))
    assert errors(c.outputs_to_send()) == [
        {
            "type": "response.inject.failed",
            "sequence_number": 8,
            "response_id": job.response_id,
            "input": [fco("call_9", "{}")],
            "error": {
                "code": "unknown_call_id",
                "message": f"No pending function call with call_id 'call_9' in response '{job.response_id}'.",
            },
        }
    ]
    c.receive_text(json.dumps({**bad, "input": [fco("call_1")]}))
    out = c.outputs_to_send()
    assert errors(out) == [{"type": "response.inject.created", "sequence_number": 9, "response_id": job.response_id}]
    assert isinstance(out[-1], ResumeJob) and job.counter.value == 10


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
