"""Closed-loop agent rollouts against a live server on loopback, one mode at a time.

Covers: the rollout loop shared by every mode. Scenario: an agent sends a task,
streams the response, runs each tool call it receives (sim/tools.py: a simulated tool
time drawn from the workload and a tool output of a drawn size, or a real subprocess), sends the outputs
and repeats until the model answers with text. The next turn starts at the
previous turn's end plus tool time (closed loop, never a trace timestamp).

Same tokens in every mode: the task text, tool outputs and tool times of a
rollout come from rngs seeded by (seed, rollout index, turn) only, and the server's
model output depends only on (seed, conversation, turn), so every mode feeds
the simulator the same model-visible token sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from prototype.client import Mode, ResponsesClient, TurnResult, tool_outputs
from prototype.clock import Clock

from .tools import SimulatedTools, ToolRunner

__all__ = ["RolloutResult", "RolloutSpec", "make_spec", "run_rollout", "tool_output_text", "turn_stream"]

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
    tools = tools or SimulatedTools()
    settings: dict[str, Any] = {
        "model": model,
        "instructions": spec.instructions,
        "tools": [EXEC_TOOL],
        "store": client.mode == "http_prev" if store is None else store,
    }
    if context_management is not None:
        settings["context_management"] = context_management
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
