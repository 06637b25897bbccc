"""A rollout's specification: what the simulated agent will send, drawn from a seed.

Same tokens in every mode: the task text, tool outputs and tool times of a rollout come from
rngs seeded by (seed, rollout index, turn) only (`turn_stream`), and the server's model output
depends only on (seed, conversation, turn), so every mode feeds the simulator the same
model-visible token sequence. Interjections (user messages mid-rollout,
docs/experiments.md#interjections) are drawn from their own stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

__all__ = [
    "EXEC_TOOL",
    "Interjection",
    "RolloutSpec",
    "draw_interjections",
    "instructions",
    "make_spec",
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
class Interjection:
    """A user message that arrives while rollout turn `turn` runs, `delay_s` after that turn's
    first token (docs/experiments.md#interjections)."""

    turn: int
    delay_s: float
    text: str

    def message(self) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": self.text}


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    index: int
    seed: int
    task: str
    tool_times_s: tuple[float, ...]  # one per possible tool turn
    tool_outputs: tuple[str, ...]
    instructions: str = _INSTRUCTION_LINE
    interjections: tuple[Interjection, ...] = ()  # user messages mid-rollout (draw_interjections)


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
