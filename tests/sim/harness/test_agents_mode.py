"""The fifth design in the comparison: `agents` runs the same seeded rollouts through the Agents
API's sessions (sim/client/agents_client.py), live over loopback and in virtual time."""

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


@pytest.mark.parametrize(
    "virtual", [pytest.param(False, id="live", marks=pytest.mark.slow), pytest.param(True, id="virtual")]
)
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


def test_an_interjection_steers_the_turn_with_appends_tokens() -> None:
    """A held interjection goes in the POST with the tool results; the session commits it at the
    step boundary after them, where append commits it: the same context, the same usage."""
    config = SMALL.updated(modes=("append", "agents"), interjections=1, tool_calls=5)
    result = compare(config, virtual=True)
    by_mode = {m: sorted((r for r in result.rollouts if r.mode == m), key=lambda r: r.index) for m in config.modes}
    for append, agents in zip(by_mode["append"], by_mode["agents"], strict=True):
        assert append.interjections and len(agents.interjections) == len(append.interjections)
        assert agents.turns[-1].response.usage == append.turns[-1].response.usage


def test_a_message_held_past_the_answer_starts_a_second_session_turn() -> None:
    """An interjection that arrives after the rollout's answer is one more turn in every mode; in
    `agents` it is a new turn of the idle session, followed on the session's event stream."""
    config = SMALL.updated(modes=("append", "agents"), interjections=1, interjection_window_s=600.0)
    result = compare(config, virtual=True)
    by_mode = {m: sorted((r for r in result.rollouts if r.mode == m), key=lambda r: r.index) for m in config.modes}
    late = 0
    for append, agents in zip(by_mode["append"], by_mode["agents"], strict=True):
        assert len(agents.turns) == len(append.turns)
        late += len(append.turns) == 6  # 4 calls, the answer, then the held message's own turn
        assert agents.turns[-1].response.usage == append.turns[-1].response.usage
        assert agents.turns[-1].response.id != agents.turns[-2].response.id  # a second response
    assert late > 0


async def test_the_client_over_loopback_follows_a_second_turn() -> None:
    """The measuring client itself over a real socket: the create's stream to the answer, then a
    message to the idle session, read on a `GET .../events` subscription."""
    from prototype.serve.wallclock import AsyncioClock
    from sim.client.agents_client import AgentsClient
    from sim.client.client import open_client
    from sim.rollout.result import tool_outputs
    from sim.rollout.spec import EXEC_TOOL
    from tests.support import live_server

    async with live_server(tool_calls=2, seed=9) as live:
        client = open_client("agents", live.base_url, AsyncioClock())
        try:
            settings = {"model": "sim", "instructions": "Be brief.", "tools": [EXEC_TOOL]}
            items: list[dict[str, object]] = [{"type": "message", "role": "user", "content": "Fix the tests."}]
            results = []
            for _ in range(3):
                result = await client.turn(items, **settings)
                results.append(result)
                items = tool_outputs(result, "ok")  # type: ignore[assignment]
            assert [len(r.call_ids) for r in results] == [1, 1, 0]
            assert results[-1].response.status == "completed"
            again = await client.turn([{"type": "message", "role": "user", "content": "And now?"}], **settings)
            assert again.response.status == "completed" and again.response.id != results[-1].response.id
            assert again.output_items and again.output_items[-1]["type"] == "message"
            assert isinstance(client, AgentsClient) and client.session_id and client.turn_id
            turn = await client._turn(client.session_id, client.turn_id)  # what it reads of a turn that failed
            assert turn["id"] == client.turn_id and turn["status"] == "completed"
        finally:
            await client.close()
