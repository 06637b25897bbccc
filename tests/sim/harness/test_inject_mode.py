"""The comparison's `inject` mode (docs/beta.md, docs/experiments.md): one beta response per rollout,
its tools declared async, the tool outputs sent with `response.inject`; the same seeded rollouts, and
so the same model calls, answer and tokens, as append mode."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from sim.__main__ import main, run
from sim.harness.experiment import CompareConfig
from sim.rollout.result import MODES, RolloutResult

SMALL = CompareConfig.of(
    rollouts=4,
    tool_calls=4,
    tps=0,
    tool_time_s=0.2,
    seed=11,
    profile="local",
    system_prompt_tokens=300,
    modes=("http", "append", "inject"),
)


def _calls_and_answer(r: RolloutResult) -> list[Any]:
    items = [item for t in r.turns for item in t.output_items]
    return [(i["name"], i["arguments"]) if i["type"] == "function_call" else i["content"][0]["text"] for i in items]


def _same_rollouts(rollouts: list[RolloutResult], n: int) -> None:
    by_mode = {m: sorted((r for r in rollouts if r.mode == m), key=lambda r: r.index) for m in ("append", "inject")}
    assert len(by_mode["append"]) == len(by_mode["inject"]) == n
    for a, b in zip(by_mode["append"], by_mode["inject"], strict=True):
        assert len(a.turns) == len(b.turns) == SMALL.tool_calls + 1
        assert _calls_and_answer(a) == _calls_and_answer(b)
        # one response each, waiting between turns: no usage until its end, then the same tokens
        assert len({t.response.id for t in a.turns}) == len({t.response.id for t in b.turns}) == 1
        assert all(t.response.usage is None for t in (*a.turns[:-1], *b.turns[:-1]))
        ua, ub = a.turns[-1].response.usage, b.turns[-1].response.usage
        assert ua is not None and ub is not None
        assert (ua.input_tokens, ua.output_tokens) == (ub.input_tokens, ub.output_tokens)
        assert b.turns[-1].response.status == "completed"
        calls = [i for t in b.turns for i in t.output_items if i["type"] == "function_call"]
        assert [c.get("async") for c in calls] == [True] * SMALL.tool_calls
        # the resumes carry the same tool outputs; only the create differs (the tools' `async: true`,
        # and one call in flight at a time, so the model waits for each output: docs/beta.md)
        assert [t.bytes_sent for t in a.turns[1:]] == [t.bytes_sent for t in b.turns[1:]]
        assert b.turns[0].bytes_sent - a.turns[0].bytes_sent == len(',"async":true') + len(
            ',"parallel_tool_calls":false'
        )
        assert b.turns[0].response.parallel_tool_calls is False


def test_inject_and_append_run_the_same_seeded_rollouts_in_virtual_time() -> None:
    result = run(SMALL, virtual=True, free_cpu=True)
    _same_rollouts(result.rollouts, SMALL.rollouts)
    summary = {s.mode: s for s in result.summary}
    inject = summary["inject"]
    assert inject.n == SMALL.rollouts and inject.kv_idle_token_s > 0  # the waiting response holds its KV
    assert inject.saved_vs_http_ci_low <= inject.saved_vs_http <= inject.saved_vs_http_ci_high
    assert not math.isnan(inject.saved_vs_http_ci_low) and inject.saved_vs_http > 0
    # one pause machine: on free CPU, the rollout takes append's time (the create is 40 bytes longer)
    append = {r.index: r.completion_s for r in result.rollouts if r.mode == "append"}
    for r in result.rollouts:
        if r.mode == "inject":
            assert r.completion_s == pytest.approx(append[r.index], rel=0.01)


@pytest.mark.slow
def test_inject_runs_live_over_sockets_with_beta_frames() -> None:
    """Real sockets: every frame of the beta socket is checked against the beta event union."""
    result = run(msgspec.structs.replace(SMALL, rollouts=2), virtual=False)
    _same_rollouts(result.rollouts, 2)


def test_inject_is_opt_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert "inject" not in MODES and "inject" not in CompareConfig().modes
    argv = ["compare", "--virtual", "--free-cpu", "--modes", "http,inject", "--rollouts", "2", "--tool-calls", "2"]
    assert main([*argv, "--quiet"]) == 0
    assert "\ninject " in capsys.readouterr().out
