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

**Sized turns** (what `python -m sim record` writes as `workload.jsonl`, sim/record/workload.py):
a line with `output_tokens` and no `assistant` is a turn known by its sizes only:

    {"rollout": "conv-0", "turn": 0, "mode": "ws", "input_tokens": 812, "cached_tokens": 0,
     "output_tokens": 95, "tool_call": true, "tool_time_s": 1.2}

Its content is filler of those sizes, drawn from the rollout's name: the task is the first
turn's `input_tokens` less the replay's own prompt around it (`REPLAY_PROMPT_TOKENS`); a turn
with `tool_call` calls `exec_command` with arguments of `output_tokens`, else answers in a text
of `output_tokens`; a tool's output is what the next turn's input adds to this turn's input and
output (`TOOL_ITEM_TOKENS` of it is the item's framing). `task`, `instructions`, `assistant` and
`tool_output` given on a sized line (`record --keep-content`) are used as they are. `turn`,
`mode` and `cached_tokens` are what the recorder saw; the replay recomputes caching itself.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np

from prototype.context.conversation import conversation_key
from sim.model.policy import ConversationPolicy, DefaultPolicy, PlannedItem, Policy, ScriptPolicy, parse_turn
from sim.rollout.spec import RolloutSpec, tool_output_text

__all__ = ["REPLAY_PROMPT_TOKENS", "TOOL_ITEM_TOKENS", "RecordedRollout", "load_trace", "replay_plan"]

_KEYS = frozenset({"rollout", "task", "instructions", "assistant", "tool_output", "tool_time_s"})
_SIZED_KEYS = frozenset({"turn", "mode", "input_tokens", "cached_tokens", "output_tokens", "tool_call"})
# The replayed prompt's tokens besides the task on a sized rollout's first turn (the harness's
# exec_command tool and the message framing, no instructions), and the framing of a tool's output
# item and of a call's arguments: what tests/sim/rollout/test_replay.py measures a replay to hold.
REPLAY_PROMPT_TOKENS: Final = 87
TOOL_ITEM_TOKENS: Final = 35
_CALL_TOKENS: Final = 6


@dataclass(slots=True)
class RecordedRollout:
    name: str
    task: str
    instructions: str | None
    turns: list[tuple[PlannedItem, ...]] = field(default_factory=list)
    tool_outputs: list[str] = field(default_factory=list)
    tool_times_s: list[float] = field(default_factory=list)


def load_trace(path: str | os.PathLike[str]) -> list[RecordedRollout]:
    grouped: dict[str, list[tuple[str, dict[str, Any]]]] = {}
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
        unknown = sorted(set(entry) - _KEYS - _SIZED_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
        grouped.setdefault(str(entry.get("rollout", "")), []).append((where, entry))
    rollouts = [_rollout(name, lines) for name, lines in grouped.items()]
    keys = [conversation_key(r.task) for r in rollouts]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path}: two rollouts share a task; each rollout needs its own")
    return rollouts


def _count(entry: dict[str, Any], key: str, where: str) -> int:
    v = entry.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{where}: a sized turn needs '{key}' (an integer >= 0)")
    return v


def _filler(name: str, turn: int, part: int, tokens: int) -> str:
    """About `tokens` tokens of words, the same for the same (rollout, turn, part): one token a
    word and one a line of twelve (`tool_output_text`)."""
    digest = hashlib.blake2b(f"{name}\0{turn}\0{part}".encode(), digest_size=8).digest()
    return tool_output_text(np.random.default_rng(int.from_bytes(digest, "big")), max(1, round(tokens * 12 / 13)))


def _rollout(name: str, lines: list[tuple[str, dict[str, Any]]]) -> RecordedRollout:
    where, first = lines[0]
    sized = [("assistant" not in e and "output_tokens" in e) for _, e in lines]
    task = first.get("task")
    if not isinstance(task, str):
        if not sized[0]:
            raise ValueError(f"{where}: a rollout's first line needs a 'task' string")
        task = f"Task {name}: " + _filler(name, 0, 0, _count(first, "input_tokens", where) - REPLAY_PROMPT_TOKENS)
    instructions = first.get("instructions")
    rollout = RecordedRollout(name, task, instructions if isinstance(instructions, str) else None)
    for k, (where, entry) in enumerate(lines):
        if sized[k]:
            out = _count(entry, "output_tokens", where)
            if entry.get("tool_call") is True:
                args = msgspec.json.encode({"cmd": _filler(name, k, 1, out - _CALL_TOKENS)}).decode()
                turn: tuple[PlannedItem, ...] = (PlannedItem("function_call", "exec_command", args),)
            else:
                turn = (PlannedItem("message", "", _filler(name, k, 1, out)),)
        elif isinstance(entry.get("assistant"), dict):
            turn = parse_turn(entry["assistant"], where)
        else:
            raise ValueError(f"{where}: 'assistant' must be an object (a --script line)")
        rollout.turns.append(turn)
        if not any(item.kind == "function_call" for item in turn):
            continue
        output, seconds = entry.get("tool_output"), entry.get("tool_time_s")
        if output is None and sized[k]:
            output = _filler(name, k, 2, _tool_tokens(lines, k, where))
        if not isinstance(output, str) or not isinstance(seconds, int | float) or seconds < 0:
            raise ValueError(f"{where}: a turn with calls needs 'tool_output' (string) and 'tool_time_s' (>= 0)")
        rollout.tool_outputs.append(output)
        rollout.tool_times_s.append(float(seconds))
    return rollout


def _tool_tokens(lines: list[tuple[str, dict[str, Any]]], k: int, where: str) -> int:
    """A sized tool output: what the next turn's input adds to this turn's input and output, less
    the item's framing; without a next sized turn (a recording cut short), the turn's own output's size."""
    entry = lines[k][1]
    if k + 1 < len(lines) and "input_tokens" in lines[k + 1][1]:
        grown = _count(lines[k + 1][1], "input_tokens", lines[k + 1][0]) - _count(entry, "input_tokens", where)
        return grown - _count(entry, "output_tokens", where) - TOOL_ITEM_TOKENS
    return _count(entry, "output_tokens", where)


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
