"""Target 11 of `python -m sim.bench`: the API's overhead per turn on a real engine (docs/engine.md).

A small comparison runs live with llama.cpp behind the server (`--engine llamacpp`, local
profile: only the API's real CPU work, no modeled waits). Per mode, the API's overhead is what
the client waited beyond the engine's own time: the turns' end-to-end times less the engine's
``/completion`` times for the same turns, both summed over the mode's rollouts. The floor is
the engine's time itself: the ratio is overhead / engine time, the share the API adds at the
engine's speed. Goal: under 10 % for `ws` and `append` (at ~50-75 tokens/s the API's work
hides inside inference: the post's "little at 65 tokens/s").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from sim.engine.config import EngineConfig
from sim.harness.experiment import CompareConfig, compare

__all__ = ["ENGINE_GOAL", "engine"]

ENGINE_GOAL = 0.10
MODES = ("http", "ws", "append")


def engine(
    report: Callable[[str, str, float, float, float, str, bool | None], None],
    rollouts: int,
    *,
    tool_calls: int = 3,
    config: EngineConfig | None = None,
) -> None:
    with contextlib.suppress(OSError):  # the engine and its server are not the load generator: every core
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    base = config or EngineConfig(engine_kind="llamacpp")
    settings = {f: getattr(base, f) for f in base.__struct_fields__}
    compare_config = CompareConfig.of(
        **settings,
        modes=MODES,
        profile="local",
        rollouts=rollouts,
        tool_calls=tool_calls,
        system_prompt_tokens=600,
        tool_output_tokens=120,
        tool_time_s=0.1,
    )
    result = compare(compare_config, virtual=False)
    for mode in MODES:
        e2e = sum(t.e2e_s for r in result.rollouts if r.mode == mode for t in r.turns)
        engine_s = sum(t.total_s for t in result.engine_turns if t.tag == mode)
        turns = sum(1 for t in result.engine_turns if t.tag == mode)
        overhead = e2e - engine_s
        ratio = overhead / engine_s if engine_s > 0 else float("nan")
        report(
            "11",
            f"API overhead ms/turn on the engine, {mode} ({turns} turns; floor: engine ms/turn)",
            1000 * overhead / max(1, turns),
            1000 * engine_s / max(1, turns),
            ratio,
            f"< {ENGINE_GOAL:.0%} of the engine" if mode != "http" else "(reported)",
            ratio < ENGINE_GOAL if mode != "http" else None,
        )
