"""The fleet's results pinned: a small run per family of switches, its whole `FleetRun` (every
count, every session's records, the KV series) hashed, the digests taken from the code before
the fleet was split into its loop and parts. A change of the model's rules changes a digest on
purpose (re-pin it in the same commit, saying why); a refactor must leave them all."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.fleet.config import FleetConfig
from sim.fleet.engine import simulate
from sim.fleet.sessions import array_sessions
from sim.model.config import HOSTED_MODEL
from sim.rollout.workload import WORKLOADS

DIGESTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "append-hold-priced": ("append", {}, "78c7fae8d782ab60055f104b29ec04de5c254824a50c1b8c5c7fd8f15292cc83"),
    "append-minwaste-grow": (
        "append",
        {"hold_policy": "minwaste", "running_kv": "grow", "offload_host_gb": 4.0},
        "31be80b906f028ceb00f6e4e8585359323b5efe41e5ed0c4e13500025892eac0",
    ),
    "append-ttl-free": (
        "append",
        {"hold_policy": "ttl", "compute": "free", "ttl_rule": "reload", "cache_ttl_s": 5.0},
        "4e7d7d592a2800e885f7a833680a69165f5acf85bad28cc035df8ad532d390c5",
    ),
    "ws-prefix-program": (
        "ws",
        {"router": "prefix", "queue_order": "program", "admission": "greedy"},
        "d370bbb274e42074b59be9a32cfd17c409608335ea537759e38248ed9ca60d76",
    ),
    "agents-offload-slots": (
        "agents",
        {"hold_policy": "offload", "held_slot": True, "slot_cache": True},
        "b3ebd32f8c2951ea766bf3a280bfaa47a0677f2b65a2ed5ac04aa44e2f470278",
    ),
    "http-least": (
        "http",
        {"router": "least", "evict_tail": False},
        "3a0530dbb67417fe4a77a8659310d874296cf9c7a2e65d79d8513c5c09f98671",
    ),
}


@pytest.mark.parametrize("case", DIGESTS)
def test_a_small_run_is_byte_identical_to_its_pinned_digest(case: str) -> None:
    """24 sessions on 2 replicas of 100,000 tokens (evictions and, with held KV, preemptions in
    every case), all of the run's result hashed by its repr (floats to the last bit)."""
    mode, switches, digest = DIGESTS[case]
    sessions = array_sessions(WORKLOADS["interactive"], 1, 24)
    model = msgspec.structs.replace(HOSTED_MODEL, decode_slots=8)
    config = FleetConfig(replicas=2, kv_budget_tokens=100_000, hold_ttl_s=1.0, model=model, **switches)
    times = [0.5 * i for i in range(len(sessions))]
    run = simulate(mode, load_profile("hosted"), config, sessions, arrivals=times, seed=1, series_every_s=1.0)
    assert run.completed == len(sessions) and run.evicted_tokens > 0
    assert hashlib.sha256(repr(dataclasses.asdict(run)).encode()).hexdigest() == digest
