"""Fit a cost profile to measured turns, and say how well it predicts turns it has not seen.

Theory of operation (docs/calibration.md)
-----------------------------------------
A turn's time is a sum of parts, each linear in what the turn carried: the upload is a round
trip plus bytes over the uplink, rendering and classification cost per token, prefill is a fixed
model latency plus uncached tokens over the prefill rate, decoding is output tokens over the
decode rate, and the fixed waits (auth and routing, the classifier call, the inference hop,
billing, a store load) depend on the API path, i.e. on the mode. Where records carry the
server's stages each stage is one `Part` fitted on its own; the client's share of TTFT and of
the turn's end (time outside every stage) is a part too. Where they do not (a capture of a
server we do not run), TTFT and the rest of the turn are fitted whole on the same features.

Each part is a non-negative least-squares fit (a cost is never negative) weighted by the turn's
measured time, so it minimizes *relative* error: a 20 ms resumed turn counts as much as a 600 ms
cold one. A prediction of TTFT is the sum of the parts before the first token; of the turn's end,
that plus the parts after it.

Held out: whole rollouts (every mode's copy of a seeded rollout together) are kept out of the fit
(`holdout`, seeded), and the error is |predicted / measured − 1| per held-out turn: its median,
with a 95 % interval from resampling the held-out rollouts (a cluster bootstrap: turns of one
rollout are not independent). The fitted parameters' intervals resample the fitted rollouts and
refit. Pure: numpy and scipy's NNLS.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from prototype.pipeline import (
    AFTER_FIRST_TOKEN,
    DESIGNS,
    MODEL_COSTS,
    STAGE_COSTS,
    CostProfile,
    Count,
    Occasion,
    Stage,
    StageCost,
    TurnPath,
    pays,
)
from sim.analysis.records import TurnRecord
from sim.analysis.stats import LEVEL

__all__ = [
    "Calibration",
    "FitFile",
    "Param",
    "check_profile",
    "fit",
    "fit_file",
    "predict",
    "report",
]

Feature = Callable[[TurnRecord], float | None]
Vector = npt.NDArray[np.float64]

PARAM_RESAMPLES: Final = 200  # refits for the parameters' intervals
ERROR_RESAMPLES: Final = 2000  # resamples of held-out rollouts for the error's interval
MODEL_PARTS: Final = ("queue", "prefill")  # the accelerator's part of TTFT; the rest is the API's and the client's
ROWS: Final = (*STAGE_COSTS, *MODEL_COSTS)  # every modeled cost: the API's stages and the model's
BY_FIELD: Final = {r.field: r for r in ROWS}
MODE: Final = "mode"  # an intercept kind: one per mode (a conversation's first turn, and the rest)
ONE: Final = "1"
SUM: Final = "+"  # joins the fields of one column: identified only together
STAGE_ORDER: Final = tuple(s.value for s in Stage)


def _after(stage: str) -> bool:
    return Stage(stage) in AFTER_FIRST_TOKEN


@dataclass(frozen=True)
class Part:
    """One additive part of a turn: the time it takes, and the table's rows it is linear in.

    A stage a record reports is a part of its own (its rows, or an intercept for a stage with
    none: real CPU work); what is left of TTFT and of the rest of the turn once a record's
    reported stages are taken out is a rest part, whose rows are those of the stages the record
    does not report (a capture's whole turn), or the client's own time per mode where every
    stage is reported. A field is one coefficient across parts: a turn that reports the hop
    (timing frames) and one that does not (an HTTP turn of the same capture) fit one hop."""

    name: str
    stage: str | None  # the stage this part is, or None for a rest part
    rows: tuple[StageCost, ...]
    before_first_token: bool


def _parts(known: Sequence[str]) -> tuple[Part, ...]:
    """The parts for records that report (some of) the stages `known` (module doc)."""
    parts: list[Part] = []
    for stage in STAGE_ORDER:
        if stage in known:
            rows = tuple(r for r in ROWS if r.stage == stage and r.occasion is not Occasion.COMPACTION)
            parts.append(Part(stage, stage, rows, not _after(stage)))
    for before in (True, False):
        rows = tuple(r for r in ROWS if _after(r.stage) != before and r.occasion is not Occasion.COMPACTION)
        parts.append(Part("ttft" if before else "after_first_token", None, rows, before))
    return tuple(parts)


class _Turns:
    """The records' paths and counts, as the stage-cost table reads them."""

    def __init__(self, records: Sequence[TurnRecord], context: Sequence[TurnRecord] = ()) -> None:
        self.records = records  # `context`: every record, unfitted (no TTFT) too: their prompts give counts
        last: dict[tuple[str, str], int] = {}
        first: dict[tuple[str, str], TurnRecord] = {}
        by_turn: dict[tuple[str, str, int], TurnRecord] = {}
        for r in (*context, *records):
            key = (r.mode, r.rollout)
            last[key] = max(last.get(key, 0), r.turn)
            by_turn[(r.mode, r.rollout, r.turn)] = r
            if r.turn == 0:
                first[key] = r
        self.paths: list[TurnPath] = []
        self.counts: list[dict[Count, float]] = []
        for r in records:
            if r.mode not in DESIGNS:
                raise ValueError(
                    f"mode {r.mode!r} (rollout {r.rollout}) is not a design the stage-cost table knows: "
                    f"{', '.join(DESIGNS)}"
                )
            path = DESIGNS[r.mode].path(r.turn, last=r.turn == last[(r.mode, r.rollout)])
            self.paths.append(path)
            self.counts.append(
                self._count(r, path, first.get((r.mode, r.rollout)), by_turn.get((r.mode, r.rollout, r.turn - 1)))
            )

    @staticmethod
    def _count(
        r: TurnRecord, path: TurnPath, first: TurnRecord | None, before: TurnRecord | None
    ) -> dict[Count, float]:
        counts: dict[Count, float] = {Count.BYTES: float(r.bytes_in)}
        if r.uncached_tokens is not None:
            counts[Count.TOKENS_PREFILLED] = float(r.uncached_tokens)
            if r.prompt_tokens is not None:
                cached = r.prompt_tokens - r.uncached_tokens
                counts[Count.PREFILL_CONTEXT] = float(r.uncached_tokens) * (cached + r.uncached_tokens / 2)
        if r.output_tokens is not None:
            counts[Count.TOKENS_AFTER_FIRST] = float(max(0, r.output_tokens - 1))
        if r.tokens_rendered is not None and r.tokens_classified is not None:
            # A server's own counts. On a whole-context turn the classifier's state for the
            # instructions is kept like their rendering: what it waits for is what was rendered.
            counts[Count.TOKENS_RENDERED] = float(r.tokens_rendered)
            counts[Count.TOKENS_CLASSIFIED] = float(r.tokens_rendered if path.whole_context else r.tokens_classified)
        elif r.prompt_tokens is not None:
            # A capture: from the prompts. A whole-context turn renders and classifies the history
            # after the conversation's first prompt (the server keeps the instructions'); a later
            # turn on a connection classifies what the prompt grew by and renders that less the
            # previous output (rendered when it was decoded).
            if path.whole_context:
                if first is None or first.prompt_tokens is None:
                    raise ValueError(f"{r.mode} rollout {r.rollout} turn {r.turn}: no turn 0 of its conversation")
                counts[Count.TOKENS_RENDERED] = counts[Count.TOKENS_CLASSIFIED] = float(
                    max(0, r.prompt_tokens - first.prompt_tokens)
                )
            else:
                if before is None or before.prompt_tokens is None:
                    raise ValueError(
                        f"{r.mode} rollout {r.rollout} turn {r.turn}: no turn {r.turn - 1} of its conversation"
                    )
                grew = float(max(0, r.prompt_tokens - before.prompt_tokens))
                counts[Count.TOKENS_CLASSIFIED] = grew
                counts[Count.TOKENS_RENDERED] = max(0.0, grew - (before.output_tokens or 0))
        return counts

    def reports(self, i: int, stage: str) -> bool:
        """Whether record `i` reports `stage` (a longrun server's records report every stage)."""
        r = self.records[i]
        return stage in r.stages_s or Stage.PARSE.value in r.stages_s

    def weights(self, part: Part) -> Vector:
        """Each record's weight in `part`'s equations: 1 / its measured time (a relative error),
        zero where the part does not apply (a stage the record does not report)."""
        out = np.zeros(len(self.records))
        for i, r in enumerate(self.records):
            if part.stage is not None and not self.reports(i, part.stage):
                continue
            scale = r.ttft_s if part.before_first_token and r.ttft_s else r.e2e_s
            out[i] = 1.0 / max(scale, 1e-6)
        return out

    def target(self, part: Part) -> Vector:
        out = np.zeros(len(self.records))
        for i, r in enumerate(self.records):
            if part.stage is not None:
                out[i] = r.stages_s.get(part.stage, 0.0)
                continue
            assert r.ttft_s is not None
            whole = r.ttft_s if part.before_first_token else r.e2e_s - r.ttft_s
            taken = sum(v for k, v in r.stages_s.items() if _after(k) != part.before_first_token)
            out[i] = whole - taken
        return out

    def in_part(self, part: Part, row: StageCost) -> Vector | None:
        """The row's column in `part`'s equations: in a stage's part on the records that report
        the stage, in a rest part on those that do not."""
        v = self.row(row)
        if v is None or row not in part.rows:
            return None if v is None else np.zeros(len(self.records))
        mask = np.asarray([self.reports(i, row.stage) for i in range(len(self.records))], dtype=bool)
        keep = mask if part.stage is not None else ~mask
        return np.asarray(v * keep, dtype=np.float64)

    def stacked(self, parts: Sequence[Part], row: StageCost) -> Vector | None:
        blocks = [self.in_part(p, row) for p in parts]
        if any(b is None for b in blocks):
            return None
        return np.concatenate([b for b in blocks if b is not None])

    def stacked_column(self, parts: Sequence[Part], name: str) -> Vector:
        """A column over every part's equations: a field (or sum of fields) or a part's intercept."""
        n = len(self.records)
        head, _, rest = name.partition(":")
        if rest:  # an intercept of one part
            blocks = []
            for p in parts:
                if p.name != head:
                    blocks.append(np.zeros(n))
                elif rest == ONE:
                    blocks.append(np.ones(n))
                else:
                    kind, mode = rest.split(":", 1)
                    first = kind == "first"
                    blocks.append(np.asarray([r.mode == mode and (r.turn == 0) == first for r in self.records], float))
            return np.concatenate(blocks)
        v = self.stacked(parts, BY_FIELD[name.split(SUM)[0]])
        assert v is not None
        return v

    def row(self, row: StageCost) -> Vector | None:
        """The row's column: its count on the turns whose path pays it; None when a turn lacks the count."""
        out = np.zeros(len(self.records))
        for i, (path, counts) in enumerate(zip(self.paths, self.counts, strict=True)):
            if row in MODEL_COSTS or pays(row, path):
                if row.count is Count.ONCE:
                    out[i] = 1.0
                elif row.count in counts:
                    out[i] = counts[row.count]
                else:
                    return None
        return out


@dataclass(frozen=True)
class Identification:
    """What the records identify: the columns (a field, fields joined by `+` that only their sum
    is identified of, or a part's intercept `part:1`, `part:first:M`, `part:mode:M`), the
    fields they cannot identify, with why, and whether the columns are linearly dependent."""

    columns: list[str]
    unidentified: dict[str, str]  # field -> reason
    collinear: bool


def _intercepts(parts: Sequence[Part], turns: _Turns, modes: Sequence[str]) -> list[str]:
    """Intercept columns: a reported stage the table has no row for (real CPU work), and the
    client's time per mode where every record reports every stage of its side of the turn."""
    out: list[str] = []
    for part in parts:
        if part.stage is not None and not part.rows:
            out.append(f"{part.name}:{ONE}")
        elif part.stage is None and all(
            turns.reports(i, r.stage) for r in part.rows for i in range(len(turns.records))
        ):
            out += [f"{part.name}:first:{m}" for m in modes] + [f"{part.name}:mode:{m}" for m in modes]
    return out


def _identify(parts: Sequence[Part], turns: _Turns, modes: Sequence[str]) -> Identification:
    unidentified: dict[str, str] = {}
    groups: list[tuple[list[str], Vector]] = []
    for row in ROWS:
        if row.occasion is Occasion.COMPACTION:
            unidentified[row.field] = "the records carry no compaction's counts"
            continue
        v = turns.stacked(parts, row)
        if v is None:
            unidentified[row.field] = f"the records lack its count ({row.count})"
        elif not v.any():
            unidentified[row.field] = "no turn in the records pays it"
        else:
            same = next((g for g in groups if np.array_equal(g[1], v)), None)
            if same is None:
                groups.append(([row.field], v))
            else:
                same[0].append(row.field)
    columns = [SUM.join(fields) for fields, _ in groups] + _intercepts(parts, turns, modes)
    x = np.column_stack([turns.stacked_column(parts, c) for c in columns])
    x = x[np.concatenate([turns.weights(p) for p in parts]) > 0]
    x = x / np.maximum(np.abs(x).max(axis=0), 1e-12)
    return Identification(columns, unidentified, bool(np.linalg.matrix_rank(x) < len(columns)))


class Param(msgspec.Struct, frozen=True):
    """A fitted coefficient and its 95 % interval over refits on resampled rollouts."""

    value: float
    ci_low: float
    ci_high: float


class Error(msgspec.Struct, frozen=True):
    """Median |predicted / measured − 1| over held-out turns, with its interval; n turns."""

    median: float
    ci_low: float
    ci_high: float
    n: int
    rollouts: int


@dataclass
class _Design:
    """Every part's equations over every usable record, stacked (part by part, record by
    record), on the shared columns; a fit (or a refit on resampled rollouts) takes rows of them."""

    parts: tuple[Part, ...]
    columns: list[str]
    n: int  # records
    x: Vector
    y: Vector
    w: Vector

    def rows(self, records: npt.NDArray[np.intp], parts: Sequence[int] | None = None) -> npt.NDArray[np.intp]:
        blocks = range(len(self.parts)) if parts is None else parts
        return np.concatenate([b * self.n + records for b in blocks]).astype(np.intp)


def _build(parts: tuple[Part, ...], turns: _Turns, columns: list[str]) -> _Design:
    n = len(turns.records)
    x = np.column_stack([turns.stacked_column(parts, c) for c in columns]) if columns else np.zeros((n * len(parts), 0))
    y = np.concatenate([turns.target(p) for p in parts])
    w = np.concatenate([turns.weights(p) for p in parts])
    return _Design(parts, columns, n, x, y, w)


def _fit_rows(d: _Design, records: npt.NDArray[np.intp]) -> Vector:
    rows = d.rows(records)
    x, y, w = d.x[rows], d.y[rows], d.w[rows]
    if x.shape[1] == 0:
        return np.zeros(0)
    # Column scaling keeps NNLS well conditioned when per-token and per-turn terms differ by 10^4.
    scale = np.maximum(np.abs(x * w[:, None]).max(axis=0), 1e-12)
    solution, _ = nnls((x * w[:, None]) / scale, y * w)
    return np.asarray(solution / scale, dtype=np.float64)


def _predict(d: _Design, coef: Vector, records: npt.NDArray[np.intp], *, first_token: bool) -> Vector:
    total = np.zeros(len(records))
    for b, part in enumerate(d.parts):
        if part.before_first_token or not first_token:
            total += d.x[d.rows(records, [b])] @ coef
    return total


def _usable(records: Sequence[TurnRecord]) -> list[TurnRecord]:
    return [r for r in records if r.ttft_s is not None and r.ttft_s > 0 and r.e2e_s > 0]


def _error(errors: Vector, groups: list[str], seed: int) -> Error:
    ids = sorted(set(groups))
    by = {g: errors[[i for i, x in enumerate(groups) if x == g]] for g in ids}
    rng = np.random.default_rng(seed)
    medians = np.empty(ERROR_RESAMPLES)
    for b in range(ERROR_RESAMPLES):
        pick = rng.integers(0, len(ids), size=len(ids))
        medians[b] = np.median(np.concatenate([by[ids[i]] for i in pick]))
    alpha = (1 - LEVEL) / 2
    low, high = np.quantile(medians, [alpha, 1 - alpha]) if len(ids) > 1 else (math.nan, math.nan)
    return Error(float(np.median(errors)), float(low), float(high), len(errors), len(ids))


POOR_ERROR: Final = 0.10  # a held-out median error above this is not noise a capture should carry


class Calibration(msgspec.Struct, frozen=True):
    """What a fit gives: the cost profile and model rates it identifies (fields it cannot are
    named in `unidentified`, never given a value; fields it identifies only as a sum are in
    `sums`), every part's coefficients with intervals, the relative spread left (jitter), the
    held-out error, and whether the model fits at all (`problems`)."""

    cost_profile: dict[str, float]  # identified fields; a sum's fields share it equally (a placeholder split)
    model: dict[str, Param]  # model_latency_s, prefill_tok_per_s, tps: those identified alone
    profile_params: dict[str, Param]  # every identified field, or sum of fields (joined by '+'), with intervals
    coefficients: dict[str, dict[str, Param]]  # part -> column -> coefficient
    jitter: dict[str, float]  # std of log(measured / predicted) on held-out turns: ttft, e2e
    ttft_error: Error
    e2e_error: Error
    # Staged fits: the API's and client's part of TTFT alone (TTFT less queue and prefill), the
    # part the profile models; None when the records do not report those stages.
    api_error: Error | None
    staged: bool  # every stage reported by the records (a longrun server's)
    known_stages: list[str]  # the stages the records report, each fitted on its own
    unidentified: dict[str, str]  # field -> why the records cannot identify it
    sums: list[list[str]]  # fields identified only as their sum
    problems: list[str]  # why the fit gives no usable profile (empty: it does)
    residual_trend: float  # rank correlation of held-out log(measured/predicted) TTFT with the prompt
    refits: list[dict[str, float]]  # the identified values of each refit on resampled rollouts
    modes: list[str]
    train_rollouts: list[str]
    test_rollouts: list[str]
    seed: int

    @property
    def usable(self) -> bool:
        return not self.problems


def _values(d: _Design, coef: Vector) -> dict[str, float]:
    """Each identified column of the table's rows in its field's unit (a rate for a rate's row)."""
    out: dict[str, float] = {}
    for j, col in enumerate(d.columns):
        if ":" in col:  # a part's intercept
            continue
        c = float(coef[j])
        rate = any(BY_FIELD[f].rate for f in col.split(SUM))
        out[col] = (1.0 / c if c > 0 else math.inf) if rate else c
    return out


def _interval(samples: list[float], value: float) -> Param:
    """The refits' central 95 %; a rate's refits may be unbounded (no per-unit cost found), so
    the quantiles are order statistics, not interpolations (inf − inf has no value)."""
    known = [s for s in samples if not math.isnan(s)]
    if len(known) < 2:
        return Param(value, math.nan, math.nan)
    alpha = (1 - LEVEL) / 2
    low, high = np.quantile(np.asarray(known), [alpha, 1 - alpha], method="inverted_cdf")
    return Param(value, float(low), float(high))


def _known_stages(records: Sequence[TurnRecord]) -> list[str]:
    """Stages the records report. A record with `parse_validate` comes from a server that reports
    every stage (longrun's: an absent stage took no time); otherwise only those present (a
    capture's timing frames: the engine's and the hop's)."""
    seen = {k for r in records for k in r.stages_s}
    if Stage.PARSE.value in seen:
        return list(STAGE_ORDER)
    unknown = seen - set(STAGE_ORDER)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; the pipeline's are {', '.join(STAGE_ORDER)}")
    return [s for s in STAGE_ORDER if s in seen]


def _rank_correlation(a: Vector, b: Vector) -> float:
    if len(a) < 3:
        return math.nan
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if np.std(ra) == 0 or np.std(rb) == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def fit(records: Sequence[TurnRecord], *, holdout: float = 0.3, seed: int = 0) -> Calibration:
    """Fit on the rollouts not held out; predict the held-out ones (module doc)."""
    usable = _usable(records)
    rollouts = sorted({r.rollout for r in usable})
    if len(rollouts) < 2:
        raise ValueError(f"calibration needs at least 2 rollouts with a TTFT (got {len(rollouts)})")
    if not 0 < holdout < 1:
        raise ValueError("holdout must be in (0, 1)")
    order = list(np.random.default_rng(seed).permutation(len(rollouts)))
    n_test = min(len(rollouts) - 1, max(1, round(holdout * len(rollouts))))
    test_ids = sorted(rollouts[i] for i in order[:n_test])
    train_ids = sorted(rollouts[i] for i in order[n_test:])
    known = _known_stages(usable)
    parts = _parts(known)
    modes = tuple(dict.fromkeys(r.mode for r in usable))
    turns = _Turns(usable, records)
    ident = _identify(parts, turns, modes)
    design = _build(parts, turns, ident.columns)
    index = {g: np.asarray([i for i, r in enumerate(usable) if r.rollout == g], dtype=np.intp) for g in rollouts}
    train = np.concatenate([index[g] for g in train_ids])
    test = np.concatenate([index[g] for g in test_ids])
    coef = _fit_rows(design, train)

    # Parameters' intervals: refit on training rollouts drawn with replacement.
    rng = np.random.default_rng(seed + 1)
    boot: list[Vector] = []
    for _ in range(PARAM_RESAMPLES if len(train_ids) > 1 else 0):
        pick = rng.integers(0, len(train_ids), size=len(train_ids))
        boot.append(_fit_rows(design, np.concatenate([index[train_ids[i]] for i in pick])))
    every = np.arange(len(usable), dtype=np.intp)
    coefficients = {
        p.name: {
            col: _interval([float(b[j]) for b in boot], float(coef[j]))
            for j, col in enumerate(ident.columns)
            if design.x[design.rows(every, [k]), j].any()
        }
        for k, p in enumerate(parts)
    }
    values = _values(design, coef)
    boot_values = [_values(design, b) for b in boot]
    params = {k: _interval([bv[k] for bv in boot_values], v) for k, v in values.items()}
    model_fields = {r.field for r in MODEL_COSTS}
    sums = [k.split(SUM) for k in values if SUM in k]
    cost: dict[str, float] = {}
    for k, v in values.items():
        fields = k.split(SUM)
        for f in fields:
            if f not in model_fields:
                cost[f] = v / len(fields)  # a sum's split is a placeholder: `sums` says so
    model_params = {k: p for k, p in params.items() if k in model_fields}

    ttft = np.asarray([usable[i].ttft_s for i in test], dtype=float)
    e2e = np.asarray([usable[i].e2e_s for i in test], dtype=float)
    ttft_pred = _predict(design, coef, test, first_token=True)
    e2e_pred = _predict(design, coef, test, first_token=False)
    groups = [usable[i].rollout for i in test]
    api_error = None
    if set(MODEL_PARTS) <= set(known):
        blocks = [k for k, p in enumerate(parts) if p.name in MODEL_PARTS]
        model_pred = sum((design.x[design.rows(test, [k])] @ coef for k in blocks), np.zeros(len(test)))
        model_seen = np.asarray([sum(usable[i].stages_s.get(n, 0.0) for n in MODEL_PARTS) for i in test], dtype=float)
        api_seen = ttft - model_seen
        ok = api_seen > 0
        api_error = _error(
            np.abs((ttft_pred - model_pred)[ok] / api_seen[ok] - 1.0),
            [g for g, y in zip(groups, ok, strict=True) if y],
            seed,
        )

    def spread(measured: Vector, predicted: Vector) -> float:
        ok = predicted > 0
        return float(np.std(np.log(measured[ok] / predicted[ok]))) if ok.sum() > 1 else math.nan

    ttft_error = _error(np.abs(ttft_pred / ttft - 1.0), groups, seed)
    e2e_error = _error(np.abs(e2e_pred / e2e - 1.0), groups, seed)
    ok = ttft_pred > 0
    prompts = np.asarray([usable[i].prompt_tokens or 0 for i in test], dtype=float)
    trend = _rank_correlation(np.log(ttft[ok] / ttft_pred[ok]), prompts[ok])
    problems = []
    if ident.collinear:
        problems.append("the columns are linearly dependent (the records cannot tell the costs apart)")
    if not any(v > 0 and math.isfinite(v) for k, v in values.items() if not set(k.split(SUM)) <= model_fields):
        problems.append("no API wait identified (every one zero): the records carry no sign of the API's costs")
    for name, err in (("TTFT", ttft_error), ("end time", e2e_error)):
        if err.median > POOR_ERROR:
            problems.append(
                f"the fit is poor: held-out {name} error {100 * err.median:.1f} % > {100 * POOR_ERROR:.0f} % "
                "(the turns do not follow the stage-cost model)"
            )

    return Calibration(
        cost_profile=cost,
        model=model_params,
        profile_params=params,
        coefficients=coefficients,
        jitter={"ttft": spread(ttft, ttft_pred), "e2e": spread(e2e, e2e_pred)},
        ttft_error=ttft_error,
        e2e_error=e2e_error,
        api_error=api_error,
        staged=known == list(STAGE_ORDER),
        known_stages=known,
        unidentified=ident.unidentified,
        sums=sums,
        problems=problems,
        residual_trend=trend,
        refits=boot_values,
        modes=list(modes),
        train_rollouts=train_ids,
        test_rollouts=test_ids,
        seed=seed,
    )


def predict(c: Calibration, records: Sequence[TurnRecord], *, first_token: bool) -> Vector:
    """A fit's prediction of each record's TTFT (`first_token`) or end of turn, from its coefficients."""
    parts = _parts(c.known_stages)
    values = {col: p.value for cols in c.coefficients.values() for col, p in cols.items()}
    design = _build(parts, _Turns(records), list(values))
    coef = np.asarray(list(values.values()), dtype=np.float64)
    return _predict(design, coef, np.arange(len(records), dtype=np.intp), first_token=first_token)


def _pct(e: Error) -> str:
    if math.isnan(e.ci_low):
        ci = "no interval: 1 held-out rollout"
    else:
        ci = f"95 % CI {100 * e.ci_low:.1f}–{100 * e.ci_high:.1f}"
    return f"held-out error: {100 * e.median:.1f} % ({ci}), n={e.n} turns"


def _num(p: Param) -> str:
    def f(x: float) -> str:
        return "inf" if math.isinf(x) else "nan" if math.isnan(x) else f"{x:.4g}"

    return f"{f(p.value)} ({f(p.ci_low)}–{f(p.ci_high)})"


def report(c: Calibration) -> str:
    """The text `python -m sim calibrate` prints."""
    how = (
        "stage by stage"
        if c.staged
        else (
            f"stages {', '.join(c.known_stages)} on their own, the rest of the turn whole"
            if c.known_stages
            else "TTFT and the rest of the turn whole"
        )
    )
    lines = [
        f"fitted on {len(c.train_rollouts)} rollouts, held out {len(c.test_rollouts)} "
        f"({how}; modes {', '.join(c.modes)}; seed {c.seed})",
        f"per-turn TTFT      {_pct(c.ttft_error)}",
        f"per-turn end time  {_pct(c.e2e_error)}",
        *([f"API part of TTFT   {_pct(c.api_error)} (TTFT less queue and prefill)"] if c.api_error else []),
        f"jitter (std of log measured/predicted, held out): TTFT {c.jitter['ttft']:.3f}, end {c.jitter['e2e']:.3f}",
        f"held-out TTFT residuals against the prompt's size: rank correlation {c.residual_trend:+.2f}",
    ]
    if c.profile_params:
        lines.append("identified (95 % CI over refits; a+b: only the sum is identified):")
        for k, p in c.profile_params.items():
            rate = any(BY_FIELD[f].rate for f in k.split(SUM))
            bound = math.inf if rate else 0.0
            at_bound = p.value == bound and p.ci_low == bound and p.ci_high == bound
            note = "  (at the bound on every refit: too small for these records to resolve)" if at_bound else ""
            lines.append(f"  {k:<22} {_num(p)}{note}")
    if c.unidentified:
        lines.append("not identified (no value is written for these):")
        lines += [f"  {k:<22} {why}" for k, why in c.unidentified.items()]
    if c.problems:
        lines.append("no usable profile: " + "; ".join(c.problems))
    lines.append("coefficients by part (seconds per unit; mode:X is a per-request wait in mode X):")
    for part, cols in c.coefficients.items():
        shown = ", ".join(f"{col} {_num(p)}" for col, p in cols.items() if p.value or p.ci_high)
        if shown:
            lines.append(f"  {part:<16} {shown}")
    return "\n".join(lines)


class FitFile(msgspec.Struct, frozen=True, kw_only=True):
    """What `--out` writes: `--profile FILE` reads its `cost_profile` (identified fields only;
    `load_profile` refuses a run that pays an `unidentified` field or the parts of a sum apart);
    `model` holds the identified rates to pass as `--tps`, `--prefill-tok-per-s` and
    `--model-latency-s`."""

    cost_profile: dict[str, float]
    model: dict[str, float]
    unidentified: list[str]
    sums: list[list[str]]
    calibration: Calibration


def fit_file(c: Calibration) -> FitFile:
    """The fit file; refuses (ValueError) a fit that gives no usable profile."""
    if c.problems:
        raise ValueError("no profile written: " + "; ".join(c.problems))
    model_fields = {r.field for r in MODEL_COSTS}
    model = {k: p.value for k, p in c.profile_params.items() if k in model_fields}
    for k, p in c.profile_params.items():
        fields = k.split(SUM)
        if len(fields) > 1:
            model.update({f: p.value / len(fields) for f in fields if f in model_fields})
    return FitFile(
        cost_profile={"name": "fitted", **c.cost_profile},  # type: ignore[dict-item]
        model=model,
        unidentified=sorted(c.unidentified),
        sums=c.sums,
        calibration=c,
    )


def check_profile(c: Calibration, known: CostProfile, model: dict[str, float], *, tolerance: float) -> list[str]:
    """The identified values farther than `tolerance` (relative) from a known profile and model
    rates (a sum against the sum of its fields): empty when the fit recovers them. Fields the
    known profile sets to zero must fit below `tolerance` × the largest fixed wait."""

    def truth(field: str) -> float:
        return float(model[field]) if field in model else float(getattr(known, field))

    misses: list[str] = []
    fixed = [truth(r.field) for r in ROWS if r.count is Count.ONCE and (r.field in model or hasattr(known, r.field))]
    floor = tolerance * max([*fixed, 1e-3])
    for k, p in c.profile_params.items():
        fields = k.split(SUM)
        if not all(f in model or hasattr(known, f) for f in fields):
            continue
        want = sum(truth(f) for f in fields)
        if math.isinf(want) and math.isinf(p.value):
            continue
        if want == 0:
            if abs(p.value) > floor:
                misses.append(f"{k}: {p.value:.4g}, want 0")
        elif not abs(p.value / want - 1) <= tolerance:
            misses.append(f"{k}: {p.value:.4g}, want {want:.4g}")
    return misses
