"""The post's curve on a real engine: time saved against `http` as the engine's decode speed grows.

A **point** is one engine comparison's run folder (`python -m sim compare --engine llamacpp
--out DIR`: config.json, records.jsonl, engine.jsonl, pairs.json), all the points the same
rollouts (workload, rollouts, seed, modes, profile, engine) at another decode setting: `forced`
(a token-id grammar), `free` (`--engine-decode length`: the planned length decoded freely) or
`verified:K` (the planned tokens through the prompt path K a pass). Per point, `curve_of` reads:

* **the engine's effective decode rate**: planned tokens over the engine's own decode time
  (engine.jsonl: ``predicted_n`` / ``predicted_ms``; verified, the passes' summed time), the
  curve's x; beside it the **wall rate** the API saw (the tokens after a turn's first over the
  time from its first token to its last) and the first turns' prefill rate (the ceiling verified
  decoding approaches);
* **the measured time saved** per mode against `http`: the comparison's own paired 95 % interval
  and n (pairs.json);
* **the simulator's prediction for the same rollouts**: `validate_records` on the folder (fitted
  on training rollouts' `http` and `ws` turns, every mode predicted), and whether it falls inside
  the measured interval;
* **the drift check** (`sim.harness.drift.drift_report` on engine.jsonl): whether the engine's speed
  held across modes and over the run.

The result is a value (`Curve`), its rows (`CurveRow`, what curve.csv holds), a text table, a
Markdown table for docs/validation.md, and a figure drawn by `draw_curve` on an axis (the notebook
calls it on curve.csv's rows). `python -m sim curve DIR ... --out OUT` redraws from folders;
`--points forced,free,verified:16,...` first runs each point live into OUT/<point>/.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from prototype.options import add_struct_options, leaves, option_error, struct_from_args
from sim.analysis.records import read_records
from sim.analysis.stats import Estimate
from sim.engine.model import EngineTurn
from sim.harness.console import add_save_options, start_folder
from sim.harness.drift import Drift, drift_report
from sim.harness.experiment import CompareConfig, check, config_of
from sim.harness.validate import BASE, validate_records

__all__ = [
    "CURVE_DEFAULTS",
    "Curve",
    "CurveError",
    "CurvePoint",
    "CurveRow",
    "PointSpec",
    "curve_main",
    "curve_markdown",
    "curve_of",
    "curve_options",
    "curve_text",
    "draw_curve",
    "load_point",
    "parse_points",
    "read_curve_csv",
    "replace_block",
]

MARKERS: Final = ("<!-- curve:start -->", "<!-- curve:end -->")
# The engine settings a curve's points may differ in: the decode setting, where the engine was.
VARIED: Final = frozenset({"engine_decode", "engine_verify_k", "engine_url", "engine_startup_timeout_s"})
DECODE_NAMES: Final = {"forced": "forced", "length": "free", "verified": "verified"}

# `python -m sim curve --points`' comparison when no option says otherwise: every design the
# post's curve shows, on the README's profile, a workload a 2-core CPU engine serves in minutes.
CURVE_DEFAULTS: Final = CompareConfig.of(
    engine_kind="llamacpp",
    modes=("http", "ws", "append", "agents"),
    profile="hosted",
    rollouts=5,
    tool_calls=4,
    tool_output_tokens=60,
    system_prompt_tokens=300,
    tool_time_s=0.3,
)


class CurveError(ValueError):
    """A folder that is no engine comparison, or points that are not the same rollouts."""


class PointSpec(msgspec.Struct, frozen=True):
    """One point to run: an engine decode setting (`verify_k` for `verified` only)."""

    decode: str  # EngineConfig.engine_decode: forced, length, verified
    verify_k: int | None = None

    @property
    def name(self) -> str:
        """The point's folder name: forced, free, verified-16."""
        return DECODE_NAMES[self.decode] + ("" if self.verify_k is None else f"-{self.verify_k}")

    def config(self, base: CompareConfig) -> CompareConfig:
        if self.verify_k is None:
            return base.updated(engine_decode=self.decode)
        return base.updated(engine_decode=self.decode, engine_verify_k=self.verify_k)


def parse_points(text: str) -> list[PointSpec]:
    """`forced,free,verified:8,verified:32` as point specs; a bad item raises ValueError."""
    out: list[PointSpec] = []
    for item in (x.strip() for x in text.split(",")):
        name, _, k = item.partition(":")
        if name in ("forced", "free") and not k:
            out.append(PointSpec("length" if name == "free" else "forced"))
        elif name == "verified" and k.isdigit() and 1 <= int(k) <= 512:
            out.append(PointSpec("verified", int(k)))
        else:
            raise ValueError(f"--points: {item!r} is not forced, free or verified:K (K from 1 to 512)")
    if len({p.name for p in out}) != len(out):
        raise ValueError("--points: a point is named twice")
    return out


class ModeSaved(msgspec.Struct, frozen=True):
    """One mode at one point: time saved against `http`, measured and predicted."""

    mode: str
    measured: Estimate  # paired by rollout, the comparison's interval (pairs.json)
    predicted: float  # the simulator's on the fitted profile; NaN: no usable fit
    inside: bool  # the prediction within the measured interval


class CurvePoint(msgspec.Struct, frozen=True):
    """One point: its decode setting, the engine's rates, each mode's time saved, the drift check."""

    folder: str
    decode: str
    verify_k: int | None
    engine_decode_tok_s: float
    wall_decode_tok_s: float
    prefill_tok_s: float
    saved: list[ModeSaved]
    drift: Drift
    failed: int  # rollouts that ended in an error (in no figure)
    problems: list[str]  # why there is no prediction, if there is none

    @property
    def label(self) -> str:
        return DECODE_NAMES.get(self.decode, self.decode) + ("" if self.verify_k is None else f" k={self.verify_k}")


class CurveRow(msgspec.Struct, frozen=True):
    """One (point, mode): a line of curve.csv."""

    point: str
    decode: str
    verify_k: int | None
    engine_decode_tok_s: float
    wall_decode_tok_s: float
    prefill_tok_s: float
    mode: str
    saved: float
    saved_ci_low: float
    saved_ci_high: float
    n: int
    predicted: float
    inside: bool
    drift_within_bound: bool
    drift_decode_across_modes: float
    drift_decode_over_run: float
    failed: int
    folder: str


class Curve(msgspec.Struct, frozen=True):
    """The points, slowest decode first, and the workload they share."""

    points: list[CurvePoint]
    workload: str

    def rows(self) -> list[CurveRow]:
        return [
            CurveRow(
                point=p.label,
                decode=p.decode,
                verify_k=p.verify_k,
                engine_decode_tok_s=p.engine_decode_tok_s,
                wall_decode_tok_s=p.wall_decode_tok_s,
                prefill_tok_s=p.prefill_tok_s,
                mode=s.mode,
                saved=s.measured.value,
                saved_ci_low=s.measured.ci_low,
                saved_ci_high=s.measured.ci_high,
                n=s.measured.n,
                predicted=s.predicted,
                inside=s.inside,
                drift_within_bound=p.drift.within_bound,
                drift_decode_across_modes=p.drift.decode_across_modes,
                drift_decode_over_run=p.drift.decode_over_run,
                failed=p.failed,
                folder=p.folder,
            )
            for p in self.points
            for s in p.saved
        ]


# -- reading the points -----------------------------------------------------------------------------


class _Run(msgspec.Struct, frozen=True):
    folder: Path
    config: CompareConfig
    failed: int
    turns: list[EngineTurn]
    pairs: list[dict[str, Any]]


def load_point(folder: str | Path) -> _Run:
    """A run folder's config, engine turns and pairs; CurveError when it is no engine comparison."""
    from sim.harness.trace import read_engine_turns  # plotting's imports only when a folder is read

    path = Path(folder)
    try:
        meta = json.loads((path / "config.json").read_text())  # NaN: a bound not known
        config = config_of(meta["config"])
        if config.engine.engine_kind == "none":
            raise CurveError(f"{path} is not an engine run (its comparison ran on the simulator)")
        turns = read_engine_turns(path)
        pairs = json.loads((path / "pairs.json").read_text())
        if not (path / "records.jsonl").is_file():
            raise FileNotFoundError(path / "records.jsonl")
    except FileNotFoundError as exc:
        raise CurveError(f"{path} is not an engine run folder (no {Path(exc.filename).name})") from None
    except (OSError, KeyError, TypeError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CurveError(f"{path} is not an engine run folder ({exc})") from None
    if not turns:
        raise CurveError(f"{path} is not an engine run folder (its engine.jsonl is empty)")
    return _Run(path, config, len(meta.get("failed", [])), turns, pairs)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value}


def same_rollouts(configs: Sequence[CompareConfig], names: Sequence[str]) -> None:
    """CurveError naming the fields two points differ in beyond their decode setting."""
    flat = [_flat(msgspec.to_builtins(c)) for c in configs]
    for name, other in zip(names[1:], flat[1:], strict=True):
        differ = sorted(
            k.rsplit(".", 1)[-1]
            for k in flat[0].keys() | other.keys()
            if k.rsplit(".", 1)[-1] not in VARIED and flat[0].get(k) != other.get(k)
        )
        if differ:
            raise CurveError(
                f"{name} and {names[0]} are not the same rollouts: they differ in {', '.join(differ)} "
                "(a curve's points differ only in the engine's decode setting)"
            )


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


def _point(run: _Run, *, train_share: float) -> CurvePoint:
    turns, config = run.turns, run.config
    timed = [t for t in turns if t.predicted_ms > 0]
    streamed = [t for t in turns if t.predicted_n > 1 and t.total_s > t.ttft_s]
    firsts = [t for t in turns if t.turn_index == 0 and t.prompt_ms > 0]
    problems: list[str] = []
    predicted: dict[str, float] = {}
    try:
        v = validate_records(read_records([run.folder]), config, train_share=train_share, seed=config.seed)
        problems, predicted = v.problems, v.predicted_saved
    except ValueError as exc:  # modes or rollouts the validation cannot score: no prediction
        problems = [str(exc)]
    saved = []
    for pair in run.pairs:
        if pair["base"] != BASE:
            continue
        e = Estimate(pair["saved"], pair["saved_ci_low"], pair["saved_ci_high"], pair["n"])
        p = predicted.get(pair["other"], math.nan)
        saved.append(ModeSaved(pair["other"], e, p, bool(e.ci_low <= p <= e.ci_high)))
    return CurvePoint(
        folder=run.folder.as_posix(),
        decode=config.engine.engine_decode,
        verify_k=config.engine.engine_verify_k if config.engine.engine_decode == "verified" else None,
        engine_decode_tok_s=_rate(sum(t.predicted_n for t in timed), sum(t.predicted_ms for t in timed) / 1e3),
        wall_decode_tok_s=_rate(sum(t.predicted_n - 1 for t in streamed), sum(t.total_s - t.ttft_s for t in streamed)),
        prefill_tok_s=_rate(sum(t.prompt_n for t in firsts), sum(t.prompt_ms for t in firsts) / 1e3),
        saved=saved,
        drift=drift_report(turns, config.modes),
        failed=run.failed,
        problems=list(problems),
    )


def _workload(c: CompareConfig) -> str:
    shape = f"workload {c.workload}" if c.workload != "custom" else f"{c.tool_calls} tool calls"
    return f"{shape}, {c.rollouts} rollouts, {c.server.profile_name} profile, seed {c.seed}"


def curve_of(folders: Sequence[str | Path], *, train_share: float = 0.5) -> Curve:
    """The curve of the point folders (module docstring), slowest effective decode first."""
    if not folders:
        raise CurveError("no point folders given")
    runs = [load_point(f) for f in folders]
    same_rollouts([r.config for r in runs], [r.folder.as_posix() for r in runs])
    points = sorted((_point(r, train_share=train_share) for r in runs), key=lambda p: p.engine_decode_tok_s)
    return Curve(points, _workload(runs[0].config))


# -- showing it ---------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}"


def _measured(r: CurveRow) -> str:
    if math.isnan(r.saved_ci_low) or math.isnan(r.saved_ci_high):
        return f"{_pct(r.saved)} % (no interval)"
    return f"{_pct(r.saved)} % ({_pct(r.saved_ci_low)} to {_pct(r.saved_ci_high)})"


def _verdict(r: CurveRow) -> str:
    if math.isnan(r.predicted):
        return "no prediction"
    return "inside" if r.inside else "outside"


def _drift(r: CurveRow) -> str:
    spread = max((x for x in (r.drift_decode_across_modes, r.drift_decode_over_run) if not math.isnan(x)), default=0.0)
    return f"held ({100 * spread:.0f} %)" if r.drift_within_bound else f"DRIFT ({100 * spread:.0f} %)"


def _cells(r: CurveRow) -> list[str]:
    return [
        r.point,
        f"{r.engine_decode_tok_s:.0f}",
        f"{r.wall_decode_tok_s:.0f}",
        f"{r.prefill_tok_s:.0f}",
        r.mode,
        _measured(r),
        str(r.n),
        "n/a" if math.isnan(r.predicted) else f"{_pct(r.predicted)} %",
        _verdict(r),
        _drift(r),
    ]


HEADER: Final = [
    "point",
    "decode tok/s (engine)",
    "decode tok/s (wall)",
    "prefill tok/s",
    "mode",
    "time saved vs http, measured (95 % CI)",
    "n",
    "simulator",
    "prediction",
    "engine speed",
]


def curve_text(curve: Curve) -> str:
    """The curve as a terminal table, the points' problems under it."""
    rows = [HEADER, *(_cells(r) for r in curve.rows())]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [f"the curve on the engine: {curve.workload}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for p in curve.points:
        if p.problems:
            lines.append(f"{p.label}: no prediction: {'; '.join(p.problems)}")
        if p.failed:
            lines.append(f"{p.label}: {p.failed} rollouts failed (in no figure; the folder's config.json)")
    return "\n".join(lines)


def curve_markdown(rows: Sequence[CurveRow]) -> str:
    """The curve's rows as the Markdown table docs/validation.md shows between its markers."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def replace_block(page: str, rows: Sequence[CurveRow]) -> str:
    """`page` with the text between its curve markers replaced by `curve_markdown(rows)`."""
    start, end = MARKERS
    head, found, rest = page.partition(start + "\n")
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"the page needs the lines {start} and {end}")
    return f"{head}{start}\n{curve_markdown(rows)}{end}{tail}"


def read_curve_csv(path: str | Path) -> list[CurveRow]:
    """curve.csv's rows back as `CurveRow`s."""
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["verify_k"] = row["verify_k"] or None  # the CSV's empty cell
    return msgspec.convert(rows, list[CurveRow], strict=False)


def draw_curve(ax: Any, rows: Sequence[CurveRow], *, title: str = "") -> None:
    """Time saved against the engine's effective decode rate on `ax` (a matplotlib axis): per mode
    a colour, measured as filled points with their 95 % interval, the simulator's prediction as
    open markers joined by a line; a point whose engine speed drifted is marked."""
    modes = list(dict.fromkeys(r.mode for r in rows))
    for i, mode in enumerate(modes):
        colour = f"C{i}"  # the default colour cycle, one colour a mode
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.engine_decode_tok_s)
        shift = 1 + 0.025 * (i - (len(modes) - 1) / 2)  # side by side on the log axis
        x = [r.engine_decode_tok_s * shift for r in mine]
        y = [100 * r.saved for r in mine]
        below = [0.0 if math.isnan(r.saved_ci_low) else 100 * (r.saved - r.saved_ci_low) for r in mine]
        above = [0.0 if math.isnan(r.saved_ci_high) else 100 * (r.saved_ci_high - r.saved) for r in mine]
        ax.errorbar(x, y, yerr=[below, above], fmt="o", capsize=3, color=colour, label=f"{mode}, engine")
        known = [(xi, 100 * r.predicted) for xi, r in zip(x, mine, strict=True) if not math.isnan(r.predicted)]
        if known:
            ax.plot(
                [k[0] for k in known], [k[1] for k in known], marker="o", markerfacecolor="none", linestyle="--",
                color=colour, label=f"{mode}, simulator",
            )  # fmt: skip
        for xi, yi, r in zip(x, y, mine, strict=True):
            if not r.drift_within_bound:
                ax.annotate("drift", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ticks = {r.engine_decode_tok_s: r.point for r in rows if math.isfinite(r.engine_decode_tok_s)}
    if ticks:  # each point's rate and setting under it; a decade at least, so one point is not zoomed on
        low, high = min(ticks), max(ticks)
        margin = max(1.3, math.sqrt(10 * low / high))
        ax.set_xlim(low / margin, high * margin)
        # Each point's rate and decode setting, slanted: neighbours on a log axis can sit close.
        ax.set_xticks(list(ticks), [f"{x:.0f} ({name})" for x, name in ticks.items()], fontsize=7, rotation=30,
                      ha="right")  # fmt: skip
        ax.minorticks_off()
    ax.set_xlabel("engine's effective decode rate (tokens/s, engine.jsonl)")
    ax.set_ylabel("time saved vs http (%)")
    n = min((r.n for r in rows), default=0)
    shown = f"engine measured (95 % CI, n={n} rollouts), simulator predicted"
    ax.set_title(f"{title}\n{shown}" if title else shown, fontsize=9)
    ax.legend(fontsize=7, ncol=2)


# -- the command --------------------------------------------------------------------------------------


def write_curve(curve: Curve, folder: Path) -> None:
    """curve.csv, curve.txt, curve.json and curve.png in `folder` (through the run-folder writer)."""
    from sim.harness.trace import write_figure, write_json, write_table, write_text

    rows = curve.rows()
    write_table([msgspec.to_builtins(r) for r in rows], folder / "curve.csv")
    write_text(curve_text(curve), folder / "curve.txt")
    write_json(curve, folder / "curve.json")
    write_figure(lambda ax: draw_curve(ax, rows, title=curve.workload), folder / "curve.png")


def curve_options(sub: Any) -> None:
    """`python -m sim curve`'s parser: point folders, or `--points` and the comparison's options."""
    p = sub.add_parser(
        "curve",
        help="time saved against http as the engine's decode speed grows: each point an engine comparison's run "
        "folder, measured with its interval beside the simulator's prediction (docs/validation.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("folders", nargs="*", metavar="DIR", help="the points' engine run folders (no new run)")
    p.add_argument(
        "--points",
        metavar="LIST",
        help="run these points live first, each into OUT/<point>/: a comma list of forced, free, verified:K "
        "(the comparison's options below apply to every point; their defaults: the curve's workload, "
        "sim/harness/curve.py's CURVE_DEFAULTS)",
    )
    p.add_argument("--train-share", type=float, default=0.5, help="share of rollouts the simulator's fit sees")
    p.add_argument("--doc", metavar="PAGE", help="also write the table between the page's curve markers")
    add_save_options(p, "curve.csv, curve.txt, curve.json, curve.png; with --points the points' folders", "curve")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_struct_options(p, CompareConfig)


def _point_configs(args: argparse.Namespace) -> list[tuple[PointSpec, CompareConfig]]:
    """Every point's comparison, checked and its slots sized, before any run folder or engine."""
    from sim.harness.sizing import fit_engine

    for flag in ("engine_decode", "engine_verify_k"):
        if hasattr(args, flag):
            raise SystemExit(f"invalid option: --{flag.replace('_', '-')}: --points sets it for each point")
    try:
        specs = parse_points(args.points)
        base: CompareConfig = struct_from_args(args, CompareConfig, base=CURVE_DEFAULTS)
        if base.engine.engine_kind == "none":
            raise ValueError("--points runs on a real engine (--engine llamacpp or openai)")
        configs = []
        for spec in specs:
            check(spec.config(base), virtual=False)
            configs.append((spec, fit_engine(spec.config(base))))
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid option: {option_error(exc, CompareConfig)}") from None
    except (ValueError, OSError) as exc:  # EngineTooSmall is a ValueError: one line, before any engine starts
        raise SystemExit(f"invalid option: {exc}") from None
    return configs


def _run_points(
    points: Sequence[tuple[PointSpec, CompareConfig]], out: Path, run: Callable[[CompareConfig], Any]
) -> list[Path]:
    """Each point's comparison run live into OUT/<point>/ (a comparison's run folder and table.txt)."""
    from sim.harness.console import table
    from sim.harness.drift import drift_text
    from sim.harness.trace import write_run, write_text

    folders = []
    for spec, config in points:
        print(f"point {spec.name}: {config.rollouts} rollouts per mode live on the engine", file=sys.stderr, flush=True)
        result = run(config)
        folder = write_run(result, out / spec.name)
        drift = "" if result.drift is None else "\n" + drift_text(result.drift)
        write_text(table(result.summary, result.failed) + drift, folder / "table.txt")
        folders.append(folder)
    return folders


def curve_main(args: argparse.Namespace, run: Callable[[CompareConfig, bool], Any]) -> int:
    """`python -m sim curve`: `run(config, progress)` runs one live comparison (the entry point's loop)."""
    if args.points and args.folders:
        raise SystemExit("invalid option: give the points' folders or --points to run them, not both")
    if not args.points and not args.folders:
        raise SystemExit("invalid option: give the points' engine run folders, or --points to run them")
    if args.points and args.no_save:
        raise SystemExit("invalid option: --no-save: --points writes each point's run folder")
    if not 0 < args.train_share < 1:
        raise SystemExit("invalid option: --train-share: must be between 0 and 1")
    if args.folders and any(hasattr(args, f.name) for _, f in leaves(CompareConfig)):  # only a run reads them
        raise SystemExit("invalid option: the comparison's options need --points (the folders' configs say the rest)")
    folders: Sequence[str | Path] = args.folders
    try:
        if args.doc:  # its markers checked before anything runs
            page = Path(args.doc)
            replace_block(page.read_text(encoding="utf-8"), [])
        if folders:  # refused before the run folder is made
            same_rollouts([load_point(f).config for f in folders], [Path(f).as_posix() for f in folders])
        points = _point_configs(args) if args.points else []
        out = start_folder(args, "curve")
        if points:
            assert out is not None
            folders = _run_points(points, out, lambda c: run(c, not args.quiet))
        curve = curve_of(folders, train_share=args.train_share)
        if args.doc:
            new = replace_block(page.read_text(encoding="utf-8"), curve.rows())
    except (CurveError, OSError) as exc:
        raise SystemExit(str(exc)) from None
    except ValueError as exc:  # the page without the markers
        raise SystemExit(f"--doc: {exc}") from None
    print(curve_text(curve))
    if out is not None:
        write_curve(curve, out)
        print(f"run folder: {out}", file=sys.stderr)
    if args.doc:
        from sim.harness.trace import write_text

        write_text(new.removesuffix("\n"), page)
    return 0
