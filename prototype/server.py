"""Command-line entry point and composition root: `python -m prototype.server`.

This is the one module of `prototype/` that imports `sim/` (the token simulator and its
policies, built from `ModelConfig`, and with `--engine` the real engine behind the same seam,
from `EngineConfig`) and the one place uvloop is chosen. Its options are its
own (address, store, seed, policy) and, generated, every field of `ServerConfig` and of
`ModelConfig`. Everything else receives its parts through `make_app`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import msgspec
import uvloop
from aiohttp import web

from sim.engine.backend import check_installed, engine_limits, engine_model
from sim.engine.config import EngineConfig
from sim.engine.process import EngineNotInstalled
from sim.model.config import ModelConfig, build_model
from sim.model.policy import DefaultPolicy, Policy, load_script

from .config import ServerConfig
from .model import TokenModel
from .options import OneLineParser, add_struct_options, option_error, struct_from_args
from .serve.app import LIVE_IDLE_TIMEOUT, ApiRunner, make_app
from .serve.wallclock import AsyncioClock
from .store.memory import MemoryStore
from .store.spec import open_store

__all__ = ["PID_HEADER", "build_parser", "main"]

PID_HEADER = "X-Longrun-Pid"


def build_parser() -> argparse.ArgumentParser:
    """The entry point's own options, then one per leaf of `ServerConfig` (prototype/config.py)
    and of the model stand-in's `ModelConfig` (sim/model/config.py), generated from them."""
    p = OneLineParser(
        prog="python -m prototype.server",
        description="Responses API server (HTTP, SSE, WebSocket mode) on a token-generating simulator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (0 picks a free one)")
    p.add_argument("--store", default="memory", help="response store: memory | sqlite:PATH | redis://HOST:PORT[/DB]")
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT (Linux), so several server processes share one port; give them a redis store",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the simulator and ids")
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
    p.add_argument("--log-level", default="WARNING", help="logging level")
    add_struct_options(p.add_argument_group("server (ServerConfig)"), ServerConfig)  # type: ignore[arg-type]
    add_struct_options(p.add_argument_group("model stand-in (ModelConfig)"), ModelConfig)  # type: ignore[arg-type]
    add_struct_options(p.add_argument_group("real engine (EngineConfig, docs/engine.md)"), EngineConfig)  # type: ignore[arg-type]
    return p


async def serve(
    args: argparse.Namespace, model_config: ModelConfig, config: ServerConfig, engine: EngineConfig
) -> None:
    clock = AsyncioClock(tick_s=0.001)  # uvloop timers are 1 ms anyway: one timer per tick for all streams
    policy: Policy = load_script(args.script) if args.script else DefaultPolicy(tool_calls=args.tool_calls)
    model = build_model(model_config, clock=clock, policy=policy, seed=args.seed)
    if engine.engine_kind == "none":
        await _serve_model(args, model, config, clock)
        return
    # The simulator plans each turn's tokens; the engine prefills and decodes them (docs/engine.md).
    config = msgspec.structs.replace(config, model=engine_limits(engine))
    async with engine_model(engine, planner=model, clock=clock) as real:
        print(f"longrun: {real.dialect.name} engine at {real.url}", flush=True)
        await _serve_model(args, real, config, clock)


async def _serve_model(args: argparse.Namespace, model: TokenModel, config: ServerConfig, clock: AsyncioClock) -> None:
    store = open_store(args.store)
    # Seeded ids repeat on every start. A store that outlives the process (sqlite, redis) would
    # then see a restarted or second process reissue stored ids and overwrite them: random ids there.
    id_seed = args.seed if isinstance(store, MemoryStore) else None
    app = make_app(model=model, store=store, clock=clock, config=config, seed=id_seed)
    app.on_response_prepare.append(_pid_header)
    runner = ApiRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=args.reuse_port or None)
    try:
        await site.start()
    except OSError as exc:  # the port is taken, or the address is not this host's
        await runner.cleanup()
        raise Refused(f"--port: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
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


class Refused(Exception):
    """An option the server cannot serve with, found once it tries (a busy port): `main` prints it
    as one line and exits 2."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:  # the kernel would take 99999 as 99999 mod 65536: refused here
        print(
            f"python -m prototype.server: invalid option: --port: {args.port} is not a TCP port (0–65535)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    model: ModelConfig
    config: ServerConfig
    engine: EngineConfig
    try:
        cls: type[msgspec.Struct] = ModelConfig
        model = struct_from_args(args, ModelConfig)
        cls = ServerConfig
        config = struct_from_args(args, ServerConfig)
        cls = EngineConfig
        engine = struct_from_args(args, EngineConfig)
        check_installed(engine)
    except msgspec.ValidationError as err:
        print(f"python -m prototype.server: invalid option: {option_error(err, cls)}", file=sys.stderr)
        return 2
    except EngineNotInstalled as err:
        print(f"python -m prototype.server: {err}", file=sys.stderr)
        return 2
    if config.idle_timeout_s:
        print(f"python -m prototype.server: invalid option: {LIVE_IDLE_TIMEOUT}", file=sys.stderr)
        return 2
    try:
        uvloop.run(serve(args, model, config, engine))
    except Refused as err:
        print(f"python -m prototype.server: invalid option: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
