"""Metric definitions (docs/experiments.md#metrics) on synthetic rollouts: exact numbers."""

from __future__ import annotations

import itertools
import math

import pytest

from prototype.wire.schemas import InputTokensDetails, OutputTokensDetails, Response, StageReport, Usage
from sim.analysis.metrics import pair_summaries, summarize
from sim.rollout.result import RolloutResult, TurnResult


def turn(
    rid: str,
    sent: float,
    first: float | None,
    done: float,
    *,
    stages: dict[str, float],
    rendered: int,
    cache: str = "none",
    inp: int = 100,
    cached: int = 0,
    usage: bool = True,
    nbytes: int = 1000,
) -> TurnResult:
    u = (
        Usage(
            input_tokens=inp,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=10,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=inp + 10,
        )
        if usage
        else None
    )
    report = StageReport(
        stages_s=stages, server_s=sum(stages.values()), tokens_rendered=rendered, connection_cache=cache
    )
    response = Response(id=rid, created_at=0, status="completed", model="m", usage=u, longrun=report)
    return TurnResult(response, sent, first, done, nbytes, 5)


def test_create_mode_metrics() -> None:
    r = RolloutResult("http", 0, started_at=0.0, finished_at=10.0, tool_time_s=4.0)
    r.turns = [
        turn("resp_1", 0.0, 0.5, 2.0, stages={"decode": 1.0, "prefill": 0.5, "routing": 0.5}, rendered=100),
        turn(
            "resp_2",
            6.0,
            6.7,
            8.0,
            stages={"decode": 1.0, "prefill": 0.3, "queue": 0.2},
            rendered=300,
            cache="hit",
            cached=60,
            nbytes=3000,
        ),
    ]
    (s,) = summarize([r])
    assert s.completion_p50_s == 10.0 and s.turns == 2
    assert s.ttft_p50_s == pytest.approx(0.6)  # median of 0.5 and 0.7
    assert s.tool_to_token_p50_s == pytest.approx(0.7)  # the second turn starts when the tool result is ready
    assert s.overhead_share == pytest.approx((10.0 - 3.0 - 4.0) / 10.0)  # model = queue + prefill + decode
    assert s.bytes_per_turn == 2000 and s.tokens_rendered_per_turn == 200
    assert s.connection_cache_hit_rate == 1.0 and s.token_hit_rate == pytest.approx(60 / 200)
    assert s.saved_vs_http == 0.0 and math.isnan(s.kv_idle_token_s)


def test_append_reports_are_cumulative_per_response() -> None:
    r = RolloutResult("append", 0, started_at=0.0, finished_at=5.0, tool_time_s=1.0)
    r.turns = [
        turn("resp_A", 0.0, 0.2, 1.0, stages={"decode": 0.5, "render": 0.1}, rendered=1000, usage=False),
        turn("resp_A", 2.0, 2.1, 3.0, stages={"decode": 1.2, "render": 0.15}, rendered=1100, inp=300, cached=250),
    ]
    (s,) = summarize([r], {"append": 42.0})
    assert s.tokens_rendered_per_turn == (1000 + 100) / 2  # the second report adds 100 rendered tokens
    assert s.overhead_share == pytest.approx((5.0 - 1.2 - 1.0) / 5.0)  # decode 1.2 total, not 0.5 + 1.2
    assert s.token_hit_rate == pytest.approx(250 / 300) and s.kv_idle_token_s == 42.0
    assert math.isnan(s.connection_cache_hit_rate) and math.isnan(s.saved_vs_http)


def test_saving_is_paired_by_rollout_with_intervals() -> None:
    def rollout(mode: str, index: int, t: float) -> RolloutResult:
        r = RolloutResult(mode, index, started_at=0.0, finished_at=t)  # type: ignore[arg-type]
        r.turns = [turn("resp", 0.0, 0.1, t, stages={"decode": 0.1}, rendered=1)]
        return r

    http = [10.0, 12.0, 20.0, 11.0, 15.0, 30.0, 13.0]
    ws = [6.0, 9.0, 10.0, 8.8, 9.0, 27.0, 6.5]  # per rollout: 40 %, 25 %, 50 %, 20 %, 40 %, 10 %, 50 % saved
    results = [rollout("http", i, t) for i, t in enumerate(http)] + [rollout("ws", i, t) for i, t in enumerate(ws)]
    results.append(rollout("ws", 99, 1.0))  # no http twin: not in any pair
    summary = {s.mode: s for s in summarize(results)}
    ws_s = summary["ws"]
    assert ws_s.saved_vs_http == pytest.approx(2.35 / 7) and ws_s.saved_vs_http_n == 7  # the mean of the pairs
    assert 0 < ws_s.saved_vs_http_ci_low < 0.33 < ws_s.saved_vs_http_ci_high < 0.5
    assert summary["http"].saved_vs_http == 0.0
    s = summary["http"]
    assert s.n == 7 and s.completion_p50_s == 13.0 and s.completion_p90_s == pytest.approx(24.0)
    # 7 draws: the median's order-statistic interval is (x(1), x(7)), p90 has no upper bound.
    assert (s.completion_p50_ci_low, s.completion_p50_ci_high) == (10.0, 30.0)
    assert math.isnan(s.completion_p90_ci_high)
    assert summarize(results) == summarize(results)  # seeded bootstrap: the same intervals twice
    (pair,) = pair_summaries(results)
    assert (pair.base, pair.other, pair.n) == ("http", "ws", 7) and pair.saved == ws_s.saved_vs_http
    assert pair.difference_s == pytest.approx(sum(b - a for a, b in zip(http, ws, strict=True)) / 7)
    assert pair.difference_ci_low < pair.difference_s < pair.difference_ci_high < 0


@pytest.mark.slow
def test_timeline_tiles_each_rollout_with_stages_and_tool_time() -> None:
    from sim.__main__ import run
    from sim.analysis.metrics import timeline
    from sim.harness.experiment import CompareConfig

    result = run(CompareConfig(rollouts=1, tool_calls=3, seed=4), virtual=True, free_cpu=True)
    for rollout in result.rollouts:
        rows = timeline(rollout)
        assert rows[0]["start_s"] == 0.0 and rows[-1]["end_s"] == pytest.approx(rollout.completion_s)
        assert all(a["end_s"] == b["start_s"] for a, b in itertools.pairwise(rows))  # contiguous
        tool = sum(float(r["end_s"]) - float(r["start_s"]) for r in rows if r["segment"] == "tool")
        assert tool == pytest.approx(rollout.tool_time_s)
        decode_turns = {r["turn"] for r in rows if r["segment"] == "decode"}
        assert decode_turns == set(range(4))
        routed = [r["turn"] for r in rows if r["segment"] == "routing"]
        assert routed == ([0] if rollout.mode in ("ws", "append") else [0, 1, 2, 3])  # routing reused on a connection
