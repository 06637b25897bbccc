"""One subscriber's server-sent events of an Agents API session (`EventFeed`)."""

from __future__ import annotations

import asyncio
import collections

__all__ = ["EventFeed"]


class EventFeed:
    """One subscriber's server-sent events: SSE frames in publish order, then None at the end
    (`until_idle`: the create stream's, after the first turn's `agent.session.idle`)."""

    def __init__(self, *, until_idle: bool = False) -> None:
        self.until_idle = until_idle
        self._frames: collections.deque[bytes | None] = collections.deque()
        self._wake: asyncio.Event | None = None
        self.closed = False

    def put(self, frame: bytes | None) -> None:
        if self.closed:
            return
        self._frames.append(frame)
        if frame is None:
            self.closed = True
        if self._wake is not None:
            self._wake.set()

    async def get(self) -> bytes | None:
        """The next frames joined (everything published so far), or None at the end."""
        while not self._frames:
            self._wake = asyncio.Event()
            try:
                await self._wake.wait()
            finally:
                self._wake = None
        out: list[bytes] = []
        while self._frames:
            frame = self._frames.popleft()
            if frame is None:
                if out:
                    self._frames.appendleft(None)
                    break
                return None
            out.append(frame)
        return b"".join(out)
