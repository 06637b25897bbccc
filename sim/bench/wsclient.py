"""A minimal counting WebSocket client for the load generator (asyncio Protocol, no aiohttp).

It parses frame headers only and hands each payload to a callback, so one core
can take in far more frames than the server under test can send: the client
never sets the pace. It offers no extensions (so frames are never compressed)
and masks its own frames with a zero key (valid, RFC 6455 5.3).
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable

__all__ = ["FrameCounter", "WSConnection", "connect"]


class WSConnection(asyncio.Protocol):
    def __init__(self, on_frame: Callable[[bytes], None]) -> None:
        self.on_frame = on_frame
        self.buf = bytearray()
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.upgraded = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(ConnectionError("closed during handshake"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(buf[:end]).split(b"\r\n", 1)[0]
            del buf[: end + 4]
            if b" 101 " not in status:
                self.handshake.set_exception(ConnectionError(status.decode()))
                return
            self.upgraded = True
            self.handshake.set_result(None)
        pos, size, on_frame = 0, len(buf), self.on_frame
        while size - pos >= 2:
            n = buf[pos + 1] & 0x7F
            head = 2
            if n == 126:
                if size - pos < 4:
                    break
                n, head = int.from_bytes(buf[pos + 2 : pos + 4]), 4
            elif n == 127:
                if size - pos < 10:
                    break
                n, head = int.from_bytes(buf[pos + 2 : pos + 10]), 10
            if size - pos < head + n:
                break
            if buf[pos] & 0x0F == 1:  # text
                on_frame(bytes(buf[pos + head : pos + head + n]))
            pos += head + n
        del buf[:pos]

    def send_text(self, data: bytes) -> None:
        n = len(data)
        if n < 126:
            head = bytes((0x81, 0x80 | n))
        elif n < 1 << 16:
            head = bytes((0x81, 0x80 | 126)) + n.to_bytes(2)
        else:
            head = bytes((0x81, 0x80 | 127)) + n.to_bytes(8)
        assert self.transport is not None
        self.transport.write(head + b"\0\0\0\0" + data)  # zero masking key: payload unchanged

    def close(self) -> None:
        if self.transport is not None:
            self.transport.write(bytes((0x88, 0x82)) + b"\0\0\0\0" + (1000).to_bytes(2))
            self.transport.close()


async def connect(port: int, path: str, on_frame: Callable[[bytes], None]) -> WSConnection:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_connection(lambda: WSConnection(on_frame), "127.0.0.1", port)
    proto.transport = transport  # uvloop may call connection_made later
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer sk-bench\r\n\r\n"
    )
    transport.write(request.encode())
    await proto.handshake
    return proto


class FrameCounter:
    """Counts frames starting with `counted` (first and last arrival times) until one
    starting with any of `ends`; `done` resolves then. `tokens` counts the spaces in
    them: the benchmark's words are one token each, with a leading space, and nothing
    else in a delta event holds a space, so a delta carrying k tokens counts k."""

    def __init__(self, counted: bytes, ends: tuple[bytes, ...], now: Callable[[], float]) -> None:
        self.counted = counted
        self.ends = ends
        self.now = now
        self.count = 0
        self.tokens = 0
        self.first_tokens = 0
        self.frames = 0
        self.first = self.last = 0.0
        self.last_frame = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __call__(self, payload: bytes) -> None:
        self.frames += 1
        if payload.startswith(self.counted):
            self.last = self.now()
            k = payload.count(b" ")
            if not self.count:
                self.first, self.first_tokens = self.last, k
            self.count += 1
            self.tokens += k
        elif payload.startswith(self.ends) and not self.done.done():
            self.last_frame = payload
            self.done.set_result(None)

    @property
    def rate(self) -> float:
        """Tokens per second from the first delta's arrival to the last's."""
        return (self.tokens - self.first_tokens) / (self.last - self.first) if self.last > self.first else 0.0
