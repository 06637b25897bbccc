"""A comparison on a real engine: the modes interleaved, and a check that the engine's speed held.

A comparison's modes run the same rollouts. Run mode after mode on a real engine, anything that
changes the engine's speed over the run (another job on a shared machine, thermal limits) falls
on whichever mode ran then and reads as a design effect. So an engine comparison runs in
**rounds**: a round is as many rollouts as are in flight at once (`round_size`: one rollout at
concurrency 1), run in every mode, the modes in an order that rotates from round to round
(`rotation`: round 0 runs `http, ws, append`, round 1 `ws, append, http`, ...). Every mode
then samples the whole run.

`drift_report` then checks the engine's own speed from its per-turn counters
(`sim.engine.model.EngineTurn`, the run folder's engine.jsonl), per mode and across the run:

* **decode rate**: tokens decoded per second of the engine's own decode time (``predicted_n`` /
  ``predicted_ms``; verified decoding: its passes' summed time), over every turn (every mode
  decodes the same tokens);
* **prefill rate**: tokens prefilled per second of the engine's prefill time (``prompt_n`` /
  ``prompt_ms``) over the rollouts' first turns, which prefill the same prompt on erased slots in
  every mode (later turns prefill what each design's KV left, a design effect, not drift);
* **spread across modes**: the fastest mode's rate over the slowest's, less 1;
* **change over the run**: the last third of those turns (in the order the engine finished
  them) against the first third, |last / first − 1|.

Each spread is held against a bound (`DRIFT_BOUND`, 10 %); `Drift.within_bound` is False when any
measured spread exceeds it, and the comparison prints a warning beside its table
(docs/engine.md#drift).

`carry` then puts the drift into each time-saved interval against the base mode: a mode's engine
time at the run's pooled rates instead of its own (decode, and prefill at its first turns' rate)
differs by a number of seconds; the difference between that and the base's, over the base's total
time, is the share of the saving the engine's speed could explain, and the paired interval widens
by it on each side. Only where the designs do the same engine work at the same speed: with every
rollout on a slot of its own (no contention), the same tokens decode and the same first prompts
prefill in every mode, so a rate that differs by mode is the engine's, not the design's. Under
contention a second stream slows decoding by design, and nothing is carried.

Pure functions of the turns: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import msgspec

if TYPE_CHECKING:  # its module speaks to the engine: only the record's type is read here
    from sim.engine.model import EngineTurn

__all__ = [
    "DRIFT_BOUND",
    "Carried",
    "Drift",
    "ModeRates",
    "carry",
    "drift_report",
    "drift_text",
    "rotation",
    "round_size",
]

DRIFT_BOUND: Final = 0.10  # a spread of the engine's rates beyond this is reported as drift


def rotation(modes: Sequence[str], round_index: int) -> tuple[str, ...]:
    """The modes in the order round `round_index` runs them: the list rotated left by the round."""
    if not modes:
        return ()
    k = round_index % len(modes)
    return (*modes[k:], *modes[:k])


def round_size(concurrency: int, lanes: int) -> int:
    """Rollouts a round runs in each mode: those in flight at once (`concurrency`, or `lanes`
    sharing a connection), a whole number of lane groups."""
    size = max(concurrency, lanes, 1)
    return -(-size // lanes) * lanes if lanes else size


class ModeRates(msgspec.Struct, frozen=True, kw_only=True):
    """One mode's engine rates over the run (NaN where the engine reported no such time)."""

    mode: str
    decode_tok_s: float
    prefill_tok_s: float
    turns: int


class Carried(msgspec.Struct, frozen=True, kw_only=True):
    """One mode's time saved against `base` with the engine's drift carried (module docstring)."""

    mode: str
    base: str
    saved: float  # the paired saving, as the comparison measured it
    ci_low: float  # its interval, widened by |bias| on each side
    ci_high: float
    bias: float  # (engine seconds the mode lost to its rates − the base's) / the base's total seconds


class Drift(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's speed across modes and across the run, against `bound` (module docstring)."""

    bound: float
    modes: list[ModeRates]
    decode_across_modes: float  # fastest mode's decode rate / slowest's − 1
    prefill_across_modes: float
    decode_over_run: float  # |last third's decode rate / first third's − 1|
    prefill_over_run: float
    within_bound: bool
    carried: list[Carried] = []  # time saved with the drift carried (`carry`); empty under contention


def _rate(tokens: Sequence[int], ms: Sequence[float]) -> float:
    total_ms = sum(ms)
    return 1000.0 * sum(tokens) / total_ms if total_ms > 0 else math.nan


def _decode(turns: Sequence[EngineTurn]) -> float:
    timed = [t for t in turns if t.predicted_ms > 0]
    return _rate([t.predicted_n for t in timed], [t.predicted_ms for t in timed])


def _prefill(turns: Sequence[EngineTurn]) -> float:
    timed = [t for t in turns if t.turn_index == 0 and t.prompt_ms > 0]
    return _rate([t.prompt_n for t in timed], [t.prompt_ms for t in timed])


def _spread(rates: Sequence[float]) -> float:
    known = [r for r in rates if math.isfinite(r) and r > 0]
    return max(known) / min(known) - 1 if len(known) >= 2 else math.nan


def _over_run(turns: Sequence[EngineTurn], rate: Callable[[Sequence[EngineTurn]], float]) -> float:
    third = len(turns) // 3
    if third == 0:
        return math.nan
    first, last = rate(turns[:third]), rate(turns[-third:])
    return abs(last / first - 1) if first > 0 and math.isfinite(first) and math.isfinite(last) else math.nan


def drift_report(turns: Sequence[EngineTurn], modes: Sequence[str], *, bound: float = DRIFT_BOUND) -> Drift:
    """The engine's rates per mode of `modes` and their spreads from its turns in the order it
    finished them (an `EngineTurn.tag` is the mode it ran)."""
    per_mode = [
        ModeRates(
            mode=m,
            decode_tok_s=_decode(mine := [t for t in turns if t.tag == m]),
            prefill_tok_s=_prefill(mine),
            turns=len(mine),
        )
        for m in modes
    ]
    firsts = [t for t in turns if t.turn_index == 0]
    spreads = {
        "decode_across_modes": _spread([r.decode_tok_s for r in per_mode]),
        "prefill_across_modes": _spread([r.prefill_tok_s for r in per_mode]),
        "decode_over_run": _over_run([t for t in turns if t.predicted_ms > 0], _decode),
        "prefill_over_run": _over_run(firsts, _prefill),
    }
    within = all(not (s > bound) for s in spreads.values())  # NaN (not measured) is no evidence of drift
    return Drift(
        bound=bound,
        modes=per_mode,
        within_bound=within,
        decode_across_modes=spreads["decode_across_modes"],
        prefill_across_modes=spreads["prefill_across_modes"],
        decode_over_run=spreads["decode_over_run"],
        prefill_over_run=spreads["prefill_over_run"],
    )


def _lost_s(turns: Sequence[EngineTurn], pooled_decode: float, pooled_prefill: float) -> float:
    """Seconds these turns' engine time exceeds the same work at the pooled rates (negative: the
    mode ran faster than the pool)."""
    decode_s = sum(t.predicted_ms for t in turns if t.predicted_ms > 0) / 1000
    prefill_s = sum(t.prompt_ms for t in turns if t.prompt_ms > 0) / 1000
    lost = 0.0
    if decode_s > 0 and math.isfinite(pooled_decode):
        lost += decode_s * (1 - _decode(turns) / pooled_decode)
    own_prefill = _prefill(turns)
    if prefill_s > 0 and math.isfinite(pooled_prefill) and math.isfinite(own_prefill):
        lost += prefill_s * (1 - own_prefill / pooled_prefill)
    return lost


def carry(
    drift: Drift, turns: Sequence[EngineTurn], savings: Sequence[tuple[str, float, float, float]],
    *, base: str, base_total_s: float,
) -> Drift:  # fmt: skip
    """`drift` with each (mode, saved, ci_low, ci_high) against `base` carried (module docstring);
    `base_total_s` is the base mode's summed rollout time over the pairs. Call it only for a run
    without contention."""
    if base_total_s <= 0:
        return drift
    pooled_decode, pooled_prefill = _decode(turns), _prefill(turns)
    lost = {m.mode: _lost_s([t for t in turns if t.tag == m.mode], pooled_decode, pooled_prefill) for m in drift.modes}
    carried = []
    for mode, saved, low, high in savings:
        bias = (lost.get(mode, 0.0) - lost.get(base, 0.0)) / base_total_s
        carried.append(
            Carried(mode=mode, base=base, saved=saved, ci_low=low - abs(bias), ci_high=high + abs(bias), bias=bias)
        )
    return msgspec.structs.replace(drift, carried=carried)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f} %"


def drift_text(d: Drift) -> str:
    """The drift check as the comparison prints it beside its table: per mode the engine's rates,
    the spreads, and a warning when one exceeds the bound."""
    lines = ["the engine's own speed (engine.jsonl), modes interleaved by round:"]
    for r in d.modes:
        lines.append(
            f"  {r.mode}: decode {r.decode_tok_s:.1f} tokens/s, first-turn prefill {r.prefill_tok_s:.0f} tokens/s "
            f"({r.turns} turns)"
        )
    lines.append(
        f"  drift: decode {_pct(d.decode_across_modes)} across modes, {_pct(d.decode_over_run)} first to last third; "
        f"prefill {_pct(d.prefill_across_modes)} across modes, {_pct(d.prefill_over_run)} first to last third "
        f"(bound {100 * d.bound:g} %)"
    )
    for c in d.carried:
        lines.append(
            f"  {c.mode} vs {c.base}: time saved {100 * c.saved:.1f} % ({100 * c.ci_low:.1f} to {100 * c.ci_high:.1f} "
            f"with the drift carried: the engine's rates explain {100 * c.bias:+.2f} points)"
        )
    if not d.within_bound:
        lines.append(
            f"  WARNING: the engine's speed moved more than {100 * d.bound:g} % during the run: differences between "
            "modes of that size may be the engine's, not the designs'"
        )
    return "\n".join(lines)
