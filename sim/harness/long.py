"""Long rollouts with and without compaction, through the comparison (`python -m sim long`).

Covers: one `CompareConfig` run twice on the same seeded rollouts, once without
`context_management` and once with every mode's creates carrying its `compact_threshold`
(docs/compaction.md), and what each turn cost in windows of turns. Scenario: a rollout of
many tool calls (200 by default), whose context grows with every tool output unless the
server compacts it. The model's outputs are the same in both runs (the compaction item
carries the model's turn count), so the two runs differ only in the context.

Figures (sim.analysis.metrics): per mode and window, the per-turn E2E time and the prompt the model
read, each the mean over a rollout's turns in the window and then over rollouts with its
interval; the with-less-without difference of per-turn E2E, paired by rollout; per mode, the
compactions per rollout, the `compaction` stage's seconds per compaction, the prompt a
compacting turn read; per mode without and with, the connection-cache and prompt-token hit
rates and the held KV's idle token·s (sim.analysis.metrics.ModeSummary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import structs

from sim.analysis.metrics import (
    CompactionSummary,
    WindowDifference,
    WindowSummary,
    compaction_summary,
    turn_windows,
    window_differences,
)
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.harness.trace import write_json, write_run, write_table

__all__ = ["LongResult", "long_tables", "run_long", "write_long"]


@dataclass(frozen=True, slots=True)
class LongResult:
    config: CompareConfig  # with its compact_threshold (the run without has 0)
    window_turns: int
    without: CompareResult
    with_compaction: CompareResult
    windows: list[tuple[int, WindowSummary]]  # (compact_threshold, window), without first
    differences: list[WindowDifference]  # with less without
    compaction: list[CompactionSummary]  # the run with compaction


def run_long(
    config: CompareConfig, *, window_turns: int = 50, charge_cpu: bool = False, progress: bool = False
) -> LongResult:
    """`config` without compaction and with its `compact_threshold` (which must be set), in
    virtual time; CPU work is free unless `charge_cpu` (then memoization is off too)."""
    if config.compact_threshold <= 0:
        raise ValueError("a long run compares without and with compaction: set compact_threshold")
    if window_turns < 1:
        raise ValueError("window_turns must be >= 1")
    free = not charge_cpu
    without = compare(structs.replace(config, compact_threshold=0), virtual=True, free_cpu=free, progress=progress)
    with_ = compare(config, virtual=True, free_cpu=free, progress=progress)
    seed = config.seed
    windows = [(0, w) for w in turn_windows(without.rollouts, window_turns, seed=seed)]
    windows += [(config.compact_threshold, w) for w in turn_windows(with_.rollouts, window_turns, seed=seed)]
    return LongResult(
        config,
        window_turns,
        without,
        with_,
        windows,
        window_differences(without.rollouts, with_.rollouts, window_turns, seed=seed),
        compaction_summary(with_.rollouts, with_.summary, seed=seed),
    )


def _ci(value: float, low: float, high: float, fmt: str) -> str:
    def one(x: float) -> str:
        return "?" if math.isnan(x) else format(x, fmt)

    return f"{one(value)} ({one(low)}–{one(high)})"


def long_tables(result: LongResult) -> str:
    """The run's three tables, as text (95 % intervals, n rollouts)."""
    rows = [
        "per turn, by turn window (each rollout's mean over the window, then the mean over n rollouts, 95 % CI):",
        f"{'mode':<10} {'compaction':>10} {'turns':>9} {'n':>3} {'E2E s/turn':>24} "
        f"{'prompt tokens/turn':>30} {'compactions':>20}",
    ]
    by_mode = sorted(result.windows, key=lambda tw: (_order(result, tw[1].mode), tw[0], tw[1].first_turn))
    for threshold, w in by_mode:
        rows.append(
            f"{w.mode:<10} {threshold or 'no':>10} {f'{w.first_turn}–{w.last_turn}':>9} {w.n:>3} "
            f"{_ci(w.e2e_s, w.e2e_ci_low, w.e2e_ci_high, '.3f'):>24} "
            f"{_ci(w.prompt_tokens, w.prompt_ci_low, w.prompt_ci_high, ',.0f'):>30} "
            f"{_ci(w.compactions, w.compactions_ci_low, w.compactions_ci_high, '.1f'):>20}"
        )
    rows += [
        "",
        f"with compaction (compact_threshold {result.config.compact_threshold}) less without, "
        "per-turn E2E s, paired by rollout:",
        f"{'mode':<10} {'turns':>9} {'n':>3} {'difference s (95 % CI)':>28}",
    ]
    for d in result.differences:
        diff = _ci(d.difference_s, d.difference_ci_low, d.difference_ci_high, "+.3f")
        rows.append(f"{d.mode:<10} {f'{d.first_turn}–{d.last_turn}':>9} {d.n:>3} {diff:>28}")
    rows += [
        "",
        "compaction, per rollout (95 % CI):",
        f"{'mode':<10} {'n':>3} {'compactions':>20} {'first at turn':>22} {'s per compaction':>24} "
        f"{'prompt on compacting turn':>30}",
    ]
    for c in result.compaction:
        rows.append(
            f"{c.mode:<10} {c.n:>3} {_ci(c.compactions, c.compactions_ci_low, c.compactions_ci_high, '.1f'):>20} "
            f"{_ci(c.first_turn, c.first_turn_ci_low, c.first_turn_ci_high, '.1f'):>22} "
            f"{_ci(c.seconds_per_compaction, c.seconds_ci_low, c.seconds_ci_high, '.2f'):>24} "
            f"{_ci(c.prompt_after_tokens, c.prompt_after_ci_low, c.prompt_after_ci_high, ',.0f'):>30}"
        )
    rows += [
        "",
        "caches, without → with compaction (the mode's rollouts together; held KV per rollout):",
        f"{'mode':<10} {'connection-cache hits':>22} {'prompt tokens cached':>22} {'held-KV idle token·s':>26}",
    ]
    with_ = {s.mode: s for s in result.with_compaction.summary}
    for a in result.without.summary:
        b = with_[a.mode]
        idle = f"{a.kv_idle_token_s / a.rollouts:,.0f} → {b.kv_idle_token_s / b.rollouts:,.0f}"
        rows.append(
            f"{a.mode:<10} {f'{_pct(a.connection_cache_hit_rate)} → {_pct(b.connection_cache_hit_rate)}':>22} "
            f"{f'{_pct(a.token_hit_rate)} → {_pct(b.token_hit_rate)}':>22} {idle:>26}"
        )
    return "\n".join(rows)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


def _order(result: LongResult, mode: str) -> int:
    modes = list(result.config.modes)
    return modes.index(mode) if mode in modes else len(modes)


def write_long(result: LongResult, directory: str | Path) -> Path:
    """DIR/without and DIR/with (run folders, sim/harness/trace.py), windows.csv (one row per setting,
    mode and window), differences.csv and compaction.json (sim/harness/trace.py writes them)."""
    path = Path(directory)
    write_run(result.without, path / "without")
    write_run(result.with_compaction, path / "with")
    rows: list[dict[str, Any]] = [
        {"compact_threshold": threshold, **msgspec.to_builtins(w)} for threshold, w in result.windows
    ]
    write_table(rows, path / "windows.csv")
    write_table([msgspec.to_builtins(d) for d in result.differences], path / "differences.csv")
    write_json({c.mode: c for c in result.compaction}, path / "compaction.json")
    return path
