"""Replay a recorded trace: the recorded assistant turns, tool outputs and tool times, so
that only the API mode changes between runs.

Trace format: JSON Lines, one line per model turn, grouped by rollout (in file order):

    {"rollout": "r1", "task": "Fix the failing test.", "instructions": "You are …",
     "assistant": {"tool_call": {"name": "exec_command", "arguments": {"cmd": "pytest -q"}}},
     "tool_output": "1 failed", "tool_time_s": 2.4}
    {"rollout": "r1", "assistant": {"text": "Fixed: the off-by-one in parse()."}}

* `assistant` is one model turn in the `--script` line format (`text`, `tool_call` or
  `tool_calls`); a turn with calls needs `tool_output` (one string, given to every call
  of the turn) and `tool_time_s`.
* `task` (the first user message) is required on a rollout's first line;
  `instructions` is optional there. Blank lines and `#` comments are skipped.

The server's policy replays each rollout's own turns, found by the conversation key
of its task (so two rollouts need different tasks); errors name `path:line`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from prototype.context.conversation import conversation_key
from sim.model.policy import ConversationPolicy, DefaultPolicy, PlannedItem, Policy, ScriptPolicy, parse_turn
from sim.rollout.spec import RolloutSpec

__all__ = ["RecordedRollout", "load_trace", "replay_plan"]

_KEYS = frozenset({"rollout", "task", "instructions", "assistant", "tool_output", "tool_time_s"})


@dataclass(slots=True)
class RecordedRollout:
    name: str
    task: str
    instructions: str | None
    turns: list[tuple[PlannedItem, ...]] = field(default_factory=list)
    tool_outputs: list[str] = field(default_factory=list)
    tool_times_s: list[float] = field(default_factory=list)


def load_trace(path: str | os.PathLike[str]) -> list[RecordedRollout]:
    rollouts: dict[str, RecordedRollout] = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            entry = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a JSON object")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
        name = str(entry.get("rollout", ""))
        if name not in rollouts:
            if not isinstance(entry.get("task"), str):
                raise ValueError(f"{where}: a rollout's first line needs a 'task' string")
            instructions = entry.get("instructions")
            rollouts[name] = RecordedRollout(
                name, entry["task"], instructions if isinstance(instructions, str) else None
            )
        rollout = rollouts[name]
        if not isinstance(entry.get("assistant"), dict):
            raise ValueError(f"{where}: 'assistant' must be an object (a --script line)")
        turn = parse_turn(entry["assistant"], where)
        rollout.turns.append(turn)
        if any(item.kind == "function_call" for item in turn):
            output, seconds = entry.get("tool_output"), entry.get("tool_time_s")
            if not isinstance(output, str) or not isinstance(seconds, int | float) or seconds < 0:
                raise ValueError(f"{where}: a turn with calls needs 'tool_output' (string) and 'tool_time_s' (>= 0)")
            rollout.tool_outputs.append(output)
            rollout.tool_times_s.append(float(seconds))
    keys = [conversation_key(r.task) for r in rollouts.values()]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: two rollouts share a task; each rollout needs its own")
    return list(rollouts.values())


def replay_plan(
    rollouts: list[RecordedRollout], seed: int, fallback: Policy | None = None
) -> tuple[list[RolloutSpec], Policy]:
    """The specs the harness runs and the policy the server's model uses."""
    specs = [
        RolloutSpec(
            index,
            seed,
            r.task,
            tuple(r.tool_times_s),
            tuple(r.tool_outputs),
            r.instructions if r.instructions is not None else "",
        )
        for index, r in enumerate(rollouts)
    ]
    policy = ConversationPolicy(
        {conversation_key(r.task): ScriptPolicy(r.turns) for r in rollouts}, fallback or DefaultPolicy(tool_calls=0)
    )
    return specs, policy
