"""Bench row: N lanes (`stream_id`) on one WebSocket against N connections, same work.

Each side streams N unpaced responses of the same length at once from one bench server;
the figure is the wall time until the last terminal event arrives, the median of
interleaved repeats (lanes, connections, lanes, …), so both sides see the same machine.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from prototype.wire.schemas import encode

from .wsclient import connect

__all__ = ["lanes_vs_connections"]

_TERMINAL = (b'"type":"response.completed"', b'"type":"response.incomplete"', b'"type":"response.failed"')


class _Ends:
    """Counts terminal events (a lane's frames start with its `stream_id`, so match inside the head)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.frames = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __call__(self, payload: bytes) -> None:
        self.frames += 1
        head = payload[:80]
        if any(t in head for t in _TERMINAL) or b'"type":"error"' in head:
            self.seen += 1
            if self.seen == self.expected and not self.done.done():
                self.done.set_result(None)


def _create(n_tokens: int, stream_id: str | None) -> bytes:
    body: dict[str, object] = {
        "type": "response.create",
        "model": "sim",
        "input": "go",
        "max_output_tokens": n_tokens,
        "store": False,
    }
    if stream_id is not None:
        body["stream_id"] = stream_id
    return encode(body)


async def _on_lanes(port: int, n: int, tokens: int) -> float:
    ends = _Ends(n)
    conn = await connect(port, "/v1/responses", ends)
    t = time.perf_counter()
    for k in range(n):
        conn.send_text(_create(tokens, f"lane-{k}"))
    await ends.done
    wall = time.perf_counter() - t
    conn.close()
    return wall


async def _on_connections(port: int, n: int, tokens: int) -> float:
    counters = [_Ends(1) for _ in range(n)]
    conns = [await connect(port, "/v1/responses", c) for c in counters]
    t = time.perf_counter()
    for conn in conns:
        conn.send_text(_create(tokens, None))
    await asyncio.gather(*(c.done for c in counters))
    wall = time.perf_counter() - t
    for conn in conns:
        conn.close()
    return wall


async def lanes_vs_connections(port: int, n: int, tokens: int, repeats: int) -> tuple[float, float]:
    """Median seconds for N responses of `tokens` tokens: on N lanes of one socket, on N sockets."""
    await _on_lanes(port, n, 200)  # warm-up
    await _on_connections(port, n, 200)
    lanes: list[float] = []
    conns: list[float] = []
    runs: list[tuple[list[float], Callable[[int, int, int], Awaitable[float]]]] = [
        (lanes, _on_lanes),
        (conns, _on_connections),
    ]
    for _ in range(repeats):
        for into, run in runs:
            into.append(await run(port, n, tokens))
    return statistics.median(lanes), statistics.median(conns)
