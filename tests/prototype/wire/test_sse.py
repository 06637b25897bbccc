"""Tests for `prototype.wire.sse`: exact frame bytes, the WHATWG parsing rules, and chunking invariance."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prototype.wire.sse import DONE_FRAME, SSE_HEADERS, ServerSentEvent, SSEDecoder, encode_event


def decode_all(chunks: Iterable[bytes]) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return events


def decode(stream: bytes) -> list[ServerSentEvent]:
    return decode_all([stream])


def split_at(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(stream)]
    return [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --------------------------------------------------------------------------- encoder


@pytest.mark.parametrize(
    ("data", "event", "expected"),
    [
        (b"hello", None, b"data: hello\n\n"),
        (b"", None, b"data: \n\n"),
        (b"[DONE]", None, b"data: [DONE]\n\n"),
        (b'{"a":1}', "response.created", b'event: response.created\ndata: {"a":1}\n\n'),
        (b"a\nb", None, b"data: a\ndata: b\n\n"),
        (b"a\r\nb", None, b"data: a\ndata: b\n\n"),
        (b"a\rb", None, b"data: a\ndata: b\n\n"),
        (b"a\r\n\r\nb", None, b"data: a\ndata: \ndata: b\n\n"),
        (b"a\n\rb", None, b"data: a\ndata: \ndata: b\n\n"),
        (b"a\n", None, b"data: a\ndata: \n\n"),
        (b"\n", None, b"data: \ndata: \n\n"),
        (b" lead", None, b"data:  lead\n\n"),
        (b": not a comment", None, b"data: : not a comment\n\n"),
        (b"x", "", b"event: \ndata: x\n\n"),
        ("é".encode(), "ünï", "event: ünï\ndata: é\n\n".encode()),
        (b"\xff\xfe", None, b"data: \xff\xfe\n\n"),  # bytes pass through untouched
    ],
)
def test_encode_exact_bytes(data: bytes, event: str | None, expected: bytes) -> None:
    assert encode_event(data, event=event) == expected


def test_done_frame_is_an_encoded_event() -> None:
    assert encode_event(b"[DONE]") == DONE_FRAME
    assert decode(DONE_FRAME) == [ServerSentEvent(data="[DONE]")]


def test_headers() -> None:
    assert SSE_HEADERS == {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    }


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\r\nb", "\n", "trailing\r", "\nleading"])
def test_event_name_with_newline_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        encode_event(b"x", event=name)


# --------------------------------------------------------------------------- decoder: parsing rules


def ev(data: str, event: str = "message", id: str | None = None, retry: int | None = None) -> ServerSentEvent:
    return ServerSentEvent(event=event, data=data, id=id, retry=retry)


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        # line terminators
        (b"data: a\n\n", [ev("a")]),
        (b"data: a\r\n\r\n", [ev("a")]),
        (b"data: a\r\r", [ev("a")]),
        (b"data: a\r\n\r", [ev("a")]),
        (b"data: a\n\r\n", [ev("a")]),
        (b"data: a\ndata: b\n\n", [ev("a\nb")]),
        (b"data: a\r\ndata: b\r\n\r\n", [ev("a\nb")]),
        (b"data: a\rdata: b\r\r", [ev("a\nb")]),
        (b"data: a\rdata: b\ndata: c\r\n\n", [ev("a\nb\nc")]),
        (b"data\n\n", [ev("")]),
        (b"data:\n\n", [ev("")]),
        (b"data: \n\n", [ev("")]),
        (b"data\ndata\n\n", [ev("\n")]),
        (b"data: a\ndata:\n\n", [ev("a\n")]),
        # exactly one leading space is removed, and only one colon splits
        (b"data:a\n\n", [ev("a")]),
        (b"data:  a\n\n", [ev(" a")]),
        (b"data:\ta\n\n", [ev("\ta")]),
        (b"data: a: b:c\n\n", [ev("a: b:c")]),
        (b"data: a \n\n", [ev("a ")]),
        # field names are case-sensitive; unknown fields and fields with leading space are ignored
        (b"Data: a\n\n", []),
        (b" data: a\n\n", []),
        (b"foo: bar\ndata: a\n\n", [ev("a")]),
        # event types
        (b"event: delta\ndata: a\n\n", [ev("a", event="delta")]),
        (b"event:delta\ndata: a\n\n", [ev("a", event="delta")]),
        (b"event\ndata: a\n\n", [ev("a")]),
        (b"event: \ndata: a\n\n", [ev("a")]),
        (b"event: x\nevent: y\ndata: a\n\n", [ev("a", event="y")]),
        (b"event: x\n\ndata: a\n\n", [ev("a")]),  # the type does not leak into the next block
        (b"event: x\ndata: a\n\ndata: b\n\n", [ev("a", event="x"), ev("b")]),
        # comments
        (b": keep-alive\n\n", []),
        (b":\n\n", []),
        (b": c\ndata: a\n: c\ndata: b\n\n", [ev("a\nb")]),
        (b":data: a\n\n", []),
        # empty data buffer: nothing is dispatched
        (b"\n\n\n", []),
        (b"event: x\n\n", []),
        (b"event: x\n\ndata: a\n\n", [ev("a")]),
        # blank-line runs between events
        (b"data: a\n\n\n\ndata: b\n\n", [ev("a"), ev("b")]),
        # invalid UTF-8 is replaced, per line
        (b"data: \xff\n\n", [ev("\ufffd")]),
        (b"data: \xe6\x97\n\n", [ev("\ufffd")]),
        (b"data: \xe6\x97\ndata: \x9f\n\n", [ev("\ufffd\n\ufffd")]),
    ],
)
def test_decode_rules(stream: bytes, expected: list[ServerSentEvent]) -> None:
    assert decode(stream) == expected
    assert decode_all(bytes([b]) for b in stream) == expected


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (b"\xef\xbb\xbfdata: a\n\n", [ev("a")]),
        (b"\xef\xbb\xbf\n", []),
        (b"\xef\xbb\xbf\ndata: a\n\n", [ev("a")]),
        (b"\xef\xbb\xbf:comment\ndata: a\n\n", [ev("a")]),
        # only ONE leading BOM is stripped: a second one makes the field name "\ufeffdata"
        (b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\n", []),
        # a BOM that is not at the start of the stream is not stripped
        (b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [ev("a")]),
        (b"data: \xef\xbb\xbfa\n\n", [ev("\ufeffa")]),
        # a truncated BOM is just invalid UTF-8 in a field name
        (b"\xef\xbbdata: a\n\n", []),
    ],
)
def test_bom(stream: bytes, expected: list[ServerSentEvent]) -> None:
    assert decode(stream) == expected
    assert decode_all(bytes([b]) for b in stream) == expected


def test_id_persists_until_changed_and_nul_is_ignored() -> None:
    stream = (
        b"data: a\n\n"  # no id yet
        b"id: 1\ndata: b\n\n"
        b"data: c\n\n"  # id persists
        b"id: 2\x00x\ndata: d\n\n"  # contains NUL: ignored, id stays "1"
        b"id:3\ndata: e\n\n"
        b"id\ndata: f\n\n"  # empty value resets to the empty string
        b"id:  4 \ndata: g\n\n"  # one leading space removed only
    )
    assert decode(stream) == [
        ev("a"),
        ev("b", id="1"),
        ev("c", id="1"),
        ev("d", id="1"),
        ev("e", id="3"),
        ev("f", id=""),
        ev("g", id=" 4 "),
    ]


def test_id_only_block_sets_last_event_id_without_dispatch() -> None:
    decoder = SSEDecoder()
    assert decoder.last_event_id is None
    assert decoder.feed(b"id: 7\n") == []
    assert decoder.last_event_id is None  # the buffer only becomes the ID at the blank line
    assert decoder.feed(b"\n") == []
    assert decoder.last_event_id == "7"
    assert decoder.feed(b"data: x\n\n") == [ev("x", id="7")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"0", 0),
        (b"1500", 1500),
        (b"007", 7),
        (b"99999999999999999999", 99999999999999999999),
        (b"", None),
        (b"-1", None),
        (b"+1", None),
        (b"1.5", None),
        (b"1 ", None),
        (b" 1", 1),  # the one leading space after the colon is not part of the value
        (b"  1", None),
        (b"1e3", None),
        ("١٢".encode(), None),  # Arabic-Indic digits are digits, but not ASCII digits
        ("²".encode(), None),
    ],
)
def test_retry_only_if_all_ascii_digits(value: bytes, expected: int | None) -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"retry:" + value + b"\ndata: x\n\n")
    assert events == [ev("x", retry=expected)]
    assert decoder.reconnection_time == expected


def test_retry_scope() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(
        b"retry: 100\ndata: a\n\n"
        b"data: b\n\n"  # retry is per block on the event...
        b"retry: 200\n\n"  # ...a retry-only block dispatches nothing...
        b"retry: 300\nretry: x\ndata: c\n\n"  # ...an invalid value leaves the previous one
    )
    assert events == [ev("a", retry=100), ev("b"), ev("c", retry=300)]
    assert decoder.reconnection_time == 300  # ...but the stream-wide value is always kept


# --------------------------------------------------------------------------- decoder: chunking


def test_cr_lf_split_across_chunks_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\ndata: b\r") == []  # the LF pairs with the CR: no blank line
    assert decoder.feed(b"\n\r") == [ev("a\nb")]  # "\r" alone is a blank line: dispatch at once
    assert decoder.feed(b"\n") == []  # ...and this LF is the rest of that CRLF, not another blank line
    assert decoder.feed(b"data: c\r") == []
    assert decoder.feed(b"") == []  # an empty chunk does not lose the pending CR
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r\n") == [ev("c")]
    assert decoder.close() == []


def test_lone_cr_at_chunk_end_then_other_byte() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"data: b\r") == []
    assert decoder.feed(b"\r") == [ev("a\nb")]


def test_cr_cr_lf_split_every_way() -> None:
    # "\r" ends line "data: a", then "\r\n" is a blank line: exactly one event, whatever the chunking
    stream = b"data: a\r\r\ndata: b\r\n\r\n"
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            assert decode_all(split_at(stream, [i, j])) == [ev("a"), ev("b")]


@pytest.mark.parametrize("text", ["é", "日本語", "🙂", "a🙂b", "ÿ\u0800\U0010ffff"])
def test_multibyte_utf8_split_across_chunks(text: str) -> None:
    stream = f"event: {text}\ndata: {text}\n\n".encode()
    expected = [ev(text, event=text)]
    for i in range(len(stream) + 1):
        assert decode_all(split_at(stream, [i])) == expected
    assert decode_all(bytes([b]) for b in stream) == expected


def test_incomplete_trailing_event_discarded_at_close() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: b\n") == [ev("a")]
    assert decoder.close() == []  # "b" had no blank line


@pytest.mark.parametrize("tail", [b"data: b", b"data: b\n", b"data: b\r\n", b"event: x\ndata: b\n", b"data"])
def test_unterminated_tail_never_dispatched(tail: bytes) -> None:
    assert decode(b"data: a\n\n" + tail) == [ev("a")]


def test_trailing_cr_dispatches_without_waiting_for_close() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\r") == [ev("a")]
    assert decoder.close() == []


def test_close_is_idempotent_and_feed_after_close_raises() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: a\n")
    assert decoder.close() == []
    assert decoder.close() == []
    with pytest.raises(ValueError, match="closed"):
        decoder.feed(b"\n")


# --------------------------------------------------------------------------- a Responses-like stream


def _responses_stream() -> list[tuple[str, dict[str, Any]]]:
    """~30 events shaped like a streamed OpenAI Responses API reply."""
    resp: dict[str, Any] = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    msg: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    deltas = [
        "Hé",
        "llo",
        ", wö",
        "rld",
        "! 日本",
        "語 ",
        "🙂",
        " line1\nline2",
        "\r\n",
        " tab\t",
        'q"uote',
        "\\",
        ".",
    ]
    text = "".join(deltas)
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": resp}),
        ("response.in_progress", {"response": resp}),
        ("response.output_item.added", {"output_index": 0, "item": msg}),
        ("response.content_part.added", {"item_id": "msg_1", "part": {"type": "output_text", "text": ""}}),
    ]
    events += [("response.output_text.delta", {"item_id": "msg_1", "delta": d}) for d in deltas]
    events += [
        ("response.output_text.done", {"item_id": "msg_1", "text": text}),
        ("response.content_part.done", {"item_id": "msg_1", "part": {"type": "output_text", "text": text}}),
        ("response.output_item.done", {"output_index": 1, "item": {**msg, "status": "completed"}}),
        ("response.output_item.added", {"output_index": 1, "item": {"type": "function_call", "id": "fc_1"}}),
    ]
    events += [
        ("response.function_call_arguments.delta", {"item_id": "fc_1", "delta": d})
        for d in ['{"city"', ': "Zü', 'rich"', "}"]
    ]
    events += [
        ("response.function_call_arguments.done", {"item_id": "fc_1", "arguments": '{"city": "Zürich"}'}),
        ("response.output_item.done", {"output_index": 1, "item": {"type": "function_call", "id": "fc_1"}}),
        ("response.completed", {"response": {**resp, "status": "completed", "usage": {"total_tokens": 42}}}),
    ]
    return events


def _encode_stream(events: list[tuple[str, dict[str, Any]]]) -> tuple[bytes, list[ServerSentEvent]]:
    """Encode as a server would (with a keep-alive comment and a pretty-printed, multi-line event),
    returning the bytes and the events a client must decode from them."""
    frames: list[bytes] = []
    expected: list[ServerSentEvent] = []
    for n, (name, payload) in enumerate(events):
        payload = {"type": name, "sequence_number": n, **payload}
        # one event pretty-printed, so its data spans many `data:` lines
        text = json.dumps(payload, ensure_ascii=False, indent=2 if n == 3 else None)
        frames.append(encode_event(text.encode(), event=name))
        expected.append(ev(text, event=name))
        if n == 10:
            frames.append(b": keep-alive\n\n")
    frames.append(DONE_FRAME)
    expected.append(ev("[DONE]"))
    return b"".join(frames), expected


STREAM, EXPECTED = _encode_stream(_responses_stream())
# The same stream with each of the three line terminators (raw CR/LF only ever occur as terminators:
# JSON escapes them inside strings, and the pretty-printed event's newlines became `data:` lines).
STREAMS = {
    "LF": STREAM,
    "CRLF": STREAM.replace(b"\n", b"\r\n"),
    "CR": STREAM.replace(b"\n", b"\r"),
    "BOM+CRLF": b"\xef\xbb\xbf" + STREAM.replace(b"\n", b"\r\n"),
}


def test_responses_stream_shape() -> None:
    assert 28 <= len(EXPECTED) <= 35
    assert sum(e.data.count("\n") for e in EXPECTED) > 5  # the multi-line event is really multi-line
    assert STREAM.count(b"\n\n") == len(EXPECTED) + 1  # one frame per event, plus the comment
    assert [json.loads(e.data)["sequence_number"] for e in EXPECTED[:-1]] == list(range(len(EXPECTED) - 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STREAMS))
def test_responses_stream_split_at_every_byte_offset(kind: str) -> None:
    stream = STREAMS[kind]
    assert decode(stream) == EXPECTED
    for i in range(len(stream) + 1):
        assert decode_all(split_at(stream, [i])) == EXPECTED, f"split at byte {i}"


@pytest.mark.parametrize("kind", list(STREAMS))
def test_responses_stream_byte_by_byte(kind: str) -> None:
    stream = STREAMS[kind]
    decoder = SSEDecoder()
    got: list[ServerSentEvent] = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == EXPECTED
    assert decoder.close() == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STREAMS))
def test_responses_stream_events_arrive_as_soon_as_complete(kind: str) -> None:
    """Each event is returned by the very feed() that delivers its terminating blank line."""
    stream = STREAMS[kind]
    decoder = SSEDecoder()
    seen = 0
    for i in range(len(stream)):
        seen += len(decoder.feed(stream[i : i + 1]))
        assert seen == len(decode(stream[: i + 1]))
    assert seen == len(EXPECTED)


@given(data=st.data())
def test_responses_stream_random_chunks(data: st.DataObject) -> None:
    stream = data.draw(st.sampled_from(sorted(STREAMS.values())))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    assert decode_all(split_at(stream, cuts)) == EXPECTED


# --------------------------------------------------------------------------- round-trip properties

_names = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12)
# payload text rich in line terminators (including CRLF pairs), colons, spaces, NUL and BOM
_payloads = st.lists(
    st.one_of(
        st.sampled_from(["\r", "\n", "\r\n", ":", " ", "\x00", "\ufeff"]),
        st.characters(codec="utf-8"),
    ),
    max_size=40,
).map("".join)


@given(
    events=st.lists(st.tuples(st.one_of(st.none(), _names), _payloads), max_size=8),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_round_trip_random_events_random_chunks(events: list[tuple[str | None, str]], cuts: list[int]) -> None:
    stream = b"".join(encode_event(data.encode(), event=name) for name, data in events)
    expected = [ev(data.replace("\r\n", "\n").replace("\r", "\n"), event=name or "message") for name, data in events]
    assert decode_all(split_at(stream, [c % (len(stream) + 1) for c in cuts])) == expected


@given(stream=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_arbitrary_bytes_chunking_invariant(stream: bytes, cuts: list[int]) -> None:
    """Whatever the input (garbage included), the chunking never changes the result."""
    whole = decode(stream)
    assert decode_all(split_at(stream, [c % (len(stream) + 1) for c in cuts])) == whole
    assert decode_all(bytes([b]) for b in stream) == whole
