"""What a WebSocket connection keeps of a finished response, and how a lane's events are tagged.

Pure data: no I/O, no engine, no asyncio. The connection core (`connection.py`) holds
these entries; the engine builds them when a response ends (docs/lanes.md, "The
connection cache").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.errors import ProtocolError
from ..wire.schemas import Response
from .conversation import Context, Preamble
from .safety import ClassifierState

__all__ = ["CacheEntry", "store_unavailable", "tag_stream"]


def store_unavailable() -> ProtocolError:
    """The one mapping of a store outage to the wire: 503 `store_unavailable` (HTTP body, or the
    `error` of a `response.failed` / WebSocket `error` event). A new one each time: a raised
    exception keeps its traceback, and with it the frames of the response that met the outage."""
    return ProtocolError("The response store is unavailable. Please retry.", code="store_unavailable", status=503)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A connection cache entry (docs/protocol.md, the connection-local cache): the previous
    response, its effective input and output items, tools, their rendered tokens, and how far
    the safety classifier has read them."""

    response: Response
    context: Context  # input + output items of `response`, rendered
    n_items: int  # length of `context` that belongs to this entry (Context is append-only)
    preamble: Preamble
    store: bool
    safety: ClassifierState | None = None  # classifier state over preamble + chunks[:safety_chunks]
    safety_chunks: int = 0

    @property
    def response_id(self) -> str:
        return self.response.id

    @property
    def nbytes(self) -> int:
        """What the entry holds: its items' JSON, their tokens and the rendered preamble."""
        ctx = self.context
        if self.n_items == len(ctx.items):
            held = ctx.held_bytes
        else:  # the context grew past this entry
            held = sum(len(item.raw) for item in ctx.items[: self.n_items])
            held += sum(chunk.nbytes for chunk in ctx.chunks[: self.n_items])
        return held + len(self.preamble.key) + self.preamble.tokens.nbytes


def tag_stream(frame: bytes, prefix: bytes | None) -> bytes:
    """A server frame (one JSON object) with its lane's `stream_id` as the first member.

    `prefix` is `stream_prefix(stream_id)`; None (the default lane) leaves the frame as it
    is. The lane is envelope metadata of WebSocket mode, so it is added where frames leave
    for the socket, without touching the event Structs."""
    if prefix is None:
        return frame
    return prefix + frame[1:]


def stream_prefix(stream_id: str | None) -> bytes | None:
    """`{"stream_id":"<id>",` for a named lane (ids are ASCII letters, digits, `_-.`: no escaping)."""
    if stream_id is None:
        return None
    return b'{"stream_id":"' + stream_id.encode() + b'",'
