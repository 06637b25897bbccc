"""The fleet model (sim/fleet/): agreement with the full path, and each switch doing what it says."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import numpy as np
import pytest

from prototype.config import WebSocketConfig
from prototype.pipeline import load_profile
from sim.analysis.records import records_from_rollouts
from sim.analysis.stats import paired_mean
from sim.fleet.compute import ENGINES, StepCost
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.engine import SHARED_PREFIX_EXTRA, simulate
from sim.fleet.holds import CALL_TEMPLATE_TOKENS
from sim.fleet.predict import predict_turns
from sim.fleet.sessions import SessionTokens, array_sessions, custom_sessions, workload_sessions
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.model.config import HOSTED_MODEL
from sim.rollout.spec import tool_output_text
from sim.rollout.workload import WORKLOADS
from tests.support import flat_step_cost, fleet_session

HOSTED = load_profile("hosted")
CALLS = 6


def _sessions(n: int, **kw: float) -> list[SessionTokens]:
    args = {"tool_time_median_s": 0.3, "tool_time_sigma": 0.8, "tool_output_median_tokens": 500}
    args.update(kw)
    return custom_sessions(0, range(n), tool_calls=CALLS, system_prompt_tokens=6000, **args)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sequential() -> tuple[CompareConfig, CompareResult]:
    config = CompareConfig(rollouts=3, tool_calls=CALLS, modes=("http", "http_prev", "ws", "append", "agents"))
    return config, compare(config, virtual=True, free_cpu=True)


def test_sessions_have_the_full_paths_tokens(sequential: tuple[CompareConfig, CompareResult]) -> None:
    """Prompt and output tokens per turn are the server's own, in every mode."""
    _, result = sequential
    records = records_from_rollouts(result.rollouts, source="v")
    for s in _sessions(3):
        for mode in ("http", "http_prev", "ws", "append", "agents"):
            full = sorted((r for r in records if r.mode == mode and r.rollout == str(s.index)), key=lambda r: r.turn)
            assert [r.prompt_tokens for r in full] == s.prompt_tokens()
            assert [r.output_tokens for r in full] == list(s.output_tokens)


@pytest.mark.parametrize("mode", ["http", "http_prev", "ws", "append", "agents"])
def test_one_session_at_a_time_reproduces_compare(sequential: tuple[CompareConfig, CompareResult], mode: str) -> None:
    """One replica, unlimited KV, sessions one after another (compare's concurrency 1): each
    turn's first token and end, and each rollout's time, are the full path's, within 0.1 ms a turn."""
    _, result = sequential
    records = records_from_rollouts(result.rollouts, source="v")
    run = simulate(mode, HOSTED, FleetConfig(compute="free"), _sessions(3), users=1)
    for rec in run.sessions:
        full = sorted((r for r in records if r.mode == mode and r.rollout == str(rec.index)), key=lambda r: r.turn)
        assert len(rec.ttft_s) == len(full)
        for got, want in zip(rec.ttft_s, full, strict=True):
            assert got == pytest.approx(want.ttft_s, abs=1e-4)
        for got, want in zip(rec.e2e_s, full, strict=True):
            assert got == pytest.approx(want.e2e_s, abs=1e-4)
        rollout = next(r for r in result.rollouts if r.mode == mode and r.index == rec.index)
        assert rec.finished_at - rec.arrived_at == pytest.approx(rollout.completion_s, rel=1e-3)


@pytest.mark.slow
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
        run = simulate(
            mode,
            HOSTED,
            FleetConfig(compute="free", model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=2)),
            sessions,
            users=4,
        )
        fleet = {r.index: r.finished_at - r.arrived_at for r in run.sessions}
        full = {r.index: r.completion_s for r in result.rollouts if r.mode == mode}
        diff = paired_mean([fleet[i] - full[i] for i in range(n)])
        mean = sum(full.values()) / n
        assert diff.ci_low <= 0 <= diff.ci_high or abs(diff.value) <= 0.03 * mean, (mode, diff)


def _loaded(mode: str, config: FleetConfig, n: int = 40, gap: float = 0.5, **kw: float) -> FleetRun:
    sessions = _sessions(n, **kw)
    return simulate(mode, HOSTED, config, sessions, arrivals=[gap * i for i in range(n)])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["http", "ws", "append"])
@pytest.mark.parametrize("policy", ["hold", "ttl", "release", "offload", "minwaste"])
def test_kv_stays_within_budget_and_no_session_is_lost(mode: str, policy: str) -> None:
    budget = 40_000
    config = FleetConfig(
        kv_budget_tokens=budget,
        hold_policy=policy,
        hold_ttl_s=0.2,
        model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=8),
    )
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
    runs = [
        _loaded(mode, FleetConfig(kv_budget_tokens=60_000, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=4)))
        for mode in ("http", "ws", "append")
    ]
    assert len({r.prompt_tokens for r in runs}) == 1
    assert len({len(s.ttft_s) for r in runs for s in r.sessions}) == 1


def test_held_kv_blocks_admission_and_release_frees_it() -> None:
    """A tight budget and long tools: holding makes turns wait or preempts; releasing does not hold."""
    config = FleetConfig(
        kv_budget_tokens=50_000, preempt_held=False, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=16)
    )
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
    config = FleetConfig(
        hold_policy="ttl", hold_ttl_s=1.0, model=msgspec.structs.replace(HOSTED_MODEL, cache_generated=False)
    )
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
    prompt_only = _one("ws", FleetConfig(model=msgspec.structs.replace(HOSTED_MODEL, cache_generated=False)), 0.3)
    generated = _one("ws", FleetConfig(model=msgspec.structs.replace(HOSTED_MODEL, cache_generated=True)), 0.3)
    assert generated.prefilled_tokens < prompt_only.prefilled_tokens


def test_offload_counts_bytes_and_reloads_instead_of_prefilling() -> None:
    hold = _one("append", FleetConfig(), 0.3)
    offload = _one("append", FleetConfig(hold_policy="offload", offload_gb_per_s=1.0), 0.3)
    assert offload.offload_bytes > 0 and hold.offload_bytes == 0
    assert offload.prefilled_tokens == hold.prefilled_tokens
    assert offload.sessions[0].finished_at > hold.sessions[0].finished_at


def test_a_reconnect_under_affinity_loses_the_cache() -> None:
    stay = _one("ws", FleetConfig(replicas=2), 1.0)
    moved = _one("ws", FleetConfig(replicas=2, websocket=WebSocketConfig(lifetime_s=2.5)), 1.0)
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
    config = FleetConfig(
        replicas=3,
        router=router,
        kv_budget_tokens=50_000,
        model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=4),
        websocket=WebSocketConfig(lifetime_s=0.5),
    )
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


# -- priced compute and the engines' scheduling rules ------------------------------------------

LOCAL = load_profile("local")
# The free model's rates as a step cost: 20,000 prefill tokens/s, 1,000 tokens/s a stream at any batch.
FREE_LIKE = StepCost(
    name="free-like",
    step_s=1e-3,
    prefill_s_per_token=1 / 20_000,
    prefill_s_per_token_ctx=0.0,
    decode_batch=(1,),
    decode_s_per_token=(1e-9,),
    decode_s_per_ctx_token=0.0,
    token_budget=8192,
)


def test_a_turn_alone_costs_its_steps() -> None:
    """One turn on an idle llama.cpp replica: the prompt in budget-sized chunks, then one decode
    step a token at the measured one-stream rate."""
    (spec,) = _sessions(1)
    spec = dataclasses.replace(spec, output_tokens=spec.output_tokens[:1], tool_times_s=(), tool_tokens=())
    run = simulate("ws", LOCAL, FleetConfig(engine="llamacpp-cpu"), [spec], arrivals=[0.0])
    cost = ENGINES["llamacpp-cpu"]
    prompt, out = spec.first_prompt_tokens, spec.output_tokens[0]
    assert prompt > cost.token_budget  # chunked
    prefill = cost.prefill_alone_s(0, prompt)
    assert run.sessions[0].ttft_s == [pytest.approx(prefill, rel=1e-9)]
    assert run.sessions[0].e2e_s == [pytest.approx(prefill + (out - 1) / 70.8, rel=1e-9)]
    assert run.replica_busy_s == [pytest.approx(run.sessions[0].model_s)]
    assert run.replica_prefill_tokens == [prompt]


def test_decode_slows_with_the_batch_as_measured() -> None:
    cost = ENGINES["llamacpp-cpu"]
    assert [round(n / cost.decode_s(n), 1) for n in (1, 2, 4)] == [70.8, 76.9, 111.7]
    assert cost.decode_s(3) / 3 == pytest.approx((cost.decode_s(2) / 2 + cost.decode_s(4) / 4) / 2)
    assert cost.decode_s(8) / 8 == pytest.approx(cost.decode_s(4) / 4)  # flat past the last point
    with pytest.raises(ValueError, match="decode_batch"):
        msgspec.structs.replace(cost, decode_batch=(2, 1))


def test_a_shared_prefill_budget_saturates_a_load_free_prefill_calls_fine() -> None:
    """The same sessions, arrivals and per-request rates: free compute prefills every turn at
    20,000 tokens/s in parallel and calls a load asking twice that fine; one shared prefill
    budget at that rate saturates (the replica is busy throughout, TTFT and session time grow),
    and at half that load both are fine."""
    sessions = _sessions(120, tool_output_median_tokens=2000)
    for gap, saturated in ((0.5, True), (2.0, False)):
        times = [gap * i for i in range(len(sessions))]
        free = simulate("ws", HOSTED, FleetConfig(compute="free"), sessions, arrivals=times)
        priced = simulate("ws", HOSTED, FleetConfig(engine=FREE_LIKE), sessions, arrivals=times)
        demand = free.prefilled_tokens / times[-1]
        ttft = {
            name: np.quantile([t for s in r.sessions for t in s.ttft_s], 0.9)
            for name, r in (("free", free), ("priced", priced))
        }
        session_s = {
            name: np.mean([s.finished_at - s.arrived_at for s in r.sessions])
            for name, r in (("free", free), ("priced", priced))
        }
        assert ttft["free"] < 1.0 and free.prefilled_tokens == priced.prefilled_tokens
        assert priced.prefill_tok_per_s()[0] <= 20_000
        if saturated:
            assert demand > 1.5 * 20_000
            assert priced.busy_share()[0] > 0.95 and priced.prefill_tok_per_s()[0] > 0.9 * 20_000
            assert ttft["priced"] > 5 * ttft["free"] and session_s["priced"] > 5 * session_s["free"]
        else:
            assert demand < 0.6 * 20_000
            assert ttft["priced"] < 2 * ttft["free"]
            assert session_s["priced"] < 1.5 * session_s["free"]


@pytest.mark.parametrize("mode", ["ws", "append"])
def test_free_compute_prices_a_prefill_as_the_simulator_does(mode: str) -> None:
    """The fleet's free compute and the accelerator share one prefill rule (`prefill_time_s`):
    with an attention term each turn's first token comes exactly that much later."""
    sessions = [fleet_session(0, 3000, (50, 50, 50), (1.0, 1.0))]
    ttft = {}
    for ctx in (0.0, 1e-7):
        model = msgspec.structs.replace(HOSTED_MODEL, prefill_tok_per_s=1000.0, prefill_s_per_token_ctx=ctx)
        run = simulate(mode, LOCAL, FleetConfig(compute="free", model=model), sessions, arrivals=[0.0])
        ttft[ctx] = run.sessions[0].ttft_s
    first_uncached = 3000 + 16  # the turn's whole prompt, its instructions included, is cold
    assert ttft[1e-7][0] - ttft[0.0][0] == pytest.approx(1e-7 * first_uncached * first_uncached / 2, rel=0.02)
    assert all(b > a for a, b in zip(ttft[0.0], ttft[1e-7], strict=True))


def _contended(c_prompt: int, **changes: object) -> FleetRun:
    """A runs a long turn, B (append) holds its paused context through a 100 s tool, C arrives
    at 5 s needing `c_prompt` tokens of a 5,000-token budget."""
    config = FleetConfig(
        compute="free",
        kv_budget_tokens=5000,
        **changes,
        model=msgspec.structs.replace(HOSTED_MODEL, tps=10.0, cache_generated=False),
    )  # type: ignore[arg-type]
    sessions = [
        fleet_session(0, 1000, (2000,)),
        fleet_session(1, 1000, (10, 10), (100.0,)),
        fleet_session(2, c_prompt, (10,)),
    ]
    return simulate("append", LOCAL, config, sessions, arrivals=[0.0, 0.0, 5.0])


def test_an_impossible_admission_changes_no_pin_or_account() -> None:
    """C cannot fit even with B's held KV taken: planned admission leaves B's pin alone (no
    preemption, B resumes without prefilling again); the greedy rule preempts B for nothing."""
    planned, greedy = _contended(3000), _contended(3000, admission="greedy")
    for run in (planned, greedy):
        assert run.completed == 3 and run.overflow_tokens == 0
        assert run.sessions[2].admission_wait_s[0] > 150  # C waits for A's turn either way
    assert planned.preemptions == 0 and planned.sessions[1].reprefill_tokens == 0
    assert greedy.preemptions == 1 and greedy.sessions[1].reprefill_tokens > 0


def test_preempted_held_kv_returns_to_the_cache_tail_first() -> None:
    """C fits by taking part of B's held KV: tail-first eviction keeps B's prefix cached, so B
    prefills less again at its resume than when its whole context is dropped."""
    tail, whole = _contended(1500), _contended(1500, evict_tail=False)
    assert tail.preemptions == whole.preemptions == 1
    assert 0 < tail.sessions[1].reprefill_tokens < whole.sessions[1].reprefill_tokens


def test_program_order_lets_a_resume_pass_the_turns_waiting() -> None:
    """B's resume (its session arrived first) waits behind C under first come first served, and
    goes first under program-level order (Continuum)."""
    turn, program = _contended(3000), _contended(3000, queue_order="program")
    assert turn.sessions[1].admission_wait_s[1] > 50
    assert program.sessions[1].admission_wait_s[1] == 0
    assert program.sessions[1].finished_at < turn.sessions[1].finished_at


def test_an_expired_entry_leaves_the_kv_accounts_at_its_timeout() -> None:
    """Session 0's last turn leaves its context cached; nothing happens on the replica until
    session 1 arrives at 100 s. Its entry counts as cached KV for exactly the time-to-live, not
    until the replica's next event: each 10 s more of TTL adds the same token-seconds."""
    sessions = [fleet_session(0, 2000, (40,)), fleet_session(1, 2000, (40,))]

    def cached(ttl: float) -> float:
        config = FleetConfig(compute="free", cache_ttl_s=ttl)
        return simulate("ws", LOCAL, config, sessions, arrivals=[0.0, 100.0]).kv_token_s["cached"]

    ten, twenty, thirty = cached(10.0), cached(20.0), cached(30.0)
    assert twenty - ten > 10 * 1000  # the entry's 10 s more: its tokens (about 2,000 less the shared) x 10 s
    assert thirty - twenty == pytest.approx(twenty - ten)


def test_a_ttl_from_the_reload_cost_scales_with_the_budget() -> None:
    """Ski rental: held while the KV's share of the budget has cost less than a reload. A budget
    40 times the context holds through a 1 s tool; a budget just over it releases (a GPU
    prefills the context again in about 0.3 s)."""
    base = FleetConfig(
        hold_policy="ttl", ttl_rule="reload", model=msgspec.structs.replace(HOSTED_MODEL, cache_generated=False)
    )
    (spec,) = _sessions(1)
    spec = dataclasses.replace(spec, tool_times_s=(1.0,) * CALLS)
    largest = max(spec.prompt_tokens()) + max(spec.output_tokens) + 14
    roomy = simulate(
        "append", LOCAL, msgspec.structs.replace(base, kv_budget_tokens=40 * largest), [spec], arrivals=[0.0]
    )
    tight = simulate("append", LOCAL, msgspec.structs.replace(base, kv_budget_tokens=largest), [spec], arrivals=[0.0])
    assert roomy.ttl_releases == 0 and roomy.reprefill_tokens == 0
    assert tight.ttl_releases == CALLS


def test_every_scheduling_switch_is_refused_when_unknown() -> None:
    for name in ("compute", "admission", "queue_order", "ttl_rule", "running_kv", "engine"):
        with pytest.raises(ValueError, match=name):
            FleetConfig(**{name: "nope"})  # type: ignore[arg-type]


def test_the_engine_prediction_queues_rollouts_beyond_the_slots() -> None:
    """Three rollouts on two llama.cpp slots: the third waits for a slot; one rollout alone gets
    the one-stream figures; in append its resumed turn prefills only the tool output."""
    prompts, outputs, tools = [500, 700], [40, 40], [1.0]
    alone = predict_turns("ws", 2, [prompts], [outputs], [tools])[0]
    cost = ENGINES["llamacpp-cpu"]
    assert alone[0].ttft_s == pytest.approx(cost.prefill_alone_s(0, 500))
    assert alone[0].turn_s == pytest.approx(alone[0].ttft_s + 39 / 70.8)
    three = predict_turns("ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3)
    assert three[2][0].admission_wait_s > 0 and three[0][0].admission_wait_s == 0
    assert three[2][0].ttft_s > three[0][0].ttft_s
    held = predict_turns("append", 2, [prompts], [outputs], [tools])[0]
    assert held[1].ttft_s < cost.prefill_alone_s(0, 700) / 2
    with pytest.raises(ValueError, match="context"):
        predict_turns("ws", 2, [[500, 510]], [outputs], [tools])


def test_the_caches_granularity_is_the_models_setting() -> None:
    """One session's second turn finds its first turn's context cached (prompt, output and the
    call's template: 101 + 7 + 14 tokens): all of it token-exact (llama.cpp's slots), whole
    16-token blocks of it by default (vLLM); the same prompts either way."""
    spec = fleet_session(0, 101, (7, 7), (1.0,))
    runs = {}
    for block in (1, 16):
        config = FleetConfig(model=msgspec.structs.replace(HOSTED_MODEL, prefix_block_tokens=block))
        runs[block] = simulate("ws", LOCAL, config, [spec], arrivals=[0.0])
    assert runs[1].hit_tokens == 101 + 7 + CALL_TEMPLATE_TOKENS == 122
    assert runs[16].hit_tokens == 112 and FleetConfig().model.prefix_block_tokens == 16
    assert runs[1].prompt_tokens == runs[16].prompt_tokens
    assert runs[1].prefilled_tokens == runs[16].prefilled_tokens - 10


def test_a_slot_cache_keeps_only_the_sequences_the_slots_last_served() -> None:
    """Three ws rollouts on two slots (llama.cpp without a host cache to follow them): the third
    rollout's turn takes a slot and its last sequence's KV goes, so a second turn re-prefills
    all but the shared system prompt; with a cache that follows the conversation it does not."""
    prompts, outputs, tools = [1200, 1400], [40, 40], [5.0]
    starts = [0.0, 0.0, 3.0]  # the third once the first pair has prefilled the shared prompt
    follows = predict_turns("ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3, shared_tokens=700, starts_s=starts)
    slot = predict_turns(
        "ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3, shared_tokens=700, starts_s=starts, slot_cache=True
    )
    assert [t.ttft_s for t in follows[0]] == pytest.approx([t.ttft_s for t in slot[0]][:1] + [follows[0][1].ttft_s])
    assert slot[0][1].ttft_s > 2 * follows[0][1].ttft_s  # the history prefilled again
    # The shared prompt stays: a first turn after the first pair prefills only what follows it.
    cost = ENGINES["llamacpp-cpu"]
    assert slot[2][0].ttft_s - slot[2][0].admission_wait_s < cost.prefill_alone_s(0, 1200)
    with pytest.raises(ValueError, match="decode_slots"):
        FleetConfig(slot_cache=True)


def test_a_queued_turn_finds_on_a_slot_what_is_there_when_the_slot_takes_it() -> None:
    """llama.cpp matches a prompt against a slot's KV when the slot takes it: a third rollout
    that arrived while the first pair prefilled the shared system prompt, and waited for a slot,
    finds the prompt there. The paged default keeps the simulator's rule (the match made when the
    turn reached the replica), so the same rollout prefills it again."""
    prompts, outputs, tools = [1200, 1400], [40, 40], [5.0]
    starts = [0.0, 0.0, 0.1]  # the third arrives before the shared prompt is prefilled
    cost = ENGINES["llamacpp-cpu"]
    slot = predict_turns(
        "ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3, shared_tokens=700, starts_s=starts, slot_cache=True
    )
    paged = predict_turns("ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3, shared_tokens=700, starts_s=starts)
    assert slot[2][0].admission_wait_s > 0 and paged[2][0].admission_wait_s > 0
    assert slot[2][0].ttft_s - slot[2][0].admission_wait_s < cost.prefill_alone_s(0, 1200) / 2
    assert paged[2][0].ttft_s - paged[2][0].admission_wait_s > cost.prefill_alone_s(0, 1200) * 0.9


def test_a_host_cache_gives_back_a_long_context_its_slot_lost() -> None:
    """llama.cpp's host-RAM prompt cache: a slot's last sequence that keeps less than half its
    prompt for the turn taking the slot is saved, and its next turn gets it back wherever it
    lands. Three rollouts on two slots, the third taking rollout 0's slot during its tool call:
    with 2,000-token contexts (1,300 past the 700 shared) rollout 0's second turn prefills only
    its new tokens; with 1,000-token ones (300 past) the slot kept more than half, nothing was
    saved, and the history is prefilled again, as without the cache."""
    outputs, tools, starts = [40, 40], [5.0], [0.0, 0.0, 3.0]

    def second_ttft(first: int, host: int) -> float:
        prompts = [first, first + 200]
        runs = predict_turns(
            "ws", 2, [prompts] * 3, [outputs] * 3, [tools] * 3, shared_tokens=700, starts_s=starts,
            slot_cache=True, host_cache_tokens=host,
        )  # fmt: skip
        return runs[0][1].ttft_s - runs[0][1].admission_wait_s

    cost = ENGINES["llamacpp-cpu"]
    assert second_ttft(2000, 16_384) < cost.prefill_alone_s(2000, 200) * 1.5 < second_ttft(2000, 0)
    assert second_ttft(1000, 16_384) == pytest.approx(second_ttft(1000, 0))
    assert second_ttft(1000, 0) > cost.prefill_alone_s(700, 500)
    with pytest.raises(ValueError, match="slot_cache"):
        FleetConfig(slot_host_cache_tokens=1000)


def test_verified_decoding_moves_a_pass_a_step_beside_another_slots_prefill() -> None:
    """Verified decoding (k = 64): a turn's passes are prefills of 64 tokens (its last, what is
    left), each sharing a step with the other slot's work. Rollout A (500 prompt tokens, 130
    out) decodes 129 tokens after its first in passes of 64, 64 and 1; rollout B arrives during
    A's first pass, and its 1,000-token prefill shares A's second pass's step, its own first pass
    A's last step. At a token a step, A's decode would crawl behind B's prefill."""
    cost = flat_step_cost("verified", decode_tokens_per_step=64)
    a, b = predict_turns(
        "ws", 2, [[500], [1000]], [[130], [65]], [[], []], engine=cost, starts_s=[0.0, 0.55], block_tokens=1
    )
    prefill_b = (1000 - SHARED_PREFIX_EXTRA) * 1e-3  # the prompt's shared start: A's KV serves it
    assert a[0].ttft_s == pytest.approx(0.5)
    assert b[0].ttft_s == pytest.approx(0.564 + 0.064 + prefill_b - 0.55)  # its prefill waits for A's first pass
    assert a[0].turn_s == pytest.approx(0.564 + 0.064 + prefill_b + 0.065)  # A's 1 and B's 64 in the last step
    assert b[0].turn_s == pytest.approx(a[0].turn_s - 0.55)
    alone = predict_turns("ws", 2, [[500]], [[130]], [[]], engine=cost)[0][0]
    assert alone.turn_s == pytest.approx(0.5 + 0.129)
    one_token = msgspec.structs.replace(cost, decode_tokens_per_step=1)
    assert predict_turns("ws", 2, [[500]], [[130]], [[]], engine=one_token)[0][0].turn_s == pytest.approx(0.5 + 1.29)


def test_a_pass_answered_at_a_steps_end_misses_a_step_that_starts_on_other_work() -> None:
    """The client's round trip (`request_round_trip`): the scene above, each pass a request sent
    once the last is answered. B's prefill, ready when A's first pass ends, takes the next step
    alone; then A's second pass and B's first alternate, each missing the step the other's
    request started; A's last token comes after B's pass."""
    cost = flat_step_cost("verified", decode_tokens_per_step=64)
    trip = msgspec.structs.replace(cost, request_round_trip=True)
    a, b = predict_turns(
        "ws", 2, [[500], [1000]], [[130], [65]], [[], []], engine=trip, starts_s=[0.0, 0.55], block_tokens=1
    )
    prefill_b = (1000 - SHARED_PREFIX_EXTRA) * 1e-3
    assert a[0].ttft_s == pytest.approx(0.5)
    assert b[0].ttft_s == pytest.approx(0.564 + prefill_b - 0.55)  # A's second pass is not in its step
    assert b[0].turn_s == pytest.approx(0.564 + prefill_b + 0.064 + 0.064 - 0.55)  # after A's second pass
    assert a[0].turn_s == pytest.approx(0.564 + prefill_b + 0.064 + 0.064 + 0.001)  # its last after B's pass
    # Alone, nothing else is ever ready: the same passes as without the round trip.
    alone = predict_turns("ws", 2, [[500]], [[130]], [[]], engine=trip)[0][0]
    assert alone.turn_s == pytest.approx(0.5 + 0.129)
    # Two turns decoding together share each step, as without it.
    both = predict_turns("ws", 2, [[500], [500]], [[130], [130]], [[], []], engine=trip, block_tokens=1)
    plain = predict_turns("ws", 2, [[500], [500]], [[130], [130]], [[], []], engine=cost, block_tokens=1)
    assert [r[0].turn_s for r in both] == pytest.approx([r[0].turn_s for r in plain])


@pytest.mark.slow
def test_array_sessions_keep_the_workloads_distributions_without_text() -> None:
    """Sessions built as arrays: a tool output's tokens counted from its size match the text's
    count, and the point's turns, tool tokens and output tokens have the exact builder's means."""
    rng = np.random.default_rng(0)
    for n in (1, 11, 12, 13, 250):
        text = tool_output_text(rng, n)
        assert text.count(" ") + 2 * text.count("\n") + 1 == n + -(-n // 12) - 1
    w = WORKLOADS["agentic"]
    exact, fast = workload_sessions(w, 0, 200), array_sessions(w, 0, 4000)
    for what in (
        lambda s: [s.turns],
        lambda s: list(s.tool_tokens),
        lambda s: list(s.output_tokens),
        lambda s: list(s.tool_bytes),
    ):
        a = np.concatenate([what(s) for s in exact])
        b = np.concatenate([what(s) for s in fast])
        assert abs(b.mean() - a.mean()) < 4 * math.sqrt(a.var() / len(a) + b.var() / len(b))
    assert {s.first_prompt_tokens for s in fast} == {exact[0].first_prompt_tokens}


def test_growing_kv_preempts_the_newest_running_turn_and_recomputes_it() -> None:
    """Two turns whose prompts fit together but not their outputs: reserving the output makes
    the second wait for admission; growing it at the first token (vLLM) admits both, then
    preempts the newer one, which runs again after the first ends, its prompt's blocks still
    cached unless they are dropped."""
    sessions = [fleet_session(0, 1000, (800,)), fleet_session(1, 1000, (800,))]
    config = FleetConfig(engine="llamacpp-cpu", kv_budget_tokens=3000)
    runs = {
        name: simulate("ws", LOCAL, msgspec.structs.replace(config, **changes), sessions, arrivals=[0.0, 0.01])
        for name, changes in (
            ("reserve", {}),
            ("grow", {"running_kv": "grow"}),
            ("grow, dropped", {"running_kv": "grow", "evict_tail": False}),
        )
    }
    for run in runs.values():
        assert run.completed == 2 and run.turns == 2 and run.overflow_tokens == 0
        assert run.kv_peak_tokens <= 3000
        assert [len(s.ttft_s) for s in run.sessions] == [1, 1]
    reserve, grow, dropped = runs.values()
    assert reserve.running_preemptions == 0 and reserve.sessions[1].admission_wait_s[0] > 10
    assert grow.running_preemptions == dropped.running_preemptions == 1
    assert grow.sessions[1].ttft_s[0] > grow.sessions[0].e2e_s[0]  # it waited for the first to end
    assert 0 <= grow.sessions[1].reprefill_tokens < dropped.sessions[1].reprefill_tokens
    with pytest.raises(ValueError, match="running_kv"):
        FleetConfig(compute="free", running_kv="grow")


@pytest.mark.parametrize(
    ("running_kv", "policy"),
    [
        # The fast loop keeps one combination; the other seven are slow (docs/testing.md).
        pytest.param(
            kv, policy, id=f"{kv}-{policy}", marks=() if (kv, policy) == ("reserve", "hold") else pytest.mark.slow
        )
        for kv in ("reserve", "grow")
        for policy in ("hold", "ttl", "offload", "minwaste")
    ],
)
def test_every_switch_combination_serves_every_session_within_the_budget(policy: str, running_kv: str) -> None:
    """Tight KV, scheduling switches crossed: every session ends, KV stays within its budget, and
    each turn has one first token, one end and one admission wait (a preempted running turn,
    an offloaded one reloading among them, continues its own records). The second set bounds
    the host memory to a few contexts, so offloads drop older ones."""
    sessions = array_sessions(WORKLOADS["interactive"], 1, 60)
    for admission, queue_order, evict_tail, host_gb in (("plan", "turn", True, 0.0), ("greedy", "program", False, 4.0)):
        config = FleetConfig(
            replicas=2,
            kv_budget_tokens=120_000,
            hold_policy=policy,
            hold_ttl_s=1.0,
            offload_host_gb=host_gb,
            admission=admission,
            queue_order=queue_order,
            evict_tail=evict_tail,
            running_kv=running_kv,
            model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=8),
        )
        run = simulate("append", HOSTED, config, sessions, arrivals=[0.5 * i for i in range(len(sessions))])
        assert run.completed == len(sessions) and run.overflow_tokens == 0
        assert run.kv_peak_tokens <= 120_000
        for s in run.sessions:
            assert len(s.ttft_s) == len(s.e2e_s) == len(s.admission_wait_s) == sessions[s.index].turns
        assert run.host_peak_bytes <= (host_gb * 1e9 or math.inf)
        if policy == "offload" and host_gb:
            assert run.host_drops > 0


@pytest.mark.parametrize("compute", ["free", "priced"])
def test_a_held_slot_keeps_a_paused_response_in_its_slot(compute: str) -> None:
    """`held_slot` (llama.cpp's pinned slot): two append sessions on one slot, the second arriving
    while the first is paused at its tool. With it, the first resumes in the slot it kept and the
    second waits for the first's whole rollout; without it (vLLM), the second takes the slot the
    paused first left. `ws` holds no slot either way."""
    sessions = _sessions(2, tool_time_median_s=2.0, tool_time_sigma=0.0)
    slot = msgspec.structs.replace(HOSTED_MODEL, decode_slots=1)

    def run(mode: str, held_slot: bool) -> FleetRun:
        config = FleetConfig(compute=compute, model=slot, held_slot=held_slot)
        return simulate(mode, HOSTED, config, sessions, arrivals=[0.0, 0.5])

    pinned, shared = run("append", True), run("append", False)
    first, second = pinned.sessions[0], pinned.sessions[1]
    assert second.admission_wait_s[0] > 2.0 * CALLS  # waited across every pause of the first rollout
    assert max(first.admission_wait_s) < 1e-9  # every resume found its slot
    assert shared.sessions[1].admission_wait_s[0] < 1.0  # without the pin: at most one turn of the first
    assert all(r.done for r in (*pinned.sessions, *shared.sessions))
    ws = [run("ws", held).sessions[1].admission_wait_s for held in (True, False)]
    assert ws[0] == ws[1]


def test_the_shared_prefix_expires_on_its_own_ttl_and_is_prefilled_again() -> None:
    """Two sessions 100 s apart on one replica, turns' entries kept 10 s. The instructions kept
    for the run (prefix TTL 0) or 200 s: session 1's first turn finds them. Kept 50 s: they leave
    50 s after session 0's last turn, each further 10 s of prefix TTL adds their tokens x 10 s of
    cached KV, and session 1 prefills them again."""
    sessions = [fleet_session(0, 2000, (40,)), fleet_session(1, 2000, (40,))]

    def run(prefix_ttl: float) -> FleetRun:
        config = FleetConfig(compute="free", cache_ttl_s=10.0, prefix_ttl_s=prefix_ttl)
        return simulate("ws", LOCAL, config, sessions, arrivals=[0.0, 100.0])

    kept, long, fifty, sixty = run(0.0), run(200.0), run(50.0), run(60.0)
    assert long.hit_tokens == kept.hit_tokens and long.prefilled_tokens == kept.prefilled_tokens
    assert fifty.prefilled_tokens > kept.prefilled_tokens and fifty.hit_tokens < kept.hit_tokens
    assert sixty.prefilled_tokens == fifty.prefilled_tokens
    instructions = fifty.prefilled_tokens - kept.prefilled_tokens  # what session 1 prefilled again
    assert sixty.kv_token_s["cached"] - fifty.kv_token_s["cached"] == pytest.approx(10 * instructions, rel=0.01)


def test_a_prefix_ttl_shorter_than_the_turns_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_ttl_s"):
        FleetConfig(cache_ttl_s=120.0, prefix_ttl_s=60.0)
    FleetConfig(cache_ttl_s=60.0, prefix_ttl_s=60.0)
    FleetConfig(prefix_ttl_s=60.0)  # the turns kept until evicted: the instructions once none is left
