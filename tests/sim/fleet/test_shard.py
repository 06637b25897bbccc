"""A fleet run split by replica (sim/fleet/shard.py): the merge equals the whole run, and what
cannot split is refused."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.engine import simulate
from sim.fleet.sessions import SessionTokens, workload_sessions
from sim.fleet.shard import merge, run_shard, shard_positions, simulate_split, split_refusal
from sim.harness.capacity import arrivals
from sim.harness.sweep import dask_executor
from sim.model.config import HOSTED_MODEL
from sim.rollout.workload import WORKLOADS

HOSTED = load_profile("hosted")
N = 36

# Three replicas with a KV budget tight enough to evict, preempt and queue, and a cache timeout.
FLEET = FleetConfig(
    replicas=3,
    router="hash",
    kv_budget_tokens=60_000,
    cache_ttl_s=30.0,
    model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=4),
)


@pytest.fixture(scope="module")
def sessions() -> list[SessionTokens]:
    return workload_sessions(WORKLOADS["agentic"], 3, N)


def _fields(run: FleetRun) -> dict[str, object]:
    out = dataclasses.asdict(run)
    out.pop("kv_token_s")
    return out


def _assert_same(whole: FleetRun, split: FleetRun) -> None:
    assert split.sessions == whole.sessions  # every record: arrival, end, each turn's TTFT, wait, model time
    assert _fields(split) == _fields(whole)  # counts, peak, per-replica work, end
    for kind, token_s in whole.kv_token_s.items():
        assert split.kv_token_s[kind] == pytest.approx(token_s, rel=1e-9, abs=1e-6)  # a float sum's order


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("mode", "fleet"),
    [
        # The fast loop keeps the three plain modes; the switched variants are slow (docs/testing.md).
        ("http", FLEET),
        ("ws", FLEET),
        ("append", FLEET),
        pytest.param("append", msgspec.structs.replace(FLEET, hold_policy="ttl", preempt_held=False), marks=SLOW),
        pytest.param("append", msgspec.structs.replace(FLEET, hold_policy="offload", running_kv="grow"), marks=SLOW),
        pytest.param("ws", msgspec.structs.replace(FLEET, compute="free"), marks=SLOW),
        pytest.param("http_prev", msgspec.structs.replace(FLEET, router="affinity"), marks=SLOW),
        pytest.param("agents", msgspec.structs.replace(FLEET, router="affinity", queue_order="program"), marks=SLOW),
    ],
)
def test_a_split_run_merges_to_the_whole_run(mode: str, fleet: FleetConfig, sessions: list[SessionTokens]) -> None:
    at = arrivals(3, N, 0.5)
    whole = simulate(mode, HOSTED, fleet, sessions, arrivals=at, seed=3)
    split = simulate_split(mode, HOSTED, fleet, sessions, arrivals=at, seed=3)
    assert whole.turns > N and whole.completed == N
    _assert_same(whole, split)


def test_the_point_is_busy_enough_to_show_a_wrong_merge(sessions: list[SessionTokens]) -> None:
    """Each replica does different work, and the budget makes turns wait and evict: a merge that
    dropped or mixed up a shard would not pass the equality above."""
    at = arrivals(3, N, 0.5)
    whole = simulate("append", HOSTED, FLEET, sessions, arrivals=at, seed=3)
    assert len(set(whole.replica_prefill_tokens)) == 3
    assert whole.preemptions > 0 and whole.evicted_tokens > 0
    assert any(w > 0 for s in whole.sessions for w in s.admission_wait_s)


def test_a_reconnection_stays_on_its_replica_under_hash(sessions: list[SessionTokens]) -> None:
    fleet = msgspec.structs.replace(FLEET, websocket=msgspec.structs.replace(FLEET.websocket, lifetime_s=5.0))
    at = arrivals(3, N, 0.5)
    whole = simulate("append", HOSTED, fleet, sessions, arrivals=at, seed=3)
    assert whole.reconnects > 0
    _assert_same(whole, simulate_split("append", HOSTED, fleet, sessions, arrivals=at, seed=3))


def test_routers_that_read_the_fleet_are_refused(sessions: list[SessionTokens]) -> None:
    at = arrivals(3, N, 0.5)
    for router in ("least", "prefix", "random"):
        fleet = msgspec.structs.replace(FLEET, router=router)
        assert split_refusal("http", fleet) is not None
        with pytest.raises(ValueError, match=f"router '{router}' does not split"):
            simulate_split("http", HOSTED, fleet, sessions, arrivals=at)
    affinity = msgspec.structs.replace(FLEET, router="affinity")
    assert split_refusal("http", affinity) is None
    for mode in ("ws", "append"):
        with pytest.raises(ValueError, match="least loaded; use hash"):
            simulate_split(mode, HOSTED, affinity, sessions, arrivals=at)
    assert split_refusal("http", FLEET, closed=True) is not None
    assert split_refusal("http", FLEET, series=True) is not None
    assert shard_positions(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]


def test_a_router_that_reads_the_load_would_merge_wrong(sessions: list[SessionTokens]) -> None:
    """Why `least` is refused: forced through the split, its sessions land elsewhere than in the whole run."""
    fleet = msgspec.structs.replace(FLEET, router="least")
    at = arrivals(3, N, 0.5)
    whole = simulate("http", HOSTED, fleet, sessions, arrivals=at, seed=3)
    parts = shard_positions(N, 3)
    shards = [run_shard("http", HOSTED, fleet, [sessions[i] for i in p], [at[i] for i in p], 3) for p in parts]
    assert merge("http", fleet, sessions, shards).sessions != whole.sessions


def test_the_shards_run_on_a_process_pool(sessions: list[SessionTokens]) -> None:
    at = arrivals(3, N, 0.5)
    whole = simulate("append", HOSTED, FLEET, sessions, arrivals=at, seed=3)
    with ProcessPoolExecutor(2) as pool:
        split = simulate_split("append", HOSTED, FLEET, sessions, arrivals=at, seed=3, executor=pool)
    _assert_same(whole, split)


@pytest.mark.slow
def test_the_shards_run_on_a_dask_cluster(sessions: list[SessionTokens]) -> None:
    at = arrivals(3, N, 0.5)
    whole = simulate("ws", HOSTED, FLEET, sessions, arrivals=at, seed=3)
    with dask_executor("local", workers=2) as executor:
        split = simulate_split("ws", HOSTED, FLEET, sessions, arrivals=at, seed=3, executor=executor)
    _assert_same(whole, split)
