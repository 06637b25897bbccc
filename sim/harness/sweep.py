"""Parameter sweeps in virtual time: a grid of comparisons, one tidy table.

Covers: tokens/s × tool calls × tool time × RTT × cost profile, every mode at
each point. Scenario: each grid point is one `CompareConfig` (same seed, so the
same rollouts at every point), run in process on a `VirtualTimeLoop` with CPU
work free, so a point's result depends only on its config and the table is
reproducible; points run in parallel on any `concurrent.futures.Executor`: local
processes by default, or a Dask distributed cluster (`Client.get_executor()`).

Rows: one per (point, mode), the point's parameters first, then the metrics of
`sim.analysis.metrics.ModeSummary`, intervals included (`n`, `<metric>_ci_low`, `<metric>_ci_high`).
Common random numbers: rollout r draws the same tool times, output sizes and texts at
every point (sim/rollout/spec.py, per (rollout, turn) streams), so a curve over an axis is the
same rollouts under other parameters, not resampled noise.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import signal
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import msgspec

from prototype.options import get_leaf, replace_leaves
from sim.harness.experiment import CompareConfig, run_compare
from sim.rollout.result import MODES
from sim.runtime.virtual import VirtualClock, run_virtual

__all__ = [
    "AXES",
    "SweepConfig",
    "dask_executor",
    "points",
    "process_pool",
    "run_point",
    "run_sweep",
    "sigterm_as_sigint",
]

AXES = ("tps", "tool_calls", "tool_time_s", "rtt_s", "profile")
SWEEP_ROLLOUTS = 8


class SweepConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    tps: tuple[float, ...] = (65.0, 1000.0, 4000.0)
    tool_calls: tuple[int, ...] = (5, 20, 50)
    tool_time_s: tuple[float, ...] = (
        0.3,
        4.5,
    )  # Codex-interactive median; SWE-bench-like mean (docs/experiments.md#workloads)
    rtt_s: tuple[float, ...] = (0.04,)
    profile: tuple[str, ...] = ("hosted",)
    modes: tuple[str, ...] = MODES
    # Everything else. 8 rollouts per point: enough for a paired interval on every saving
    # (the studentized bootstrap needs n >= 4), and common random numbers keep a curve's
    # points on the same rollouts, so neighbouring points differ by their parameters only.
    base: CompareConfig = CompareConfig(rollouts=SWEEP_ROLLOUTS)


def points(sweep: SweepConfig) -> list[CompareConfig]:
    """The grid, in a fixed order (the last axis varies fastest)."""
    grid = itertools.product(sweep.tps, sweep.tool_calls, sweep.tool_time_s, sweep.rtt_s, sweep.profile)
    return [
        replace_leaves(
            sweep.base, tps=tps, tool_calls=calls, tool_time_s=tool, rtt_s=rtt, profile=profile, modes=sweep.modes
        )
        for tps, calls, tool, rtt, profile in grid
    ]


def run_point(config: CompareConfig) -> list[dict[str, Any]]:
    """One grid point in virtual time with free CPU: rows for its modes. Picklable for process pools."""
    # Summaries need each turn's first token and end only: no clock wake-up per token. CPU is
    # free, so the pure work of a turn may be looked up from earlier points (`sim.runtime.memo`).
    main = run_compare(config, VirtualClock(), virtual=True, pace_by_turn=True, memoize=True)
    result = run_virtual(main, charge_cpu=False)
    params = {axis: get_leaf(config, axis) for axis in AXES}
    return [{**params, **msgspec.to_builtins(s)} for s in result.summary]


def run_sweep(
    sweep: SweepConfig,
    executor: Executor | None = None,
    *,
    on_point: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Every point of the grid; in parallel on `executor` if given."""
    grid = points(sweep)
    results: Iterable[list[dict[str, Any]]] = executor.map(run_point, grid) if executor else map(run_point, grid)
    rows: list[dict[str, Any]] = []
    for done, point_rows in enumerate(results, 1):
        rows.extend(point_rows)
        if on_point is not None:
            on_point(done, len(grid))
    return rows


@contextlib.contextmanager
def dask_executor(address: str, *, workers: int = 2) -> Iterator[Executor]:
    """A `concurrent.futures` executor on a Dask cluster: `address` of a running scheduler,
    or "local" for a cluster of `workers` processes on loopback (closed on exit)."""
    # Imported here: Dask is the optional `cluster` extra, needed only by this function.
    from distributed import Client, LocalCluster

    if address == "local":
        cluster = LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=workers, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        )
        with cluster, Client(cluster) as client:  # type: ignore[no-untyped-call]
            yield client.get_executor()
    else:
        with Client(address) as client:  # type: ignore[no-untyped-call]
            yield client.get_executor()


STOP_TIMEOUT_S = 10.0
"""How long an interrupted pool's workers get to exit after SIGTERM before SIGKILL."""


@contextlib.contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A `ProcessPoolExecutor` of `workers` processes that an exception or an interrupt stops at
    once: its queued points cancelled and its workers terminated (a plain pool's exit would wait
    for every queued point). The workers are the multiprocessing children that appear while it
    runs, not the pool's private table."""
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(workers)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        mine = [p for p in multiprocessing.active_children() if p not in before]
        for process in mine:
            process.terminate()
        for process in mine:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        raise
    pool.shutdown(wait=True)


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """SIGTERM raises `KeyboardInterrupt` as SIGINT does while the block runs, so a job stopped by
    a timeout or a scheduler unwinds the same way as one stopped with Ctrl-C: its pools and
    clusters close on the way out instead of outliving it."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
