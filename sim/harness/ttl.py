"""The prefix cache's idle timeout against its hit rate and the KV it stores (`python -m sim
ttl-curve`, docs/capacity.md#the-idle-timeout-trade-off): TraceLab's eviction trade-off measured
on the fleet model.

TraceLab (arXiv 2606.30560; its `artifacts/prefix_cache/eviction_tradeoff`) sweeps an idle
timeout τ over its trace with an idealised cache whose only imperfection is the timeout: a step
whose idle gap before it (tool latency, or human think time) is at most τ hits its whole
reusable prefix, any other step prefills its whole context; the hit rate is token-weighted over
steps that have a predecessor. Its storage ratio is time-weighted: R(τ) = Σ min(gapᵢ, τ) / Σ
generation spans, suspended KV over active KV, every step's KV counted the same size.

Here the same sweep runs the fleet model itself: one point is one seed's sessions, served in one
mode (`ws` by default: a prefix cache and nothing held) with an unbounded KV budget (TraceLab's
cache has no capacity limit), with `cache_ttl_s` = τ. Per point the fleet's own measures:

* `hit_rate`: prompt tokens found cached over prompt tokens, every turn (the first turns' hits
  are the shared instructions);
* `stored_over_active`: the replicas' held + cached KV token-seconds over their running turns'
  (cached includes the shared instructions and the entries of sessions that have ended, kept
  until their timeout);

and, beside them, TraceLab's rule applied to the same sessions and the fleet's own model time:

* `tracelab_hit_rate`: Σ over tool steps with gap ≤ τ of (prompt − fresh) / Σ prompt, with
  fresh the tool output and its template (the context's growth less the previous output);
* `tracelab_storage_ratio`: Σ min(tool time, τ) / Σ the sessions' model time (admission to
  last token).

Points share their seed's sessions and arrivals (common random numbers), so the rise from one
timeout to the next is paired by seed. Intervals are the capacity job's t intervals over seeds.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Annotated, Any, Final, cast

import msgspec
import numpy as np
from msgspec import Meta

from prototype.options import add_struct_options, leaves, struct_from_args
from prototype.pipeline import CostProfile, load_profile
from sim.fleet.config import READ_LEAVES, FleetConfig
from sim.fleet.costs import FLEET_MODES
from sim.fleet.engine import _Fleet
from sim.fleet.ledger import KVLedger
from sim.fleet.sessions import STEP_TEMPLATE_TOKENS, SessionTokens
from sim.fleet.state import Replica
from sim.harness.capacity import arrivals, point_sessions, seed_interval
from sim.harness.console import add_save_options, start_folder
from sim.model.config import HOSTED_MODEL
from sim.rollout.workload import WORKLOADS

__all__ = [
    "MEASURES",
    "TTLCurveConfig",
    "one_ttl_curve",
    "one_ttl_table",
    "run_ttl_point",
    "tracelab_rule",
    "ttl_curve",
    "ttl_main",
    "ttl_options",
    "ttl_table",
]

MEASURES: Final = (
    "hit_rate",
    "stored_over_active",
    "suspended_over_active",
    "tracelab_hit_rate",
    "tracelab_storage_ratio",
)


class _SplitLedger(KVLedger):
    """The KV ledger, its cached KV token-seconds split further: the entries of sessions that
    have ended (kept until their timeout, never read again) and the shared instructions' blocks.
    What is left of held + cached is the KV of sessions in flight between their turns:
    TraceLab's suspended KV."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ended: set[int] = set()
        self.ended_tokens = 0  # tokens of ended sessions' cache entries, fleet-wide
        self.ended_token_s = 0.0
        self.shared_token_s = 0.0
        self.since = 0.0

    def integrate(self, t: float) -> None:
        dt = t - self.since
        if dt > 0:
            self.ended_token_s += self.ended_tokens * dt
            self.shared_token_s += sum(r.shared for r in self.replicas) * dt
            self.since = t
        super().integrate(t)

    def session_ended(self, s: int) -> None:
        self.ended.add(s)
        self.ended_tokens += self._entry(s)

    def _entry(self, s: int) -> int:
        return sum(r.cache[s].tokens for r in self.replicas if s in r.cache)

    def drop_entry(self, r: Replica, s: int) -> int:
        dropped = super().drop_entry(r, s)
        if s in self.ended:
            self.ended_tokens -= dropped
        return dropped

    def evict_entry(self, r: Replica, s: int, deficit: int) -> None:
        before = self._entry(s) if s in self.ended else 0
        super().evict_entry(r, s, deficit)
        if s in self.ended:
            self.ended_tokens -= before - self._entry(s)


class _SplitStored(_Fleet):
    """The fleet on a `_SplitLedger`, told when each session ends."""

    def __init__(
        self, mode: str, profile: CostProfile, config: FleetConfig, sessions: Sequence[SessionTokens], seed: int
    ) -> None:
        super().__init__(mode, profile, config, sessions, seed, 0.0, _SplitLedger)
        self.split = cast(_SplitLedger, self.ledger)

    def turn_done(self, s: int, k: int) -> None:
        super().turn_done(s, k)
        if k == self.states[s].spec.turns - 1:
            self.split.session_ended(s)


def _fleet() -> FleetConfig:
    return FleetConfig(replicas=2, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=64))


class TTLCurveConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A sweep of the prefix cache's idle timeout: every timeout serves each seed's same sessions."""

    workload: Annotated[str, Meta(description="a workload profile (sim/rollout/workload.py)")] = "agentic"
    sessions: Annotated[int, Meta(ge=1, description="sessions per point")] = 500
    load: Annotated[float, Meta(gt=0, description="offered load, sessions/s (open loop, Poisson)")] = 0.25
    ttls_s: Annotated[tuple[float, ...], Meta(description="prefix-cache idle timeouts swept, seconds")] = (
        60.0,
        300.0,
        600.0,
        1800.0,
        3600.0,
    )
    seeds: Annotated[int, Meta(ge=1, description="seeds per timeout: the intervals are over seeds")] = 5
    seed: int = 0
    one_ttl: Annotated[
        bool,
        Meta(
            description="also serve every timeout with the shared instructions on the same timeout (one TTL for "
            "every breakpoint) and give the difference from the sweep's own instructions' TTL (--prefix-ttl-s: 0 "
            "keeps them for the run; 43200 is a 12 h breakpoint), paired by seed"
        ),
    ] = False
    mode: Annotated[str, Meta(description="the API mode served (ws: a prefix cache, nothing held)")] = "ws"
    profile: Annotated[str, Meta(description="API cost profile: local, hosted, or a JSON file")] = "hosted"
    # The timeout is the sweep's axis; the KV budget defaults to unbounded, as TraceLab's cache.
    fleet: FleetConfig = msgspec.field(default_factory=_fleet)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.mode not in FLEET_MODES:
            raise ValueError(f"mode: one of {', '.join(FLEET_MODES)}, got {self.mode!r}")
        if not self.ttls_s or any(not t > 0 for t in self.ttls_s):
            raise ValueError("ttls_s: one or more timeouts > 0 (0 would mean no timeout)")
        if list(self.ttls_s) != sorted(set(self.ttls_s)):
            raise ValueError("ttls_s: increasing, each once")
        if self.fleet.cache_ttl_s:
            raise ValueError("fleet.cache_ttl_s: the timeouts are the sweep's axis, set them with ttls_s")
        if self.fleet.prefix_ttl_s and self.fleet.prefix_ttl_s < self.ttls_s[-1]:
            raise ValueError(
                f"prefix_ttl_s: at least the longest timeout ({self.ttls_s[-1]:g} s): the turns' entries "
                "extend the instructions and expire first"
            )


def tracelab_rule(sessions: Sequence[SessionTokens], model_s: float, ttl_s: float) -> tuple[float, float]:
    """TraceLab's idealised cache on `sessions`: (hit rate, storage ratio R) at timeout `ttl_s`,
    with `model_s` the sessions' total model time (the generation spans R divides by)."""
    hit = total = idle = 0.0
    for s in sessions:
        prompts = s.prompt_tokens()
        for k in range(1, s.turns):
            gap = s.tool_times_s[k - 1]
            fresh = s.tool_tokens[k - 1] + STEP_TEMPLATE_TOKENS
            total += prompts[k]
            if gap <= ttl_s:
                hit += prompts[k] - fresh
            idle += min(gap, ttl_s)
    return (hit / total if total else math.nan), (idle / model_s if model_s > 0 else math.nan)


def run_ttl_point(config: TTLCurveConfig, ttl_s: float, seed: int, one_ttl: bool = False) -> dict[str, Any]:
    """One timeout and seed: the fleet's measures and TraceLab's rule on the same run (with
    `one_ttl`, the instructions expire on the same timeout). Picklable."""
    sessions = point_sessions(config.workload, seed, config.sessions, 1.0)
    fleet = msgspec.structs.replace(config.fleet, cache_ttl_s=ttl_s)
    if one_ttl:
        fleet = msgspec.structs.replace(fleet, prefix_ttl_s=ttl_s)
    traced = _SplitStored(config.mode, load_profile(config.profile), fleet, sessions, seed)
    run = traced.run(arrivals(seed, config.sessions, config.load), 0, (), math.inf)
    kv = run.kv_token_s
    suspended = kv["held"] + kv["cached"] - traced.split.ended_token_s - traced.split.shared_token_s
    model_s = sum(r.model_s for r in run.sessions)
    tl_hit, tl_ratio = tracelab_rule(sessions, model_s, ttl_s)
    return {
        "ttl_s": ttl_s,
        "seed": seed,
        "hit_rate": run.hit_tokens / max(1, run.prompt_tokens),
        "stored_over_active": (kv["held"] + kv["cached"]) / kv["active"] if kv["active"] > 0 else math.nan,
        "suspended_over_active": suspended / kv["active"] if kv["active"] > 0 else math.nan,
        "tracelab_hit_rate": tl_hit,
        "tracelab_storage_ratio": tl_ratio,
        "sessions_completed": run.completed,
    }


def _aggregate(config: TTLCurveConfig, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per timeout: each measure's mean and t interval over seeds, and its rise from the previous
    timeout paired by seed (the same sessions and arrivals), with its interval."""
    by = {(r["ttl_s"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = []
    for i, ttl in enumerate(config.ttls_s):
        point: dict[str, Any] = {"ttl_s": ttl, "n": len(seeds)}
        for m in MEASURES:
            values = [by[ttl, s][m] for s in seeds]
            point.update(zip((m, f"{m}_ci_low", f"{m}_ci_high"), seed_interval(values), strict=True))
            if i:
                before = config.ttls_s[i - 1]
                rise = seed_interval([by[ttl, s][m] - by[before, s][m] for s in seeds])
            else:
                rise = (math.nan, math.nan, math.nan)
            point.update(zip((f"{m}_rise", f"{m}_rise_ci_low", f"{m}_rise_ci_high"), rise, strict=True))
        out.append(point)
    return out


def ttl_curve(
    config: TTLCurveConfig, executor: Executor | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (timeout, seed), on `executor` if given: (rows per seed, points with intervals)."""
    grid = [(ttl, config.seed + i) for i in range(config.seeds) for ttl in config.ttls_s]
    ttls, seeds = [t for t, _ in grid], [s for _, s in grid]
    if executor is not None:
        rows = list(executor.map(run_ttl_point, [config] * len(grid), ttls, seeds))
    else:
        rows = [run_ttl_point(config, t, s) for t, s in grid]
    return rows, _aggregate(config, rows)


def one_ttl_curve(
    config: TTLCurveConfig, rows: Sequence[dict[str, Any]], executor: Executor | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every (timeout, seed) again with the instructions on the same timeout: (those rows, per
    timeout the sweep's rows less them, paired by seed, each difference's mean and t interval)."""
    grid = [(ttl, config.seed + i) for i in range(config.seeds) for ttl in config.ttls_s]
    ttls, seeds = [t for t, _ in grid], [s for _, s in grid]
    if executor is not None:
        one = list(executor.map(run_ttl_point, [config] * len(grid), ttls, seeds, [True] * len(grid)))
    else:
        one = [run_ttl_point(config, t, s, True) for t, s in grid]
    own = {(r["ttl_s"], r["seed"]): r for r in rows}
    out = []
    for ttl in config.ttls_s:
        pairs = [(own[ttl, r["seed"]], r) for r in one if r["ttl_s"] == ttl]
        point: dict[str, Any] = {"ttl_s": ttl, "n": len(pairs)}
        for m in ("hit_rate", "stored_over_active"):
            low_high = seed_interval([a[m] - b[m] for a, b in pairs])
            point.update(zip((f"{m}_gain", f"{m}_gain_ci_low", f"{m}_gain_ci_high"), low_high, strict=True))
            point[f"{m}_one_ttl"] = float(np.mean([b[m] for _, b in pairs]))
        out.append(point)
    return one, out


def one_ttl_table(config: TTLCurveConfig, points: Sequence[dict[str, Any]]) -> str:
    own = f"{config.fleet.prefix_ttl_s:g} s" if config.fleet.prefix_ttl_s else "the whole run"
    lines = [
        f"the instructions on their own TTL ({own}) against one TTL for every breakpoint: the sweep's measure less "
        f"the one-TTL run's, paired by seed (n = {config.seeds}), 95 % t interval",
        f"{'timeout':>8} {'one-TTL hit rate':>17} {'hit rate gain, points':>26} {'one-TTL stored/active':>22} "
        f"{'stored/active gain':>22}",
    ]
    for p in points:
        hit = _ci(100 * p["hit_rate_gain"], 100 * p["hit_rate_gain_ci_low"], 100 * p["hit_rate_gain_ci_high"], "+.2f")
        m = "stored_over_active_gain"
        stored = _ci(p[m], p[f"{m}_ci_low"], p[f"{m}_ci_high"], "+.3f")
        lines.append(
            f"{p['ttl_s']:>7g}s {100 * p['hit_rate_one_ttl']:>15.1f} % {hit:>26} "
            f"{p['stored_over_active_one_ttl']:>22.2f} {stored:>22}"
        )
    return "\n".join(lines)


def _ci(mean: float, low: float, high: float, fmt: str) -> str:
    return format(mean, fmt) if math.isnan(low) else f"{mean:{fmt}} ({low:{fmt}}–{high:{fmt}})"


def ttl_table(config: TTLCurveConfig, points: Sequence[dict[str, Any]]) -> str:
    budget = (
        f"{config.fleet.kv_budget_tokens:,} KV tokens a replica" if config.fleet.kv_budget_tokens else "unbounded KV"
    )
    lines = [
        f"prefix-cache idle timeout sweep: {config.mode}, {config.sessions} {config.workload} sessions a point at "
        f"{config.load:g} sessions/s, {config.fleet.replicas} replicas, {budget}; mean over n = {config.seeds} "
        "seeds with 95 % t interval",
        f"{'timeout':>8} {'fleet hit rate':>24} {'stored/active':>22} {'in flight/active':>22} "
        f"{'TraceLab-rule hit':>24} {'TraceLab-rule R':>22}",
    ]
    for p in points:
        cells = [
            _ci(100 * p[m], 100 * p[f"{m}_ci_low"], 100 * p[f"{m}_ci_high"], ".1f") + " %"
            if "hit" in m
            else _ci(p[m], p[f"{m}_ci_low"], p[f"{m}_ci_high"], ".2f")
            for m in MEASURES
        ]
        widths = (24, 22, 22, 24, 22)
        lines.append(f"{p['ttl_s']:>7g}s " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------

_UNREAD: Final = tuple(  # the nested model's and server's leaves the fleet does not read
    field.name
    for path, field in leaves(TTLCurveConfig)
    if path[:1] == ("fleet",) and path[1:2] and path[1] in READ_LEAVES and field.name not in READ_LEAVES[path[1]]
)


def ttl_options(sub: Any) -> None:
    """`python -m sim ttl-curve`'s parser, one option per leaf of `TTLCurveConfig`."""
    p = sub.add_parser(
        "ttl-curve",
        help="sweep the prefix cache's idle timeout: hit rate and stored over active KV with intervals over "
        "seeds, beside TraceLab's rule on the same sessions (docs/capacity.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_struct_options(p, TTLCurveConfig, skip=("cache_ttl_s", *_UNREAD))
    p.add_argument("--workers", type=int, default=1, help="local worker processes")
    add_save_options(p, "config.json, points.csv, runs.csv", "ttl-curve")


def ttl_main(args: argparse.Namespace) -> int:
    # Imported here: the run-folder writer is the one module that writes files.
    from sim.harness.trace import write_json, write_table

    try:
        config = struct_from_args(args, TTLCurveConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folder = start_folder(args, "ttl-curve")
    if args.workers > 1:
        from sim.harness.sweep import process_pool

        with process_pool(args.workers) as pool:
            rows, points = ttl_curve(config, pool)
            one_rows, gains = one_ttl_curve(config, rows, pool) if config.one_ttl else ([], [])
    else:
        rows, points = ttl_curve(config)
        one_rows, gains = one_ttl_curve(config, rows) if config.one_ttl else ([], [])
    print(ttl_table(config, points))
    if gains:
        print("\n" + one_ttl_table(config, gains))
    if folder is not None:
        out = folder
        write_json({"config": config}, out / "config.json")
        write_table([{k: _round(v) for k, v in p.items()} for p in points], out / "points.csv")
        write_table([{k: _round(v) for k, v in r.items()} for r in rows], out / "runs.csv")
        if gains:
            write_table([{k: _round(v) for k, v in p.items()} for p in gains], out / "one_ttl_points.csv")
            write_table([{k: _round(v) for k, v in r.items()} for r in one_rows], out / "one_ttl_runs.csv")
        print(f"run folder: {out}", file=sys.stderr)
    return 0


def _round(value: Any) -> Any:
    return float(np.round(value, 6)) if isinstance(value, float) else value
