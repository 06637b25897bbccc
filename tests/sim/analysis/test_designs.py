"""sim/analysis/designs.py on synthetic rollouts (exact numbers), and on a small comparison: the parts of
a mode's saving add up to its paired difference in rollout time."""

from __future__ import annotations

import math

import pytest

from prototype.wire.schemas import Response, StageReport
from sim.analysis.designs import DECIMALS, PARTS, explain, kv_price, mode_costs, rollout_parts, stage_savings, verdict
from sim.harness.experiment import CompareConfig, compare
from sim.rollout.result import RolloutResult, TurnResult


def turn(
    rid: str, sent: float, done: float, stages: dict[str, float], *, nbytes: int = 1000, events: int = 10
) -> TurnResult:
    report = StageReport(stages_s=stages, server_s=sum(stages.values()), tokens_rendered=100)
    response = Response(id=rid, created_at=0, status="completed", model="m", longrun=report)
    return TurnResult(response, sent, None, done, nbytes, events)


def rollout(mode: str, index: int, finished: float, turns: list[TurnResult], tool_s: float) -> RolloutResult:
    r = RolloutResult(mode, index, started_at=0.0, finished_at=finished, tool_time_s=tool_s)  # type: ignore[arg-type]
    r.turns = turns
    return r


def http(index: int, routing: float) -> RolloutResult:
    """Two turns, each a new response: routing, prefill and decode, a 1-s tool between."""
    return rollout(
        "http",
        index,
        4.0 + 2 * routing,
        [
            turn(f"h{index}a", 0.0, 1.5 + routing, {"routing": routing, "prefill": 0.5, "decode": 1.0}),
            turn(f"h{index}b", 2.5 + routing, 4.0 + 2 * routing, {"routing": routing, "prefill": 0.5, "decode": 1.0}),
        ],
        1.0,
    )


def append(index: int) -> RolloutResult:
    """The same rollout as one response: cumulative reports, routing once, no second prefill
    (held KV), 0.25 s of client time on the second turn."""
    return rollout(
        "append",
        index,
        3.75,
        [
            turn("a", 0.0, 1.5, {"prefill": 0.5, "decode": 1.0}, nbytes=400, events=8),
            turn("a", 2.5, 3.75, {"prefill": 0.5, "decode": 2.0}, nbytes=200, events=6),
        ],
        1.0,
    )


def test_a_rollouts_parts_add_up_to_its_time() -> None:
    parts = rollout_parts(append(0))
    assert set(parts) == set(PARTS)
    assert parts["decode"] == 2.0 and parts["prefill"] == 0.5 and parts["tool"] == 1.0  # differenced reports
    assert parts["other"] == pytest.approx(0.25)
    assert sum(parts.values()) == pytest.approx(3.75)


def test_stage_savings_are_paired_by_rollout() -> None:
    results = [http(0, 0.1), http(1, 0.3), append(0), append(1)]
    rows = {r.part: r for r in stage_savings(results, "http")}
    # Parts that are zero in every rollout of every mode are left out.
    assert set(rows) == {"routing", "prefill", "decode", "tool", "other"}
    routing = rows["routing"]
    assert (routing.mode, routing.base, routing.n) == ("append", "http", 2)
    assert routing.saved_s == pytest.approx((0.2 + 0.6) / 2)
    assert rows["prefill"].saved_s == pytest.approx(0.5)
    # The same saving in every rollout: an exact interval, not float noise read as spread.
    assert rows["prefill"].ci_low == rows["prefill"].ci_high == rows["prefill"].saved_s
    assert rows["tool"].saved_s == 0.0 and rows["other"].saved_s == pytest.approx(-0.25)
    assert rows["decode"].saved_s == 0.0
    total = sum(r.saved_s for r in rows.values())
    assert total == pytest.approx(((4.2 - 3.75) + (4.6 - 3.75)) / 2)
    with pytest.raises(ValueError, match="no 'ws' rollouts"):
        stage_savings(results, "ws")


def test_rounding_is_to_the_nanosecond() -> None:
    assert DECIMALS == 9
    a = rollout("http", 0, 1.0, [turn("x", 0.0, 1.0, {"decode": 0.1 + 0.2})], 0.0)
    b = rollout("ws", 0, 1.0, [turn("y", 0.0, 1.0, {"decode": 0.3})], 0.0)
    (decode, other) = stage_savings([a, b], "http")
    assert decode.part == "decode" and decode.saved_s == 0.0  # 0.1 + 0.2 − 0.3 is 5.6e-17
    assert other.part == "other" and other.saved_s == 0.0


def test_mode_costs() -> None:
    results = [http(0, 0.1), http(1, 0.3), append(0), append(1)]
    h, a = mode_costs(results, {"http": 0.0, "append": 19.0})
    assert (h.mode, h.rollouts, h.turns_per_rollout, h.messages_per_rollout) == ("http", 2, 2.0, 2.0)
    assert h.responses_per_rollout == 2.0 and a.responses_per_rollout == 1.0
    assert h.events_per_turn == 10.0 and a.events_per_turn == 7.0
    assert h.bytes_per_turn == 1000.0 and a.bytes_per_turn == 300.0
    assert h.before_inference_s_per_turn == pytest.approx((0.2 + 0.6) / 4)  # routing is before inference
    assert a.before_inference_s_per_turn == 0.0
    assert h.prefill_s_per_turn == 0.5 and a.prefill_s_per_turn == 0.25
    assert h.tokens_rendered_per_turn == 100.0 and a.tokens_rendered_per_turn == 50.0  # cumulative: differenced
    assert a.kv_idle_token_s_per_rollout == 9.5 and a.kv_idle_tokens_mean == pytest.approx(19.0 / 7.5)
    assert math.isnan(mode_costs(results)[0].kv_idle_token_s_per_rollout)
    steered = append(0)
    steered.turns[1].steered = [Response(id="parent", created_at=0, status="incomplete", model="m")]
    (s,) = mode_costs([steered])
    assert s.responses_per_rollout == 2.0  # the response a steer ended, and the one the turns carry


def test_kv_price() -> None:
    results = [http(0, 0.1), http(1, 0.3), append(0), append(1)]
    (price,) = kv_price(results, {"http": 0.0, "append": 19.0}, "http")
    assert (price.mode, price.base, price.n) == ("append", "http", 2)
    assert price.saved_s == pytest.approx(0.65) and price.extra_kv_idle_token_s == 9.5
    assert price.kv_token_s_per_second_saved == pytest.approx(9.5 / 0.65)
    (back,) = kv_price(results, {"http": 0.0, "append": 19.0}, "append")
    assert back.saved_s == pytest.approx(-0.65) and math.isnan(back.kv_token_s_per_second_saved)


def test_explain_names_the_largest_parts() -> None:
    rows = stage_savings([http(0, 0.1), http(1, 0.3), append(0), append(1)], "http")
    text = explain(rows, "append", top=2)
    assert text.startswith("append against http: +0.65 s saved per rollout (n=2)")
    assert "prefill +0.50 s (95 % CI 0.50 s to 0.50 s)" in text and "routing +0.40 s" in text
    assert "decode" not in text  # not among the two largest
    with pytest.raises(ValueError):
        explain(rows, "ws")
    same = stage_savings([http(0, 0.1), rollout("ws", 0, 4.2, http(0, 0.1).turns, 1.0)], "http")
    assert explain(same, "ws") == "ws against http: no part differs (n=1)"


def test_on_a_comparison_the_parts_add_up_to_the_paired_difference() -> None:
    config = CompareConfig(rollouts=3, tool_calls=3, modes=("http", "ws", "append"), seed=1)
    result = compare(config, virtual=True, free_cpu=True)
    rows = stage_savings(result.rollouts, "http", seed=config.seed)
    for pair in result.pairs:
        if pair.base != "http":
            continue
        total = sum(r.saved_s for r in rows if r.mode == pair.other)
        assert total == pytest.approx(-pair.difference_s, abs=1e-6)
    by = {(r.mode, r.part): r.saved_s for r in rows}
    # ws routes once per connection; only append skips the per-turn inference hop and re-prefill.
    assert by[("ws", "routing")] > 0 and by[("ws", "inference_hop")] == 0 < by[("append", "inference_hop")]
    costs = {c.mode: c for c in mode_costs(result.rollouts, {s.mode: s.kv_idle_token_s for s in result.summary})}
    assert costs["append"].responses_per_rollout == 1.0 < costs["ws"].responses_per_rollout
    assert costs["append"].kv_idle_token_s_per_rollout > 0 == costs["ws"].kv_idle_token_s_per_rollout


def test_verdict_reads_the_interval() -> None:
    assert verdict(-0.2, -0.3, -0.1, lower="saves", higher="costs") == "saves"
    assert verdict(0.2, 0.1, 0.3, lower="saves", higher="costs") == "costs"
    assert verdict(0.05, -0.1, 0.2) == "not distinguishable from 0 at this n"
    assert verdict(0.0, 0.0, 0.0) == "not distinguishable from 0 at this n"
    assert verdict(3e-17, 1e-17, 5e-17) == "not distinguishable from 0 at this n"  # float rounding
    assert verdict(0.5, math.nan, 0.6).endswith("no interval: more rollouts needed")
