"""`sim.client.loop`: a paused response that ended under a client that does not move on (a shared
socket, `async`, or reconnecting turned off) fails its rollout with the limit's error; it is never
taken for the rollout's answer (a rollout cut short that looks finished)."""

from __future__ import annotations

import pytest

from sim.harness.experiment import CompareConfig, compare

# 8 tool calls of 10 s each against a 30 s connection limit.
PAST_THE_LIMIT = CompareConfig.of(
    rollouts=2, tool_calls=8, tool_time_s=10.0, tool_time_sigma=0.0, lifetime_s=30.0, rotate_margin_s=10.0
)


@pytest.mark.parametrize(
    ("mode", "fields"),
    [("append", {"lanes": 2}), ("async", {}), ("append", {"reconnect": False}), ("inject", {"reconnect": False})],
)
def test_a_cut_the_client_does_not_mend_fails_the_rollout(mode: str, fields: dict[str, object]) -> None:
    result = compare(PAST_THE_LIMIT.updated(modes=(mode,), **fields), virtual=True, free_cpu=True)
    assert result.rollouts == []
    assert [f.index for f in result.failed] == [0, 1]
    assert all("websocket_connection_limit_reached" in f.error for f in result.failed)


def test_the_same_rollouts_finish_on_their_own_sockets_with_the_store() -> None:
    result = compare(PAST_THE_LIMIT.updated(modes=("append",), store_responses=True), virtual=True, free_cpu=True)
    assert result.failed == [] and len(result.rollouts) == 2
    assert all(len(r.turns) == 9 and r.reconnects for r in result.rollouts)
