"""Bench rows: what the recorder (`python -m sim record`) costs, against the same work direct.

The recorder runs in this process (the load generator's core) in front of a bench server.
- Turns: per mode (`http`, `ws`) the same seeded rollout runs direct and through the recorder,
  interleaved (`rounds` times each), and the figure is the median turn (request sent to terminal
  event) through the recorder against the median direct one, as a ratio in one run, with the
  milliseconds it adds; the recorder's own measured latencies (summary.json) are noted beside it.
- Streams: per transport (SSE, WebSocket) one unpaced response of `n_tokens` text deltas, direct
  and through the recorder, interleaved: the median delta events/s the client reads (its deltas
  over the time from sending the request to reading the last one, so chunks the recorder relays
  coalesced cannot inflate it) through the recorder against direct, as a ratio in one run.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final

import aiohttp
import msgspec
from aiohttp import web

from sim.client.client import open_client
from sim.client.loop import run_rollout
from sim.record.proxy import Recorder, make_recorder_app
from sim.rollout.spec import RolloutSpec

__all__ = ["recorder_stream_rates", "recorder_vs_direct"]

Report = Callable[[str, str, float, float, float, str, bool | None], None]
_DELTA: Final = b'"type":"response.output_text.delta"'


class _Clock:
    def now(self) -> float:
        return time.perf_counter()

    def time(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:  # tools take no time here
        return None


async def _turns(mode: str, base: str, spec: RolloutSpec) -> list[float]:
    clock = _Clock()
    client = open_client(mode, base, clock)  # type: ignore[arg-type]
    try:
        result = await run_rollout(client, clock, spec, model="sim")
    finally:
        await client.close()
    return [t.e2e_s for t in result.turns]


@contextlib.asynccontextmanager
async def _recorder(port: int) -> AsyncIterator[tuple[int, Recorder]]:
    """The recorder on an ephemeral port in front of the bench server, into a scratch folder."""
    with tempfile.TemporaryDirectory() as out:
        recorder = Recorder(f"http://127.0.0.1:{port}", Path(out))
        runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield runner.addresses[0][1], recorder
        finally:
            await runner.cleanup()  # writes summary.json


async def _stream_rate(port: int, transport: str, n_tokens: int) -> float:
    """Delta events/s of one unpaced response read on `port`: its deltas over the time from
    sending the request (a socket's handshake done) to reading the last of them."""
    request = {"model": "sim", "input": "go", "max_output_tokens": n_tokens, "store": False}
    count, last = 0, 0.0
    async with aiohttp.ClientSession() as session:
        if transport == "ws":
            async with session.ws_connect(f"ws://127.0.0.1:{port}/v1/responses", max_msg_size=0) as ws:
                start = time.perf_counter()
                await ws.send_str(msgspec.json.encode({"type": "response.create", **request}).decode())
                async for msg in ws:
                    data = msg.data if isinstance(msg.data, bytes) else str(msg.data).encode()
                    if _DELTA in data:
                        count, last = count + 1, time.perf_counter()
                    elif data.startswith((b'{"type":"response.completed"', b'{"type":"error"')):
                        break
        else:
            body = msgspec.json.encode({**request, "stream": True})
            start = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            async with session.post(f"http://127.0.0.1:{port}/v1/responses", data=body, headers=headers) as r:
                tail = b""
                async for chunk in r.content.iter_any():
                    data = tail + chunk
                    k = data.count(_DELTA)  # a tail shorter than the pattern is never counted twice
                    if k:
                        count, last = count + k, time.perf_counter()
                    tail = data[-(len(_DELTA) - 1) :]
    if count != n_tokens:
        raise RuntimeError(f"{transport}: {count} deltas read, {n_tokens} asked for")
    return count / (last - start)


async def recorder_stream_rates(port: int, n_tokens: int, rounds: int, report: Report) -> None:
    async with _recorder(port) as (proxy_port, _):
        for transport, name in (("sse", "SSE"), ("ws", "WebSocket")):
            await _stream_rate(port, transport, n_tokens)  # warm-up
            direct: list[float] = []
            proxied: list[float] = []
            for _ in range(rounds):
                direct.append(await _stream_rate(port, transport, n_tokens))
                proxied.append(await _stream_rate(proxy_port, transport, n_tokens))
            d, p = statistics.median(direct), statistics.median(proxied)
            what = f"{name} delta events/s through the recorder / direct ({n_tokens} tok)"
            report("record", what, p, d, p / d, "report", None)


async def recorder_vs_direct(port: int, turns: int, rounds: int, report: Report, note: Callable[[str], None]) -> None:
    spec = RolloutSpec(0, 0, "Task 0: fix the failing test.", (0.0,) * turns, ("ok",) * turns)
    direct_base = f"http://127.0.0.1:{port}/v1"
    async with _recorder(port) as (proxy_port, recorder):
        proxied_base = f"http://127.0.0.1:{proxy_port}/v1"
        for mode in ("http", "ws"):
            await _turns(mode, direct_base, spec)  # warm-up
            direct: list[float] = []
            proxied: list[float] = []
            for _ in range(rounds):
                direct += await _turns(mode, direct_base, spec)
                proxied += await _turns(mode, proxied_base, spec)
            d, p = statistics.median(direct), statistics.median(proxied)
            what = f"{mode}: turn through the recorder / direct, ms"
            report("record", what, p * 1e3, d * 1e3, p / d, "report", None)
            note(f"record {mode}: {(p - d) * 1e3:+.3f} ms per turn added (median, {len(direct)} turns each)")
    summary = recorder.capture.summary()
    for key in ("proxy_request_ms", "proxy_first_byte_ms"):
        figures = summary[key]
        assert isinstance(figures, dict)
        note(f"record: the recorder's own {key}: median {figures['median']}, p95 {figures['p95']} (n={figures['n']})")
