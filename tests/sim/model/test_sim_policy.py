"""Tests for `sim.model.policy`: DefaultPolicy's decisions, sizes and determinism; the script format."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from prototype.context.tokenizer import get_tokenizer
from prototype.model import FunctionTool, ModelRequest
from sim.model.accelerator import turn_rng
from sim.model.policy import (
    SCRIPT_EXHAUSTED_TEXT,
    DefaultPolicy,
    PlannedItem,
    ScriptPolicy,
    load_script,
    parse_script,
)
from tests.support import EXEC_COMMAND, EXEC_COMMAND_SCHEMA, GET_WEATHER_SCHEMA, make_request, schema_errors

SCHEMAS = {"exec_command": EXEC_COMMAND_SCHEMA, "get_weather": GET_WEATHER_SCHEMA}


def plan(policy: DefaultPolicy | ScriptPolicy, request: ModelRequest, seed: int = 0) -> list[PlannedItem]:
    return policy.plan(request, turn_rng(seed, request.conversation_key, request.turn_index))


def assert_valid_call(item: PlannedItem) -> None:
    assert item.kind == "function_call"
    assert schema_errors(SCHEMAS[item.name], msgspec.json.decode(item.text)) == []


# --------------------------------------------------------------------------- DefaultPolicy


def test_tool_calls_first_then_text() -> None:
    policy = DefaultPolicy(tool_calls=3)
    kinds = []
    for turn in range(6):
        items = plan(policy, make_request(turn_index=turn))
        assert len(items) == 1
        kinds.append(items[0].kind)
        if items[0].kind == "function_call":
            assert_valid_call(items[0])
        else:
            assert items[0].name == "" and items[0].text
    assert kinds == ["function_call"] * 3 + ["message"] * 3


def test_arguments_valid_for_many_conversations() -> None:
    policy = DefaultPolicy()
    names = set()
    for key in range(300):
        (item,) = plan(policy, make_request(conversation_key=key, turn_index=key % 10))
        assert_valid_call(item)
        names.add(item.name)
    assert names == {"exec_command", "get_weather"}


def test_no_tools_or_tool_choice_none_gives_text() -> None:
    policy = DefaultPolicy()
    assert plan(policy, make_request(tools=()))[0].kind == "message"
    assert plan(policy, make_request(tool_choice="none"))[0].kind == "message"


def test_tool_choice_required_calls_past_the_limit() -> None:
    policy = DefaultPolicy(tool_calls=2)
    for turn in range(2, 20):
        (item,) = plan(policy, make_request(turn_index=turn, tool_choice="required"))
        assert_valid_call(item)


def test_tool_choice_named_always_calls_that_tool() -> None:
    policy = DefaultPolicy(tool_calls=2)
    for turn in range(10):
        (item,) = plan(policy, make_request(turn_index=turn, tool_choice="get_weather"))
        assert item.name == "get_weather"
        assert_valid_call(item)


def test_unknown_tool_choice_name_behaves_as_auto() -> None:
    policy = DefaultPolicy(tool_calls=2)
    assert plan(policy, make_request(turn_index=0, tool_choice="nope"))[0].kind == "function_call"
    assert plan(policy, make_request(turn_index=2, tool_choice="nope"))[0].kind == "message"


def test_tool_without_parameters_gets_empty_object() -> None:
    tool = FunctionTool("submit", None, b"")
    (item,) = plan(DefaultPolicy(), make_request(tools=(tool,)))
    assert item == PlannedItem("function_call", "submit", "{}")


def test_deterministic_per_seed_key_turn() -> None:
    policy = DefaultPolicy(tool_calls=5)
    for turn in (0, 7):
        request = make_request(turn_index=turn)
        assert plan(policy, request, seed=1) == plan(policy, request, seed=1)
        assert plan(policy, request, seed=1) != plan(policy, request, seed=2)
        other_key = make_request(turn_index=turn, conversation_key=request.conversation_key + 1)
        assert plan(policy, request, seed=1) != plan(policy, other_key, seed=1)
    assert plan(policy, make_request(turn_index=0)) != plan(policy, make_request(turn_index=1))


def test_output_sizes_follow_the_lognormal() -> None:
    """Median ~120 tokens, sigma 0.8 (docs/pipeline.md, "Calibration"), measured in real o200k tokens."""
    tokenizer = get_tokenizer()
    policy = DefaultPolicy(tool_calls=1)
    exec_only = (EXEC_COMMAND,)
    args = [
        len(tokenizer.encode(plan(policy, make_request(conversation_key=k, tools=exec_only))[0].text))
        for k in range(400)
    ]
    text = [
        len(tokenizer.encode(plan(policy, make_request(conversation_key=k, turn_index=1))[0].text)) for k in range(400)
    ]
    for sizes in (args, text):
        p10, p50, p90 = np.percentile(sizes, [10, 50, 90])
        assert 100 <= p50 <= 145, p50
        # lognormal(sigma=0.8): p90/p50 = p50/p10 = exp(1.2816 * 0.8) = 2.79
        assert 2.2 <= p90 / p50 <= 3.4
        assert 2.2 <= p50 / p10 <= 3.4


def test_max_item_tokens_caps_the_tail() -> None:
    policy = DefaultPolicy(text_tokens_median=100_000, max_item_tokens=50)
    (item,) = plan(policy, make_request(tools=()))
    assert len(get_tokenizer().encode(item.text)) < 80  # 50 tokens' worth of characters, roughly


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tool_calls": -1}, "tool_calls must be >= 0, got -1"),
        ({"text_tokens_median": 0}, "token medians must be >= 1"),
        ({"tokens_sigma": -0.1}, "tokens_sigma must be >= 0, got -0.1"),
        ({"max_item_tokens": 0}, "max_item_tokens must be >= 1, got 0"),
    ],
)
def test_default_policy_rejects_bad_parameters(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        DefaultPolicy(**kwargs)


def test_planned_item_checks() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        PlannedItem("function_call", "", "{}")
    with pytest.raises(ValueError, match="has no name"):
        PlannedItem("message", "x", "hi")
    with pytest.raises(ValueError, match="unknown item kind"):
        PlannedItem("reasoning", "", "hi")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- scripts

SCRIPT = """\
# a demo script
{"tool_call": {"name": "exec_command", "arguments": {"cmd": "ls -la", "timeout_ms": 1000}}}

{"tool_call": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}
   # indented comment
{"tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}, {"name": "read"}]}
{"text": "Done. \u00e9t\u00e9 \U0001f600"}
"""


def test_script_turns_map_to_lines() -> None:
    policy = parse_script(SCRIPT)
    rng = np.random.default_rng(0)
    assert policy.plan(make_request(turn_index=0), rng) == [
        PlannedItem("function_call", "exec_command", '{"cmd":"ls -la","timeout_ms":1000}')
    ]
    assert policy.plan(make_request(turn_index=1), rng) == [
        PlannedItem("function_call", "get_weather", '{"city": "Paris"}')  # string arguments are verbatim
    ]
    assert policy.plan(make_request(turn_index=2), rng) == [
        PlannedItem("function_call", "read", '{"path":"a.py"}'),
        PlannedItem("function_call", "read", "{}"),
    ]
    assert policy.plan(make_request(turn_index=3), rng) == [PlannedItem("message", "", "Done. été 😀")]
    for turn in (4, 100):
        assert policy.plan(make_request(turn_index=turn), rng) == [PlannedItem("message", "", SCRIPT_EXHAUSTED_TEXT)]


def test_load_script_from_file(tmp_path: Path) -> None:
    path = tmp_path / "demo.jsonl"
    path.write_text(SCRIPT, encoding="utf-8")
    assert load_script(path) == parse_script(SCRIPT)


def test_load_script_error_names_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('# ok\n{"text": "hi"}\n\n{"txet": "typo"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: unknown key\(s\) 'txet'$"):
        load_script(path)


def test_script_policy_from_items() -> None:
    call = PlannedItem("function_call", "f", "{}")
    policy = ScriptPolicy([PlannedItem("message", "", "a"), [call, call]])
    assert policy.turns == ((PlannedItem("message", "", "a"),), (call, call))
    with pytest.raises(ValueError, match="^turn 0 has no items$"):
        ScriptPolicy([[]])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (
            '{"text": "a", "tool_call": {"name": "f"}}',
            "expected exactly one of 'text', 'tool_call', 'tool_calls'",
        ),
        ("{}", "expected exactly one of 'text', 'tool_call', 'tool_calls'"),
        ('{"text": "a", "speed": 2}', "unknown key(s) 'speed'"),
        ('{"text": 3}', "'text' must be a string"),
        ('{"tool_call": "f"}', "a tool call must be an object, got str"),
        ('{"tool_call": {"arguments": {}}}', "a tool call needs a non-empty string 'name'"),
        ('{"tool_call": {"name": ""}}', "a tool call needs a non-empty string 'name'"),
        ('{"tool_call": {"name": "f", "args": {}}}', "unknown key(s) 'args' in a tool call"),
        ('{"tool_call": {"name": "f", "arguments": "{oops"}}', "'arguments' string is not valid JSON"),
        ('{"tool_call": {"name": "f", "arguments": [1]}}', "'arguments' must be an object or a JSON string"),
        ('{"tool_calls": []}', "'tool_calls' must be a non-empty list"),
        ('{"tool_calls": {"name": "f"}}', "'tool_calls' must be a non-empty list"),
        (
            '{"tool_calls": [{"name": "f"}, {"name": 1}]}',
            "tool_calls[1]: a tool call needs a non-empty string 'name'",
        ),
    ],
)
def test_script_errors_name_the_line(line: str, message: str) -> None:
    source = f'# header\n\n{{"text": "fine"}}\n{line}\n'
    with pytest.raises(ValueError) as info:
        parse_script(source, origin="demo.jsonl")
    assert str(info.value).startswith(f"demo.jsonl:4: {message}"), str(info.value)
