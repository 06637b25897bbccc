"""The Agents API's event feeds: one bounded queue of SSE frames per subscriber of a session.

A session's runner (`agents_api.py`) publishes each event to every subscriber's `EventFeed`
without waiting: one slow client must not slow the turn or the other subscribers. A feed holds
at most `ServerConfig.max_subscriber_bytes` of frames not yet taken by its writer; a publish that
would pass the bound drops the subscriber instead: its queue is cleared and it gets one final
`error` event (`subscriber_too_slow`, in the Agents API's event shape), then its end. The writer
(the aiohttp handler, or the in-process transport) takes at most `BATCH_BYTES` at a time and waits
for its socket before it takes more, so what a subscriber holds in the server is its feed plus
one batch and the transport's buffer.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Final

from ..agents import wire as w
from ..wire.schemas import encode
from ..wire.sse import encode_event
from .session import BATCH_BYTES

__all__ = ["SUBSCRIBER_TOO_SLOW", "EventFeed", "let_subscribers_read", "too_slow_frame"]

SUBSCRIBER_TOO_SLOW: Final = "subscriber_too_slow"  # longrun's code: the public material names none


def too_slow_frame(session_id: str, event_id: str, limit: int) -> bytes:
    """The last frame of a dropped subscriber: an `error` event as the SDK's
    `AgentSessionErrorEvent` reads it."""
    error = w.SessionErrorOut(
        code=SUBSCRIBER_TOO_SLOW,
        message=f"This event stream fell more than {limit} bytes behind the session and was ended; "
        "subscribe again (GET .../events) and read the session's state to catch up.",
        param=None,
        type="invalid_request_error",
    )
    return encode_event(encode(w.ErrorEvent(event_id=event_id, error=error, session_id=session_id)), event="error")


class EventFeed:
    """One subscriber's server-sent events: SSE frames in publish order, then None at the end
    (`until_idle`: the create stream's, after the first turn's `agent.session.idle`).

    `limit` bounds the bytes queued (None: unbounded); past it the feed is `dropped`: cleared,
    then the frame `dropped_frame()` returns, then the end."""

    def __init__(
        self,
        *,
        limit: int | None,
        dropped_frame: Callable[[int], bytes],
        until_idle: bool = False,
    ) -> None:
        self.until_idle = until_idle
        self.limit = limit
        self._dropped_frame = dropped_frame
        self._frames: collections.deque[bytes | None] = collections.deque()
        self._wake: asyncio.Event | None = None
        self.queued = 0  # bytes of the frames in the deque
        self.closed = False
        self.dropped = False

    def put(self, frame: bytes | None) -> None:
        """Publish one frame (None: the end). Never waits; a frame past the limit drops the feed."""
        if self.closed:
            return
        if frame is None:
            self._frames.append(None)
            self.closed = True
        elif self.limit is not None and self.queued + len(frame) > self.limit:
            final = self._dropped_frame(self.limit)
            self._frames.clear()
            self._frames.extend((final, None))
            self.queued = len(final)
            self.closed = self.dropped = True
        else:
            self._frames.append(frame)
            self.queued += len(frame)
        if self._wake is not None:
            self._wake.set()

    async def get(self, max_bytes: int = BATCH_BYTES) -> bytes | None:
        """The next frames joined (at least one, then more while they fit in `max_bytes`), or
        None at the end."""
        frames = self._frames
        while not frames:
            if self.closed:
                return None  # the end was taken already
            self._wake = asyncio.Event()
            try:
                await self._wake.wait()
            finally:
                self._wake = None
        out: list[bytes] = []
        size = 0
        while frames:
            frame = frames[0]
            if frame is None:
                if out:
                    break
                frames.popleft()
                return None
            if out and size + len(frame) > max_bytes:
                break
            frames.popleft()
            out.append(frame)
            size += len(frame)
        self.queued -= size
        return b"".join(out)


async def let_subscribers_read(feeds: Iterable[EventFeed]) -> None:
    """One pass of the event loop once a subscriber has a batch (`BATCH_BYTES`) queued, so its
    writer moves it towards the socket while a turn that never yields by itself (an unpaced
    model) runs on. It yields; it never waits for a subscriber."""
    if any(feed.queued >= BATCH_BYTES and not feed.closed for feed in feeds):
        await asyncio.sleep(0)
