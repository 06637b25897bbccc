"""Target 11 of `python -m sim.bench`: the API's overhead per turn on a real engine (docs/engine.md).

A small comparison runs live with llama.cpp behind the server (`--engine llamacpp`, local
profile: only the API's real CPU work, no modeled waits), decoding verified (the planned tokens
k a forward pass: the engine's fast regime). Per mode, two rows:

* the verified decode rate: the turns' decoded tokens over their time from the first token to
  the last pass's reply (the client's clock, HTTP included), against the engine's own prefill
  rate in the same turns (its prompt tokens over its ``prompt_ms``), the rate verified decoding
  approaches as k grows. Goal: at least 250 tokens/s (issue 51's "fast regime");
* the API's overhead: what the client waited beyond the engine's own time, the turns'
  end-to-end times less the engine's request times for the same turns, both summed over the
  mode's rollouts, against the engine's time (the floor). Goal: under 10 % for `ws` and `append`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from sim.engine.config import EngineConfig
from sim.harness.experiment import CompareConfig, compare

__all__ = ["ENGINE_GOAL", "engine"]

ENGINE_GOAL = 0.10
VERIFIED_GOAL_TOK_S = 250.0
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
    base = config or EngineConfig(engine_kind="llamacpp", engine_decode="verified")
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
        mine = [t for t in result.engine_turns if t.tag == mode]
        decoded = sum(t.predicted_n for t in mine)
        decode_s = sum(t.total_s - t.ttft_s for t in mine)
        prefill_tok_s = sum(t.prompt_n for t in mine) / max(1e-9, sum(t.prompt_ms for t in mine) / 1e3)
        rate = decoded / decode_s if decode_s > 0 else float("nan")
        report(
            "11",
            f"{base.engine_decode} decode tokens/s, {mode} ({decoded} tokens; floor: the engine's prefill tokens/s)",
            rate,
            prefill_tok_s,
            rate / prefill_tok_s,
            f">= {VERIFIED_GOAL_TOK_S:.0f} tokens/s",
            rate >= VERIFIED_GOAL_TOK_S,
        )
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
