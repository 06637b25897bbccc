"""Closed-loop agent rollouts against a live server on loopback, one mode at a time.

Covers: the rollout loop shared by every mode. Scenario: an agent sends a task,
streams the response, runs each tool call it receives (sim/harness/tools.py: a simulated tool
time drawn from the workload and a tool output of a drawn size, or a real subprocess), sends the outputs
and repeats until the model answers with text. The next turn starts at the
previous turn's end plus tool time (closed loop, never a trace timestamp).

Same tokens in every mode: the task text, tool outputs and tool times of a
rollout come from rngs seeded by (seed, rollout index, turn) only, and the server's
model output depends only on (seed, conversation, turn), so every mode feeds
the simulator the same model-visible token sequence.

The `async` mode has its own driver, `run_async_rollout`: one beta response, each tool
started as its call arrives and its output injected when it finishes, while the client
reads on (docs/beta.md#async-tools-that-overlap-decoding). Its tool steps are the same
draws as every other mode's (tool step k: the k-th call's time and output).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from prototype.clock import Clock
from sim.harness.client import (
    Interjection,
    InterjectionRecord,
    Mode,
    ResponsesClient,
    TurnResult,
    WSClient,
    tool_outputs,
)
from sim.harness.tools import SimulatedTools, ToolRunner

__all__ = [
    "RolloutResult",
    "RolloutSpec",
    "draw_interjections",
    "exposed_s",
    "make_spec",
    "run_async_rollout",
    "run_interjected",
    "run_rollout",
    "tool_output_text",
    "turn_stream",
]

EXEC_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command in the repository and return its output.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
        "required": ["cmd"],
    },
    "strict": False,
}
_INSTRUCTION_LINE: Final = (
    "You are a coding agent working in a repository. Use exec_command to inspect and change files; "
    "keep going until the task is done, then summarise what you did.\n"
)  # 34 o200k tokens


def instructions(tokens: int) -> str:
    """A system prompt of about `tokens` tokens (docs/pipeline.md#calibration: Codex's prompt is ≈ 5.5K)."""
    return _INSTRUCTION_LINE * max(1, round(tokens / 34))


_WORDS: Final = (
    "src tests lib def return import class self value error config test assert path file line "
    "None True False open read write json yield async await print len range dict list str int"
).split()


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    index: int
    seed: int
    task: str
    tool_times_s: tuple[float, ...]  # one per possible tool turn
    tool_outputs: tuple[str, ...]
    instructions: str = _INSTRUCTION_LINE
    interjections: tuple[Interjection, ...] = ()  # user messages mid-rollout (draw_interjections)


@dataclass(slots=True)
class RolloutResult:
    mode: Mode
    index: int
    started_at: float
    finished_at: float
    turns: list[TurnResult] = field(default_factory=list)
    tool_time_s: float = 0.0
    # Per model turn, the prompt tokens the model read (the comparison records them server-side).
    prompt_tokens: list[int] = field(default_factory=list)
    interjections: list[InterjectionRecord] = field(default_factory=list)
    tokens_discarded: int = 0  # decoded tokens of items a steer cut off (`steer` mode)
    successors: int = 0  # automatic successors the steers started (`steer` mode)

    @property
    def completion_s(self) -> float:
        return self.finished_at - self.started_at


def tool_output_text(rng: np.random.Generator, n_tokens: int) -> str:
    """Plausible command output of about `n_tokens` tokens (~1 token per short word)."""
    # The same draws as rng.choice(_WORDS, size): indices, then the words (≈ 6 × faster than choice).
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=max(1, n_tokens)).tolist()]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return "\n".join(lines)


def turn_stream(seed: int, index: int, turn: int, *stream: int) -> np.random.Generator:
    """The rng of one turn of one rollout: a function of (seed, rollout index, turn) only,
    so a turn's draws are the same whatever else the run draws (common random numbers)."""
    return np.random.default_rng(np.random.SeedSequence([seed, index, turn, *stream]))


def make_spec(
    seed: int,
    index: int,
    *,
    max_turns: int,
    tool_time_median_s: float,
    tool_time_sigma: float,
    tool_output_median_tokens: int,
    system_prompt_tokens: int = 34,
) -> RolloutSpec:
    """Rollout `index`: tool step k draws, from its own `turn_stream(seed, index, k)` and
    in this order, a standard normal for its time, one for its output size, then the
    output's words. Common random numbers: a rollout of more tool calls is this rollout
    plus more turns, and another tool-time median or output median scales the same
    normals (the output text of a larger size starts with the smaller one's words)."""
    times, outputs = [], []
    for k in range(max_turns):
        rng = turn_stream(seed, index, k)
        z_time, z_size = rng.standard_normal(2).tolist()
        times.append(tool_time_median_s * math.exp(tool_time_sigma * z_time) if tool_time_median_s > 0 else 0.0)
        size = int(min(tool_output_median_tokens * math.exp(1.1 * z_size), 10_000))
        outputs.append(tool_output_text(rng, size))
    task = f"Task {index}: fix the failing test in module {index % 7}."
    return RolloutSpec(index, seed, task, tuple(times), tuple(outputs), instructions(system_prompt_tokens))


INTERJECTION_STREAM: Final = 0x57EE  # turn_stream's extra word for a rollout's interjection draws


def draw_interjections(seed: int, index: int, count: int, tool_turns: int, window_s: float) -> tuple[Interjection, ...]:
    """Rollout `index`'s interjections: `count` distinct turns among the tool-call turns that
    another tool-call turn follows (0 … tool_turns − 2, so a later request exists to carry the
    message), each with a delay uniform in [0, window_s) after the turn's first token and a
    short user message; drawn from their own stream, so the rollout's other draws do not move."""
    if count <= 0 or tool_turns < 2:
        return ()
    rng = turn_stream(seed, index, 0, INTERJECTION_STREAM)
    turns = sorted(rng.choice(tool_turns - 1, size=min(count, tool_turns - 1), replace=False).tolist())
    delays = rng.uniform(0.0, window_s, size=len(turns)).tolist()
    files = rng.integers(0, 100, size=len(turns)).tolist()
    return tuple(
        Interjection(turn, delay, f"Also check tests/test_{name:02d}.py before you go on.")
        for turn, delay, name in zip(turns, delays, files, strict=True)
    )


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
        result.turns.append(outcome)
        if turn == len(spec.tool_times_s):
            break
        if not outcome.call_ids:
            break
        output, tool_s = await tools.run(clock, float(spec.tool_times_s[turn]), spec.tool_outputs[turn])
        result.tool_time_s += tool_s
        items = tool_outputs(outcome, output)
    result.finished_at = clock.now()
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
    steering = bool(getattr(client, "steering", False))
    planned = {interjection.turn: interjection for interjection in spec.interjections}
    result = RolloutResult(client.mode, spec.index, clock.now(), 0.0)
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": spec.task}]
    held: list[InterjectionRecord] = []  # arrived (or due), not sent yet
    carried: list[InterjectionRecord] = []  # sent with this turn's input
    turn = 0
    while True:
        interjection = planned.get(turn)
        if interjection is not None and steering:
            client.arm(interjection)  # type: ignore[attr-defined]
        outcome = await client.turn(items, **settings)
        result.turns.append(outcome)
        for record in carried:
            record.seen_at = outcome.first_token_at
        carried = []
        if interjection is not None and not steering:
            start = outcome.first_token_at if outcome.first_token_at is not None else outcome.sent_at
            record = InterjectionRecord(interjection, start + interjection.delay_s)
            held.append(record)
            result.interjections.append(record)
        if turn >= len(spec.tool_times_s) or not outcome.call_ids:
            held += client.disarm() if steering else []  # type: ignore[attr-defined]
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
    if steering:
        state = client.steer_state  # type: ignore[attr-defined]
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
    client: WSClient,
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
