"""Live costs on the real clock (the clock itself is `prototype.serve.wallclock.AsyncioClock`).

`live_cost_samples` measures, on this machine's real clock and loopback sockets, the
per-operation costs a live run pays and an in-process virtual run does not
(`python -m sim fidelity --calibrate`, docs/fidelity.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np

from prototype.serve.wallclock import AsyncioClock

__all__ = ["live_cost_samples"]

Samples = list[tuple[str, list[float], str]]  # (name, seconds per operation, what it is)

REQUEST_BYTES: Final = 30_000  # a request body the size of a `local` turn's (the instructions and tools)
IDLE_WAIT_S: Final = 0.1  # how long the loop sleeps before an "after the loop slept" sample (a tool's time)


def live_cost_samples(
    repeats: int, stream_bytes: int, *, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> Samples:
    """Per-operation costs a live run pays on this machine and an in-process virtual run does
    not, sampled on a fresh loop from `loop_factory` over loopback (`sim.harness.fidelity.calibrate`
    summarizes them): a sleep's lateness, how much longer the same short render and
    classification takes right after a wait than right after other work (a live loop waits
    between turns and stages; a virtual one never does), the hop to a nice-19 thread (as the
    server's render threads) and back, tokenizing 20 KB there rather than inline, an HTTP
    request of `REQUEST_BYTES` to its handler and its response, back to back and after the
    loop slept `IDLE_WAIT_S`, a megabyte of SSE, a WebSocket message of `REQUEST_BYTES` to its
    handler, back to back and after a sleep, a megabyte in one message."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_live_cost_samples(repeats, stream_bytes))


async def _live_cost_samples(repeats: int, stream_bytes: int) -> Samples:
    from aiohttp import ClientSession, web

    from prototype.context.safety import SafetyClassifier
    from prototype.context.tokenizer import get_tokenizer
    from prototype.wire.sse import SSEDecoder
    from sim.rollout.spec import tool_output_text

    clock, loop, out = AsyncioClock(), asyncio.get_running_loop(), []
    late = []
    for i in range(repeats):
        deadline = clock.now() + 0.001 + 0.004 * (i % 5) / 5
        await clock.sleep_until(deadline)
        late.append(clock.now() - deadline)
    out.append(("timer_wakeup", late, "a sleep's lateness (the loop's timer resolution + the scheduler): per wait"))

    def nice() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)

    tokenizer = get_tokenizer()
    classifier = SafetyClassifier()
    short = tool_output_text(np.random.default_rng(0), 500)  # a median tool output
    warm: list[float] = []
    cold: list[float] = []
    for i in range(2 * repeats):  # the same work right after another, or right after a wait
        await asyncio.sleep(0.005 if i % 2 else 0.0)
        t = time.perf_counter()
        classifier.update(classifier.begin(), tokenizer.encode(short))
        (cold if i % 2 else warm).append(time.perf_counter() - t)
    base = float(np.median(warm))
    out.append(
        ("work_after_wait", [x - base for x in cold], "500 tokens rendered and classified after a 5 ms wait, less warm")
    )
    text = tool_output_text(np.random.default_rng(0), 4000)  # ≈ 20 KB: long enough to be offloaded
    with ThreadPoolExecutor(1, initializer=nice) as pool:
        hops, renders = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            await loop.run_in_executor(pool, int)
            hops.append(time.perf_counter() - t)
        for _ in range(max(3, repeats // 4)):
            t = time.perf_counter()
            tokenizer.encode(text)
            inline = time.perf_counter() - t
            t = time.perf_counter()
            await loop.run_in_executor(pool, tokenizer.encode, text)
            renders.append(time.perf_counter() - t - inline)
    out.append(("render_hop", hops, "to a nice-19 render thread and back: per render of >= 8 KiB of text"))
    out.append(("render_offload", renders, "the same 20 KB tokenized there rather than inline (hop + priority)"))

    payload = b"x" * stream_bytes
    body = b"x" * REQUEST_BYTES
    handled: list[float] = []  # perf_counter when a handler holds a request's body / a message

    async def post(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        handled.append(time.perf_counter())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if data == b"big":  # four events of a quarter each, one line each, as a response's echo
            quarter = len(payload) // 4
            for start in range(0, 4 * quarter, quarter):
                await resp.write(b"event: e\ndata: " + payload[start : start + quarter] + b"\n\n")
        else:
            await resp.write(b"data: {}\n\n")
        await resp.write_eof()
        return resp

    async def socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            handled.append(time.perf_counter())
            await ws.send_str(payload.decode() if msg.data == "big" else "{}")
        return ws

    app = web.Application(client_max_size=0)
    app.router.add_post("/", post)
    app.router.add_get("/ws", socket)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    streams = max(3, repeats // 10)
    waited = max(3, repeats // 8)  # each after an `IDLE_WAIT_S` sleep
    try:
        async with ClientSession() as session:

            async def request(data: bytes) -> tuple[float, float]:
                """(client call to the handler holding the body, the rest of the round trip)."""
                t = time.perf_counter()
                async with session.post(url + "/", data=data) as resp:
                    decoder = SSEDecoder()  # the client's own parser, as `sim.client.client` reads
                    async for chunk in resp.content.iter_any():
                        decoder.feed(chunk)
                return handled[-1] - t, time.perf_counter() - handled[-1]

            async def after_wait(data: bytes) -> tuple[float, float]:
                await asyncio.sleep(IDLE_WAIT_S)
                return await request(data)

            await request(b"")  # the connection, opened once (the client keeps it alive)
            back = [await request(body) for _ in range(repeats)]
            slept = [await after_wait(body) for _ in range(waited)]
            small = [sum(await request(b"")) for _ in range(repeats)]
            base = float(np.median(small))
            big = []
            for _ in range(streams):
                t = time.perf_counter()  # what the in-process transport does too: frame, then parse
                quarter = len(payload) // 4
                SSEDecoder().feed(b"".join(b"event: e\ndata: " + payload[:quarter] + b"\n\n" for _ in range(4)))
                in_memory = time.perf_counter() - t
                big.append((sum(await request(b"big")) - base - in_memory) * 1e6 / stream_bytes)
            what = f"POST of {REQUEST_BYTES // 1000} kB: client call to the handler holding the body"
            out.append(("http_request", [a for a, _ in back], what + ", back to back"))
            out.append(("http_request_after_wait", [a for a, _ in slept], what + ", after the loop slept"))
            what = "its response: headers, one SSE event, end of stream"
            out.append(("http_response", [b for _, b in back], what + ", back to back"))
            out.append(("http_response_after_wait", [b for _, b in slept], what + ", after the loop slept"))
            out.append(("sse_per_mb", big, "SSE events over the socket, less the same framing and parsing in memory"))
            async with session.ws_connect(url + "/ws", max_msg_size=0) as ws:

                async def message(data: str) -> tuple[float, float]:
                    t = time.perf_counter()
                    await ws.send_str(data)
                    await ws.receive()
                    return handled[-1] - t, time.perf_counter() - t

                text = body.decode()
                back = [await message(text) for _ in range(repeats)]
                slept = []
                for _ in range(waited):
                    await asyncio.sleep(IDLE_WAIT_S)
                    slept.append(await message(text))
                base = float(np.median([b for _, b in back]))
                big = []
                for _ in range(streams):
                    big.append((sum(await message("big")) - base) * 1e6 / stream_bytes)
            what = f"a {REQUEST_BYTES // 1000} kB WebSocket message: client send to the handler holding it"
            out.append(("ws_message", [a for a, _ in back], what + ", back to back"))
            out.append(("ws_message_after_wait", [a for a, _ in slept], what + ", after the loop slept"))
            out.append(("ws_per_mb", big, "a WebSocket message: per MB of events"))
    finally:
        await runner.cleanup()
    return out
