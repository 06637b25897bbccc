"""What a job shows and where it keeps it: the comparison's tables (one that fits a terminal, one
with every column for the run folder), progress on stderr (a bar on a terminal, a line at each
tenth in a log or a pipe), the server's log as one line a record (`one_line_logs`) and the
default run folder's name (`runs/JOB-YYYYMMDD-HHMM`, UTC).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from tqdm import tqdm

from sim.analysis.metrics import ModeSummary, PairSummary
from sim.analysis.stats import Estimate
from sim.rollout.result import RolloutFailure, failure_lines

__all__ = [
    "RUNS_ENV",
    "TERMINAL_COLUMNS",
    "ProgressLines",
    "add_save_options",
    "agreement_text",
    "interjection_table",
    "one_line_logs",
    "pairs_table",
    "points_bar",
    "progress_bar",
    "run_folder",
    "saved_text",
    "start_folder",
    "table",
    "terminal_table",
]


class _OneLine(logging.Formatter):
    """A record as one line: the logger, the message and the exception's own line, no traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line += f": {type(error).__name__}: {error}"
        return " ".join(line.split())


class _Stderr(logging.Handler):
    """Writes to whatever `sys.stderr` is when a record comes (a test's capture, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def one_line_logs() -> None:
    """The server's log (`longrun.*`) in a job's stderr one line a record: a rollout that a
    failed response ended is a failed row of the job's table, and its log line says why without
    the traceback Python's last-resort handler would print. Idempotent."""
    logger = logging.getLogger("longrun")
    if not any(isinstance(h.formatter, _OneLine) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_OneLine())
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)


# Where a job's default run folder goes: `runs/` where the command runs (in .gitignore), or this
# variable's directory (the tests point it at a temporary one).
RUNS_ENV: Final = "LONGRUN_RUNS"


def add_save_options(p: argparse.ArgumentParser, what: str, job: str) -> None:
    """A job's `--out DIR` and `--no-save` (`run_folder` reads them); `what`: what its folder holds."""
    p.add_argument(
        "--out",
        metavar="DIR",
        default=argparse.SUPPRESS,  # the help says what the default is: no "(default: None)"
        help=f"the run folder ({what}) (default: a new one, runs/{job}-YYYYMMDD-HHMM, UTC)",
    )
    p.add_argument("--no-save", action="store_true", help="write no run folder")


def start_folder(args: argparse.Namespace, job: str) -> Path | None:
    """`run_folder`, named on stderr before the job runs (a run cut short still says where it was to be)."""
    folder = run_folder(args, job)
    if folder is not None:
        print(f"run folder: {folder}", file=sys.stderr, flush=True)
    return folder


def run_folder(args: argparse.Namespace, job: str) -> Path | None:
    """The run folder the job writes: `--out`, else a new `runs/JOB-YYYYMMDD-HHMM` (UTC; `-2`, `-3`,
    … after it when that minute has one already), created now so that a second run does not take
    it; None with `--no-save`."""
    out = getattr(args, "out", None)
    if args.no_save:
        if out:
            raise SystemExit("invalid option: --no-save: not with --out")
        return None
    if out:
        return Path(out)
    base = Path(os.environ.get(RUNS_ENV) or "runs")
    stamp = f"{job}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M}"
    for n in itertools.count(1):
        path = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise SystemExit(f"cannot write the run folder {path}: {exc.strerror or exc}") from None
        return path
    raise AssertionError("unreachable")


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def _bounds(e: Estimate, digits: int = 2) -> str:
    """`(low–high)`; a missing bound (too few rollouts for it at 95 %) is `?`."""

    def one(x: float) -> str:
        return "?" if math.isnan(x) else f"{x:.{digits}f}"

    return f"({one(e.ci_low)}–{one(e.ci_high)})"


def saved_text(e: Estimate) -> str:
    """`30.9 % ± 1.2`: the saving and its interval's half-width, in points; `?` without one."""
    if math.isnan(e.value):
        return "-"
    spread = "?" if math.isnan(e.half_width) else f"{100 * e.half_width:.1f}"
    return f"{100 * e.value:.1f} % ± {spread}"


# The terminal's table fits this many columns; the run folder's table.txt has every column.
TERMINAL_COLUMNS: Final = 100


def terminal_table(summary: list[ModeSummary], failed: Sequence[RolloutFailure] = ()) -> str:
    """The table for a terminal, within `TERMINAL_COLUMNS` for the usual magnitudes: per mode n,
    p50 with its interval, p90, TTFT, overhead share, KV idle and time saved with its ± (95 %).
    Failed rollouts follow, a row per mode and error."""
    head = (
        f"{'mode':<10} {'n':>3} {'rollout p50 s (95 % CI)':>23} {'p90 s':>7} {'TTFT ms':>7} {'overhead':>8} "
        f"{'KV idle tok·s':>13} {'saved vs http':>16}"
    )
    rows = [head]
    for s in summary:
        p50, p90 = s.estimate("completion_p50"), s.estimate("completion_p90")
        saved = "-" if s.mode == "http" else saved_text(s.estimate("saved_vs_http"))
        rows.append(
            f"{s.mode:<10} {s.n:>3} {f'{p50.value:.3f} {_bounds(p50)}':>23} {p90.value:>7.3f} {_ms(s.ttft_p50_s):>7} "
            f"{_pct(s.overhead_share):>8} {s.kv_idle_token_s:>13.0f} {saved:>16}"
        )
    return "\n".join(rows + failure_lines(failed))


def table(summary: list[ModeSummary], failed: Sequence[RolloutFailure] = ()) -> str:
    """Every column, for the run folder's table.txt: one row per mode; p50/p90 with their
    intervals, time saved with its ± (95 %). Failed rollouts (not in the metrics) follow, a row
    per mode and error."""
    head = (
        f"{'mode':<10} {'n':>3} {'rollout p50 s (95 % CI)':>26} {'p90 s (95 % CI)':>24} {'TTFT ms':>8} "
        f"{'tool→token ms':>14} {'overhead':>9} {'bytes/turn':>11} {'rendered/turn':>14} {'conn hit':>9} "
        f"{'tok hit':>8} {'KV idle tok·s':>14} {'time saved vs http':>19}"
    )
    rows = [head]
    for s in summary:
        p50, p90 = s.estimate("completion_p50"), s.estimate("completion_p90")
        saved = "-" if s.mode == "http" else saved_text(s.estimate("saved_vs_http"))
        rows.append(
            f"{s.mode:<10} {s.n:>3} {f'{p50.value:.3f} {_bounds(p50)}':>26} {f'{p90.value:.3f} {_bounds(p90)}':>24} "
            f"{_ms(s.ttft_p50_s):>8} {_ms(s.tool_to_token_p50_s):>14} {_pct(s.overhead_share):>9} "
            f"{s.bytes_per_turn:>11.0f} {s.tokens_rendered_per_turn:>14.0f} {_pct(s.connection_cache_hit_rate):>9} "
            f"{_pct(s.token_hit_rate):>8} {s.kv_idle_token_s:>14.0f} {saved:>19}"
        )
    return "\n".join(rows + failure_lines(failed))


def pairs_table(pairs: list[PairSummary]) -> str:
    """Every mode against every other, paired by rollout (95 % intervals)."""
    rows = [f"{'other vs base':<22} {'n':>3} {'time saved':>16} {'difference s (95 % CI)':>28}"]
    for p in pairs:
        saved = saved_text(Estimate(p.saved, p.saved_ci_low, p.saved_ci_high, p.n))
        diff = Estimate(p.difference_s, p.difference_ci_low, p.difference_ci_high, p.n)
        rows.append(
            f"{f'{p.other} vs {p.base}':<22} {p.n:>3} {saved:>16} {f'{diff.value:+.3f} {_bounds(diff, 3)}':>28}"
        )
    return "\n".join(rows)


def interjection_table(summary: list[ModeSummary], pairs: list[PairSummary]) -> str:
    """Interjections (docs/experiments.md#interjections): per mode the mean latency from the user's
    message to the first token that has it in context, with its interval, discarded tokens and
    successors per rollout; then the paired latency differences."""
    rows = [
        f"{'mode':<10} {'n':>3} {'interjections':>13} {'latency ms (95 % CI)':>26} "
        f"{'discarded tok/rollout':>22} {'successors/rollout':>19}"
    ]
    for s in summary:
        if not s.interjections:
            continue
        e = Estimate(s.interjection_latency_s, s.interjection_latency_ci_low, s.interjection_latency_ci_high, s.n)
        bounds = _bounds(e.scaled(1000), 0)
        rows.append(
            f"{s.mode:<10} {s.n:>3} {s.interjections:>13} {f'{1000 * e.value:.0f} {bounds}':>26} "
            f"{s.tokens_discarded_per_rollout:>22.1f} {s.successors_per_rollout:>19.2f}"
        )
    rows.append(f"\n{'latency: other vs base':<22} {'n':>3} {'difference ms (95 % CI)':>28}")
    for p in pairs:
        if math.isnan(p.interjection_latency_difference_s):
            continue
        d = Estimate(
            p.interjection_latency_difference_s,
            p.interjection_latency_difference_ci_low,
            p.interjection_latency_difference_ci_high,
            p.n,
        ).scaled(1000)
        rows.append(f"{f'{p.other} vs {p.base}':<22} {p.n:>3} {f'{d.value:+.0f} {_bounds(d, 0)}':>28}")
    return "\n".join(rows)


def agreement_text(e: Estimate) -> str:
    if math.isnan(e.value):
        return "virtual vs live: no pairs"
    if math.isnan(e.half_width):
        return f"virtual vs live: live {100 * e.value:+.1f} % against virtual, over {e.n} (mode, rollout) pair"
    return (
        f"virtual vs live: live takes {100 * e.value:+.1f} % (95 % CI {100 * e.ci_low:+.1f} to "
        f"{100 * e.ci_high:+.1f} %) longer than virtual time\n  on the same rollout, over {e.n} (mode, rollout) pairs"
    )


def progress_bar(enabled: bool, *, total: int) -> Any:
    """The progress of the rollouts run, on stderr, when `enabled`: a widget in a notebook, a bar
    on a terminal, and where stderr is no terminal (a log, a pipe), which the bar's carriage
    returns would fill, a line at each tenth (`ProgressLines`). Its total grows by a batch's
    rollouts as each batch starts."""
    if enabled and not sys.stderr.isatty() and "ipykernel" not in sys.modules:
        return ProgressLines(total, unit="rollouts")
    # Imported here: in a notebook kernel without ipywidgets importing tqdm.auto warns, and the
    # notebooks import this module without asking for a bar.
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="rollout", file=sys.stderr, disable=None if enabled else True, leave=True)


class ProgressLines:
    """Progress for a log: a line on stderr each time the count passes another tenth of the total
    (`progress: 8/40 rollouts (20 %), n=20 per mode`), the part of tqdm's interface the jobs use."""

    def __init__(self, total: int, *, unit: str) -> None:
        self.total = total
        self.n = 0
        self.unit = unit
        self._postfix = ""
        self._tenths = 0

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text

    def update(self, count: int = 1) -> None:
        self.n += count
        tenths = 10 * self.n // self.total if self.total > 0 else 10
        if tenths <= self._tenths:
            return
        self._tenths = tenths
        postfix = f", {self._postfix}" if self._postfix else ""
        line = f"progress: {self.n}/{self.total} {self.unit} ({100 * self.n // max(self.total, 1)} %){postfix}"
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def points_bar(total: int, *, quiet: bool) -> Iterator[Callable[[int, int], None]]:
    """An `on_point(done, total)` callback that shows the grid points done on stderr: a bar on a
    terminal, a line at each tenth where stderr is no terminal (a log, a pipe, which the bar's
    carriage returns would fill), nothing with `quiet`."""
    if not quiet and not sys.stderr.isatty():
        lines = ProgressLines(total, unit="points")

        def on_line(done: int, total: int) -> None:
            lines.update(done - lines.n)

        yield on_line
        return
    with tqdm(total=total, unit="point", file=sys.stderr, disable=True if quiet else None) as bar:

        def on_point(done: int, total: int) -> None:
            bar.update(done - bar.n)

        yield on_point
