"""`python -m sim.bench TARGET --baseline REV`: a target run on this checkout and on a git revision,
interleaved in one run, each row's ratio new/old with its spread.

REV's tree is exported with `git archive` into a temporary directory (removed afterwards, also on an
error or an interrupt). Each round runs the target once per side, each side in its own interpreter
started in its own tree (its cwd and `PYTHONPATH`), so the old code is imported from the old tree;
the sides alternate which goes first from one round to the next, so a drift of the machine's load
falls on both. A side's rows are read from the lines it prints (the row format every revision of the
bench prints), and the k-th row of one side is paired with the k-th row of the other. The ratio of a
row is the median over the rounds of the ratio of the two runs of the same round; its spread, the
lowest and highest of those ratios. Beside it, where the row's goal says which way is better
(`<`: lower, `>`: higher), the ratio of each side's best round: on a machine whose speed moves,
interference only ever slows a run down, so a side's best round is the closest to its code's own
speed (as `timeit` reads its repeats), and the two bests are measured the same way on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from . import report as page
from .contract import ROOT, exported
from .report import Row

__all__ = ["Pair", "Refused", "against", "compare", "forwarded", "pairs", "parse_rows", "resolve", "targets_of"]

# A row as `Row.line` prints it: target, figure (padded), value, floor, ratio, goal, verdict.
_NUMBER: Final = r"[-+]?(?:\d[\d.]*(?:e[-+]?\d+)?|nan|inf)"
_LINE: Final = re.compile(
    rf"^(?P<target>\S+)\s+(?P<figure>\S.*?)\s+(?P<value>{_NUMBER})\s+(?P<floor>{_NUMBER})\s+(?P<ratio>{_NUMBER})"
    r"  (?P<goal>.*?)\s+(?P<verdict>PASS|FAIL|report)$"
)
STOP_TIMEOUT_S: Final = 30.0
"""How long a side gets to stop its own workers after SIGINT before its process group is killed."""


class Refused(Exception):
    """A `--baseline` run that cannot be made; its message is the one line the CLI prints."""


@dataclass(frozen=True, slots=True)
class Measured:
    """One row of one side's run: the figure's text, its value and its goal's text."""

    target: str
    figure: str
    value: float
    goal: str = ""


@dataclass(frozen=True, slots=True)
class Pair:
    """One row on both sides over every round: the values (new and old, in round order) and
    the figure's text on each side (the same unless the revision words it differently)."""

    target: str
    figure: str
    old_figure: str
    new: tuple[float, ...]
    old: tuple[float, ...]
    goal: str = ""  # the new side's goal: its first character says which way is better

    @property
    def ratios(self) -> list[float]:
        """new/old of each round (both runs of a round made back to back)."""
        return [n / o if o else float("nan") for n, o in zip(self.new, self.old, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def best_ratio(self) -> float | None:
        """new/old of each side's best round (lowest value when the goal is `<`, highest when `>`);
        None when the goal says no direction (a row that is only reported)."""
        best = min if self.goal.startswith("<") else max if self.goal.startswith(">") else None
        if best is None:
            return None
        old = best(self.old)
        return best(self.new) / old if old else float("nan")

    def row(self, revision: str) -> Row:
        """The pair as a bench row: the medians of each side, the ratio and its spread (in the goal's
        column, with the best rounds' ratio where the row has a direction); reported only, never a
        verdict."""
        spread = f"{min(self.ratios):.2f}-{max(self.ratios):.2f}"
        if self.best_ratio is not None:
            spread += f"; best/best {self.best_ratio:.2f}"
        new, old = statistics.median(self.new), statistics.median(self.old)
        return Row(self.target, f"{self.figure} (new/old vs {revision})", new, old, self.ratio, spread, None)


def parse_rows(text: str) -> list[Measured]:
    """The rows a bench run printed, in order (headers, notes and tracebacks are not rows)."""
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            rows.append(Measured(m["target"], m["figure"].rstrip(), float(m["value"]), m["goal"].strip()))
    return rows


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def resolve(revision: str) -> str:
    """The commit `revision` names (a sha), or `Refused`."""
    out = _git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if out.returncode != 0:
        raise Refused(f"--baseline: {revision!r} is not a revision of this repository")
    return out.stdout.strip()


def _side_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def targets_of(tree: Path) -> tuple[str, ...]:
    """The targets the bench in `tree` knows (its `TARGETS`), read by its own interpreter."""
    code = "from sim.bench.__main__ import TARGETS; print(*TARGETS)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=_side_env(tree), capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refused(f"--baseline: the revision's bench does not load its target list ({last})")
    return tuple(out.stdout.split())


DROPPED: Final = ("--baseline", "--baseline-rounds", "--report", "--only")
"""The options a side's run does not get: the comparison's own, and the targets (each side runs one)."""


def forwarded(argv: Sequence[str], switches: set[str]) -> list[str]:
    """The options of `argv` a side's run gets: all but the targets and `DROPPED` (each given as
    `--flag VALUE` or `--flag=VALUE`); `switches`, the options that take no value."""
    out: list[str] = []
    args = list(argv)
    k = 0
    while k < len(args):
        arg = args[k]
        name = arg.split("=", 1)[0]
        takes = "=" not in arg and name not in switches and arg.startswith("-")
        if arg.startswith("-") and name not in DROPPED:
            out.extend(args[k : k + 1 + takes])
        k += 1 + takes
    return out


@contextlib.contextmanager
def _process_group(command: list[str], tree: Path) -> Iterator[subprocess.Popen[str]]:
    """`command` in `tree`, in its own process group (its servers and workers with it); on the way
    out, still running (an error or an interrupt here), it gets SIGINT, then SIGKILL after
    `STOP_TIMEOUT_S`, the whole group."""
    proc = subprocess.Popen(
        command,
        cwd=tree,
        env=_side_env(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # whatever it left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


def run_side(tree: Path, target: str, options: Sequence[str], echo: Callable[[str], None]) -> list[Measured]:
    """One run of `target` by the bench in `tree`; its rows. A run that exits with an error, or
    prints no row, is `Refused` with its last line."""
    command = [sys.executable, "-m", "sim.bench", target, *options]
    lines: list[str] = []
    with _process_group(command, tree) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            echo(line.rstrip("\n"))
        code = proc.wait()
    rows = parse_rows("\n".join(lines))
    if not rows or code not in (0, 1):  # 1: a row failed its goal, which is still a measurement
        last = next((x for x in reversed(lines) if x.strip()), "no output")
        raise Refused(f"--baseline: {target} in {tree} exited {code} with {len(rows)} rows: {last.strip()}")
    return rows


def _prefixed(echo: Callable[[str], None], side: str) -> Callable[[str], None]:
    return lambda line: echo(f"{side} | {line}")


def pairs(target: str, new: list[list[Measured]], old: list[list[Measured]]) -> list[Pair]:
    """Each row of `target` paired over the rounds (`new[r]`, `old[r]`: round r's rows of a side).
    Sides or rounds that disagree on the number of rows cannot be paired: `Refused`."""
    counts = {len(rows) for rows in new + old}
    if len(counts) != 1:
        raise Refused(f"--baseline: {target}'s runs printed different numbers of rows ({sorted(counts)})")
    out = []
    for k in range(counts.pop()):
        out.append(
            Pair(
                target,
                new[0][k].figure,
                old[0][k].figure,
                tuple(rows[k].value for rows in new),
                tuple(rows[k].value for rows in old),
                new[0][k].goal,
            )
        )
    return out


def compare(
    revision: str,
    targets: Sequence[str],
    options: Sequence[str],
    rounds: int,
    echo: Callable[[str], None],
    report: Callable[[Pair], None],
) -> list[Pair]:
    """Every target of `targets` on this checkout and on `revision`, `rounds` times each, the sides
    alternating; each row reported (`report`) once its target's rounds are done."""
    sha = resolve(revision)
    with exported(sha) as old_tree:
        known = targets_of(old_tree)
        missing = [t for t in targets if t not in known]
        if missing:
            raise Refused(f"--baseline: {revision}'s bench has no target {missing[0]!r} (it has {', '.join(known)})")
        trees = {"new": ROOT, "old": old_tree}
        done: list[Pair] = []
        for target in targets:
            runs: dict[str, list[list[Measured]]] = {"new": [], "old": []}
            for r in range(rounds):
                for side in ("new", "old") if r % 2 == 0 else ("old", "new"):
                    code = "this checkout" if side == "new" else sha[:12]
                    echo(f"-- {target}, round {r + 1}/{rounds}, {side} ({code})")
                    runs[side].append(run_side(trees[side], target, options, _prefixed(echo, side)))
            for pair in pairs(target, runs["new"], runs["old"]):
                report(pair)
                done.append(pair)
        return done


def _line(pair: Pair) -> str:
    spread = f"{min(pair.ratios):.3f}-{max(pair.ratios):.3f}"
    new, old = statistics.median(pair.new), statistics.median(pair.old)
    best = "-" if pair.best_ratio is None else f"{pair.best_ratio:.3f}"
    return f"{pair.target:<10} {pair.figure:<46} {new:>12.4g} {old:>12.4g} {pair.ratio:>8.3f} {best:>9}  {spread}"


def against(
    args: argparse.Namespace,
    argv: Sequence[str],
    targets: Sequence[str],
    parser: argparse.ArgumentParser,
    contract: Callable[[], None],
) -> int:
    """`main` with `--baseline REV`: `targets` against REV, the table printed and, with
    `--report`, written. `contract` runs the contract target, which is itself a comparison with REV
    (in one process, its servers side by side). Exit status 2 and one line when the run is refused."""
    switches = {o for a in parser._actions if a.nargs == 0 for o in a.option_strings}
    started = datetime.datetime.now(datetime.UTC)
    about, revision = page.machine(), page.commit()
    rows: list[Row] = []
    header = f"{'target':<10} {'figure':<46} {'new':>12} {'old':>12} {'new/old':>8} {'best/best':>9}"
    print(f"{header}  spread (lowest-highest round)")
    try:
        if "contract" in targets:
            contract()
        found = compare(
            args.baseline,
            [t for t in targets if t != "contract"],
            forwarded(argv, switches),
            args.baseline_rounds,
            lambda line: print(f"    {line}", flush=True),
            lambda pair: print(_line(pair), flush=True),
        )
    except Refused as e:
        print(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the baseline's tree and every side's processes are gone", file=sys.stderr)
        return 130
    rows = [pair.row(args.baseline) for pair in found]
    print(f"{len(rows)} rows against {args.baseline}")
    if args.report is not None:
        command = " ".join(["python -m sim.bench", *argv])
        page.write(args.report, page.block(rows, [], command, started, about, revision))
        print(f"wrote {args.report}")
    return 0
