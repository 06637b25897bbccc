"""The comparison's `async` mode (docs/beta.md#async-tools-that-overlap-decoding): one beta response
per rollout whose tools run while the model decodes on; the model decides, per turn, whether its next
turn needs an output still outstanding. The same seeded rollouts, and so the same tokens, as `inject`
and `append`; only the timing differs, and only by overlapped tool time."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest

from prototype.config import ServerConfig, WebSocketConfig
from prototype.model import DecidesAsync, FunctionTool, ModelEvent, ModelRequest, SamplingFinished, TokensSampled
from prototype.store.memory import MemoryStore
from prototype.wire.schemas import RequiredInput, decode_stored
from prototype.ws.connection import Connection
from prototype.ws.events import AckInject, ArmPauseTimer, ResumeJob, StartJob, TakeInput
from prototype.ws.lanes import CS
from sim.__main__ import main, run
from sim.client.loop import exposed_s
from sim.client.websocket import AsyncDriver
from sim.harness import experiment
from sim.harness.experiment import CompareConfig
from sim.model import config as model_config
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.model.receipt import Receipt
from sim.rollout.result import MODES, RolloutResult, tool_outputs
from sim.rollout.spec import EXEC_TOOL
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual

SMALL = CompareConfig.of(
    rollouts=4,
    tool_calls=5,
    tps=0,
    tool_time_s=0.2,
    seed=11,
    profile="local",
    system_prompt_tokens=300,
    async_independent=0.5,
    modes=("http", "append", "inject", "async"),
)


class RecordingModel(SimulatedModel):
    """The comparison's model, recording every sampled turn's token ids by (conversation, turn)."""

    turns: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    async def sample(self, request: ModelRequest, receipt: Receipt | None = None) -> AsyncGenerator[ModelEvent, None]:
        ids: list[int] = []
        async with contextlib.aclosing(super().sample(request, receipt)) as events:  # its receipt on close
            async for event in events:
                if isinstance(event, TokensSampled):
                    ids.extend(event.token_ids)
                elif isinstance(event, SamplingFinished):  # the service stops reading here
                    self.turns.setdefault((request.conversation_key, request.turn_index), []).append(tuple(ids))
                yield event


def _calls_and_answer(r: RolloutResult) -> list[Any]:
    items = [item for t in r.turns for item in t.output_items]
    return [(i["name"], i["arguments"]) if i["type"] == "function_call" else i["content"][0]["text"] for i in items]


def _by_mode(result: experiment.CompareResult, mode: str) -> dict[int, RolloutResult]:
    return {r.index: r for r in result.rollouts if r.mode == mode}


def test_async_samples_the_same_tokens_as_inject_and_append(monkeypatch: pytest.MonkeyPatch) -> None:
    RecordingModel.turns = {}
    monkeypatch.setattr(model_config, "SimulatedModel", RecordingModel)  # what build_model builds
    result = run(msgspec.structs.replace(SMALL, modes=("append", "inject", "async")), virtual=True, free_cpu=True)
    # every (conversation, turn) was sampled once per mode, with the same token ids each time
    assert len(RecordingModel.turns) == SMALL.rollouts * (SMALL.tool_calls + 1)
    for ids in RecordingModel.turns.values():
        assert len(ids) == 3 and ids[0] == ids[1] == ids[2] and ids[0]
    append, inject, overlap = (_by_mode(result, m) for m in ("append", "inject", "async"))
    for i, a in append.items():
        b = overlap[i]
        assert _calls_and_answer(a) == _calls_and_answer(inject[i]) == _calls_and_answer(b)
        assert len(b.turns) == SMALL.tool_calls + 1 and len({t.response.id for t in b.turns}) == 1
        final = b.turns[-1].response
        assert final.status == "completed" and final.usage is not None
        assert final.usage.output_tokens == append[i].turns[-1].response.usage.output_tokens  # type: ignore[union-attr]
        assert final.parallel_tool_calls is True and inject[i].turns[-1].response.parallel_tool_calls is False
    summary = {s.mode: s for s in result.summary}
    # and some turns did decode on: the response held its KV idle for less time
    assert summary["async"].kv_idle_token_s < summary["inject"].kv_idle_token_s


def test_with_no_independent_calls_async_takes_injects_time() -> None:
    """Negative control: with `async_independent=0` the model always waits, so overlapping the
    client's tools saves nothing."""
    config = SMALL.updated(async_independent=0.0, modes=("inject", "async"))
    result = run(config, virtual=True, free_cpu=True)
    inject, overlap = _by_mode(result, "inject"), _by_mode(result, "async")
    for i, r in overlap.items():
        assert r.completion_s == pytest.approx(inject[i].completion_s, rel=0.01)
    summary = {s.mode: s for s in result.summary}
    assert summary["async"].kv_idle_token_s == pytest.approx(summary["inject"].kv_idle_token_s, rel=0.01)


def test_independent_calls_overlap_tools_with_decoding() -> None:
    config = SMALL.updated(async_independent=1.0, modes=("http", "inject", "async"))
    result = run(config, virtual=True, free_cpu=True)
    inject, overlap = _by_mode(result, "inject"), _by_mode(result, "async")
    for i, r in overlap.items():
        saved = inject[i].completion_s - r.completion_s
        # faster, by at most the tool time there was to overlap
        assert 0 < saved <= inject[i].tool_time_s + 1e-9
        assert r.tool_time_s < inject[i].tool_time_s  # less of it on the critical path
    summary = {s.mode: s for s in result.summary}
    # the response waits only before its final answer: far less KV held idle
    assert 0 < summary["async"].kv_idle_token_s < summary["inject"].kv_idle_token_s
    pair = next(p for p in result.pairs if (p.base, p.other) == ("inject", "async"))
    assert pair.n == SMALL.rollouts and pair.saved > 0 and pair.difference_s < 0
    assert pair.saved_ci_low <= pair.saved <= pair.saved_ci_high
    assert summary["async"].saved_vs_http > summary["inject"].saved_vs_http


@pytest.mark.slow
def test_async_runs_live_over_sockets_with_beta_frames() -> None:
    """Real sockets: every frame of the beta socket is checked against the beta event union."""
    config = SMALL.updated(rollouts=2, async_independent=1.0, modes=("inject", "async"))
    result = run(config, virtual=False)
    inject, overlap = _by_mode(result, "inject"), _by_mode(result, "async")
    for i, r in overlap.items():
        assert _calls_and_answer(r) == _calls_and_answer(inject[i])
        assert r.turns[-1].response.status == "completed"


def test_async_is_opt_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert "async" not in MODES and "async" not in CompareConfig().modes
    argv = ["compare", "--virtual", "--free-cpu", "--modes", "inject,async", "--rollouts", "2", "--tool-calls", "2"]
    assert main([*argv, "--async-independent", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "\nasync " in out and "async vs inject" in out


def test_exposed_time_is_the_union_less_what_hides_it() -> None:
    assert exposed_s([(0, 2), (1, 3)], []) == 3
    assert exposed_s([(0, 2), (1, 3)], [(0.5, 1), (2.5, 4)]) == 2
    assert exposed_s([(0, 1)], [(0, 1)]) == 0


# -- the engine's side, in process on a virtual clock ---------------------------------------------------


def _server(
    *, independent: float, tool_calls: int = 2, timeout_s: float = 300.0
) -> tuple[InProcessServer, SimulatedModel]:
    clock = VirtualClock()
    model = SimulatedModel(
        clock=clock,
        policy=DefaultPolicy(tool_calls=tool_calls),
        seed=3,
        decode_tok_per_s=200.0,
        async_independent=independent,
    )
    config = ServerConfig(websocket=WebSocketConfig(append_timeout_s=timeout_s))
    return InProcessServer(config, model=model, store=MemoryStore(), clock=clock, seed=3), model


SETTINGS: dict[str, Any] = {"model": "sim", "tools": [EXEC_TOOL], "store": True}
TASK = [{"type": "message", "role": "user", "content": "Fix the failing test."}]


def test_the_simulated_model_decides_and_never_decodes_on_to_its_final_answer() -> None:
    server, model = _server(independent=1.0)
    assert isinstance(model, DecidesAsync)

    def request(turn: int, *, parallel: bool = True) -> ModelRequest:
        tool = FunctionTool("exec_command", None, b'{"type":"object"}', is_async=True)
        return ModelRequest(
            (), 0, 0, turn, conversation_key=7, tools=(tool,), parallel_tool_calls=parallel, conversation_id="c"
        )

    assert model.decodes_on(request(1), (0,))  # turn 1 calls a tool: it may go on
    assert not model.decodes_on(request(2), (0, 1))  # turn 2 is the final answer (tool_calls=2)
    assert not model.decodes_on(request(1, parallel=False), (0,))  # one call in flight at a time
    model.planner.async_independent = 0.0
    assert not model.decodes_on(request(1), (0,))


def test_an_output_injected_during_a_later_turn_is_committed_after_its_call() -> None:
    server, _ = _server(independent=1.0, tool_calls=3)
    clock = server.engine.clock

    async def go() -> None:
        client = server.client("async", clock)
        assert isinstance(client, AsyncDriver)
        try:
            await client.begin(TASK, **SETTINGS)
            first = await client.next_turn()
            # answered at once: the output arrives while the model decodes its next turn
            await client.inject(tool_outputs(first, "output one"))
            second = await client.next_turn()
            third = await client.next_turn()  # decoded on: the second call is still unanswered
            assert second.response.status == third.response.status == "in_progress"
            final = asyncio.get_running_loop().create_task(client.next_turn())
            await clock.sleep_until(clock.now() + 30.0)
            assert not final.done()  # the final answer waits for every output
            await client.inject(tool_outputs(second, "output two"))
            await clock.sleep_until(clock.now() + 30.0)
            assert not final.done()
            await client.inject(tool_outputs(third, "output three"))
            last = await final
        finally:
            await client.close()
        assert last.response.status == "completed"
        kinds = [type(i).__name__ for i in last.response.output]
        assert kinds == ["FunctionCall", "FunctionCall", "FunctionCall", "OutputMessage"]
        data = await server.engine.store.get(last.response.id)
        assert data is not None
        context = [msgspec.json.decode(raw) for raw in decode_stored(data).context]
        one, two, three = first.call_ids[0], second.call_ids[0], third.call_ids[0]
        assert [(c["type"], c.get("call_id")) for c in context][1:] == [
            ("function_call", one),
            ("function_call", two),  # the model went on without the first output
            ("function_call_output", one),  # injected during the second turn: in at its end, after its call
            ("function_call", three),
            ("function_call_output", two),  # the final answer waited for these
            ("function_call_output", three),
        ]
        stats = server.engine.statistics()
        assert stats.pauses == 1 and stats.kv_idle_token_s > 0  # one wait, before the final answer

    run_virtual(go, charge_cpu=False)


def test_an_output_that_never_arrives_times_the_response_out() -> None:
    server, _ = _server(independent=1.0, timeout_s=5.0)
    clock = server.engine.clock

    async def go() -> None:
        client = server.client("async", clock)
        assert isinstance(client, AsyncDriver)
        try:
            await client.begin(TASK, **SETTINGS)
            first = await client.next_turn()
            second = await client.next_turn()  # decoded on: nothing was injected
            assert first.call_ids and second.call_ids
            start = clock.now()
            last = await client.next_turn()
        finally:
            await client.close()
        assert last.response.status == "incomplete"
        assert last.response.incomplete_details is not None
        assert last.response.incomplete_details.reason == "append_timeout"
        assert clock.now() - start == pytest.approx(5.0, abs=0.01)

    run_virtual(go, charge_cpu=False)


def test_a_larger_share_only_adds_turns_that_decode_on() -> None:
    _, model = _server(independent=0.3)
    low = {k for k in range(200) if model.planner.independent(7, k)}
    model.planner.async_independent = 0.6
    high = {k for k in range(200) if model.planner.independent(7, k)}
    assert low < high and 30 < len(low) < 90 and 90 < len(high) < 150  # common random numbers
    with pytest.raises(ValueError, match="async_independent"):
        SimulatedModel(clock=VirtualClock(), policy=DefaultPolicy(), async_independent=1.5)


def test_async_rollouts_share_a_socket_on_lanes() -> None:
    config = SMALL.updated(async_independent=1.0, lanes=2, modes=("inject", "async"))
    result = run(config, virtual=True, free_cpu=True)
    inject, overlap = _by_mode(result, "inject"), _by_mode(result, "async")
    for i, r in overlap.items():
        assert _calls_and_answer(r) == _calls_and_answer(inject[i])
        assert r.turns[-1].response.status == "completed"


def test_the_core_hands_over_injected_outputs_at_a_boundary_and_keeps_the_rest_pending() -> None:
    c = Connection(beta=True)
    c.receive_text(json.dumps({"type": "response.create", "model": "sim", "input": "hi"}))
    (job,) = [o.job for o in c.outputs_to_send() if isinstance(o, StartJob)]
    for call_id in ("call_a", "call_b"):
        c.call_emitted(job, RequiredInput(call_id=call_id, name="exec_command"))
    inject = {"type": "response.inject", "response_id": job.response_id}
    c.receive_text(
        json.dumps({**inject, "input": [{"type": "function_call_output", "call_id": "call_a", "output": "A"}]})
    )
    assert [type(o) for o in c.outputs_to_send()] == [AckInject]
    c.turn_ended(job)
    (taken,) = c.outputs_to_send()
    assert isinstance(taken, TakeInput) and [i.view.call_id for i in taken.items] == ["call_a"]
    c.turn_ended(job)  # nothing new since: nothing handed over twice
    assert c.outputs_to_send() == [TakeInput(job, ())]
    c.response_paused(job, ())  # the model waits for call_b
    assert [type(o) for o in c.outputs_to_send()] == [ArmPauseTimer] and c.state is CS.PAUSED
    c.receive_text(
        json.dumps({**inject, "input": [{"type": "function_call_output", "call_id": "call_b", "output": "B"}]})
    )
    resumed = [o for o in c.outputs_to_send() if isinstance(o, ResumeJob)]
    assert len(resumed) == 1 and [i.view.call_id for i in resumed[0].items] == ["call_b"]
