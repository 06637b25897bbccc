"""The API stages of a turn: work counted per stage, each stage's time against known modeled waits,
switches, profiles, metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prototype.config import ServerConfig
from prototype.context.safety import SafetyClassifier
from prototype.pipeline import (
    PROFILES,
    CostProfile,
    Optimization,
    Stage,
    StageReport,
    load_profile,
)
from prototype.serve.app import ENGINE
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from sim.client.client import open_client
from sim.model.accelerator import SimulatedModel
from sim.model.kv import PrefixCache
from sim.model.policy import DefaultPolicy
from sim.rollout.result import TurnResult, tool_outputs
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual
from tests.strict import STREAM_EVENT, WS_EVENT, Checker
from tests.support import EXEC_TOOL, live_server

TURNS = 10


async def rollout(mode: str, config: ServerConfig | None = None, turns: int = TURNS) -> list[TurnResult]:
    async with live_server(tool_calls=turns - 1, seed=5, config=config) as live:
        client = open_client(mode, live.base_url, AsyncioClock())  # type: ignore[arg-type]
        settings = {"model": "sim", "tools": [EXEC_TOOL], "instructions": "Be careful.", "store": mode == "http_prev"}
        items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        results = []
        try:
            for _ in range(turns):
                result = await client.turn(items, **settings)
                results.append(result)
                items = tool_outputs(result, "line of tool output\n" * 40)
                if not items:
                    break
        finally:
            await client.close()
        return results


def per_turn(results: list[TurnResult], field: str) -> list[int]:
    """Work done in each turn; append-mode reports are cumulative over the response's segments."""
    values = [getattr(r.response.longrun, field) for r in results]
    if results[0].response.id == results[-1].response.id:  # append: one response
        return [b - a for a, b in zip([0, *values], values, strict=False)]
    return values


def not_growing(values: list[int]) -> bool:
    """No trend: the later half averages within 1.5× the earlier half (the model's output sizes vary)."""
    half = len(values) // 2
    early, late = sum(values[:half]) / half, sum(values[half:]) / (len(values) - half)
    return late < 1.5 * early


@pytest.mark.slow
@pytest.mark.parametrize("field", ["tokens_rendered", "tokens_classified"])
async def test_per_turn_work_is_flat_for_ws_and_append_and_grows_for_http(field: str) -> None:
    work = {mode: per_turn(await rollout(mode), field) for mode in ("http", "http_prev", "ws", "append")}
    for mode in ("http", "http_prev"):
        growth = work[mode]
        assert all(b > a for a, b in zip(growth[1:], growth[2:], strict=False)), (mode, growth)  # grows every turn
        assert growth[-1] > 3 * growth[1], (mode, growth)
    for mode in ("ws", "append"):
        flat = work[mode][1:]  # after the first turn: only the new items (tool output + model output)
        assert not_growing(flat), (mode, flat)
        assert max(flat) < work["http"][-1] / 5, (mode, flat, work["http"])
    # http and http_prev do the same rendering; ws and append the same incremental work
    assert work["http"] == work["http_prev"]


# Modeled waits, each a different power of two (ms), so that any sum of them names its parts:
# a wait charged to the wrong stage changes two stages' values, and no other mix of waits
# can stand in for it.
RTT, AUTH, ROUTING, STATE_LOAD, SAFETY_CALL, HOP, BILLING, MODEL_LATENCY = (2**k / 1000 for k in range(8))
KNOWN_WAITS = CostProfile(
    name="known-waits",
    rtt_s=RTT,
    auth_s=AUTH,
    routing_s=ROUTING,
    state_load_s=STATE_LOAD,
    safety_call_s=SAFETY_CALL,
    inference_hop_s=HOP,
    billing_s=BILLING,
)


def expected_stages(mode: str, turn: int, *, last: bool = False) -> tuple[dict[str, float], float]:
    """What turn `turn` (0-based) of `mode` waits in each stage, and what it overlaps, from the
    pipeline's rules (prototype/pipeline.py): every request (and every append) pays the round
    trip, a classifier call and the model's fixed latency; auth and routing are per request over
    HTTP and once per connection over WebSocket; the store round trip is paid by an HTTP
    continuation only (the connection cache serves WebSocket); the hop to inference is once per
    response; billing is on the critical path over HTTP and overlapped over WebSocket, in append
    mode once, when the response ends (`last`). Append reports add up over the response's
    segments. CPU is free (virtual time), pacing off: every other stage is zero."""
    segments = turn + 1 if mode == "append" else 1
    stages = {
        "network": RTT * segments,
        "safety": SAFETY_CALL * segments,
        "prefill": MODEL_LATENCY * segments,
        "routing": AUTH + ROUTING if mode in ("http", "http_prev", "append") or turn == 0 else 0.0,
        "load_state": STATE_LOAD if mode == "http_prev" and turn > 0 else 0.0,
        "inference_hop": HOP,
        "post_inference": BILLING if mode in ("http", "http_prev") else 0.0,
    }
    overlapped = BILLING if mode == "ws" or (mode == "append" and last) else 0.0
    return stages, overlapped


async def known_waits_rollout(mode: str, clock: VirtualClock, turns: int, wire: Checker) -> list[TurnResult]:
    model = SimulatedModel(
        clock=clock,
        policy=DefaultPolicy(tool_calls=turns - 1),
        seed=5,
        model_latency_s=MODEL_LATENCY,
        decode_tok_per_s=math.inf,
    )
    config = ServerConfig(profile=KNOWN_WAITS)
    kind = STREAM_EVENT if mode.startswith("http") else WS_EVENT

    def check(direction: str, data: bytes) -> None:  # what the in-process transports carry down, checked
        if direction == "down":
            wire.check_json(kind, data, where=f"in-process {mode}")

    server = InProcessServer(config, model=model, store=MemoryStore(), clock=clock, seed=5, tap=check)
    client = server.client(mode, clock)  # type: ignore[arg-type]
    items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    results = []
    try:
        for _ in range(turns):
            results.append(await client.turn(items, model="sim", tools=[EXEC_TOOL], store=mode == "http_prev"))
            items = tool_outputs(results[-1], "line of tool output\n" * 40)
    finally:
        await client.close()
    return results


@pytest.mark.parametrize("mode", ["http", "http_prev", "ws", "append"])
def test_each_stage_holds_exactly_its_modeled_waits(mode: str, wire: Checker) -> None:
    """Virtual time with free CPU: a stage's time is the modeled waits it is charged, exactly.
    The expectation comes from the profile's fields and the pipeline's rules, not from the
    report (its stages summing to `server_s` is true by construction and proves nothing)."""
    turns = 3
    clock = VirtualClock()
    results = run_virtual(known_waits_rollout(mode, clock, turns, wire), charge_cpu=False)
    assert len(results) == turns and wire.counts[STREAM_EVENT if mode.startswith("http") else WS_EVENT] > 0
    previous = 0.0
    for turn, result in enumerate(results):
        report = result.response.longrun
        assert isinstance(report, StageReport)
        stages, overlapped = expected_stages(mode, turn, last=turn == turns - 1)
        assert set(report.stages_s) <= {s.value for s in Stage}
        got = {name: value for name, value in report.stages_s.items() if value != 0.0}
        assert got == pytest.approx({k: v for k, v in stages.items() if v}, abs=1e-9), (mode, turn)
        assert report.overlapped_s == pytest.approx(overlapped, abs=1e-9)
        assert report.server_s == pytest.approx(sum(stages.values()), abs=1e-9)
        # The client waited exactly the server's time for this segment: nothing else is modeled.
        assert result.e2e_s == pytest.approx(report.server_s - previous, abs=1e-9), (mode, turn)
        previous = report.server_s if mode == "append" else 0.0


async def _diagnosed_load_state(comparison: str | None, wire: Checker) -> float:
    """load_state of a fresh request (no previous response) that names `comparison` for
    `prompt_cache_diagnostics` (the id of a stored response, or one that does not exist)."""
    clock = VirtualClock()
    model = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=0), seed=5, decode_tok_per_s=math.inf)
    config = ServerConfig(profile=KNOWN_WAITS)
    server = InProcessServer(config, model=model, store=MemoryStore(), clock=clock, seed=5)
    items = [{"role": "user", "content": "Fix the failing test."}]
    first, second = server.client("http", clock), server.client("http", clock)
    try:
        stored = await first.turn(items, model="sim", tools=[EXEC_TOOL])
        named = stored.response.id if comparison == "stored" else comparison
        options = {} if named is None else {"prompt_cache_options": {"comparison_response_id": named}}
        result = await second.turn(items, model="sim", tools=[EXEC_TOOL], **options)
    finally:
        await first.close()
        await second.close()
    report = result.response.longrun
    assert isinstance(report, StageReport)
    return report.stages_s.get("load_state", 0.0)


@pytest.mark.parametrize("comparison", ["stored", "resp_0000000000000000000000000000dead"])
def test_a_diagnostics_store_read_pays_the_store_round_trip(comparison: str, wire: Checker) -> None:
    """`prompt_cache_options.comparison_response_id` reads the compared response from the store
    (found or not): its round trip is charged to load_state, as a continuation's store load is."""
    plain = run_virtual(_diagnosed_load_state(None, wire), charge_cpu=False)
    diagnosed = run_virtual(_diagnosed_load_state(comparison, wire), charge_cpu=False)
    assert plain == 0.0 and diagnosed == pytest.approx(STATE_LOAD, abs=1e-9)


@pytest.mark.slow
async def test_on_the_live_server_each_stage_waits_at_least_its_modeled_waits() -> None:
    """Sockets and the real clock: a timer never fires early, so each stage is at least its
    modeled waits (CPU work and scheduling only add); exact values are the virtual test's."""
    for mode in ("http", "ws"):
        async with live_server(tool_calls=2, seed=5, config=ServerConfig(profile=KNOWN_WAITS)) as live:
            live.model.model_latency_s = MODEL_LATENCY
            client = open_client(mode, live.base_url, AsyncioClock())
            items: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            try:
                for turn in range(3):
                    result = await client.turn(items, model="sim", tools=[EXEC_TOOL])
                    items = tool_outputs(result, "ok")
                    report = result.response.longrun
                    assert isinstance(report, StageReport)
                    stages, overlapped = expected_stages(mode, turn)
                    for name, wait in stages.items():
                        assert report.stages_s.get(name, 0.0) >= wait - 1e-9, (mode, turn, name, report)
                    assert report.overlapped_s >= overlapped - 1e-9
                    assert report.server_s <= result.e2e_s  # the client saw at least the server's time
            finally:
                await client.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("disabled", "field"),
    [(Optimization.TOKEN_CACHE, "tokens_rendered"), (Optimization.INCREMENTAL_SAFETY, "tokens_classified")],
)
async def test_each_switch_alone_brings_back_the_growing_work(disabled: Optimization, field: str) -> None:
    config = ServerConfig(disable=frozenset({disabled}))
    grows = per_turn(await rollout("ws", config), field)
    assert all(b > a for a, b in zip(grows[1:], grows[2:], strict=False)) and grows[-1] > 3 * grows[1], grows
    other = "tokens_classified" if field == "tokens_rendered" else "tokens_rendered"
    assert not_growing(per_turn(await rollout("ws", config), other)[1:])


async def test_without_state_cache_ws_loads_like_http_prev() -> None:
    config = ServerConfig(disable=frozenset({Optimization.STATE_CACHE}))
    async with live_server(tool_calls=3, seed=5, config=config) as live:
        client = open_client("ws", live.base_url, AsyncioClock())
        try:
            first = await client.turn([{"role": "user", "content": "go"}], model="sim", tools=[EXEC_TOOL])
            second = await client.turn(tool_outputs(first, "ok"), model="sim", tools=[EXEC_TOOL])
        finally:
            await client.close()
    assert second.response.longrun.connection_cache == "miss"  # type: ignore[union-attr]  # served from the store
    assert second.response.longrun.tokens_rendered > first.response.longrun.tokens_rendered  # type: ignore[union-attr]


async def test_flagged_input_is_refused_before_inference() -> None:
    async with live_server() as live:
        engine = live.app[ENGINE]
        blocked = int(engine.tokenizer.encode(" forbidden")[0])
        engine.classifier = SafetyClassifier(flag_tokens=[blocked])
        async with aiohttp.ClientSession() as s:
            async with s.post(live.base_url + "/responses", json={"model": "m", "input": "a forbidden word"}) as r:
                body = await r.json()
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "content_filter"}
        assert body["output"] == [] and engine.statistics().model_calls == 0


async def test_metrics_endpoint_exposes_stage_histograms() -> None:
    async with live_server() as live, aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(live.base_url + "/responses", json={"model": "m", "input": "hi"}) as r:
                assert r.status == 200
        async with s.get(live.base_url.replace("/v1", "/metrics")) as r:
            text = await r.text()
            assert r.content_type == "text/plain"
    assert "# TYPE longrun_stage_seconds histogram" in text
    assert 'longrun_stage_seconds_count{stage="render"} 2' in text
    assert 'longrun_stage_seconds_bucket{stage="decode",le="+Inf"} 2' in text
    assert "longrun_responses_total 2" in text and "longrun_tokens_rendered_total" in text


def test_profiles_and_profile_files(tmp_path: Path) -> None:
    assert load_profile("local") == PROFILES["local"] and load_profile("hosted").routing_s > 0
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"name": "mine", "rtt_s": 0.1, "billing_s": 0.2}))
    assert load_profile(str(good)) == CostProfile(name="mine", rtt_s=0.1, billing_s=0.2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rtt": 0.1}))
    with pytest.raises(ValueError, match=r"Object contains unknown field `rtt`"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match=r"^unknown cost profile 'nope'"):
        load_profile("nope")


def test_hosted_profile_matches_the_calibration() -> None:
    """docs/pipeline.md, "Calibration": ≈250 ms fixed + 10 µs/token over HTTP, ≈70 ms + 10 µs/new token over WS."""
    p = PROFILES["hosted"]
    http_fixed = p.auth_s + p.routing_s + p.safety_call_s + p.inference_hop_s + p.billing_s
    ws_fixed = p.safety_call_s + p.inference_hop_s
    assert http_fixed == pytest.approx(0.250) and ws_fixed == pytest.approx(0.070)
    assert p.safety_s_per_token + p.validate_s_per_token == pytest.approx(10e-6)


async def test_usage_cached_tokens_are_the_prefix_cache_hits() -> None:
    async with live_server(tool_calls=5, seed=5) as live:
        client = open_client("http", live.base_url, AsyncioClock())
        items: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
        usages = []
        try:
            for _ in range(6):
                result = await client.turn(items, model="sim", tools=[EXEC_TOOL], instructions="x " * 300)
                usages.append(result.response.usage)
                items = tool_outputs(result, "ok " * 50)
        finally:
            await client.close()
        stats = live.model.statistics()
    cached = [u.input_tokens_details.cached_tokens for u in usages]  # type: ignore[union-attr]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert sum(cached) == stats.cached_tokens == stats.kv.hit_tokens
    assert all(c % 16 == 0 for c in cached)  # whole blocks
    assert all(c < u.input_tokens for c, u in zip(cached, usages, strict=True))  # type: ignore[union-attr]


async def test_under_kv_pressure_ws_loses_its_prefix_while_a_paused_append_keeps_its_kv() -> None:
    """Continuum (arXiv 2511.02230): end-of-turn KV release exposes create modes to eviction."""
    async with live_server(tool_calls=1, seed=5) as live:
        live.model.prefix_cache = PrefixCache(capacity_tokens=3000)
        clock = AsyncioClock()
        appender, creator = open_client("append", live.base_url, clock), open_client("ws", live.base_url, clock)
        flood = open_client("http", live.base_url, clock)
        a_settings = {"model": "sim", "tools": [EXEC_TOOL], "instructions": "Follow plan A. " * 120}
        w_settings = {"model": "sim", "tools": [EXEC_TOOL], "instructions": "Follow plan W. " * 120}
        try:
            a1 = await appender.turn([{"role": "user", "content": "task A"}], **a_settings)
            w1 = await creator.turn([{"role": "user", "content": "task W"}], **w_settings)
            for i in range(4):  # other tenants' long prompts push unpinned blocks out
                await flood.turn([{"role": "user", "content": f"tenant {i} " + "data " * 900}], model="sim")
            a2 = await appender.turn(tool_outputs(a1, "ok"), **a_settings)
            w2 = await creator.turn(tool_outputs(w1, "ok"), **w_settings)
        finally:
            for c in (appender, creator, flood):
                await c.close()
    assert a1.response.usage is None and a2.response.usage is not None  # one response: paused, then completed
    assert w1.response.usage is not None and w1.response.usage.input_tokens_details.cached_tokens == 0
    w2_cached = w2.response.usage.input_tokens_details.cached_tokens  # type: ignore[union-attr]
    a2_cached = a2.response.usage.input_tokens_details.cached_tokens  # segment 1 was cold: all of it is segment 2
    assert w2_cached == 0  # the ws conversation's prefix was evicted between its turns
    assert a2_cached > 500  # the paused response's KV (its ~600-token context) was pinned through the pressure
    stats = live.model.statistics()
    assert stats.kv.evicted_blocks > 0 and stats.kv.pinned_blocks == 0  # released when the response ended
    assert live.app[ENGINE].statistics().kv_idle_token_s > 0
