"""Virtual time against live loopback: one config run both ways, compared turn by turn.

Covers: whether a virtual run (in process, `VirtualTimeLoop`, CPU work charged) reports
what a live run on this machine reports, and whether it reports the same *differences*
between modes, which is what the comparison exists to measure. Scenario: the same config
and seed run live on loopback and in virtual time, so every mode sends the same turns in
both; per mode the turn time, TTFT and each server stage, live against virtual, and the
paired per-turn differences between modes (``http - ws``, ``http_prev - ws``, ``ws - append``).

Statistics (turns after the first; the first turn is the same cold prefill in every mode):

* a turn's end-to-end time and TTFT: the median, with a seeded bootstrap interval over turns;
* a stage: the 20 % trimmed mean per turn (stage times are small and a loaded machine adds
  rare long preemptions; trimming keeps those from deciding), with its bootstrap interval;
* a paired difference: turn k of rollout i in mode a minus the same turn in mode b, the
  20 % trimmed mean of those, with its bootstrap interval (the pairs are resampled together).

Agreement: a mode's median turn and TTFT within `TURN_TOLERANCE` of live; a paired
difference within `DIFF_TOLERANCE` of live's, or within `DIFF_FLOOR_S` (one late timer
wake-up of a live run is most of a millisecond); completion time within
`TURN_TOLERANCE`; the overhead share within `SHARE_TOLERANCE` (absolute). Stage columns are
shown with their ratio and are not judged alone: they are the parts of the turn time.

docs/fidelity.md has the command's output for the default config, the `local` profile and
a long-context workload, and the live costs virtual time leaves out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import structs

from prototype.options import leaves, struct_from_args
from prototype.pipeline import Stage
from sim.analysis.metrics import per_turn_work, summarize
from sim.harness.experiment import CompareConfig, CompareResult, check, compare, config_of
from sim.runtime.realtime import live_cost_samples
from sim.runtime.virtual import LiveCosts, load_live_costs

__all__ = [
    "DEFAULT_COSTS_PATH",
    "DIFF_FLOOR_S",
    "DIFF_TOLERANCE",
    "PAIRS",
    "PRESETS",
    "SHARE_TOLERANCE",
    "TURN_TOLERANCE",
    "Comparison",
    "FidelityReport",
    "Cost",
    "Interval",
    "calibrate",
    "compare_runs",
    "fidelity_main",
    "fidelity_options",
    "format_costs",
    "format_report",
    "measure",
    "run_pairs",
    "paired_bootstrap",
    "write_live_costs",
]

TURN_TOLERANCE: Final = 0.05  # a mode's median turn, TTFT and completion time: within 5 % of live
DIFF_TOLERANCE: Final = 0.20  # a paired between-mode difference: within 20 % of live's ...
DIFF_FLOOR_S: Final = 0.001  # ... or within 1 ms
SHARE_TOLERANCE: Final = 0.02  # overhead share: within 2 percentage points
TRIM: Final = 0.2  # trimmed from each end for the trimmed means
RESAMPLES: Final = 2000
PAIRS: Final = (("http", "ws"), ("http_prev", "ws"), ("ws", "append"))
# A turn's time outside every server stage: the client's request reaching the server, the
# events reaching the client and their parsing (`sim.analysis.metrics.timeline`'s `client` segment).
CLIENT: Final = "client"

PRESETS: Final[dict[str, CompareConfig]] = {
    "default": CompareConfig(),
    # Only real CPU work: no modeled waits, so the server's own work is the whole overhead.
    "local": CompareConfig.of(profile="local", tool_calls=10, rollouts=2),
    # Contexts past 100k tokens from the first turn: every http turn re-renders and
    # re-classifies all of it. Prefill of the uncached tail at the default rate.
    "long-context": CompareConfig.of(
        profile="local", system_prompt_tokens=100_000, tool_calls=8, rollouts=2, tool_time_s=0.1
    ),
}

# Where `--calibrate` writes the transport's costs and `python -m sim fidelity` looks for them.
_CACHE: Final = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
DEFAULT_COSTS_PATH: Final = _CACHE / "longrun" / "live-costs.json"

LoopFactory = Callable[[], Any]  # a fresh event loop for a live run (the CLI passes uvloop's)
Sample = npt.NDArray[np.float64]
Statistic = Callable[[Sample], Sample]  # (resamples, n) -> (resamples,)


@dataclass(frozen=True, slots=True)
class Interval:
    estimate: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.estimate * 1e3:8.2f} [{self.low * 1e3:.2f}, {self.high * 1e3:.2f}]"


def _median(x: Sample) -> Sample:
    return np.median(x, axis=-1)


def _trimmed_mean(x: Sample) -> Sample:
    n = x.shape[-1]
    cut = int(TRIM * n)
    kept = np.sort(x, axis=-1)[..., cut : n - cut] if n - 2 * cut > 0 else x
    return kept.mean(axis=-1)  # type: ignore[no-any-return]


def paired_bootstrap(
    values: Sequence[float], statistic: Statistic = _trimmed_mean, *, seed: int = 0, resamples: int = RESAMPLES
) -> Interval:
    """`statistic` of `values` (per-turn values, or per-turn paired differences: resampling the
    differences resamples the pairs together) with a 95 % percentile bootstrap interval from
    an rng seeded by `seed`."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return Interval(math.nan, math.nan, math.nan)
    estimate = float(statistic(x[np.newaxis, :])[0])
    rng = np.random.default_rng(seed)
    draws = statistic(x[rng.integers(0, x.size, size=(resamples, x.size))])
    low, high = np.percentile(draws, [2.5, 97.5])
    return Interval(estimate, float(low), float(high))


@dataclass(frozen=True, slots=True)
class Comparison:
    """One quantity, live against virtual, and whether they agree within `tolerance`."""

    mode: str  # a mode, or "a-b" for a paired difference
    metric: str
    live: Interval
    virtual: Interval
    judged: bool  # stages are shown, not judged
    agrees: bool
    tolerance: str

    @property
    def ratio(self) -> float:
        return self.virtual.estimate / self.live.estimate if self.live.estimate else math.nan


@dataclass(frozen=True, slots=True)
class FidelityReport:
    config: CompareConfig
    free_cpu: bool
    rows: list[Comparison]

    @property
    def agrees(self) -> bool:
        return all(r.agrees for r in self.rows if r.judged)

    def row(self, mode: str, metric: str) -> Comparison:
        return next(r for r in self.rows if r.mode == mode and r.metric == metric)


Turns = dict[tuple[int, int, int], dict[str, float]]  # (repeat, rollout, turn) -> metric -> seconds
Runs = CompareResult | Sequence[CompareResult]  # one run, or repeats of it


def _runs(runs: Runs) -> list[CompareResult]:
    return [runs] if isinstance(runs, CompareResult) else list(runs)


def _turns(runs: list[CompareResult], mode: str) -> Turns:
    out: Turns = {}
    for repeat, result in enumerate(runs):
        for r in result.rollouts:
            if r.mode != mode:
                continue
            for k, (t, work) in enumerate(zip(r.turns, per_turn_work(r), strict=True)):
                if k == 0:
                    continue
                row = {"turn": t.e2e_s, "ttft": t.ttft_s if t.ttft_s is not None else math.nan}
                for stage in Stage:
                    row[stage.value] = work.get(f"stage:{stage.value}", 0.0)
                row[CLIENT] = t.e2e_s - sum(row[stage.value] for stage in Stage)
                out[(repeat, r.index, k)] = row
    return out


def _relative(live: float, virtual: float, tolerance: float, floor: float = 0.0) -> bool:
    return abs(virtual - live) <= max(tolerance * abs(live), floor)


def compare_runs(live_runs: Runs, virtual_runs: Runs, *, free_cpu: bool = False, seed: int = 0) -> FidelityReport:
    """The report for live and virtual runs of the same config (pure: no run here); with
    repeats, their turns are pooled (repeat i of one side pairs with repeat i of the other)."""
    rows: list[Comparison] = []
    sides = {"live": _runs(live_runs), "virtual": _runs(virtual_runs)}
    modes = [s.mode for s in sides["live"][0].summary]
    turns = {(side, m): _turns(results, m) for side, results in sides.items() for m in modes}

    def boot(values: list[float], statistic: Statistic = _trimmed_mean) -> Interval:
        return paired_bootstrap([v for v in values if not math.isnan(v)], statistic, seed=seed)

    pooled = {side: [r for result in results for r in result.rollouts] for side, results in sides.items()}
    summaries = {(side, s.mode): s for side, rollouts in pooled.items() for s in summarize(rollouts)}
    for m in modes:
        a, b = turns[("live", m)], turns[("virtual", m)]
        keys = sorted(a.keys() & b.keys())
        for metric in ("turn", "ttft"):
            li = boot([a[k][metric] for k in keys], _median)
            vi = boot([b[k][metric] for k in keys], _median)
            floor = DIFF_FLOOR_S if metric == "ttft" else 0.0
            ok = _relative(li.estimate, vi.estimate, TURN_TOLERANCE, floor)
            tol = f"{TURN_TOLERANCE:.0%}" + (f" or {floor * 1e3:g} ms" if floor else "")
            rows.append(Comparison(m, metric, li, vi, True, ok, tol))
        comp = {side: boot([r.completion_s for r in rs if r.mode == m], _median) for side, rs in pooled.items()}
        ok = _relative(comp["live"].estimate, comp["virtual"].estimate, TURN_TOLERANCE)
        rows.append(Comparison(m, "completion", comp["live"], comp["virtual"], True, ok, f"{TURN_TOLERANCE:.0%}"))
        shares = [summaries[(side, m)].overhead_share for side in ("live", "virtual")]
        ok = abs(shares[1] - shares[0]) <= SHARE_TOLERANCE
        rows.append(
            Comparison(
                m,
                "overhead_share",
                Interval(shares[0], shares[0], shares[0]),
                Interval(shares[1], shares[1], shares[1]),
                True,
                ok,
                f"±{SHARE_TOLERANCE * 100:.0f} pt",
            )
        )
        for name in (*(stage.value for stage in Stage), CLIENT):
            li, vi = boot([a[k][name] for k in keys]), boot([b[k][name] for k in keys])
            if li.estimate == 0 and vi.estimate == 0:
                continue
            rows.append(Comparison(m, name, li, vi, False, True, "-"))
    for first, second in PAIRS:
        if first not in modes or second not in modes:
            continue
        for metric in ("turn", CLIENT):  # the turn is judged; its part outside the server's stages shown
            diffs = {}
            for side in ("live", "virtual"):
                a, b = turns[(side, first)], turns[(side, second)]
                keys = sorted(a.keys() & b.keys())
                diffs[side] = boot([a[k][metric] - b[k][metric] for k in keys])
            if metric == CLIENT:
                rows.append(Comparison(f"{first}-{second}", metric, diffs["live"], diffs["virtual"], False, True, "-"))
                continue
            ok = _relative(diffs["live"].estimate, diffs["virtual"].estimate, DIFF_TOLERANCE, DIFF_FLOOR_S)
            tol = f"{DIFF_TOLERANCE:.0%} or {DIFF_FLOOR_S * 1e3:g} ms"
            rows.append(Comparison(f"{first}-{second}", metric, diffs["live"], diffs["virtual"], True, ok, tol))
    return FidelityReport(sides["live"][0].config, free_cpu, rows)


def format_report(report: FidelityReport) -> str:
    """A table: per mode and quantity, live and virtual (ms, with 95 % intervals), their ratio,
    and the verdict where one is judged."""
    head = f"{'mode':<12} {'quantity':<15} {'live ms [95% CI]':>28} {'virtual ms [95% CI]':>28} {'v/l':>6}  verdict"
    lines = [head]
    for r in report.rows:
        if r.metric == "overhead_share":
            live, virt = f"{r.live.estimate * 100:.2f} %", f"{r.virtual.estimate * 100:.2f} %"
        else:
            live, virt = str(r.live), str(r.virtual)
        verdict = ("ok" if r.agrees else "DISAGREES") + f" (tol {r.tolerance})" if r.judged else ""
        lines.append(f"{r.mode:<12} {r.metric:<15} {live:>28} {virt:>28} {r.ratio:>6.2f}  {verdict}")
    cpu = "CPU free (negative control)" if report.free_cpu else "CPU charged"
    lines.append(f"virtual time with {cpu}: {'agrees' if report.agrees else 'DISAGREES'} with live")
    return "\n".join(lines)


def run_pairs(
    config: CompareConfig, *, repeats: int = 1, free_cpu: bool = False, loop_factory: LoopFactory | None = None
) -> tuple[list[CompareResult], ...]:
    """`repeats` times: `config` live on loopback (on a loop from `loop_factory`; the CLI passes
    uvloop's, as `python -m sim compare` does), then in
    virtual time with CPU charged (or free: the negative control). Alternating keeps a change
    in the machine's load from landing on one side only."""
    live, virtual = [], []
    for _ in range(repeats):
        live.append(compare(config, virtual=False, loop_factory=loop_factory))
        virtual.append(compare(config, virtual=True, free_cpu=free_cpu))
    return live, virtual


def measure(
    config: CompareConfig,
    *,
    repeats: int = 1,
    free_cpu: bool = False,
    seed: int = 0,
    loop_factory: LoopFactory | None = None,
) -> FidelityReport:
    """`run_pairs`, compared."""
    live, virtual = run_pairs(config, repeats=repeats, free_cpu=free_cpu, loop_factory=loop_factory)
    return compare_runs(live, virtual, free_cpu=free_cpu, seed=seed)


def fidelity_options(p: argparse.ArgumentParser, add_config_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """`python -m sim fidelity [CONFIG] [--field value ...]`: the config options override the
    preset or file named by CONFIG (so their defaults are the preset's, not shown here)."""
    p.add_argument(
        "config",
        nargs="?",
        default="default",
        help=f"a preset ({', '.join(PRESETS)}) or a JSON file: CompareConfig fields, or a run folder's config.json",
    )
    add_config_options(p)
    fields = {field.name for _, field in leaves(CompareConfig)}
    for action in p._actions:
        if action.dest in fields:
            action.help = (action.help or "") + " (overrides CONFIG)"
    p.add_argument("--free-cpu", action="store_true", help="the negative control: virtual time with CPU work free")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the live per-operation costs that virtual time leaves out, and write the transport's to "
        f"--live-costs (default {DEFAULT_COSTS_PATH})",
    )
    p.add_argument(
        "--no-live-costs",
        action="store_true",
        help=f"charge no live transport costs (by default those in {DEFAULT_COSTS_PATH}, if it exists)",
    )
    p.add_argument("--repeats", type=int, default=1, help="live and virtual runs, alternating; turns pooled")
    p.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap intervals")


def _load_config(name: str) -> CompareConfig:
    if name in PRESETS:
        return PRESETS[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown config {name!r}: use a preset ({', '.join(PRESETS)}) or a JSON file")
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("config"), dict):  # a run folder's config.json
        data = data["config"]
    return config_of(data)


def fidelity_main(args: argparse.Namespace, loop_factory: LoopFactory | None = None) -> int:
    """The `fidelity` subcommand; live runs on loops from `loop_factory` (the CLI: uvloop)."""
    if args.calibrate:
        print("longrun fidelity --calibrate: live per-operation costs on this machine (loopback)", flush=True)
        costs = calibrate(loop_factory=loop_factory)
        print(format_costs(costs))
        path = write_live_costs(costs, getattr(args, "live_costs", None) or DEFAULT_COSTS_PATH)
        print(f"transport costs written to {path} (charged by virtual runs with live_costs={path})")
        return 0
    try:
        config = struct_from_args(args, CompareConfig, base=_load_config(args.config))
        if args.no_live_costs:
            config = structs.replace(config, live_costs=None)
        elif not hasattr(args, "live_costs") and config.live_costs is None and DEFAULT_COSTS_PATH.is_file():
            config = structs.replace(config, live_costs=str(DEFAULT_COSTS_PATH))
        check(config, virtual=False)
    except (ValueError, OSError, msgspec.ValidationError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    default = msgspec.to_builtins(CompareConfig())
    shown = {k: v for k, v in msgspec.to_builtins(config).items() if v != default[k]}
    print(f"longrun fidelity: {args.config} {json.dumps(shown)} (live loopback, then virtual time)", flush=True)
    if config.live_costs and not args.free_cpu:
        charged = msgspec.to_builtins(load_live_costs(config.live_costs))
        print("charged live costs µs: " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in charged.items()), flush=True)
    repeats, seed = max(1, args.repeats), args.bootstrap_seed
    report = measure(config, repeats=repeats, free_cpu=args.free_cpu, seed=seed, loop_factory=loop_factory)
    print(format_report(report))
    return 0 if report.agrees else 1


class Cost(msgspec.Struct, frozen=True, kw_only=True):
    """One live per-operation cost that virtual time leaves out, measured on this machine."""

    name: str
    median_s: float
    p90_s: float
    what: str


def calibrate(
    *, repeats: int = 200, stream_bytes: int = 1_000_000, loop_factory: LoopFactory | None = None
) -> list[Cost]:
    """Measure, live on loopback (on loops from `loop_factory`: the CLI uses uvloop), the costs
    a live turn pays that an in-process virtual run does not (`sim.runtime.realtime.live_cost_samples`:
    a timer's late wake-up, work after a wait, the hop to a render thread and back, an HTTP
    request and its response, a WebSocket message, each back to back and after the loop slept,
    a megabyte streamed as SSE or as one WebSocket message). Medians and 90th percentiles over
    `repeats`; the streams, the offloaded render and the samples after a sleep over fewer.
    `write_live_costs` keeps the transport's (`sim.runtime.virtual.LiveCosts`) for virtual runs."""
    out = []
    for name, samples, what in live_cost_samples(repeats, stream_bytes, loop_factory=loop_factory):
        xs = np.asarray(samples)
        out.append(Cost(name=name, median_s=float(np.median(xs)), p90_s=float(np.percentile(xs, 90)), what=what))
    return out


def write_live_costs(costs: Sequence[Cost], path: str | Path) -> Path:
    """Write the transport's costs among `costs` (their medians) as a `LiveCosts` JSON file."""
    medians = {c.name: c.median_s for c in costs}
    fields = {f: max(0.0, medians[f]) for f in LiveCosts.__struct_fields__ if f in medians}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(LiveCosts(**fields))) + b"\n")
    return out


def format_costs(costs: Sequence[Cost]) -> str:
    lines = [f"{'cost':<24} {'median µs':>10} {'p90 µs':>10}  what"]
    lines += [f"{c.name:<24} {c.median_s * 1e6:>10.1f} {c.p90_s * 1e6:>10.1f}  {c.what}" for c in costs]
    return "\n".join(lines)
