"""WebSocket mode over real loopback sockets: tolerance rules, FIFO, cache, store, warm-up, limits, auth."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

import aiohttp
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.store.memory import MemoryStore
from tests.support import (
    EXEC_TOOL,
    RECEIVE_TIMEOUT_S,
    TERMINAL,
    Live,
    connect,
    last,
    live_server,
    read_response,
    receive_event,
    turn,
)


@pytest.fixture
async def live() -> Any:
    async with live_server(tool_calls=3) as server:
        yield server


async def test_codex_shaped_turns_are_accepted(live: Live) -> None:
    """Codex: stream:true, unknown top-level fields, client item ids, namespace/custom/web_search tools."""
    session, ws = await connect(live)
    async with session, ws:
        tools = [
            EXEC_TOOL,
            {
                "type": "namespace",
                "name": "mcp",
                "description": "Tools of one MCP server.",
                "tools": [{"type": "function", "name": "x", "parameters": {}}],
            },
            {"type": "web_search", "external_web_access": False},
            {
                "type": "custom",
                "name": "apply_patch",
                "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
            },
        ]
        common = {
            "stream": True,
            "tools": tools,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "01a22608",
            "client_metadata": {"x": "y"},
            "access_programs": [],
        }
        warm = await turn(
            ws,
            generate=False,
            input=[
                {
                    "type": "message",
                    "id": "msg_abc",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "You are Codex."}],
                }
            ],
            **common,
        )
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
        done = last(warm)["response"]
        assert done["output"] == [] and done["usage"]["total_tokens"] == 0
        first = await turn(
            ws,
            previous_response_id=done["id"],
            input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}],
            **common,
        )
        resp = last(first)["response"]
        assert resp["status"] == "completed" and resp["tools"] == tools
        assert resp["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the warm-up's rendered tokens
        call = resp["output"][0]
        second = await turn(
            ws,
            previous_response_id=resp["id"],
            input=[{"type": "function_call_output", "id": "fco_01a2", "call_id": call["call_id"], "output": "a.py\n"}],
            **common,
        )
        assert last(second)["response"]["status"] == "completed"


async def test_openai_agents_shape_untyped_message_and_replayed_items(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        first = last(await turn(ws, input=[{"content": "Weather in Paris?", "role": "user"}], tools=[EXEC_TOOL]))
        call = first["response"]["output"][0]
        replay = [
            {"content": "Weather in Paris?", "role": "user"},
            {**call, "annotations": [], "logprobs": []},
            {"call_id": call["call_id"], "output": "Paris: 21C", "type": "function_call_output"},
        ]
        second = last(await turn(ws, input=replay, tools=[EXEC_TOOL]))
        assert second["response"]["status"] == "completed"


async def test_nested_create_form_and_string_input(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        await ws.send_str(json.dumps({"type": "response.create", "response": {"model": "sim", "input": "Say hello."}}))
        events = await read_response(ws)
        assert last(events)["type"] == "response.completed"
        assert last(events)["response"]["output"][0]["type"] == "message"


async def test_sequence_numbers_restart_per_response_and_are_contiguous(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        for _ in range(2):
            events = await turn(ws, input="hi", tools=[EXEC_TOOL])
            assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_pipelined_creates_run_fifo_and_never_interleave(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        for i in range(3):
            await ws.send_str(
                json.dumps({"type": "response.create", "model": "sim", "input": f"task {i}", "metadata": {"n": str(i)}})
            )
        order = []
        for _ in range(3):
            events = await read_response(ws)
            ids = {e["response"]["id"] for e in events if "response" in e}
            assert len(ids) == 1  # one response's events, contiguous
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            order.append(last(events)["response"]["metadata"]["n"])
        assert order == ["0", "1", "2"]


async def test_error_events_keep_the_socket_open(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        cases = [
            ("{oops", "invalid_json"),
            ("[1]", "invalid_json"),
            # WebSocket mode steers; this steer names no previous_response_id
            (json.dumps({"type": "response.steer", "input": []}), "invalid_value"),
            (json.dumps({"type": "response.append", "input": []}), "unsupported_event_type"),
            (json.dumps({"type": "response.create", "model": "sim", "background": True}), "unsupported_parameter"),
            (
                json.dumps({"type": "response.create", "model": "sim", "input": [{"role": "robot", "content": "x"}]}),
                "invalid_value",
            ),
            (
                json.dumps(
                    {
                        "type": "response.create",
                        "model": "sim",
                        "tools": [{"type": "function", "name": "f", "parameters": "nope"}],
                    }
                ),
                "invalid_function_parameters",
            ),
            (
                json.dumps(
                    {"type": "response.create", "model": "sim", "tool_choice": {"type": "function", "name": "nope"}}
                ),
                "invalid_value",
            ),
            (
                json.dumps({"type": "response.create", "model": "sim", "previous_response_id": "resp_missing"}),
                "previous_response_not_found",
            ),
        ]
        for frame, code in cases:
            await ws.send_str(frame)
            msg = json.loads((await ws.receive(timeout=RECEIVE_TIMEOUT_S)).data)
            assert msg["type"] == "error" and msg["status"] == 400, msg
            assert msg["error"]["code"] == code and msg["error"]["type"] == "invalid_request_error", msg
            assert "Traceback" not in msg["error"]["message"]
        assert last(await turn(ws, input="still alive?"))["type"] == "response.completed"


async def test_binary_frame_closes_with_1003(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        await ws.send_bytes(b"\x00\x01")
        msg = await ws.receive(timeout=RECEIVE_TIMEOUT_S)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1003


async def test_warm_up_is_chainable_by_the_very_next_frame(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        await ws.send_str(
            json.dumps(
                {
                    "type": "response.create",
                    "model": "sim",
                    "generate": False,
                    "store": False,
                    "input": "system warmup",
                    "instructions": "You are terse.",
                }
            )
        )
        warm = await read_response(ws)
        warm_id = last(warm)["response"]["id"]
        assert last(warm)["response"]["output"] == []
        assert last(warm)["response"]["usage"]["input_tokens"] == 0
        nxt = await turn(ws, previous_response_id=warm_id, store=False, instructions="You are terse.", input="go")
        assert last(nxt)["response"]["status"] == "completed"
        assert last(nxt)["response"]["previous_response_id"] == warm_id


async def test_store_false_miss_on_new_socket_then_full_resend(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        first = last(await turn(ws, input="hello", store=False))["response"]
    session, ws = await connect(live)
    async with session, ws:
        err = last(await turn(ws, input="again", store=False, previous_response_id=first["id"]))
        assert err == {
            "type": "error",
            "status": 400,
            "error": {
                "type": "invalid_request_error",
                "code": "previous_response_not_found",
                "message": f"Previous response with id '{first['id']}' not found.",
                "param": "previous_response_id",
            },
        }
        full = [{"role": "user", "content": "hello"}, *first["output"], {"role": "user", "content": "again"}]
        assert last(await turn(ws, input=full, store=False))["type"] == "response.completed"


async def test_store_true_miss_hydrates_from_store_with_same_tokens(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        first = last(await turn(ws, input="hello", tools=[EXEC_TOOL]))["response"]
        call = first["output"][0]
        fco = {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}
        cached = last(await turn(ws, input=[fco], tools=[EXEC_TOOL], previous_response_id=first["id"]))["response"]
    session, ws = await connect(live)
    async with session, ws:
        hydrated = last(await turn(ws, input=[fco], tools=[EXEC_TOOL], previous_response_id=first["id"]))["response"]
    assert hydrated["usage"]["input_tokens"] == cached["usage"]["input_tokens"]
    # A store hit is a connection-cache miss (the model's prefix cache may still hold the tokens).
    assert hydrated["longrun"]["connection_cache"] == "miss" and cached["longrun"]["connection_cache"] == "hit"
    assert cached["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert hydrated["output"][0]["arguments"] == cached["output"][0]["arguments"]


async def test_failed_continuation_evicts_the_cache(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        first = last(await turn(ws, input="hello", store=False))["response"]
        bad = last(
            await turn(ws, input=[{"role": "robot", "content": "x"}], store=False, previous_response_id=first["id"])
        )
        assert bad["type"] == "error" and bad["error"]["code"] == "invalid_value"
        again = last(await turn(ws, input="hello", store=False, previous_response_id=first["id"]))
        assert again["error"]["code"] == "previous_response_not_found"


async def test_get_without_upgrade_is_405(live: Live) -> None:
    async with aiohttp.ClientSession() as session, session.get(live.base_url + "/responses") as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_auth_is_checked_before_the_upgrade() -> None:
    async with live_server(config=ServerConfig(api_key="sk-right")) as server:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await session.ws_connect(server.ws_url, headers={"Authorization": "Bearer sk-wrong"})
            assert info.value.status == 401
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await session.ws_connect(server.ws_url)
            async with session.ws_connect(server.ws_url, headers={"Authorization": "Bearer sk-right"}) as ws:
                assert last(await turn(ws, input="hi"))["type"] == "response.completed"
            async with session.post(server.base_url + "/responses", json={"model": "sim", "input": "x"}) as r:
                assert r.status == 401
                body = await r.json()
                assert body["error"]["code"] == "invalid_api_key"


async def test_refuse_mode_answers_426() -> None:
    async with (
        live_server(config=ServerConfig(websocket=WebSocketConfig(refuse=True))) as server,
        aiohttp.ClientSession() as session,
    ):
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(server.ws_url)
        assert info.value.status == 426


async def test_lifetime_limit_closes_an_idle_socket_with_exact_error() -> None:
    async with live_server(config=ServerConfig(websocket=WebSocketConfig(lifetime_s=0.5))) as server:
        session, ws = await connect(server)
        async with session, ws:
            assert last(await turn(ws, input="hi"))["type"] == "response.completed"
            msg = await asyncio.wait_for(ws.receive(), 30)  # the timer fires; no sleep in the test
            err = json.loads(msg.data)
            assert err["error"]["code"] == "websocket_connection_limit_reached"
            assert err["error"]["message"] == (
                "Responses websocket connection limit reached (0.5 seconds). "
                "Create a new websocket connection to continue."
            )
            closing = await asyncio.wait_for(ws.receive(), 30)
            assert closing.type is aiohttp.WSMsgType.CLOSE and closing.data == 1001


async def test_lifetime_limit_lets_the_in_flight_response_finish() -> None:
    # Paced at 200 tokens/s, the response outlives the 0.3 s limit.
    async with live_server(
        config=ServerConfig(websocket=WebSocketConfig(lifetime_s=0.3)), decode_tok_per_s=200.0
    ) as server:
        session, ws = await connect(server)
        async with session, ws:
            events = await turn(ws, input="write a long answer", max_output_tokens=150)
            assert last(events)["type"] in ("response.completed", "response.incomplete")
            assert any(e["type"] == "response.output_text.delta" for e in events)
            err = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            assert err["error"]["code"] == "websocket_connection_limit_reached"


async def test_disconnect_mid_stream_frees_the_connection() -> None:
    async with live_server(decode_tok_per_s=100.0) as server:
        session, ws = await connect(server)
        async with session:
            await ws.send_str(
                json.dumps({"type": "response.create", "model": "sim", "input": "x", "max_output_tokens": 500})
            )
            while (await receive_event(ws))["type"] != "response.output_text.delta":
                pass
            await ws.close()
        # the server's reader saw the close, cancelled the sampling task and dropped the socket
        from prototype.serve.app import SOCKETS

        for _ in range(100):
            if not server.app[SOCKETS]:
                break
            await asyncio.sleep(0)  # let the server task run its cleanup (no wall-clock wait)
        assert not server.app[SOCKETS]


async def test_store_unavailable_is_a_clear_5xx() -> None:
    class Down(MemoryStore):
        async def get(self, response_id: str) -> bytes | None:
            from prototype.store.base import StoreUnavailable

            raise StoreUnavailable("down")

    async with live_server(store=Down()) as server:
        session, ws = await connect(server)
        async with session, ws:
            err = last(await turn(ws, input="x", previous_response_id="resp_abc"))
            assert err["status"] == 503 and err["error"]["code"] == "store_unavailable"
            assert err["error"]["type"] == "server_error"
    # Nothing keeps the session once it is closed: the outage's error (raised through the
    # response's frames) is a new object each time, not a constant holding its traceback.
    from prototype.serve.session import WebSocketSession

    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, WebSocketSession)]


# -- lanes (`stream_id`) ---------------------------------------------------------------------------


async def read_lanes(ws: aiohttp.ClientWebSocketResponse, n: int) -> dict[str | None, list[dict[str, Any]]]:
    """Read until `n` responses (on any lanes) have ended; events grouped by `stream_id`."""
    by_lane: dict[str | None, list[dict[str, Any]]] = {}
    order: list[str | None] = []
    ended = 0
    while ended < n:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        ev = json.loads(msg.data)
        by_lane.setdefault(ev.get("stream_id"), []).append(ev)
        order.append(ev.get("stream_id"))
        ended += ev["type"] in TERMINAL
    by_lane["__order__"] = order  # type: ignore[assignment]
    return by_lane


async def test_two_lanes_interleave_and_every_event_carries_its_lane() -> None:
    async with live_server(tool_calls=3, decode_tok_per_s=2000) as live:
        session, ws = await connect(live)
        async with session, ws:
            for lane in ("alpha", "beta"):
                await ws.send_str(
                    json.dumps({"type": "response.create", "model": "sim", "input": lane, "stream_id": lane})
                )
            got = await read_lanes(ws, 2)
            order = got.pop("__order__")
            assert set(got) == {"alpha", "beta"}  # nothing without a lane
            for lane, events in got.items():
                assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
                assert all(e["stream_id"] == lane for e in events)
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
            # Concurrent, not one after the other: beta starts before alpha ends.
            alpha_end = len(order) - 1 - order[::-1].index("alpha")
            assert order.index("beta") < alpha_end


async def test_a_fork_onto_a_new_lane_continues_from_the_other_lane(live: Live) -> None:
    session, ws = await connect(live)
    async with session, ws:
        first = await turn(ws, input="hi", store=False, stream_id="main")
        parent = last(first)["response"]["id"]
        assert all(e["stream_id"] == "main" for e in first)
        fork = await turn(ws, input="branch", store=False, stream_id="side", previous_response_id=parent)
        assert last(fork)["type"] == "response.completed" and last(fork)["stream_id"] == "side"
        assert last(fork)["response"]["longrun"]["connection_cache"] == "hit"
        again = await turn(ws, input="go on", store=False, stream_id="main", previous_response_id=parent)
        assert last(again)["response"]["longrun"]["connection_cache"] == "hit"  # the fork kept the parent


async def test_lane_errors_leave_other_lanes_running() -> None:
    async with live_server(tool_calls=3, decode_tok_per_s=500) as live:
        session, ws = await connect(live)
        async with session, ws:
            await ws.send_str(json.dumps({"type": "response.create", "model": "sim", "input": "x", "stream_id": "ok"}))
            await ws.send_str(json.dumps({"type": "response.create", "model": "sim", "input": "x", "stream_id": "a b"}))
            await ws.send_str(
                json.dumps(
                    {
                        "type": "response.create",
                        "model": "sim",
                        "input": "x",
                        "stream_id": "gone",
                        "store": False,
                        "previous_response_id": "resp_unknown",
                    }
                )
            )
            got = await read_lanes(ws, 3)
            got.pop("__order__")
            assert [e["error"]["code"] for e in got[None]] == ["invalid_stream_id"]
            assert [e["type"] for e in got["gone"]] == ["error"]
            assert got["gone"][0]["error"]["code"] == "previous_response_not_found"
            assert got["ok"][-1]["type"] == "response.completed"


def test_compare_with_lanes_runs_a_group_of_rollouts_on_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.runtime.inprocess
    from prototype.serve.session import WebSocketSession
    from sim.harness.experiment import CompareConfig, run_compare
    from sim.runtime.virtual import VirtualClock, run_virtual

    sessions: list[WebSocketSession] = []

    class Counted(WebSocketSession):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            sessions.append(self)

    monkeypatch.setattr(sim.runtime.inprocess, "WebSocketSession", Counted)
    config = CompareConfig.of(
        rollouts=5, tool_calls=2, lanes=3, modes=("ws", "append"), system_prompt_tokens=200, tps=0
    )
    result = run_virtual(run_compare(config, VirtualClock(), virtual=True), charge_cpu=False)
    assert len(sessions) == 4  # per mode: lanes 0-2 on one connection, lanes 0-1 on another
    assert sorted(len(s.conn.lanes) - 1 for s in sessions) == [2, 2, 3, 3]
    assert all(len(r.turns) == 3 for r in result.rollouts) and len(result.rollouts) == 10


def test_lanes_share_the_models_decode_slots() -> None:
    """Multiplexing has its honest cost: with one decode slot, two lanes' turns take turns."""
    from sim.harness.experiment import CompareConfig, run_compare
    from sim.runtime.virtual import VirtualClock, run_virtual

    def p50(decode_slots: int | None) -> float:
        config = CompareConfig.of(
            rollouts=2,
            tool_calls=2,
            lanes=2,
            modes=("ws",),
            system_prompt_tokens=200,
            tps=500,
            decode_slots=decode_slots,
            tool_time_s=0.0,
            profile="local",  # no modeled waits: decode is the time
            model_latency_s=0.0,
            prefill_tok_per_s=0.0,
        )
        result = run_virtual(run_compare(config, VirtualClock(), virtual=True), charge_cpu=False)
        (summary,) = result.summary
        return summary.completion_p50_s

    assert p50(1) > 1.6 * p50(None)  # nearly serial: one lane decodes while the other waits


async def _two_lanes_and_a_bad_frame(compress: bool) -> None:
    async with live_server(decode_tok_per_s=2000.0) as server:
        client, ws = await connect(server, compress=15 if compress else 0)
        async with client, ws:
            for lane in ("a", "b"):
                await ws.send_str(
                    json.dumps({"type": "response.create", "model": "sim", "input": "x", "stream_id": lane})
                )
            await ws.send_str("{not json")
            done, errors = set(), 0
            while len(done) < 2:
                event = await receive_event(ws)
                if event["type"] == "error":
                    errors += 1
                elif event["type"] in TERMINAL:
                    done.add(event["stream_id"])
            assert done == {"a", "b"} and errors == 1


async def test_one_task_writes_a_compressed_connections_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two lanes streaming at once, a bad frame and the core's error for it, on a compressed socket
    (frames are sent one by one): every frame is written by one task (the connection's `Outbox`),
    never by a response's task or the reader, in the order it was put."""
    from prototype.serve import app

    writers: set[asyncio.Task[Any] | None] = set()
    original = app._AiohttpSocket.send_text

    async def send_text(self: Any, message: bytes) -> None:
        writers.add(asyncio.current_task())
        await original(self, message)

    monkeypatch.setattr(app._AiohttpSocket, "send_text", send_text)
    await _two_lanes_and_a_bad_frame(compress=True)
    assert len(writers) == 1 and None not in writers, writers


async def test_an_uncompressed_connections_frames_all_go_through_its_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on an uncompressed socket: every frame, the responses' and the core's, goes into the
    connection's one `BatchedFrames` buffer (written by its flush), none to the socket past it."""
    from prototype.serve import app, session

    buffered, direct = 0, 0
    push = session.BatchedFrames.push

    def pushed(self: Any, message: bytes) -> bool:
        nonlocal buffered
        buffered += 1
        return push(self, message)

    async def send_text(self: Any, message: bytes) -> None:
        nonlocal direct
        direct += 1

    monkeypatch.setattr(session.BatchedFrames, "push", pushed)
    monkeypatch.setattr(app._AiohttpSocket, "send_text", send_text)
    await _two_lanes_and_a_bad_frame(compress=False)
    assert buffered > 2 and direct == 0
