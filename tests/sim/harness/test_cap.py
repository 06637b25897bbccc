"""`sim.harness.cap` (`python -m sim long --cap`): rollouts past a short connection limit on the
virtual clock, per design (mode, store): the share that crossed it, the reconnects each rollout
made and what they cost, and the rollouts `store: false` loses."""

from __future__ import annotations

import pytest

from sim.__main__ import main
from sim.harness.cap import cap_tables, run_cap, wilson, write_cap
from sim.harness.experiment import CompareConfig

# 8 tool calls of 10 s each: every rollout runs past a 30 s limit.
CONFIG = CompareConfig.of(
    rollouts=3,
    tool_calls=8,
    tool_time_s=10.0,
    tool_time_sigma=0.0,
    lifetime_s=30.0,
    rotate_margin_s=10.0,
    modes=("http_prev", "ws", "append"),
)


def test_the_job_counts_reconnects_and_what_store_false_loses(tmp_path: object) -> None:
    result = run_cap(CONFIG)
    designs = {(d.mode, d.store): d for d in result.designs}
    assert set(designs) == {("ws", False), ("append", False), ("http_prev", True), ("ws", True), ("append", True)}
    for (mode, store), d in designs.items():
        assert d.rollouts == 3 and d.crossed.value == 1.0
        if mode == "http_prev":  # no socket: nothing to move, nothing lost
            assert d.reconnects.value == 0 and d.lost.value == 0
        elif store:
            assert d.lost.value == 0 and d.reconnects.value >= 2 and d.reconnect_cost.n > 0
            if mode == "ws":  # a cold cache: the whole context rendered again, not only the new items
                assert d.reconnect_cost.tokens_rendered.value > d.warm_cost.tokens_rendered.value
            else:  # an append response's report sums its segments: no per-turn warm figure
                assert d.warm_cost.n == 0
        else:
            assert d.lost.value == 1.0 and d.reconnects.n == 0
            assert d.errors == ["3 × 400 previous_response_not_found: Previous response with id 'resp_…' not found."]
    text = cap_tables(result)
    assert "rotate" in text and "cut" in text and "previous_response_not_found" in text
    folder = write_cap(result, tmp_path)  # type: ignore[arg-type]
    rows = (folder / "reconnects.csv").read_text().splitlines()
    assert rows[0].startswith("mode,store,rollout,reason,turn,at")
    assert len(rows) - 1 == sum(len(r.reconnects) for run in result.runs.values() for r in run.rollouts)


def test_wilson_interval() -> None:
    assert wilson(0, 10).ci_low == 0 and 0.3 > wilson(0, 10).ci_high > 0.25
    assert wilson(5, 10).value == 0.5 and wilson(5, 10).ci_low == pytest.approx(1 - wilson(5, 10).ci_high)


def test_a_mode_the_study_does_not_model_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["long", "--cap", "--modes", "ws,async", "--no-save"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cap models http_prev, ws, append, inject, not async" in err
