"""Trace replay: every mode re-sends the recorded assistant turns; only the API mode changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.__main__ import run
from sim.analysis.records import records_from_rollouts
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


SIZED = [
    {"rollout": "c0", "turn": 0, "mode": "http", "input_tokens": 500, "cached_tokens": 0, "output_tokens": 100},
    {"rollout": "c0", "turn": 1, "mode": "http", "input_tokens": 1400, "cached_tokens": 400, "output_tokens": 60},
    {"rollout": "c0", "turn": 2, "mode": "http", "input_tokens": 2000, "cached_tokens": 1300, "output_tokens": 40},
    {"rollout": "c1", "turn": 0, "mode": "ws", "input_tokens": 300, "cached_tokens": 0, "output_tokens": 30},
    {"rollout": "c1", "turn": 1, "mode": "ws", "input_tokens": 700, "cached_tokens": 200, "output_tokens": 200},
]


def _sized(tmp_path: Path) -> Path:
    """A workload.jsonl as the recorder writes it: sizes and tool times, no content."""
    path = tmp_path / "workload.jsonl"
    lines = []
    for k, line in enumerate(SIZED):
        last = k + 1 == len(SIZED) or SIZED[k + 1]["rollout"] != line["rollout"]
        extra = {"tool_call": False} if last else {"tool_call": True, "tool_time_s": 0.25 * (k + 1)}
        lines.append(json.dumps(line | extra))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_sized_trace_replays_its_recorded_token_counts_and_tool_times(tmp_path: Path) -> None:
    path = _sized(tmp_path)
    recorded = load_trace(path)
    assert [len(r.turns) for r in recorded] == [3, 2]
    assert recorded[0].tool_times_s == [0.25, 0.5] and recorded[1].tool_times_s == [1.0]
    assert [t[0].kind for t in recorded[0].turns] == ["function_call", "function_call", "message"]
    result = run(CompareConfig.of(trace=str(path), modes=("http", "ws"), profile="local"), virtual=True, free_cpu=True)
    for rollout in result.rollouts:
        want = [line for line in SIZED if line["rollout"] == f"c{rollout.index}"]
        assert len(rollout.turns) == len(want)
        assert rollout.tool_time_s == pytest.approx(sum(recorded[rollout.index].tool_times_s))
    for r in records_from_rollouts(result.rollouts, source="replay"):
        line = [x for x in SIZED if x["rollout"] == f"c{r.rollout}" and x["turn"] == r.turn][0]
        assert r.prompt_tokens == pytest.approx(line["input_tokens"], rel=0.02)
        assert r.output_tokens == pytest.approx(line["output_tokens"], rel=0.1, abs=4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"rollout": "a", "output_tokens": 3}, r":1: a sized turn needs 'input_tokens'"),
        ({"rollout": "a", "input_tokens": 9, "output_tokens": -1}, r":1: a sized turn needs 'output_tokens'"),
        (
            {"rollout": "a", "input_tokens": 9, "output_tokens": 3, "tool_call": True},
            r":1: a turn with calls needs 'tool_output' \(string\) and 'tool_time_s'",
        ),
    ],
)
def test_bad_sized_lines_fail_with_their_line(tmp_path: Path, line: dict[str, object], message: str) -> None:
    path = tmp_path / "workload.jsonl"
    path.write_text(json.dumps(line))
    with pytest.raises(ValueError, match=message):
        load_trace(path)
