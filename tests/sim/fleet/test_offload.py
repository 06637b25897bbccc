"""Offload with a host-memory budget and one link a replica, and InferCept's min-waste choice
(sim/fleet/offload.py, through the fleet's event loop)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.engine import simulate
from sim.fleet.ledger import floor_blocks
from sim.fleet.offload import HostLink, expected_pause_s, min_waste
from sim.fleet.sessions import custom_sessions
from sim.model.config import HOSTED_MODEL
from tests.support import fleet_session

LOCAL = load_profile("local")
HOSTED = load_profile("hosted")
BYTES = FleetConfig().kv_bytes_per_token
INSTRUCTIONS = 16
SHARED = floor_blocks(INSTRUCTIONS + 81)  # the instructions' blocks every prompt starts with (engine.py)
# Free compute without a batch slowdown: two identical sessions run turn for turn alike.
FLAT = msgspec.structs.replace(HOSTED_MODEL, concurrency_slowdown=0.0, cache_generated=False)


def _paused_unique(prompt: int, output: int) -> int:
    """KV a first turn's paused context holds after the shared blocks (output + call template)."""
    return prompt + output + 14 - SHARED


def _records(run: FleetRun) -> list[Any]:
    """Everything a run tells about its sessions and its KV, but the offload's own counters."""
    per_session = [(s.ttft_s, s.e2e_s, s.admission_wait_s, s.reprefill_tokens, s.finished_at) for s in run.sessions]
    counts = (run.prefilled_tokens, run.hit_tokens, run.reprefill_tokens, run.preemptions, run.kv_peak_tokens)
    return [per_session, counts, run.kv_token_s]


# -- the link and the host memory ------------------------------------------------------------


def test_copies_queue_on_the_link_one_at_a_time() -> None:
    link = HostLink(math.inf)
    assert link.transfer(0.0, 2.0) == 2.0
    assert link.transfer(0.0, 2.0) == 4.0  # issued at once: the second waits for the first
    assert link.transfer(10.0, 1.0) == 11.0  # an idle link starts at once
    assert link.busy == 5.0


def test_host_memory_drops_the_oldest_offload_or_refuses_without_dropping() -> None:
    link = HostLink(100)
    for s in (1, 2):
        assert link.room_for(40) == []
        link.put(s, 40)
    assert link.room_for(50) == [1]  # the least recently offloaded goes
    link.put(3, 50)
    assert list(link.entries) == [2, 3] and link.used == 90 and link.peak == 90
    link.take(2, until=5.0)  # being read back: pinned until its copy ends
    assert link.room_for(61) is None and list(link.entries) == [3]  # refused, nothing dropped
    link.settle(5.0)
    assert link.used == 50 and link.room_for(60) == [3] and link.used == 0
    assert HostLink(10).room_for(11) is None


def test_two_offloads_at_once_share_the_link() -> None:
    """Two identical append sessions pause at the same instant on one replica and resume
    together after a 50 ms tool: the second offload ends two copies after the pause, the first reload
    a copy later, the second another copy later. Alone on the replica, each session's reload
    follows its own offload: the shared link delays the first resume by one copy and the
    second by two."""
    prompt, out = 4000, 10
    copy_s = _paused_unique(prompt, out) * BYTES / 1e9  # 1 GB/s: ~1.3 s a copy, far over the API's waits
    config = FleetConfig(compute="free", hold_policy="offload", offload_gb_per_s=1.0, model=FLAT)
    a, b = fleet_session(0, prompt, (out, out), (0.05,)), fleet_session(1, prompt, (out, out), (0.05,))
    together = simulate("append", LOCAL, config, [a, b], arrivals=[0.0, 0.0])
    alone = [simulate("append", LOCAL, config, [s], arrivals=[0.0]).sessions[0] for s in (a, b)]
    for i, copies in ((0, 1), (1, 2)):
        assert together.sessions[i].ttft_s[0] == pytest.approx(alone[i].ttft_s[0], abs=1e-12)
        assert together.sessions[i].ttft_s[1] - alone[i].ttft_s[1] == pytest.approx(copies * copy_s, rel=1e-9)
    assert together.replica_link_busy_s == [pytest.approx(4 * copy_s)]  # two out, two back
    assert together.offload_bytes == 2 * _paused_unique(prompt, out) * BYTES
    assert together.host_peak_bytes == together.offload_bytes


def test_an_uncontended_offload_costs_one_reload_as_before() -> None:
    """One session whose tool outlasts its copy out: the resume waits only for its reload
    (bytes / bandwidth), the one cost offload had before the link was shared, and an unlimited
    host memory (the default) and a large one give the same run."""
    prompt, out = 4000, 10
    copy_s = _paused_unique(prompt, out) * BYTES / 1e9
    s = fleet_session(0, prompt, (out, out), (5.0,))
    base = FleetConfig(compute="free", offload_gb_per_s=1.0, model=FLAT)
    hold = simulate("append", LOCAL, base, [s], arrivals=[0.0])
    offload = simulate("append", LOCAL, msgspec.structs.replace(base, hold_policy="offload"), [s], arrivals=[0.0])
    roomy = msgspec.structs.replace(base, hold_policy="offload", offload_host_gb=1000.0)
    assert offload.sessions[0].ttft_s[1] - hold.sessions[0].ttft_s[1] == pytest.approx(copy_s, rel=1e-9)
    assert _records(simulate("append", LOCAL, roomy, [s], arrivals=[0.0])) == _records(offload)
    assert offload.prefilled_tokens == hold.prefilled_tokens and offload.reprefill_tokens == 0
    assert hold.replica_link_busy_s == [0.0] and hold.host_peak_bytes == 0


def test_a_context_keeps_its_gpu_kv_until_its_copy_out_ends() -> None:
    """Room for one context besides B's turn: B, arriving as A's copy out has begun, waits for
    that copy to end (a copy reads the blocks it moves); released to the prefix cache instead,
    A's blocks are evicted at once and B waits for nothing."""
    prompt, out = 4000, 10
    unique = _paused_unique(prompt, out)
    copy_s = unique * BYTES / 1e9
    config = FleetConfig(compute="free", offload_gb_per_s=1.0, kv_budget_tokens=SHARED + unique + 2000, model=FLAT)
    a, b = fleet_session(0, prompt, (out, out), (60.0,)), fleet_session(1, prompt, (out,), ())
    runs = {
        p: simulate("append", LOCAL, msgspec.structs.replace(config, hold_policy=p), [a, b], arrivals=[0.0, 0.5])
        for p in ("offload", "release")
    }
    assert all(r.completed == 2 and r.overflow_tokens == 0 for r in runs.values())
    assert copy_s - 0.5 < runs["offload"].sessions[1].admission_wait_s[0] < copy_s
    assert runs["release"].sessions[1].admission_wait_s[0] == 0.0
    assert runs["offload"].kv_peak_tokens <= config.kv_budget_tokens


def _loaded(config: FleetConfig) -> FleetRun:
    sessions = custom_sessions(
        0,
        range(24),
        tool_calls=5,
        system_prompt_tokens=3000,
        tool_time_median_s=3.0,
        tool_time_sigma=0.8,
        tool_output_median_tokens=500,
    )
    return simulate("append", HOSTED, config, sessions, arrivals=[0.3 * i for i in range(24)])


def test_a_host_memory_that_fits_nothing_behaves_as_release() -> None:
    base = FleetConfig(replicas=2, kv_budget_tokens=60_000, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=8))
    release = _loaded(msgspec.structs.replace(base, hold_policy="release"))
    none = _loaded(msgspec.structs.replace(base, hold_policy="offload", offload_host_gb=1e-6))  # under one token
    assert _records(none) == _records(release)
    assert none.offload_refused == 24 * 5 and none.offload_bytes == 0 and none.host_peak_bytes == 0
    assert none.replica_link_busy_s == [0.0, 0.0] and none.kv_token_s["held"] == 0
    unlimited = _loaded(msgspec.structs.replace(base, hold_policy="offload"))
    assert unlimited.offload_refused == 0 and unlimited.reprefill_tokens < release.reprefill_tokens


def test_a_full_host_memory_drops_the_oldest_offload_which_prefills_again() -> None:
    """Room for one context: B's offload drops A's (A is paused through a 60 s tool), so A
    prefills its context again at its resume; B reloads its own."""
    prompt, out = 4000, 10
    unique = _paused_unique(prompt, out)
    config = FleetConfig(compute="free", hold_policy="offload", offload_host_gb=1.5 * unique * BYTES / 1e9, model=FLAT)
    a, b = fleet_session(0, prompt, (out, out), (60.0,)), fleet_session(1, prompt, (out, out), (1.0,))
    run = simulate("append", LOCAL, config, [a, b], arrivals=[0.0, 5.0])
    assert run.completed == 2 and run.host_drops == 1 and run.offload_refused == 0
    assert run.sessions[0].reprefill_tokens > 0 and run.sessions[1].reprefill_tokens == 0
    assert run.host_peak_bytes == unique * BYTES <= config.offload_host_gb * 1e9
    assert run.replica_link_busy_s == [pytest.approx(3 * unique * BYTES / (config.offload_gb_per_s * 1e9))]


# -- InferCept's min-waste choice --------------------------------------------------------------


def test_min_waste_weighs_memory_by_time() -> None:
    # preserve 1,000 × 2 s = 2,000; discard 0.1 s × (1,000 + 9,000) = 1,000; swap 2 × 0.01 s × 10,000 = 200
    assert min_waste(1000, 9000, 2.0, 0.1, 0.01) == "swap"
    assert min_waste(1000, 9000, 2.0, 0.1, 0.2) == "discard"
    assert min_waste(1000, 9000, 0.5, 0.1, 0.2) == "preserve"
    assert min_waste(1000, 0, 0.1, 0.1, 1.0) == "preserve"  # a tie goes to preserving


def test_the_expected_pause_is_the_sessions_mean_tool_time_unless_set() -> None:
    sessions = [fleet_session(0, 500, (5, 5, 5), (1.0, 2.0)), fleet_session(1, 500, (5, 5), (6.0,))]
    assert expected_pause_s(FleetConfig(hold_policy="minwaste"), sessions) == 3.0
    assert expected_pause_s(FleetConfig(hold_policy="minwaste", pause_mean_s=0.5), sessions) == 0.5


def _choice_runs(prompt: int, pause_mean_s: float, gb_per_s: float, fixed: str) -> tuple[FleetRun, FleetRun]:
    """The same sessions under `minwaste` and under the fixed policy its choice should be."""
    sessions = [fleet_session(i, prompt, (20, 20, 20), (30.0, 30.0)) for i in range(3)]
    config = FleetConfig(offload_gb_per_s=gb_per_s, pause_mean_s=pause_mean_s, kv_budget_tokens=8 * prompt)
    runs = [
        simulate("append", HOSTED, msgspec.structs.replace(config, hold_policy=p), sessions, arrivals=[0.0, 1.0, 2.0])
        for p in ("minwaste", fixed)
    ]
    return runs[0], runs[1]


@pytest.mark.parametrize(
    ("prompt", "pause_mean_s", "gb_per_s", "choice", "fixed"),
    [
        (20_000, 1e-3, 1000.0, "preserve", "hold"),  # a very short pause: holding wastes least
        (500, 1000.0, 0.1, "discard", "release"),  # long, small context, slow link: recompute it
        (100_000, 1000.0, 1000.0, "swap", "offload"),  # long, huge context, fast link: copy it out
    ],
)
def test_min_waste_takes_each_choice_where_it_wastes_least(
    prompt: int, pause_mean_s: float, gb_per_s: float, choice: str, fixed: str
) -> None:
    """Each pause takes the decisive choice and the run is the fixed policy's, turn for turn:
    were the choice ignored (the context held, say), the discard and swap runs would differ."""
    minwaste, same = _choice_runs(prompt, pause_mean_s, gb_per_s, fixed)
    assert minwaste.pause_choices == {c: (6 if c == choice else 0) for c in ("preserve", "discard", "swap")}
    assert _records(minwaste) == _records(same)
    assert minwaste.offload_bytes == same.offload_bytes and minwaste.replica_link_busy_s == same.replica_link_busy_s
    assert same.pause_choices == {"preserve": 0, "discard": 0, "swap": 0}


def test_min_waste_is_not_any_one_policy() -> None:
    """A short pause keeps a context and a long one does not: per pause, by its own estimate.
    The same sessions with one expected pause held, with another released or offloaded, and
    the three runs differ from each other."""
    runs = {t: _choice_runs(2000, t, 25.0, "hold")[0] for t in (1e-3, 1000.0)}
    assert runs[1e-3].pause_choices["preserve"] == 6
    assert runs[1000.0].pause_choices["preserve"] == 0
    assert _records(runs[1e-3]) != _records(runs[1000.0])


def test_a_reconnect_frees_the_offloaded_context_of_the_response_it_ends() -> None:
    """append under the `hash` router: the connection's lifetime ends during a pause whose
    context is offloaded; the response ends with it, so its host memory is freed, and the next
    pause's offload finds the room without dropping anything."""
    prompt, out = 3000, 20
    context = prompt + out + 14  # the paused context: prompt, output and the call's template
    config = FleetConfig(
        compute="free",
        hold_policy="offload",
        router="hash",
        offload_host_gb=1.5 * context * 327_680 / 1e9,  # room for one paused context, not two
        websocket=msgspec.structs.replace(FleetConfig().websocket, lifetime_s=5.0),
        model=msgspec.structs.replace(HOSTED_MODEL, tps=100.0),
    )
    run = simulate("append", LOCAL, config, [fleet_session(0, prompt, (out, out, out), (10.0, 10.0))], arrivals=[0.0])
    assert run.completed == 1 and run.reconnects >= 1
    assert run.host_drops == 0 and run.offload_refused == 0
