"""Trace replay: every mode re-sends the recorded assistant turns; only the API mode changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.__main__ import run
from sim.harness.experiment import CompareConfig
from sim.rollout.replay import load_trace
from tests.support import REPO

SAMPLE = REPO / "sim" / "data" / "sample_trace.jsonl"


def test_every_mode_replays_the_recorded_turns() -> None:
    recorded = load_trace(SAMPLE)
    assert [len(r.turns) for r in recorded] == [5, 3]
    config = CompareConfig.of(trace=str(SAMPLE), rollouts=1, tps=0, profile="local")
    result = run(config, virtual=True, free_cpu=True)
    for mode in ("http", "http_prev", "ws", "append"):
        rollouts = [r for r in result.rollouts if r.mode == mode]
        assert len(rollouts) == 2
        for rec, got in zip(recorded, rollouts, strict=True):
            assert len(got.turns) == len(rec.turns)
            for planned, turn in zip(rec.turns, got.turns, strict=True):
                item = turn.output_items[0]
                if planned[0].kind == "function_call":
                    assert item["name"] == planned[0].name and item["arguments"] == planned[0].text
                else:
                    assert item["content"][0]["text"] == planned[0].text
            assert got.tool_time_s == pytest.approx(sum(rec.tool_times_s))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"rollout": "a", "assistant": {"text": "x"}}], r":1: a rollout's first line needs a 'task' string$"),
        ([{"rollout": "a", "task": "t", "assistant": {"tool_call": {"name": "f"}}}], r":1: a turn with calls needs"),
        ([{"rollout": "a", "task": "t", "assistant": {"text": "x"}, "extra": 1}], r":1: unknown key\(s\) 'extra'$"),
        ([{"rollout": "a", "task": "t", "assistant": "x"}], r":1: 'assistant' must be an object"),
        (
            [
                {"rollout": "a", "task": "t", "assistant": {"text": "x"}},
                {"rollout": "b", "task": "t", "assistant": {"text": "y"}},
            ],
            r"two rollouts share a task",
        ),
    ],
)
def test_bad_traces_fail_with_their_line(tmp_path: Path, lines: list[object], message: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    with pytest.raises(ValueError, match=message):
        load_trace(path)
