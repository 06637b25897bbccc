"""The benchmark's server process: `python -m sim.bench.server` (started and pinned by `sim.bench`).

It serves the longrun app (the same `make_app` as `prototype.server`, on uvloop)
with the simulator, plus the raw floors measured in the same process:

* ``GET /bench/raw_ws``: a WebSocket that, for a text frame ``"N"``, sends N text
  frames, each an `OutputTextDelta` encoded by msgspec and sent by aiohttp, then
  ``{"type":"end"}``; any other text frame is echoed (the round-trip floor).
* ``POST /bench/raw_sse?n=N``: N SSE frames of the same event, one write each.
* ``GET /bench/timer?rate=R&n=N``: an asyncio task sleeping to absolute deadlines
  ``i / R`` (no writes): the p50/p99/max lateness of the loop's timer itself.
* ``"paced N R"`` on ``/bench/raw_ws``: N tokens paced at R/s by absolute deadlines, one
  frame and one aiohttp send each (``"paced N R coalesce"``: the tokens due at a wake-up
  in one frame); ``GET /bench/raw_lateness`` reports them like `/bench/lateness`.
* ``GET /bench/lateness``: the simulator's per-token lateness and per-turn rates
  since the last call (`sim.model.accelerator.LatenessRecorder`), then cleared.
* ``GET /bench/memory``: the process's resident bytes and the connection caches' sizes.

`BenchPolicy` answers every turn with a text of exactly ``max_output_tokens`` one-token
words, so a client chooses the stream length.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import time
from typing import Final

import msgspec
import numpy as np
import uvloop
from aiohttp import WSMsgType, web

from prototype.config import ServerConfig
from prototype.model import ModelRequest
from prototype.options import add_struct_options, struct_from_args
from prototype.serve.app import ApiRunner, make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.server import serve_until_stopped
from prototype.store.spec import open_store
from prototype.wire.schemas import OutputTextDelta, encode
from prototype.wire.sse import SSE_HEADERS, encode_event
from sim.model.accelerator import LatenessRecorder
from sim.model.config import ModelConfig, build_model
from sim.model.policy import DefaultPolicy, PlannedItem, Policy
from sim.runtime.memo import memo_tokenizer

__all__ = ["BenchPolicy", "delta_event", "main", "parser"]

WORDS: Final = (" the", " value", " return", " file", " test", " line", " data", " and", " of", " model")
DEFAULT_TOKENS: Final = 100


class BenchPolicy:
    """Every turn: one message of ``max_output_tokens`` (default 100) one-token words."""

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        return [PlannedItem("message", "", _bench_text(request.max_output_tokens or DEFAULT_TOKENS))]


@functools.lru_cache(maxsize=16)
def _bench_text(n: int) -> str:
    """The same text for every stream of n tokens, built once: planning is the stand-in model's
    work, which a real accelerator does elsewhere; rebuilding it per stream would load the
    server's core in a burst when 100 streams start together."""
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


def delta_event(seq: int, word: str = " value") -> OutputTextDelta:
    """A delta event of the size longrun sends (same type, same id lengths)."""
    return OutputTextDelta(
        sequence_number=seq,
        item_id="msg_" + "0" * 32,
        output_index=0,
        content_index=0,
        delta=word,
    )


RAW_LATENESS: Final = LatenessRecorder()  # the raw paced sender's, for `/bench/raw_lateness`


async def raw_paced(ws: web.WebSocketResponse, n: int, rate: float, coalesce: bool) -> None:
    """N tokens paced by absolute deadlines, one aiohttp send per frame: the floor of paced
    streaming. One token per frame, or with `coalesce` every token due at a wake-up in one."""
    clock = AsyncioClock()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = last = 0.0
    i = seq = 0
    while i < n:
        due = t0 + i / rate
        now = loop.time()
        if due > now:
            await clock.sleep_until(due)
            now = loop.time()
        end = i + 1
        while coalesce and end < n and t0 + end / rate <= now:
            end += 1
        word = "".join(WORDS[k % len(WORDS)] for k in range(i, end))
        await ws.send_frame(encode(delta_event(seq, word)), WSMsgType.TEXT)
        last = RAW_LATENESS.tokens(due, end - i, 1.0 / rate)
        first = first or last
        i, seq = end, seq + 1
    RAW_LATENESS.turns.append((n, rate, first, last))
    await ws.send_frame(b'{"type":"end"}', WSMsgType.TEXT)


async def raw_ws(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=0)
    await ws.prepare(request)
    async for msg in ws:
        if msg.type is not WSMsgType.TEXT:
            break
        if msg.data.startswith("paced "):
            _, n, rate, *how = msg.data.split()
            await raw_paced(ws, int(n), float(rate), how == ["coalesce"])
        elif msg.data.isdigit():
            for i in range(int(msg.data)):
                await ws.send_frame(encode(delta_event(i, WORDS[i % len(WORDS)])), WSMsgType.TEXT)
            await ws.send_frame(b'{"type":"end"}', WSMsgType.TEXT)
        else:
            await ws.send_str(msg.data)
    return ws


async def raw_sse(request: web.Request) -> web.StreamResponse:
    n = int(request.query["n"])
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    for i in range(n):
        ev = delta_event(i, WORDS[i % len(WORDS)])
        await resp.write(encode_event(encode(ev), event="response.output_text.delta"))
    await resp.write(encode_event(b'{"type":"end"}', event="end"))
    await resp.write_eof()
    return resp


def _quantiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "n": int(len(values)),
        "p50": float(np.quantile(values, 0.5)),
        "p99": float(np.quantile(values, 0.99)),
        "max": float(values.max()),
    }


async def timer_floor(request: web.Request) -> web.Response:
    rate, n = float(request.query["rate"]), int(request.query["n"])
    loop = asyncio.get_running_loop()
    clock = AsyncioClock()
    late = np.empty(n)
    t0 = loop.time()
    for i in range(n):
        due = t0 + i / rate
        await clock.sleep_until(due)
        late[i] = time.monotonic() - due
    return web.json_response(_quantiles(late))


def make_bench_app(args: argparse.Namespace) -> tuple[web.Application, LatenessRecorder]:
    clock = AsyncioClock(tick_s=0.001)  # as prototype.server
    lateness = LatenessRecorder()
    policy: Policy = BenchPolicy() if args.policy == "bench" else DefaultPolicy(tool_calls=args.tool_calls)
    model = build_model(
        struct_from_args(args, ModelConfig),
        clock=clock,
        policy=policy,
        # Every stream plans the same text: the simulator tokenizes it once, not once per stream
        # (its planning is a stand-in's work, not the server's; the server's tokenizer is not memoized).
        tokenizer=memo_tokenizer() if args.policy == "bench" else None,
        lateness=lateness,
    )
    config: ServerConfig = struct_from_args(args, ServerConfig)
    app = make_app(model=model, store=open_store("memory"), clock=clock, config=config, seed=0)

    def lateness_body(recorder: LatenessRecorder) -> bytes:
        late = recorder.late_s
        turns = [
            {"tokens": n, "rate": rate, "achieved": (n - 1) / (last - first) if last > first else math.nan}
            for n, rate, first, last in recorder.turns
        ]
        recorder.clear()
        return msgspec.json.encode({"late_s": _quantiles(late), "turns": turns})

    async def lateness_report(request: web.Request) -> web.Response:
        return web.Response(body=lateness_body(lateness), content_type="application/json")

    async def raw_lateness_report(request: web.Request) -> web.Response:
        return web.Response(body=lateness_body(RAW_LATENESS), content_type="application/json")

    async def memory(request: web.Request) -> web.Response:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        import resource

        return web.json_response({"rss_bytes": rss_pages * resource.getpagesize()})

    app.router.add_get("/bench/raw_ws", raw_ws)
    app.router.add_post("/bench/raw_sse", raw_sse)
    app.router.add_get("/bench/timer", timer_floor)
    app.router.add_get("/bench/lateness", lateness_report)
    app.router.add_get("/bench/raw_lateness", raw_lateness_report)
    app.router.add_get("/bench/memory", memory)
    return app, lateness


async def serve(args: argparse.Namespace) -> None:
    app, _ = make_bench_app(args)
    runner = ApiRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    print(f"port {runner.addresses[0][1]}", flush=True)
    await serve_until_stopped(runner)


def parser() -> argparse.ArgumentParser:
    """The bench server's command line: its own options, then every server and model option."""
    p = argparse.ArgumentParser(prog="python -m sim.bench.server")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--policy", choices=("bench", "agent"), default="bench")
    p.add_argument("--tool-calls", type=int, default=1000, help="agent policy: tool calls before the text answer")
    add_struct_options(p, ServerConfig)  # every server and model option, as `prototype.server` has them
    add_struct_options(p, ModelConfig)
    p.set_defaults(tps=0.0)  # unpaced unless a target paces
    return p


def main(argv: list[str] | None = None) -> int:
    uvloop.run(serve(parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
