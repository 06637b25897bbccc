"""`python -m sim`: the append-vs-create comparison (`compare`) and parameter sweeps (`sweep`).

Covers: the main job. Scenario: the same seeded agent rollouts in each API mode
(`http`, `http_prev`, `ws`, `append`) against one server. By default the precision comes
from virtual time (`--rollouts` per mode, CPU work charged) and a short live run on
loopback (`--live-rollouts`, the first rollouts of the same seed) runs beside it, with
their agreement as an interval on the paired difference; `--virtual` or `--live` runs only
one. A table of the metrics per mode with 95 % intervals and n, the paired differences
between modes, and a run folder (sim/harness/trace.py): `--out DIR`, by default a new one under
`runs/`, none with `--no-save`. `results` writes the
headline comparison into a small committed folder and renders the README's table from it
(sim/harness/results.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import uvloop

from prototype.options import OneLineParser, add_struct_options, leaves, option_error, struct_from_args
from sim.analysis.metrics import live_agreement
from sim.analysis.records import read_records
from sim.analysis.stats import Estimate
from sim.engine.process import EngineNotInstalled
from sim.fleet.config import READ_LEAVES
from sim.harness.cap import cap_main, cap_options
from sim.harness.capacity import (
    CapacityConfig,
    cache_table,
    capacity_table,
    crossover_table,
    resource_table,
    run_capacity,
    split_refusal_of,
)
from sim.harness.console import (
    add_save_options,
    agreement_text,
    interjection_table,
    one_line_logs,
    pairs_table,
    points_bar,
    run_folder,
    saved_text,
    start_folder,
    table,
    terminal_table,
)
from sim.harness.contention import WHAT_IFS as CONTENTION_WHAT_IFS
from sim.harness.contention import contention, contention_text, fit_elsewhere, saved_contention
from sim.harness.curve import curve_main, curve_options
from sim.harness.drift import drift_text
from sim.harness.experiment import CompareConfig, CompareResult, check, compare
from sim.harness.fidelity import fidelity_main, fidelity_options
from sim.harness.idle import idle_main, idle_options
from sim.harness.long import long_tables, run_long, write_long
from sim.harness.predict import calibrate_main, calibrate_options
from sim.harness.results import render_results
from sim.harness.sizing import EngineTooSmall, fit_engine, kv_mib
from sim.harness.sweep import AXES, SweepConfig, dask_executor, points, process_pool, run_sweep, sigterm_as_sigint
from sim.harness.trace import read_config, write_capacity, write_json, write_run, write_table, write_text
from sim.harness.ttl import ttl_main, ttl_options
from sim.harness.validate import modes_refusal, validate, validate_records, validation_text
from sim.measure.driver import measure_main, measure_options
from sim.record.proxy import record_main, record_options
from sim.rollout.result import ALL_MODES, MODES

__all__ = [
    "build_parser",
    "interjection_table",
    "main",
    "pairs_table",
    "run",
    "run_folder",
    "saved_text",
    "table",
    "terminal_table",
]


_FLEET_SET_BY_POINT: Final = ("kv_budget_tokens", "hold_policy", "preempt_held")  # capacity: grid axes and variants
# capacity: the nested model's and server's leaves the fleet does not read
_FLEET_UNREAD: Final = tuple(
    field.name
    for path, field in leaves(CapacityConfig)
    if path[:1] == ("fleet",) and path[1:2] and path[1] in READ_LEAVES and field.name not in READ_LEAVES[path[1]]
)


# The modes of `compare` and `results` (what `make compare` runs): those of the README's results
# table, the baselines, the shipped create design, append and the Agents API. A config built in
# code keeps `CompareConfig`'s four.
HEADLINE_MODES: Final = (*MODES, "agents")


def _add_config_options(p: argparse.ArgumentParser, **defaults: object) -> None:
    """One option per leaf field of `CompareConfig`, its nested `server` and `model` included;
    `defaults`: the command's own, by leaf name."""
    add_struct_options(p, CompareConfig, defaults=defaults)


def _add_compare_options(c: argparse.ArgumentParser, *, results: bool = False) -> None:
    _add_config_options(c, modes=HEADLINE_MODES)
    where = c.add_mutually_exclusive_group()
    where.add_argument(
        "--virtual", action="store_true", help="only in process on a virtual clock (no sockets, no waiting)"
    )
    where.add_argument("--live", action="store_true", help="only live on loopback (--rollouts of them)")
    c.add_argument(
        "--live-rollouts",
        type=int,
        default=2,
        help="rollouts per mode of the live run beside the virtual one (0 = none)",
    )
    c.add_argument(
        "--free-cpu", action="store_true", help="virtual run: CPU work costs no virtual time (exactly reproducible)"
    )
    if results:  # the committed folder the README's table is rendered from
        c.add_argument("--out", metavar="DIR", default="docs/results/headline", help="the folder to write and render")
        c.set_defaults(no_save=False)
    else:
        add_save_options(c, "config, summary, per-turn tables, plots", "compare")
    c.add_argument("--quiet", action="store_true", help="no progress bar")


# `python -m sim long`: 10 rollouts of 200 tool calls in every mode but `steer` (which is `inject` when
# there are no interjections, and the beta does not steer a compacting response) and `agents`, compacting past
# 20,000 tokens; tool outputs of median 250 tokens, so that no rollout outgrows the context window
# without compaction.
LONG_DEFAULTS: Final = {
    "rollouts": 10,
    "tool_calls": 200,
    "tool_output_tokens": 250,
    "modes": ",".join(m for m in ALL_MODES if m not in ("steer", "agents")),
    "compact_threshold": 20_000,
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m sim", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compare",
        help="run the same rollouts in each mode and print a table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_compare_options(c)
    r = sub.add_parser(
        "results",
        help="run the default comparison into a small run folder to commit, and print the README table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_compare_options(r, results=True)
    r.add_argument("--render", action="store_true", help="only print the table of the folder at --out (no run)")

    w = sub.add_parser(
        "sweep",
        help="a grid of comparisons in virtual time, one tidy table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = SweepConfig()
    for axis in AXES:
        w.add_argument(
            "--" + axis.replace("_", "-"), default=",".join(map(str, getattr(defaults, axis))), help="comma list"
        )
    w.add_argument("--modes", default=",".join(defaults.modes), help="comma list of modes")
    w.add_argument("--rollouts", type=int, default=defaults.base.rollouts, help="rollouts per mode and point")
    w.add_argument("--seed", type=int, default=defaults.base.seed)
    w.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="local worker processes")
    w.add_argument("--dask", metavar="ADDRESS", help="run on a Dask cluster: a scheduler address, or 'local'")
    w.add_argument(
        "--out",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="the table: .csv or .parquet (default: sweep.csv in a new run folder, runs/sweep-YYYYMMDD-HHMM, UTC)",
    )
    w.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    w.add_argument("--quiet", action="store_true", help="no progress bar")

    lg = sub.add_parser(
        "long",
        help="long rollouts without and with compaction in each mode: per-turn cost by turn window "
        "(virtual time, docs/compaction.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_config_options(lg, **LONG_DEFAULTS)
    lg.add_argument("--window-turns", type=int, default=50, help="turns per window of the table")
    cap_options(lg)
    lg.add_argument(
        "--charge-cpu", action="store_true", help="charge CPU work to virtual time (default: CPU free, reproducible)"
    )
    add_save_options(lg, "both runs' folders and the window tables", "long")
    lg.add_argument("--quiet", action="store_true", help="no progress bar")

    f = sub.add_parser(
        "fidelity",
        help="run one config live and in virtual time and compare them (sim/harness/fidelity.py)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fidelity_options(f, _add_config_options)

    val = sub.add_parser(
        "validate",
        help="the simulator against a real engine: run every mode live on llama.cpp, fit on some rollouts' "
        "http and ws turns, predict the rest and append, print the held-out errors (docs/validation.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_config_options(val)
    val.add_argument("--train-share", type=float, default=0.5, help="share of rollouts the fit sees")
    add_save_options(val, "the engine run: config, records.jsonl, engine.jsonl, tables", "validate")
    val.add_argument("--quiet", action="store_true", help="no progress bar")
    val.add_argument(
        "--capture",
        action="store_true",
        help="fit on what a capture of the http and ws turns holds (times, sizes, usage; no server stages)",
    )
    val.add_argument(
        "--contention",
        action="store_true",
        help="instead: more rollouts in flight than slots (http, ws, append; rollout i starts i × --stagger-s after "
        "the first), a fit on some rollouts' http and ws turns, the fleet model's prediction of the held-out turns",
    )
    for flag, _, text in CONTENTION_WHAT_IFS:
        val.add_argument(flag, action="store_true", help=f"--contention what-if: {text}")
    val.add_argument(
        "--fit-from",
        metavar="DIR",
        help="--contention: fit on this other engine run's http and ws turns (one rollout a slot, the same "
        "engine) instead of the contention run's own training rollouts",
    )
    val.add_argument(
        "--replicate",
        metavar="DIR",
        help="--contention --from: a second engine run of the same config and seed, scored against the run as a "
        "prediction is (the engine against itself: the floor of the per-turn errors)",
    )
    val.add_argument(
        "--measured-order",
        action="store_true",
        help="--contention --from a run without a stagger, what-if: the order its rollouts reached the engine, "
        "read from the measurement (default: every order scored)",
    )
    val.add_argument("--from", dest="source", metavar="DIR", help="validate a saved engine run folder (no new run)")

    cap = sub.add_parser(
        "capacity",
        help="goodput against offered load when sessions share a fleet with a KV budget, for every mode, "
        "hold policy, KV budget and tool-time tail, and where holding KV stops paying (the fleet model, "
        "docs/capacity.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_struct_options(cap, CapacityConfig, skip=_FLEET_SET_BY_POINT + _FLEET_UNREAD)
    cap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="local worker processes")
    cap.add_argument("--dask", metavar="ADDRESS", help="run on a Dask cluster: a scheduler address, or 'local'")
    add_save_options(cap, "points.csv, runs.csv, frontier.png, crossover.png, config.json", "capacity")
    cap.add_argument("--quiet", action="store_true", help="no progress bar")
    cap.add_argument(
        "--split-point",
        action="store_true",
        help="run each point as one run per replica on the workers (--dask or --workers), merged: the same result; "
        "static routers only (hash; affinity for http, http_prev, agents)",
    )
    ttl_options(sub)
    idle_options(sub)
    curve_options(sub)

    calibrate_options(sub)
    record_options(sub)
    measure_options(sub)
    return p


def capacity_main(args: argparse.Namespace) -> int:
    try:
        config = struct_from_args(args, CapacityConfig)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, CapacityConfig)}") from None
    except ValueError as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    split = args.split_point
    if split and (reason := split_refusal_of(config)) is not None:
        print(f"error: --split-point: {reason}", file=sys.stderr)
        return 2
    grid = len(config.grid())
    folder = start_folder(args, "capacity")
    with points_bar(grid, quiet=args.quiet) as on_point:
        if args.dask:
            with dask_executor(args.dask, workers=args.workers) as executor:
                rows, points_ = run_capacity(config, executor, on_point=on_point, split=split)
        elif args.workers > 1 and (grid > 1 or split):
            with process_pool(args.workers) as pool:
                rows, points_ = run_capacity(config, pool, on_point=on_point, split=split)
        else:
            rows, points_ = run_capacity(config, on_point=on_point, split=split)
    print(capacity_table(config, points_))
    if "append" in config.modes and "ws" in config.modes:
        print("\n" + crossover_table(config, points_))
    print("\n" + resource_table(config, points_))
    print("\n" + cache_table(config, points_))
    if folder is not None:
        print(f"run folder: {write_capacity(folder, config, rows, points_)}", file=sys.stderr)
    return 0


def long_main(args: argparse.Namespace) -> int:
    if args.cap:
        config = config_from(args)
        return cap_main(config, args, _describe(config), long_modes=str(LONG_DEFAULTS["modes"]))
    try:
        config = config_from(args)
        check(config, virtual=True)
        if config.compact_threshold <= 0:
            raise ValueError("--compact-threshold must be > 0: the run compares without and with compaction")
        if args.window_turns < 1:
            raise ValueError("--window-turns must be >= 1")
    except (msgspec.ValidationError, ValueError, OSError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    folder = start_folder(args, "long")
    cpu = "CPU charged" if args.charge_cpu else "CPU free"
    print(
        f"longrun long: {config.rollouts} rollouts per mode in virtual time ({cpu}), without compaction and "
        f"with; {_describe(config)}",
        flush=True,
    )
    result = run_long(config, window_turns=args.window_turns, charge_cpu=args.charge_cpu, progress=not args.quiet)
    print("\n" + long_tables(result))
    if folder is not None:
        print(f"run folder: {write_long(result, folder)}", file=sys.stderr)
    return 0


# A sweep's config fields by the flag that sets them (the grid axes are flags of their own name).
_SWEEP_FLAGS: Final = {"base.rollouts": "--rollouts", "base.seed": "--seed"}


def sweep_from(args: argparse.Namespace) -> SweepConfig:
    """The grid the options give; a refused value raises SystemExit naming its flag."""

    def numbers(flag: str, text: str, kind: type[float] | type[int]) -> list[float] | list[int]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"invalid option: {flag}: not a comma list of {kind.__name__}: {text!r}") from None

    grid = {
        axis: numbers("--" + axis.replace("_", "-"), getattr(args, axis), float)
        for axis in ("tps", "tool_time_s", "rtt_s")
    }
    try:
        sweep = msgspec.convert(
            {
                **grid,
                "tool_calls": numbers("--tool-calls", args.tool_calls, int),
                "profile": [x.strip() for x in args.profile.split(",") if x.strip()],
                "modes": [x.strip() for x in args.modes.split(",") if x.strip()],
                "base": msgspec.to_builtins(CompareConfig(rollouts=args.rollouts, seed=args.seed)),
            },
            SweepConfig,
        )
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, SweepConfig, _SWEEP_FLAGS)}") from None
    try:
        for config in points(sweep):  # each point's config, as the workers will build it
            check(config, virtual=True)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, CompareConfig)}") from None
    except ValueError as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    if args.workers < 1:
        raise SystemExit("invalid option: --workers: must be >= 1")
    return sweep


def sweep_main(args: argparse.Namespace) -> int:
    sweep = sweep_from(args)
    if not hasattr(args, "out"):
        folder = run_folder(argparse.Namespace(no_save=False), "sweep")
        assert folder is not None
        out = folder / "sweep.csv"
    else:
        out = Path(args.out)
        if out.suffix not in (".csv", ".parquet"):
            raise SystemExit(f"invalid option: --out: {out} is neither .csv nor .parquet")
        if out.exists() and not args.force:
            raise SystemExit(f"invalid option: --out: {out} exists (--force overwrites it)")
    print(f"the table: {out}", file=sys.stderr, flush=True)
    with points_bar(len(points(sweep)), quiet=args.quiet) as on_point:
        if args.dask:
            with dask_executor(args.dask, workers=args.workers) as executor:
                rows = run_sweep(sweep, executor, on_point=on_point)
        else:
            with process_pool(args.workers) as pool:
                rows = run_sweep(sweep, pool, on_point=on_point)
    path = write_table(rows, out)
    print(f"{len(rows)} rows ({len(points(sweep))} points x {len(sweep.modes)} modes) written to {path}")
    return 0


def config_from(args: argparse.Namespace) -> CompareConfig:
    """The config the options give; a refused value raises SystemExit naming its flag."""
    try:
        config: CompareConfig = struct_from_args(args, CompareConfig)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, CompareConfig)}") from None
    return config


def run(config: CompareConfig, *, virtual: bool, free_cpu: bool = False, progress: bool = False) -> CompareResult:
    """`sim.harness.experiment.compare`, live runs on uvloop."""
    return compare(config, virtual=virtual, free_cpu=free_cpu, progress=progress, loop_factory=uvloop.new_event_loop)


def _describe(config: CompareConfig) -> str:
    if config.trace is not None:
        shape = f"trace {config.trace}"
    elif config.workload != "custom":
        shape = f"workload {config.workload}"
    else:
        shape = f"{config.tool_calls} tool calls, tool time median {config.tool_time_s:g} s"
    compaction = f", compacting past {config.compact_threshold} tokens" if config.compact_threshold else ""
    e = config.engine
    speed = (
        f"llama.cpp engine ({e.engine_slots} slots of {e.ctx_per_slot:,} tokens, {kv_mib(e.ctx_per_slot):,.0f} MiB of "
        f"KV each, {e.engine_decode} decoding)"
        if e.engine_kind != "none"
        else f"{config.model.tps:g} tokens/s"
    )
    return f"{shape}, {speed}, seed {config.seed}, {config.server.profile_name} cost profile{compaction}"


def _show(title: str, result: CompareResult) -> None:
    print(f"\n{title}")
    print(terminal_table(result.summary, result.failed))
    if result.drift is not None:
        print(drift_text(result.drift))
    if result.stopped:
        print(f"stopped adding rollouts: {result.stopped}")
    print("\npaired by rollout:")
    print(pairs_table(result.pairs))
    if any(s.interjections for s in result.summary):
        print("\ninterjections (user message → first token of the turn that has it in context):")
        print(interjection_table(result.summary, result.pairs))


def compare_main(args: argparse.Namespace) -> int:
    config = config_from(args)
    if args.live_rollouts < 0:
        raise SystemExit("invalid option: --live-rollouts: must be >= 0")
    if config.engine.engine_kind != "none":  # a real engine is real time: the comparison is the live one
        if args.virtual:
            raise SystemExit("invalid option: --engine runs in real time only (drop --virtual)")
        args.live = True
    try:
        check(config, virtual=not args.live)
        if not args.virtual and not args.live and args.live_rollouts:
            check(config, virtual=False)
        config = fit_engine(config)  # the slots sized to the workload, or refused, before the engine starts
    except (EngineNotInstalled, EngineTooSmall) as exc:
        raise SystemExit(f"python -m sim compare: {exc}") from None
    except (ValueError, OSError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    folder = run_folder(args, "compare")
    beside = 0 if (args.virtual or args.live) else args.live_rollouts
    cpu = "CPU free" if args.free_cpu else "CPU charged"
    plan = (
        f"{config.rollouts} rollouts per mode live on loopback"
        if args.live
        else f"{config.rollouts} rollouts per mode in virtual time ({cpu})"
        + (f", beside {beside} live on loopback" if beside else "")
    )
    if config.ci_width > 0 and not args.live:
        plan += f", adding batches until every time saved is within ±{config.ci_width:g} points"
    print(f"longrun compare: {plan};\n  {_describe(config)}", flush=True)
    if folder is not None:  # before the run: a run cut short still says where its folder was to be
        print(f"run folder: {folder}", file=sys.stderr, flush=True)
    progress = not args.quiet
    main_result = run(config, virtual=not args.live, free_cpu=args.free_cpu, progress=progress)
    where = "live loopback" if args.live else "virtual time"
    lanes = f", WebSocket modes: {config.lanes} rollouts multiplexed on one connection" if config.lanes else ""
    n_main = main_result.summary[0].n if main_result.summary else 0
    _show(f"{where}, n={n_main} rollouts per mode{lanes}:", main_result)
    if config.lanes:  # the same seeds on a connection per rollout, as many in flight
        apart = msgspec.structs.replace(config, lanes=0, concurrency=max(config.concurrency, config.lanes))
        alone = run(apart, virtual=not args.live, free_cpu=args.free_cpu, progress=progress)
        _show(f"against: {apart.concurrency} rollouts in flight, a connection each:", alone)
    live_result: CompareResult | None = None
    agreement: Estimate | None = None
    if beside:
        live_config = msgspec.structs.replace(config, rollouts=beside, ci_width=0.0)
        live_result = run(live_config, virtual=False, progress=progress)
        _show(f"live loopback, n={beside} rollouts per mode (rollouts 0–{beside - 1} of the same seed):", live_result)
        agreement = live_agreement(main_result.rollouts, live_result.rollouts, seed=config.seed)
        print("\n" + agreement_text(agreement))
    if folder is not None:
        tables = args.command != "results"
        path = write_run(main_result, folder, tables=tables)
        if tables:  # every column of the terminal's table
            drift = "" if main_result.drift is None else "\n" + drift_text(main_result.drift)
            write_text(table(main_result.summary, main_result.failed) + drift, path / "table.txt")
        if live_result is not None and agreement is not None:
            write_run(live_result, path / "live", tables=tables)
            if tables:
                write_text(table(live_result.summary, live_result.failed), path / "live" / "table.txt")
            write_json({"live_vs_virtual": agreement, "pairs": "(mode, rollout)"}, path / "agreement.json")
        print(f"run folder: {path}", file=sys.stderr)
        if args.command == "results":
            print("\n" + render_results(path))
    return 0


# `python -m sim validate --contention`: eight rollouts of each mode in flight on the engine's two
# slots, started half a second apart in index order (the arrival order, an input of the
# prediction), decoded verified (the fast regime: the engine's time per turn near the API's); the
# engine's host-RAM prompt cache on.
CONTENTION_DEFAULTS: Final = CompareConfig.of(
    engine_kind="llamacpp",
    engine_cache_ram_mib=-1,
    engine_decode="verified",
    modes=("http", "ws", "append"),
    profile="local",
    rollouts=8,  # the fit's 4 training rollouts: 3 give its coefficients, 1 its own hold-out
    concurrency=8,
    stagger_s=0.5,
    tool_calls=3,
    system_prompt_tokens=600,
    tool_output_tokens=120,
    tool_time_s=1.0,
)

# `python -m sim validate`'s run when no option says otherwise: a small workload every mode of
# which a 2-core CPU engine serves in minutes, on the local profile (no modeled waits).
VALIDATE_DEFAULTS: Final = CompareConfig.of(
    engine_kind="llamacpp",
    modes=("http", "ws", "append"),
    profile="local",
    rollouts=6,
    tool_calls=4,
    system_prompt_tokens=600,
    tool_output_tokens=120,
    tool_time_s=0.2,
)


def _engine_config(args: argparse.Namespace, base: CompareConfig) -> CompareConfig:
    """The options given over `base`, checked for a live run on the engine (exits on a bad one)."""
    try:
        config: CompareConfig = struct_from_args(args, CompareConfig, base=base)
        check(config, virtual=False)
        config = fit_engine(config)
    except (EngineNotInstalled, EngineTooSmall) as exc:
        raise SystemExit(f"python -m sim validate: {exc}") from None
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, CompareConfig)}") from None
    except (ValueError, OSError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    return config


def contention_main(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {"train_share": args.train_share}
    options.update((key, getattr(args, key)) for _, key, _ in CONTENTION_WHAT_IFS)
    if args.fit_from:  # the engine's rates fitted on another run, read before any engine starts
        try:
            options["calibration"] = fit_elsewhere(read_records([Path(args.fit_from)]))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise SystemExit(f"python -m sim validate: --fit-from {args.fit_from}: {exc}") from None
        options["fit_source"] = args.fit_from
    if args.replicate and not args.source:
        raise SystemExit("python -m sim validate: --replicate scores two saved runs: give the run with --from")
    if args.source:  # a saved run: its config, records and the engine's turns
        again = Path(args.replicate) if args.replicate else None
        try:
            v = saved_contention(Path(args.source), replicate=again, measured_order=args.measured_order, **options)
        except (OSError, KeyError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise SystemExit(f"python -m sim validate: {exc}") from None
        print(contention_text(v))
        return 1 if v.problems else 0
    if args.measured_order:
        raise SystemExit("python -m sim validate: --measured-order scores a saved run (--from) only")
    given = {k: getattr(args, k, getattr(CONTENTION_DEFAULTS, k)) for k in ("stagger_s", "concurrency", "rollouts")}
    if not given["stagger_s"] > 0:  # refused before the engine starts
        raise SystemExit(
            "python -m sim validate: a new contention run needs --stagger-s > 0 (the arrival order "
            "is an input of the prediction, never read from the engine)"
        )
    if given["concurrency"] < given["rollouts"]:
        raise SystemExit(
            "python -m sim validate: every rollout of a mode must be in flight at once "
            f"(--concurrency {given['concurrency']} < --rollouts {given['rollouts']})"
        )
    config = _engine_config(args, CONTENTION_DEFAULTS)
    out = start_folder(args, "validate-contention")
    print(f"longrun validate --contention: {config.rollouts} rollouts in flight; {_describe(config)}", flush=True)
    measured = run(config, virtual=False, progress=not args.quiet)
    _show(f"engine, n={config.rollouts} rollouts per mode, {config.concurrency} in flight:", measured)
    if out is not None:
        print(f"run folder: {write_run(measured, out)}", file=sys.stderr)
    try:
        v = contention(measured, seed=config.seed, **options)
    except ValueError as exc:
        raise SystemExit(f"python -m sim validate: {exc}") from None
    print("\n" + contention_text(v))
    return 1 if v.problems else 0


def validate_main(args: argparse.Namespace) -> int:
    if args.contention:
        return contention_main(args)
    keys = [("--fit-from", "fit_from"), ("--replicate", "replicate"), ("--measured-order", "measured_order")]
    given = [flag for flag, key in keys + [(f, k) for f, k, _ in CONTENTION_WHAT_IFS] if getattr(args, key)]
    if given:  # options of the contention check only
        raise SystemExit(f"python -m sim validate: {', '.join(given)} go with --contention")
    if args.source:
        folder = Path(args.source)
        try:
            saved = read_config(folder)
            if hasattr(args, "cache_generated"):  # the simulator's what-if, on the saved measurement
                saved = saved.updated(cache_generated=args.cache_generated)
            if hasattr(args, "engine_block_tokens"):  # the prediction at another prefix granularity
                saved = saved.updated(engine_block_tokens=args.engine_block_tokens)
            v = validate_records(
                read_records([folder]), saved, train_share=args.train_share, seed=saved.seed, capture=args.capture
            )
        except (OSError, KeyError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise SystemExit(f"python -m sim validate: {exc}") from None
        print(validation_text(v))
        return 1 if v.problems else 0
    config = _engine_config(args, VALIDATE_DEFAULTS)
    refused = modes_refusal(config)
    if refused:  # before the engine starts
        raise SystemExit(f"python -m sim validate: --modes {','.join(config.modes)}: {refused}")
    out = start_folder(args, "validate")
    print(f"longrun validate: {config.rollouts} rollouts per mode live on the engine; {_describe(config)}", flush=True)
    measured = run(config, virtual=False, progress=not args.quiet)
    _show(f"engine, n={config.rollouts} rollouts per mode:", measured)
    if out is not None:
        print(f"run folder: {write_run(measured, out)}", file=sys.stderr)
    try:
        v = validate(measured, train_share=args.train_share, seed=config.seed, capture=args.capture)
    except ValueError as exc:
        raise SystemExit(f"python -m sim validate: {exc}") from None
    print("\n" + validation_text(v))
    return 1 if v.problems else 0


def main(argv: list[str] | None = None) -> int:
    """Run a command. A refusal (an option's value, a missing engine) is one line on stderr
    naming what was refused, with exit code 2, before anything runs: the commands raise it as
    `SystemExit(message)`, which Python alone would print with exit code 1."""
    args = build_parser().parse_args(argv)
    one_line_logs()
    try:
        with sigterm_as_sigint():
            return _dispatch(args)
    except KeyboardInterrupt:  # its pools and clusters closed on the way out
        print(f"python -m sim {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        line = " ".join(exc.code.split())
        prefix = f"python -m sim {args.command}:"
        print(line if line.startswith(prefix) else f"{prefix} {line}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    jobs: dict[str, Callable[[argparse.Namespace], int]] = {
        "sweep": sweep_main,
        "long": long_main,
        "calibrate": calibrate_main,
        "capacity": capacity_main,
        "ttl-curve": ttl_main,
        "idle": idle_main,
        "fidelity": lambda a: fidelity_main(a, uvloop.new_event_loop),
        "validate": validate_main,
        "curve": lambda a: curve_main(a, lambda c, progress: run(c, virtual=False, progress=progress)),
        "record": lambda a: record_main(a, uvloop.run),
        "measure": lambda a: measure_main(a, uvloop.run),
    }
    if args.command in jobs:
        return jobs[args.command](args)
    if args.command == "results" and args.render:
        print(render_results(args.out))
        return 0
    return compare_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
