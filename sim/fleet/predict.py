"""The fleet model's prediction of a contention run on one engine, turn by turn, to hold against
a measurement (issue 42's check against the real engine).

`predict_turns` serves M rollouts on one replica of N slots (llama.cpp's `--parallel N`) under
an engine's step costs (by default the llama.cpp CPU set of sim/fleet/compute.py), all rollouts
starting at once, with no API work (the `local` profile: the engine is driven directly) and no
KV limit unless given. The rollouts are given as the measurement has them: per turn the prompt
tokens (the whole context), the output tokens, and the tool time after each turn but the last.
What a design changes is the KV between turns: `append` holds a paused rollout's context in its
slot; `ws` and `http` leave it to the prefix cache: by default one that follows a conversation
to any slot (a host-RAM prompt cache); with `slot_cache` the KV of the last sequence each slot
served, the shared prefix reusable from any (`FleetConfig.slot_cache`). `held_slot`: the paused
rollout also keeps the slot itself (llama.cpp's slot is one sequence: pinned, no other request
runs in it), where the fleet's default frees it at the turn's end as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from prototype.pipeline import load_profile
from sim.fleet.compute import StepCost
from sim.fleet.config import FleetConfig
from sim.fleet.engine import SHARED_PREFIX_EXTRA, simulate
from sim.fleet.sessions import STEP_TEMPLATE_TOKENS, SessionTokens
from sim.model.config import HOSTED_MODEL
from sim.model.kv import DEFAULT_BLOCK_TOKENS

__all__ = ["TurnPrediction", "predict_turns"]


@dataclass(frozen=True, slots=True)
class TurnPrediction:
    ttft_s: float  # turn sent → first token
    turn_s: float  # turn sent → last token
    admission_wait_s: float  # waiting for a slot (or KV)


def predict_turns(
    mode: str,
    slots: int,
    prompt_tokens: Sequence[Sequence[int]],
    output_tokens: Sequence[Sequence[int]],
    tool_times_s: Sequence[Sequence[float]],
    *,
    engine: str | StepCost = "llamacpp-cpu",
    kv_budget_tokens: int = 0,
    starts_s: Sequence[float] | None = None,
    held_slot: bool = False,
    slot_cache: bool = False,
    shared_tokens: int = 0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    host_cache_tokens: int = 0,
) -> list[list[TurnPrediction]]:
    """Each rollout's turns as the fleet model predicts them (see the module's docstring).
    `shared_tokens`: the prompt prefix every rollout shares (the system prompt: any slot's KV
    serves it). `block_tokens`: the engine's prefix-cache granularity (llama.cpp's slots: 1).
    `host_cache_tokens` (with `slot_cache`): llama.cpp's host-RAM prompt cache, in tokens
    (`FleetConfig.slot_host_cache_tokens`).
    Refuses rollouts whose contexts do not grow by at least each turn's output and template."""
    m = len(prompt_tokens)
    if not (len(output_tokens) == len(tool_times_s) == m) or m == 0:
        raise ValueError("one prompt, output and tool-time list per rollout, at least one rollout")
    sessions = []
    for i, (prompts, outputs, tools) in enumerate(zip(prompt_tokens, output_tokens, tool_times_s, strict=True)):
        if not prompts or len(outputs) != len(prompts) or len(tools) != len(prompts) - 1:
            raise ValueError(f"rollout {i}: one output per turn, one tool time between turns")
        added = [prompts[k + 1] - prompts[k] - outputs[k] - STEP_TEMPLATE_TOKENS for k in range(len(prompts) - 1)]
        if any(a < 0 for a in added) or any(o < 1 for o in outputs) or prompts[0] < 1:
            raise ValueError(f"rollout {i}: each context must hold the previous one, its output and the template")
        sessions.append(
            SessionTokens(
                index=i,
                instruction_tokens=max(0, shared_tokens - SHARED_PREFIX_EXTRA),
                first_prompt_tokens=prompts[0],
                instruction_bytes=0,
                first_request_bytes=0,
                output_tokens=tuple(outputs),
                output_bytes=(0,) * len(outputs),
                tool_times_s=tuple(tools),
                tool_tokens=tuple(added),
                tool_bytes=(0,) * len(added),
            )
        )
    config = FleetConfig(
        replicas=1,
        engine=engine,
        kv_budget_tokens=kv_budget_tokens,
        hold_policy="hold",
        held_slot=held_slot,
        slot_cache=slot_cache,
        slot_host_cache_tokens=host_cache_tokens,
        model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=slots, prefix_block_tokens=block_tokens),
    )
    starts = list(starts_s) if starts_s is not None else [0.0] * m
    run = simulate(mode, load_profile("local"), config, sessions, arrivals=starts)
    out: list[list[TurnPrediction]] = [[] for _ in range(m)]
    for record in run.sessions:
        out[record.index] = [
            TurnPrediction(t, e, w)
            for t, e, w in zip(record.ttft_s, record.e2e_s, record.admission_wait_s, strict=True)
        ]
    return out
