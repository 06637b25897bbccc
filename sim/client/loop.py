"""The simulated agent's closed loop: rollouts against a server, one mode at a time.

Covers: the rollout loop shared by every mode. Scenario: an agent sends a task (its
`RolloutSpec`, sim/rollout/spec.py), streams the response, runs each tool call it receives
(sim/client/tools.py: a simulated tool time drawn from the workload and a tool output of a drawn
size, or a real subprocess), sends the outputs and repeats until the model answers with text.
The next turn starts at the previous turn's end plus tool time (closed loop, never a trace
timestamp).

The `async` mode has its own driver, `run_async_rollout`: one beta response, each tool
started as its call arrives and its output injected when it finishes, while the client
reads on (docs/beta.md#async-tools-that-overlap-decoding). Its tool steps are the same
draws as every other mode's (tool step k: the k-th call's time and output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prototype.clock import Clock
from sim.client.client import ResponsesClient
from sim.client.reconnect import cut_error, lost_input
from sim.client.steer import SteerDriver
from sim.client.tools import SimulatedTools, ToolRunner
from sim.client.websocket import AsyncDriver
from sim.rollout.result import InterjectionRecord, Mode, RolloutResult, TurnResult, tool_outputs
from sim.rollout.spec import EXEC_TOOL, RolloutSpec

__all__ = ["exposed_s", "run_async_rollout", "run_interjected", "run_rollout"]


def _settings(
    mode: Mode, spec: RolloutSpec, model: str, store: bool | None, context_management: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A rollout's request settings: `store` defaults to what the mode needs (only `http_prev`
    chains through the store); `context_management` only when given."""
    settings: dict[str, Any] = {
        "model": model,
        "instructions": spec.instructions,
        "tools": [EXEC_TOOL],
        "store": mode == "http_prev" if store is None else store,
    }
    if context_management is not None:
        settings["context_management"] = context_management
    return settings


async def run_rollout(
    client: ResponsesClient,
    clock: Clock,
    spec: RolloutSpec,
    *,
    model: str,
    tools: ToolRunner | None = None,
    store: bool | None = None,
    context_management: list[dict[str, Any]] | None = None,
) -> RolloutResult:
    """One rollout; `store` defaults to what the mode needs (only `http_prev` chains through the store).
    `context_management` goes on every create (docs/compaction.md); append and inject modes create
    once, and their response compacts at a resume past the create's threshold."""
    if spec.interjections:
        return await run_interjected(
            client, clock, spec, model=model, tools=tools, store=store, context_management=context_management
        )
    tools = tools or SimulatedTools()
    settings = _settings(client.mode, spec, model, store, context_management)
    result = RolloutResult(client.mode, spec.index, clock.now(), 0.0)
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": spec.task}]
    for turn in range(len(spec.tool_times_s) + 1):
        outcome = await client.turn(items, **settings)
        if lost_input(outcome):  # a client that does not move on (lanes, steer, or reconnect off)
            raise cut_error(outcome)
        result.turns.append(outcome)
        if turn == len(spec.tool_times_s):
            break
        if not outcome.call_ids:
            break
        output, tool_s = await tools.run(clock, float(spec.tool_times_s[turn]), spec.tool_outputs[turn])
        result.tool_time_s += tool_s
        items = tool_outputs(outcome, output)
    result.finished_at = clock.now()
    result.reconnects = list(getattr(client, "reconnects", ()))  # a `RotatingClient`'s moves
    return result


async def run_interjected(
    client: ResponsesClient,
    clock: Clock,
    spec: RolloutSpec,
    *,
    model: str,
    tools: ToolRunner | None = None,
    store: bool | None = None,
    context_management: list[dict[str, Any]] | None = None,
) -> RolloutResult:
    """`run_rollout` with the spec's interjections (docs/experiments.md#interjections). Each
    arrives its delay after its turn's first token. A client that steers (`steer` mode) is armed
    before that turn and sends it itself; every other client holds it and sends it with the first
    request after it arrived, after the tool outputs. One not delivered by the rollout's answer
    (its delay outran the rollout, or its steer failed) is sent, once it has arrived, as one more
    turn, in every mode alike."""
    tools = tools or SimulatedTools()
    settings = _settings(client.mode, spec, model, store, context_management)
    steerer = client if isinstance(client, SteerDriver) and client.steering else None
    planned = {interjection.turn: interjection for interjection in spec.interjections}
    result = RolloutResult(client.mode, spec.index, clock.now(), 0.0)
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": spec.task}]
    held: list[InterjectionRecord] = []  # arrived (or due), not sent yet
    carried: list[InterjectionRecord] = []  # sent with this turn's input
    turn = 0
    while True:
        interjection = planned.get(turn)
        if interjection is not None and steerer is not None:
            steerer.arm(interjection)
        outcome = await client.turn(items, **settings)
        if lost_input(outcome):
            raise cut_error(outcome)
        result.turns.append(outcome)
        for record in carried:
            record.seen_at = outcome.first_token_at
        carried = []
        if interjection is not None and steerer is None:
            start = outcome.first_token_at if outcome.first_token_at is not None else outcome.sent_at
            record = InterjectionRecord(interjection, start + interjection.delay_s)
            held.append(record)
            result.interjections.append(record)
        if turn >= len(spec.tool_times_s) or not outcome.call_ids:
            held += steerer.disarm() if steerer is not None else []
            if not held:
                break
            last = max(record.arrived_at for record in held)
            if last > clock.now():
                await clock.sleep_until(last)
            items, carried, held = [record.interjection.message() for record in held], held, []
            turn += 1
            continue
        output, tool_s = await tools.run(clock, float(spec.tool_times_s[turn]), spec.tool_outputs[turn])
        result.tool_time_s += tool_s
        items = tool_outputs(outcome, output)
        now = clock.now()
        carried = [record for record in held if record.arrived_at <= now]
        held = [record for record in held if record.arrived_at > now]
        items += [record.interjection.message() for record in carried]
        turn += 1
    result.finished_at = clock.now()
    if steerer is not None:
        state = steerer.steer_state
        result.interjections.extend(state.records)
        result.tokens_discarded, result.successors = state.tokens_discarded, state.successors
    return result


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def exposed_s(spans: Sequence[tuple[float, float]], hidden_by: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by `spans` (their union) and not by `hidden_by`'s."""
    mine, theirs = _merged(spans), _merged(hidden_by)
    total = sum(end - start for start, end in mine)
    j = 0
    for start, end in mine:
        while j < len(theirs) and theirs[j][1] <= start:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < end:
            total -= min(end, theirs[k][1]) - max(start, theirs[k][0])
            k += 1
    return total


async def run_async_rollout(
    client: AsyncDriver,
    clock: Clock,
    spec: RolloutSpec,
    *,
    model: str,
    tools: ToolRunner | None = None,
    store: bool = False,
    context_management: list[dict[str, Any]] | None = None,
) -> RolloutResult:
    """One rollout in `async` mode: tool step k starts when the k-th turn's call arrives (its
    `output_item.done`) and injects its output when it finishes, while the client reads on;
    the rollout ends at the terminal event. `tool_time_s` is the time a tool ran while the
    server was not working on a turn (the tool time on the rollout's critical path), so the
    overhead share counts tool time overlapped with the model's work once, as model time."""
    tools = tools or SimulatedTools()
    settings = _settings(client.mode, spec, model, store, context_management)
    result = RolloutResult(client.mode, spec.index, clock.now(), 0.0)
    spans: list[tuple[float, float]] = []

    async def tool_step(k: int, turn: TurnResult) -> list[dict[str, Any]]:
        start = clock.now()
        output, _ = await tools.run(clock, float(spec.tool_times_s[k]), spec.tool_outputs[k])
        spans.append((start, clock.now()))
        return tool_outputs(turn, output)

    await client.begin([{"type": "message", "role": "user", "content": spec.task}], **settings)
    try:
        for turn in range(len(spec.tool_times_s) + 1):
            outcome = await client.next_turn()
            if lost_input(outcome):  # `async` is not kept across the limit: the rollout fails with it
                raise cut_error(outcome)
            result.turns.append(outcome)
            if outcome.response.status != "in_progress" or turn == len(spec.tool_times_s) or not outcome.call_ids:
                break
            client.inject_when_ready(tool_step(turn, outcome))  # runs while the client reads on
    finally:
        failure = await client.settle()  # after the terminal event every step is done
    result.finished_at = clock.now()
    if failure is not None:
        raise failure
    result.tool_time_s = exposed_s(spans, [_working(t) for t in result.turns])
    return result


def _working(turn: TurnResult) -> tuple[float, float]:
    """When the server worked on an `async` turn, as the client sees it: from its start, or from
    its resume (`response.in_progress`) if it waited, to its end."""
    resumed = [at for at, kind in turn.event_log if kind == "response.in_progress"]
    return (resumed[-1] if resumed else turn.sent_at, turn.done_at)
