"""The engine's slots sized to a comparison's workload, before the engine starts (docs/engine.md).

The simulator plans every rollout (seeded): its tool outputs, its model turns and so each turn's
prompt are known without running it (`sim.fleet.sessions.from_spec`, checked against the full
path). So the largest context any rollout reaches is known up front, and `fit_engine` either
sizes the slots for it or refuses in one line with the flags that fit:

* slots of a given size (`--engine-ctx-per-slot`, or an attached engine's, 8192 unless said):
  kept if the largest prompt fits, refused otherwise;
* no size given, an engine longrun starts: 8192 tokens, or the smallest slot that takes the
  largest prompt with the API's output room when that is more; refused when it is past the
  model's trained context or its slots' KV past half the memory available.

A trace's rollouts and a compacting run's contexts are not planned here: their slots keep the
given or default size, and a rollout that outgrows them is a failed row of the comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from msgspec import structs

from sim.engine.backend import CTX_STEP, MODEL_CONTEXT, ctx_for, prompt_limit, slot_kv_bytes
from sim.engine.config import DEFAULT_CTX_PER_SLOT
from sim.fleet.sessions import from_spec
from sim.harness.experiment import CompareConfig
from sim.harness.specs import custom_specs
from sim.rollout.workload import WORKLOADS, draw_rollouts

__all__ = [
    "EngineTooSmall",
    "Largest",
    "available_memory",
    "fit_engine",
    "kv_mib",
    "largest_context",
    "planned_prompts",
]

# An interjection's user message with its template, at most (the message is ≈ 13 tokens): added to
# every turn's prompt of a run with interjections, so the plan stays an upper bound.
INTERJECTION_TOKENS: Final = 32


class EngineTooSmall(ValueError):
    """The workload's largest context does not fit the engine's slots: one line, with the flags that fit."""


@dataclass(frozen=True, slots=True)
class Largest:
    """The largest prompt of a workload: its tokens, and the rollout and (0-based) model turn that read it."""

    tokens: int
    rollout: int
    turn: int


def planned_prompts(config: CompareConfig) -> dict[int, list[int]] | None:
    """Per rollout index, the prompt tokens of each model turn as the simulator plans them (with
    `ci_width`, of every rollout up to `max_rollouts`); None for a trace or a compacting run."""
    if config.trace is not None or config.compact_threshold:
        return None
    count = config.max_rollouts if config.ci_width > 0 else config.rollouts
    if config.workload == "custom":
        sessions = [from_spec(spec, config.tool_calls) for spec in custom_specs(config, 0, count)]
    else:
        specs, _ = draw_rollouts(WORKLOADS[config.workload], config.seed, count)
        sessions = [from_spec(s, len(s.tool_outputs)) for s in specs]
    extra = config.interjections * INTERJECTION_TOKENS
    return {s.index: [p + extra for p in s.prompt_tokens()] for s in sessions}


def largest_context(prompts: dict[int, list[int]]) -> Largest:
    return max(
        (Largest(p, i, k) for i, turns in prompts.items() for k, p in enumerate(turns)),
        key=lambda x: (x.tokens, -x.rollout, -x.turn),
    )


def available_memory() -> int | None:
    """Bytes of memory available to a new process (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def kv_mib(ctx_per_slot: int) -> float:
    return slot_kv_bytes(ctx_per_slot) / 2**20


def _tool_calls_that_fit(config: CompareConfig, prompts: dict[int, list[int]], limit: int) -> int | None:
    """The most tool calls (fewer than the config's) whose rollouts all fit `limit`: a rollout of k
    calls is the first k + 1 turns of the planned one (common random numbers); None if none does."""
    if config.workload != "custom":
        return None
    fits = [k for k in range(config.tool_calls) if all(turns[k] <= limit for turns in prompts.values())]
    return max(fits) if fits else None


def _smaller(config: CompareConfig, prompts: dict[int, list[int]], limit: int) -> str:
    """The workload's own flags that fit `limit`."""
    if config.workload != "custom":
        return f"a smaller workload than {config.workload}"
    calls = _tool_calls_that_fit(config, prompts, limit)
    fewer = f"--tool-calls {calls}, or " if calls is not None else ""
    return f"{fewer}smaller --system-prompt-tokens/--tool-output-tokens"


def fit_engine(config: CompareConfig, *, memory_bytes: int | None = None) -> CompareConfig:
    """`config` with its llama.cpp engine's slot context set for the workload's largest context,
    or `EngineTooSmall`. `memory_bytes`: what is available (default: read from the system)."""
    engine = config.engine
    if engine.engine_kind != "llamacpp":
        return config
    prompts = planned_prompts(config)
    if prompts is None:
        return config
    need = largest_context(prompts)
    where = f"the workload's largest context is {need.tokens:,} tokens (rollout {need.rollout}, turn {need.turn})"
    fitting = ctx_for(need.tokens)
    if engine.engine_ctx_per_slot is not None or engine.engine_url is not None:  # a size given: kept or refused
        ctx = engine.ctx_per_slot
        limit = prompt_limit(ctx)
        if need.tokens <= limit:
            return structs.replace(config, engine=structs.replace(engine, engine_ctx_per_slot=ctx))
        larger = (
            f"--engine-ctx-per-slot {fitting} ({kv_mib(fitting):,.0f} MiB of KV a slot)"
            if fitting <= MODEL_CONTEXT
            else ""
        )
        if engine.engine_url is not None and larger:
            larger = f"an engine started with -c {fitting * engine.engine_slots} and {larger}"
        fix = f"{larger}, or {_smaller(config, prompts, limit)}" if larger else _smaller(config, prompts, limit)
        raise EngineTooSmall(
            f"{where}; the engine's slots of {ctx:,} tokens take prompts up to {limit:,}: run with {fix}"
        )
    ctx = max(DEFAULT_CTX_PER_SLOT, fitting)
    if ctx > MODEL_CONTEXT:
        limit = prompt_limit(MODEL_CONTEXT)
        raise EngineTooSmall(
            f"{where}; Gemma 3 270M reads at most {MODEL_CONTEXT:,} tokens a slot (prompts up to {limit:,} with the "
            f"output room): run with {_smaller(config, prompts, limit)}"
        )
    memory = available_memory() if memory_bytes is None else memory_bytes
    total = engine.engine_slots * slot_kv_bytes(ctx)
    if memory is not None and total > memory // 2:
        room = (memory // 2) // engine.engine_slots // slot_kv_bytes(CTX_STEP) * CTX_STEP  # tokens a slot may hold
        limit = prompt_limit(max(CTX_STEP, room))
        raise EngineTooSmall(
            f"{where}; {engine.engine_slots} slots of {ctx:,} tokens take {total / 2**20:,.0f} MiB of KV, more than "
            f"half the {memory / 2**20:,.0f} MiB available: run with fewer --engine-slots, or "
            f"{_smaller(config, prompts, limit)}"
        )
    return structs.replace(config, engine=structs.replace(engine, engine_ctx_per_slot=ctx))
