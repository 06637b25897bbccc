"""Where explicit prompt-cache breakpoints fall in the prompt (`prototype.context.breakpoints`): a
part's boundary is exact (its item's first token plus the rendering up to the part's end), only the
conversation's latest 80 are matched, a breakpoint without a `ttl` takes the request's, and a
model that cannot follow breakpoints refuses them with the API's error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prototype.context.breakpoints import (
    MATCHED_BREAKPOINTS,
    TTL_S,
    conversation_breakpoints,
    first_breakpoint,
    has_breakpoints,
    refuse_explicit,
)
from prototype.context.conversation import Context, parse_items, render_items
from prototype.context.tokenizer import get_tokenizer
from prototype.wire.errors import ProtocolError

TOKENIZER = get_tokenizer()


def _part(text: str, ttl: str | None = None, *, marked: bool = True) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_text", "text": text}
    if marked:
        part["prompt_cache_breakpoint"] = {"mode": "explicit"} if ttl is None else {"mode": "explicit", "ttl": ttl}
    return part


def _context(*items: dict[str, Any]) -> Context:
    parsed = parse_items([json.dumps(i).encode() for i in items])  # type: ignore[misc]
    context = Context()
    context.extend(parsed, render_items(parsed, TOKENIZER))
    return context


def test_boundary_is_the_end_of_the_marked_part() -> None:
    plain = {"role": "user", "content": "Some earlier words."}
    marked = {"role": "user", "content": [_part("A system prefix."), _part("A turn.", marked=False)]}
    context = _context(plain, marked)
    (bp,) = conversation_breakpoints(context, 10, TOKENIZER, TTL_S["30m"])
    before = len(TOKENIZER.encode("<|start|>user<|message|>Some earlier words.<|end|>"))
    head = len(TOKENIZER.encode("<|start|>user<|message|>A system prefix."))
    assert bp.tokens == 10 + before + head  # 10: the preamble's tokens
    assert bp.tokens < 10 + context.n_tokens  # the part after it is not in the prefix


def test_tool_output_parts_carry_breakpoints() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": [_part("result")]}
    context = _context({"role": "user", "content": "go"}, call, output)
    (bp,) = conversation_breakpoints(context, 0, TOKENIZER, TTL_S["30m"])
    start = context.n_tokens - len(context.chunks[-1])
    assert bp.tokens == start + len(TOKENIZER.encode("<|start|>tool<|message|>result"))


def test_a_breakpoint_without_a_ttl_takes_the_requests() -> None:
    context = _context({"role": "user", "content": [_part("prefix", "12h"), _part("turn"), _part("last", "30m")]})
    for request_ttl in ("30m", "12h"):
        got = [bp.ttl_s for bp in conversation_breakpoints(context, 0, TOKENIZER, TTL_S[request_ttl])]
        assert got == [TTL_S["12h"], TTL_S[request_ttl], TTL_S["30m"]]


def test_only_the_latest_80_are_matched() -> None:
    n = MATCHED_BREAKPOINTS + 5
    context = _context(*({"role": "user", "content": [_part(f"turn {i}")]} for i in range(n)))
    got = conversation_breakpoints(context, 0, TOKENIZER, TTL_S["30m"])
    assert len(got) == MATCHED_BREAKPOINTS
    every = [sum(len(c) for c in context.chunks[: i + 1]) - len(TOKENIZER.encode("<|end|>")) for i in range(n)]
    assert [bp.tokens for bp in got] == every[-MATCHED_BREAKPOINTS:]  # in prompt order, the oldest five left out


def test_no_breakpoints() -> None:
    context = _context({"role": "user", "content": [_part("x", marked=False)]}, {"role": "user", "content": "y"})
    assert conversation_breakpoints(context, 0, TOKENIZER, TTL_S["30m"]) == ()
    assert context.marked == [] and not has_breakpoints(context)
    # A `null` breakpoint (what the SDK's output models print for none) is no breakpoint.
    null = {"role": "user", "content": [{"type": "input_text", "text": "x", "prompt_cache_breakpoint": None}]}
    context = _context(null)
    assert context.marked and not has_breakpoints(context)
    assert conversation_breakpoints(context, 0, TOKENIZER, TTL_S["30m"]) == ()
    assert has_breakpoints(_context({"role": "user", "content": [_part("x")]}))


def test_refusal_names_the_mode_or_the_first_breakpoint() -> None:
    items = parse_items(
        [
            json.dumps({"role": "user", "content": "plain"}).encode(),  # type: ignore[list-item]
            json.dumps({"role": "user", "content": [_part("x", marked=False), _part("y")]}).encode(),  # type: ignore[list-item]
        ]
    )
    assert first_breakpoint(items) == "input[1].content[1].prompt_cache_breakpoint"
    with pytest.raises(ProtocolError) as raised:
        refuse_explicit(False, items, "an engine's slot cache")
    assert (raised.value.param, raised.value.code, raised.value.status) == (
        "input[1].content[1].prompt_cache_breakpoint",
        "unsupported_parameter",
        400,
    )
    with pytest.raises(ProtocolError) as raised:
        refuse_explicit(True, items[:1], "an engine's slot cache")
    assert raised.value.param == "prompt_cache_options.mode"
    refuse_explicit(False, items[:1], "an engine's slot cache")  # implicit, no breakpoint: served
