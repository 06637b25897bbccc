"""`python -m sim compare`: the same seeded agent rollouts in each API mode, side by side.

Scenario: the server runs in process on loopback with the token simulator at
`--tps`; each mode runs the same rollouts (same tasks, tool outputs, tool times
and model tokens) one after another; the table reports rollout completion time,
TTFT and bytes sent per turn, and the share of `http`'s rollout time each mode saves.

Status: this is the live-loopback comparison of all four modes on the `local`
cost profile (only real CPU work: JSON, validation, rendering with the real BPE
vocabulary). The modeled API-stage costs of the `hosted` profile (issue 4) and
virtual time (issue 5) are not in yet, so the differences printed here are
those of real CPU work and bytes alone.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import uvloop
from aiohttp import web

from prototype.app import ServerConfig, make_app, make_engine
from prototype.client import MODES, Mode, ResponsesClient, open_client
from prototype.pipeline import load_profile
from prototype.store import MemoryStore
from sim.accelerator import SimulatedModel
from sim.inprocess import InProcessServer
from sim.kv import PrefixCache
from sim.live import RolloutResult, make_spec, run_rollout
from sim.policy import DefaultPolicy
from sim.realtime import AsyncioClock
from sim.virtual import VirtualClock, run_virtual


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compare",
        help="run the same rollouts in each mode and print a table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument("--rollouts", type=int, default=3, help="rollouts per mode")
    c.add_argument("--tool-calls", type=int, default=12, help="tool calls per rollout (then a text answer)")
    c.add_argument("--tps", type=float, default=1000.0, help="decode tokens/s (0 = unpaced)")
    c.add_argument("--tool-time", type=float, default=0.05, metavar="SECONDS", help="median simulated tool time")
    c.add_argument("--tool-output-tokens", type=int, default=500, help="median tool output size")
    c.add_argument("--profile", default="local", help="API cost profile: local, hosted, or a JSON file")
    c.add_argument("--model-latency", type=float, default=0.05, metavar="SECONDS", help="fixed model latency")
    c.add_argument("--prefill-tps", type=float, default=20_000.0, help="prefill tokens/s for uncached tokens")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--virtual",
        action="store_true",
        help="run in process on a virtual clock (no sockets; waits cost no wall time)",
    )
    c.add_argument(
        "--free-cpu",
        action="store_true",
        help="with --virtual: real CPU work costs no virtual time (results exactly reproducible)",
    )
    c.add_argument("--quiet", action="store_true", help="no progress line")
    c.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of http,http_prev,ws,append")
    return p


async def compare(args: argparse.Namespace) -> list[RolloutResult]:
    """Every mode's rollouts, one after another, against one server: live on loopback, or
    (`args.virtual`) in process through the same engine and WebSocket adapter."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    clock = VirtualClock() if args.virtual else AsyncioClock()
    model = SimulatedModel(
        clock=clock,
        policy=DefaultPolicy(tool_calls=args.tool_calls),
        seed=args.seed,
        decode_tok_per_s=args.tps if args.tps > 0 else math.inf,
        model_latency_s=args.model_latency,
        prefill_tok_per_s=args.prefill_tps if args.prefill_tps > 0 else math.inf,
    )
    config = ServerConfig(profile=load_profile(args.profile))
    store = MemoryStore()
    runner: web.AppRunner | None = None
    if args.virtual:
        server = InProcessServer(make_engine(model=model, store=store, clock=clock, config=config, seed=args.seed))

        def client_for(mode: Mode) -> ResponsesClient:
            return server.client(mode, clock)
    else:
        runner = web.AppRunner(make_app(model=model, store=store, clock=clock, config=config, seed=args.seed))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

        def client_for(mode: Mode) -> ResponsesClient:
            return open_client(mode, base_url, clock)

    results: list[RolloutResult] = []
    try:
        total = len(modes) * args.rollouts
        for mode in modes:
            # Each mode starts from a cold prefix cache: the same prompts run in every mode, and a
            # cache warmed by the previous mode would favour whichever runs later.
            model.prefix_cache = PrefixCache()
            for i in range(args.rollouts):
                spec = make_spec(
                    args.seed,
                    i,
                    max_turns=args.tool_calls,
                    tool_time_median_s=args.tool_time,
                    tool_time_sigma=0.8,
                    tool_output_median_tokens=args.tool_output_tokens,
                )
                client = client_for(mode)
                try:
                    results.append(await run_rollout(client, clock, spec, model="sim-1k"))
                finally:
                    await client.close()
                if not args.quiet:
                    print(f"\r  {len(results)}/{total} rollouts", end="", file=sys.stderr, flush=True)
        if not args.quiet:
            print(file=sys.stderr)
    finally:
        if runner is not None:
            await runner.cleanup()
    return results


def table(results: list[RolloutResult]) -> str:
    modes = list(dict.fromkeys(r.mode for r in results))
    base = float(np.median([r.completion_s for r in results if r.mode == "http"])) if "http" in modes else None
    rows = [
        f"{'mode':<10} {'rollout p50 s':>13} {'p90 s':>8} {'TTFT p50 ms':>12} {'bytes/turn':>11} "
        f"{'cached tok %':>12} {'time saved vs http':>19}"
    ]
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        comp = np.array([r.completion_s for r in rs])
        turns = [t for r in rs for t in r.turns]
        ttft = np.array([t.ttft_s for t in turns if t.ttft_s is not None]) * 1000
        sent = np.mean([t.bytes_sent for t in turns])
        usage = [t.response.usage for t in turns if t.response.usage is not None]
        cached = (
            100 * sum(u.input_tokens_details.cached_tokens for u in usage) / max(1, sum(u.input_tokens for u in usage))
        )
        p50 = float(np.median(comp))
        speed = f"{(1 - p50 / base) * 100:.1f}%" if base else "-"
        rows.append(
            f"{mode:<10} {p50:>13.3f} {np.percentile(comp, 90):>8.3f} {np.median(ttft):>12.1f} "
            f"{sent:>11.0f} {cached:>12.1f} {speed:>19}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(
        f"longrun compare: {args.rollouts} rollouts x {args.tool_calls} tool calls per mode, "
        f"{args.tps:g} tokens/s, tool time median {args.tool_time:g} s, seed {args.seed} "
        f"({'virtual time' if args.virtual else 'live loopback'}, {args.profile} cost profile)",
        flush=True,
    )
    results = run_virtual(compare(args), charge_cpu=not args.free_cpu) if args.virtual else uvloop.run(compare(args))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
