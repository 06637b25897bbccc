"""The rollouts a comparison runs: its first batch (a custom draw, a workload's or a replayed
trace's) with the server model's policy, the batches after it, and each rollout's seeded
interjections: functions of the config and its seed (and of a trace's file, read when replayed).
They read the config through `RolloutPlan`, the fields of `CompareConfig` that draw the rollouts,
so this module does not import the comparison that imports it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Final, Protocol

from sim.model.policy import DefaultPolicy, Policy
from sim.rollout.replay import load_trace, replay_plan
from sim.rollout.spec import RolloutSpec, draw_interjections, make_spec
from sim.rollout.workload import WORKLOADS, draw_rollouts

__all__ = ["RolloutPlan", "custom_specs", "first_rollouts", "interjected", "more_rollouts"]


class RolloutPlan(Protocol):
    """What of a `CompareConfig` draws its rollouts (read-only)."""

    @property
    def seed(self) -> int: ...
    @property
    def rollouts(self) -> int: ...
    @property
    def trace(self) -> str | None: ...
    @property
    def workload(self) -> str: ...
    @property
    def tool_calls(self) -> int: ...
    @property
    def tool_time_s(self) -> float: ...
    @property
    def tool_time_sigma(self) -> float: ...
    @property
    def tool_output_tokens(self) -> int: ...
    @property
    def system_prompt_tokens(self) -> int: ...
    @property
    def interjections(self) -> int: ...
    @property
    def interjection_window_s(self) -> float: ...


def first_rollouts(config: RolloutPlan, *, memoize: bool = False) -> tuple[list[RolloutSpec], Policy]:
    """The first batch of rollouts every mode runs, and the policy of the server's model. With
    `memoize`, a custom rollout drawn before in this process is reused (a spec is immutable):
    the points of a sweep that differ only in speed share it, texts and all."""
    if config.trace is not None:
        return replay_plan(load_trace(config.trace), config.seed)
    if config.workload != "custom":
        specs, per_conversation = draw_rollouts(WORKLOADS[config.workload], config.seed, config.rollouts)
        return specs, DefaultPolicy(tool_calls=config.tool_calls, per_conversation=per_conversation)
    return custom_specs(config, 0, config.rollouts, memoize), DefaultPolicy(tool_calls=config.tool_calls)


def custom_specs(config: RolloutPlan, start: int, count: int, memoize: bool = False) -> list[RolloutSpec]:
    make = _memo_spec if memoize else make_spec
    return [
        make(
            config.seed,
            i,
            max_turns=config.tool_calls,
            tool_time_median_s=config.tool_time_s,
            tool_time_sigma=config.tool_time_sigma,
            tool_output_median_tokens=config.tool_output_tokens,
            system_prompt_tokens=config.system_prompt_tokens,
        )
        for i in range(start, start + count)
    ]


def more_rollouts(config: RolloutPlan, policy: Policy, start: int, count: int, *, memoize: bool) -> list[RolloutSpec]:
    """Rollouts `start` … `start + count − 1` (for the next batch); a workload's new
    conversations get their tool-call counts in the policy's table."""
    if config.workload == "custom":
        return custom_specs(config, start, count, memoize)
    specs, per_conversation = draw_rollouts(WORKLOADS[config.workload], config.seed, count, start=start)
    table = getattr(policy, "per_conversation", None)
    if not isinstance(table, dict):
        raise TypeError("a workload's policy keeps a mutable per-conversation table")
    table.update(per_conversation)
    return specs


def interjected(config: RolloutPlan, specs: list[RolloutSpec]) -> list[RolloutSpec]:
    """The specs with `config.interjections` each (sim.rollout.spec.draw_interjections); as they are at 0."""
    if not config.interjections:
        return specs
    return [
        dataclasses.replace(
            spec,
            interjections=draw_interjections(
                config.seed, spec.index, config.interjections, len(spec.tool_times_s), config.interjection_window_s
            ),
        )
        for spec in specs
    ]


_memo_spec: Final = functools.lru_cache(maxsize=256)(make_spec)
