"""The fifth design in the comparison: `agents` runs the same seeded rollouts through the Agents
API's sessions (sim/harness/agents_client.py), live over loopback and in virtual time."""

from __future__ import annotations

import pytest

from sim.__main__ import run, table
from sim.harness.experiment import CompareConfig, compare

SMALL = CompareConfig.of(
    rollouts=2,
    tool_calls=4,
    tps=0,
    tool_time_s=0,
    seed=7,
    profile="local",
    system_prompt_tokens=500,
    modes=("ws", "append", "agents"),
)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("virtual", [False, True], ids=["live", "virtual"])
def test_agents_runs_the_same_tokens_as_append(virtual: bool) -> None:
    result = run(SMALL, virtual=False) if not virtual else compare(SMALL, virtual=True)
    by_mode = {m: [r for r in result.rollouts if r.mode == m] for m in ("ws", "append", "agents")}
    for i in range(2):
        per_mode = {m: rs[i].turns for m, rs in by_mode.items()}
        assert {len(t) for t in per_mode.values()} == {5}  # 4 tool calls, then the answer
        for k in range(5):
            outputs = {
                m: turns[k].output_items[0].get("arguments") or turns[k].output_items[0]["content"][0]["text"]
                for m, turns in per_mode.items()
            }
            assert len(set(outputs.values())) == 1, (i, k, outputs)
        agents, append, ws = per_mode["agents"], per_mode["append"], per_mode["ws"]
        # One session turn is one response, paused at each call as append's: its usage at the end
        # totals the ws turns', and the pauses carry none.
        final = agents[-1].response.usage
        assert final is not None and all(t.response.usage is None for t in agents[:-1])
        assert final.input_tokens == sum(t.response.usage.input_tokens for t in ws)  # type: ignore[union-attr]
        assert final == append[-1].response.usage
        assert len({t.response.id for t in agents}) == 1
        assert [t.response.status for t in agents] == ["in_progress"] * 4 + ["completed"]
    summary = {s.mode: s for s in result.summary}
    assert summary["agents"].kv_idle_token_s > 0  # the paused turn holds its KV, as append's pause does
    assert summary["agents"].tokens_rendered_per_turn == summary["append"].tokens_rendered_per_turn
    assert "agents" in table(result.summary)
