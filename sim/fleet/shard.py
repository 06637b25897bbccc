"""A fleet run split by replica: one run per replica, on an executor's workers, merged.

When the router places a session without looking at the fleet (`hash`, any mode; `affinity` for
the HTTP modes and `agents`, session i on replica i mod R), nothing one replica does reaches
another: a session's turns, its KV, its queue and its compute stay on its replica, and the event
loop's tie-breaks keep their order within a replica. A run of R replicas is then R runs of one
replica, each with the sessions placed there and their arrival times, and the fleet's run is
their merge:

* the sessions' records, in arrival order (ties by session, as the whole run breaks them);
* the counts (turns, tokens, preemptions, releases, reconnections, bytes), summed;
* the peak KV, the highest of the replicas' peaks (the fleet's peak is a replica's);
* the per-replica work (prefill tokens, time running steps, steps), replica by replica;
* the run's end, the last shard's; the KV token-seconds, summed, each shard's KV after its own
  last event carried to the run's end as the whole run carries it (equal up to the order of a
  floating-point sum).

`split_refusal` names what cannot split: routers that read the replicas' load or cache
(`least`, `prefix`), `random` (one random stream drawn in the order turns are sent across the
fleet), `affinity` for the WebSocket modes (a connection goes to the least loaded replica), a
closed loop (a user freed on one replica starts another session anywhere), and a KV time series
(sampled fleet-wide). `tests/sim/fleet/test_shard.py` checks a split run against the whole one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import msgspec

from prototype.pipeline import CostProfile
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.engine import _Fleet
from sim.fleet.sessions import SessionTokens

__all__ = ["ShardRun", "merge", "run_shard", "shard_positions", "simulate_split", "split_refusal"]

_WEBSOCKET_MODES = ("ws", "append")


def split_refusal(mode: str, config: FleetConfig, *, closed: bool = False, series: bool = False) -> str | None:
    """Why a run of `mode` under `config` does not split exactly by replica, or None if it does."""
    router = config.router
    if closed:
        return "a closed loop does not split by replica: a user freed on one replica starts another session anywhere"
    if series:
        return "a KV time series does not split by replica: it samples the whole fleet at its events"
    if router in ("least", "prefix"):
        return f"router {router!r} does not split by replica: it reads every replica's load or cache; use hash"
    if router == "random":
        return (
            "router 'random' does not split by replica: it draws one random stream in the order turns are sent "
            "across the fleet; use hash"
        )
    if router == "affinity" and mode in _WEBSOCKET_MODES:
        return f"router 'affinity' in {mode} does not split by replica: a connection goes to the least loaded; use hash"
    return None


def shard_positions(sessions: int, replicas: int) -> list[list[int]]:
    """The sessions (positions in the run's list) each replica serves: session i on replica i mod R."""
    return [list(range(j, sessions, replicas)) for j in range(replicas)]


@dataclass(frozen=True, slots=True)
class ShardRun:
    """One replica's run and its KV (active, held, cached) after its last event, the cached part
    as (tokens, when they leave the cache): the shared blocks never, an entry at its timeout."""

    run: FleetRun
    final_kv: tuple[int, int, int]
    cached_until: tuple[tuple[int, float], ...]


def run_shard(
    mode: str,
    profile: CostProfile,
    config: FleetConfig,
    sessions: Sequence[SessionTokens],
    arrivals: Sequence[float],
    seed: int,
    max_time_s: float = math.inf,
) -> ShardRun:
    """One replica's sessions on a fleet of one replica (`config`'s other switches). Picklable."""
    fleet = _Fleet(mode, profile, msgspec.structs.replace(config, replicas=1), sessions, seed, 0.0)
    run = fleet.run(arrivals, 0, (), max_time_s)
    totals = fleet.ledger.totals
    r, ttl = fleet.replicas[0], config.cache_ttl_s
    entries = ((e.tokens, e.last_use + ttl if ttl > 0 else math.inf) for e in r.cache.values())
    shared_until = r.shared_used + config.prefix_ttl_s if config.prefix_ttl_s > 0 else math.inf
    return ShardRun(run, (totals.active, totals.held, totals.cached), ((r.shared, shared_until), *entries))


def merge(mode: str, config: FleetConfig, sessions: Sequence[SessionTokens], shards: Sequence[ShardRun]) -> FleetRun:
    """The fleet's run from its replicas' (shard j: replica j's, as `shard_positions` places them)."""
    position = {s.index: i for i, s in enumerate(sessions)}
    end = max(sh.run.end_s for sh in shards)
    out = FleetRun(mode, [], kv_budget_tokens=config.kv_budget_tokens, end_s=end)
    records = [r for sh in shards for r in sh.run.sessions]
    out.sessions = sorted(records, key=lambda r: (r.arrived_at, position[r.index]))
    for name in (
        "turns",
        "prompt_tokens",
        "hit_tokens",
        "prefilled_tokens",
        "reprefill_tokens",
        "preemptions",
        "evicted_tokens",
        "running_preemptions",
        "ttl_releases",
        "reconnects",
        "offload_bytes",
        "overflow_tokens",
        "offload_refused",
        "host_drops",
    ):
        setattr(out, name, sum(getattr(sh.run, name) for sh in shards))
    out.kv_peak_tokens = max(sh.run.kv_peak_tokens for sh in shards)
    out.host_peak_bytes = max(sh.run.host_peak_bytes for sh in shards)  # per replica, as the whole run counts it
    out.pause_choices = {k: sum(sh.run.pause_choices[k] for sh in shards) for k in out.pause_choices}
    # A replica's KV after its last event lasts to the fleet's end, a cache entry to its timeout
    # if that comes first (the whole run's accounts drop it then).
    for i, kind in enumerate(("active", "held")):
        out.kv_token_s[kind] = sum(sh.run.kv_token_s[kind] + sh.final_kv[i] * (end - sh.run.end_s) for sh in shards)
    out.kv_token_s["cached"] = sum(
        sh.run.kv_token_s["cached"]
        + sum(tokens * max(0.0, min(until, end) - sh.run.end_s) for tokens, until in sh.cached_until)
        for sh in shards
    )
    out.replica_prefill_tokens = [t for sh in shards for t in sh.run.replica_prefill_tokens]
    out.replica_busy_s = [t for sh in shards for t in sh.run.replica_busy_s]
    out.replica_steps = [n for sh in shards for n in sh.run.replica_steps]
    out.replica_link_busy_s = [t for sh in shards for t in sh.run.replica_link_busy_s]
    return out


def simulate_split(
    mode: str,
    profile: CostProfile,
    config: FleetConfig,
    sessions: Sequence[SessionTokens],
    *,
    arrivals: Sequence[float],
    seed: int = 0,
    max_time_s: float = math.inf,
    executor: Executor | None = None,
) -> FleetRun:
    """`simulate(mode, profile, config, sessions, arrivals=arrivals, seed=seed)` run as one run
    per replica (on `executor` if given) and merged. Refuses what does not split exactly."""
    reason = split_refusal(mode, config)
    if reason is not None:
        raise ValueError(reason)
    if len(arrivals) != len(sessions):
        raise ValueError("one arrival time per session")
    if len({s.index for s in sessions}) != len(sessions):
        raise ValueError("sessions: each index once (the merge orders the records by it)")
    parts = shard_positions(len(sessions), config.replicas)
    shard_sessions = [[sessions[i] for i in part] for part in parts]
    shard_arrivals = [[arrivals[i] for i in part] for part in parts]
    n = len(parts)
    args = ([mode] * n, [profile] * n, [config] * n, shard_sessions, shard_arrivals, [seed] * n, [max_time_s] * n)
    shards = list(executor.map(run_shard, *args)) if executor is not None else list(map(run_shard, *args))
    return merge(mode, config, sessions, shards)
