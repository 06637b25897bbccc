"""Property-based fuzzing of client input (issue 8, "Bad input").

Most examples go straight to the sans-IO core (`Connection.receive_text`) and to
the HTTP body decoder (`decode_create_params` + `normalize_create`); fewer go
through the real aiohttp app on loopback (HTTP bodies, WebSocket frames) to check
status codes, error envelopes, closes and that a socket stays usable. Every Agents API
route is fuzzed through the real app only (its plan needs a running event loop).

Every bad input must get the protocol's error shape with a 4xx status and a
message free of tracebacks, file paths and exception class names. The number of
inputs tried is printed in the terminal summary; `FUZZ_SCALE=N` multiplies every
test's example count (the README quotes a run with `FUZZ_SCALE=20`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import json
import logging
import math
import os
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from prototype.config import ServerConfig
from prototype.context.conversation import normalize_create
from prototype.serve.app import ApiRunner, make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from prototype.wire.contract import from_validation_error
from prototype.wire.errors import ProtocolError
from prototype.wire.schemas import RequiredInput, checked_text, decode_create_params
from prototype.ws.connection import Connection
from prototype.ws.events import SendFrame, StartJob
from prototype.ws.lanes import CS
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.model.schema_values import sample_json
from tests.support import EXEC_TOOL

SCALE = int(os.environ.get("FUZZ_SCALE", "1"))
TRIED: collections.Counter[str] = collections.Counter()
# What must never reach a peer: traces, paths of our code, Python exception names.
LEAKS = ("Traceback", 'File "', "/work/", "prototype/", ".py", "Error:", "RecursionError", "KeyError", "TypeError")
LEAK_CLASSES = ("ValueError", "AttributeError", "IndexError", "AssertionError", "Exception")
MAX_FRAME = 256 * 1024  # the live server's frame and body limit, small so oversize inputs are cheap


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n * SCALE,
        deadline=None,
        # The default run (CI) draws the same inputs every time, so a commit passes or fails for
        # good; FUZZ_SCALE > 1 explores new ones (and finds what then becomes an @example).
        derandomize=SCALE == 1,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module", autouse=True)
def summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    line = f"fuzz inputs tried: {sum(TRIED.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items())) + ")"
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print(f"\n{line}", flush=True)


# -- strategies ---------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
FIELDS = (
    "type",
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "background",
    "generate",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "temperature",
    "top_p",
    "reasoning",
    "text",
    "truncation",
    "user",
    "service_tier",
    "prompt_cache_key",
    "stream_id",
    "response",
    "include",
    "top_logprobs",
    "safety_identifier",
    "prompt_cache_retention",
    "prompt_cache_options",
    "stream_options",
    "moderation",
    "conversation",
    "prompt",
    "context_management",
    "messages",
    "foo",
)


def valid_create() -> dict[str, Any]:
    return {
        "type": "response.create",
        "model": "sim",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "list the files"}]}],
        "tools": [EXEC_TOOL],
        "tool_choice": "auto",
        "store": False,
        "max_output_tokens": 64,
    }


@st.composite
def wrong_field(draw: st.DrawFn) -> dict[str, Any]:
    """A valid create with one field (top level, in an item or in a tool) replaced by any JSON value."""
    body = valid_create()
    where = draw(st.sampled_from(("top", "item", "part", "tool", "schema")))
    value = draw(json_values)
    if where == "top":
        body[draw(st.sampled_from(FIELDS))] = value
    elif where == "item":
        body["input"][0][draw(st.sampled_from(("type", "role", "content", "id", "call_id", "output")))] = value
    elif where == "part":
        body["input"][0]["content"][0][draw(st.sampled_from(("type", "text")))] = value
    elif where == "tool":
        body["tools"][0] = {**EXEC_TOOL, draw(st.sampled_from(("type", "name", "parameters", "strict"))): value}
    else:
        body["tools"][0] = {**EXEC_TOOL, "parameters": {"type": "object", "properties": {"cmd": value}}}
    if draw(st.booleans()):
        body.pop("type")
    return body


def deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "array" else ('{"a":' * depth + "1" + "}" * depth)


@st.composite
def deeply_nested(draw: st.DrawFn) -> str:
    depth = draw(st.sampled_from((10, 200, 600, 1000, 5000, 10_000)) | st.integers(1, 12_000))
    nested = deep(depth, draw(st.sampled_from(("array", "object"))))
    slot = draw(st.sampled_from(("root", "input", "item", "parameters", "metadata", "tool_choice", "reasoning")))
    if slot == "root":
        return nested
    head = '{"type":"response.create","model":"sim",'
    if slot == "input":
        return head + '"input":' + nested + "}"
    if slot == "item":
        return head + '"input":[{"role":"user","content":' + nested + "}]}"
    if slot == "parameters":
        schema = '{"type":"object","properties":{"a":' + nested + "}}"
        return head + '"tools":[{"type":"function","name":"f","parameters":' + schema + "}]}"
    return head + '"' + slot + '":' + nested + "}"


@st.composite
def truncated(draw: st.DrawFn) -> str:
    text = json.dumps(draw(wrong_field()) if draw(st.booleans()) else valid_create())
    return text[: draw(st.integers(0, len(text) - 1))]


@st.composite
def huge(draw: st.DrawFn) -> str:
    body = valid_create()
    big = draw(st.sampled_from('xé\u4e2d\U0001f600\\"')) * draw(st.integers(10_000, 200_000))
    where = draw(st.sampled_from(("model", "previous_response_id", "type", "text", "tool", "instructions", "key")))
    if where == "text":
        body["input"][0]["content"][0]["text"] = big
    elif where == "tool":
        body["tools"][0] = {**EXEC_TOOL, "name": big}
    elif where == "key":
        body[big] = 1
    else:
        body[where] = big
    return json.dumps(body)


# Pre-tokenizer material for long texts: words, CJK, digits, contractions, every kind of
# whitespace, '/', punctuation; in runs long enough that tokenization goes piece by piece.
PRETOKEN_MATERIAL = ("word ", "Word", "é", "漢字", "123", "'s", " ", "\t", "\n", "\r\n", "/", "!?", "-")


@st.composite
def long_text_body(draw: st.DrawFn) -> dict[str, Any]:
    """A valid create with one long text (50k to 240k characters) in one of its text slots."""
    unit = "".join(draw(st.lists(st.sampled_from(PRETOKEN_MATERIAL), min_size=1, max_size=12)))
    n = draw(st.integers(50_000, 240_000))
    text = (unit * (n // len(unit) + 1))[:n]
    while len(json.dumps(text).encode()) > MAX_FRAME - 4096:  # within the message limit
        text = text[: len(text) * 7 // 8]
    body = valid_create()
    body.pop("type")
    where = draw(st.sampled_from(("input", "content", "output", "instructions", "description", "arguments")))
    if where == "input":
        body["input"] = text
    elif where == "content":
        body["input"][0]["content"][0]["text"] = text
    elif where in ("output", "arguments"):
        call = {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"}
        output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
        (call if where == "arguments" else output)["arguments" if where == "arguments" else "output"] = text
        body["input"] += [call, output]
    elif where == "description":
        body["tools"][0] = {**EXEC_TOOL, "description": text}
    else:
        body[where] = text
    return body


@st.composite
def unknown_event(draw: st.DrawFn) -> str:
    kind = draw(
        st.text(max_size=40).filter(lambda t: t not in ("response.create", "response.append", "response.inject"))
    )
    return json.dumps({"type": kind, **draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3))})


@st.composite
def append_event(draw: st.DrawFn) -> str:
    item = draw(
        st.sampled_from(
            (
                {"type": "function_call_output", "call_id": "call_a", "output": "ok"},
                {"type": "function_call_output", "call_id": draw(st.text(max_size=10)), "output": "ok"},
                {"type": "function_call_output", "call_id": "call_a"},
                {"role": "user", "content": "steer"},
                {"role": "assistant", "content": "no"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            )
        )
        | json_values
    )
    event: dict[str, Any] = {"type": draw(st.sampled_from(("response.append", "response.inject")))}
    if draw(st.booleans()):
        event["input"] = draw(st.lists(st.just(item), max_size=3)) if draw(st.booleans()) else item
    if draw(st.booleans()):
        event["response_id"] = draw(st.sampled_from(("resp_x", "", "resp_paused")) | json_values)
    return json.dumps(event)


text_frames = st.one_of(
    json_values.map(json.dumps),
    wrong_field().map(json.dumps),
    truncated(),
    deeply_nested(),
    huge(),
    unknown_event(),
    append_event(),
    st.text(max_size=200),
)


@st.composite
def invalid_utf8(draw: st.DrawFn) -> bytes:
    data = json.dumps(valid_create()).encode()
    at = draw(st.integers(0, len(data)))
    bad = draw(st.sampled_from((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82")))
    return data[:at] + bad + data[at:]


byte_bodies = st.one_of(text_frames.map(str.encode), invalid_utf8(), st.binary(max_size=300))


# -- checks --------------------------------------------------------------------------------------------


def check_error(error: dict[str, Any], sent: str | bytes) -> None:
    """The protocol's error object, with a clear message and no internal detail."""
    assert set(error) == {"type", "code", "message", "param"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str)
    shown = sent if isinstance(sent, str) else sent.decode(errors="replace")
    for marker in LEAKS + LEAK_CLASSES:
        assert marker not in error["message"] or marker in shown, (marker, error["message"][:300])


def check_ws_error(frame: bytes, sent: str | bytes) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(frame)
    if event["type"] == "response.inject.failed":  # inject's own refusal shape (docs/protocol.md#append-mode)
        assert set(event["error"]) == {"code", "message"}
        check_error({"type": "", "param": None, **event["error"]}, sent)
        return event
    assert event["type"] == "error" and 400 <= event["status"] < 500, event
    check_error(event["error"], sent)
    return event


# -- the sans-IO core ----------------------------------------------------------------------------------


@pytest.mark.slow
@fuzz(500)
@given(frame=st.one_of(text_frames, invalid_utf8()))
def test_any_frame_gets_a_start_or_a_4xx_error_event(frame: str | bytes) -> None:
    TRIED["core frames"] += 1
    c = Connection(append_mode=True)
    c.receive_text(frame)
    out = c.outputs_to_send()
    assert len(out) == 1, out
    if isinstance(out[0], StartJob):
        assert c.state is CS.ACTIVE
        c.response_ended(out[0].job, None)
        assert c.outputs_to_send() == []
    else:
        assert isinstance(out[0], SendFrame) and c.state is CS.IDLE
        check_ws_error(out[0].data, frame)
    c.receive_text(json.dumps(valid_create()))  # the connection still takes a valid create
    assert [type(o) for o in c.outputs_to_send()] == [StartJob]


@pytest.mark.slow
@fuzz(150)
@given(frames=st.lists(st.one_of(append_event(), text_frames), min_size=1, max_size=6))
@example(  # found by CI: the append resumes the response, then a create queues behind it
    frames=[
        '{"type": "response.append"}',
        '{"type": "response.append", "input": [{"type": "function_call_output", "call_id": "call_a", "output": "ok"}]}',
        json.dumps(valid_create()),
    ]
)
def test_frames_while_paused_never_break_the_pause(frames: list[str]) -> None:
    """Appends, injects and creates at a paused response: errors or commits, never a crash."""
    TRIED["core frames while paused"] += len(frames)
    c = Connection(append_mode=True)
    c.receive_text(json.dumps(valid_create()))
    [job] = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    c.response_paused(job, (RequiredInput(call_id="call_a", name="exec_command"),))
    c.outputs_to_send()
    for frame in frames:
        c.receive_text(frame)
        for out in c.outputs_to_send():
            if isinstance(out, SendFrame):
                event = json.loads(out.data)
                if event["type"] == "response.inject.created":
                    assert event["response_id"] == job.response_id
                else:
                    check_ws_error(out.data, frame)
        assert c.state in (CS.PAUSED, CS.ACTIVE) and c.in_flight is job
        # A create while paused is refused, never queued; once an append resumed the response,
        # creates queue behind it as behind any response in progress.
        assert c.state is CS.ACTIVE or not c.queue


def decode_http(body: bytes) -> ProtocolError | None:
    """What `create_response` does with a body before the engine: the error it answers, if any."""
    try:
        normalize_create(decode_create_params(checked_text(body)), websocket=False)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return from_validation_error(exc)
    except ProtocolError as err:
        return err
    return None


@pytest.mark.slow
@fuzz(500)
@given(body=byte_bodies)
def test_any_http_body_decodes_or_gets_a_4xx(body: bytes) -> None:
    TRIED["core HTTP bodies"] += 1
    err = decode_http(body)
    if err is not None:
        assert 400 <= err.status < 500
        check_error(json.loads(msgspec.json.encode(err.body())), body)


schema_keywords = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(("object", "string", "integer", "number", "boolean", "array", "null", "nope"))
        | st.lists(st.sampled_from(("string", "null", "integer", "x")), max_size=3),
        "minimum": st.integers(-50, 50) | st.floats(-1e20, 1e20) | st.booleans(),
        "maximum": st.integers(-50, 50) | st.floats(-1e20, 1e20),
        "exclusiveMinimum": st.integers(-50, 50) | st.booleans(),
        "exclusiveMaximum": st.integers(-50, 50) | st.booleans(),
        "minLength": st.integers(-1, 3000) | st.just(10**9),
        "maxLength": st.integers(-1, 3000),
        "minItems": st.integers(-1, 8) | st.just(10**9),
        "maxItems": st.integers(0, 10**12),
        "enum": st.lists(json_values, max_size=3) | json_values,
        "const": json_values,
        "required": st.lists(st.sampled_from(("a", "b", "c")), max_size=3) | json_values,
        "format": st.sampled_from(("date", "uuid", "email", "uri", "weird")),
        "additionalProperties": st.booleans() | json_values,
    },
)
schemas = st.recursive(
    schema_keywords | st.booleans() | json_values,
    lambda inner: st.one_of(
        st.builds(
            lambda kw, props: {**kw, "properties": props},
            schema_keywords,
            st.dictionaries(st.sampled_from(("a", "b", "c", "cmd", "path")), inner, max_size=3),
        ),
        st.builds(lambda kw, items: {**kw, "items": items}, schema_keywords, inner),
        st.builds(
            lambda kw, key, branches: {**kw, key: branches},
            schema_keywords,
            st.sampled_from(("anyOf", "oneOf", "allOf")),
            st.lists(inner, max_size=3),
        ),
    ),
    max_leaves=8,
)


@pytest.mark.slow
@fuzz(300)
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
def test_a_tool_schema_is_refused_with_a_400_or_the_simulator_can_call_it(schema: object, seed: int) -> None:
    """Broken tool schemas are a 400 before any inference; an accepted one never makes the
    simulated model fail, and never makes it write a huge argument."""
    TRIED["tool schemas"] += 1
    root = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    body = json.dumps({"model": "sim", "input": "x", "tools": [{**EXEC_TOOL, "parameters": root}]}).encode()
    err = decode_http(body)
    if err is not None:
        assert err.status == 400 and err.code == "invalid_function_parameters", err
        assert err.param == "tools[0].parameters" and err.message.startswith("Invalid schema for function")
        return
    value = sample_json(root, np.random.default_rng(seed), target_chars=200)
    assert len(json.dumps(value)) < 4 << 20


# -- through the real app ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """The real app on loopback in a thread of its own, so hypothesis drives it with sync clients."""
    loop = asyncio.new_event_loop()
    ready: list[int] = []
    started = threading.Event()
    stop = asyncio.Event()

    async def run() -> None:
        clock = AsyncioClock()
        model = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=1), seed=0, decode_tok_per_s=math.inf)
        config = ServerConfig(max_message_bytes=MAX_FRAME)
        runner = ApiRunner(make_app(model=model, store=MemoryStore(), clock=clock, config=config))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        ready.append(runner.addresses[0][1])
        started.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    started.wait()
    yield ready[0]
    loop.call_soon_threadsafe(stop.set)
    thread.join()
    loop.close()


def post(port: int, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/responses", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# Found by FUZZ_SCALE=5: a schema nested (inside an unknown keyword) just under the request
# decoder's limit was accepted, then the simulator, decoding it deeper in the stack, hit the
# recursion limit mid-stream: a 500. Now the schema's nesting is bounded: a 400.
DEEP_SCHEMA = (
    b'{"model":"sim","input":"x","tools":[{"type":"function","name":"f","parameters":'
    b'{"type":"object","properties":' + b'{"a":' * 980 + b"1" + b"}" * 980 + b"}}]}"
)


@pytest.mark.slow
@fuzz(80)
@given(body=st.one_of(byte_bodies, st.integers(MAX_FRAME + 1, 2 * MAX_FRAME).map(lambda n: b"[" * n)))
@example(body=DEEP_SCHEMA)
def test_http_bodies_end_to_end(port: int, body: bytes) -> None:
    TRIED["HTTP POST bodies"] += 1
    status, data = post(port, body)
    assert b"Traceback" not in data
    if body == DEEP_SCHEMA:
        assert (status, msgspec.json.decode(data)["error"]["code"]) == (400, "invalid_function_parameters")
    if status == 200:
        assert msgspec.json.decode(data)["object"] == "response"
        return
    assert 400 <= status < 500, (status, data[:300])
    envelope = msgspec.json.decode(data)
    assert set(envelope) == {"error"}
    check_error(envelope["error"], body)
    if len(body) > MAX_FRAME:
        assert status == 413 and envelope["error"]["code"] == "request_too_large"


def exchange(port: int, frame: str | bytes, *, binary: bool = False) -> tuple[list[dict[str, Any]], int | None, str]:
    """Send one frame, then a valid create; return the events up to the valid create's end,
    or the close code and reason if the server closed the socket."""
    events: list[dict[str, Any]] = []
    with ws_connect(f"ws://127.0.0.1:{port}/v1/responses", max_size=None, open_timeout=60) as ws:
        try:
            if binary:
                ws.send(frame if isinstance(frame, bytes) else frame.encode())
            else:
                ws.send(frame, text=True)
            ws.send(json.dumps({**valid_create(), "tools": []}))
            while not (events and events[-1]["type"] == "response.completed" and events[-1]["response"]["tools"] == []):
                events.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed as closed:
            assert closed.rcvd is not None
            return events, closed.rcvd.code, closed.rcvd.reason
    return events, None, ""


@pytest.mark.slow
@pytest.mark.timeout(600)  # 60 examples, each a real socket round trip
@fuzz(60)
@given(frame=st.one_of(text_frames, st.integers(MAX_FRAME + 1, 2 * MAX_FRAME).map(lambda n: "x" * n)))
def test_websocket_text_frames_end_to_end(port: int, frame: str) -> None:
    """A bad text frame gets an `error` event and the socket answers the next create; an
    oversize frame closes with 1009 and says why."""
    TRIED["WebSocket text frames"] += 1
    events, code, reason = exchange(port, frame)
    if len(frame.encode()) > MAX_FRAME:
        assert (code, reason) == (1009, f"message larger than {MAX_FRAME} bytes")
        return
    assert code is None, (code, reason)
    assert events[-1]["type"] == "response.completed"
    for event in events:
        if event["type"] in ("error", "response.inject.failed"):
            check_ws_error(json.dumps(event).encode(), frame)


@fuzz(20)
@given(data=st.binary(max_size=200) | invalid_utf8())
def test_binary_frames_and_invalid_utf8_close_with_a_reason(port: int, data: bytes) -> None:
    TRIED["WebSocket binary / invalid UTF-8 frames"] += 1
    as_binary = _valid_utf8(data) or len(data) % 2 == 0
    if as_binary:
        _, code, reason = exchange(port, data, binary=True)
        assert (code, reason) == (1003, "binary frames are not supported")
        return
    _, code, reason = exchange(port, data, binary=False)  # websockets sends bytes with text=True as-is
    assert (code, reason) == (1007, "text frame is not valid UTF-8")


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # the examples' repr is long
@fuzz(12)
@given(body=long_text_body(), ws=st.booleans())
def test_long_texts_anywhere_get_a_response_over_http_and_websocket(port: int, body: dict[str, Any], ws: bool) -> None:
    """Texts long enough to be tokenized in pieces, in every text slot, within the message
    limit: the response is served (never a 5xx, a hang or a dropped socket)."""
    TRIED["long texts end to end"] += 1
    if not ws:
        status, data = post(port, json.dumps(body).encode())
        assert status == 200, data[:300]
        assert msgspec.json.decode(data)["status"] in ("completed", "incomplete")
        return
    with ws_connect(f"ws://127.0.0.1:{port}/v1/responses", max_size=None) as sock:
        sock.send(json.dumps({"type": "response.create", **body}))
        while True:
            event = json.loads(sock.recv(timeout=60))
            assert event["type"] != "error", event
            if event["type"] in ("response.completed", "response.incomplete"):
                break


# -- the Agents API through the real app ------------------------------------------------------------------

BETA = {"OpenAI-Beta": "agents=v1"}
SESSIONS = "/v1/agents/sessions"
AGENT_TOOL = {key: value for key, value in EXEC_TOOL.items() if key != "strict"}  # a session's tools take no `strict`


def valid_session_create() -> dict[str, Any]:
    return {"environment": {"type": "none"}, "agent": {"model": "sim", "tools": [AGENT_TOOL]}, "input": "list files"}


AGENT_FIELDS = (
    "environment",
    "agent",
    "agent_id",
    "input",
    "metadata",
    "prompt_cache_options",
    "review",
    "spend_control",
    "stream",
    "stream_options",
    "vault_ids",
    "bogus",
)
AGENT_SUBFIELDS = ("model", "instructions", "tools", "reasoning", "text", "service_tier", "multi_agent", "compaction")


@st.composite
def session_create_body(draw: st.DrawFn) -> str:
    """A session create with one field (top level, in the agent, a tool, a message) replaced,
    nested deep, or huge; or any bad body."""
    body = valid_session_create()
    where = draw(st.sampled_from(("top", "agent", "tool", "message", "deep", "deep", "huge", "bytes")))
    if where == "bytes":
        return draw(text_frames)
    if where == "top":
        body[draw(st.sampled_from(AGENT_FIELDS))] = draw(json_values)
    elif where == "agent":
        body["agent"][draw(st.sampled_from(AGENT_SUBFIELDS))] = draw(json_values)
    elif where == "tool":
        key = draw(st.sampled_from(("type", "name", "description", "parameters", "defer_loading", "async", "strict")))
        body["agent"]["tools"] = [{**AGENT_TOOL, key: draw(json_values)}]
    elif where == "message":
        part = {"type": draw(st.sampled_from(("input_text", "input_image", "output_text", "x"))), "text": "hi"}
        part[draw(st.sampled_from(("type", "text", "image_url")))] = draw(json_values)
        if draw(st.booleans()):
            part.pop("text")
        body["input"] = [{"role": draw(st.sampled_from(("user", "assistant"))), "content": [part]}]
    elif where == "huge":
        big = draw(st.sampled_from('xé\U0001f600\\"')) * draw(st.integers(10_000, 100_000))
        body[draw(st.sampled_from(("input", "agent_id", big[:64])))] = big
    else:
        nested = deep(draw(st.sampled_from((5000, 10_000))), draw(st.sampled_from(("array", "object"))))
        head = json.dumps(body)[:-1]
        return (
            head
            + {
                "parameters": ',"agent":{"model":"sim","tools":[{"type":"function","name":"f","description":"d",'
                '"parameters":{"type":"object","properties":{"a":' + nested + "}}}]}}",
                "content": ',"input":[{"role":"user","content":' + nested + "}]}",
                "environment": ',"environment":' + nested + "}",
            }[draw(st.sampled_from(("parameters", "content", "environment")))]
        )
    return json.dumps(body)


@st.composite
def events_body(draw: st.DrawFn) -> str:
    """A `POST .../events` body: input events with odd fields, deep outputs, or any bad body."""
    if draw(st.integers(0, 4)) == 0:
        return draw(text_frames)
    kind = draw(st.sampled_from(("message", "tool_result", "tool_result", "cancel", "other")))
    event: dict[str, Any] = {"type": f"agent.session.input.{kind}"}
    if kind == "message":
        event["input"] = [{"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    elif kind == "tool_result":
        event.update(turn_id="turn_x", call_id="call_x", success=True, output="ok")
    if draw(st.booleans()):
        event[draw(st.sampled_from(("input", "output", "turn_id", "call_id", "success", "error", "type", "x")))] = draw(
            json_values
        )
    if kind == "tool_result" and draw(st.booleans()):
        nested = deep(draw(st.sampled_from((1000, 5000))), "array")
        return '{"events":[' + json.dumps(event)[:-1] + ',"output":' + nested + "}]}"
    return json.dumps({"events": draw(st.lists(st.just(event), max_size=3))})


ODD_IDS = st.one_of(
    st.sampled_from(("sess_nope", "", "turn_x", "..", "%00", "sess_" + "a" * 300)),
    st.text(max_size=30),
    st.integers(9000, 12_000).map(lambda n: "s" * n),  # a request line past aiohttp's limit
)


SESSION = "{session}"  # stands for the module's live session id (`agents_session`) in a drawn path
OTHER_ROUTES = (
    ("GET", SESSIONS),
    ("GET", f"{SESSIONS}/{{sid}}"),
    ("POST", f"{SESSIONS}/{{sid}}"),
    ("DELETE", f"{SESSIONS}/{{sid}}"),
    ("GET", f"{SESSIONS}/{{sid}}/events"),
    ("GET", f"{SESSIONS}/{{sid}}/turns"),
    ("GET", f"{SESSIONS}/{{sid}}/turns/{{tid}}"),
    ("GET", f"{SESSIONS}/{{sid}}/items"),
    ("GET", f"{SESSIONS}/{{sid}}/turns/{{tid}}/items"),
    ("PUT", f"{SESSIONS}/{{sid}}"),
    ("PATCH", SESSIONS),
    ("GET", f"{SESSIONS}/{{sid}}/nope"),
)


@st.composite
def agents_request(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    """Any route of the Agents API (or a method or path it does not serve), the live session or
    an odd id, with or without the beta header, with a bad body or query. The two routes that
    take a body get a third of the examples each."""
    method, path = draw(
        st.one_of(
            st.just(("POST", SESSIONS)),
            st.just(("POST", f"{SESSIONS}/{{sid}}/events")),
            st.sampled_from(OTHER_ROUTES),
        )
    )
    sid = draw(st.sampled_from((SESSION, SESSION, SESSION)) | ODD_IDS)
    quoted = sid if sid == SESSION else urllib.parse.quote(sid, safe="")
    tid = urllib.parse.quote(draw(ODD_IDS), safe="")
    path = path.replace("{sid}", quoted).replace("{tid}", tid)
    if method == "GET" and draw(st.booleans()):
        query = draw(
            st.dictionaries(st.sampled_from(("limit", "order", "after", "x")), st.text(max_size=12), max_size=3)
            | st.just({"limit": "1000000000000000000000"})
        )
        path += "?" + urllib.parse.urlencode(query)
    headers = {"Content-Type": "application/json"}
    beta = draw(st.sampled_from(("agents=v1", "agents=v1", "agents=v1", "responses=v1, agents=v1", None, "agents=v2")))
    if beta is not None:
        headers["OpenAI-Beta"] = beta
    body = b""
    if method == "POST" and path == SESSIONS:
        body = draw(session_create_body()).encode()
    elif method == "POST" and path.endswith("/events"):
        body = draw(events_body()).encode()
    elif draw(st.integers(0, 3)) == 0:
        body = draw(byte_bodies)
    return method, path, headers, body


class Logged(logging.Handler):
    """The server's log records worth a look: any with a traceback, any error."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


@pytest.fixture(scope="module")
def server_log() -> Iterator[Logged]:
    handler = Logged()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


@pytest.fixture(scope="module")
def agents_session(port: int) -> str:
    status, data = request(
        port,
        "POST",
        SESSIONS,
        {**BETA, "Content-Type": "application/json"},
        json.dumps(valid_session_create()).encode(),
    )
    assert status == 200, data[:300]
    session_id: str = msgspec.json.decode(data)["id"]
    return session_id


def request(port: int, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """One request; a server-sent event stream's reply is only its head (the stream stays open)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        if resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream"):
            return resp.status, b"<event-stream>"
        assert resp.getheader("Content-Type", "").startswith("application/json"), (resp.status, resp.getheaders())
        return resp.status, resp.read()
    finally:
        conn.close()


DEEP_TOOL_RESULT = (
    '{"events":[{"type":"agent.session.input.tool_result","turn_id":"t","call_id":"c","success":true,"output":'
    + deep(5000, "array")
    + "}]}"
)


@fuzz(120)
@given(req=agents_request())
@example(  # found by an adversarial user: RecursionError 500s before the Agents decoders were guarded
    req=("POST", SESSIONS, BETA, ('{"environment":{"type":"none"},"input":' + deep(5000, "array") + "}").encode())
)
@example(req=("POST", f"{SESSIONS}/{SESSION}/events", BETA, DEEP_TOOL_RESULT.encode()))
def test_every_agents_route_answers_in_the_apis_shape(
    port: int, agents_session: str, server_log: Logged, req: tuple[str, str, dict[str, str], bytes]
) -> None:
    """Bad ids, bodies, queries and headers on every Agents route: never a 5xx, every error in
    the JSON error shape without internal detail, and nothing the server logs as its own fault."""
    TRIED["Agents API requests"] += 1
    method, path, headers, body = req
    path = path.replace(SESSION, agents_session)
    server_log.records.clear()
    status, reply = request(port, method, path, headers, body)
    assert status < 500, (method, path[:200], status, reply[:300])
    assert not server_log.records, [r.getMessage() for r in server_log.records]
    if reply == b"<event-stream>":
        assert method in ("GET", "POST") and headers.get("OpenAI-Beta", "").endswith("agents=v1")
        return
    if status == 202:
        assert reply == b"" and path.endswith("/events")
        return
    envelope = msgspec.json.decode(reply)
    if status == 200:
        assert envelope["object"] in ("agent.session", "list", "agent.session.turn", "agent.session.deleted")
        if envelope["object"] == "agent.session" and method == "POST":  # a new session: keep the server small
            request(port, "DELETE", f"{SESSIONS}/{envelope['id']}", BETA, b"")
        return
    assert set(envelope) == {"error"}, envelope
    error = envelope["error"]
    if error["code"] is None:  # the real API's unknown URL, or a rule it answers without a code
        error = {**error, "code": "null"}
    check_error(error, urllib.parse.unquote(path) + body.decode(errors="replace"))
    if "OpenAI-Beta" not in headers and status == 400 and path.startswith(SESSIONS) and len(path) < 8000:
        assert error["code"] in ("missing_beta_header", "null", "method_not_allowed"), error


# -- regressions found by the fuzzer --------------------------------------------------------------------


@pytest.mark.parametrize("slot", ["input", "item", "parameters", "metadata", "tool_choice", "reasoning"])
def test_ten_thousand_levels_of_nesting_are_a_400_not_a_recursion_error(slot: str) -> None:
    head = '{"type":"response.create","model":"sim",'
    nested = deep(10_000, "array")
    frame = {
        "input": head + '"input":' + nested + "}",
        "item": head + '"input":[{"role":"user","content":' + nested + "}]}",
        "parameters": head + '"tools":[{"type":"function","name":"f","parameters":{"a":' + nested + "}}]}",
    }.get(slot, head + '"' + slot + '":' + nested + "}")
    c = Connection()
    c.receive_text(frame)
    [out] = c.outputs_to_send()
    assert isinstance(out, SendFrame)
    event = check_ws_error(out.data, frame)
    if slot != "metadata":  # metadata is typed: msgspec stops at its first '['
        assert event["error"]["code"] == "invalid_json" and "nested too deeply" in event["error"]["message"]
    err = decode_http(frame.encode())
    assert err is not None and err.status == 400


def test_invalid_utf8_inside_a_kept_verbatim_part_is_a_400() -> None:
    body = json.dumps(valid_create()).replace('"properties"', '"\udcffproperties"', 1)
    raw = body.encode(errors="surrogateescape")  # a lone 0xff byte inside the tool schema
    err = decode_http(raw)
    assert err is not None and err.status == 400 and "UTF-8" in err.message


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "string"}, "type"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}, "minimum"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0.2, "maximum": 0.8}}}, "minimum"),
        ({"type": "object", "properties": {"a": False}}, "properties.a"),
        ({"type": "object", "properties": {"a": {}}, "required": [{}]}, "required"),
        ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "type"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}}, "minItems"),
        ({"type": "object", "properties": {"a": {"type": "string", "minLength": 10**9}}, "required": ["a"]}, ""),
        ({"type": "object", "properties": {"a": {"minLength": 10**9}}}, "longer than"),  # untyped, optional
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf"),
        ({"type": "object", "properties": {"a": {"type": "number", "maximum": 1e300}}}, "maximum"),
        ({"type": "object", "properties": {"a": {"enum": []}}}, "enum"),
        ({"type": "object", "properties": []}, "properties"),
    ],
)
def test_broken_tool_schemas_are_400_invalid_function_parameters(schema: dict[str, Any], where: str) -> None:
    body = json.dumps({"model": "sim", "input": "x", "tools": [{**EXEC_TOOL, "parameters": schema}]}).encode()
    err = decode_http(body)
    assert err is not None and err.status == 400 and err.code == "invalid_function_parameters"
    assert err.param == "tools[0].parameters" and where in err.message


def test_a_huge_max_items_is_accepted_and_sampled_small() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "maxItems": 10**12}}, "required": ["a"]}
    body = json.dumps({"model": "sim", "input": "x", "tools": [{**EXEC_TOOL, "parameters": schema}]}).encode()
    assert decode_http(body) is None
    value = sample_json(schema, np.random.default_rng(0))
    assert isinstance(value, dict) and 1 <= len(value["a"]) <= 4
