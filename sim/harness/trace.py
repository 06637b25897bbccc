"""The only module of `sim/` that writes files: a run folder for one comparison.

    DIR/
      config.json     the CompareConfig (with its seed), whether it ran in virtual time, the git SHA,
                      and with ci_width why no more batches ran (`stopped`)
      summary.json    mode name → metrics (sim.analysis.metrics.ModeSummary): each interval as
                      <metric>_ci_low / <metric>_ci_high beside it, `n` the rollouts they rest on
      pairs.json      every pair of modes, paired by rollout (sim.analysis.metrics.PairSummary): time saved
                      and difference in seconds, with intervals and n
      turns.csv       one tidy row per turn (and turns.parquet, the same table); `n`, `e2e_ci_low`,
                      `e2e_ci_high`: the mean E2E of that mode's turn k over the n rollouts that
                      reached it, with its interval; `prompt_tokens` the prompt the model read,
                      `compacted` whether the turn's context was compacted; the token columns the
                      turn's own in every mode (`turn_rows`)
      table.txt       the comparison's table with every column (`python -m sim compare` writes it)
      events.jsonl    one row per server event the client received: mode, rollout, turn, t, type
      records.jsonl   one per-turn record per turn (sim.analysis.records.TurnRecord, docs/calibration.md):
                      the input of `python -m sim calibrate`
      *.png           rollout time per mode (median; its interval as error bars where both bounds
                      are known); where a turn's server time goes, per mode; titled from the run
                      (`plot_title`)

`write_run(..., tables=False)` writes only the three JSON files (a run folder small enough to
commit, as docs/results/ does).

Notebooks and scripts load these; nothing here computes a metric (sim/analysis/metrics.py does).
"""

from __future__ import annotations

import collections
import csv
import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from sim.analysis.metrics import ModeSummary, compacted, per_turn_work, turn_intervals
from sim.analysis.records import records_from_rollouts
from sim.analysis.stats import Estimate
from sim.engine.model import EngineTurn
from sim.harness.capacity import CapacityConfig, Variant, variants
from sim.harness.experiment import CompareConfig, CompareResult, config_of

__all__ = [
    "p50_error_bars",
    "plot_title",
    "read_config",
    "read_engine_turns",
    "turn_rows",
    "write_figure",
    "write_json",
    "write_run",
    "write_table",
    "write_text",
]


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def turn_rows(result: CompareResult) -> list[dict[str, Any]]:
    """The tidy per-turn table: one row per (mode, rollout, turn)."""
    rows = []
    intervals = turn_intervals(result.rollouts, seed=result.config.seed)
    for r in result.rollouts:
        turns_of = collections.Counter(t.response.id for t in r.turns)
        for k, (t, work) in enumerate(zip(r.turns, per_turn_work(r), strict=True)):
            e2e: Estimate = intervals[(r.mode, k)]
            prompt = r.prompt_tokens[k] if k < len(r.prompt_tokens) else None
            usage = t.response.usage
            tokens: tuple[int | None, int | None, int | None]
            if usage is not None and turns_of[t.response.id] == 1:  # the response is this turn's: its usage
                tokens = (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens)
            elif len(r.model_tokens) == len(r.turns):
                # A response that spans turns (append, inject, async, agents) reports no usage while
                # paused and its whole total at the end; the beta's pauses carry no report either. The
                # turn's own: the model's count of the turn it sampled (sim.harness.experiment's log).
                tokens = (prompt, *r.model_tokens[k])
            else:  # a steer's cut turn was sampled twice: the server's report differenced per turn
                prefilled, decoded = work.get("tokens_prefilled"), work.get("tokens_decoded")
                cached = None if prompt is None or prefilled is None else prompt - round(prefilled)
                tokens = (prompt, cached, None if decoded is None else round(decoded))
            row: dict[str, Any] = {
                "mode": r.mode,
                "rollout": r.index,
                "turn": k,
                "n": e2e.n,
                "e2e_ci_low": e2e.ci_low,
                "e2e_ci_high": e2e.ci_high,
                "response_id": t.response.id,
                "sent_at_s": t.sent_at - r.started_at,
                "ttft_s": t.ttft_s,
                "e2e_s": t.e2e_s,
                "bytes_sent": t.bytes_sent,
                "events": t.events,
                "input_tokens": tokens[0],
                "cached_tokens": tokens[1],
                "output_tokens": tokens[2],
                "tokens_rendered": work.get("tokens_rendered"),
                "prompt_tokens": prompt,
                "compacted": compacted(t),
            }
            for key, value in work.items():
                if key.startswith("stage:"):
                    row[f"{key[6:]}_s"] = value
            rows.append(row)
    return rows


def write_text(text: str, target: str | Path) -> Path:
    """`text` as a UTF-8 file ending in a newline (a run folder's table.txt)."""
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def write_json(value: Any, target: str | Path) -> Path:
    """`value` (builtins or msgspec Structs) as indented JSON; NaN stays NaN (a missing bound)."""
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(msgspec.to_builtins(value), indent=2, allow_nan=True) + "\n")
    return path


def write_run(result: CompareResult, directory: str | Path, *, tables: bool = True) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"config": result.config, "virtual": result.virtual, "git_sha": _git_sha()}
    if result.stopped:
        meta["stopped"] = result.stopped
    if result.failed:  # rollouts that ended in an error: in no metric below
        meta["failed"] = [{"mode": f.mode, "rollout": f.index, "error": f.error} for f in result.failed]
    write_json(meta, path / "config.json")
    write_json({s.mode: s for s in result.summary}, path / "summary.json")
    write_json(result.pairs, path / "pairs.json")
    if not tables:
        return path
    rows = turn_rows(result)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with (path / "turns.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    _write_parquet(rows, columns, path / "turns.parquet")
    with (path / "events.jsonl").open("w") as f:
        for r in result.rollouts:
            for k, t in enumerate(r.turns):
                for at, kind in t.event_log:
                    f.write(
                        json.dumps(
                            {"mode": r.mode, "rollout": r.index, "turn": k, "t": at - r.started_at, "type": kind}
                        )
                    )
                    f.write("\n")
    source = "longrun-virtual" if result.virtual else "longrun-live"
    with (path / "records.jsonl").open("wb") as fb:
        for record in records_from_rollouts(result.rollouts, source=source):
            fb.write(msgspec.json.encode(record))
            fb.write(b"\n")
    if result.engine_turns:  # the real engine's own counters per turn (docs/engine.md)
        with (path / "engine.jsonl").open("wb") as fb:
            for turn in result.engine_turns:
                fb.write(msgspec.json.encode(turn))
                fb.write(b"\n")
    if result.drift is not None:  # the engine's speed per mode and over the run (docs/engine.md#drift)
        write_json(result.drift, path / "drift.json")
    _plots(result, rows, path)
    return path


def read_config(folder: Path) -> CompareConfig:
    """The config a run folder was measured with (its config.json, `write_run`)."""
    return config_of(msgspec.json.decode((folder / "config.json").read_bytes())["config"])


def read_engine_turns(folder: Path) -> list[EngineTurn]:
    """A run folder's engine.jsonl (`write_run`): the real engine's own counters per turn."""
    return [msgspec.json.decode(line, type=EngineTurn) for line in (folder / "engine.jsonl").read_bytes().splitlines()]


def write_figure(draw: Callable[[Any], None], target: str | Path, *, size: tuple[float, float] = (7, 4)) -> Path:
    """One figure, drawn by `draw` on its axis, as a PNG (a job's own figure: `sim curve`'s curve.png)."""
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after choosing the backend

    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_table(rows: list[dict[str, Any]], target: str | Path) -> Path:
    """A tidy table as CSV, or Parquet when the name ends in `.parquet`."""
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if path.suffix == ".parquet":
        _write_parquet(rows, columns, path)
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    return path


def _write_parquet(rows: list[dict[str, Any]], columns: list[str], target: Path) -> None:
    table = pa.table({c: [row.get(c) for row in rows] for c in columns})
    pq.write_table(table, target)


def plot_title(result: CompareResult, rows: list[dict[str, Any]]) -> str:
    """What the run was, from its own config and rows: the rollouts' shape, the decode rate (a real
    engine's as measured over the run's turns, tokens decoded / decode seconds; the simulator's as
    configured), the cost profile and the seed."""
    config = result.config
    if config.trace is not None:
        shape = "replayed trace"
    elif config.workload != "custom":
        shape = f"workload {config.workload}"
    else:
        shape = f"{config.tool_calls} tool calls"
    if config.engine.engine_kind != "none":
        decoded = [(row["output_tokens"], row.get("decode_s")) for row in rows]
        tokens = sum(t for t, s in decoded if t is not None and s)
        seconds = sum(s for t, s in decoded if t is not None and s)
        rate = f"{tokens / seconds:.0f} tok/s measured" if seconds > 0 else "decode rate unmeasured"
        speed = f"{config.engine.engine_kind} engine, {rate}"
    else:
        speed = f"{config.model.tps:g} tok/s" if config.model.tps > 0 else "unpaced decode"
    return f"{shape}, {speed}, {config.server.profile_name} profile, seed {config.seed}"


def p50_error_bars(summary: list[ModeSummary]) -> tuple[list[list[float]] | None, str]:
    """rollout_time.png's error bars (below, above the median) and what they are: a mode's
    interval only where the table has both its bounds (too few rollouts: `?`, no bar); None
    when no mode has one."""
    known = [not (math.isnan(s.completion_p50_ci_low) or math.isnan(s.completion_p50_ci_high)) for s in summary]
    n = min((s.n for s in summary), default=0)
    if not any(known):
        return None, f"no interval: too few rollouts, n={n}"
    below = [s.completion_p50_s - s.completion_p50_ci_low if k else 0.0 for s, k in zip(summary, known, strict=True)]
    above = [s.completion_p50_ci_high - s.completion_p50_s if k else 0.0 for s, k in zip(summary, known, strict=True)]
    return [below, above], f"{'95 % interval' if all(known) else '95 % interval where known'}, n={n}"


def _plots(result: CompareResult, rows: list[dict[str, Any]], path: Path) -> None:
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after choosing the backend

    modes = [s.mode for s in result.summary]
    title = plot_title(result, rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    p50 = [s.completion_p50_s for s in result.summary]
    bars, shown = p50_error_bars(result.summary)
    if bars is not None:
        ax.bar(modes, p50, yerr=bars, capsize=4, color="#4c72b0")
    else:
        ax.bar(modes, p50, color="#4c72b0")
    ax.set_ylabel(f"rollout completion, median (s)\n{shown}")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path / "rollout_time.png", dpi=120)
    plt.close(fig)

    stages = [c[:-2] for c in dict.fromkeys(k for row in rows for k in row) if c_is_stage(c)]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bottoms = [0.0] * len(modes)
    for i, stage in enumerate(stages):
        values = []
        for mode in modes:
            mode_rows = [row for row in rows if row["mode"] == mode]
            values.append(sum(row.get(f"{stage}_s") or 0.0 for row in mode_rows) / max(1, len(mode_rows)) * 1000)
        ax.bar(modes, values, bottom=bottoms, label=stage, color=plt.get_cmap("tab20")(i))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("server time per turn, mean (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path / "stages.png", dpi=120)
    plt.close(fig)


def c_is_stage(column: str) -> bool:
    return column.endswith("_s") and column not in {"sent_at_s", "ttft_s", "e2e_s"}


def write_capacity(
    directory: str | Path, config: CapacityConfig, rows: list[dict[str, Any]], points: list[dict[str, Any]]
) -> Path:
    """A capacity run folder: config.json, runs.csv (per seed), points.csv (with intervals),
    frontier.png (goodput) and, when both ran, crossover.png (append's session time saved against ws)."""
    out = Path(directory)
    write_json(config, out / "config.json")
    write_table(rows, out / "runs.csv")
    write_table(points, out / "points.csv")
    _capacity_grid(out / "frontier.png", config, points, "goodput", f"goodput (p90 TTFT ≤ {config.ttft_slo_s:g} s)")
    if "ws" in config.modes and "append" in config.modes:  # the crossover is append's against ws
        _capacity_grid(out / "crossover.png", config, points, "saved_vs_ws", "session time saved vs ws (%)")
    return out


def _capacity_grid(path: Path, config: CapacityConfig, points: list[dict[str, Any]], what: str, ylabel: str) -> None:
    """One panel per (tool tail, KV budget): `what` against the load per variant, with bands."""
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after choosing the backend

    key = "users" if config.closed else "offered_load"
    crossover = what == "saved_vs_ws"
    column = "saved_vs_ws_pct" if crossover else "goodput"
    low = ("saved_vs_ws" if crossover else "goodput") + "_ci_low"
    high = low.replace("_low", "_high")
    tails, budgets = config.tool_tails, config.kv_budgets
    fig, axes = plt.subplots(
        len(tails), len(budgets), figsize=(4.2 * len(budgets), 3.4 * len(tails)), squeeze=False, sharex=True
    )
    shown = [v for v in variants(config) if not crossover or v.mode == "append"]
    for i, tail in enumerate(tails):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            cell = [p for p in points if p["tool_tail"] == tail and p["kv_budget_tokens"] == budget]
            for v in shown:
                line = sorted((p for p in cell if Variant.of(p) == v), key=lambda p: p[key])
                x = [p[key] for p in line]
                ax.plot(x, [p[column] for p in line], marker="o", markersize=3, label=v.label)
                if line and all(p["n"] > 1 for p in line):
                    ax.fill_between(x, [p[low] for p in line], [p[high] for p in line], alpha=0.2)
            if crossover:
                ax.axhline(0.0, color="grey", linewidth=0.8)
                ax.set_yscale("symlog", linthresh=1.0)
            elif not config.closed:
                ax.plot(list(config.loads), list(config.loads), color="grey", linestyle=":", label="offered")
            if not config.closed:
                ax.set_xscale("log", base=2)
            kv = f"{budget / 1e3:g}k KV" if budget else "unlimited KV"
            ax.set_title(f"tail ×{tail:g}, {kv}", fontsize=9)
            if i == len(tails) - 1:
                ax.set_xlabel("users" if config.closed else "offered load (sessions/s)")
            if j == 0:
                ax.set_ylabel(ylabel, fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
