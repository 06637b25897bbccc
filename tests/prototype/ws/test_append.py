"""Append mode over real loopback sockets: one rollout = one Response (docs/protocol.md#append-mode)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.model import ModelEvent, ModelRequest, Prefilled, TokenModel, TokensSampled
from prototype.serve.app import ENGINE, SOCKETS
from prototype.serve.wallclock import AsyncioClock
from sim.client.client import open_client
from sim.model.policy import PlannedItem, ScriptPolicy
from sim.rollout.result import tool_outputs
from tests.support import EXEC_TOOL, RECEIVE_TIMEOUT_S, Live, live_server, receive_event

STOPS = {"response.done", "response.completed", "response.incomplete", "response.failed", "error"}


async def read_until_stop(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    events = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        events.append(json.loads(msg.data))
        if events[-1]["type"] in STOPS:
            return events


async def send(ws: aiohttp.ClientWebSocketResponse, **frame: Any) -> None:
    await ws.send_str(json.dumps(frame))


def outputs_for(done: dict[str, Any], text: str = "ok") -> list[dict[str, str]]:
    return [{"type": "function_call_output", "call_id": r["call_id"], "output": text} for r in done["required_input"]]


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server(tool_calls=3) as server:
        yield server


async def connect(live: Live, session: aiohttp.ClientSession, **kw: Any) -> aiohttp.ClientWebSocketResponse:
    return await session.ws_connect(live.ws_url + "?mode=append", **kw)


@pytest.mark.slow
async def test_one_rollout_is_one_response(live: Live) -> None:
    async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
        await send(ws, type="response.create", model="sim", input="fix the bug", tools=[EXEC_TOOL], store=False)
        segment = await read_until_stop(ws)
        done = segment[-1]
        rid = done["response"]["id"]
        # The pause: non-terminal status, the calls it waits for, usage null, output so far.
        assert done["type"] == "response.done" and done["response"]["status"] == "in_progress"
        assert done["response"]["usage"] is None
        call = done["response"]["output"][0]
        assert done["required_input"] == [
            {"call_id": call["call_id"], "name": "exec_command", "type": "function_call_output"}
        ]
        seqs = [e["sequence_number"] for e in segment]
        output_indices = [0]
        for _ in range(3):
            await send(ws, type="response.append", input=outputs_for(done))
            segment = await read_until_stop(ws)
            assert segment[0]["type"] == "response.in_progress"  # the resume point
            assert {e["response"]["id"] for e in segment if "response" in e} == {rid}  # same response
            seqs += [e["sequence_number"] for e in segment]
            output_indices += sorted({e["output_index"] for e in segment if "output_index" in e})
            done = segment[-1]
        assert done["type"] == "response.completed"
        assert seqs == list(range(len(seqs)))  # one response, one stream
        assert output_indices == [0, 1, 2, 3]
        final = done["response"]
        assert [o["type"] for o in final["output"]] == ["function_call"] * 3 + ["message"]
        usage = final["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] > 0 and usage["output_tokens"] > 0
        # The completed response enters the connection cache: an ordinary create can chain from it.
        await send(ws, type="response.create", model="sim", input="and now?", previous_response_id=rid, store=False)
        after = (await read_until_stop(ws))[-1]
        assert after["type"] == "response.completed" and after["response"]["previous_response_id"] == rid
    stats = live.app[ENGINE].statistics()
    assert stats.responses == 2 and stats.model_calls == 5 and stats.pauses == 3


async def test_opt_in_by_beta_header_and_not_without(live: Live) -> None:
    async with aiohttp.ClientSession() as session:
        headers = {"OpenAI-Beta": "responses_websockets=2026-02-04"}
        async with session.ws_connect(live.ws_url, headers=headers) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
            assert (await read_until_stop(ws))[-1]["type"] == "response.done"
        async with session.ws_connect(live.ws_url) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
            assert (await read_until_stop(ws))[-1]["type"] == "response.completed"  # plain WebSocket mode
            await send(ws, type="response.append", input=[])
            assert (await read_until_stop(ws))[-1]["error"]["code"] == "unsupported_event_type"


async def test_errors_keep_the_socket_open(live: Live) -> None:
    async with aiohttp.ClientSession() as session, await connect(live, session) as ws:

        async def error_code(**frame: Any) -> str:
            await send(ws, **frame)
            event = (await read_until_stop(ws))[-1]
            assert event["type"] == "error" and event["status"] in (400, 409), event
            return str(event["error"]["code"])

        fco = {"type": "function_call_output", "call_id": "call_x", "output": "x"}
        assert await error_code(type="response.append", input=[fco]) == "response_not_found"
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
        done = (await read_until_stop(ws))[-1]
        rid = done["response"]["id"]
        assert await error_code(type="response.append", input=[fco]) == "unknown_call_id"
        assert await error_code(type="response.append", response_id="resp_nope", input=outputs_for(done)) == (
            "response_not_found"
        )
        missing = [{"type": "function_call_output", "output": "x"}]
        assert await error_code(type="response.append", input=missing) == "missing_required_parameter"
        assert await error_code(type="response.create", model="sim", input="x", previous_response_id=rid) == (
            "response_paused"
        )
        # still paused and usable
        await send(ws, type="response.append", response_id=rid, input=outputs_for(done))
        assert (await read_until_stop(ws))[-1]["type"] == "response.done"


async def test_append_while_sampling_is_not_paused() -> None:
    async with live_server(tool_calls=3, decode_tok_per_s=100.0) as live:
        async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
            while (await receive_event(ws))["type"] != "response.function_call_arguments.delta":
                pass
            await send(ws, type="response.append", input=[])
            events = await read_until_stop(ws)
            errors = [e for e in events if e["type"] == "error"]
            assert errors and errors[0]["error"]["code"] == "response_not_paused"


async def test_parallel_calls_wait_for_every_output_and_inject_acks() -> None:
    two_calls = [
        PlannedItem("function_call", "exec_command", '{"cmd":"ls"}'),
        PlannedItem("function_call", "exec_command", '{"cmd":"pwd"}'),
    ]
    policy = ScriptPolicy([two_calls, PlannedItem("message", "", "done")])
    async with live_server(policy=policy) as live:
        async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
            done = (await read_until_stop(ws))[-1]
            rid = done["response"]["id"]
            first, second = outputs_for(done)
            await send(ws, type="response.inject", response_id=rid, input=[first])
            ack = json.loads((await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data)
            assert ack == {
                "type": "response.inject.created",
                "response_id": rid,
                "sequence_number": done["sequence_number"] + 1,
            }
            # One output is not enough: the response stays paused (nothing else arrives) until the second.
            await send(ws, type="response.inject", response_id=rid, input=[first])
            failed = json.loads((await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data)
            assert failed["type"] == "response.inject.failed" and failed["error"]["code"] == "unknown_call_id"
            assert failed["input"] == [first] and failed["sequence_number"] == ack["sequence_number"] + 1
            await send(ws, type="response.inject", response_id=rid, input=[second])
            assert json.loads((await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data)["type"] == "response.inject.created"
            rest = await read_until_stop(ws)
            assert rest[0]["type"] == "response.in_progress"
            assert rest[-1]["type"] == "response.completed"
            seqs = [done["sequence_number"]] + [e["sequence_number"] for e in rest]
            assert seqs[1] == done["sequence_number"] + 4  # three inject events sit in between
            assert seqs[1:] == list(range(seqs[1], seqs[1] + len(rest)))


async def test_pause_timeout_ends_incomplete_and_frees_the_slot() -> None:
    async with live_server(tool_calls=3, config=ServerConfig(websocket=WebSocketConfig(append_timeout_s=0.2))) as live:
        async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL], store=False)
            done = (await read_until_stop(ws))[-1]
            end = (await read_until_stop(ws))[-1]  # the timer fires; no sleep in the test
            assert end["type"] == "response.incomplete"
            assert end["response"]["incomplete_details"] == {"reason": "append_timeout"}
            assert end["response"]["output"] == done["response"]["output"]
            await send(ws, type="response.append", input=outputs_for(done))
            assert (await read_until_stop(ws))[-1]["error"]["code"] == "response_already_completed"
            await send(ws, type="response.create", model="sim", input="again", store=False)
            assert (await read_until_stop(ws))[-1]["type"] in ("response.done", "response.completed")


async def test_disconnect_while_paused_leaves_no_task_behind(live: Live) -> None:
    async with aiohttp.ClientSession() as session:
        ws = await connect(live, session)
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
        assert (await read_until_stop(ws))[-1]["type"] == "response.done"
        await ws.close()
    for _ in range(200):
        if not live.app[SOCKETS]:
            break
        await asyncio.sleep(0)  # let the server's handler run its cleanup (no wall-clock wait)
    assert not live.app[SOCKETS]
    names = {t.get_coro().__qualname__ for t in asyncio.all_tasks()}  # type: ignore[union-attr]
    assert not {n for n in names if n.startswith("WebSocketSession.")}, names


async def test_lifetime_limit_while_paused() -> None:
    async with live_server(tool_calls=3, config=ServerConfig(websocket=WebSocketConfig(lifetime_s=0.3))) as live:
        async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
            await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
            assert (await read_until_stop(ws))[-1]["type"] == "response.done"
            end = (await read_until_stop(ws))[-1]
            assert end["type"] == "response.incomplete"
            assert end["response"]["incomplete_details"] == {"reason": "connection_limit"}
            err = json.loads((await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data)
            assert err["error"]["code"] == "websocket_connection_limit_reached"
            assert (await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data == 1001


class Recorder:
    """Wraps the simulator and records every model-visible prompt and sampled token."""

    def __init__(self, inner: TokenModel) -> None:
        self.inner = inner
        self.prompts: list[np.ndarray] = []
        self.cached: list[int] = []
        self.tokens: list[list[int]] = []

    async def sample(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.prompts.append(np.concatenate(request.prompt))
        self.tokens.append([])
        async for event in self.inner.sample(request):
            if isinstance(event, TokensSampled):
                self.tokens[-1].extend(event.token_ids)
            elif isinstance(event, Prefilled):
                self.cached.append(event.cached_tokens)
            yield event

    def release(self, conversation_id: str) -> None:
        self.inner.release(conversation_id)


async def rollout(mode: str, turns: int) -> tuple[Recorder, list[Any], Any]:
    async with live_server(tool_calls=turns - 1, seed=11) as live:
        engine = live.app[ENGINE]
        recorder = Recorder(engine.model)
        engine.model = recorder
        clock = AsyncioClock()
        client = open_client(mode, live.base_url, clock)  # type: ignore[arg-type]
        settings = {
            "model": "sim",
            "tools": [EXEC_TOOL],
            "instructions": "You are a coding agent.",
            "store": mode == "http_prev",
        }
        results = []
        items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        try:
            for k in range(turns):
                result = await client.turn(items, **settings)
                results.append(result)
                items = tool_outputs(result, f"output of step {k}\n" * (k + 1))
                if not items:
                    break
        finally:
            await client.close()
        return recorder, results, engine.statistics()


@pytest.mark.slow
async def test_thirty_turns_same_tokens_as_ws_with_work_done_once() -> None:
    ws_rec, ws_results, ws_stats = await rollout("ws", 30)
    ap_rec, ap_results, ap_stats = await rollout("append", 30)
    assert len(ws_rec.prompts) == len(ap_rec.prompts) == 30
    for k in range(30):
        assert np.array_equal(ws_rec.prompts[k], ap_rec.prompts[k]), k  # same model-visible context
        assert ws_rec.tokens[k] == ap_rec.tokens[k], k  # same sampled tokens
        # Held KV covers the whole context before the appended items; ws's prefix cache
        # covers the previous prompt's full blocks (the output's rendering was never prefilled).
        assert ap_rec.cached[k] >= ws_rec.cached[k], k
    # The same totals: append's one usage is the sum of the ws turns'.
    final = ap_results[-1].response
    assert final.status == "completed" and len(final.output) == 30
    assert final.usage.input_tokens == sum(r.response.usage.input_tokens for r in ws_results)
    assert final.usage.output_tokens == sum(r.response.usage.output_tokens for r in ws_results)
    assert final.usage.input_tokens_details.cached_tokens >= sum(
        r.response.usage.input_tokens_details.cached_tokens for r in ws_results
    )
    assert final.usage.input_tokens_details.cached_tokens == sum(ap_rec.cached)
    # Pre-inference once (no re-render), one response object, no queue re-entry, 29 pauses.
    assert ap_stats.responses == 1 and ws_stats.responses == 30
    assert ap_stats.pauses == 29 and ws_stats.pauses == 0
    assert ap_stats.tokens_rendered == ws_stats.tokens_rendered  # both render each item exactly once
    assert ap_stats.kv_idle_token_s > 0


@pytest.mark.slow
async def test_http_renders_quadratically_append_linearly() -> None:
    """Tokens rendered per turn: flat in append, growing with history in http (counted, not timed)."""
    _, _, ap_stats = await rollout("append", 12)
    _, _, http_stats = await rollout("http", 12)
    assert http_stats.tokens_rendered > 4 * ap_stats.tokens_rendered


async def test_store_true_append_response_is_stored_once_with_its_transcript(live: Live) -> None:
    async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
        await send(ws, type="response.create", model="sim", input="go", tools=[EXEC_TOOL])
        done = (await read_until_stop(ws))[-1]
        while done["type"] == "response.done":
            await send(ws, type="response.append", input=outputs_for(done))
            done = (await read_until_stop(ws))[-1]
        rid = done["response"]["id"]
        assert live.app[ENGINE].statistics().store_writes == 1  # post-inference once
        await send(ws, type="response.create", model="sim", input="next", previous_response_id=rid, tools=[EXEC_TOOL])
        cached = (await read_until_stop(ws))[-1]["response"]
    async with aiohttp.ClientSession() as session:  # another connection hydrates from the store
        async with session.ws_connect(live.ws_url) as ws:
            await send(
                ws, type="response.create", model="sim", input="next", previous_response_id=rid, tools=[EXEC_TOOL]
            )
            hydrated = (await read_until_stop(ws))[-1]["response"]
    assert hydrated["usage"]["input_tokens"] == cached["usage"]["input_tokens"]
    strip = ("id", "call_id")  # fresh ids per response; the model-visible content must match
    assert [{k: v for k, v in o.items() if k not in strip} for o in hydrated["output"]] == [
        {k: v for k, v in o.items() if k not in strip} for o in cached["output"]
    ]


@pytest.mark.slow
async def test_all_four_modes_feed_the_model_the_same_tokens() -> None:
    recorders = {mode: (await rollout(mode, 8))[0] for mode in ("http", "http_prev", "ws", "append")}
    reference = recorders["http"]
    for mode, rec in recorders.items():
        assert len(rec.prompts) == 8, mode
        for k in range(8):
            assert np.array_equal(rec.prompts[k], reference.prompts[k]), (mode, k)
            assert rec.tokens[k] == reference.tokens[k], (mode, k)


async def test_lanes_in_append_mode_pause_independently_and_acks_carry_the_lane() -> None:
    async with live_server(tool_calls=2) as live:
        async with aiohttp.ClientSession() as session, await connect(live, session) as ws:
            for lane in ("a", "b"):
                await send(ws, type="response.create", model="sim", input=lane, tools=[EXEC_TOOL], stream_id=lane)
            done: dict[str, dict[str, Any]] = {}
            while len(done) < 2:  # both lanes pause: a paused response holds only its own lane
                ev = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
                assert ev["stream_id"] in ("a", "b")
                if ev["type"] == "response.done":
                    done[ev["stream_id"]] = ev
            rid = done["a"]["response"]["id"]
            await send(ws, type="response.inject", response_id=rid, input=outputs_for(done["a"]))
            ack = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            assert ack == {
                "stream_id": "a",
                "type": "response.inject.created",
                "response_id": rid,
                "sequence_number": done["a"]["sequence_number"] + 1,
            }
            resumed = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            assert (resumed["type"], resumed["stream_id"]) == ("response.in_progress", "a")
