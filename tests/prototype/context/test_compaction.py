"""Compaction: `context_management` on a create (HTTP, SSE, WebSocket), `POST /v1/responses/compact`,
the threshold rule, continuation from a compacted response, its cost, and the comparison's
`compact_threshold` switch in every mode (`sim compare`, `sim long`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from openai.types.beta import BetaResponsesServerEvent

from prototype.context.compaction import decode_payload
from sim.__main__ import main as sim_main
from sim.analysis.metrics import compacted, compaction_summary, per_turn_work, turn_windows
from sim.harness.experiment import CompareConfig, CompareResult, compare, run_compare
from sim.rollout.result import ALL_MODES, RolloutResult
from sim.runtime.virtual import VirtualClock, run_virtual
from tests import strict
from tests.support import EXEC_TOOL, RECEIVE_TIMEOUT_S, Live, live_server, receive_event

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
        # The create's item rules (conversation.split_trigger, check_continuation), run here too.
        (
            {"model": "sim", "input": [{"type": "compaction_trigger"}, {"role": "user", "content": "hi"}]},
            "invalid_value",
            "input[0]",
        ),
        ({"model": "sim", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, None, "input"),
        (
            {"model": "sim", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "missing_required_parameter",
            "input[0].content[0].text",
        ),
    ],
)
async def test_compact_endpoint_refuses_bad_input(
    live: Live, body: dict[str, Any], code: str | None, param: str
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{live.base_url}/responses/compact", json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error")


# -- the comparison's switch (sim compare, sim long), in virtual time with CPU free -----------------------------------

# The modes whose creates carry `context_management`: an Agents API session takes none (docs/compaction.md).
COMPACTING = tuple(m for m in ALL_MODES if m != "agents")
SMALL = CompareConfig(rollouts=1, tool_calls=12, system_prompt_tokens=400, seed=3, modes=COMPACTING)


def run(threshold: int = 0, **kw: Any) -> CompareResult:
    return compare(SMALL.updated(compact_threshold=threshold, **kw), virtual=True, free_cpu=True)


def by_mode(result: CompareResult) -> dict[str, RolloutResult]:
    assert all(r.index == 0 for r in result.rollouts)
    return {r.mode: r for r in result.rollouts}


def model_outputs(r: RolloutResult) -> list[list[str]]:
    """Per turn, the model's items (call arguments or text), compaction items left out."""

    def content(item: dict[str, Any]) -> str:
        if item.get("type") == "function_call":
            return f"{item['name']}({item['arguments']})"
        return "".join(part.get("text", "") for part in item.get("content", []))

    return [[content(i) for i in t.output_items if i.get("type") != "compaction"] for t in r.turns]


def test_compacts_exactly_when_the_prompt_is_past_the_threshold() -> None:
    plain = by_mode(run(modes=("ws",)))["ws"]
    k = next(i for i, p in enumerate(plain.prompt_tokens) if p > 2000)
    at = by_mode(run(plain.prompt_tokens[k], modes=("ws",)))["ws"]  # a prompt equal to the threshold is not past it
    past = by_mode(run(plain.prompt_tokens[k] - 1, modes=("ws",)))["ws"]
    assert [compacted(t) for t in at.turns[: k + 1]] == [False] * (k + 1)
    assert [compacted(t) for t in past.turns[: k + 1]] == [False] * k + [True]
    assert past.prompt_tokens[k] < plain.prompt_tokens[k] / 2
    assert at.prompt_tokens[: k + 1] == plain.prompt_tokens[: k + 1]


@pytest.mark.slow
def test_same_model_outputs_in_every_mode_with_and_without_compaction() -> None:
    """The same seeded rollouts: every mode, inject included, with and without compaction, makes
    the same calls and says the same text; with compaction every mode reads the same prompts."""
    runs = {th: by_mode(run(th)) for th in (0, 3000)}
    outputs = {(th, mode): model_outputs(r) for th, rs in runs.items() for mode, r in rs.items()}
    assert len(outputs) == 2 * len(COMPACTING) and len({json.dumps(o) for o in outputs.values()}) == 1
    with_ = runs[3000]
    # The same context in every mode but `async`, whose outputs enter the context when they arrive.
    assert len({json.dumps(r.prompt_tokens) for m, r in with_.items() if m != "async"}) == 1
    assert all(sum(compacted(t) for t in r.turns) >= 2 for r in with_.values())
    assert all(t.response.longrun.connection_cache == "hit" for t in with_["ws"].turns[1:])  # type: ignore[union-attr]
    assert all(
        len(r.prompt_tokens) == len(r.turns) == SMALL.tool_calls + 1 for rs in runs.values() for r in rs.values()
    )


@pytest.mark.slow
def test_compact_threshold_zero_sends_no_context_management() -> None:
    """0, the default: no body or frame carries `context_management`, nothing compacts, and the run
    is the comparison as it is without the field; N: every mode's creates carry the spec's shape."""
    seen: dict[int, list[bytes]] = {0: [], 3000: []}

    def go(threshold: int) -> CompareResult:
        config = msgspec.structs.replace(SMALL, compact_threshold=threshold)
        main = run_compare(
            config, VirtualClock(), virtual=True, memoize=True, tap=lambda way, data: seen[threshold].append(data)
        )
        return run_virtual(main, charge_cpu=False)

    off, on = go(0), go(3000)
    assert not any(b"context_management" in data for data in seen[0])
    assert not any(compacted(t) for r in off.rollouts for t in r.turns)
    creates = [json.loads(d) for d in seen[3000] if b'"input"' in d and b"response.append" not in d]
    creates = [c for c in creates if c.get("type", "response.create") == "response.create"]
    assert len(creates) >= len(COMPACTING)
    assert all(c["context_management"] == [{"type": "compaction", "compact_threshold": 3000}] for c in creates)
    assert msgspec.to_builtins(off.summary) == msgspec.to_builtins(run(0).summary)
    default = compare(SMALL, virtual=True, free_cpu=True)  # the config as written without the switch
    assert msgspec.to_builtins(default.summary) == msgspec.to_builtins(off.summary)
    assert [r.completion_s for r in default.rollouts] == [r.completion_s for r in off.rollouts]
    assert on.summary != off.summary


def test_inject_compacts_at_a_resume_and_releases_its_held_kv() -> None:
    """The beta's waiting response compacts at an inject past the threshold, as append does at a
    resume: one response per rollout, its held KV released and the compacted prompt prefilled."""
    modes = ("ws", "append", "inject")
    plain_run, compacting_run = run(modes=modes), run(3000, modes=modes)
    plain, with_ = by_mode(plain_run), by_mode(compacting_run)
    for mode in ("append", "inject"):
        r = with_[mode]
        assert len({t.response.id for t in r.turns}) == 1  # one long response
        assert r.prompt_tokens == with_["ws"].prompt_tokens and sum(compacted(t) for t in r.turns) >= 2
    # Append's pauses carry the stage report, so its prefill is known per segment. Its held KV
    # covers the whole context but the appended items, the model's own output included, so it
    # never prefills more than `ws` does (whose prefix cache keeps whole blocks of the prompt and
    # the output, so `ws` recomputes the last partial block); a compaction releases it, and the
    # compacting turn prefills what a create that compacts does (all but the prefix before the
    # summary). Held again from there.

    def uncached(r: RolloutResult) -> list[float]:
        """Per turn, the prompt tokens prefilled: (prefill − model latency) × prefill rate."""
        return [
            (w["stage:prefill"] - SMALL.model.model_latency_s) * SMALL.model.prefill_tok_per_s for w in per_turn_work(r)
        ]

    append, ws = uncached(with_["append"]), uncached(with_["ws"])
    turns = with_["append"].turns
    assert all(a <= w + 1e-6 for a, w, t in zip(append[1:], ws[1:], turns[1:], strict=True) if not compacted(t))
    for k, t in enumerate(turns):
        if compacted(t):
            assert append[k] == pytest.approx(ws[k], abs=1) and append[k] > 0.5 * with_["append"].prompt_tokens[k]
    plain_append, plain_ws = uncached(plain["append"])[1:], uncached(plain["ws"])[1:]
    assert all(a <= w + 1e-6 for a, w in zip(plain_append, plain_ws, strict=True)) and sum(plain_append) < sum(plain_ws)
    idle = {s.mode: s.kv_idle_token_s for s in plain_run.summary}
    for s in compacting_run.summary:
        if s.mode in ("append", "inject"):  # a shorter context held while the tools run
            assert 0 < s.kv_idle_token_s < 0.8 * idle[s.mode]


def test_compaction_cost_lands_in_the_compaction_stage(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"  # a profile file of any subset of fields, the others `local`'s (none)
    path.write_text(
        json.dumps(
            {
                "name": "compaction-only",
                "compaction_call_s": 0.25,
                "compaction_s_per_token_read": 1e-4,
                "compaction_s_per_token_written": 2e-3,
                "compaction_ratio": 0.25,
            }
        )
    )
    plain = by_mode(run(modes=("ws",), profile=str(path)))["ws"]
    with_ = by_mode(run(3000, modes=("ws",), profile=str(path)))["ws"]
    k = next(i for i, t in enumerate(with_.turns) if compacted(t))
    stage = [w.get("stage:compaction", 0.0) for w in per_turn_work(with_)]
    read = plain.prompt_tokens[k]  # the prompt the summarisation read: the uncompacted one
    written = (stage[k] - 0.25 - 1e-4 * read) / 2e-3
    assert abs(written - round(written)) < 1e-6  # CPU is free here: the stage is the modeled call exactly
    # The summary is a quarter of the dropped history (the prompt less the instructions, tools and task).
    assert 0.15 * read < written <= 0.25 * read + 1
    assert all(s == 0.0 for s, t in zip(stage, with_.turns, strict=True) if not compacted(t))
    (summary,) = compaction_summary([with_], run(3000, modes=("ws",), profile=str(path)).summary)
    assert summary.compactions == sum(compacted(t) for t in with_.turns)
    assert summary.seconds_per_compaction == pytest.approx(sum(stage) / summary.compactions)


@pytest.mark.slow
def test_per_turn_prompt_plateaus_with_compaction_and_grows_without() -> None:
    """Through the comparison, in each mode: without compaction the prompt of a turn grows window
    by window; with it, it stops at the threshold's plateau. A turn that re-reads its history
    (`http`) costs ≈ 10 µs more per context token (the hosted profile's validation and safety),
    so without compaction its cost grows with the prompt; with it, a turn that does not compact
    costs what it did early on. `ws` touches only new items: flat either way."""
    config = CompareConfig(rollouts=2, tool_calls=40, system_prompt_tokens=400, tool_output_tokens=300, seed=5)
    without = compare(msgspec.structs.replace(config, modes=COMPACTING), virtual=True, free_cpu=True)
    with_ = compare(
        msgspec.structs.replace(config, modes=COMPACTING, compact_threshold=6000), virtual=True, free_cpu=True
    )
    grows = {(w.mode, w.first_turn): w for w in turn_windows(without.rollouts, 10)}
    flat = {(w.mode, w.first_turn): w for w in turn_windows(with_.rollouts, 10)}
    for mode in COMPACTING:
        assert [w.last_turn for (m, _), w in grows.items() if m == mode] == [10, 20, 30, 41]
        assert all(w.n == 2 for (m, _), w in grows.items() if m == mode)
        assert grows[mode, 31].prompt_tokens > 1.8 * grows[mode, 11].prompt_tokens, mode
        assert 0.75 < flat[mode, 31].prompt_tokens / flat[mode, 11].prompt_tokens < 1.33, mode
        assert max(p for r in with_.rollouts if r.mode == mode for p in r.prompt_tokens) <= 6000
        assert flat[mode, 11].compactions >= 1 and grows[mode, 31].compactions == 0
    more_tokens = grows["http", 31].prompt_tokens - grows["http", 11].prompt_tokens
    assert grows["http", 31].e2e_s - grows["http", 11].e2e_s > 0.8e-5 * more_tokens
    assert abs(grows["ws", 31].e2e_s - grows["ws", 11].e2e_s) < 0.15 * grows["ws", 11].e2e_s

    def plain_turns(mode: str, first: int, last: int) -> float:
        """Mean E2E of the turns first…last (1-based) that did not compact, over the rollouts."""
        turns = [t for r in with_.rollouts if r.mode == mode for t in r.turns[first - 1 : last] if not compacted(t)]
        return math.fsum(t.e2e_s for t in turns) / len(turns)

    assert 0.85 < plain_turns("http", 31, 41) / plain_turns("http", 11, 20) < 1.15


@pytest.mark.slow
def test_long_command_prints_the_window_tables_and_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["long", "--rollouts", "2", "--tool-calls", "12", "--system-prompt-tokens", "400", "--quiet"]
    assert sim_main([*argv, "--compact-threshold", "3000", "--window-turns", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per turn, by turn window" in out and "compaction, per rollout" in out
    modes = [m for m in COMPACTING if m != "steer"]  # steer is inject without interjections
    for mode in modes:  # every other mode, inject and async included, without and with
        assert f"\n{mode:<10} {'no':>10}       1–5" in out and f"\n{mode:<10} {3000:>10}       1–5" in out
    assert "\nsteer " not in out
    windows = (tmp_path / "windows.csv").read_text().splitlines()
    assert len(windows) == 1 + 2 * len(modes) * 2  # 13 turns by 5: 1–5, 6–13
    assert (tmp_path / "with" / "summary.json").is_file() and (tmp_path / "without" / "turns.csv").is_file()
    capsys.readouterr()
    for bad in ("0", "999"):
        assert sim_main([*argv, "--compact-threshold", bad]) == 2
        assert "invalid option" in capsys.readouterr().err
    assert sim_main(["compare", "--virtual", "--compact-threshold", "999"]) == 2
    assert "invalid option" in capsys.readouterr().err
