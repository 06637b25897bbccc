"""Inputs of any size within the message limit get a protocol reply, never a 5xx: long
texts are tokenized in pieces the BPE library accepts, with the tokens one pass gives."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prototype.config import ModelLimits, ServerConfig
from prototype.context.tokenizer import PIECE_CHARS, get_tokenizer, split_text
from prototype.wire.contract import CONTEXT_LENGTH_MESSAGE, STRING_MAX
from sim.model.policy import PlannedItem, ScriptPolicy
from tests.support import Live, live_server

# Pre-tokenizer material: letters of each case, marks, digits, CJK, contractions, spaces,
# tabs, both line breaks, '/', punctuation, so cuts land next to every kind of pre-token.
ALPHABET = ["a", "B", "é", "漢", "1", "'s", "'", " ", "  ", "\t", "\n", "\r", "\r\n", "/", "!", "-", "x", "\u0301"]
texts = st.lists(st.sampled_from(ALPHABET), max_size=400).map("".join)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(text=texts, limit=st.integers(1, 64))
def test_pieces_give_the_tokens_of_one_pass(text: str, limit: int) -> None:
    """Wherever `split_text` cuts only at pre-token starts, the pieces' tokens are the
    whole text's, token for token (the library takes the whole text in one call here)."""
    once = get_tokenizer().encode_once
    pieces, exact = split_text(text, limit)
    assert "".join(pieces) == text and all(len(p) <= limit for p in pieces)
    if exact:
        assert [t for p in pieces for t in once(p)] == once(text)


def test_a_long_text_is_the_concatenation_of_its_halves_cut_at_a_line_break() -> None:
    """Past the library's limits (over 200,000 tokens here) the tokenizer gives what the two
    halves, each accepted in one call, give."""
    half = "def f(x):\n    return x * 2  # a comment\n" * 12_000  # ~480k chars, ~130k tokens each
    tokens = get_tokenizer().encode(half + half)
    assert len(tokens) > 200_000
    assert tokens.tolist() == get_tokenizer().encode_once(half) * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ["x" * 5_000_000, "漢字" * 400_000, "!" * 3_000_000, " " * 2_000_000, "1" * 2_000_000],
    ids=["5M-word", "cjk-run", "punctuation", "spaces", "digits"],
)
def test_runs_with_no_place_to_cut_are_tokenized(text: str) -> None:
    tokens = get_tokenizer().encode(text)
    assert get_tokenizer().decode(tokens) == text
    assert len(split_text(text)[0]) > len(text) // PIECE_CHARS - 1


# -- the issue's inputs, over HTTP, SSE and WebSocket ----------------------------------------------

PROSE = "hello world, this is text. " * 40_000  # ~1.1M chars, ~280k tokens: over gpt-5's 272k input
WORD_1MB = "a" * 1_000_000  # ~125k tokens
WORD_5MB = "y" * 5_000_000
OVER_MAX = "z" * (STRING_MAX + 1)


def tool_turn(output: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "run it"},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


CASES: dict[str, tuple[Any, str | None]] = {
    "message-280k-tokens": (PROSE, "context_length_exceeded"),
    "tool-output-1MB-word": (tool_turn(WORD_1MB), None),
    "word-5MB": (WORD_5MB, "context_length_exceeded"),
    "string-over-10485760": (OVER_MAX, "string_above_max_length"),
    "context-2M-tokens": ([{"role": "user", "content": PROSE} for _ in range(7)], "context_length_exceeded"),
}


async def reply(live: Live, session: aiohttp.ClientSession, transport: str, text: Any) -> tuple[int, dict[str, Any]]:
    """(status, error object or terminal Response) of one create, as the transport reports it."""
    payload: dict[str, Any] = {"model": "sim", "input": text, "store": False}
    if transport == "ws":
        async with session.ws_connect(live.ws_url, max_msg_size=0) as ws:
            await ws.send_str(json.dumps({"type": "response.create", **payload}))
            while True:
                event = json.loads((await ws.receive(timeout=120)).data)
                if event["type"] == "error":
                    return event["status"], event["error"]
                if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    return 200, event["response"]
    payload["stream"] = transport == "sse"
    data = io.BytesIO(json.dumps(payload).encode())
    async with session.post(live.base_url + "/responses", data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.content_type in ("application/json", "text/event-stream")
        if r.status != 200:
            return r.status, (await r.json())["error"]
        if transport == "http":
            return 200, await r.json()
        body = await r.text()
        last = json.loads([line for line in body.splitlines() if line.startswith("data: ")][-1][6:])
        if last["type"] == "error":  # refused once the stream began (the context window), as the real API
            return 400, last["error"]
        return 200, last["response"]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "sse", "ws"])
@pytest.mark.parametrize("case", list(CASES))
async def test_the_issue_inputs_get_protocol_replies(session: aiohttp.ClientSession, transport: str, case: str) -> None:
    text, code = CASES[case]
    async with live_server(tool_calls=0) as live:
        status, body = await reply(live, session, transport, text)
    if code is None:
        assert status == 200 and body["status"] == "completed", body
        return
    assert status == 400 and body["code"] == code and body["param"] == "input", body
    if code == "context_length_exceeded":
        assert body["message"] == CONTEXT_LENGTH_MESSAGE


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "sse", "ws"])
async def test_a_window_large_enough_serves_them(session: aiohttp.ClientSession, transport: str) -> None:
    """With a 4M-token window the long message and the 5 MB word are read in full: the
    prompt's token count is the tokenizer's count of the whole text."""
    config = ServerConfig(model=ModelLimits(context_window=4_000_000))
    tokenizer = get_tokenizer()
    async with live_server(tool_calls=0, config=config) as live:
        for text in (PROSE, WORD_5MB):
            status, response = await reply(live, session, transport, text)
            assert status == 200 and response["status"] == "completed", response
            assert response["usage"]["input_tokens"] > len(tokenizer.encode(text))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "sse", "ws"])
async def test_a_script_with_a_huge_output_is_sampled(session: aiohttp.ClientSession, transport: str) -> None:
    """A script (`ScriptPolicy`, as loaded from a script file) may ask the model to write a
    text past the tokenizer library's limits: it is tokenized in pieces and sampled up to the
    model's output limit."""
    text = "word " * 300_000  # 1.5M characters, ~300k tokens
    policy = ScriptPolicy([PlannedItem("message", "", text)])
    async with live_server(policy=policy) as live:
        status, response = await reply(live, session, transport, "write")
    assert status == 200
    assert response["status"] == "incomplete" and response["incomplete_details"]["reason"] == "max_output_tokens"
    assert response["usage"]["output_tokens"] == 128_000
    assert response["output"][0]["content"][0]["text"] == text[: len(response["output"][0]["content"][0]["text"])]
