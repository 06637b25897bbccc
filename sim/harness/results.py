"""The README's results table, rendered from a committed run folder (docs/results/<name>/).

`python -m sim results --out docs/results/headline` runs the default comparison (virtual
time for the precision, a short live run beside it) and writes only its JSON files there
(`sim.harness.trace.write_run(tables=False)`); `render_results` turns that folder into the Markdown
between the README's `<!-- results:start -->` and `<!-- results:end -->` markers, and
`tests/sim/harness/test_results.py` checks that the README shows exactly this rendering. Reads only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Final

from sim.harness.experiment import config_of

__all__ = ["MARKERS", "readme_block", "render_results"]

MARKERS: Final = ("<!-- results:start -->", "<!-- results:end -->")


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _num(x: float, digits: int = 2) -> str:
    return "?" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _ci(row: dict[str, Any], name: str, digits: int = 2) -> str:
    low, high = _num(row[name + "_ci_low"], digits), _num(row[name + "_ci_high"], digits)
    return f"{_num(row[name + '_s'], digits)} ({low}–{high})"


def _saved(row: dict[str, Any]) -> str:
    if row["mode"] == "http" or row["saved_vs_http_n"] == 0:
        return "–"
    value, low, high = row["saved_vs_http"], row["saved_vs_http_ci_low"], row["saved_vs_http_ci_high"]
    if math.isnan(low) or math.isnan(high):
        return f"{100 * value:.1f} % (n={row['saved_vs_http_n']}: no interval)"
    return f"{100 * value:.1f} % ± {100 * (high - low) / 2:.1f} ({100 * low:.1f}–{100 * high:.1f})"


def _mode_table(summary: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| mode | n | rollout p50 s (95 % CI) | rollout p90 s (95 % CI) | time saved vs `http` (95 % CI) |",
        "|---|---|---|---|---|",
    ]
    for row in summary.values():
        lines.append(
            f"| `{row['mode']}` | {row['n']} | {_ci(row, 'completion_p50')} | {_ci(row, 'completion_p90')} "
            f"| {_saved(row)} |"
        )
    return lines


def _describe(meta: dict[str, Any]) -> str:
    c = config_of(meta["config"])
    where = "virtual time" if meta["virtual"] else "live on loopback"
    return (
        f"{where}, {c.server.profile_name} cost profile, {c.model.tps:g} tokens/s, {c.tool_calls} tool calls per "
        f"rollout, tool time median {c.tool_time_s:g} s, seed {c.seed}"
    )


def render_results(folder: str | Path) -> str:
    """The Markdown results block of a run folder written by `python -m sim results`."""
    path = Path(folder)
    meta = _load(path / "config.json")
    lines = [f"Headline comparison ({_describe(meta)}; `python -m sim results`, folder `{path.as_posix()}`):", ""]
    lines += _mode_table(_load(path / "summary.json"))
    lines += [
        "",
        "Time saved is the mean over rollouts of 1 − t(mode)/t(`http`) for the same seeded rollout; "
        "± is half the 95 % paired-bootstrap interval, p50/p90 intervals are order-statistic "
        "intervals, `?` a bound that needs more rollouts (docs/statistics.md).",
    ]
    live = path / "live"
    if (live / "summary.json").exists():
        lines += ["", f"Beside it, {_describe(_load(live / 'config.json'))}:", ""]
        lines += _mode_table(_load(live / "summary.json"))
    if (path / "agreement.json").exists():
        e = _load(path / "agreement.json")["live_vs_virtual"]
        lines += [
            "",
            f"Live against virtual, paired by (mode, rollout): {100 * e['value']:+.1f} % "
            f"(95 % CI {_num(100 * e['ci_low'], 1)} to {_num(100 * e['ci_high'], 1)} %, n={e['n']} pairs).",
        ]
    return "\n".join(lines) + "\n"


def readme_block(readme_text: str) -> str:
    """The text between the README's results markers (without the marker lines)."""
    start, end = MARKERS
    head, found, rest = readme_text.partition(start + "\n")
    block, found_end, _ = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"the README needs the lines {start} and {end}")
    return block
