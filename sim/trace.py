"""The only module of `sim/` that writes files: a run folder for one comparison.

    DIR/
      config.json     the CompareConfig (with its seed), whether it ran in virtual time, the git SHA
      summary.json    mode name → metrics (sim.metrics.ModeSummary)
      turns.csv       one tidy row per turn (and turns.parquet, the same table)
      events.jsonl    one row per server event the client received: mode, rollout, turn, t, type
      *.png           rollout time per mode; where a turn's server time goes, per mode

Notebooks and scripts load these; nothing here computes a metric (sim/metrics.py does).
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import matplotlib
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from .experiment import CompareResult
from .metrics import per_turn_work

__all__ = ["turn_rows", "write_run", "write_table"]


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
    for r in result.rollouts:
        for k, (t, work) in enumerate(zip(r.turns, per_turn_work(r), strict=True)):
            usage = t.response.usage
            row: dict[str, Any] = {
                "mode": r.mode,
                "rollout": r.index,
                "turn": k,
                "response_id": t.response.id,
                "sent_at_s": t.sent_at - r.started_at,
                "ttft_s": t.ttft_s,
                "e2e_s": t.e2e_s,
                "bytes_sent": t.bytes_sent,
                "events": t.events,
                "input_tokens": usage.input_tokens if usage else None,
                "cached_tokens": usage.input_tokens_details.cached_tokens if usage else None,
                "output_tokens": usage.output_tokens if usage else None,
                "tokens_rendered": work.get("tokens_rendered"),
            }
            for key, value in work.items():
                if key.startswith("stage:"):
                    row[f"{key[6:]}_s"] = value
            rows.append(row)
    return rows


def write_run(result: CompareResult, directory: str | Path) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"config": msgspec.to_builtins(result.config), "virtual": result.virtual, "git_sha": _git_sha()}
    (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    summary = {s.mode: msgspec.to_builtins(s) for s in result.summary}
    (path / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
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
    _plots(result, rows, path)
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


def _plots(result: CompareResult, rows: list[dict[str, Any]], path: Path) -> None:
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # after choosing the backend

    modes = [s.mode for s in result.summary]
    config = result.config
    title = f"{config.tps:g} tok/s, {config.tool_calls} tool calls, {config.profile} profile, seed {config.seed}"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(modes, [s.completion_p50_s for s in result.summary], color="#4c72b0")
    ax.set_ylabel("rollout completion, median (s)")
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
