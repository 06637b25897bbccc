"""Server-Sent Events framing, byte-exact and I/O-free.

Theory: WHATWG HTML Living Standard, section 9.2 "Server-sent events", in
particular 9.2.5 "Parsing an event stream" and 9.2.6 "Interpreting an event
stream" (https://html.spec.whatwg.org/multipage/server-sent-events.html).

An event stream is UTF-8 text; one leading BOM is ignored. Lines end with
CRLF, a lone LF or a lone CR. A line starting with ``:`` is a comment. Any
other non-empty line is a field: the name is everything before the first
``:`` (or the whole line), the value everything after it with one leading
space removed. ``event`` sets the event type, ``data`` appends the value plus
a LF to the data buffer, ``id`` sets the last event ID (unless it contains
NUL), ``retry`` sets the reconnection time (only if all ASCII digits); other
names are ignored. A blank line dispatches: a block whose data buffer is empty
dispatches nothing, otherwise one trailing LF is dropped and the event is
delivered. At end of stream an unterminated block is discarded.

Since CR and LF never occur inside a multi-byte UTF-8 sequence, the decoder
splits *bytes* into lines first and decodes each complete line on its own, so
chunk boundaries may fall anywhere: inside a character, or between the CR and
LF of a CRLF (a CR ending a chunk ends the line at once, and a LF starting the
next chunk is then skipped).

Two mappings of spec state onto `ServerSentEvent` (which the spec lacks):
``id`` is the last event ID *as of dispatch* -- it persists across events
until another ``id`` field changes it, exactly like ``MessageEvent.lastEventId``
-- and ``retry`` is the last valid ``retry`` value seen in that event's own
block (``None`` otherwise). The stream-wide values are also on the decoder as
`SSEDecoder.last_event_id` and `SSEDecoder.reconnection_time`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "DONE_FRAME",
    "SSE_HEADERS",
    "SSEDecoder",
    "ServerSentEvent",
    "encode_event",
]

SSE_HEADERS: Final[dict[str, str]] = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

DONE_FRAME: Final[bytes] = b"data: [DONE]\n\n"

_NEWLINE: Final = re.compile(rb"\r\n|\r|\n")
_BOM: Final = b"\xef\xbb\xbf"


def encode_event(data: bytes, *, event: str | None = None) -> bytes:
    """One SSE frame: optional `event: <name>\\n`, then `data` split on CR, LF or CRLF into several
    `data: ` lines, then a blank line. `event` must not contain CR/LF (ValueError).

    Decoding the frame gives back `data` (as UTF-8) with every CRLF or lone CR turned into LF; an
    empty `data` gives an event with empty data (one `data: ` line), not a dropped event.
    """
    parts: list[bytes] = []
    if event is not None:
        if "\r" in event or "\n" in event:
            raise ValueError(f"SSE event name must not contain CR or LF: {event!r}")
        parts.append(b"event: " + event.encode("utf-8") + b"\n")
    if b"\n" not in data and b"\r" not in data:  # one line: compact JSON always is
        parts.append(b"data: " + data + b"\n\n")
        return b"".join(parts)
    for line in _NEWLINE.split(data):
        parts.append(b"data: " + line + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One dispatched event (the spec's MessageEvent: `type`, `data`, `lastEventId`, plus `retry`)."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental event-stream parser: `feed` bytes as they arrive, then `close` at end of stream."""

    __slots__ = (
        "_line",
        "_skip_lf",
        "_first_line",
        "_closed",
        "_event_type",
        "_data",
        "_id_buffer",
        "_block_retry",
        "_last_event_id",
        "_reconnection_time",
    )

    def __init__(self) -> None:
        self._line = bytearray()  # bytes of the current, not yet terminated line
        self._skip_lf = False  # the previous chunk ended in CR: a LF starting the next one is its pair
        self._first_line = True  # the BOM may only be stripped from the very first line
        self._closed = False
        self._event_type = ""
        self._data: list[str] = []  # the spec's data buffer, as lines (joined with LF on dispatch)
        self._id_buffer: str | None = None  # the spec's "last event ID buffer" (None: never set)
        self._block_retry: int | None = None
        self._last_event_id: str | None = None  # the spec's "last event ID string"
        self._reconnection_time: int | None = None

    @property
    def last_event_id(self) -> str | None:
        """The last event ID as of the last blank line (also set by blocks that dispatch nothing)."""
        return self._last_event_id

    @property
    def reconnection_time(self) -> int | None:
        """Milliseconds from the last valid `retry` field anywhere in the stream, if any."""
        return self._reconnection_time

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Parse the next chunk of the stream; return the events it completes, in order."""
        if self._closed:
            raise ValueError("feed() on a closed SSEDecoder")
        events: list[ServerSentEvent] = []
        pos = 0
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                pos = 1
        end = len(chunk)
        while pos < end:
            match = _NEWLINE.search(chunk, pos)
            if match is None:
                self._line += chunk[pos:]
                break
            self._line += chunk[pos : match.start()]
            pos = match.end()
            if pos == end and match.group() == b"\r":
                self._skip_lf = True  # this CR may be the first half of a CRLF split across chunks
            line = bytes(self._line)
            self._line.clear()
            self._process_line(line, events)
        return events

    def close(self) -> list[ServerSentEvent]:
        """End of stream: any unterminated line or event is discarded (spec), so nothing is returned.

        Idempotent; `feed` after `close` raises ValueError.
        """
        self._closed = True
        self._line.clear()
        self._skip_lf = False
        self._event_type = ""
        self._data.clear()
        self._block_retry = None
        return []

    def _process_line(self, raw: bytes, events: list[ServerSentEvent]) -> None:
        if self._first_line:
            self._first_line = False
            if raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
        if not raw:
            self._dispatch(events)
            return
        line = raw.decode("utf-8", errors="replace")
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\x00" not in value:
                self._id_buffer = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self._block_retry = self._reconnection_time = int(value)
        # any other field name is ignored

    def _dispatch(self, events: list[ServerSentEvent]) -> None:
        self._last_event_id = self._id_buffer
        if self._data:
            events.append(
                ServerSentEvent(
                    event=self._event_type or "message",
                    data="\n".join(self._data),
                    id=self._last_event_id,
                    retry=self._block_retry,
                )
            )
        self._event_type = ""
        self._data.clear()
        self._block_retry = None
