"""Bench row: what the recorder (`python -m sim record`) adds to a turn, against the same turns direct.

One bench server; the recorder runs in this process (the load generator's core) in front of it.
Per mode (`http`, `ws`) the same seeded rollout runs direct and through the recorder, interleaved
(`rounds` times each), and the figure is the median turn (request sent to terminal event) through
the recorder against the median direct one, as a ratio in one run; the recorder's own measured
latencies (summary.json) are noted beside it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from sim.client.client import open_client
from sim.client.loop import run_rollout
from sim.record.proxy import Recorder, make_recorder_app
from sim.rollout.spec import RolloutSpec

__all__ = ["recorder_vs_direct"]

Report = Callable[[str, str, float, float, float, str, bool | None], None]


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


async def recorder_vs_direct(port: int, turns: int, rounds: int, report: Report, note: Callable[[str], None]) -> None:
    spec = RolloutSpec(0, 0, "Task 0: fix the failing test.", (0.0,) * turns, ("ok",) * turns)
    direct_base = f"http://127.0.0.1:{port}/v1"
    with tempfile.TemporaryDirectory() as out:
        recorder = Recorder(f"http://127.0.0.1:{port}", Path(out))
        runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        proxied_base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        try:
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
        finally:
            await runner.cleanup()  # writes summary.json
        summary = recorder.capture.summary()
    for key in ("proxy_request_ms", "proxy_first_byte_ms"):
        figures = summary[key]
        assert isinstance(figures, dict)
        note(f"record: the recorder's own {key}: median {figures['median']}, p95 {figures['p95']} (n={figures['n']})")
