"""The recorder's bookkeeping without sockets (sim/record/capture.py): conversations, turns, modes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prototype.wire.sse import SSEDecoder
from sim.analysis.records import read_records
from sim.record.capture import Capture, Pending, SSEData

USAGE = b'{"input_tokens":10,"input_tokens_details":{"cached_tokens":0},"output_tokens":3}'


def _request(items: list[object], previous: str | None = None) -> bytes:
    body: dict[str, object] = {"model": "m", "input": items, "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return json.dumps(body).encode()


def _complete(c: Capture, p: Pending, rid: str, at: float) -> dict[str, object]:
    assert not p.event(b'{"type":"response.created","response":{"id":"%s"}}' % rid.encode(), at)
    assert not p.event(b'{"type":"response.output_text.delta","delta":"x"}', at + 0.1)
    done = b'{"type":"response.completed","response":{"id":"%s","usage":%s}}' % (rid.encode(), USAGE)
    assert p.event(done, at + 0.2)
    line: dict[str, object] = json.loads(c.finish(p))
    return line


def test_interleaved_conversations_are_told_apart_by_the_history_they_resend() -> None:
    c = Capture()
    a0, b0 = {"role": "user", "content": "task A"}, {"role": "user", "content": "task B"}
    a = _complete(c, c.begin("http", _request([a0]), 0.0), "resp_a0", 0.0)
    b = _complete(c, c.begin("http", _request([b0]), 1.0), "resp_b0", 1.0)
    a1 = _complete(c, c.begin("http", _request([a0, {"type": "x"}]), 2.0), "resp_a1", 2.0)
    b1 = _complete(c, c.begin("http", _request([b0, {"type": "y"}]), 3.0), "resp_b1", 3.0)
    assert (a["conversation"], a1["conversation"]) == ("conv-0", "conv-0")
    assert (b["conversation"], b1["conversation"]) == ("conv-1", "conv-1")
    assert [x["turn"] for x in (a, b, a1, b1)] == [0, 0, 1, 1]
    assert a["first_token_at"] == 0.1 and a["done_at"] == 0.2 and a["usage"]["output_tokens"] == 3  # type: ignore[index]


def test_a_retry_after_a_failed_request_takes_its_turn() -> None:
    c = Capture()
    first = _complete(c, c.begin("http", _request(["hi"]), 0.0), "resp_0", 0.0)
    failed = c.begin("http", _request(["hi"], previous="resp_0"), 1.0)
    assert failed.event(b'{"type":"error","error":{"type":"server_error","code":null,"message":"x"}}', 1.5)
    line = json.loads(c.finish(failed))
    assert line["failed"] == "error event" and line["turn"] == 1 and line["mode"] == "http_prev"
    assert "usage" not in line
    retry = _complete(c, c.begin("http", _request(["hi"], previous="resp_0"), 2.0), "resp_1", 2.0)
    assert retry["turn"] == 1 and retry["conversation"] == first["conversation"] == "conv-0"


def test_the_same_first_message_again_is_a_new_conversation_and_websockets_follow_the_response_chain() -> None:
    c = Capture()
    create = b'{"type":"response.create","model":"m","input":"go"}'
    w0 = _complete(c, c.begin("ws", create, 0.0), "resp_w0", 0.0)
    again = _complete(c, c.begin("ws", create, 1.0), "resp_w1", 1.0)
    follow = b'{"type":"response.create","model":"m","input":[],"previous_response_id":"resp_w0"}'
    w1 = _complete(c, c.begin("ws", follow, 2.0), "resp_w2", 2.0)
    assert (w0["conversation"], again["conversation"], w1["conversation"]) == ("conv-0", "conv-1", "conv-0")
    assert w1["mode"] == "ws" and w1["turn"] == 1 and w1["previous_response_id"] == "resp_w0"


def test_a_warm_up_is_no_turn_but_its_response_is_continued(tmp_path: Path) -> None:
    """Codex opens its WebSocket with `generate: false` (a prefill, no model turn): the line is
    marked `warmup`, the task's first request that continues it is turn 0 of its conversation,
    no workload line is written for it, and calibration reads the capture without it."""
    c = Capture()
    written: list[int] = []  # the workload lines' turns, as the recorder writes them

    def begin(frame: bytes, at: float) -> Pending:
        p = c.begin("ws", frame, at)
        line = c.workload.began(p.conversation, at)  # what Recorder.begin does
        written.extend([json.loads(line)["turn"]] if line is not None else [])
        return p

    warm = b'{"type":"response.create","model":"m","input":[],"instructions":"be brief","generate":false}'
    w = _complete(c, begin(warm, 0.0), "resp_warm", 0.0)
    assert w["warmup"] is True and w["turn"] == 0
    first = b'{"type":"response.create","model":"m","input":"go","previous_response_id":"resp_warm"}'
    t0 = _complete(c, begin(first, 1.0), "resp_t0", 1.0)
    assert written == []  # the warm-up left no turn waiting for its tool time
    follow = b'{"type":"response.create","model":"m","input":[],"previous_response_id":"resp_t0"}'
    t1 = _complete(c, begin(follow, 2.0), "resp_t1", 2.0)
    assert (t0["conversation"], t0["turn"], "warmup" in t0) == (w["conversation"], 0, False)
    assert (t1["conversation"], t1["turn"]) == (w["conversation"], 1)
    assert written == [0] and [json.loads(x)["turn"] for x in c.workload.close().splitlines()] == [1]
    summary = c.summary()
    assert summary["warmups"] == 1 and summary["completed_by_mode"] == {"ws": 2}
    sessions: Any = summary["sessions"]
    assert sessions[w["conversation"]]["turns"] == 2 and sessions[w["conversation"]]["failed"] == 0
    assert sessions[w["conversation"]]["input_tokens"]["first"] == 10
    capture = tmp_path / "capture.jsonl"
    capture.write_text("".join(json.dumps(x) + "\n" for x in (w, t0, t1)))
    assert [(r.mode, r.turn) for r in read_records([capture])] == [("ws", 0), ("ws", 1)]
    # Negative control: the same lines without the mark read the warm-up as a turn.
    capture.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "warmup"}) + "\n" for x in (w, t0, t1)))
    assert len(read_records([capture])) == 3


def test_the_sse_scan_reads_each_events_data_however_the_bytes_are_cut() -> None:
    """`SSEData` against the full SSE parser (prototype/wire/sse.py) on a stream of one-line data
    events: LF and CRLF line ends, a comment, `data:` with and without its space, `[DONE]`."""
    stream = (
        b": keep-alive\n\n"
        b'event: response.created\r\ndata: {"type":"response.created","sequence_number":0}\r\n\r\n'
        b'id: 7\ndata:{"type":"response.output_text.delta","delta":"data: x"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","sequence_number":2}\n\n'
        b"data: [DONE]\n\n"
    )
    expected = [e.data.encode() for e in SSEDecoder().feed(stream) if e.data != "[DONE]"]
    assert len(expected) == 3
    for cut in range(1, len(stream)):
        scan = SSEData()
        assert scan.feed(stream[:cut]) + scan.feed(stream[cut:]) == expected, cut
    scan = SSEData()
    assert [line for i in range(len(stream)) for line in scan.feed(stream[i : i + 1])] == expected
    # Negative control: a line that only contains `data:` is not a data line.
    assert SSEData().feed(b'event: x\nxdata: {"a":1}\n : data: {"b":2}\n') == []
