"""`python -m sim.bench [TARGET ...]`: the performance targets, each against its floor.

Targets (positional, or ``--only``): ``throughput`` (1), ``pacing`` (2), ``fanout`` (3), ``turns`` (4),
``virtual`` (5), ``memory`` (6), ``contract``, ``lanes`` (N lanes on one socket against N sockets),
``record`` (the recorder's added time per turn, sim/bench/record.py), ``stats`` (7, the cost of
intervals: sim/bench/stats.py), ``fleet`` (9), ``engine`` (11, the API's overhead
per turn on a real llama.cpp engine: sim/bench/engine.py); docs/performance.md says what each one
measures. The server (`sim.bench.server`) is a separate process pinned to core 1; this process
(the load generator) pins itself to core 0. Each line:
figure, floor measured in the same run, ratio, target, verdict.
``--report PAGE`` writes the run into PAGE; the exit status is 1 when a target fails or crashes.
``--smoke`` runs every target at a small size (`SMOKE`): figures without verdicts, exit status 1
only when a target crashes; CI runs it so the benchmark cannot rot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import aiohttp
import uvloop

from prototype.wire.schemas import (
    WebsocketTiming,
    decode_server_event,
    encode,
)
from sim.client.client import open_client
from sim.client.loop import run_rollout
from sim.rollout.result import ClientError
from sim.rollout.spec import RolloutSpec, tool_output_text

from . import report as page
from .baseline import against
from .contract import contract_rows, contract_rows_report
from .engine import engine
from .fleet import LARGE_POINT_SESSIONS, fleet
from .lanes import lanes_vs_connections
from .process import bench_process
from .record import recorder_stream_rates, recorder_vs_direct
from .report import Row
from .stats import stats
from .virtual import virtual
from .wsclient import FrameCounter, connect

SERVER_ARGS: list[str] = []  # --server-arg: appended to every bench server's command line
TARGETS: Final = (
    "throughput",
    "pacing",
    "fanout",
    "turns",
    "virtual",
    "memory",
    "contract",
    "lanes",
    "record",
    "stats",
    "fleet",
    "engine",
)
SERVER_CORE: Final = 1
CLIENT_CORE: Final = 0
DELTA: Final = b'{"type":"response.output_text.delta"'
ENDS: Final = (
    b'{"type":"response.completed"',
    b'{"type":"response.incomplete"',
    b'{"type":"response.failed"',
    b'{"type":"error"',
    b'{"type":"end"',
)
SSE_DELTA: Final = b"event: response.output_text.delta\n"


ROWS: list[Row] = []
NOTES: list[str] = []  # the detail lines printed beside the rows, kept for --report
VERDICTS: list[bool] = [True]  # [False] in a smoke run: every row is reported only


def note(text: str) -> None:
    NOTES.append(text)
    print(f"           {text}", flush=True)


def report(target: str, figure: str, value: float, floor: float, ratio: float, goal: str, ok: bool | None) -> None:
    """One row; in a smoke run (`VERDICTS == [False]`) without its verdict: its sizes are not the goal's."""
    row = (
        Row(target, figure, value, floor, ratio, goal, ok)
        if VERDICTS[0]
        else Row(target, figure, value, floor, ratio, "(smoke)", None)
    )
    ROWS.append(row)
    print(row.line(), flush=True)


class PerfClock:
    """`Clock` on `time.perf_counter` (full resolution, for client-side timings)."""

    def now(self) -> float:
        return time.perf_counter()

    def time(self) -> float:
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


def bench_server(*args: str) -> contextlib.AbstractContextManager[int]:
    """A `sim.bench.server` process pinned to the server core; yields its port."""
    return bench_process([*args, *SERVER_ARGS], core=SERVER_CORE)


async def get_json(port: int, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as r:
        return await r.json()


def create_frame(n_tokens: int) -> bytes:
    return encode(
        {"type": "response.create", "model": "sim", "input": "go", "max_output_tokens": n_tokens, "store": False}
    )


async def ws_stream(port: int, path: str, request: bytes) -> FrameCounter:
    counter = FrameCounter(DELTA, ENDS, time.perf_counter)
    conn = await connect(port, path, counter)
    conn.send_text(request)
    await counter.done
    conn.close()
    return counter


async def sse_stream(port: int, path: str, body: bytes | None) -> tuple[int, float]:
    """Delta events counted in an SSE body, and their rate (first to last chunk holding one)."""
    count, first, last, tail = 0, 0.0, 0.0, b""
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}{path}", data=body) as r:
        async for chunk in r.content.iter_any():
            data = tail + chunk
            k = data.count(SSE_DELTA)
            if k:
                last = time.perf_counter()
                first = first or last
                count += k
            tail = data[-(len(SSE_DELTA) - 1) :] if not k else data[data.rfind(SSE_DELTA) + len(SSE_DELTA) :][-40:]
    return count, (count - 1) / (last - first) if last > first else 0.0


# -- 1. throughput --------------------------------------------------------------------------------


async def throughput(n: int, repeats: int) -> None:
    with bench_server("--tps", "0") as port:
        await ws_stream(port, "/v1/responses", create_frame(1000))  # warm-up (tokenizer, caches)
        ours_ws, raw_ws, ours_sse, raw_sse = [], [], [], []
        body = encode({"model": "sim", "input": "go", "max_output_tokens": n, "stream": True, "store": False})
        for _ in range(repeats):
            raw = await ws_stream(port, "/bench/raw_ws", str(n).encode())
            raw_ws.append(raw.rate)
            ours = await ws_stream(port, "/v1/responses", create_frame(n))
            assert ours.count == n, (ours.count, n)
            last = decode_server_event(ours.last_frame)
            assert not isinstance(last, WebsocketTiming) and last.sequence_number == ours.frames - 1  # numbered
            ours_ws.append(ours.rate)
            raw_sse.append((await sse_stream(port, f"/bench/raw_sse?n={n}", None))[1])
            count, rate = await sse_stream(port, "/v1/responses", body)
            assert count == n, (count, n)
            ours_sse.append(rate)
    for name, ours_r, raw_r in (("WebSocket", ours_ws, raw_ws), ("SSE", ours_sse, raw_sse)):
        o, r = statistics.median(ours_r), statistics.median(raw_r)
        report("1", f"{name} delta events/s, 1 conn, unpaced", o, r, o / r, ">= 0.6", o / r >= 0.6)


# -- 2. pacing ------------------------------------------------------------------------------------


async def pacing(rates: list[float], seconds: float) -> None:
    for rate in rates:
        with bench_server("--tps", str(rate)) as port:
            n = max(200, int(rate * seconds))
            await ws_stream(port, "/v1/responses", create_frame(50))  # warm-up
            timer = await get_json(port, f"/bench/timer?rate={rate}&n={min(n, max(200, int(rate * 2)))}")
            await get_json(port, "/bench/raw_lateness")
            await ws_stream(port, "/bench/raw_ws", f"paced {n} {rate} coalesce".encode())
            floor = (await get_json(port, "/bench/raw_lateness"))["late_s"]  # a raw aiohttp sender, same pacing
            await get_json(port, "/bench/lateness")  # clear
            counter = await ws_stream(port, "/v1/responses", create_frame(n))
            rep = await get_json(port, "/bench/lateness")
        note(f"{rate:g} tok/s: loop timer alone p99 {timer['p99'] * 1e3:.3f} ms")
        late = rep["late_s"]
        note(
            f"{rate:g} tok/s: achieved/target {rep['turns'][-1]['achieved'] / rate:.5f} (server), "
            f"{counter.rate / rate:.5f} (client); token lateness p50 {late['p50'] * 1e3:.3f} ms, "
            f"p99 {late['p99'] * 1e3:.3f} ms",
        )
        turn = rep["turns"][-1]
        err = abs(turn["achieved"] / rate - 1)
        client_err = abs(counter.rate / rate - 1)
        report(
            "2", f"{rate:g} tok/s: rate error (server; client {client_err:.2%})", err, 0.0, err, "<= 0.5%", err <= 0.005
        )
        p99, fp99 = rep["late_s"]["p99"] * 1e3, floor["p99"] * 1e3
        report("2", f"{rate:g} tok/s: p99 token lateness ms", p99, fp99, p99 / fp99, "<= 2 ms", p99 <= 2.0)


# -- 3. fan-out -----------------------------------------------------------------------------------


async def _staggered(k: int, spread_s: float, port: int, path: str, request: bytes) -> FrameCounter:
    await asyncio.sleep(k * spread_s)  # arrivals spread out, as independent clients' are
    return await ws_stream(port, path, request)


async def fanout(conns: int, rates: list[float], seconds: float, spread_s: float, per_token: bool = False) -> None:
    """`spread_s`: seconds between two streams' starts (0: all at once, every turn's setup in one burst).
    `per_token`: the server sends one delta per token however late (`--delta-per-token`), and the raw
    floor one frame per token; else both send the tokens due at a wake-up in one frame."""
    for rate in rates:
        n = int(rate * seconds)
        with bench_server("--tps", str(rate), *(["--delta-per-token"] if per_token else [])) as port:
            await ws_stream(port, "/v1/responses", create_frame(50))
            # Floor: the same streams from a raw aiohttp sender paced the same way, in the same process.
            await get_json(port, "/bench/raw_lateness")
            paced = f"paced {n} {rate}{'' if per_token else ' coalesce'}".encode()
            raw_counters = await asyncio.gather(
                *(_staggered(k, spread_s, port, "/bench/raw_ws", paced) for k in range(conns))
            )
            raw = await get_json(port, "/bench/raw_lateness")
            await get_json(port, "/bench/lateness")
            create = create_frame(n)
            counters = await asyncio.gather(
                *(_staggered(k, spread_s, port, "/v1/responses", create) for k in range(conns))
            )
            rep = await get_json(port, "/bench/lateness")
        assert all(c.tokens == n for c in counters + raw_counters), [c.tokens for c in counters]
        frames = sum(c.count for c in counters) / (conns * n)
        raw_frames = sum(c.count for c in raw_counters) / (conns * n)
        worst = min(t["achieved"] for t in rep["turns"]) / rate
        raw_worst = min(t["achieved"] for t in raw["turns"]) / rate
        p99, fp99 = rep["late_s"]["p99"] * 1e3, raw["late_s"]["p99"] * 1e3
        name = f"{conns} x {rate:g} tok/s" + (f", starts {spread_s * 1e3:g} ms apart" if spread_s else "")
        name += ", delta per token" if per_token else ""
        note(f"{name}: delta events per token {frames:.3f} (raw sender {raw_frames:.3f})")
        if per_token:  # the reference rows: what coalescing buys
            report("3", f"{name}: slowest stream / rate", worst, raw_worst, worst / raw_worst, "report", None)
            report("3", f"{name}: p99 lateness ms", p99, fp99, p99 / fp99, "report", None)
        elif rate <= 1000:
            report("3", f"{name}: slowest stream / rate", worst, raw_worst, worst / raw_worst, ">= 0.99", worst >= 0.99)
            report("3", f"{name}: p99 lateness ms", p99, fp99, p99 / fp99, "<= 3 ms", p99 <= 3.0)
        else:
            report(
                "3", f"{name}: slowest stream / rate", worst, raw_worst, worst / raw_worst, "keeps up", worst >= 0.99
            )
            report("3", f"{name}: p99 lateness ms", p99, fp99, p99 / fp99, "report", None)


# -- 4. per-turn overhead -------------------------------------------------------------------------


async def raw_rtt(port: int, size: int, n: int) -> float:
    got: asyncio.Queue[bytes] = asyncio.Queue()
    conn = await connect(port, "/bench/raw_ws", got.put_nowait)
    payload = b"x" * size
    times = []
    for _ in range(n):
        t = time.perf_counter()
        conn.send_text(payload)
        await got.get()
        times.append(time.perf_counter() - t)
    conn.close()
    return statistics.median(times)


def first_event_s(turn: Any) -> float:
    return float(turn.event_log[0][0] - turn.sent_at)


async def turns(n_turns: int, output_tokens: int, http_every: int) -> None:
    clock = PerfClock()
    import numpy as np

    text = tool_output_text(np.random.default_rng(0), output_tokens)
    spec = RolloutSpec(0, 0, "Task 0: fix the failing test.", (0.0,) * n_turns, (text,) * n_turns)
    with bench_server("--tps", "0", "--policy", "agent", "--tool-calls", str(n_turns + 10)) as port:
        base = f"http://127.0.0.1:{port}/v1"
        rtt = await raw_rtt(port, len(text) + 200, 200)
        report("4", "raw WebSocket round trip ms (tool-output size)", rtt * 1e3, rtt * 1e3, 1.0, "floor", None)
        for mode in ("ws", "append", "http"):
            client = open_client(mode, base, clock)
            try:
                result = await run_rollout(client, clock, spec, model="sim")
            finally:
                await client.close()
            firsts = [first_event_s(t) for t in result.turns]  # index k: after k tool outputs
            early = statistics.median(firsts[1:11])
            late = statistics.median(firsts[n_turns - 9 : n_turns + 1])
            ratio = late / early
            if mode == "http":
                curve = ", ".join(f"t{k}={firsts[k] * 1e3:.2f}" for k in range(1, n_turns + 1, http_every))
                note(f"http time to first event by turn (ms): {curve}")
                report(
                    "4", f"http: turn {n_turns} / turn 1 first event", late * 1e3, early * 1e3, ratio, "report", None
                )
            else:
                report(
                    "4",
                    f"{mode}: turn {n_turns} / turn 1 first event",
                    late * 1e3,
                    early * 1e3,
                    ratio,
                    "<= 1.5",
                    ratio <= 1.5,
                )
                report(
                    "4",
                    f"{mode}: turn {n_turns} first event / raw RTT",
                    late * 1e3,
                    rtt * 1e3,
                    late / rtt,
                    "report",
                    None,
                )


# -- 6. memory ------------------------------------------------------------------------------------


def memory_server_args(n_turns: int, cap: int | None) -> list[str]:
    """The memory target's server: the agent policy for `n_turns` tool turns; `cap` its
    `max_cache_bytes`, None to keep the server's default. (The server's flag takes its value as
    it is: 0 is a cap of nothing, under which no chain gets past its first turn.)"""
    args = ["--tps", "0", "--policy", "agent", "--tool-calls", str(n_turns + 10)]
    return args if cap is None else [*args, "--max-cache-bytes", str(cap)]


def chain_ended_by_cap(error: ClientError) -> bool:
    """Whether `error` is how a chain ends under `max_cache_bytes`: an entry over the cap is not
    cached, so the next turn's `previous_response_id` is not found."""
    return isinstance(error.body, dict) and error.body.get("code") == "previous_response_not_found"


async def _held_rollout(client: Any, clock: PerfClock, spec: RolloutSpec, capped: bool) -> None:
    """One rollout on `client`; under a cap its chain may end early, any other error is the bench's."""
    try:
        await run_rollout(client, clock, spec, model="sim")
    except ClientError as e:
        if not (capped and chain_ended_by_cap(e)):
            raise


async def memory(conns: int, n_turns: int, output_tokens: int, cap: int | None) -> None:
    """`cap`: the connections' `max_cache_bytes` (None: the server's default)."""
    clock = PerfClock()
    import numpy as np

    text = tool_output_text(np.random.default_rng(0), output_tokens)
    spec = RolloutSpec(0, 0, "Task 0: fix the failing test.", (0.0,) * n_turns, (text,) * n_turns)
    with bench_server(*memory_server_args(n_turns, cap)) as port:
        base = f"http://127.0.0.1:{port}/v1"
        warm = open_client("ws", base, clock)
        try:
            await _held_rollout(warm, clock, RolloutSpec(0, 0, "warm", (0.0,) * 5, (text,) * 5), cap is not None)
        finally:
            await warm.close()
        before = (await get_json(port, "/bench/memory"))["rss_bytes"]
        clients = []
        history_bytes = 0
        try:
            for _ in range(conns):
                client = open_client("ws", base, clock)
                clients.append(client)
                await _held_rollout(client, clock, spec, cap is not None)
                history_bytes = len(encode(client.history.items))  # type: ignore[attr-defined]
            held = client.history.items  # type: ignore[attr-defined]
            turns_done = sum(item.get("type") == "function_call_output" for item in held)
            after = (await get_json(port, "/bench/memory"))["rss_bytes"]
        finally:
            for client in clients:
                await client.close()
    per = (after - before) / conns
    if cap is None:
        what = f"bytes per idle ws conn, {n_turns}-turn cache"
        report("6", what, per, history_bytes, per / history_bytes, "report", None)
    else:
        what = f"same, max_cache_bytes={cap} (chain ends at turn ~{turns_done})"
        report("6", what, per, cap, per / cap, "<= cap", per <= cap)


# -- CLI ------------------------------------------------------------------------------------------


async def lanes(n: int, tokens: int, repeats: int) -> None:
    with bench_server("--tps", "0") as port:
        on_lanes, on_conns = await lanes_vs_connections(port, n, tokens, repeats)
    what = f"{n} lanes on 1 socket vs {n} sockets, s ({tokens} tok each)"
    report("lanes", what, on_lanes, on_conns, on_lanes / on_conns, "<= 1.25", on_lanes / on_conns <= 1.25)


async def record(n_turns: int, n_tokens: int, rounds: int) -> None:
    with bench_server("--tps", "0", "--policy", "agent", "--tool-calls", str(n_turns + 10)) as port:
        await recorder_vs_direct(port, n_turns, rounds, report, note)

    with bench_server("--tps", "0") as port:
        await recorder_stream_rates(port, n_tokens, rounds, report)


# Every sizing option at its smoke size (`--smoke`): each target runs to the end in seconds, so
# the run checks that the benchmark still works, not how fast anything is. Options given on the
# command line win. tests/sim/bench/test_bench.py checks that every sizing option has an entry here.
SMOKE: Final[dict[str, Any]] = {
    "fleet_sessions": 20,
    "engine_rollouts": 1,
    "fleet_large_sessions": 200,
    "tokens": 2_000,
    "repeats": 1,
    "pacing_rates": "1000,4000",
    "seconds": 0.2,
    "conns": 4,
    "fanout_rates": "1000,4000",
    "fanout_seconds": 0.2,
    "turns": 12,
    "virtual_turns": 10,
    "sweep_points": 2,
    "mem_conns": 1,
    "mem_turns": 12,
    "cap": 20_000,  # under the 12 turns' history: the capped chain ends early, as the full run's does
    "baseline": "HEAD",  # contract: the checked-out code against its own last commit (the figures are noise)
    "baseline_rounds": 2,
    "contract_turns": 3,
    "contract_rounds": 1,
    "lanes": 2,
    "record_turns": 3,
    "stats_baseline": str(Path(__file__).resolve().parents[2]),  # this checkout against itself
    "stats_rounds": 1,
    "stats_compare_rounds": 0,
    "stats_points": 2,
}


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.bench", description=__doc__.split("\n")[0])
    p.add_argument("targets", nargs="*", metavar="TARGET", help=f"run only these: {', '.join(TARGETS)} (default: all)")
    p.add_argument("--only", action="append", choices=TARGETS, help="run only these targets (repeatable)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every target at a small size (a few minutes on 2 cores): figures only, no verdicts; "
        "exits 1 only when a target crashes",
    )
    p.add_argument("--fleet-sessions", type=int, default=1000, help="fleet: sessions of the timed capacity point")
    p.add_argument(
        "--fleet-large-sessions",
        type=int,
        default=LARGE_POINT_SESSIONS,
        help="fleet: sessions of the point measured whole (0 = skip)",
    )
    p.add_argument("--engine-rollouts", type=int, default=3, help="engine: rollouts per mode on the real engine")
    p.add_argument("--tokens", type=int, default=20_000, help="1: tokens per unpaced stream")
    p.add_argument("--repeats", type=int, default=3, help="1: runs of each stream (median)")
    p.add_argument("--pacing-rates", default="65,1000,4000", metavar="R,R,...", help="2: paced rates, tokens/s")
    p.add_argument("--seconds", type=float, default=5.0, help="2: seconds per paced stream")
    p.add_argument("--conns", type=int, default=100, help="3: connections")
    p.add_argument("--fanout-rates", default="1000,4000", metavar="R,R,...", help="3: rates per stream, tokens/s")
    p.add_argument("--fanout-seconds", type=float, default=3.0, help="3: seconds per stream")
    p.add_argument("--turns", type=int, default=150, help="4: tool turns per rollout")
    p.add_argument("--virtual-turns", type=int, default=50, help="5: tool turns of the virtual rollout")
    p.add_argument("--sweep-points", type=int, default=100, help="5: points actually run (1000 = the whole grid)")
    p.add_argument("--mem-conns", type=int, default=16, help="6: idle connections")
    p.add_argument("--mem-turns", type=int, default=200, help="6: turns held by each")
    p.add_argument("--cap", type=int, default=1_000_000, help="6: also run with this max_cache_bytes (0 = skip)")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="run each target here and on git revision REV, interleaved, and print new/old per row "
        "(sim/bench/baseline.py); contract: REV is the revision without the checks",
    )
    p.add_argument("--baseline-rounds", type=int, default=3, help="--baseline: runs of each side, alternating")
    p.add_argument("--contract-turns", type=int, default=100, help="contract: continuation turns per rollout")
    p.add_argument("--contract-rounds", type=int, default=6, help="contract: rollouts per code, alternating")
    p.add_argument("--lanes", type=int, default=8, help="lanes: streams on one connection (and connections)")
    p.add_argument("--record-turns", type=int, default=20, help="record: tool turns per rollout")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to every bench server, for A/B runs (e.g. --server-arg=--render-threads=0)",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="PAGE",
        help="write this run (date, machine, commit, every row) into PAGE, e.g. docs/performance.md",
    )
    p.add_argument("--stats-baseline", metavar="DIR", help="7: a checkout to time the compare and sweep against")
    p.add_argument("--stats-rounds", type=int, default=3, help="7: sweep runs of each side (median)")
    p.add_argument(
        "--stats-compare-rounds", type=int, default=1, help="7: default-compare runs of each side (0 = skip)"
    )
    p.add_argument("--stats-points", type=int, default=100, help="7: sweep points actually run (1000 = all)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options; with `--smoke`, every size not given is its smoke size."""
    p = parser()
    args = p.parse_args(argv)
    against = args.baseline  # given on the command line: the run is against it (not SMOKE's contract baseline)
    if args.baseline_rounds < 1:
        p.error(f"--baseline-rounds must be at least 1, not {args.baseline_rounds}")
    if args.smoke:
        if args.report is not None:
            p.error("--report writes a full run's figures; a --smoke run has none to keep")
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
    args.against = against
    return args


def selected(args: argparse.Namespace) -> list[str]:
    """The targets the run runs, in `TARGETS` order: those named, else all."""
    only = set(args.targets + (args.only or [])) or set(TARGETS)
    return [name for name in TARGETS if name in only]


def jobs(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """Each target's run at the sizes of `args`, by name."""
    contract_baseline: str | None = args.baseline
    return {
        "throughput": lambda: uvloop.run(throughput(args.tokens, args.repeats)),
        "pacing": lambda: uvloop.run(pacing(_rates(args.pacing_rates), args.seconds)),
        "fanout": lambda: [
            *(
                uvloop.run(fanout(args.conns, _rates(args.fanout_rates), args.fanout_seconds, spread))
                for spread in (0.0, 0.01)
            ),
            uvloop.run(fanout(args.conns, _rates(args.fanout_rates), args.fanout_seconds, 0.0, per_token=True)),
        ],
        "turns": lambda: asyncio.run(turns(args.turns, 500, 25)),
        "virtual": lambda: virtual(report, args.sweep_points, args.virtual_turns),
        "memory": lambda: [
            uvloop.run(memory(args.mem_conns, args.mem_turns, 500, cap))
            for cap in ([None, args.cap] if args.cap else [None])
        ],
        "contract": lambda: (
            contract_rows_report(
                report,
                uvloop.run(
                    contract_rows(
                        contract_baseline,
                        args.contract_turns,
                        args.contract_rounds,
                        SERVER_CORE,
                        check_baseline=not args.smoke,
                    )
                ),
                contract_baseline,
            )
            if contract_baseline
            else report("contract", "skipped: needs --baseline REV (a revision without the checks)", 0, 0, 0, "-", None)
        ),
        "lanes": lambda: uvloop.run(lanes(args.lanes, args.tokens // 4, args.repeats)),
        "record": lambda: uvloop.run(record(args.record_turns, args.tokens // 4, args.repeats)),
        "stats": lambda: stats(
            report,
            args.stats_baseline,
            rounds=args.stats_rounds,
            compare_rounds=args.stats_compare_rounds,
            points=args.stats_points,
            equal_rollouts=2,
        ),
        "fleet": lambda: fleet(report, args.fleet_sessions, args.fleet_large_sessions),
        "engine": lambda: engine(report, args.engine_rollouts),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.against is not None:  # every target against a revision, each side in its own process
        given = sys.argv[1:] if argv is None else argv
        return against(args, given, selected(args), parser(), lambda: jobs(args)["contract"]())
    SERVER_ARGS[:] = args.server_arg
    VERDICTS[:] = [not args.smoke]
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {CLIENT_CORE})
    if args.smoke:
        print("smoke run: every target at a small size, figures only (no verdicts; they need the full sizes)")
    print(f"{'target':<10} {'figure':<46} {'value':>12} {'floor':>12} {'ratio':>8}  {'goal':<14} verdict")
    table = jobs(args)
    started = datetime.datetime.now(datetime.UTC)
    about, revision = page.machine(), page.commit()  # the load average before the run's own load
    crashed: list[str] = []
    for name in selected(args):
        t = time.perf_counter()
        try:
            table[name]()
        except Exception:  # the other targets still run; the exit status says this one crashed
            traceback.print_exc()
            crashed.append(name)
        if args.smoke:
            note(f"{name}: {time.perf_counter() - t:.1f} s")
    failed = [r for r in ROWS if r.ok is False]
    print(f"{len(ROWS) - len(failed)} rows ok or reported, {len(failed)} failed")
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
    if args.report is not None:
        command = " ".join(["python -m sim.bench", *(argv if argv is not None else sys.argv[1:])])
        page.write(args.report, page.block(ROWS, NOTES, command, started, about, revision))
        print(f"wrote {args.report}")
    return 1 if crashed else page.exit_status(ROWS)


if __name__ == "__main__":
    raise SystemExit(main())
