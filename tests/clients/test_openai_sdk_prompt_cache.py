"""Explicit prompt caching driven by the official openai-python SDK (3.63's typed params) against the
real server on loopback, over HTTP and WebSocket: `prompt_cache_options.mode` and the content parts'
`prompt_cache_breakpoint` change `usage.input_tokens_details.cached_tokens` as the SDK's docstrings
state (docs/protocol.md#prompt-caching); a breakpoint is echoed with its input item; what longrun
cannot compute is refused with the API's 400."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Final

import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI
from openai.types.responses import EasyInputMessageParam, ResponseInputTextParam
from openai.types.responses.response_create_params import PromptCacheOptions
from openai.types.responses.response_input_text_param import PromptCacheBreakpoint
from openai.types.responses.responses_server_event import ResponseWsError

from prototype.context.tokenizer import get_tokenizer
from prototype.serve.app import make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from tests.support import Live, live_server, served

pytestmark = pytest.mark.timeout(60)

MODEL: Final = "sim"
TIMEOUT_S: Final = 10.0
TOKENIZER: Final = get_tokenizer()


def _words(tag: str) -> str:
    """3,000 words no other test sends (a server's caches are shared by its tests)."""
    return " ".join(f"{tag}{i % 50}" for i in range(3000))


def _user(text: str, breakpoint: PromptCacheBreakpoint | None = None) -> EasyInputMessageParam:
    part: ResponseInputTextParam = {"type": "input_text", "text": text}
    if breakpoint is not None:
        part["prompt_cache_breakpoint"] = breakpoint
    return {"type": "message", "role": "user", "content": [part]}


def _boundary(*texts: str) -> int:
    """Prompt tokens up to the end of the last text: the user messages before it rendered whole,
    then its own head and text (longrun's rendering, prototype/context/conversation.py)."""
    *before, last = texts
    rendered = [f"<|start|>user<|message|>{t}<|end|>" for t in before]
    return sum(len(TOKENIZER.encode(r)) for r in rendered) + len(TOKENIZER.encode(f"<|start|>user<|message|>{last}"))


EXPLICIT: Final[PromptCacheOptions] = {"mode": "explicit"}
BREAKPOINT: Final[PromptCacheBreakpoint] = {"mode": "explicit"}


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=0, seed=5) as server:
        yield server


@pytest.fixture
async def client(live: Live) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="sk-test", base_url=live.base_url, max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


async def _cached_twice(client: AsyncOpenAI, message: EasyInputMessageParam, **kw: Any) -> list[int]:
    out = []
    for _ in range(2):
        r = await client.responses.create(model=MODEL, input=[message], **kw)
        assert r.usage is not None
        out.append(r.usage.input_tokens_details.cached_tokens)
    return out


async def test_http_explicit_mode_follows_the_breakpoints(client: AsyncOpenAI) -> None:
    implicit = await _cached_twice(client, _user(_words("a")))
    assert implicit[0] == 0 and implicit[1] > 0  # the prefix cache: the default, as before
    # Explicit without a breakpoint: the request does not use prompt caching.
    assert await _cached_twice(client, _user(_words("b")), prompt_cache_options=EXPLICIT) == [0, 0]
    # Explicit with one: the second request reuses exactly the prefix up to it.
    text = _words("c")
    marked = await _cached_twice(client, _user(text, BREAKPOINT), prompt_cache_options=EXPLICIT)
    assert marked == [0, _boundary(text)]
    # Implicit plus a breakpoint: the prefix cache's whole blocks, or the breakpoint's exact end,
    # whichever is longer: here the blocks, which run past the text into the message's end.
    text = _words("d")
    both = await _cached_twice(client, _user(text, {"mode": "explicit", "ttl": "12h"}))
    assert both[0] == 0 and both[1] > _boundary(text) and both[1] % 16 == 0


async def test_http_breakpoint_is_kept_with_its_stored_item(client: AsyncOpenAI) -> None:
    """The items are stored as sent, breakpoint included: a continuation from the store (a
    plain HTTP chain) matches the breakpoint of the first request's message."""
    first, second = _words("i"), _words("j")
    options: PromptCacheOptions = {"mode": "explicit", "ttl": "12h"}
    r = await client.responses.create(model=MODEL, input=[_user(first, BREAKPOINT)], prompt_cache_options=options)
    assert r.prompt_cache_options is not None
    assert (r.prompt_cache_options.mode, r.prompt_cache_options.ttl) == ("explicit", "12h")
    again = await client.responses.retrieve(r.id)
    assert again.prompt_cache_options is not None and again.prompt_cache_options.mode == "explicit"
    chained = await client.responses.create(
        model=MODEL, input=[_user(second)], previous_response_id=r.id, prompt_cache_options=options
    )
    assert chained.usage is not None
    assert chained.usage.input_tokens_details.cached_tokens == _boundary(first)


@pytest.mark.parametrize(
    ("part", "param", "code"),
    [
        ({"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "1h"}},
         "input[0].content[0].prompt_cache_breakpoint.ttl", "invalid_value"),
        ({"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "implicit"}},
         "input[0].content[0].prompt_cache_breakpoint.mode", "invalid_value"),
        ({"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "scope": "org"}},
         "input[0].content[0].prompt_cache_breakpoint.scope", "unknown_parameter"),
        ({"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"ttl": "30m"}},
         "input[0].content[0].prompt_cache_breakpoint.mode", "missing_required_parameter"),
    ],
)  # fmt: skip
async def test_http_bad_breakpoints_get_the_api_error(
    client: AsyncOpenAI, part: dict[str, Any], param: str, code: str
) -> None:
    bad: Any = [{"role": "user", "content": [part]}]  # outside the SDK's types on purpose
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model=MODEL, input=bad)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error"
    assert (body["param"], body["code"]) == (param, code)


async def test_http_breakpoint_on_an_output_part_is_unknown(client: AsyncOpenAI) -> None:
    assistant = {
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok", "prompt_cache_breakpoint": {"mode": "explicit"}}],
    }
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model=MODEL, input=[assistant, _user("go on")])  # type: ignore[list-item]
    body = raised.value.body
    assert isinstance(body, dict)
    assert (body["code"], body["param"]) == ("unknown_parameter", "input[0].content[0].prompt_cache_breakpoint")


async def _ws_turn(conn: Any, **kw: Any) -> Any:
    await conn.response.create(model=MODEL, **kw)
    while True:
        ev = await asyncio.wait_for(conn.recv(), TIMEOUT_S)
        if ev.type in ("response.completed", "response.failed", "error"):
            return ev


async def test_websocket_explicit_breakpoints_across_a_chain(client: AsyncOpenAI) -> None:
    first, second = _words("e"), _words("f")
    async with client.responses.connect() as conn:
        # No breakpoint, explicit: the chained turn reuses nothing, though its prefix is the whole first turn.
        one = await _ws_turn(conn, input=[_user(first)], prompt_cache_options=EXPLICIT, store=False)
        two = await _ws_turn(
            conn,
            input=[_user(second)],
            previous_response_id=one.response.id,
            prompt_cache_options=EXPLICIT,
            store=False,
        )
        assert two.type == "response.completed"
        assert two.response.usage.input_tokens_details.cached_tokens == 0
    third, fourth = _words("g"), _words("h")
    async with client.responses.connect() as conn:
        # A breakpoint on the first turn's text: the chained turn (no breakpoint of its own)
        # matches it, the conversation's breakpoints being all the prompt's.
        one = await _ws_turn(conn, input=[_user(third, BREAKPOINT)], prompt_cache_options=EXPLICIT, store=False)
        assert one.response.usage.input_tokens_details.cached_tokens == 0
        assert one.response.prompt_cache_options.mode == "explicit"
        two = await _ws_turn(
            conn,
            input=[_user(fourth)],
            previous_response_id=one.response.id,
            prompt_cache_options=EXPLICIT,
            store=False,
        )
        assert two.response.usage.input_tokens_details.cached_tokens == _boundary(third)
        # A bad breakpoint over the socket: the API's error event, the socket still usable.
        part = {"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "5m"}}
        bad = await _ws_turn(conn, input=[{"role": "user", "content": [part]}])
        assert isinstance(bad, ResponseWsError)
        assert bad.error.param == "input[0].content[0].prompt_cache_breakpoint.ttl"
        assert bad.status == 400


class _SlotEngine(SimulatedModel):
    """A model whose cache cannot follow breakpoints (`prototype.model.ImplicitCacheOnly`), as the
    real engine (sim/engine/model.py) declares."""

    cache_name = "the test engine's slot cache"


async def test_a_model_that_cannot_follow_breakpoints_refuses_them() -> None:
    clock = AsyncioClock()
    model = _SlotEngine(clock=clock, policy=DefaultPolicy(tool_calls=0), seed=1)
    app: web.Application = make_app(model=model, store=MemoryStore(), clock=clock, seed=1)
    async with served(app) as port:
        base = f"http://127.0.0.1:{port}/v1"
        async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=TIMEOUT_S) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(model=MODEL, input="hi", prompt_cache_options=EXPLICIT)
            assert raised.value.body["param"] == "prompt_cache_options.mode"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(model=MODEL, input=[_user("hi"), _user("there", BREAKPOINT)])
            body = raised.value.body
            assert body["param"] == "input[1].content[0].prompt_cache_breakpoint"  # type: ignore[index]
            assert body["code"] == "unsupported_parameter"  # type: ignore[index]
            implicit = await client.responses.create(model=MODEL, input="hi")  # the engine's own cache, as before
            assert implicit.status == "completed"
