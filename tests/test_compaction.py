"""Compaction: `context_management` on a create (HTTP, SSE, WebSocket), `POST /v1/responses/compact`,
the threshold rule, continuation from a compacted response, its cost, and a 200-turn rollout."""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.beta import BetaResponsesServerEvent

from prototype.compaction import decode_payload
from prototype.pipeline import PROFILES
from sim.long_rollout import LongRolloutConfig, TurnCost, run_long_rollout

from . import strict
from .support import EXEC_TOOL, RECEIVE_TIMEOUT_S, Live, live_server, receive_event

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}


def history(pairs: int, words: int = 400) -> list[dict[str, Any]]:
    """A user task, then `pairs` tool calls with their outputs: a prompt of ≈ `pairs × words` tokens."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "fix the failing test"}]
    for i in range(pairs):
        items.append(
            {"type": "function_call", "call_id": f"call_{i}", "name": "exec_command", "arguments": '{"cmd":"ls"}'}
        )
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": "src tests " * (words // 2)})
    return items


COMPACT = [{"type": "compaction", "compact_threshold": 1000}]


@pytest.fixture
async def live() -> Any:
    async with live_server(tool_calls=50) as server:
        yield server


def compaction_events(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(type, output_index) of the events about the compaction item, in order."""
    out = []
    for ev in events:
        item = ev.get("item") or {}
        if ev["type"] == "response.compaction.compacting" or item.get("type") == "compaction":
            out.append((ev["type"], ev["output_index"]))
    return out


def check_compacted_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The compaction's events come first, as one item at index 0; the terminal response has it."""
    assert compaction_events(events) == [
        ("response.output_item.added", 0),
        ("response.compaction.compacting", 0),
        ("response.output_item.done", 0),
    ]
    added = next(ev for ev in events if ev["type"] == "response.output_item.added")
    done = next(ev for ev in events if ev["type"] == "response.output_item.done")
    assert added["item"]["encrypted_content"] == "" and done["item"]["encrypted_content"]
    compacting = next(ev for ev in events if ev["type"] == "response.compaction.compacting")
    assert compacting["item_id"] == added["item"]["id"] == done["item"]["id"]
    first_model_item = next(
        ev for ev in events if ev["type"] == "response.output_item.added" and ev["output_index"] == 1
    )
    assert events.index(first_model_item) > events.index(done)
    response: dict[str, Any] = events[-1]["response"]
    assert response["output"][0] == done["item"]
    return response


# -- the wire: HTTP JSON, SSE, WebSocket --------------------------------------------------------------------------


async def test_http_create_compacts_past_the_threshold(live: Live) -> None:
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    long = await client.responses.create(model="sim", input=history(4), tools=[EXEC_TOOL])  # type: ignore[arg-type]
    assert long.usage is not None and long.usage.input_tokens > 1000
    assert all(item.type != "compaction" for item in long.output)
    compacted = await client.responses.create(
        model="sim",
        input=history(4),  # type: ignore[arg-type]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
        context_management=COMPACT,  # type: ignore[list-item]
    )
    assert compacted.output[0].type == "compaction"
    assert compacted.usage is not None and compacted.usage.input_tokens < long.usage.input_tokens / 2
    # The model goes on exactly as it would have (the item carries its turn count): same call.
    assert [(o.name, o.arguments) for o in compacted.output[1:] if o.type == "function_call"] == [
        (o.name, o.arguments) for o in long.output if o.type == "function_call"
    ]
    await client.close()


async def test_sse_stream_carries_the_compaction_events(live: Live) -> None:
    async with aiohttp.ClientSession() as session:
        body = {
            "model": "sim",
            "input": history(4),
            "tools": [EXEC_TOOL],
            "stream": True,
            "context_management": COMPACT,
        }
        async with session.post(f"{live.base_url}/responses", json=body) as resp:
            assert resp.status == 200
            raw = await resp.text()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    response = check_compacted_stream(events)
    assert events[-1]["type"] == "response.completed" and response["output"][1]["type"] == "function_call"


async def test_sdk_stream_accumulates_the_compaction_item(live: Live) -> None:
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    async with client.responses.stream(
        model="sim",
        input=history(4),  # type: ignore[arg-type]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
        context_management=COMPACT,  # type: ignore[list-item]
    ) as stream:
        seen = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.compaction.compacting" in seen
    assert final.output[0].type == "compaction" and final.output[0].encrypted_content
    await client.close()


async def ws_turn(ws: aiohttp.ClientWebSocketResponse, **body: Any) -> list[dict[str, Any]]:
    await ws.send_str(json.dumps({"type": "response.create", "model": "sim", "tools": [EXEC_TOOL], **body}))
    events = []
    while True:
        events.append(await receive_event(ws, RECEIVE_TIMEOUT_S))
        if events[-1]["type"] in TERMINAL:
            return events


def tool_outputs(response: dict[str, Any], words: int = 400) -> list[dict[str, Any]]:
    return [
        {"type": "function_call_output", "call_id": o["call_id"], "output": "src tests " * (words // 2)}
        for o in response["output"]
        if o["type"] == "function_call"
    ]


async def test_websocket_compacts_then_continues_from_the_connection_cache(live: Live) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(live.ws_url) as ws:
        events = await ws_turn(ws, input=history(4), store=False, context_management=COMPACT)
        compacted = check_compacted_stream(events)
        # The next turn continues from the compacted context, held by the connection (store: false).
        events = await ws_turn(
            ws,
            input=tool_outputs(compacted, words=100),
            previous_response_id=compacted["id"],
            store=False,
            context_management=[{"type": "compaction", "compact_threshold": 5000}],
        )
        after = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and compaction_events(events) == []
        assert after["longrun"]["connection_cache"] == "hit"
        assert compacted["usage"]["input_tokens"] < after["usage"]["input_tokens"] < 1000


async def test_beta_websocket_connection_types_the_compaction_events(live: Live) -> None:
    """openai-python's beta connection (`client.beta.responses.connect()`) parses every frame of a
    compacting response as its beta models, validated here with validation on."""
    members = strict._members(BetaResponsesServerEvent)
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    async with client.beta.responses.connect() as conn:
        await conn.response.create(
            model="sim",
            input=history(4),  # type: ignore[arg-type]
            tools=[EXEC_TOOL],  # type: ignore[list-item]
            context_management=COMPACT,  # type: ignore[list-item]
            store=False,
        )
        events, parsed_as = [], []
        async for event in conn:
            payload = event.model_dump(mode="json", exclude_unset=True)
            members[payload["type"]].model_validate(payload, strict=True)
            events.append(payload)
            parsed_as.append(type(event).__name__)
            if event.type in TERMINAL:
                break
    assert "BetaResponseCompactionWsCompacting" in parsed_as
    check_compacted_stream(events)
    await client.close()


async def test_store_continues_from_a_compacted_response(live: Live) -> None:
    """`previous_response_id` over HTTP loads the compacted context from the store; a client that
    resends its whole history, compaction item included, gets the same prompt."""
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    first = await client.responses.create(
        model="sim",
        input=history(4),  # type: ignore[arg-type]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
        context_management=COMPACT,  # type: ignore[list-item]
    )
    outputs = tool_outputs(first.model_dump(), words=100)
    chained = await client.responses.create(
        model="sim",
        previous_response_id=first.id,
        input=outputs,  # type: ignore[arg-type]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
    )
    resent = await client.responses.create(
        model="sim",
        input=[*history(4), *[o.model_dump(exclude_none=True) for o in first.output], *outputs],  # type: ignore[list-item]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
    )
    assert chained.usage is not None and resent.usage is not None and first.usage is not None
    assert chained.usage.input_tokens == resent.usage.input_tokens < first.usage.input_tokens + 300
    stored = await client.responses.retrieve(first.id)  # the stored copy keeps the compaction item
    assert stored.output[0].type == "compaction" and stored.output[0] == first.output[0]
    assert [o.model_dump(exclude={"id", "call_id"}) for o in chained.output] == [
        o.model_dump(exclude={"id", "call_id"}) for o in resent.output
    ]
    await client.close()


async def test_a_compaction_trigger_compacts_now_and_samples_nothing(live: Live) -> None:
    """`compaction_trigger` as the final input item: the response compacts, whatever the
    threshold, and completes with the compaction item alone; the next turn continues from it."""
    async with aiohttp.ClientSession() as session, session.ws_connect(live.ws_url) as ws:
        first = (await ws_turn(ws, input=history(2), store=False))[-1]["response"]
        events = await ws_turn(
            ws,
            input=[*tool_outputs(first), {"type": "compaction_trigger"}],
            previous_response_id=first["id"],
            store=False,
        )
        compacted = events[-1]["response"]
        assert compaction_events(events) == [
            ("response.output_item.added", 0),
            ("response.compaction.compacting", 0),
            ("response.output_item.done", 0),
        ]
        assert [o["type"] for o in compacted["output"]] == ["compaction"]
        assert compacted["status"] == "completed" and compacted["usage"]["output_tokens"] == 0
        after = (await ws_turn(ws, input=[{"role": "user", "content": "go on"}], previous_response_id=compacted["id"]))[
            -1
        ]
        assert after["type"] == "response.completed"
        assert after["response"]["usage"]["input_tokens"] < first["usage"]["input_tokens"]


async def test_a_compaction_trigger_must_be_the_final_input_item(live: Live) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "sim", "input": [{"type": "compaction_trigger"}, {"role": "user", "content": "hi"}]}
        async with session.post(f"{live.base_url}/responses", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "input[0]")


# -- POST /v1/responses/compact -----------------------------------------------------------------------------------


async def test_compact_endpoint_returns_user_messages_and_one_compaction_item(live: Live) -> None:
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    items = history(4)
    compacted = await client.responses.compact(model="sim", input=items)  # type: ignore[arg-type]
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    dumped = [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]
    # openai-python types `output` as output items, so the user message parses as a loose model.
    assert [o.get("role", o["type"]) for o in dumped] == ["user", "compaction"]
    assert compacted.usage.input_tokens > 1000 and 0 < compacted.usage.output_tokens < compacted.usage.input_tokens / 2
    payload = decode_payload(dumped[-1]["encrypted_content"], "x")
    assert payload.turns == 4  # four model turns stand behind the item
    # The compacted output is the next create's input: a much shorter prompt.
    follow = await client.responses.create(
        model="sim",
        input=[*dumped, {"role": "user", "content": "go on"}],  # type: ignore[list-item]
        tools=[EXEC_TOOL],  # type: ignore[list-item]
    )
    assert follow.usage is not None and follow.usage.input_tokens < compacted.usage.input_tokens / 2
    # The beta route (`?beta=true`) is the same endpoint.
    beta = await client.beta.responses.compact(model="sim", input=items)  # type: ignore[arg-type]
    assert beta.usage.input_tokens == compacted.usage.input_tokens
    await client.close()


async def test_compact_endpoint_with_previous_response_id(live: Live) -> None:
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="sk-test")
    first = await client.responses.create(model="sim", input=history(3), tools=[EXEC_TOOL])  # type: ignore[arg-type]
    compacted = await client.responses.compact(
        model="sim",
        previous_response_id=first.id,
        input=tool_outputs(first.model_dump()),  # type: ignore[arg-type]
    )
    payload = decode_payload(compacted.output[-1].model_dump()["encrypted_content"], "x")
    assert payload.turns == 4  # three in the input, one in the stored response
    await client.close()


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"input": "hi"}, "missing_required_parameter", "model"),
        ({"model": "sim"}, "missing_required_parameter", "input"),
        ({"model": "sim", "input": "hi", "tools": []}, "unknown_parameter", "tools"),
        ({"model": "sim", "previous_response_id": "resp_nope"}, "previous_response_not_found", "previous_response_id"),
        (
            {"model": "sim", "input": [{"type": "compaction", "encrypted_content": "junk"}]},
            "invalid_encrypted_content",
            "input[0].encrypted_content",
        ),
        (
            {"model": "sim", "input": [{"type": "message", "role": "robot", "content": "x"}]},
            "invalid_value",
            "input[0].role",
        ),
    ],
)
async def test_compact_endpoint_refuses_bad_input(live: Live, body: dict[str, Any], code: str, param: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{live.base_url}/responses/compact", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")


# -- the threshold rule, continuation and cost, in virtual time -----------------------------------------------------


def rollout(mode: str = "ws", threshold: int | None = None, turns: int = 12, **kw: Any) -> list[TurnCost]:
    config = LongRolloutConfig(mode=mode, turns=turns, compact_threshold=threshold, system_prompt_tokens=400, **kw)  # type: ignore[arg-type]
    return run_long_rollout(config)


def test_compacts_exactly_when_the_prompt_is_past_the_threshold() -> None:
    plain = rollout()
    k = next(i for i, turn in enumerate(plain) if turn.prompt_tokens > 2000)
    at = rollout(threshold=plain[k].prompt_tokens)  # a prompt equal to the threshold is not past it
    past = rollout(threshold=plain[k].prompt_tokens - 1)
    assert [t.compacted for t in at[: k + 1]] == [False] * (k + 1)
    assert [t.compacted for t in past[: k + 1]] == [False] * k + [True]
    assert past[k].prompt_tokens < plain[k].prompt_tokens / 2
    assert [t.prompt_tokens for t in at[: k + 1]] == [t.prompt_tokens for t in plain[: k + 1]]


def test_same_model_output_in_every_mode_with_and_without_compaction() -> None:
    modes = ("http", "http_prev", "ws", "append")
    runs = {(mode, th): rollout(mode, th) for mode in modes for th in (None, 1500)}
    outputs = {key: [t.outputs for t in run] for key, run in runs.items()}
    assert len({json.dumps(o) for o in outputs.values()}) == 1
    prompts = {mode: [t.prompt_tokens for t in runs[mode, 1500]] for mode in modes}
    assert prompts["http"] == prompts["http_prev"] == prompts["ws"] == prompts["append"]  # the same context
    assert sum(t.compacted for t in runs["ws", 1500]) >= 2
    ws = runs["ws", 1500]
    assert all(t.connection_cache == "hit" for t in ws[1:])


def test_append_releases_its_held_kv_when_it_compacts() -> None:
    """A paused append response holds its KV across the pause; a compaction at a resume replaces
    the context, so the held KV stands for nothing the model reads and the prompt is prefilled again."""
    plain, compacted, ws = rollout("append"), rollout("append", 2000), rollout("ws", 2000)
    k = next(i for i, t in enumerate(compacted) if t.compacted)
    assert k > 0 and all(t.connection_cache == "none" for t in compacted)
    assert plain[k].cached_tokens > 0.9 * plain[k].prompt_tokens  # held KV: only the appended items are new
    # Released: only the prefix before the summary (instructions, tools, task) is cached, as for a
    # create that compacts; the summary and what follows it are prefilled.
    assert compacted[k].cached_tokens == ws[k].cached_tokens < compacted[k].prompt_tokens * 0.6
    assert compacted[k + 1].cached_tokens > 0.8 * compacted[k + 1].prompt_tokens  # held again from there


def test_compaction_cost_lands_in_the_compaction_stage() -> None:
    profile = PROFILES["local"].__class__(
        name="compaction-only",
        compaction_call_s=0.25,
        compaction_s_per_token_read=1e-4,
        compaction_s_per_token_written=2e-3,
        compaction_ratio=0.25,
    )
    plain = rollout(profile=profile)
    compacted = rollout(threshold=2000, profile=profile)
    k = next(i for i, t in enumerate(compacted) if t.compacted)
    read = plain[k].prompt_tokens  # the prompt the summarisation read: the uncompacted one
    written = (compacted[k].compaction_s - 0.25 - 1e-4 * read) / 2e-3
    assert abs(written - round(written)) < 1e-6  # CPU is free here: the stage is the modeled call exactly
    # The summary is a quarter of the dropped history (the prompt less the instructions, tools and task).
    assert 0.15 * read < written <= 0.25 * read + 1
    assert compacted[k].server_s >= compacted[k].compaction_s > 0.25
    assert all(t.compaction_s == 0.0 for t in compacted if not t.compacted)


def test_200_turns_per_turn_cost_plateaus_with_compaction_and_grows_without() -> None:
    """The prompt (every mode) and the server time of a turn that re-renders its history
    (`http_prev`) grow with the rollout without compaction and stop growing with it."""

    def quarter_means(run: list[TurnCost], field: str) -> tuple[float, float]:
        n = len(run)
        second, last = run[n // 4 : n // 2], run[3 * n // 4 :]
        return (
            math.fsum(getattr(t, field) for t in second) / len(second),
            math.fsum(getattr(t, field) for t in last) / len(last),
        )

    threshold = 20_000
    for mode in ("ws", "http_prev", "append"):
        grows = run_long_rollout(LongRolloutConfig(mode=mode, turns=200))  # type: ignore[arg-type]
        flat = run_long_rollout(LongRolloutConfig(mode=mode, turns=200, compact_threshold=threshold))  # type: ignore[arg-type]
        assert len(grows) == len(flat) == 201
        early, late = quarter_means(grows, "prompt_tokens")
        assert late > 1.8 * early, (mode, early, late)
        early, late = quarter_means(flat, "prompt_tokens")
        assert 0.8 < late / early < 1.25, (mode, early, late)
        assert max(t.prompt_tokens for t in flat) <= threshold < max(t.prompt_tokens for t in grows)
        assert sum(t.compacted for t in flat) >= 4
        if mode == "http_prev":
            early, late = quarter_means(grows, "server_s")
            assert late > 1.3 * early, (early, late)
            early, late = quarter_means(flat, "server_s")
            assert 0.85 < late / early < 1.15, (early, late)
