"""The capacity job (`python -m sim capacity`, docs/capacity.md): goodput against offered load,
and where holding append's KV stops paying.

A config value goes in (`CapacityConfig`, with its seed); out come rows per variant and grid
cell with intervals over seeds. The grid is offered load (open loop, or users in a closed loop)
× KV budget × tool-time tail; a *point* is one cell and one seed. Its sessions are drawn once
(common random numbers: every variant and every cell of the seed serves the same sessions; the
load scales only the arrival times, the tail only the tool times) and served by the fleet model
(sim/fleet/) in every mode and, for append, under every hold policy, waiting for held KV or
preempting it. Points are independent, so a sweep maps them over an executor (a Dask cluster
with `--dask`, sim/harness/sweep.py). The run folder is written by sim/harness/trace.py
(`write_capacity`).

Goodput is the rate of sessions that finish with their turns' p90 time to first token within
`ttft_slo_s`: sessions meeting the SLO / the arrival window (sessions / offered load; a closed
loop's: the run's length). Each variant is also compared with `ws` on the same sessions and
arrivals, paired by seed: the goodput difference and the session time saved.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Annotated, Any, Final, NamedTuple

import msgspec
import numpy as np
from msgspec import Meta
from scipy import stats as scipy_stats

from prototype.pipeline import load_profile
from sim.fleet.config import HOLD_POLICIES, FleetConfig, FleetRun
from sim.fleet.costs import FLEET_MODES, HELD_MODES
from sim.fleet.engine import simulate
from sim.fleet.sessions import SessionTokens, workload_sessions
from sim.fleet.shard import simulate_split, split_refusal
from sim.model.config import HOSTED_MODEL
from sim.rollout.spec import turn_stream
from sim.rollout.workload import WORKLOADS, tool_times, with_tail

__all__ = [
    "POINT_COLUMNS",
    "CapacityConfig",
    "Variant",
    "cache_table",
    "capacity_table",
    "crossover_table",
    "resource_table",
    "point_sessions",
    "run_capacity",
    "run_point",
    "seed_interval",
    "split_refusal_of",
    "variants",
]

POINT_COLUMNS: Final = (
    "mode",
    "policy",
    "preempt",
    "router",
    "offered_load",
    "users",
    "kv_budget_tokens",
    "tool_tail",
    "n",
    "goodput",
    "goodput_ci_low",
    "goodput_ci_high",
    "goodput_vs_ws",
    "goodput_vs_ws_ci_low",
    "goodput_vs_ws_ci_high",
    "saved_vs_ws_pct",
    "saved_vs_ws_ci_low",
    "saved_vs_ws_ci_high",
    "slo_met",
    "ttft_p90_s",
    "e2e_mean_s",
    "admission_wait_p90_s",
    "reprefill_tokens",
    "preemptions",
    "evicted_tokens",
    "ttl_releases",
    "offload_gb",
    "offload_refused",
    "host_drops",
    "host_peak_gb",
    "link_busy_share",
    "preserved",
    "discarded",
    "swapped",
    "hit_rate",
    "hit_rate_ci_low",
    "hit_rate_ci_high",
    "kv_peak_tokens",
    "kv_active_share",
    "kv_held_share",
    "kv_cached_share",
    "tool_p99_s",
    "prefill_tok_per_s",
    "busy_share",
    "model_share",
    "sessions_arrived",
    "sessions_completed",
)
# The job's default hold policies: every one but `minwaste`, which a run asks for (`--policies`).
DEFAULT_POLICIES: Final = tuple(p for p in HOLD_POLICIES if p != "minwaste")
_INTERVALS: Final = ("hit_rate",)  # per point, a mean over seeds with its t interval (beside goodput's)
_MEANS: Final = tuple(  # per point, averaged over seeds
    c for c in POINT_COLUMNS[POINT_COLUMNS.index("slo_met") :] if not c.endswith(("_ci_low", "_ci_high"))
)
_ARRIVAL_STREAM: Final = 0xA441  # turn_stream word of a point's arrival draws
_THINK_STREAM: Final = 0x7414  # turn_stream word of a point's think times (closed loop)


def _default_fleet() -> FleetConfig:
    return FleetConfig(replicas=2, cache_ttl_s=300.0, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=64))


class CapacityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A capacity sweep: the grid is load (or users) × KV budget × tool-time tail × seed, and
    every point serves the same sessions in every variant (mode, hold policy, preemption)."""

    workload: Annotated[str, Meta(description="a workload profile (sim/rollout/workload.py)")] = "agentic"
    sessions: Annotated[int, Meta(ge=1, description="sessions per point")] = 1000
    loads: Annotated[tuple[float, ...], Meta(description="offered loads, sessions/s (open loop)")] = (
        0.5,
        1.0,
        2.0,
        4.0,
    )
    users: Annotated[
        tuple[int, ...], Meta(description="closed loop instead: users, each starting a session after a think time")
    ] = ()
    think_median_s: Annotated[float, Meta(ge=0, description="closed loop: median think time (lognormal)")] = 84.0
    think_sigma: Annotated[float, Meta(ge=0, description="closed loop: the think time's lognormal sigma")] = 1.0
    kv_budgets: Annotated[
        tuple[int, ...], Meta(description="KV budgets per replica in tokens (0 = unlimited), each a grid axis point")
    ] = (300_000, 600_000, 1_200_000)
    tool_tails: Annotated[
        tuple[float, ...], Meta(description="tool-time tails: the workload's lognormal sigma times each")
    ] = (0.5, 1.0)
    seeds: Annotated[int, Meta(ge=1, description="seeds per point: the intervals are over seeds")] = 3
    seed: int = 0
    modes: tuple[str, ...] = ("http", "http_prev", "ws", "append")  # FLEET_MODES also takes agents
    policies: Annotated[
        tuple[str, ...], Meta(description="append's hold policies (minwaste: add it, InferCept's choice per pause)")
    ] = DEFAULT_POLICIES
    preempt: Annotated[
        tuple[bool, ...],
        Meta(description="for hold and ttl: may a turn short of KV preempt held KV (recompute), or does it wait"),
    ] = (False, True)
    profile: Annotated[str, Meta(description="API cost profile: local, hosted, or a JSON file")] = "hosted"
    ttft_slo_s: Annotated[float, Meta(gt=0, description="a session meets the SLO if its p90 TTFT is within this")] = 2.0
    # The fleet's budget, hold policy and preemption are set by each point and variant.
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
        if not self.users and (not self.loads or any(not load > 0 for load in self.loads)):
            raise ValueError("loads: one or more offered loads > 0")
        if any(u < 1 for u in self.users):
            raise ValueError("users: each >= 1")
        if not self.kv_budgets or any(b < 0 for b in self.kv_budgets):
            raise ValueError("kv_budgets: one or more budgets >= 0")
        if not self.tool_tails or any(not t > 0 for t in self.tool_tails):
            raise ValueError("tool_tails: one or more scales > 0")
        if not self.preempt:
            raise ValueError("preempt: true, false, or both")
        if self.fleet.kv_budget_tokens:
            raise ValueError("fleet.kv_budget_tokens: the budgets are a grid axis, set them with kv_budgets")

    @property
    def closed(self) -> bool:
        return bool(self.users)

    def grid(self) -> list[tuple[float, int, float, int]]:
        """Every point: (load or users, KV budget, tool tail, seed), ordered by seed and tail so a
        worker's session cache serves a seed's points in turn."""
        axis: tuple[float, ...] = tuple(map(float, self.users)) if self.closed else self.loads
        return [
            (load, budget, tail, self.seed + i)
            for i in range(self.seeds)
            for tail in self.tool_tails
            for budget in self.kv_budgets
            for load in axis
        ]


class Variant(NamedTuple):
    mode: str
    policy: str  # append's hold policy, "-" for the others
    preempt: str  # "preempt" or "wait" for hold and ttl, "-" where nothing is held

    @classmethod
    def of(cls, row: dict[str, Any]) -> Variant:
        """The variant a row or point is of."""
        return cls(row["mode"], row["policy"], row["preempt"])

    @property
    def label(self) -> str:
        return self.mode + "".join(f" {v}" for v in (self.policy, self.preempt) if v != "-")


def variants(config: CapacityConfig) -> list[Variant]:
    out: list[Variant] = []
    for mode in config.modes:
        if mode not in HELD_MODES:
            out.append(Variant(mode, "-", "-"))
            continue
        for policy in config.policies:
            if policy in ("hold", "ttl"):
                out.extend(Variant(mode, policy, "preempt" if p else "wait") for p in config.preempt)
            else:
                out.append(Variant(mode, policy, "-"))
    return out


@functools.lru_cache(maxsize=4)
def _sessions(workload: str, seed: int, count: int) -> tuple[SessionTokens, ...]:
    """A seed's sessions, kept for its other points (the costly part of a point)."""
    return tuple(workload_sessions(WORKLOADS[workload], seed, count))


def point_sessions(workload: str, seed: int, count: int, tail: float) -> list[SessionTokens]:
    """The seed's sessions with the tool-time tail scaled: the same tokens and draws, other times."""
    sessions = _sessions(workload, seed, count)
    if tail == 1.0:
        return list(sessions)
    w = with_tail(WORKLOADS[workload], tail)
    return [dataclasses.replace(s, tool_times_s=tool_times(w, seed, s.index, len(s.tool_times_s))) for s in sessions]


def arrivals(seed: int, count: int, load: float) -> list[float]:
    """Poisson arrivals at `load` sessions/s: the same unit-rate draws scaled by 1/load."""
    gaps = turn_stream(seed, 0, 0, _ARRIVAL_STREAM).exponential(1.0, count)
    times: list[float] = (np.cumsum(gaps) / load).tolist()
    return times


def think_times(seed: int, count: int, median_s: float, sigma: float) -> list[float]:
    """Closed loop: session i's think time before it starts (lognormal; the first users start at 0)."""
    z = turn_stream(seed, 0, 0, _THINK_STREAM).standard_normal(count)
    times: list[float] = (median_s * np.exp(sigma * z)).tolist()
    return times


def _row(
    config: CapacityConfig,
    v: Variant,
    at: tuple[float, int, float, int],
    sessions: Sequence[SessionTokens],
    run: FleetRun,
) -> dict[str, Any]:
    load, budget, tail, seed = at
    window = run.end_s if config.closed else config.sessions / load
    ttfts = np.array([t for s in run.sessions for t in s.ttft_s])
    waits = np.array([w for s in run.sessions for w in s.admission_wait_s])
    good = sum(1 for s in run.sessions if s.done and np.quantile(s.ttft_s, 0.9) <= config.ttft_slo_s)
    kv = run.kv_token_s
    kv_total = sum(kv.values()) or 1.0
    tools = [t for s in sessions for t in s.tool_times_s]
    return {
        "mode": v.mode,
        "policy": v.policy,
        "preempt": v.preempt,
        "router": config.fleet.router,
        "offered_load": 0.0 if config.closed else load,
        "users": int(load) if config.closed else 0,
        "kv_budget_tokens": budget,
        "tool_tail": tail,
        "seed": seed,
        "goodput": good / window if window > 0 else math.nan,
        "slo_met": good / max(1, run.arrived),
        "ttft_p90_s": float(np.quantile(ttfts, 0.9)) if len(ttfts) else math.nan,
        "e2e_mean_s": float(np.mean([s.finished_at - s.arrived_at for s in run.sessions if s.done])),
        "admission_wait_p90_s": float(np.quantile(waits, 0.9)) if len(waits) else math.nan,
        "reprefill_tokens": run.reprefill_tokens,
        "preemptions": run.preemptions,
        "evicted_tokens": run.evicted_tokens,  # prefix-cache tokens evicted to make room
        "ttl_releases": run.ttl_releases,
        "offload_gb": run.offload_bytes / 1e9,
        # Offload's host memory and link (peak GB of one replica; mean share of the run a link copied).
        "offload_refused": run.offload_refused,
        "host_drops": run.host_drops,
        "host_peak_gb": run.host_peak_bytes / 1e9,
        "link_busy_share": float(np.mean(run.replica_link_busy_s)) / run.end_s if run.end_s > 0 else 0.0,
        # minwaste: pauses that took each choice.
        "preserved": run.pause_choices["preserve"],
        "discarded": run.pause_choices["discard"],
        "swapped": run.pause_choices["swap"],
        "hit_rate": run.hit_tokens / max(1, run.prompt_tokens),
        "kv_peak_tokens": run.kv_peak_tokens,
        "kv_active_share": kv["active"] / kv_total,
        "kv_held_share": kv["held"] / kv_total,
        "kv_cached_share": kv["cached"] / kv_total,
        "tool_p99_s": float(np.quantile(tools, 0.99)) if tools else math.nan,
        # Which resource saturates: a replica's prefill rate and share of time running steps
        # (means over replicas), and the share of session time spent on a replica.
        "prefill_tok_per_s": float(np.mean(run.prefill_tok_per_s())),
        "busy_share": float(np.mean(run.busy_share())),
        "model_share": sum(s.model_s for s in run.sessions if s.done)
        / max(1e-12, sum(s.finished_at - s.arrived_at for s in run.sessions if s.done)),
        "sessions_arrived": run.arrived,
        "sessions_completed": run.completed,
    }


def split_refusal_of(config: CapacityConfig) -> str | None:
    """Why the sweep's points do not split by replica (sim/fleet/shard.py), or None if they do."""
    for mode in config.modes:
        reason = split_refusal(mode, config.fleet, closed=config.closed)
        if reason is not None:
            return reason
    return None


def run_point(
    config: CapacityConfig,
    load: float,
    budget: int,
    tail: float,
    seed: int,
    *,
    split: bool = False,
    shards: Executor | None = None,
) -> list[dict[str, Any]]:
    """One grid point, every variant on the same sessions and arrivals. Picklable. With `split`
    each variant runs as one run per replica (on `shards` if given), merged: the same rows."""
    sessions = point_sessions(config.workload, seed, config.sessions, tail)
    profile = load_profile(config.profile)
    if config.closed:
        timing: dict[str, Any] = {
            "users": int(load),
            "think_s": think_times(seed, config.sessions, config.think_median_s, config.think_sigma),
        }
    else:
        timing = {"arrivals": arrivals(seed, config.sessions, load)}
    rows = []
    for v in variants(config):
        fleet = msgspec.structs.replace(
            config.fleet,
            kv_budget_tokens=budget,
            hold_policy=v.policy if v.policy != "-" else "hold",
            preempt_held=v.preempt != "wait",
        )
        if split:
            run = simulate_split(v.mode, profile, fleet, sessions, seed=seed, executor=shards, **timing)
        else:
            run = simulate(v.mode, profile, fleet, sessions, seed=seed, **timing)
        rows.append(_row(config, v, (load, budget, tail, seed), sessions, run))
    return rows


def seed_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its t interval over seeds (95 %); NaN bounds with one seed."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(scipy_stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, mean - half, mean + half


def _cell(row: dict[str, Any]) -> tuple[float, int, int, float]:
    return (row["offered_load"], row["users"], row["kv_budget_tokens"], row["tool_tail"])


def aggregate(config: CapacityConfig, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, grid cell): the goodput's mean and interval over seeds; against
    `ws` on the same sessions and arrivals, the paired difference in goodput and the session
    time saved (%, > 0: faster than ws), each with its interval; the other columns' means."""
    rows = list(rows)
    ws = {(*_cell(r), r["seed"]): r for r in rows if r["mode"] == "ws"}
    groups: dict[tuple[Variant, tuple[float, int, int, float]], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((Variant.of(row), _cell(row)), []).append(row)
    out = []
    for (v, cell), group in groups.items():
        goodput, low, high = seed_interval([r["goodput"] for r in group])
        point: dict[str, Any] = {
            **v._asdict(),
            "router": config.fleet.router,
            "offered_load": cell[0],
            "users": cell[1],
            "kv_budget_tokens": cell[2],
            "tool_tail": cell[3],
            "n": len(group),
            "goodput": goodput,
            "goodput_ci_low": low,
            "goodput_ci_high": high,
        }
        base = [ws.get((*cell, r["seed"])) for r in group]
        if all(b is not None for b in base):
            pairs = list(zip(group, base, strict=True))
            d = seed_interval([r["goodput"] - b["goodput"] for r, b in pairs])  # type: ignore[index]
            saved = seed_interval([100 * (1 - r["e2e_mean_s"] / b["e2e_mean_s"]) for r, b in pairs])  # type: ignore[index]
        else:
            d = saved = (math.nan, math.nan, math.nan)
        point.update(zip(("goodput_vs_ws", "goodput_vs_ws_ci_low", "goodput_vs_ws_ci_high"), d, strict=True))
        point.update(zip(("saved_vs_ws_pct", "saved_vs_ws_ci_low", "saved_vs_ws_ci_high"), saved, strict=True))
        for column in _MEANS:
            point[column] = float(np.mean([r[column] for r in group]))
        for column in _INTERVALS:
            mean, low, high = seed_interval([r[column] for r in group])
            point.update({column: mean, f"{column}_ci_low": low, f"{column}_ci_high": high})
        out.append({column: point[column] for column in POINT_COLUMNS})  # the table's column order
    order = {v: i for i, v in enumerate(variants(config))}
    return sorted(
        out, key=lambda p: (p["tool_tail"], p["kv_budget_tokens"], order[Variant.of(p)], p["users"], p["offered_load"])
    )


def run_capacity(
    config: CapacityConfig,
    executor: Executor | None = None,
    *,
    on_point: Callable[[int, int], None] | None = None,
    split: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every grid point, on `executor` if given: (per-seed rows, aggregated points). With `split`
    the points run in turn, each variant split into one run per replica on `executor`'s workers
    (refused, ValueError, where the replicas are not independent: `split_refusal_of`)."""
    grid = config.grid()
    mapped: Iterable[list[dict[str, Any]]]
    if split:
        reason = split_refusal_of(config)
        if reason is not None:
            raise ValueError(reason)
        mapped = (run_point(config, *at, split=True, shards=executor) for at in grid)
    elif executor is not None:
        mapped = executor.map(run_point, [config] * len(grid), *(list(axis) for axis in zip(*grid, strict=True)))
    else:
        mapped = (run_point(config, *at) for at in grid)
    rows: list[dict[str, Any]] = []
    for done, point_rows in enumerate(mapped, 1):
        rows.extend(point_rows)
        if on_point is not None:
            on_point(done, len(grid))
    return rows, aggregate(config, rows)


def _blocks(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The points by (tool tail, KV budget), each with a title line."""
    w = WORKLOADS[config.workload]
    out = []
    for tail in config.tool_tails:
        sigmas = "/".join(f"{c.sigma * tail:.2f}" for c in w.tool_time)
        for budget in config.kv_budgets:
            block = [p for p in points if p["tool_tail"] == tail and p["kv_budget_tokens"] == budget]
            p99 = block[0]["tool_p99_s"] if block else math.nan
            kv = f"{budget:,} KV tokens a replica" if budget else "unlimited KV"
            out.append((f"tool tail x{tail:g} (sigma {sigmas}, tool P99 {p99:.1f} s), {kv}", block))
    return out


def _axis(config: CapacityConfig) -> tuple[str, str, list[float]]:
    if config.closed:
        return "users", "users", [float(u) for u in config.users]
    return "offered_load", "load/s", list(config.loads)


def _ci(mean: float, low: float, high: float, fmt: str) -> str:
    if math.isnan(low):
        return format(mean, fmt)
    return f"{mean:{fmt}} ({low:{fmt}}–{high:{fmt}})"


def _compute(fleet: FleetConfig) -> str:
    if fleet.compute == "free":
        model = fleet.model
        return f"free compute ({model.prefill_tok_per_s:g} prefill tokens/s a turn, {model.tps:g} tokens/s a stream)"
    cost = fleet.step_cost()
    return f"priced compute ({cost.name}, {cost.token_budget} tokens a step)"


def capacity_table(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> str:
    """The frontier as text: goodput with its interval per variant, load and grid cell."""
    key, unit, axis = _axis(config)
    loop = f"closed loop, think median {config.think_median_s:g} s" if config.closed else "open loop"
    lines = [
        f"goodput (sessions/s meeting p90 TTFT <= {config.ttft_slo_s:g} s), mean over seeds with 95 % CI, "
        f"n = {config.seeds} seeds; {config.sessions} sessions a point, workload {config.workload}, {loop}, "
        f"{config.fleet.replicas} replicas x {config.fleet.model.decode_slots or 'unlimited'} slots, "
        f"{_compute(config.fleet)}, router {config.fleet.router}",
    ]
    for title, block in _blocks(config, points):
        lines += ["", title, f"{'':<22}" + "".join(f"{unit + ' ' + format(x, 'g'):>24}" for x in axis)]
        for v in variants(config):
            cells = {p[key]: p for p in block if Variant.of(p) == v}
            text = [
                _ci(c["goodput"], c["goodput_ci_low"], c["goodput_ci_high"], ".3f") if c else "-"
                for c in (cells.get(x) for x in axis)
            ]
            lines.append(f"{v.label:<22}" + "".join(f"{t:>24}" for t in text))
    return "\n".join(lines)


def crossover_table(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> str:
    """Where holding stops paying: each append variant's session time saved against `ws` on the
    same sessions (%, paired over seeds, 95 % CI), marked + (saves), - (loses) or ~ (the interval
    holds 0)."""
    key, unit, axis = _axis(config)
    lines = [
        f"session time saved vs ws (%, > 0 faster), paired mean over n = {config.seeds} seeds with 95 % CI; "
        "+ saves, - loses, ~ not resolved"
    ]
    for title, block in _blocks(config, points):
        lines += ["", title, f"{'':<22}" + "".join(f"{unit + ' ' + format(x, 'g'):>28}" for x in axis)]
        for v in variants(config):
            if v.mode != "append":
                continue
            cells = {p[key]: p for p in block if Variant.of(p) == v}
            text = []
            for c in (cells.get(x) for x in axis):
                if c is None or math.isnan(c["saved_vs_ws_pct"]):
                    text.append("-")
                    continue
                low, high = c["saved_vs_ws_ci_low"], c["saved_vs_ws_ci_high"]
                mark = "~" if math.isnan(low) or low <= 0 <= high else "+" if low > 0 else "-"
                text.append(_ci(c["saved_vs_ws_pct"], low, high, "+.1f") + " " + mark)
            lines.append(f"{v.label:<22}" + "".join(f"{t:>28}" for t in text))
    return "\n".join(lines)


def cache_table(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> str:
    """What the prefix cache gave and what making room took from it: per variant and cell, the
    prefix-hit rate (%, mean over seeds with its 95 % CI) and the cached tokens evicted to admit
    turns (millions, mean over seeds), under the run's eviction rule (`evict_tail`)."""
    key, unit, axis = _axis(config)
    rule = "tail blocks first (vLLM's free-block queue)" if config.fleet.evict_tail else "whole entries"
    lines = [
        f"prefix-hit rate % (95 % CI) / cached M tokens evicted to make room, eviction by {rule}; "
        f"n = {config.seeds} seeds"
    ]
    for title, block in _blocks(config, points):
        lines += ["", title, f"{'':<22}" + "".join(f"{unit + ' ' + format(x, 'g'):>30}" for x in axis)]
        for v in variants(config):
            cells = {p[key]: p for p in block if Variant.of(p) == v}
            text = [
                _ci(100 * c["hit_rate"], 100 * c["hit_rate_ci_low"], 100 * c["hit_rate_ci_high"], ".1f")
                + f" / {c['evicted_tokens'] / 1e6:.2f}M"
                if c
                else "-"
                for c in (cells.get(x) for x in axis)
            ]
            lines.append(f"{v.label:<22}" + "".join(f"{t:>30}" for t in text))
    return "\n".join(lines)


def resource_table(config: CapacityConfig, points: Sequence[dict[str, Any]]) -> str:
    """Which resource saturates: per variant and cell, the replicas' share of the run spent
    running steps, their prefill tokens/s (means over replicas), the running turns' share of KV
    token-seconds, and the share of session time spent on a replica (means over seeds)."""
    key, unit, axis = _axis(config)
    lines = [
        "per replica: busy share / prefill k tokens/s; KV share of running turns / share of session time "
        f"on a replica; means over n = {config.seeds} seeds"
    ]
    for title, block in _blocks(config, points):
        lines += ["", title, f"{'':<22}" + "".join(f"{unit + ' ' + format(x, 'g'):>28}" for x in axis)]
        for v in variants(config):
            cells = {p[key]: p for p in block if Variant.of(p) == v}
            text = [
                f"{c['busy_share']:.2f} / {c['prefill_tok_per_s'] / 1000:.1f}k; "
                f"{c['kv_active_share']:.2f} / {c['model_share']:.2f}"
                if c
                else "-"
                for c in (cells.get(x) for x in axis)
            ]
            lines.append(f"{v.label:<22}" + "".join(f"{t:>28}" for t in text))
    return "\n".join(lines)
