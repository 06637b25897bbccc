"""Hour-scale rollouts across the WebSocket connection limit (`python -m sim long --cap`).

Covers: one `CompareConfig` run twice in virtual time on the same seeded rollouts, once with every
create `store: false` and once `store: true`, each WebSocket rollout on its own socket kept by
`sim.client.reconnect.RotatingClient` (rotate `rotate_margin_s` before the server's
`lifetime_s`, reconnect at it, restart a paused response the limit cut). Scenario: a rollout of
many tool calls whose tool times have a heavy tail, so that a share of rollouts outlives a
connection. A design is a (mode, store) pair; `http_prev` needs the store and runs only with it.

Figures per design (95 % intervals, n rollouts):

* **crossed**: the share of rollouts that reached the limit: finished later than `lifetime_s`
  after they started, or ended in the limit's error or a lost continuation (Wilson interval);
* **lost**: the share that ended in an error (`store: false`: `previous_response_not_found` on
  the new socket), and the errors, one line each;
* **reconnects per rollout** over the rollouts that finished (studentized bootstrap), and the
  moves by reason (rotate, limit, closed, cut, restart);
* **what a reconnect cost**: per move to a new socket, the first turn on it as the server's stage
  report shows it (sim/rollout/result.py `Reconnect`): its E2E, `load_state` (the store load of
  a cold connection cache), `render`, tokens rendered and prefilled; beside it the same means
  over the design's other turns that carry a stage report, continuing on a warm socket (`ws` and
  `http_prev` only: an append or inject response's report sums its segments). A turn that
  reports no stages (the beta's, which pause without an event) is not in these means, and a
  `restart` (a new response on the same socket after a pause timeout) is counted, not costed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
from msgspec import structs

from prototype.wire.schemas import StageReport
from sim.analysis.stats import Estimate, paired_mean
from sim.client.reconnect import RECONNECTING_MODES
from sim.harness.console import start_folder
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.harness.trace import write_json, write_run, write_table
from sim.rollout.result import RolloutResult

__all__ = ["CAP_MODES", "CapDesign", "CapResult", "cap_main", "cap_tables", "run_cap", "write_cap"]

CAP_MODES: Final = ("http_prev", *RECONNECTING_MODES)  # http_prev: the reference that holds no socket
# An append or inject response reports its segments summed, not turn by turn: no warm row.
_SUMMED: Final = ("append", "inject")
_RESPONSE_ID: Final = re.compile(r"'resp_[0-9a-f]+'")
_LIMIT_ERRORS: Final = ("previous_response_not_found", "websocket_connection_limit_reached", "connection_limit")


class Cost(msgspec.Struct, frozen=True):
    """Means over turns (a reconnect's first turn, or the warm turns), each with its interval."""

    n: int
    e2e_s: Estimate
    load_s: Estimate
    render_s: Estimate
    tokens_rendered: Estimate
    tokens_prefilled: Estimate


class CapDesign(msgspec.Struct, frozen=True):
    mode: str
    store: bool
    rollouts: int  # run (finished + failed)
    crossed: Estimate  # share of rollouts that reached the limit
    lost: Estimate  # share that ended in an error
    reconnects: Estimate  # per finished rollout
    reasons: dict[str, int]  # moves by reason, over the design's rollouts
    reconnect_cost: Cost
    warm_cost: Cost
    completion_s: Estimate  # rollout time of the finished ones
    errors: list[str]  # one line per distinct error, with its count


@dataclass(frozen=True, slots=True)
class CapResult:
    config: CompareConfig
    runs: dict[bool, CompareResult]  # by store
    designs: list[CapDesign]


def wilson(k: int, n: int, z: float = 1.959964) -> Estimate:
    """The share k/n with its Wilson score interval (NaN for n = 0)."""
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half), n)


def run_cap(config: CompareConfig, *, progress: bool = False) -> CapResult:
    """`config` with `store: false` (without `http_prev`) and with `store: true`, in virtual time, CPU free."""
    bad = [m for m in config.modes if m not in CAP_MODES]
    if bad:
        raise ValueError(f"--cap models {', '.join(CAP_MODES)}; not {', '.join(bad)}")
    runs: dict[bool, CompareResult] = {}
    for store in (False, True):
        modes = tuple(m for m in config.modes if store or m != "http_prev")
        if modes:
            run = config.updated(store_responses=store, modes=modes)
            runs[store] = compare(run, virtual=True, free_cpu=True, progress=progress)
    designs = [_design(config, r, store, mode) for store, r in runs.items() for mode in r.config.modes]
    return CapResult(config, runs, designs)


def _design(config: CompareConfig, run: CompareResult, store: bool, mode: str) -> CapDesign:
    lifetime = config.server.websocket.lifetime_s
    done = [r for r in run.rollouts if r.mode == mode]
    failed = [f for f in run.failed if f.mode == mode]
    n = len(done) + len(failed)
    crossed = sum(r.completion_s > lifetime for r in done) + sum(
        any(c in f.error for c in _LIMIT_ERRORS) for f in failed
    )
    moves = [m for r in done for m in r.reconnects]
    costed = [m for m in moves if m.reason != "restart" and m.connection_cache]  # a new socket, a stage report
    errors = Counter(_RESPONSE_ID.sub("'resp_…'", f.error) for f in failed)
    seed = config.seed
    return CapDesign(
        mode,
        store,
        n,
        wilson(crossed, n),
        wilson(len(failed), n),
        paired_mean([len(r.reconnects) for r in done], seed=seed),
        dict(Counter(m.reason for m in moves)),
        _cost([(m.e2e_s, m.load_s, m.render_s, m.tokens_rendered, m.tokens_prefilled) for m in costed], seed),
        _cost(_warm_turns(done) if mode not in _SUMMED else [], seed),
        paired_mean([r.completion_s for r in done], seed=seed),
        [f"{count} × {error}" for error, count in errors.most_common()],
    )


def _warm_turns(rollouts: list[RolloutResult]) -> list[tuple[float, float, float, int, int]]:
    """The turns after the first that report stages and are not a reconnect's first turn."""
    rows = []
    for r in rollouts:
        moved = {m.turn for m in r.reconnects}
        for k, t in enumerate(r.turns):
            report = t.response.longrun
            if k == 0 or k in moved or not isinstance(report, StageReport):
                continue
            stages = report.stages_s
            rows.append(
                (
                    t.e2e_s,
                    stages.get("load_state", 0.0),
                    stages.get("render", 0.0),
                    report.tokens_rendered,
                    report.tokens_prefilled,
                )
            )
    return rows


def _cost(rows: list[tuple[float, float, float, int, int]], seed: int) -> Cost:
    e2e, load, render, rendered, prefilled = (paired_mean([float(row[k]) for row in rows], seed=seed) for k in range(5))
    return Cost(len(rows), e2e, load, render, rendered, prefilled)


def _ci(e: Estimate, fmt: str, scale: float = 1.0) -> str:
    def one(x: float) -> str:
        return "?" if math.isnan(x) else format(x * scale, fmt)

    return "-" if e.n == 0 else f"{one(e.value)} ({one(e.ci_low)}–{one(e.ci_high)})"


def cap_tables(result: CapResult) -> str:
    """The designs as text: one row each, then the moves' cost beside a warm turn's, then the errors."""
    lifetime = result.config.server.websocket.lifetime_s
    margin = result.config.session.rotate_margin_s
    rows = [
        f"per design (connection limit {lifetime:g} s, rotate {margin:g} s before it; 95 % CI; n rollouts):",
        f"{'mode':<10} {'store':>5} {'n':>3} {'crossed %':>18} {'lost %':>18} {'reconnects/rollout':>20} "
        f"{'rollout s':>24}  moves",
    ]
    for d in result.designs:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(d.reasons.items())) or "-"
        rows.append(
            f"{d.mode:<10} {str(d.store).lower():>5} {d.rollouts:>3} {_ci(d.crossed, '.0f', 100):>18} "
            f"{_ci(d.lost, '.0f', 100):>18} {_ci(d.reconnects, '.2f'):>20} {_ci(d.completion_s, ',.0f'):>24}  {reasons}"
        )
    rows += [
        "",
        "what a move to a new socket cost: its first turn vs. the design's warm turns (turns with a stage "
        "report; mean, 95 % CI):",
        f"{'mode':<10} {'store':>5} {'turns':>8} {'n':>5} {'E2E s':>20} {'load_state ms':>22} {'render ms':>20} "
        f"{'tokens rendered':>24} {'tokens prefilled':>24}",
    ]
    for d in result.designs:
        for name, c in (("moved", d.reconnect_cost), ("warm", d.warm_cost)):
            if c.n == 0:
                continue
            rows.append(
                f"{d.mode:<10} {str(d.store).lower():>5} {name:>8} {c.n:>5} {_ci(c.e2e_s, '.3f'):>20} "
                f"{_ci(c.load_s, '.2f', 1000):>22} {_ci(c.render_s, '.2f', 1000):>20} "
                f"{_ci(c.tokens_rendered, ',.0f'):>24} {_ci(c.tokens_prefilled, ',.0f'):>24}"
            )
    errors = [f"{d.mode:<10} {str(d.store).lower():>5} {line}" for d in result.designs for line in d.errors]
    if errors:
        rows += ["", "rollouts lost, by error:", *errors]
    return "\n".join(rows)


def write_cap(result: CapResult, directory: str | Path) -> Path:
    """DIR/store-false and DIR/store-true (run folders, sim/harness/trace.py), designs.json, and
    reconnects.csv (one row per move: design, rollout, `Reconnect`'s fields)."""
    path = Path(directory)
    for store, run in result.runs.items():
        write_run(run, path / f"store-{str(store).lower()}", tables=bool(run.rollouts))  # every one failed: no tables
    write_json(result.designs, path / "designs.json")
    rows: list[dict[str, Any]] = [
        {"mode": r.mode, "store": store, "rollout": r.index, **dataclasses.asdict(m)}
        for store, run in result.runs.items()
        for r in run.rollouts
        for m in r.reconnects
    ]
    if rows:
        write_table(rows, path / "reconnects.csv")
    return path


def cap_options(p: argparse.ArgumentParser) -> None:
    """`long`'s `--cap`: this study instead of the compaction one."""
    p.add_argument(
        "--cap",
        action="store_true",
        help="hour-scale rollouts across the connection limit instead: every design with store false and true, "
        "reconnects and what they cost and lost (set a heavy tool-time tail, e.g. the agentic workload's "
        "--tool-time-s 0.3 --tool-time-sigma 2.86; docs/experiments.md)",
    )


def cap_main(config: CompareConfig, args: argparse.Namespace, describe: str, *, long_modes: str) -> int:
    """`python -m sim long --cap`; `long_modes`: long's default `--modes`, which here mean `CAP_MODES`.
    A mode it does not model is refused in one line."""
    if ",".join(args.modes) == long_modes:
        config = structs.replace(config, modes=CAP_MODES)
    bad = [m for m in config.modes if m not in CAP_MODES]
    if bad:
        raise SystemExit(f"invalid option: --modes: --cap models {', '.join(CAP_MODES)}, not {', '.join(bad)}")
    folder = start_folder(args, "long")
    print(
        f"longrun long --cap: {config.rollouts} rollouts per design in virtual time (CPU free), "
        f"store false and true; {describe}",
        flush=True,
    )
    result = run_cap(config, progress=not args.quiet)
    print("\n" + cap_tables(result))
    if folder is not None:
        print(f"run folder: {write_cap(result, folder)}", file=sys.stderr)
    return 0
