"""The user's rollouts the recorder writes (sim/record/workload.py): a turn's line when its
conversation's next request begins, the last turns at shutdown, sizes from `usage`, no content;
and through the real proxy in front of longrun's server, a workload `compare --trace` replays,
whole lines left by a recorder killed mid-run, and content only with `--keep-content`."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from openai import AsyncOpenAI

from sim.analysis.records import read_records, records_from_rollouts
from sim.harness.experiment import CompareConfig, compare
from sim.record.capture import Capture, Pending
from sim.record.proxy import Recorder, make_recorder_app
from sim.rollout.replay import REPLAY_PROMPT_TOKENS, load_trace
from tests.processes import free_port
from tests.recording import http_flow, http_prev_flow, recording, ws_flow
from tests.support import RECEIVE_TIMEOUT_S, REPO, live_server


def _usage(inp: int, cached: int, out: int) -> bytes:
    return b'{"input_tokens":%d,"input_tokens_details":{"cached_tokens":%d},"output_tokens":%d}' % (inp, cached, out)


def _turn(c: Capture, p: Pending, rid: str, at: float, usage: bytes) -> None:
    assert not p.event(b'{"type":"response.output_text.delta","delta":"x"}', at + 0.1)
    assert p.event(b'{"type":"response.completed","response":{"id":"%s","usage":%s}}' % (rid.encode(), usage), at + 0.5)
    c.finish(p)


def _request(items: list[object], previous: str | None = None) -> bytes:
    body: dict[str, object] = {"model": "m", "input": items, "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return json.dumps(body).encode()


def test_a_turns_line_is_due_when_its_conversations_next_request_begins() -> None:
    c = Capture()
    w = c.workload
    a0, b0 = {"role": "user", "content": "task A"}, {"role": "user", "content": "task B"}
    p = c.begin("http", _request([a0]), 0.0)
    assert w.began(p.conversation, 0.0) is None  # a first request closes no turn
    _turn(c, p, "ra0", 0.0, _usage(100, 0, 20))
    q = c.begin("ws", b'{"type":"response.create","input":[%s]}' % json.dumps(b0).encode(), 1.0)
    assert w.began(q.conversation, 1.0) is None
    _turn(c, q, "rb0", 1.0, _usage(50, 0, 5))
    p1 = c.begin("http", _request([a0, {"type": "function_call_output", "output": "ok"}]), 3.0)
    line = w.began(p1.conversation, 3.0)
    assert line is not None and line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {
        "rollout": "conv-0",
        "turn": 0,
        "mode": "http",
        "input_tokens": 100,
        "cached_tokens": 0,
        "output_tokens": 20,
        "tool_call": True,
        "tool_time_s": 2.5,  # from the response's end (0.5) to the next request (3.0)
    }
    _turn(c, p1, "ra1", 3.0, _usage(140, 100, 10))
    last = [json.loads(x) for x in w.close().splitlines()]
    assert [(x["rollout"], x["turn"], x["tool_call"], "tool_time_s" in x) for x in last] == [
        ("conv-1", 0, False, False),
        ("conv-0", 1, False, False),
    ]
    assert last[1]["cached_tokens"] == 100 and w.close() == b""


def test_a_failed_request_writes_no_turn_and_its_retry_keeps_the_tool_time_to_the_first_attempt() -> None:
    c = Capture()
    p = c.begin("http", _request(["hi"]), 0.0)
    c.workload.began(p.conversation, 0.0)
    _turn(c, p, "r0", 0.0, _usage(10, 0, 3))
    failed = c.begin("http", _request(["hi"], previous="r0"), 2.0)
    line = c.workload.began(failed.conversation, 2.0)
    assert line is not None and json.loads(line)["tool_time_s"] == 1.5
    failed.fail("http 500", 2.1)
    c.finish(failed)
    retry = c.begin("http", _request(["hi"], previous="r0"), 3.0)
    assert c.workload.began(retry.conversation, 3.0) is None
    _turn(c, retry, "r1", 3.0, _usage(20, 10, 4))
    [answer] = [json.loads(x) for x in c.workload.close().splitlines()]
    assert answer["turn"] == 1 and answer["mode"] == "http_prev" and answer["input_tokens"] == 20


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _flows(base: str, conversations: int) -> None:
    async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
        for k in range(conversations):
            await http_flow(c, f"Conversation {k}: list the files.")
            await ws_flow(c, f"Conversation {k}: read the logs.")
            await http_prev_flow(c, f"Conversation {k}: fix the test.")


async def test_the_recorded_workload_is_the_captures_turns_and_compare_replays_it(tmp_path: Path) -> None:
    async with live_server(tool_calls=3, seed=5) as live:
        async with recording(f"http://127.0.0.1:{live.port}", tmp_path) as (base, _):
            await _flows(base, 2)
    capture = {(x["conversation"], x["turn"]): x for x in _jsonl(tmp_path / "capture.jsonl")}
    workload = _jsonl(tmp_path / "workload.jsonl")
    assert sorted((x["rollout"], x["turn"]) for x in workload) == sorted(capture)
    for line in workload:
        cap = capture[(line["rollout"], line["turn"])]
        assert line["mode"] == cap["mode"] and line["input_tokens"] == cap["usage"]["input_tokens"]
        assert line["output_tokens"] == cap["usage"]["output_tokens"]
        nxt = capture.get((line["rollout"], line["turn"] + 1))
        assert line["tool_call"] is (nxt is not None)
        if nxt is not None:
            assert line["tool_time_s"] == pytest.approx(nxt["sent_at"] - cap["done_at"], abs=1e-5)
    text = (tmp_path / "workload.jsonl").read_text()
    assert "List the files" not in text and "sk-test" not in text  # no content unless asked
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workload_turns"] == len(workload) == 24
    # Long-session signals beside the timing: every conversation's growth; a socket's silences.
    sessions = summary["sessions"]
    assert len(sessions) == 6
    for name, s in sessions.items():
        assert s["turns"] == 4 and s["input_tokens"]["last"] > s["input_tokens"]["first"]
        lines = [x for x in capture.values() if x["conversation"] == name]
        if s["modes"] == ["ws"]:
            assert s["reconnects"] == [] and len({x["connection"] for x in lines}) == 1
            gaps = [x["tool_time_s"] for x in workload if x["rollout"] == name and x["tool_call"]]
            assert s["longest_socket_silence_s"] == pytest.approx(max(gaps), abs=1e-5)
        else:
            assert "reconnects" not in s and all("connection" not in x for x in lines)
    # The workload replays: the same turns per rollout, each prompt's growth over the first within
    # 2 % of the recorded one (and 5 tokens a turn: the replay's items are framed a little unlike this
    # client's); a first prompt shorter than the replay's own frame replays at that floor.
    rollouts = load_trace(tmp_path / "workload.jsonl")
    assert sorted(len(r.turns) for r in rollouts) == [4] * 6
    config = CompareConfig.of(trace=str(tmp_path / "workload.jsonl"), modes=("http",), profile="local")
    result = compare(config, virtual=True, free_cpu=True)
    names = [r.name for r in rollouts]
    turns = records_from_rollouts(result.rollouts, source="replay")
    replayed = {(names[int(r.rollout)], r.turn): r.prompt_tokens for r in turns}
    assert sorted(replayed) == sorted(capture)
    for (name, turn), tokens in replayed.items():
        recorded, first = (capture[(name, k)]["usage"]["input_tokens"] for k in (turn, 0))
        assert replayed[(name, 0)] == pytest.approx(max(first, REPLAY_PROMPT_TOKENS), abs=3)
        assert tokens - replayed[(name, 0)] == pytest.approx(recorded - first, rel=0.02, abs=5 * turn)
    assert len(read_records([tmp_path / "capture.jsonl"])) == 24


async def _line(stream: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(stream.readline(), RECEIVE_TIMEOUT_S)


async def test_a_killed_recorder_leaves_the_turns_it_closed_each_line_whole(tmp_path: Path) -> None:
    port = free_port()
    async with live_server(tool_calls=3, seed=5) as live:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sim",
            "record",
            "--upstream",
            f"http://127.0.0.1:{live.port}",
            "--listen",
            f"127.0.0.1:{port}",
            "--out",
            str(tmp_path),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            assert b"recording" in await _line(proc.stdout)
            await _flows(f"http://127.0.0.1:{port}/v1", 2)
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
    assert not (tmp_path / "summary.json").exists()  # no shutdown ran
    raw = (tmp_path / "workload.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    workload = [json.loads(line) for line in raw.splitlines()]
    # Every turn with a next request was written as it came; the rollouts' answers wait for shutdown.
    assert len(workload) == 18 and all(x["tool_call"] for x in workload)
    assert len(_jsonl(tmp_path / "capture.jsonl")) == 24


async def test_keep_content_writes_the_task_turns_and_tool_outputs_and_the_replay_sends_them(tmp_path: Path) -> None:
    recorder = Recorder("", tmp_path, keep_content=True)
    async with live_server(tool_calls=2, seed=5) as live:
        recorder.upstream = f"http://127.0.0.1:{live.port}"
        runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10) as c:
                await http_flow(c, "Conversation A: list the files.")
                await ws_flow(c, "Conversation B: read the logs.")
        finally:
            await runner.cleanup()
    workload = _jsonl(tmp_path / "workload.jsonl")
    by = {(x["rollout"], x["turn"]): x for x in workload}
    assert by[("conv-0", 0)]["task"] == "Conversation A: list the files."
    assert by[("conv-1", 0)]["task"] == "Conversation B: read the logs."
    for (_, turn), line in by.items():
        assert ("task" in line) is (turn == 0)
        if line["tool_call"]:
            assert line["assistant"]["tool_call"]["name"] == "run" and line["tool_output"] == "ok"
        else:
            assert set(line["assistant"]) == {"text"} and "tool_output" not in line
    assert "sk-test" not in (tmp_path / "workload.jsonl").read_text()
    # The replay sends the recorded turns themselves.
    rollouts = load_trace(tmp_path / "workload.jsonl")
    assert [r.task for r in rollouts] == ["Conversation A: list the files.", "Conversation B: read the logs."]
    config = CompareConfig.of(trace=str(tmp_path / "workload.jsonl"), modes=("http",), profile="local")
    for result in compare(config, virtual=True, free_cpu=True).rollouts:
        recorded = rollouts[result.index].turns
        assert len(result.turns) == len(recorded) == 3
        for planned, turn in zip(recorded, result.turns, strict=True):
            item = turn.output_items[0]
            text = item["arguments"] if planned[0].kind == "function_call" else item["content"][0]["text"]
            assert text == planned[0].text
