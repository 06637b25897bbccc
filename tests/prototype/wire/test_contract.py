"""The request contract (prototype/wire/contract.py, docs/contract.md), one row per rule, over
HTTP and over WebSocket on a live server: status, code, param and message of each refusal,
and the parameters the real API knows are accepted."""

from __future__ import annotations

import io
import json
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
from msgspec import Raw

from prototype.config import ModelLimits, ServerConfig
from prototype.context.conversation import Context, check_continuation, parse_items
from prototype.store.memory import MemoryStore
from prototype.wire.contract import (
    CLIENT_PARAMETERS,
    CONTEXT_LENGTH_MESSAGE,
    KNOWN_PARAMETERS,
    STRING_MAX,
    unsupported_message,
)
from prototype.wire.errors import ProtocolError
from prototype.wire.sse import SSEDecoder
from sim.model.policy import PlannedItem, ScriptPolicy
from tests.support import EXEC_TOOL, Live, live_server

MOVED_HINT = (
    "Try again with the new parameter. See the API documentation for more information: "
    "https://platform.openai.com/docs/api-reference/responses/create."
)
LONG = "x" * (STRING_MAX + 1)
JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Rule:
    name: str
    body: dict[str, Any]
    code: str | None
    param: str | None
    message: str
    status: int = 400
    over: tuple[str, ...] = ("http", "ws")  # transports the rule applies to
    ws_ok: bool = False  # over WebSocket the same body is served (an HTTP-only rule)
    extra: dict[str, Any] = field(default_factory=dict)


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "sim", "input": "hi", **kw}


def too_long(param: str, n: int, maximum: int) -> str:
    return (
        f"Invalid '{param}': string too long. Expected a string with maximum length {maximum}, "
        f"but got a string with length {n} instead."
    )


def invalid_value(value: str, supported: str) -> str:
    return f"Invalid value: '{value}'. Supported values are: {supported}."


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}

RULES = [
    # -- required parameters and empty input
    Rule(
        "model missing", {"input": "hi"}, "missing_required_parameter", "model", "Missing required parameter: 'model'."
    ),
    Rule(
        "input missing", {"model": "sim"}, "missing_required_parameter", "input", "Missing required parameter: 'input'."
    ),
    Rule(
        "input empty",
        {"model": "sim", "input": []},
        "missing_required_parameter",
        "input",
        "Missing required parameter: 'input'.",
    ),
    # -- unknown and moved parameters, refused alike on both transports
    Rule("unknown parameter", body(foo=1), "unknown_parameter", "foo", "Unknown parameter: 'foo'."),
    Rule(
        "messages moved",
        {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "input": "hi"},
        "unsupported_parameter",
        None,
        "Unsupported parameter: 'messages'. In the Responses API, this parameter has moved to 'input'. " + MOVED_HINT,
    ),
    Rule(
        "response_format moved",
        body(response_format={"type": "json_object"}),
        "unsupported_parameter",
        None,
        "Unsupported parameter: 'response_format'. In the Responses API, this parameter has moved to "
        "'text.format'. " + MOVED_HINT,
    ),
    Rule(
        "max_completion_tokens moved",
        body(max_completion_tokens=100),
        "unsupported_parameter",
        None,
        "Unsupported parameter: 'max_completion_tokens'. In the Responses API, this parameter has moved to "
        "'max_output_tokens'. " + MOVED_HINT,
    ),
    Rule(
        "reasoning_effort moved",
        body(reasoning_effort="low"),
        "unsupported_parameter",
        None,
        "Unsupported parameter: 'reasoning_effort'. In the Responses API, this parameter has moved to "
        "'reasoning.effort'. " + MOVED_HINT,
    ),
    Rule(
        "generate over HTTP",
        body(generate=False),
        "unsupported_parameter",
        "generate",
        "Unsupported parameter: generate",
        over=("http",),
    ),
    Rule(
        "stream_id over HTTP",
        body(stream_id="a"),
        "unknown_parameter",
        "stream_id",
        "Unknown parameter: 'stream_id'.",
        over=("http",),
    ),
    # -- types
    Rule(
        "temperature type",
        body(temperature="hot"),
        "invalid_type",
        "temperature",
        "Invalid type for 'temperature': expected a decimal, but got a string instead.",
    ),
    Rule(
        "store type",
        body(store="yes"),
        "invalid_type",
        "store",
        "Invalid type for 'store': expected a boolean, but got a string instead.",
    ),
    Rule(
        "input type",
        {"model": "sim", "input": 5},
        "invalid_type",
        "input",
        "Invalid type for 'input': expected one of a string or an array, but got an integer instead.",
    ),
    Rule(
        "content part type",
        {"model": "sim", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "invalid_type",
        "input[0].content[0].text",
        "Invalid type for 'input[0].content[0].text': expected a string, but got an integer instead.",
    ),
    Rule(
        "client_metadata type",
        body(client_metadata="exec"),
        "invalid_type",
        "client_metadata",
        "Invalid type for 'client_metadata': expected an object, but got a string instead.",
    ),
    Rule(
        "tools type",
        body(tools={}),
        "invalid_type",
        "tools",
        "Invalid type for 'tools': expected an array, but got an object instead.",
    ),
    # -- ranges
    Rule(
        "temperature above 2",
        body(temperature=2.5),
        "decimal_above_max_value",
        "temperature",
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 instead.",
    ),
    Rule(
        "temperature below 0",
        body(temperature=-0.5),
        "decimal_below_min_value",
        "temperature",
        "Invalid 'temperature': decimal below minimum value. Expected a value >= 0, but got -0.5 instead.",
    ),
    Rule(
        "top_p above 1",
        body(top_p=1.5),
        "decimal_above_max_value",
        "top_p",
        "Invalid 'top_p': decimal above maximum value. Expected a value <= 1, but got 1.5 instead.",
    ),
    Rule(
        "max_output_tokens below 16",
        body(max_output_tokens=10),
        "integer_below_min_value",
        "max_output_tokens",
        "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got 10 instead.",
    ),
    Rule(
        "max_tool_calls negative",
        body(max_tool_calls=-1),
        "integer_below_min_value",
        "max_tool_calls",
        "Invalid 'max_tool_calls': integer below minimum value. Expected a value >= 0, but got -1 instead.",
    ),
    Rule(
        "top_logprobs above 20",
        body(top_logprobs=21),
        "integer_above_max_value",
        "top_logprobs",
        "Invalid 'top_logprobs': integer above maximum value. Expected a value <= 20, but got 21 instead.",
    ),
    Rule(
        "top_logprobs negative",
        body(top_logprobs=-1),
        "integer_below_min_value",
        "top_logprobs",
        "Invalid 'top_logprobs': integer below minimum value. Expected a value >= 0, but got -1 instead.",
    ),
    # -- enums
    Rule(
        "truncation",
        body(truncation="middle"),
        "invalid_value",
        "truncation",
        invalid_value("middle", "'auto' and 'disabled'"),
    ),
    Rule(
        "service_tier",
        body(service_tier="gold"),
        "invalid_value",
        "service_tier",
        invalid_value("gold", "'auto', 'default', 'flex', 'scale', 'priority', 'fast', and 'ultrafast'"),
    ),
    Rule(
        "prompt_cache_retention",
        body(prompt_cache_retention="1y"),
        "invalid_value",
        "prompt_cache_retention",
        invalid_value("1y", "'in_memory' and '24h'"),
    ),
    Rule(
        "include",
        body(include=["reasoning.encrypted_content", "everything"]),
        "invalid_value",
        "include[1]",
        invalid_value(
            "everything",
            "'file_search_call.results', 'web_search_call.results', 'web_search_call.action.sources', "
            "'message.input_image.image_url', 'computer_call_output.output.image_url', "
            "'code_interpreter_call.outputs', 'reasoning.encrypted_content', and 'message.output_text.logprobs'",
        ),
    ),
    Rule(
        "reasoning.effort",
        body(reasoning={"effort": "extreme"}),
        "invalid_value",
        "reasoning.effort",
        invalid_value("extreme", "'none', 'minimal', 'low', 'medium', 'high', 'xhigh', and 'max'"),
    ),
    Rule(
        "text.verbosity",
        body(text={"verbosity": "loud"}),
        "invalid_value",
        "text.verbosity",
        invalid_value("loud", "'low', 'medium', and 'high'"),
    ),
    Rule(
        "tool_choice",
        body(tool_choice="sometimes"),
        "invalid_value",
        "tool_choice",
        "Invalid value for 'tool_choice': 'sometimes'. Supported values are: 'none', 'auto', and 'required'.",
    ),
    Rule(
        "tool_choice function not in tools",
        body(tools=[TOOL], tool_choice={"type": "function", "name": "g"}),
        "invalid_value",
        "tool_choice",
        "Tool choice 'g' not found in 'tools' parameter.",
    ),
    Rule(
        "previous_response_id format",
        body(previous_response_id="abc"),
        "invalid_value",
        "previous_response_id",
        "Invalid 'previous_response_id': 'abc'. Expected an ID that begins with 'resp_'.",
    ),
    Rule(
        "previous_response_id unknown",
        body(previous_response_id="resp_nope"),
        "previous_response_not_found",
        "previous_response_id",
        "Previous response with id 'resp_nope' not found.",
    ),
    Rule(
        "message role",
        {"model": "sim", "input": [{"role": "robot", "content": "x"}]},
        "invalid_value",
        "input[0].role",
        "Invalid value for 'input[0].role': 'robot'. "
        "Supported values are: 'assistant', 'developer', 'system', and 'user'.",
    ),
    # -- metadata
    Rule(
        "metadata keys",
        body(metadata={f"k{i}": "v" for i in range(17)}),
        "object_above_max_properties",
        "metadata",
        "Invalid 'metadata': too many properties. Expected an object with at most 16 properties, "
        "but got an object with 17 properties instead.",
    ),
    Rule(
        "metadata key length",
        body(metadata={"k" * 65: "v"}),
        "string_above_max_length",
        "metadata",
        "Invalid 'metadata': key too long. Expected a key with maximum length 64, "
        "but got a key with length 65 instead.",
    ),
    Rule(
        "metadata value length",
        body(metadata={"k": "v" * 513}),
        "string_above_max_length",
        "metadata.k",
        too_long("metadata.k", 513, 512),
    ),
    Rule(
        "metadata value type",
        body(metadata={"k": 1}),
        "invalid_type",
        "metadata",
        "Invalid type for 'metadata': expected a string, but got an integer instead.",
    ),
    Rule(
        "safety_identifier length",
        body(safety_identifier="s" * 65),
        "string_above_max_length",
        "safety_identifier",
        too_long("safety_identifier", 65, 64),
    ),
    # -- function tools
    Rule(
        "tool name pattern",
        body(tools=[{**TOOL, "name": "get.weather"}]),
        "invalid_value",
        "tools[0].name",
        "Invalid 'tools[0].name': string does not match pattern. Expected a string that matches the pattern "
        "'^[a-zA-Z0-9_-]+$'.",
    ),
    Rule(
        "tool name with a trailing newline",
        body(tools=[{**TOOL, "name": "f\n"}]),
        "invalid_value",
        "tools[0].name",
        "Invalid 'tools[0].name': string does not match pattern. Expected a string that matches the pattern "
        "'^[a-zA-Z0-9_-]+$'.",
    ),
    Rule(
        "tool name length",
        body(tools=[{**TOOL, "name": "n" * 129}]),
        "string_above_max_length",
        "tools[0].name",
        too_long("tools[0].name", 129, 128),
    ),
    Rule(
        "tool type missing",
        body(tools=[{"name": "f"}]),
        "missing_required_parameter",
        "tools[0].type",
        "Missing required parameter: 'tools[0].type'.",
    ),
    Rule(
        "tool names unique",
        body(tools=[TOOL, TOOL]),
        "invalid_value",
        "tools[1].name",
        "Duplicate tool name: 'f'.",
    ),
    Rule(
        "tool parameters schema",
        body(tools=[{**TOOL, "parameters": {"type": "string"}}]),
        "invalid_function_parameters",
        "tools[0].parameters",
        "Invalid schema for function 'f' at 'type': schema must be a JSON Schema of 'type: \"object\"'.",
    ),
    Rule(
        "input_text without text",
        {"model": "sim", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "missing_required_parameter",
        "input[0].content[0].text",
        "Missing required parameter: 'input[0].content[0].text'.",
    ),
    Rule(
        "tool name missing",
        body(tools=[{"type": "function", "parameters": {"type": "object"}}]),
        "missing_required_parameter",
        "tools[0].name",
        "Missing required parameter: 'tools[0].name'.",
    ),
    # -- exclusive parameters and features the simulator lacks
    Rule(
        "previous_response_id with conversation",
        body(previous_response_id="resp_1", conversation="conv_1"),
        "mutually_exclusive_parameters",
        "conversation",
        "Mutually exclusive parameters: Ensure you are only providing one of: "
        "'previous_response_id' or 'conversation'.",
    ),
    Rule(
        "conversation",
        body(conversation="conv_1"),
        "unsupported_parameter",
        "conversation",
        unsupported_message("conversation"),
    ),
    Rule(
        "background",
        body(background=True),
        "unsupported_parameter",
        "background",
        unsupported_message("background"),
    ),
    Rule(
        "prompt",
        body(prompt={"id": "pmpt_1"}),
        "unsupported_parameter",
        "prompt",
        unsupported_message("prompt"),
    ),
    Rule(
        "context_management not a list",
        body(context_management={"type": "compaction"}),
        "invalid_type",
        "context_management",
        "Invalid type for 'context_management': expected an array, but got an object instead.",
    ),
    Rule(
        "context_management type",
        body(context_management=[{"type": "truncate"}]),
        "invalid_value",
        "context_management[0].type",
        "Invalid value: 'truncate'. Supported values are: 'compaction'.",
    ),
    Rule(
        "context_management without type",
        body(context_management=[{"compact_threshold": 2000}]),
        "missing_required_parameter",
        "context_management[0].type",
        "Missing required parameter: 'context_management[0].type'.",
    ),
    Rule(
        "compact_threshold minimum",
        body(context_management=[{"type": "compaction", "compact_threshold": 999}]),
        "integer_below_min_value",
        "context_management[0].compact_threshold",
        "Invalid 'context_management[0].compact_threshold': integer below minimum value. "
        "Expected a value >= 1000, but got 999 instead.",
    ),
    Rule(
        "compact_threshold type",
        body(context_management=[{"type": "compaction", "compact_threshold": "big"}]),
        "invalid_type",
        "context_management[0].compact_threshold",
        "Invalid type for 'context_management[0].compact_threshold': expected an integer, but got a string instead.",
    ),
    Rule(
        "compaction item content",
        {"model": "sim", "input": [{"type": "compaction", "encrypted_content": "not ours"}]},
        "invalid_encrypted_content",
        "input[0].encrypted_content",
        "The encrypted content could not be decrypted or parsed.",
    ),
    Rule(
        "hosted tool forced",
        body(tools=[{"type": "web_search_preview"}], tool_choice={"type": "web_search_preview"}),
        "unsupported_parameter",
        "tool_choice",
        "Forcing the tool type 'web_search_preview' with 'tool_choice' is not supported by this server "
        "(a simulator of the Responses API: its model calls function tools only).",
    ),
    # -- items: lengths, ids, tool-call pairing within the input
    Rule(
        "call_id length",
        {
            "model": "sim",
            "input": [{"type": "function_call", "call_id": "c" * 65, "name": "f", "arguments": "{}"}],
        },
        "string_above_max_length",
        "input[0].call_id",
        too_long("input[0].call_id", 65, 64),
    ),
    Rule(
        "duplicate item id",
        {
            "model": "sim",
            "input": [{"id": "msg_1", "role": "user", "content": "a"}, {"id": "msg_1", "role": "user", "content": "b"}],
        },
        None,
        "input",
        "Duplicate item found with id msg_1. Remove duplicate items from your input and try again.",
    ),
    Rule(
        "output without call",
        {"model": "sim", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "o"}]},
        None,
        "input",
        "No tool call found for function call output with call_id call_x.",
    ),
    Rule(
        "call without output",
        {
            "model": "sim",
            "input": [
                {"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "call_y", "name": "f", "arguments": "{}"},
                {"role": "user", "content": "b"},
            ],
        },
        None,
        "input",
        "No tool output found for function call call_y.",
    ),
    # -- the longest string
    Rule(
        "input string too long",
        {"model": "sim", "input": LONG},
        "string_above_max_length",
        "input",
        too_long("input", len(LONG), STRING_MAX),
    ),
    Rule(
        "content too long",
        {"model": "sim", "input": [{"role": "user", "content": LONG}]},
        "string_above_max_length",
        "input[0].content",
        too_long("input[0].content", len(LONG), STRING_MAX),
    ),
    Rule(
        "tool output too long",
        {
            "model": "sim",
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": LONG},
            ],
        },
        "string_above_max_length",
        "input[1].output",
        too_long("input[1].output", len(LONG), STRING_MAX),
    ),
]

CASES = [pytest.param(rule, transport, id=f"{transport}-{rule.name}") for rule in RULES for transport in rule.over]


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=1, store=MemoryStore()) as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(session: aiohttp.ClientSession, live: Live, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = io.BytesIO(json.dumps(payload).encode())  # aiohttp warns about large raw bodies
    async with session.post(live.base_url + "/responses", data=data, headers=JSON) as r:
        return r.status, await r.json()


async def ws_create(ws: aiohttp.ClientWebSocketResponse, payload: dict[str, Any]) -> dict[str, Any]:
    """Send one create; the `error` event, or the terminal (or, in append mode, pause) event."""
    await ws.send_str(json.dumps({"type": "response.create", **payload}))
    while True:
        event = json.loads((await ws.receive(timeout=60)).data)
        if event["type"] in ("error", "response.completed", "response.incomplete", "response.failed", "response.done"):
            return event


def check(error: dict[str, Any], rule: Rule) -> None:
    assert error == {"type": "invalid_request_error", "code": rule.code, "param": rule.param, "message": rule.message}


@pytest.mark.parametrize(("rule", "transport"), CASES)
async def test_each_rule(live: Live, session: aiohttp.ClientSession, rule: Rule, transport: str) -> None:
    if transport == "http":
        status, reply = await post(session, live, rule.body)
        assert status == rule.status, reply
        assert set(reply) == {"error"}
        check(reply["error"], rule)
        return
    async with session.ws_connect(live.ws_url, max_msg_size=0) as ws:
        event = await ws_create(ws, rule.body)
        if rule.ws_ok:
            assert event["type"] == "response.completed", event
        else:
            assert event["type"] == "error" and event["status"] == rule.status, event
            check(event["error"], rule)
        # the socket stays open and serves the next create
        assert (await ws_create(ws, body()))["type"] == "response.completed"


async def _first_turn(
    session: aiohttp.ClientSession, live: Live, ws: aiohttp.ClientWebSocketResponse | None
) -> dict[str, Any]:
    """A stored response that ends in a function call (the simulator calls the one tool)."""
    first = body(tools=[EXEC_TOOL], store=True)
    if ws is None:
        status, response = await post(session, live, first)
        assert status == 200, response
    else:
        response = (await ws_create(ws, first))["response"]
    assert response["output"][-1]["type"] == "function_call", response
    return response


def continuation_cases(call: dict[str, Any]) -> list[tuple[list[dict[str, Any]], str]]:
    """New input against a history that ends in `call`, and the refusal each one gets."""
    return [
        (
            [{"type": "function_call_output", "call_id": "call_other", "output": "o"}],
            "No tool call found for function call output with call_id call_other.",
        ),
        ([{"role": "user", "content": "and now?"}], f"No tool output found for function call {call['call_id']}."),
        (
            [{"type": "function_call_output", "call_id": call["call_id"], "output": "o", "id": call["id"]}],
            f"Duplicate item found with id {call['id']}. Remove duplicate items from your input and try again.",
        ),
    ]


@pytest.mark.parametrize("transport", ["http", "ws"])
async def test_continuation_rules_read_the_history(live: Live, session: aiohttp.ClientSession, transport: str) -> None:
    """The pairing and duplicate-id rules hold across `previous_response_id` (the store over
    HTTP, the connection cache over WebSocket): the history's calls answer outputs, its
    pending calls need outputs, its ids are taken."""
    async with session.ws_connect(live.ws_url) as ws:
        sock = ws if transport == "ws" else None
        for case in range(3):
            prev = await _first_turn(session, live, sock)  # over WS a refused create evicts its entry
            call = prev["output"][-1]
            items, message = continuation_cases(call)[case]
            payload = {"model": "sim", "input": items, "previous_response_id": prev["id"], "tools": [EXEC_TOOL]}
            if sock is None:
                status, reply = await post(session, live, payload)
                assert status == 400, reply
                error = reply["error"]
            else:
                event = await ws_create(ws, payload)
                assert event["type"] == "error" and event["status"] == 400, event
                error = event["error"]
            assert error == {"type": "invalid_request_error", "code": None, "param": "input", "message": message}
        # the answer the history asks for is accepted
        prev = await _first_turn(session, live, sock)
        ok = {
            "model": "sim",
            "input": [{"type": "function_call_output", "call_id": prev["output"][-1]["call_id"], "output": "done"}],
            "previous_response_id": prev["id"],
            "tools": [EXEC_TOOL],
        }
        if sock is None:
            status, reply = await post(session, live, ok)
            assert status == 200, reply
        else:
            assert (await ws_create(ws, ok))["type"] == "response.completed"


def sdk_parameters() -> set[str]:
    """The parameters of `client.responses.create` in the installed openai-python."""
    from openai.types.responses import response_create_params as params

    return set(typing.get_type_hints(params.ResponseCreateParamsStreaming))


async def test_every_known_parameter_is_accepted(live: Live, session: aiohttp.ClientSession) -> None:
    """A body with every parameter the real API knows (set to a value the simulator can
    honour, or the value that means 'off' for the features it lacks) is served."""
    payload: dict[str, Any] = {
        "model": "sim",
        "input": "hi",
        "access_programs": {"cyber": "standard"},
        "background": False,
        "background_options": {"completion_window": "soonest"},
        "client_metadata": {"session_source": "exec"},
        "image": {"context_compression": "auto"},
        "context_management": None,
        "conversation": None,
        "include": ["reasoning.encrypted_content"],
        "instructions": "be brief",
        "max_output_tokens": 4096,
        "max_tool_calls": 3,
        "metadata": {"k": "v"},
        "moderation": None,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_key": "k",
        "prompt_cache_options": {"ttl": "30m"},
        "prompt_cache_retention": "24h",
        "reasoning": {"effort": "low", "summary": "auto"},
        "safety_identifier": "user-1",
        "service_tier": "auto",
        "store": False,
        "stream": False,
        "stream_options": None,
        "temperature": 0.5,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "tool_choice": "auto",
        "tools": [EXEC_TOOL, {"type": "web_search"}],
        "top_logprobs": 5,
        "top_p": 0.9,
        "truncation": "disabled",
        "user": "u",
    }
    assert set(payload) == KNOWN_PARAMETERS == sdk_parameters() | CLIENT_PARAMETERS
    status, reply = await post(session, live, payload)
    assert status == 200, reply
    async with session.ws_connect(live.ws_url) as ws:
        event = await ws_create(ws, {k: v for k, v in payload.items() if k != "stream"})
        assert event["type"] == "response.completed", event


@pytest.fixture
async def small_window() -> AsyncIterator[Live]:
    config = ServerConfig(model=ModelLimits(context_window=3_000, max_output_tokens=1_000))
    policy = ScriptPolicy([PlannedItem("message", "", " word" * 5_000)])  # wants 5k tokens
    async with live_server(policy=policy, config=config) as server:
        yield server


@pytest.mark.parametrize("transport", ["http", "sse", "ws"])
async def test_context_window(small_window: Live, transport: str) -> None:
    """A prompt longer than the window minus the output limit is refused before inference
    (the model never sees it), with the real message; one that fits is served, its output cut
    at the output limit, so prompt and output stay within the window."""
    fits, too_long_ = " word" * 1_500, " word" * 2_100  # about 1.5k and 2.1k tokens
    model = small_window.model
    async with aiohttp.ClientSession() as s:
        for text, ok in ((too_long_, False), (fits, True)):
            payload = {"model": "sim", "input": text}
            before = model.statistics().requests
            if transport == "ws":
                async with s.ws_connect(small_window.ws_url) as ws:
                    event = await ws_create(ws, payload)
                if ok:
                    response = event["response"]
                    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
                    usage = response["usage"]
                    assert usage["output_tokens"] == 1_000 and usage["input_tokens"] + usage["output_tokens"] <= 3_000
                    assert model.statistics().requests == before + 1
                    continue
                assert event["type"] == "error" and event["status"] == 400
                error = event["error"]
            elif transport == "sse":  # as the real API: the stream begins, then the error event
                async with s.post(small_window.base_url + "/responses", json={**payload, "stream": True}) as r:
                    assert r.status == 200
                    decoder = SSEDecoder()
                    events = decoder.feed(await r.read()) + decoder.close()
                names = [e.event for e in events]
                if ok:
                    assert names[-1] == "response.incomplete"
                    continue
                assert names == ["response.created", "response.in_progress", "error"]
                error_event = json.loads(events[-1].data)
                assert error_event["sequence_number"] == 2 and error_event["type"] == "error"
                error = error_event["error"]
            else:
                async with s.post(small_window.base_url + "/responses", json=payload) as r:
                    if ok:
                        assert r.status == 200
                        continue
                    assert r.status == 400 and r.content_type == "application/json"
                    error = (await r.json())["error"]
            assert error == {
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
                "param": "input",
                "message": CONTEXT_LENGTH_MESSAGE,
            }
            assert model.statistics().requests == before  # refused before inference


async def test_an_append_past_the_window_fails_the_response_before_sampling() -> None:
    """Append mode: tool outputs appended to a paused response that take its prompt past the
    window end it with `response.failed` (code `context_length_exceeded`); the model is not
    asked to read them."""
    config = ServerConfig(model=ModelLimits(context_window=3_000, max_output_tokens=1_000))
    async with live_server(tool_calls=5, config=config) as live, aiohttp.ClientSession() as s:
        async with s.ws_connect(live.ws_url + "?mode=append") as ws:
            done = await ws_create(ws, body(tools=[EXEC_TOOL]))
            assert done["type"] == "response.done", done
            before = live.model.statistics().requests
            call = done["response"]["output"][-1]
            output = [{"type": "function_call_output", "call_id": call["call_id"], "output": " word" * 2_500}]
            await ws.send_str(json.dumps({"type": "response.append", "input": output}))
            while True:
                event = json.loads((await ws.receive(timeout=60)).data)
                if event["type"] in ("response.failed", "response.done", "response.completed", "error"):
                    break
            assert event["type"] == "response.failed", event
            assert event["response"]["error"] == {"code": "context_length_exceeded", "message": CONTEXT_LENGTH_MESSAGE}
            assert live.model.statistics().requests == before


def test_an_item_reference_names_an_item_and_is_no_duplicate() -> None:
    """`item_reference` items carry the id of the item they stand for: they never collide
    with it, in the new input or against the history."""
    history = parse_items([Raw(json.dumps({"id": "msg_9", "role": "user", "content": "a"}).encode())])
    context = Context()
    context.extend(history, [np.zeros(1, dtype=np.uint32)])
    reference = parse_items([Raw(b'{"type": "item_reference", "id": "msg_9"}')])
    check_continuation(context, reference)
    context.extend(reference, [np.zeros(0, dtype=np.uint32)])
    again = parse_items([Raw(json.dumps({"id": "msg_9", "role": "user", "content": "b"}).encode())])
    with pytest.raises(ProtocolError, match=r"^Duplicate item found with id msg_9\."):
        check_continuation(context, again)
    # an output after a reference may answer the call the reference stands for
    answer = parse_items(
        [
            Raw(b'{"type": "item_reference", "id": "fc_1"}'),
            Raw(b'{"type": "function_call_output", "call_id": "call_1", "output": "ok"}'),
        ]
    )
    check_continuation(Context(), answer)


async def test_function_tools_are_echoed_with_the_fields_the_spec_requires(
    live: Live, session: aiohttp.ClientSession
) -> None:
    """`FunctionTool` on a response requires `strict` and `parameters`; a client may omit both.
    Omitted, `strict` is what the API would use: strict when the schema allows it."""
    closed = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    tools = [
        {"type": "function", "name": "strict_ok", "parameters": {**closed, "additionalProperties": False}},
        {"type": "function", "name": "open_schema", "parameters": closed},
        {"type": "function", "name": "bare"},
        {"type": "function", "name": "said", "parameters": closed, "strict": False},
        {"type": "web_search"},
    ]
    status, reply = await post(session, live, body(tools=tools, tool_choice="none"))
    assert status == 200, reply
    echoed = {t.get("name", t["type"]): t for t in reply["tools"]}
    assert echoed["strict_ok"]["strict"] is True
    assert echoed["open_schema"]["strict"] is False
    assert echoed["bare"]["parameters"] is None and echoed["bare"]["strict"] is None
    assert echoed["said"] == tools[3] and echoed["web_search"] == tools[4]
