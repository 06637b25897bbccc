"""`python -m sim`: the append-vs-create comparison (`compare`) and parameter sweeps (`sweep`).

Covers: the main job. Scenario: the same seeded agent rollouts in each API mode
(`http`, `http_prev`, `ws`, `append`) against one server, live on loopback by
default or in virtual time (`--virtual`); a table of the workloads.md section 6
metrics per mode, and with `--out DIR` a run folder (sim/trace.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec
import uvloop

from sim.experiment import CompareConfig, CompareResult, check, compare
from sim.fidelity import fidelity_main, fidelity_options
from sim.metrics import ModeSummary
from sim.sweep import AXES, SweepConfig, dask_executor, points, run_sweep
from sim.trace import write_run, write_table

__all__ = ["build_parser", "main", "run", "table"]


def _add_config_options(p: argparse.ArgumentParser) -> None:
    """One option per `CompareConfig` field, typed and documented from its JSON schema
    (the config's help text generates the CLI, as in vidur)."""
    schema: Any = msgspec.json.schema(CompareConfig)
    types = {"integer": int, "number": float, "string": str}
    for name, prop in schema["$defs"]["CompareConfig"]["properties"].items():
        flag = "--" + name.replace("_", "-")
        if prop.get("type") == "array":  # comma-separated on the command line
            default = ",".join(prop.get("default", ()))
            p.add_argument(flag, default=default, help=prop.get("description", "comma-separated subset of " + default))
            continue
        if prop.get("type") == "boolean":
            p.add_argument(flag, action="store_true", help=prop.get("description", ""))
            continue
        kinds = [prop.get("type")] + [alt.get("type") for alt in prop.get("anyOf", [])]
        kind = next((types[k] for k in kinds if k in types), str)
        p.add_argument(flag, type=kind, default=prop.get("default"), help=prop.get("description", ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compare",
        help="run the same rollouts in each mode and print a table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_config_options(c)
    c.add_argument("--virtual", action="store_true", help="in process on a virtual clock (no sockets, no waiting)")
    c.add_argument(
        "--free-cpu", action="store_true", help="with --virtual: CPU work costs no virtual time (exactly reproducible)"
    )
    c.add_argument("--out", metavar="DIR", help="write a run folder (config, summary, per-turn tables, plots)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")

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
    w.add_argument("--out", metavar="FILE", default="sweep.csv", help="the table: .csv or .parquet")
    w.add_argument("--quiet", action="store_true", help="no progress bar")

    f = sub.add_parser(
        "fidelity",
        help="run one config live and in virtual time and compare them (sim/fidelity.py)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fidelity_options(f, _add_config_options)
    return p


def sweep_from(args: argparse.Namespace) -> SweepConfig:
    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x.strip()]

    return msgspec.convert(
        {
            "tps": floats(args.tps),
            "tool_calls": [int(x) for x in floats(args.tool_calls)],
            "tool_time_s": floats(args.tool_time_s),
            "rtt_s": floats(args.rtt_s),
            "profile": [x.strip() for x in args.profile.split(",") if x.strip()],
            "modes": [x.strip() for x in args.modes.split(",") if x.strip()],
            "base": msgspec.to_builtins(CompareConfig(rollouts=args.rollouts, seed=args.seed)),
        },
        SweepConfig,
    )


def sweep_main(args: argparse.Namespace) -> int:
    sweep = sweep_from(args)
    progress = None if args.quiet else _progress_bar("points")
    if args.dask:
        with dask_executor(args.dask, workers=args.workers) as executor:
            rows = run_sweep(sweep, executor, on_point=progress)
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            rows = run_sweep(sweep, pool, on_point=progress)
    path = write_table(rows, args.out)
    print(f"{len(rows)} rows ({len(points(sweep))} points x {len(sweep.modes)} modes) written to {path}")
    return 0


def _progress_bar(unit: str) -> Callable[[int, int], None]:
    def show(done: int, total: int, width: int = 30) -> None:
        filled = width * done // total
        end = "\n" if done == total else ""
        print(
            f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {unit}", end=end, file=sys.stderr, flush=True
        )

    return show


def config_from(args: argparse.Namespace) -> CompareConfig:
    values = {f: getattr(args, f) for f in CompareConfig.__struct_fields__ if getattr(args, f, None) is not None}
    for f in ("modes", "disable"):
        values[f] = tuple(x.strip() for x in values[f].split(",") if x.strip())
    return msgspec.convert(values, CompareConfig)


def run(config: CompareConfig, *, virtual: bool, free_cpu: bool = False, progress: bool = False) -> CompareResult:
    """`sim.experiment.compare`, live runs on uvloop."""
    return compare(config, virtual=virtual, free_cpu=free_cpu, progress=progress, loop_factory=uvloop.new_event_loop)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def table(summary: list[ModeSummary]) -> str:
    head = (
        f"{'mode':<10} {'rollout p50 s':>13} {'p90 s':>7} {'TTFT ms':>8} {'tool→token ms':>14} {'overhead':>9} "
        f"{'bytes/turn':>11} {'rendered/turn':>14} {'conn hit':>9} {'tok hit':>8} {'KV idle tok·s':>14} "
        f"{'time saved vs http':>19}"
    )
    rows = [head]
    for s in summary:
        rows.append(
            f"{s.mode:<10} {s.completion_p50_s:>13.3f} {s.completion_p90_s:>7.3f} {_ms(s.ttft_p50_s):>8} "
            f"{_ms(s.tool_to_token_p50_s):>14} {_pct(s.overhead_share):>9} {s.bytes_per_turn:>11.0f} "
            f"{s.tokens_rendered_per_turn:>14.0f} {_pct(s.connection_cache_hit_rate):>9} {_pct(s.token_hit_rate):>8} "
            f"{s.kv_idle_token_s:>14.0f} {_pct(s.saved_vs_http):>19}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sweep":
        return sweep_main(args)
    if args.command == "fidelity":
        return fidelity_main(args, uvloop.new_event_loop)
    try:
        config = config_from(args)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    try:
        check(config, virtual=args.virtual)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    where = "virtual time" if args.virtual else "live loopback"
    if config.trace is not None:
        shape = f"trace {config.trace}"
    elif config.workload != "custom":
        shape = f"workload {config.workload}"
    else:
        shape = f"{config.tool_calls} tool calls, tool time median {config.tool_time_s:g} s"
    print(
        f"longrun compare: {config.rollouts} rollouts per mode, {shape}, {config.tps:g} tokens/s, "
        f"seed {config.seed} ({where}, {config.profile} cost profile)",
        flush=True,
    )
    result = run(config, virtual=args.virtual, free_cpu=args.free_cpu, progress=not args.quiet)
    print(table(result.summary))
    if args.out:
        path = write_run(result, args.out)
        print(f"run folder: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
