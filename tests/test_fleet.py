"""The fleet model (sim/fleet/): agreement with the full path, and each switch doing what it says."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.analysis.records import records_from_rollouts
from sim.analysis.stats import paired_mean
from sim.fleet.engine import FleetConfig, FleetRun, simulate
from sim.fleet.sessions import SessionTokens, custom_sessions
from sim.harness.experiment import CompareConfig, CompareResult, compare

HOSTED = load_profile("hosted")
CALLS = 6


def _sessions(n: int, **kw: float) -> list[SessionTokens]:
    args = {"tool_time_median_s": 0.3, "tool_time_sigma": 0.8, "tool_output_median_tokens": 500}
    args.update(kw)
    return custom_sessions(0, range(n), tool_calls=CALLS, system_prompt_tokens=6000, **args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sequential() -> tuple[CompareConfig, CompareResult]:
    config = CompareConfig(rollouts=3, tool_calls=CALLS, modes=("http", "http_prev", "ws", "append"))
    return config, compare(config, virtual=True, free_cpu=True)


def test_sessions_have_the_full_paths_tokens(sequential: tuple[CompareConfig, CompareResult]) -> None:
    """Prompt and output tokens per turn are the server's own, in every mode."""
    _, result = sequential
    records = records_from_rollouts(result.rollouts, source="v")
    for s in _sessions(3):
        for mode in ("http", "http_prev", "ws", "append"):
            full = sorted((r for r in records if r.mode == mode and r.rollout == str(s.index)), key=lambda r: r.turn)
            assert [r.prompt_tokens for r in full] == s.prompt_tokens()
            assert [r.output_tokens for r in full] == list(s.output_tokens)


@pytest.mark.parametrize("mode", ["http", "http_prev", "ws", "append"])
def test_one_session_at_a_time_reproduces_compare(sequential: tuple[CompareConfig, CompareResult], mode: str) -> None:
    """One replica, unlimited KV, sessions one after another (compare's concurrency 1): each
    turn's first token and end, and each rollout's time, are the full path's, within 0.1 ms a turn."""
    _, result = sequential
    records = records_from_rollouts(result.rollouts, source="v")
    run = simulate(mode, HOSTED, FleetConfig(cache_generated=False), _sessions(3), users=1)
    for rec in run.sessions:
        full = sorted((r for r in records if r.mode == mode and r.rollout == str(rec.index)), key=lambda r: r.turn)
        assert len(rec.ttft_s) == len(full)
        for got, want in zip(rec.ttft_s, full, strict=True):
            assert got == pytest.approx(want.ttft_s, abs=1e-4)
        for got, want in zip(rec.e2e_s, full, strict=True):
            assert got == pytest.approx(want.e2e_s, abs=1e-4)
        rollout = next(r for r in result.rollouts if r.mode == mode and r.index == rec.index)
        assert rec.finished_at - rec.arrived_at == pytest.approx(rollout.completion_s, rel=1e-3)


def test_a_shared_accelerator_agrees_with_the_full_path_per_session() -> None:
    """Four sessions at once on two decode slots: paired by session, the fleet's rollout time is
    the full path's within the pairs' interval or 3 % (ties between simultaneous arrivals break
    differently, so single turns may queue in another order)."""
    n = 8
    modes = ("http", "ws", "append")
    config = CompareConfig.of(rollouts=n, tool_calls=CALLS, modes=modes, concurrency=4, decode_slots=2)
    result = compare(config, virtual=True, free_cpu=True)
    sessions = _sessions(n)
    for mode in modes:
        run = simulate(mode, HOSTED, FleetConfig(cache_generated=False, decode_slots=2), sessions, users=4)
        fleet = {r.index: r.finished_at - r.arrived_at for r in run.sessions}
        full = {r.index: r.completion_s for r in result.rollouts if r.mode == mode}
        diff = paired_mean([fleet[i] - full[i] for i in range(n)])
        mean = sum(full.values()) / n
        assert diff.ci_low <= 0 <= diff.ci_high or abs(diff.value) <= 0.03 * mean, (mode, diff)


def _loaded(mode: str, config: FleetConfig, n: int = 40, gap: float = 0.5, **kw: float) -> FleetRun:
    sessions = _sessions(n, **kw)
    return simulate(mode, HOSTED, config, sessions, arrivals=[gap * i for i in range(n)])


@pytest.mark.parametrize("mode", ["http", "ws", "append"])
@pytest.mark.parametrize("policy", ["hold", "ttl", "release", "offload"])
def test_kv_stays_within_budget_and_no_session_is_lost(mode: str, policy: str) -> None:
    budget = 40_000
    config = FleetConfig(kv_budget_tokens=budget, hold_policy=policy, decode_slots=8, hold_ttl_s=0.2)
    run = _loaded(mode, config)
    assert run.overflow_tokens == 0
    assert 0 < run.kv_peak_tokens <= budget
    assert run.arrived == 40 and run.completed == 40
    cut = simulate(mode, HOSTED, config, _sessions(40), arrivals=[0.5 * i for i in range(40)], max_time_s=10.0)
    in_flight = sum(1 for s in cut.sessions if not s.done)
    assert cut.arrived == cut.completed + in_flight and in_flight > 0


def test_a_budget_below_one_turn_is_overflow_counted_not_hidden() -> None:
    run = _loaded("ws", FleetConfig(kv_budget_tokens=5_000), n=3)
    assert run.completed == 3 and run.overflow_tokens > 0


@pytest.mark.parametrize("mode", ["http", "ws", "append"])
def test_a_turn_that_just_fits_the_budget_runs_within_it(mode: str) -> None:
    """The shared instructions count once: a session whose largest context equals the budget
    completes without overflow (counted twice, it would wait for room that never comes)."""
    (spec,) = _sessions(1)
    largest = max(p + o for p, o in zip(spec.prompt_tokens(), spec.output_tokens, strict=True)) + 14
    run = simulate(mode, HOSTED, FleetConfig(kv_budget_tokens=largest), [spec], arrivals=[0.0])
    assert run.completed == 1 and run.overflow_tokens == 0
    assert run.kv_peak_tokens <= largest


def test_every_mode_gets_the_same_tokens() -> None:
    runs = [_loaded(mode, FleetConfig(kv_budget_tokens=60_000, decode_slots=4)) for mode in ("http", "ws", "append")]
    assert len({r.prompt_tokens for r in runs}) == 1
    assert len({len(s.ttft_s) for r in runs for s in r.sessions}) == 1


def test_held_kv_blocks_admission_and_release_frees_it() -> None:
    """A tight budget and long tools: holding makes turns wait or preempts; releasing does not hold."""
    config = FleetConfig(kv_budget_tokens=50_000, decode_slots=16, preempt_held=False)
    hold = _loaded("append", config, tool_time_median_s=5.0, gap=0.2)
    release = _loaded("append", dataclasses_replace(config, hold_policy="release"), tool_time_median_s=5.0, gap=0.2)
    assert hold.completed == release.completed == 40
    wait = sum(sum(s.admission_wait_s) for s in hold.sessions)
    assert wait > 0
    assert wait > sum(sum(s.admission_wait_s) for s in release.sessions)
    assert hold.kv_token_s["held"] > 0 and release.kv_token_s["held"] == 0
    preempting = _loaded("append", dataclasses_replace(config, preempt_held=True), tool_time_median_s=5.0, gap=0.2)
    assert preempting.preemptions > 0 and preempting.reprefill_tokens > 0


def dataclasses_replace(config: FleetConfig, **changes: object) -> FleetConfig:
    return msgspec.structs.replace(config, **changes)


def _one(mode: str, config: FleetConfig, tool_s: float) -> FleetRun:
    s = _sessions(1)[0]
    s = dataclasses.replace(s, tool_times_s=(tool_s,) * len(s.tool_times_s))
    return simulate(mode, HOSTED, config, [s], arrivals=[0.0])


def test_ttl_release_reprefills_after_the_ttl_and_not_before() -> None:
    config = FleetConfig(hold_policy="ttl", hold_ttl_s=1.0, cache_generated=False)
    short, long = _one("append", config, 0.5), _one("append", config, 2.0)
    assert short.ttl_releases == 0 and short.reprefill_tokens == 0
    assert long.ttl_releases == CALLS
    # Released to the prefix cache: the block-aligned part is a hit, the generated tail is prefilled again.
    assert long.reprefill_tokens > 0


def test_cache_ttl_makes_idle_gaps_miss() -> None:
    kept = _one("ws", FleetConfig(cache_ttl_s=5.0), 2.0)
    expired = _one("ws", FleetConfig(cache_ttl_s=1.0), 2.0)
    assert kept.reprefill_tokens < expired.reprefill_tokens
    assert expired.hit_tokens < kept.hit_tokens


def test_caching_generated_blocks_saves_create_modes_the_output_reprefill() -> None:
    prompt_only = _one("ws", FleetConfig(cache_generated=False), 0.3)
    generated = _one("ws", FleetConfig(cache_generated=True), 0.3)
    assert generated.prefilled_tokens < prompt_only.prefilled_tokens


def test_offload_counts_bytes_and_reloads_instead_of_prefilling() -> None:
    hold = _one("append", FleetConfig(), 0.3)
    offload = _one("append", FleetConfig(hold_policy="offload", offload_gb_per_s=1.0), 0.3)
    assert offload.offload_bytes > 0 and hold.offload_bytes == 0
    assert offload.prefilled_tokens == hold.prefilled_tokens
    assert offload.sessions[0].finished_at > hold.sessions[0].finished_at


def test_a_reconnect_under_affinity_loses_the_cache() -> None:
    stay = _one("ws", FleetConfig(replicas=2), 1.0)
    moved = _one("ws", FleetConfig(replicas=2, connection_limit_s=2.5), 1.0)
    assert stay.reconnects == 0 and moved.reconnects > 0
    assert moved.reprefill_tokens > stay.reprefill_tokens
    assert moved.sessions[0].finished_at > stay.sessions[0].finished_at


@pytest.mark.parametrize("mode", ["ws", "append"])
@pytest.mark.parametrize("router", ["affinity", "random"])
def test_a_next_turn_routed_before_the_last_token_frees_the_right_replica(mode: str, router: str) -> None:
    """A zero tool time sends the next turn before the previous one's last token has freed its
    slot (the end event comes one token early): a reconnect or a new route at that moment must
    free the replica the turn ran on, and leave no held KV behind."""
    s = dataclasses.replace(_sessions(1)[0], tool_times_s=(0.0,) * CALLS)
    config = FleetConfig(replicas=3, router=router, connection_limit_s=0.5, decode_slots=4, kv_budget_tokens=50_000)
    run = simulate(mode, HOSTED, config, [s, dataclasses.replace(s, index=1)], arrivals=[0.0, 0.1])
    assert run.completed == 2 and run.reconnects > 0
    assert run.kv_series == [] and run.preemptions == 0


def test_prefix_routing_finds_the_cache_random_routing_loses_it() -> None:
    n = 20
    prefix = _loaded("ws", FleetConfig(replicas=4, router="prefix"), n=n)
    scattered = _loaded("ws", FleetConfig(replicas=4, router="random"), n=n)
    assert prefix.hit_tokens > scattered.hit_tokens


def test_bad_switches_are_refused() -> None:
    with pytest.raises(ValueError, match="hold_policy"):
        FleetConfig(hold_policy="forever")
    with pytest.raises(ValueError, match="router"):
        FleetConfig(router="roundrobin")
    with pytest.raises(ValueError, match="mode"):
        simulate("steer", HOSTED, FleetConfig(), _sessions(1), arrivals=[0.0])
    assert math.isnan(simulate("ws", HOSTED, FleetConfig(), [], arrivals=[]).end_s) is False
