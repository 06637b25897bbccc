"""Several rollouts on one WebSocket, each on its own lane (`stream_id`, docs/lanes.md): a
`LaneSocket` opens the socket with its first lane's first turn, and one reader task hands each
frame to the lane its `stream_id` names, as the SDKs' WebSocket sessions do
(sim/client/websocket.py's `share_socket` puts clients on one)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp

from prototype.wire.schemas import decode_stream_tag

__all__ = ["LaneSocket", "TextSocket"]


class TextSocket(Protocol):
    """What a `WSSocket` (sim/client/websocket.py) needs of a WebSocket (aiohttp's client socket, or an
    in-process pair)."""

    async def send_str(self, data: str) -> None: ...

    async def receive(self) -> aiohttp.WSMessage: ...

    async def close(self) -> Any: ...


class LaneSocket:
    """One WebSocket shared by several lanes: one reader task routes every frame to the lane
    its `stream_id` names (frames without one go to the default lane), as the SDKs' WebSocket
    sessions do. The socket opens with the first lane's first turn and closes when the last
    of its `lanes` closes."""

    def __init__(
        self, connect: Callable[[], Awaitable[TextSocket]], close: Callable[[], Awaitable[Any]], *, lanes: int
    ) -> None:
        self._connect = connect
        self._close = close
        self._ws: TextSocket | None = None
        self._opening: asyncio.Lock | None = None
        self._reader: asyncio.Task[None] | None = None
        self._inboxes: dict[str | None, asyncio.Queue[aiohttp.WSMessage]] = {}
        self._open_lanes = lanes  # lanes not yet released

    def lane(self, stream_id: str | None) -> _LaneEnd:
        inbox = self._inboxes.setdefault(stream_id, asyncio.Queue())
        return _LaneEnd(self, inbox)

    async def send_str(self, data: str) -> None:
        if self._ws is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._ws is None:
                    self._ws = await self._connect()
                    self._reader = asyncio.get_running_loop().create_task(self._read(self._ws))
        await self._ws.send_str(data)

    async def _read(self, ws: TextSocket) -> None:
        inboxes = self._inboxes
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                for inbox in inboxes.values():
                    inbox.put_nowait(msg)
                return
            lane = inboxes.get(decode_stream_tag(msg.data).stream_id)
            if lane is not None:
                lane.put_nowait(msg)

    async def release(self) -> None:
        self._open_lanes -= 1
        if self._open_lanes > 0:
            return
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._close()


class _LaneEnd:
    """A `TextSocket` for one lane of a `LaneSocket`."""

    def __init__(self, shared: LaneSocket, inbox: asyncio.Queue[aiohttp.WSMessage]) -> None:
        self.shared = shared
        self.inbox = inbox

    async def send_str(self, data: str) -> None:
        await self.shared.send_str(data)

    async def receive(self) -> aiohttp.WSMessage:
        return await self.inbox.get()

    async def close(self) -> None:
        await self.shared.release()
