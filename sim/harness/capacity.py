"""The capacity job (`python -m sim capacity`, docs/capacity.md): goodput against offered load.

A config value goes in (`CapacityConfig`, with its seed); out come rows per (mode, hold policy,
offered load) with intervals over seeds. One *point* is one offered load and one seed: its
sessions are drawn once (common random numbers: every mode and policy, and every load, serves
the same sessions; only the arrival times scale with the load) and served by the fleet model
(sim/fleet/) in every mode and, for append, under every hold policy. Points are independent,
so a sweep maps them over an executor (a Dask cluster with `--dask`, sim/harness/sweep.py). The
run folder is written by sim/harness/trace.py (`write_capacity`).

Goodput is the rate of sessions that finish with their turns' p90 time to first token within
`ttft_slo_s`: sessions meeting the SLO / the arrival window (sessions / offered load).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Annotated, Any, Final

import msgspec
import numpy as np
from msgspec import Meta
from scipy import stats as scipy_stats

from prototype.pipeline import load_profile
from sim.fleet.costs import FLEET_MODES
from sim.fleet.engine import HOLD_POLICIES, FleetConfig, FleetRun, simulate
from sim.fleet.sessions import SessionTokens, workload_sessions
from sim.harness.live import turn_stream
from sim.harness.workload import WORKLOADS

__all__ = ["POINT_COLUMNS", "CapacityConfig", "capacity_table", "run_capacity", "run_point", "variants"]

POINT_COLUMNS: Final = (
    "mode",
    "policy",
    "router",
    "offered_load",
    "n",
    "goodput",
    "goodput_ci_low",
    "goodput_ci_high",
    "slo_met",
    "ttft_p90_s",
    "e2e_mean_s",
    "admission_wait_p90_s",
    "reprefill_tokens",
    "preemptions",
    "ttl_releases",
    "offload_gb",
    "hit_rate",
    "kv_peak_tokens",
    "kv_budget_tokens",
    "kv_active_share",
    "kv_held_share",
    "kv_cached_share",
    "sessions_arrived",
    "sessions_completed",
)
_ARRIVAL_STREAM: Final = 0xA441  # turn_stream word of a point's arrival draws


def _default_fleet() -> FleetConfig:
    return FleetConfig(replicas=2, decode_slots=64, kv_budget_tokens=600_000, cache_ttl_s=300.0)


class CapacityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    workload: Annotated[str, Meta(description="a workload profile (sim/harness/workload.py)")] = "agentic"
    sessions: Annotated[int, Meta(ge=1, description="sessions per point")] = 1000
    loads: Annotated[tuple[float, ...], Meta(description="offered loads, sessions/s (open loop)")] = (
        0.5,
        1.0,
        2.0,
        4.0,
    )
    seeds: Annotated[int, Meta(ge=1, description="seeds per load: the intervals are over seeds")] = 3
    seed: int = 0
    modes: tuple[str, ...] = FLEET_MODES
    policies: Annotated[tuple[str, ...], Meta(description="append's hold policies")] = HOLD_POLICIES
    profile: Annotated[str, Meta(description="API cost profile: local, hosted, or a JSON file")] = "hosted"
    ttft_slo_s: Annotated[float, Meta(gt=0, description="a session meets the SLO if its p90 TTFT is within this")] = 2.0
    fleet: FleetConfig = msgspec.field(default_factory=_default_fleet)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        for mode in self.modes:
            if mode not in FLEET_MODES:
                raise ValueError(f"modes: each one of {', '.join(FLEET_MODES)}, got {mode!r}")
        for policy in self.policies:
            if policy not in HOLD_POLICIES:
                raise ValueError(f"policies: each one of {', '.join(HOLD_POLICIES)}, got {policy!r}")
        if not self.loads or any(not load > 0 for load in self.loads):
            raise ValueError("loads: one or more offered loads > 0")


@functools.lru_cache(maxsize=4)
def _sessions(workload: str, seed: int, count: int) -> tuple[SessionTokens, ...]:
    """A point's sessions, kept for the other loads of the seed (the costly part of a point)."""
    return tuple(workload_sessions(WORKLOADS[workload], seed, count))


def arrivals(seed: int, count: int, load: float) -> list[float]:
    """Poisson arrivals at `load` sessions/s: the same unit-rate draws scaled by 1/load."""
    gaps = turn_stream(seed, 0, 0, _ARRIVAL_STREAM).exponential(1.0, count)
    times: list[float] = (np.cumsum(gaps) / load).tolist()
    return times


def variants(config: CapacityConfig) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for mode in config.modes:
        if mode == "append":
            out.extend((mode, policy) for policy in config.policies)
        else:
            out.append((mode, "-"))
    return out


def _row(config: CapacityConfig, mode: str, policy: str, load: float, seed: int, run: FleetRun) -> dict[str, Any]:
    window = config.sessions / load
    ttfts = np.array([t for s in run.sessions for t in s.ttft_s])
    waits = np.array([w for s in run.sessions for w in s.admission_wait_s])
    good = sum(1 for s in run.sessions if s.done and np.quantile(s.ttft_s, 0.9) <= config.ttft_slo_s)
    kv = run.kv_token_s
    kv_total = sum(kv.values()) or 1.0
    return {
        "mode": mode,
        "policy": policy,
        "router": config.fleet.router,
        "offered_load": load,
        "seed": seed,
        "goodput": good / window,
        "slo_met": good / max(1, run.arrived),
        "ttft_p90_s": float(np.quantile(ttfts, 0.9)) if len(ttfts) else math.nan,
        "e2e_mean_s": float(np.mean([s.finished_at - s.arrived_at for s in run.sessions if s.done])),
        "admission_wait_p90_s": float(np.quantile(waits, 0.9)) if len(waits) else math.nan,
        "reprefill_tokens": run.reprefill_tokens,
        "preemptions": run.preemptions,
        "ttl_releases": run.ttl_releases,
        "offload_gb": run.offload_bytes / 1e9,
        "hit_rate": run.hit_tokens / max(1, run.prompt_tokens),
        "kv_peak_tokens": run.kv_peak_tokens,
        "kv_budget_tokens": run.kv_budget_tokens,
        "kv_active_share": kv["active"] / kv_total,
        "kv_held_share": kv["held"] / kv_total,
        "kv_cached_share": kv["cached"] / kv_total,
        "sessions_arrived": run.arrived,
        "sessions_completed": run.completed,
    }


def run_point(config: CapacityConfig, load: float, seed: int) -> list[dict[str, Any]]:
    """One offered load and one seed, every mode and policy on the same sessions. Picklable."""
    sessions = _sessions(config.workload, seed, config.sessions)
    times = arrivals(seed, config.sessions, load)
    profile = load_profile(config.profile)
    rows = []
    for mode, policy in variants(config):
        fleet = config.fleet if policy == "-" else msgspec.structs.replace(config.fleet, hold_policy=policy)
        run = simulate(mode, profile, fleet, sessions, arrivals=times, seed=seed)
        rows.append(_row(config, mode, policy, load, seed, run))
    return rows


def _interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its t interval over seeds (95 %); NaN bounds with one seed."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(scipy_stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, mean - half, mean + half


def aggregate(config: CapacityConfig, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, policy, load): the goodput's mean and interval over seeds, the other
    columns' means (counts: per point)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["policy"], row["offered_load"]), []).append(row)
    out = []
    for (mode, policy, load), group in groups.items():
        goodput, low, high = _interval([r["goodput"] for r in group])
        point: dict[str, Any] = {
            "mode": mode,
            "policy": policy,
            "router": config.fleet.router,
            "offered_load": load,
            "n": len(group),
            "goodput": goodput,
            "goodput_ci_low": low,
            "goodput_ci_high": high,
        }
        for column in POINT_COLUMNS[8:]:
            if column not in point:
                point[column] = float(np.mean([r[column] for r in group]))
        out.append(point)
    order = {v: i for i, v in enumerate(variants(config))}
    return sorted(out, key=lambda p: (order[(p["mode"], p["policy"])], p["offered_load"]))


def run_capacity(
    config: CapacityConfig, executor: Executor | None = None, *, on_point: Callable[[int, int], None] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (load, seed) point, on `executor` if given: (per-seed rows, aggregated points)."""
    grid = [(load, config.seed + i) for i in range(config.seeds) for load in config.loads]
    # Ordered by seed so that a worker's session cache serves a seed's loads in turn.
    mapped: Iterable[list[dict[str, Any]]]
    if executor is not None:
        mapped = executor.map(run_point, [config] * len(grid), [g[0] for g in grid], [g[1] for g in grid])
    else:
        mapped = (run_point(config, load, seed) for load, seed in grid)
    rows: list[dict[str, Any]] = []
    for done, point_rows in enumerate(mapped, 1):
        rows.extend(point_rows)
        if on_point is not None:
            on_point(done, len(grid))
    return rows, aggregate(config, rows)


def capacity_table(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> str:
    """The frontier as text: goodput with its interval per variant and load."""
    lines = [
        f"goodput (sessions/s meeting p90 TTFT <= {config.ttft_slo_s:g} s), mean over seeds with 95 % CI, "
        f"n = seeds; {config.sessions} sessions a point, workload {config.workload}, "
        f"{config.fleet.replicas} replicas x {config.fleet.kv_budget_tokens:,} KV tokens, router {config.fleet.router}",
        f"{'mode':<10} {'policy':<8} {'load/s':>7} {'n':>3} {'goodput':>22} {'SLO met':>8} {'p90 TTFT':>9} "
        f"{'adm. p90':>9} {'re-prefill':>11} {'preempt':>8} {'held KV':>8}",
    ]
    for p in points:
        ci = f"({p['goodput_ci_low']:.3f}–{p['goodput_ci_high']:.3f})" if p["n"] > 1 else ""
        lines.append(
            f"{p['mode']:<10} {p['policy']:<8} {p['offered_load']:>7g} {p['n']:>3} "
            f"{p['goodput']:>8.3f} {ci:>13} {100 * p['slo_met']:>7.1f}% {p['ttft_p90_s']:>8.3f}s "
            f"{p['admission_wait_p90_s']:>8.3f}s {p['reprefill_tokens']:>11,.0f} {p['preemptions']:>8,.0f} "
            f"{100 * p['kv_held_share']:>7.1f}%"
        )
    return "\n".join(lines)
