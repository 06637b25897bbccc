"""What the recorder writes: one capture line per request, in docs/calibration.md's proxy format.

Sans-IO: the proxy (sim/record/proxy.py) hands this module the request's bytes and each server
event's bytes with the time it saw them on its own monotonic clock; this module peeks at the few
fields it needs (never decoding a whole event) and builds the line `sim.analysis.records` reads.

A request's conversation: the conversation of the response its `previous_response_id` names;
else, the conversation whose last request's input (instructions and items, compared as the
client's own bytes) is a prefix of this request's input (a client resending the whole history);
else a new one. Its `turn` is the number of that conversation's completed lines before it, so a
retry after a failed request takes the failed request's turn. A warm-up (`generate: false`: a
prefill with no model turn, as Codex opens its WebSocket) is a line marked `warmup` that names
its response for the requests that continue it but is no turn of its conversation. Its mode is what the proxy saw:
`ws` on a WebSocket, `http_prev` over HTTP with a `previous_response_id`, `http` otherwise (the
reader relabels an `http` conversation that later continues by `previous_response_id`).
"""

from __future__ import annotations

import hashlib
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from msgspec import Raw

from prototype.wire.requests import NULL, is_null
from sim.record.signals import session_signals
from sim.record.workload import Turn, Workload, assistant_of, task_of, tool_output_of, usage_counts

__all__ = ["Capture", "Pending", "SSEData", "TOKEN_DELTA_TYPES", "TERMINAL_TYPES", "latency_summary"]

# The token-carrying deltas (prototype/serve/session.py's TOKEN_DELTAS, by their wire names, and
# the other deltas of the API that carry model tokens).
TOKEN_DELTA_TYPES: Final = frozenset(
    {
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.refusal.delta",
    }
)
# The events that end a response; `response.done` is the append dialect's pause.
TERMINAL_TYPES: Final = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.done", "error"}
)


class _RequestPeek(msgspec.Struct):
    """The fields of a create (an HTTP body or a `response.create` frame) the recorder reads."""

    type: str | None = None
    stream_id: str | None = None
    previous_response_id: str | None = None
    instructions: Raw = NULL
    input: Raw = NULL
    stream: bool | None = None
    generate: Any = None  # `false`: a warm-up (no model turn)
    store: Any = None  # any type: a bad value (the upstream's to refuse) must not lose the rest of the peek


class _ResponsePeek(msgspec.Struct):
    id: str | None = None
    status: str | None = None
    usage: Raw = NULL
    output: Raw = NULL


class _EventPeek(msgspec.Struct):
    """The fields of a server event (or of a whole non-streamed Response) the recorder reads."""

    type: str | None = None
    stream_id: str | None = None
    sequence_number: int | None = None
    response: _ResponsePeek | None = None
    # A whole Response body (HTTP without `stream`): its own id, status and usage.
    id: str | None = None
    status: str | None = None
    usage: Raw = NULL
    output: Raw = NULL


_DATA_LINE: Final = re.compile(rb"^data: ?([^\r\n]*)", re.MULTILINE)


class SSEData:
    """The `data:` lines of an SSE stream as its bytes arrive, each an event's JSON: the API sends
    every event's data on one line (an event whose data spans lines is relayed but not read).
    A scan of the bytes for the lines the recorder reads, not a whole SSE parse, so that reading
    the stream costs the relay little (docs/performance.md, `record`)."""

    def __init__(self) -> None:
        self._tail = b""  # the bytes after the last line end: a line still arriving

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n") + 1
        self._tail = data[end:]
        return [line for line in _DATA_LINE.findall(data, 0, end) if line != b"[DONE]"]


_request = msgspec.json.Decoder(_RequestPeek)
_event = msgspec.json.Decoder(_EventPeek)
_items = msgspec.json.Decoder(list[Raw])


class Line(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One capture line (docs/calibration.md, "A proxy log"), with the recorder's own fields."""

    conversation: str
    mode: str
    turn: int
    response_id: str | None = None
    previous_response_id: str | None = None
    sent_at: float
    first_token_at: float | None = None
    done_at: float
    request_bytes: int
    usage: Raw | None = None
    timing: Raw | None = None
    failed: str | None = None  # why the request has no usable turn; the reader skips the line
    proxy_request_ms: float | None = None  # arrival to hand-off upstream
    proxy_first_byte_ms: float | None = None  # the upstream's first byte to its write downstream
    connection: int | None = None  # the WebSocket connection's number (1, 2, …) in this recording
    store: bool | None = None  # the request's `store`, when it sent one
    warmup: bool = False  # `generate: false`: no model turn; the reader skips the line


_encoder = msgspec.json.Encoder()


@dataclass
class Pending:
    """One request in flight, and what the proxy has seen of its response so far."""

    mode: str
    lane: str | None
    sent_at: float
    request_bytes: int
    previous_response_id: str | None
    conversation: str
    turn: int
    prefix: tuple[int, bytes]  # (items, hash) of this request's input: the key a resend of the history matches
    first_token_at: float | None = None
    done_at: float | None = None
    response_id: str | None = None
    usage: Raw | None = None
    timing: Raw | None = None
    failed: str | None = None
    last_sequence: int | None = None
    proxy_request_ms: float | None = None
    proxy_first_byte_ms: float | None = None
    finished: bool = field(default=False)
    output: Raw | None = None  # the response's output items, read only to keep content
    connection: int | None = None
    store: bool | None = None
    content: tuple[str | None, str | None, str | None] = (None, None, None)  # task, instructions, tool output
    warmup: bool = False

    @property
    def terminal(self) -> bool:
        return self.done_at is not None

    def forwarded(self, at: float) -> None:
        """The request was handed to the upstream at `at`."""
        self.proxy_request_ms = (at - self.sent_at) * 1000

    def first_byte(self, received: float, written: float) -> None:
        """The upstream's first byte of the response arrived at `received`, was written at `written`."""
        if self.proxy_first_byte_ms is None:
            self.proxy_first_byte_ms = (written - received) * 1000

    def event(self, data: bytes | str, at: float) -> bool:
        """A server event (its JSON) seen at `at`; True when it ends the response."""
        try:
            e = _event.decode(data)
        except msgspec.DecodeError:
            return False
        if e.sequence_number is not None:
            self.last_sequence = e.sequence_number
        kind = e.type
        if kind in TOKEN_DELTA_TYPES:
            if self.first_token_at is None:
                self.first_token_at = at
            return False
        if e.response is not None and e.response.id is not None and self.response_id is None:
            self.response_id = e.response.id
        if kind == "responsesapi.websocket_timing":
            self.timing = Raw(data.encode() if isinstance(data, str) else data)
            return False
        if kind not in TERMINAL_TYPES:
            return False
        self.done_at = at
        if kind == "error":
            self.failed = "error event"
        elif kind == "response.failed":
            self.failed = "response.failed"
        if e.response is not None and not is_null(e.response.output):
            self.output = e.response.output
        if e.response is not None and not is_null(e.response.usage):
            self.usage = e.response.usage
        elif self.failed is None:
            self.failed = f"{kind} without usage"
        return True

    def body(self, data: bytes, at: float) -> None:
        """A whole non-streamed Response body, complete at `at`."""
        self.done_at = at
        try:
            e = _event.decode(data)
        except msgspec.DecodeError:
            self.failed = "response body is not JSON"
            return
        self.response_id = e.id
        if e.status == "failed":
            self.failed = "response.failed"
        if not is_null(e.output):
            self.output = e.output
        if not is_null(e.usage):
            self.usage = e.usage
        elif self.failed is None:
            self.failed = "response without usage"

    def fail(self, reason: str, at: float) -> None:
        if self.failed is None:
            self.failed = reason
        if self.done_at is None:
            self.done_at = at


def _hash(previous: bytes, item: bytes) -> bytes:
    return hashlib.blake2b(previous + item, digest_size=16).digest()


class Capture:
    """The recorder's state across requests: conversations, their turns, the lines' bytes."""

    def __init__(self, *, keep_content: bool = False) -> None:
        self.keep_content = keep_content  # the workload's lines carry the task, turns and tool outputs
        self._by_response: dict[str, str] = {}  # response id -> conversation
        self._by_prefix: dict[tuple[int, bytes], str] = {}  # (items, hash) of a last input -> conversation
        self._completed: dict[str, int] = {}  # conversation -> completed lines
        self._count = 0
        self.lines: list[Line] = []
        self.workload = Workload()  # the user's rollouts, turn by turn (sim/record/workload.py)

    def begin(self, mode: str, request: bytes, sent_at: float) -> Pending:
        """A request (an HTTP body, or a WebSocket `response.create` frame) that arrived at `sent_at`.
        `mode` is `http` or `ws`; over HTTP a `previous_response_id` makes it `http_prev`."""
        try:
            peek = _request.decode(request)
        except msgspec.DecodeError:
            peek = _RequestPeek()
        transport = mode
        if mode == "http" and peek.previous_response_id is not None:
            mode = "http_prev"
        items, hashes = self._prefix_hashes(peek, transport=transport)
        conversation, known = None, 0
        if peek.previous_response_id is not None:
            conversation = self._by_response.get(peek.previous_response_id)
        if conversation is None and peek.previous_response_id is None:
            for key in reversed(hashes[:-1]):  # the longest earlier input this one extends
                if key in self._by_prefix:
                    conversation, known = self._by_prefix[key], key[0]
                    break
        content: tuple[str | None, str | None, str | None] = (None, None, None)
        if conversation is None:
            conversation = f"conv-{self._count}"
            self._count += 1
            if self.keep_content:
                instructions = msgspec.json.decode(peek.instructions) if not is_null(peek.instructions) else None
                content = (task_of(items), instructions if isinstance(instructions, str) else None, None)
        elif self.keep_content:
            content = (None, None, tool_output_of(items[known:]))
        return Pending(
            mode=mode,
            lane=peek.stream_id if isinstance(peek.stream_id, str) else None,
            sent_at=sent_at,
            request_bytes=len(request),
            previous_response_id=peek.previous_response_id,
            conversation=conversation,
            turn=self._completed.get(conversation, 0),
            prefix=hashes[-1],
            content=content,
            store=peek.store if isinstance(peek.store, bool) else None,
            warmup=peek.generate is False,
        )

    @staticmethod
    def _prefix_hashes(peek: _RequestPeek, *, transport: str) -> tuple[list[bytes], list[tuple[int, bytes]]]:
        """The input's items, and (k, hash of the transport, the instructions and the first k items)
        for k = 0 … len(items)."""
        items: list[bytes] = []
        if not is_null(peek.input):
            raw = bytes(peek.input)
            if raw.lstrip().startswith(b"["):
                try:
                    items = [bytes(i) for i in _items.decode(raw)]
                except msgspec.DecodeError:
                    items = [raw]
            else:
                items = [raw]  # a string input: one user message
        h = _hash(transport.encode(), bytes(peek.instructions))
        out = [(0, h)]
        for k, item in enumerate(items, 1):
            h = _hash(h, item)
            out.append((k, h))
        return items, out

    def finish(self, p: Pending) -> bytes:
        """The request's capture line (with its newline); a completed one counts as its
        conversation's turn and its input becomes the prefix a resent history matches."""
        assert p.done_at is not None and not p.finished
        p.finished = True
        ok = p.failed is None
        if ok and p.warmup:  # continued by `previous_response_id`, but no turn of its own
            if p.response_id is not None:
                self._by_response[p.response_id] = p.conversation
        elif ok:
            self._completed[p.conversation] = p.turn + 1
            self._by_prefix[p.prefix] = p.conversation
            if p.response_id is not None:
                self._by_response[p.response_id] = p.conversation
            counts = usage_counts(p.usage) if p.usage is not None else None
            if counts is not None:
                turn = Turn(p.conversation, p.turn, p.mode, counts, p.done_at)
                if self.keep_content:
                    turn.task, turn.instructions = p.content[0], p.content[1]
                    turn.assistant = assistant_of(p.output) if p.output is not None else None
                self.workload.completed(turn)
        line = Line(
            conversation=p.conversation,
            mode=p.mode,
            turn=p.turn,
            response_id=p.response_id,
            previous_response_id=p.previous_response_id,
            sent_at=round(p.sent_at, 6),
            first_token_at=None if p.first_token_at is None else round(p.first_token_at, 6),
            done_at=round(max(p.done_at, p.sent_at), 6),
            request_bytes=p.request_bytes,
            usage=p.usage if ok else None,
            timing=p.timing,
            failed=p.failed,
            proxy_request_ms=_ms(p.proxy_request_ms),
            proxy_first_byte_ms=_ms(p.proxy_first_byte_ms),
            connection=p.connection,
            store=p.store,
            warmup=p.warmup,
        )
        self.lines.append(line)
        return _encoder.encode(line) + b"\n"

    def summary(self) -> dict[str, object]:
        modes: dict[str, int] = {}
        for line in self.lines:
            if line.failed is None and not line.warmup:
                modes[line.mode] = modes.get(line.mode, 0) + 1
        return {
            "requests": len(self.lines),
            "failed": sum(1 for line in self.lines if line.failed is not None),
            "warmups": sum(1 for line in self.lines if line.warmup),
            "completed_by_mode": modes,
            "conversations": len({line.conversation for line in self.lines}),
            "workload_turns": self.workload.written,
            "proxy_request_ms": latency_summary([x.proxy_request_ms for x in self.lines]),
            "proxy_first_byte_ms": latency_summary([x.proxy_first_byte_ms for x in self.lines]),
            "sessions": session_signals(self.lines),
        }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def latency_summary(values: list[float | None]) -> dict[str, float | int | None]:
    """n, mean, median, p95 and max of the measured values (ms); None where none was measured."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "mean": None, "median": None, "p95": None, "max": None}
    return {
        "n": len(xs),
        "mean": round(statistics.fmean(xs), 4),
        "median": round(statistics.median(xs), 4),
        "p95": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 4),
        "max": round(xs[-1], 4),
    }
