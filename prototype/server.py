"""Command-line entry point and composition root: `python -m prototype.server`.

This is the one module of `prototype/` that imports `sim/` (the default token
simulator, its policies and the asyncio clock) and the one place uvloop is
chosen. Everything else receives its parts through `make_app`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys

import uvloop
from aiohttp import web

from sim.model.accelerator import SimulatedModel
from sim.model.kv import PrefixCache
from sim.model.policy import DefaultPolicy, Policy, load_script
from sim.runtime.realtime import AsyncioClock

from .app import (
    CONTEXT_WINDOW,
    MAX_CACHE_BYTES,
    MAX_CONNECTIONS,
    MAX_MESSAGE_BYTES,
    MAX_OUTPUT_TOKENS,
    MAX_QUEUED_CREATES,
    ServerConfig,
    make_app,
)
from .engine import STEER_BOUNDARIES
from .pipeline import ALL_OPTIMIZATIONS, Optimization, load_profile
from .store import MemoryStore, open_store

__all__ = ["PID_HEADER", "build_parser", "main"]

PID_HEADER = "X-Longrun-Pid"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prototype.server",
        description="Responses API server (HTTP, SSE, WebSocket mode) on a token-generating simulator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (0 picks a free one)")
    p.add_argument("--tps", type=float, default=1000.0, help="decode tokens/s of the simulator; 0 = unpaced")
    p.add_argument(
        "--model-latency", type=float, default=0.0, metavar="SECONDS", help="fixed model latency before the first token"
    )
    p.add_argument(
        "--prefill-tps", type=float, default=0.0, help="prefill tokens/s for uncached prompt tokens; 0 = instant"
    )
    p.add_argument("--kv-capacity", type=int, default=4_000_000, help="prefix-cache capacity in tokens (LRU)")
    p.add_argument("--no-prefix-cache", action="store_true", help="switch the simulator's prefix cache off")
    p.add_argument(
        "--decode-slots", type=int, default=0, help="turns decoding at once; more queue FIFO (0 = unlimited)"
    )
    p.add_argument("--decode-jitter", type=float, default=0.0, help="sigma of a per-turn lognormal decode-rate factor")
    p.add_argument(
        "--async-independent",
        type=float,
        default=0.0,
        help="beta async tools: share of tool-call turns whose outputs the next turn does not need, so the model "
        "decodes on without them (0 = always wait; docs/beta.md)",
    )
    p.add_argument(
        "--concurrency-slowdown", type=float, default=0.0, help="decode rate / (1 + s x (concurrent turns - 1))"
    )
    p.add_argument(
        "--delta-per-token",
        action="store_true",
        help="one delta event per token even when late (default: a late wake-up sends the tokens due in one delta)",
    )
    p.add_argument(
        "--render-threads",
        type=int,
        default=1,
        metavar="N",
        help="threads that tokenize long texts off the event loop (0: tokenize on the loop)",
    )
    p.add_argument(
        "--tool-calls",
        type=int,
        default=10,
        metavar="N",
        help="the default policy calls a tool on the first N turns of a conversation, then answers with text",
    )
    p.add_argument(
        "--script",
        metavar="FILE",
        help="replay per-turn outputs from a JSONL script (format: docs/simulator.md) instead of the default policy",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the simulator and ids")
    p.add_argument("--store", default="memory", help="response store: memory | sqlite:PATH | redis://HOST:PORT[/DB]")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (checked before a WebSocket upgrade)"
    )
    p.add_argument(
        "--connection-limit", type=float, default=3600.0, metavar="SECONDS", help="WebSocket connection lifetime"
    )
    p.add_argument(
        "--append-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="append mode: end a response paused longer than this with response.incomplete (append_timeout)",
    )
    p.add_argument(
        "--reject-concurrent",
        action="store_true",
        help="answer a create sent while one is in flight with 409 instead of queueing it",
    )
    p.add_argument(
        "--refuse-websocket", action="store_true", help="answer WebSocket upgrades with 426 (clients fall back to HTTP)"
    )
    p.add_argument(
        "--profile",
        default="local",
        help="cost profile of the API stages: local (real CPU work only), hosted (calibrated waits), or a JSON file",
    )
    p.add_argument(
        "--disable",
        action="append",
        default=[],
        choices=[o.value for o in Optimization],
        metavar="OPTIMIZATION",
        help="switch off one connection-cache optimization (repeatable): " + ", ".join(o.value for o in Optimization),
    )
    p.add_argument("--sse-done", action="store_true", help="end SSE streams with 'data: [DONE]'")
    p.add_argument(
        "--open-responses",
        action="store_true",
        help="accept the Open Responses spec's request fields OpenAI's lacks (frequency_penalty, presence_penalty)",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT (Linux), so several server processes share one port; give them a redis store",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        metavar="BYTES",
        help="largest request body (413 beyond) and WebSocket frame (close 1009 beyond)",
    )
    p.add_argument(
        "--context-window",
        type=int,
        default=CONTEXT_WINDOW,
        metavar="TOKENS",
        help="the simulated model's context window (gpt-5: 400000); a prompt longer than it minus "
        "--max-output-tokens is a 400 context_length_exceeded (0 = unbounded)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=MAX_OUTPUT_TOKENS,
        metavar="TOKENS",
        help="the simulated model's output limit (gpt-5: 128000), kept free in the context window (0 = none)",
    )
    p.add_argument(
        "--max-queued-creates",
        type=int,
        default=MAX_QUEUED_CREATES,
        metavar="N",
        help="per connection: creates waiting behind the one in flight; one more gets a 429 error event (0 = no limit)",
    )
    p.add_argument(
        "--max-cache-bytes",
        type=int,
        default=MAX_CACHE_BYTES,
        metavar="BYTES",
        help="per connection: a response whose cache entry is larger is not cached (0 = no limit)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help="open WebSocket connections; further upgrades get HTTP 503 (0 = no limit)",
    )
    p.add_argument(
        "--steer-boundary",
        default="item",
        choices=STEER_BOUNDARIES,
        help="where a steer accepted mid-decode stops the response: at the end of the output item in flight "
        "(the steering guide's rule), or at the next token, cutting the item off (docs/beta.md#steering)",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level")
    return p


async def serve(args: argparse.Namespace) -> None:
    clock = AsyncioClock(tick_s=0.001)  # uvloop timers are 1 ms anyway: one timer per tick for all streams
    policy: Policy = load_script(args.script) if args.script else DefaultPolicy(tool_calls=args.tool_calls)
    model = SimulatedModel(
        clock=clock,
        policy=policy,
        seed=args.seed,
        decode_tok_per_s=args.tps if args.tps > 0 else math.inf,
        model_latency_s=args.model_latency,
        prefill_tok_per_s=args.prefill_tps if args.prefill_tps > 0 else math.inf,
        prefix_cache=None if args.no_prefix_cache else PrefixCache(capacity_tokens=args.kv_capacity),
        prefix_caching=not args.no_prefix_cache,
        decode_slots=args.decode_slots or None,
        decode_jitter=args.decode_jitter,
        concurrency_slowdown=args.concurrency_slowdown,
        coalesce_due=not args.delta_per_token,
        async_independent=args.async_independent,
    )
    config = ServerConfig(
        api_key=args.api_key,
        connection_lifetime_s=args.connection_limit,
        reject_concurrent=args.reject_concurrent,
        refuse_websocket=args.refuse_websocket,
        sse_done=args.sse_done,
        open_responses=args.open_responses,
        append_timeout_s=args.append_timeout,
        profile=load_profile(args.profile),
        optimizations=ALL_OPTIMIZATIONS - {Optimization(o) for o in args.disable},
        max_message_bytes=args.max_message_bytes,
        max_queued_creates=args.max_queued_creates or None,
        max_cache_bytes=args.max_cache_bytes or None,
        max_connections=args.max_connections or None,
        render_threads=args.render_threads,
        context_window=args.context_window or None,
        max_output_tokens=args.max_output_tokens or None,
        steer_boundary=args.steer_boundary,
    )
    store = open_store(args.store)
    # Seeded ids repeat on every start. A store that outlives the process (sqlite, redis) would
    # then see a restarted or second process reissue stored ids and overwrite them: random ids there.
    id_seed = args.seed if isinstance(store, MemoryStore) else None
    app = make_app(model=model, store=store, clock=clock, config=config, seed=id_seed)
    app.on_response_prepare.append(_pid_header)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=args.reuse_port or None)
    await site.start()
    port = runner.addresses[0][1]
    print(f"longrun server listening on http://{args.host}:{port}/v1", flush=True)
    await serve_until_stopped(runner)


async def serve_until_stopped(runner: web.AppRunner) -> None:
    """Serve until SIGINT or SIGTERM, then shut the app down (sockets closed, store closed)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


async def _pid_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the process that answered (several may share a port with --reuse-port)."""
    response.headers[PID_HEADER] = str(os.getpid())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
