"""Every design's time saved on a fitted profile, with an interval that carries what the fit
left open (docs/calibration.md, "Predicting every design").

A capture identifies some of the profile's fields alone and some only as a sum (what every
captured turn pays once: the round trip, the classifier call, the inference hop and the model's
fixed latency); a design that pays part of such a sum apart from the rest (a held response's
resume skips the hop) saves an amount that depends on the split the capture cannot see. So each
design's saving is computed by the virtual comparison (free CPU, exactly reproducible) at:

* the fitted values, each sum split equally (the point);
* every vertex of each such sum (all of it on one field), at the fitted values: the range the
  unidentified split leaves;
* refits on resampled rollouts (`Calibration.refits`), at the equal split: the fit's own
  uncertainty.

The interval is the vertices' range widened by the refits' spread around the point. A design
whose path pays a field the capture did not identify at all is not predicted, and says which.

When not to trust it (`trust_notes`): the interval carries what the fit left open on the
capture's own turns, not an extrapolation. So the predicted workload's contexts (prompt tokens),
model turns (output tokens) and rollout lengths are compared with the capture's, and each that
reaches beyond the capture's range by more than `RANGE_MARGIN` is a warning that says the
interval is not widened for it; and a TTFT that leaves the fit at the capture's longest contexts
(the quarter of its turns with the longest prompts, their mean log(measured / fitted) against the
other turns', beyond `TREND_Z` standard errors) is stated as a misfit: the cost grows with context
unlike the stage-cost model's linear terms (a convex cost leaves a U of residuals a linear fit
cannot remove, which a rank correlation over all turns barely sees), so a prediction on longer
contexts carries an error the interval does not hold.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from prototype.pipeline import DESIGNS, MODEL_COSTS, CostProfile, profile_gaps
from sim.analysis.calibrate import SUM, Calibration, fit, fit_file, predict, report
from sim.analysis.records import TurnRecord, read_records, records_from_rollouts
from sim.harness.experiment import CompareConfig, compare
from sim.rollout.replay import load_trace
from sim.rollout.result import ALL_MODES, RolloutResult

__all__ = [
    "DesignPrediction",
    "outside_capture",
    "predict_designs",
    "prediction_table",
    "profile_settings",
    "time_saved",
    "trend_misfit",
    "trust_notes",
]

BASE: Final = "http"
MODEL_FIELDS: Final = frozenset(r.field for r in MODEL_COSTS)
RANGE_MARGIN: Final = 0.10  # beyond the capture's largest (or below its smallest) by more than this share
TREND_Z: Final = 3.0


@dataclass(frozen=True, slots=True)
class DesignPrediction:
    mode: str
    saved: float  # mean over rollouts of 1 − t(mode)/t(http), at the point
    low: float
    high: float
    split_low: float  # the range over the unidentified splits, at the fitted values
    split_high: float
    refit_low: float  # the refits' range, at the equal split
    refit_high: float
    why_wide: str  # the sums whose split moves this design's saving


def time_saved(rollouts: Sequence[RolloutResult], base: str = BASE) -> dict[str, float]:
    """Per mode, the mean over rollouts of 1 − t(mode)/t(base), paired by rollout."""
    t: dict[tuple[str, int], float] = {(r.mode, r.index): r.completion_s for r in rollouts}
    modes = dict.fromkeys(r.mode for r in rollouts)
    out: dict[str, float] = {}
    for m in modes:
        pairs = [1 - t[(m, i)] / t[(base, i)] for (mode, i) in t if mode == m and (base, i) in t]
        out[m] = float(np.mean(pairs)) if pairs else math.nan
    return out


def profile_settings(values: dict[str, float], split: dict[str, str]) -> dict[str, object]:
    """Compare's leaves for identified `values` (a sum's whole value on `split[sum]`, or shared
    equally when the sum is not in `split`)."""
    fields: dict[str, float] = {}
    for name, v in values.items():
        members = name.split(SUM)
        if name in split:
            fields.update({f: (v if f == split[name] else 0.0) for f in members})
        else:
            fields.update({f: v / len(members) for f in members})
    cost = {k: v for k, v in fields.items() if k not in MODEL_FIELDS}
    leaves: dict[str, object] = {"profile": CostProfile(name="fitted", **cost)}
    leaves.update({k: v for k, v in fields.items() if k in MODEL_FIELDS})
    return leaves


def _saved(config: CompareConfig, values: dict[str, float], split: dict[str, str]) -> dict[str, float]:
    result = compare(config.updated(**profile_settings(values, split)), virtual=True, free_cpu=True)
    return time_saved(result.rollouts)


def predict_designs(
    c: Calibration, config: CompareConfig, *, modes: Sequence[str] = ALL_MODES, refits: int = 8
) -> tuple[list[DesignPrediction], dict[str, str]]:
    """Each design's time saved vs http on the fit (module doc), and the designs not predicted
    with why. `config` is the workload to compare on (its profile and model rates are replaced)."""
    if c.problems:
        raise ValueError("no usable profile to predict with: " + "; ".join(c.problems))
    skipped: dict[str, str] = {}
    chosen = [BASE]
    for m in modes:
        if m == BASE:
            continue
        if m not in DESIGNS:
            skipped[m] = "no path in the stage-cost table (prototype/pipeline.py DESIGNS)"
            continue
        gaps = profile_gaps(list(c.unidentified), [], [m], compaction=config.compact_threshold > 0)
        if gaps:
            skipped[m] = "; ".join(gaps)
        else:
            chosen.append(m)
    if profile_gaps(list(c.unidentified), [], [BASE]):
        raise ValueError(f"cannot predict: {BASE}, the base, pays a field the fit did not identify")
    config = config.updated(modes=tuple(chosen))
    values = {k: p.value for k, p in c.profile_params.items()}
    open_sums = [SUM.join(g) for g in c.sums if profile_gaps([], [g], chosen)]
    point = _saved(config, values, {})
    vertices = (
        [
            _saved(config, values, dict(zip(open_sums, choice, strict=True)))
            for choice in itertools.product(*(name.split(SUM) for name in open_sums))
        ]
        if open_sums
        else [point]
    )
    refitted = [_saved(config, v, {}) for v in c.refits[:refits] if set(v) == set(values)]
    out: list[DesignPrediction] = []
    for m in chosen[1:]:
        at_split = [v[m] for v in vertices]
        at_refit = [v[m] for v in refitted] or [point[m]]
        lo_r, hi_r = min(at_refit), max(at_refit)
        low = min(at_split) + min(0.0, lo_r - point[m])
        high = max(at_split) + max(0.0, hi_r - point[m])
        moving = [s for s in open_sums if profile_gaps([], [s.split(SUM)], [BASE, m])]
        out.append(
            DesignPrediction(m, point[m], low, high, min(at_split), max(at_split), lo_r, hi_r, ", ".join(moving))
        )
    return out, skipped


def prediction_table(
    predictions: Sequence[DesignPrediction], skipped: dict[str, str], *, refits: int, notes: Sequence[str] = ()
) -> str:
    """The text `python -m sim calibrate --predict` prints; `notes` (`trust_notes`) after it."""
    lines = [
        f"predicted time saved vs {BASE} (virtual comparison on the fitted profile; interval: the unidentified "
        f"splits' range widened by {refits} refits' spread)",
        f"{'mode':<10} {'saved':>8} {'interval':>17} {'split range':>17} {'refit range':>17}  wide because",
    ]

    def pct(x: float) -> str:
        return f"{100 * x:.1f} %"

    for p in predictions:
        lines.append(
            f"{p.mode:<10} {pct(p.saved):>8} {pct(p.low) + '–' + pct(p.high):>17} "
            f"{pct(p.split_low) + '–' + pct(p.split_high):>17} {pct(p.refit_low) + '–' + pct(p.refit_high):>17}  "
            + (f"only the sum {p.why_wide} is identified" if p.why_wide else "-")
        )
    for m, why in skipped.items():
        lines.append(f"{m:<10} not predicted: {why}")
    return "\n".join([*lines, *notes])


def _sizes(records: Sequence[TurnRecord]) -> dict[str, list[float]]:
    turns: dict[tuple[str, str], int] = {}  # a comparison's rollout has a copy in every mode
    for r in records:
        turns[(r.mode, r.rollout)] = turns.get((r.mode, r.rollout), 0) + 1
    return {
        "context (prompt tokens a turn)": [float(r.prompt_tokens) for r in records if r.prompt_tokens is not None],
        "model turn (output tokens)": [float(r.output_tokens) for r in records if r.output_tokens is not None],
        "rollout length (turns)": [float(n) for n in turns.values()],
    }


def outside_capture(captured: Sequence[TurnRecord], predicted: Sequence[TurnRecord]) -> list[str]:
    """A warning for each size of the predicted workload that leaves the capture's range."""
    out = []
    have, want = _sizes(captured), _sizes(predicted)
    for name, xs in want.items():
        ys = have[name]
        if not xs or not ys:
            continue
        lo, hi = min(ys), max(ys)
        beyond = [
            f"up to {max(xs):,.0f}" if max(xs) > hi * (1 + RANGE_MARGIN) else "",
            f"down to {min(xs):,.0f}" if min(xs) < lo / (1 + RANGE_MARGIN) else "",
        ]
        if any(beyond):
            reach = " and ".join(b for b in beyond if b)
            out.append(
                f"warning: the predicted workload's {name} goes {reach}, outside the capture's "
                f"{lo:,.0f}–{hi:,.0f}: the fit is extrapolated there and the intervals are not widened for it"
            )
    return out


def trend_misfit(c: Calibration, captured: Sequence[TurnRecord]) -> str | None:
    """The stated misfit when the capture's TTFT leaves the fit at its longest contexts: the mean
    log(measured / fitted) of the quarter of turns with the longest prompts against the other
    turns', a z-score (on the other turns' spread) beyond `TREND_Z` either way (module doc)."""
    turns = [r for r in captured if r.ttft_s and r.prompt_tokens is not None]
    if len(turns) < 8:
        return None
    fitted = predict(c, turns, first_token=True)
    ok = fitted > 0
    residual = np.log(np.asarray([r.ttft_s or 0.0 for r in turns])[ok] / fitted[ok])
    prompts = np.asarray([r.prompt_tokens or 0 for r in turns], dtype=float)[ok]
    order = np.argsort(prompts, kind="stable")
    top, rest = residual[order[-max(2, len(order) // 4) :]], residual[order[: -max(2, len(order) // 4)]]
    if len(rest) < 2:
        return None
    # The other turns' spread is the noise: the top quarter's own spread grows with the misfit.
    se = float(np.std(rest, ddof=1)) * math.sqrt(1 / len(top) + 1 / len(rest))
    gap = float(np.mean(top) - np.mean(rest))
    if se == 0 or abs(gap / se) < TREND_Z:
        return None
    side = "above" if gap > 0 else "below"
    return (
        f"misfit: at the capture's longest contexts (the quarter from {prompts[order[-len(top)]]:,.0f} prompt tokens) "
        f"the measured TTFT is {100 * math.expm1(abs(gap)):.0f} % {side} the fit relative to the other turns "
        f"(z = {gap / se:+.1f}; held-out rank correlation with the prompt {c.residual_trend:+.2f}): the cost "
        "does not grow with context as the fitted linear costs do, so a prediction on longer contexts carries "
        "an error the intervals do not hold"
    )


def trust_notes(c: Calibration, captured: Sequence[TurnRecord], config: CompareConfig) -> list[str]:
    """When not to trust a prediction on `config`'s workload (module doc): its sizes against the
    capture's, and a residual trend with context. Runs the workload once on the fit (`http` only)."""
    values = {k: p.value for k, p in c.profile_params.items()}
    run = compare(config.updated(modes=(BASE,), **profile_settings(values, {})), virtual=True, free_cpu=True)
    notes = outside_capture(captured, records_from_rollouts(run.rollouts, source="predicted"))
    misfit = trend_misfit(c, captured)
    return notes + ([misfit] if misfit else [])


def calibrate_options(sub: Any) -> None:
    """`python -m sim calibrate`'s parser."""
    cal = sub.add_parser(
        "calibrate",
        help="fit a cost profile to per-turn records and print its held-out error (docs/calibration.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cal.add_argument("records", nargs="+", metavar="RECORDS", help="records.jsonl files or run folders")
    cal.add_argument("--out", metavar="PROFILE.json", help="write the fit; `--profile PROFILE.json` reads it")
    cal.add_argument("--holdout", type=float, default=0.3, help="share of whole rollouts held out of the fit")
    cal.add_argument("--seed", type=int, default=0, help="seeds the split and the intervals")
    cal.add_argument(
        "--predict",
        action="store_true",
        help="run the virtual comparison on the fit for every design and print each one's time saved vs http",
    )
    cal.add_argument("--trace", metavar="FILE", help="--predict on these rollouts (sim record's workload.jsonl)")
    cal.add_argument("--rollouts", type=int, default=4, help="--predict: rollouts per design (not with --trace)")
    cal.add_argument("--tool-calls", type=int, default=5, help="--predict: tool calls per rollout (not with --trace)")
    cal.add_argument("--refits", type=int, default=8, help="--predict: refits whose spread widens the interval")


def calibrate_main(args: argparse.Namespace) -> int:
    try:
        if args.trace is not None and not args.predict:
            raise ValueError("--trace: the rollouts a prediction runs on; give --predict with it")
        if args.trace is not None:
            load_trace(args.trace)  # refused before the fit, in one line
        records = read_records(args.records)
        calibration = fit(records, holdout=args.holdout, seed=args.seed)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(calibration))
    if args.out:
        try:
            fitted = fit_file(calibration)
        except ValueError as exc:  # no usable profile: none is written
            print(f"error: {exc}", file=sys.stderr)
            return 2
        from sim.harness.trace import write_json  # the run-folder writer is the one module that writes files

        write_json(fitted, args.out)
        rates = fitted.model
        flags = {"tps": "--tps", "prefill_tok_per_s": "--prefill-tok-per-s", "model_latency_s": "--model-latency-s"}
        given = " ".join(f"{flag} {rates[k]:.6g}" for k, flag in flags.items() if k in rates)
        print(f"wrote {args.out}: python -m sim compare --profile {args.out} --free-cpu {given}".rstrip())
        for group in calibration.sums:
            print(f"  {', '.join(group)}: placeholder equal shares of their sum (only the sum is identified)")
        if calibration.unidentified or calibration.sums:
            print("  (compare refuses a run whose modes pay a field the fit left open; --predict gives the range)")
    if args.predict:
        config = CompareConfig.of(rollouts=args.rollouts, tool_calls=args.tool_calls, seed=args.seed, trace=args.trace)
        try:
            predictions, skipped = predict_designs(calibration, config, refits=args.refits)
            notes = trust_notes(calibration, records, config)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n" + prediction_table(predictions, skipped, refits=args.refits, notes=notes))
    return 0
