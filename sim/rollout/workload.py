"""Workload profiles (docs/experiments.md#workloads): what one agent rollout looks like.

Covers: turns per rollout, initial context, tool output sizes and tool execution
times, drawn per rollout from a seed. Scenario: a rollout's task text fixes its
conversation key, so the server's policy can be told how many tool calls that
conversation makes (`DefaultPolicy.per_conversation`) while every API mode sees
the same rollout.

* interactive: turns median 20 (σ 0.3); tools lognormal(0.3 s, 0.8). Codex-interactive, "20+ tool calls".
* swe-long: turns median 55 (σ 0.5, cap 250); tools 97 % lognormal(0.5 s, 1.0) + 3 % lognormal(30 s, 1.5),
  cap 900 s. SWE-Bench Pro with SWE-agent (NIL).
* medium: turns median 30 (σ 0.15); tools as swe-long. SWE-smith, nebius SWE-agent.
* short: turns median 18 (σ 0.15, cap 50); tools as swe-long. OpenHands-style (SWE-Gym, R2E-Gym).
* agentic: turns median 20 (σ 0.6); tools lognormal(0.3 s, 2.86), cap 900 s: the per-call tool
  latency of the TraceLab trace of Claude Code and Codex sessions (P50 0.3 s, P90 13.6 s, P99
  3.6 min; σ fitted by least squares to the P90 and P99 log-ratios). The capacity job's default.

All: initial context ≈ 6,000 tokens, tool output lognormal(median 500 tokens,
σ 1.1) capped at 10,000 (the cap is named and applied, never silent).
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from prototype.context.conversation import conversation_key
from sim.rollout.spec import RolloutSpec, instructions, tool_output_text, turn_stream

__all__ = ["WORKLOADS", "ToolTime", "Workload", "draw_rollouts", "tool_times", "with_tail"]

TOOL_OUTPUT_CAP_TOKENS: Final = 10_000  # the Vercel demo truncates tool output at 10,000 characters


class ToolTime(msgspec.Struct, frozen=True):
    """One lognormal component of a tool-time mixture."""

    weight: float
    median_s: float
    sigma: float


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str
    turns_median: float
    turns_sigma: float
    turns_cap: int = 250
    tool_time: tuple[ToolTime, ...]
    tool_time_cap_s: float = 900.0
    tool_output_median_tokens: int = 500
    tool_output_sigma: float = 1.1
    system_prompt_tokens: int = 6000


_SWE_TOOLS: Final = (ToolTime(0.97, 0.5, 1.0), ToolTime(0.03, 30.0, 1.5))

WORKLOADS: Final[dict[str, Workload]] = {
    "interactive": Workload(name="interactive", turns_median=20, turns_sigma=0.3, tool_time=(ToolTime(1.0, 0.3, 0.8),)),
    "swe-long": Workload(name="swe-long", turns_median=55, turns_sigma=0.5, tool_time=_SWE_TOOLS),
    "medium": Workload(name="medium", turns_median=30, turns_sigma=0.15, tool_time=_SWE_TOOLS),
    "short": Workload(name="short", turns_median=18, turns_sigma=0.15, turns_cap=50, tool_time=_SWE_TOOLS),
    "agentic": Workload(name="agentic", turns_median=20, turns_sigma=0.6, tool_time=(ToolTime(1.0, 0.3, 2.86),)),
}


_WORKLOAD_STREAM: Final = 2  # last SeedSequence word of a workload's draws (custom rollouts have none)
_ROLLOUT_TURN: Final = 2**32 - 1  # the "turn" word of the per-rollout draw (its turn count)


def _tool_time(w: Workload, u: float, z: float) -> float:
    """The mixture component whose cumulative weight first exceeds `u`, at its lognormal."""
    total = sum(c.weight for c in w.tool_time)
    at = 0.0
    component = w.tool_time[-1]
    for c in w.tool_time:
        at += c.weight / total
        if u < at:
            component = c
            break
    return min(component.median_s * math.exp(component.sigma * z), w.tool_time_cap_s)


def with_tail(w: Workload, scale: float) -> Workload:
    """`w` with every tool-time component's σ multiplied by `scale` (its median kept): a lighter
    (< 1) or heavier (> 1) tail on the same draws."""
    if scale == 1.0:
        return w
    tools = tuple(msgspec.structs.replace(c, sigma=c.sigma * scale) for c in w.tool_time)
    return msgspec.structs.replace(w, tool_time=tools)


def tool_times(w: Workload, seed: int, index: int, calls: int) -> tuple[float, ...]:
    """Rollout `index`'s tool times as `draw_rollouts` draws them, without its texts: the same
    stream and draws, so `with_tail` changes the times and nothing else."""
    out = []
    for k in range(calls):
        rng = turn_stream(seed, index, k, _WORKLOAD_STREAM)
        u = float(rng.random())
        z_time = float(rng.standard_normal(2)[0])
        out.append(_tool_time(w, u, z_time))
    return tuple(out)


def draw_rollouts(w: Workload, seed: int, count: int, *, start: int = 0) -> tuple[list[RolloutSpec], dict[int, int]]:
    """Rollouts `start` … `start + count − 1` and, by conversation key, how many tool calls
    each makes (turns − 1). Common random numbers: a rollout's turn count comes from its
    own stream, and tool step k from `turn_stream(seed, index, k, 2)` (a uniform for the
    mixture component, a normal for its time, one for its output size, then the words),
    so a rollout is the same whichever other rollouts are drawn with it."""
    specs, per_conversation = [], {}
    prompt = instructions(w.system_prompt_tokens)
    for index in range(start, start + count):
        z_turns = float(turn_stream(seed, index, _ROLLOUT_TURN, _WORKLOAD_STREAM).standard_normal())
        turns = int(min(max(1, round(w.turns_median * math.exp(w.turns_sigma * z_turns))), w.turns_cap))
        calls = turns - 1
        times, outputs = [], []
        for k in range(calls):
            rng = turn_stream(seed, index, k, _WORKLOAD_STREAM)
            u = float(rng.random())
            z_time, z_size = rng.standard_normal(2).tolist()
            times.append(_tool_time(w, u, z_time))
            size = int(
                min(w.tool_output_median_tokens * math.exp(w.tool_output_sigma * z_size), TOOL_OUTPUT_CAP_TOKENS)
            )
            outputs.append(tool_output_text(rng, max(1, size)))
        task = f"Task {seed}.{index} ({w.name}): fix the failing test in module {index % 7}."
        specs.append(RolloutSpec(index, seed, task, tuple(times), tuple(outputs), prompt))
        per_conversation[conversation_key(task)] = calls
    return specs, per_conversation
