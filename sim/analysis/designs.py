"""Where each design of the agent loop saves time and what it pays for it: tidy rows from a
comparison's rollouts (notebook 05). Pure.

* `stage_savings`: per mode and per part of a rollout (each server stage of
  `prototype.pipeline.Stage`, the tools, and `other`: the rest of the rollout's time, the
  client's side of each turn: transfer, parsing, the gap before the next request), the seconds
  per rollout the mode spends less than `base` on the same seeded rollout, with the paired
  interval (`sim.analysis.stats.paired_mean` of the differences, docs/statistics.md). A rollout's parts add up to
  its time, so a mode's parts add up to its saving.
* `mode_costs`: per mode, what a rollout asks of the service: client messages and
  response objects per rollout (a steered or continued response's successor is a new
  object), server events, bytes uploaded, tokens rendered, API seconds before and after
  inference per turn, prefill per turn, and KV held idle.
* `kv_price`: the KV token·seconds a mode holds idle beyond `base`'s for each second it
  saves against `base`.
* `explain`: a mode's saving and its largest parts, as a sentence, from the rows.
* `verdict`: which side of zero an interval lies on, in words.

Stage seconds come from the server's stage report (`sim.analysis.metrics.per_turn_work`); a mode whose
report arrives only with the response's terminal event (`inject`) has the same per-rollout
totals, which is what these rows use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from prototype.pipeline import Stage
from sim.analysis.metrics import per_turn_work
from sim.analysis.stats import Estimate, paired_mean
from sim.rollout.result import RolloutResult

__all__ = [
    "BEFORE_INFERENCE",
    "DECIMALS",
    "PARTS",
    "KvPrice",
    "ModeCost",
    "StageSaving",
    "explain",
    "kv_price",
    "mode_costs",
    "rollout_parts",
    "stage_savings",
    "verdict",
]

# The API's stages on a turn's critical path before the model starts (pipeline order).
BEFORE_INFERENCE = (
    Stage.NETWORK,
    Stage.PARSE,
    Stage.LOAD_STATE,
    Stage.RENDER,
    Stage.SAFETY,
    Stage.ROUTING,
    Stage.INFERENCE_HOP,
)
PARTS = (*(s.value for s in Stage), "tool", "other")
# Differences are rounded to this many decimals of a second (1 ns) before their interval is
# taken: a part two modes spend identically (the same modeled wait every turn) then differs by
# exactly 0 or a constant, not by float rounding that the bootstrap would read as spread.
DECIMALS = 9


class StageSaving(msgspec.Struct, frozen=True, kw_only=True):
    """`base`'s seconds in `part` less `mode`'s, per rollout (mean over paired rollouts)."""

    mode: str
    base: str
    part: str
    saved_s: float
    ci_low: float
    ci_high: float
    n: int

    @property
    def estimate(self) -> Estimate:
        return Estimate(self.saved_s, self.ci_low, self.ci_high, self.n)


class ModeCost(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    rollouts: int
    turns_per_rollout: float
    messages_per_rollout: float  # client → server messages (a POST, or a WebSocket frame), one per turn
    responses_per_rollout: float  # response objects the client saw (distinct ids, steered ones included)
    events_per_turn: float  # server events the client received
    bytes_per_turn: float  # client → server payload
    tokens_rendered_per_turn: float
    before_inference_s_per_turn: float  # Σ BEFORE_INFERENCE stages / turns
    post_inference_s_per_turn: float  # post-inference work left on the critical path
    prefill_s_per_turn: float
    kv_idle_token_s_per_rollout: float  # NaN when the run did not report it
    kv_idle_tokens_mean: float  # KV idle token·s / rollout seconds: tokens held idle on average


class KvPrice(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    base: str
    saved_s: float  # per rollout, paired, with its interval
    saved_ci_low: float
    saved_ci_high: float
    n: int
    extra_kv_idle_token_s: float  # per rollout, beyond base's
    kv_token_s_per_second_saved: float  # NaN when nothing is saved


def rollout_parts(result: RolloutResult) -> dict[str, float]:
    """One rollout's time by part (`PARTS`); the parts sum to its completion time."""
    parts = dict.fromkeys(PARTS, 0.0)
    for work in per_turn_work(result):
        for key, seconds in work.items():
            if key.startswith("stage:"):
                parts[key[6:]] = parts.get(key[6:], 0.0) + seconds
    parts["tool"] = result.tool_time_s
    parts["other"] = result.completion_s - sum(v for k, v in parts.items() if k != "other")
    return parts


def _response_ids(result: RolloutResult) -> set[str]:
    """Every response object of a rollout: each turn's, and the ones a steer ended in it."""
    return {r.id for t in result.turns for r in (*t.steered, t.response)}


def _modes(results: Sequence[RolloutResult]) -> list[str]:
    return list(dict.fromkeys(r.mode for r in results))


def stage_savings(results: Sequence[RolloutResult], base: str = "http", *, seed: int = 0) -> list[StageSaving]:
    """Per mode other than `base` (run order) and per part (`PARTS` order) that is not zero in
    every rollout of every mode: seconds saved against `base`, paired by rollout index."""
    by_mode: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        by_mode.setdefault(r.mode, {})[r.index] = rollout_parts(r)
    if base not in by_mode:
        raise ValueError(f"no {base!r} rollouts to compare against (modes: {', '.join(by_mode)})")
    used = [p for p in PARTS if any(parts[p] != 0 for m in by_mode.values() for parts in m.values())]
    rows = []
    for mode in _modes(results):
        if mode == base:
            continue
        shared = sorted(by_mode[base].keys() & by_mode[mode].keys())
        for part in used:
            saved = [round(by_mode[base][i][part] - by_mode[mode][i][part], DECIMALS) for i in shared]
            e = paired_mean(saved, seed=seed)
            rows.append(
                StageSaving(mode=mode, base=base, part=part, saved_s=e.value, ci_low=e.ci_low, ci_high=e.ci_high, n=e.n)
            )
    return rows


def mode_costs(results: Sequence[RolloutResult], kv_idle_token_s: Mapping[str, float] | None = None) -> list[ModeCost]:
    """Per mode, in run order. `kv_idle_token_s`: the run's total per mode (a `ModeSummary` field)."""
    out = []
    for mode in _modes(results):
        rs = [r for r in results if r.mode == mode]
        turns = [t for r in rs for t in r.turns]
        parts = [rollout_parts(r) for r in rs]
        work = [w for r in rs for w in per_turn_work(r)]
        n_turns = len(turns)
        kv = (kv_idle_token_s or {}).get(mode, math.nan)
        seconds = sum(r.completion_s for r in rs)
        out.append(
            ModeCost(
                mode=mode,
                rollouts=len(rs),
                turns_per_rollout=n_turns / len(rs),
                messages_per_rollout=n_turns / len(rs),
                responses_per_rollout=float(np.mean([len(_response_ids(r)) for r in rs])),
                events_per_turn=sum(t.events for t in turns) / n_turns,
                bytes_per_turn=sum(t.bytes_sent for t in turns) / n_turns,
                tokens_rendered_per_turn=sum(w.get("tokens_rendered", 0.0) for w in work) / n_turns,
                before_inference_s_per_turn=sum(p[s.value] for p in parts for s in BEFORE_INFERENCE) / n_turns,
                post_inference_s_per_turn=sum(p[Stage.POST.value] for p in parts) / n_turns,
                prefill_s_per_turn=sum(p[Stage.PREFILL.value] for p in parts) / n_turns,
                kv_idle_token_s_per_rollout=kv / len(rs),
                kv_idle_tokens_mean=kv / seconds if seconds > 0 else math.nan,
            )
        )
    return out


def kv_price(
    results: Sequence[RolloutResult], kv_idle_token_s: Mapping[str, float], base: str = "ws", *, seed: int = 0
) -> list[KvPrice]:
    """Per mode other than `base`: seconds saved per rollout against `base` (paired) and the
    KV token·seconds it holds idle beyond `base`'s per rollout, per second saved."""
    times: dict[str, dict[int, float]] = {}
    counts: dict[str, int] = {}
    for r in results:
        times.setdefault(r.mode, {})[r.index] = r.completion_s
        counts[r.mode] = counts.get(r.mode, 0) + 1
    if base not in times:
        raise ValueError(f"no {base!r} rollouts to compare against (modes: {', '.join(times)})")
    rows = []
    for mode in _modes(results):
        if mode == base:
            continue
        shared = sorted(times[base].keys() & times[mode].keys())
        e = paired_mean([round(times[base][i] - times[mode][i], DECIMALS) for i in shared], seed=seed)
        extra = kv_idle_token_s[mode] / counts[mode] - kv_idle_token_s[base] / counts[base]
        rows.append(
            KvPrice(
                mode=mode,
                base=base,
                saved_s=e.value,
                saved_ci_low=e.ci_low,
                saved_ci_high=e.ci_high,
                n=e.n,
                extra_kv_idle_token_s=extra,
                kv_token_s_per_second_saved=extra / e.value if e.value > 0 else math.nan,
            )
        )
    return rows


def _seconds(x: float, sign: str = "+") -> str:
    """Seconds to two decimals, or milliseconds to three significant figures below 0.1 s."""
    return f"{x:{sign}.2f} s" if abs(x) >= 0.1 or x == 0 else f"{1000 * x:{sign}.3g} ms"


def _pm(low: float, high: float) -> str:
    if math.isnan(low) or math.isnan(high):
        return "no interval"
    return f"95 % CI {_seconds(low, '')} to {_seconds(high, '')}"


def explain(rows: Sequence[StageSaving], mode: str, *, top: int = 3) -> str:
    """`mode`'s total saving against the rows' base, then its `top` largest parts that differ
    (by size, either sign), each with its interval; from `stage_savings` rows."""
    mine = [r for r in rows if r.mode == mode]
    if not mine:
        raise ValueError(f"no rows for {mode!r}")
    base, n = mine[0].base, mine[0].n
    total = sum(r.saved_s for r in mine)
    largest = sorted((r for r in mine if r.saved_s != 0), key=lambda r: -abs(r.saved_s))[:top]
    if not largest:
        return f"{mode} against {base}: no part differs (n={n})"
    parts = "; ".join(f"{r.part} {_seconds(r.saved_s)} ({_pm(r.ci_low, r.ci_high)})" for r in largest)
    return f"{mode} against {base}: {_seconds(total)} saved per rollout (n={n}); largest parts: {parts}"


def verdict(
    value: float, low: float, high: float, *, lower: str = "lower", higher: str = "higher", atol: float = 1e-9
) -> str:
    """`lower` when the whole interval is below 0, `higher` when above (by more than `atol`: a
    difference of float rounding is none); otherwise that this many rollouts cannot tell it
    from 0, or, with a missing bound, that more are needed."""
    if math.isnan(low) or math.isnan(high):
        return f"{value:+.3g}, no interval: more rollouts needed"
    if high < -atol:
        return lower
    if low > atol:
        return higher
    return "not distinguishable from 0 at this n"
