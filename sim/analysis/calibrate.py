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

from prototype.pipeline import CostProfile
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
PRE: Final = ("network", "parse_validate", "load_state", "render", "safety", "routing", "inference_hop", "queue")
PRE_MODEL: Final = ("prefill", "compaction")
POST: Final = ("decode", "post_inference")
MODEL_PARTS: Final = ("queue", "prefill")  # the accelerator's part of TTFT; the rest is the API's and the client's


def _field(name: str) -> Feature:
    return lambda r: None if getattr(r, name) is None else float(getattr(r, name))


def _stage(name: str) -> Feature:
    return lambda r: r.stages_s.get(name, 0.0)


def _ttft_client(r: TurnRecord) -> float | None:
    if r.ttft_s is None:
        return None
    return r.ttft_s - sum(r.stages_s.get(s, 0.0) for s in (*PRE, *PRE_MODEL))


def _tail_client(r: TurnRecord) -> float | None:
    if r.ttft_s is None:
        return None
    return r.e2e_s - r.ttft_s - sum(r.stages_s.get(s, 0.0) for s in POST)


def _after_ttft(r: TurnRecord) -> float | None:
    return None if r.ttft_s is None else r.e2e_s - r.ttft_s


MODE: Final = "mode"  # a feature list entry: one intercept per mode
ONE: Final = "1"


@dataclass(frozen=True)
class Part:
    """One additive part of a turn: the time it takes (`target`), and what it is linear in."""

    name: str
    target: Feature
    features: tuple[str, ...]  # record fields, DERIVED ones, ONE (an intercept) or MODE (waits per mode)
    before_first_token: bool


STAGED: Final = (
    Part("network", _stage("network"), (ONE, "bytes_in"), True),
    Part("parse_validate", _stage("parse_validate"), (ONE, "bytes_in", "tokens_rendered"), True),
    Part("load_state", _stage("load_state"), (MODE,), True),
    Part("render", _stage("render"), (ONE, "tokens_rendered"), True),
    Part("safety", _stage("safety"), (MODE, "tokens_rendered"), True),
    Part("routing", _stage("routing"), (MODE,), True),
    Part("inference_hop", _stage("inference_hop"), (MODE,), True),
    Part("queue", _stage("queue"), (ONE,), True),
    Part("prefill", _stage("prefill"), (ONE, "uncached_tokens"), True),
    Part("compaction", _stage("compaction"), (ONE,), True),
    Part("client_ttft", _ttft_client, (MODE,), True),
    Part("decode", _stage("decode"), (ONE, "tokens_after_first"), False),
    Part("post_inference", _stage("post_inference"), (MODE,), False),
    Part("client_tail", _tail_client, (MODE,), False),
)
WHOLE: Final = (
    Part("ttft", _field("ttft_s"), (MODE, "bytes_in", "tokens_rendered", "uncached_tokens"), True),
    Part("after_first_token", _after_ttft, (MODE, "tokens_after_first"), False),
)


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
class _Fitted:
    parts: tuple[Part, ...]
    modes: tuple[str, ...]
    columns: dict[str, list[str]]  # per part: the names of its columns
    coef: dict[str, Vector]

    def design(self, part: Part, records: Sequence[TurnRecord]) -> Vector:
        return _design(part, records, self.modes, self.columns[part.name])

    def predict(self, records: Sequence[TurnRecord], *, first_token: bool) -> Vector:
        total = np.zeros(len(records))
        for part in self.parts:
            if part.before_first_token or not first_token:
                total += self.design(part, records) @ self.coef[part.name]
        return total


# Features computed from a record's fields (the rest are its fields by name).
DERIVED: Final[dict[str, Callable[[TurnRecord], float | None]]] = {
    # decode runs from the first token to the last: the first token is TTFT's
    "tokens_after_first": lambda r: None if r.output_tokens is None else max(0, r.output_tokens - 1),
}


def _value(r: TurnRecord, feature: str) -> float | None:
    if feature in DERIVED:
        return DERIVED[feature](r)
    v = getattr(r, feature)
    return None if v is None else float(v)


def _columns(part: Part, records: Sequence[TurnRecord], modes: Sequence[str]) -> list[str]:
    """A part's columns: MODE expands to a wait per mode on a conversation's first turn
    (`first:M`) and on the turns that continue it (`mode:M`), since what a connection or a
    held response reuses differs between the two."""
    out: list[str] = []
    for f in part.features:
        if f == MODE:
            out += [f"first:{m}" for m in modes] + [f"mode:{m}" for m in modes]
        elif f == ONE or all(_value(r, f) is not None for r in records):
            out.append(f)
    return out


def _design(part: Part, records: Sequence[TurnRecord], modes: Sequence[str], columns: list[str]) -> Vector:
    x = np.zeros((len(records), len(columns)))
    for j, c in enumerate(columns):
        if c == ONE:
            x[:, j] = 1.0
        elif c.startswith("first:"):
            x[:, j] = [r.mode == c[6:] and r.turn == 0 for r in records]
        elif c.startswith("mode:"):
            x[:, j] = [r.mode == c[5:] and r.turn > 0 for r in records]
        else:
            x[:, j] = [_value(r, c) or 0.0 for r in records]
    return x


def _weights(part: Part, records: Sequence[TurnRecord]) -> Vector:
    scale = [(r.ttft_s if part.before_first_token and r.ttft_s else r.e2e_s) for r in records]
    return np.asarray(1.0 / np.maximum(np.asarray(scale, dtype=np.float64), 1e-6), dtype=np.float64)


def _fit_parts(parts: tuple[Part, ...], records: Sequence[TurnRecord], modes: tuple[str, ...]) -> _Fitted:
    columns: dict[str, list[str]] = {}
    coef: dict[str, Vector] = {}
    for part in parts:
        cols = _columns(part, records, modes)
        y = np.asarray([part.target(r) for r in records], dtype=float)
        x = _design(part, records, modes, cols)
        w = _weights(part, records)
        columns[part.name] = cols
        # Column scaling keeps NNLS well conditioned when per-token and per-turn terms differ by 10^4.
        scale = np.maximum(np.abs(x * w[:, None]).max(axis=0), 1e-12)
        solution, _ = nnls((x * w[:, None]) / scale, y * w)
        coef[part.name] = np.asarray(solution / scale, dtype=np.float64)
    return _Fitted(parts, modes, columns, coef)


def _usable(records: Sequence[TurnRecord]) -> list[TurnRecord]:
    return [r for r in records if r.ttft_s is not None and r.ttft_s > 0 and r.e2e_s > 0]


def _errors(fitted: _Fitted, records: Sequence[TurnRecord]) -> tuple[Vector, Vector]:
    ttft = np.asarray([r.ttft_s for r in records], dtype=float)
    e2e = np.asarray([r.e2e_s for r in records], dtype=float)
    pred_ttft = fitted.predict(records, first_token=True)
    pred_e2e = fitted.predict(records, first_token=False)
    return np.abs(pred_ttft / ttft - 1.0), np.abs(pred_e2e / e2e - 1.0)


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


class Calibration(msgspec.Struct, frozen=True):
    """What a fit gives: the cost profile and model rates it implies, every part's coefficients
    with intervals, the relative spread left (jitter), and the held-out error."""

    cost_profile: CostProfile
    model: dict[str, Param]  # model_latency_s, prefill_tok_per_s, tps
    profile_params: dict[str, Param]  # the cost profile's fitted fields, with intervals
    coefficients: dict[str, dict[str, Param]]  # part -> column -> coefficient
    jitter: dict[str, float]  # std of log(measured / predicted) on held-out turns: ttft, e2e
    ttft_error: Error
    e2e_error: Error
    # Staged fits: the API's and client's part of TTFT alone (TTFT less queue and prefill), the
    # part the profile models; None when the records carry no stages.
    api_error: Error | None
    staged: bool  # fitted stage by stage (records carry the server's stages)
    modes: list[str]
    train_rollouts: list[str]
    test_rollouts: list[str]
    seed: int


def _reference_mode(modes: Sequence[str]) -> str:
    return "http" if "http" in modes else modes[0]


def _profile_values(fitted: _Fitted) -> tuple[dict[str, float], dict[str, float]]:
    """The cost profile's fields and the model's rates a staged fit implies (see the module doc)."""

    def c(part: str, column: str) -> float:
        cols = fitted.columns.get(part, [])
        return float(fitted.coef[part][cols.index(column)]) if column in cols else 0.0

    def rate(per: float) -> float:
        return 1.0 / per if per > 0 else math.inf

    ref = _reference_mode(fitted.modes)
    load = {m: c("load_state", f"mode:{m}") for m in fitted.modes}
    cost = {
        "rtt_s": c("network", ONE),
        "uplink_bytes_per_s": rate(c("network", "bytes_in")),
        "routing_s": c("routing", f"mode:{ref}"),  # auth and routing: one wait, not identifiable apart
        "validate_s_per_token": c("render", "tokens_rendered"),
        "state_load_s": max(0.0, load.get("http_prev", 0.0) - load.get(ref, 0.0)),
        "safety_call_s": c("safety", f"mode:{ref}"),
        "safety_s_per_token": c("safety", "tokens_rendered"),
        "inference_hop_s": c("inference_hop", f"mode:{ref}"),
        "billing_s": c("post_inference", f"mode:{ref}"),
    }
    model = {
        "model_latency_s": c("prefill", ONE),
        "prefill_tok_per_s": rate(c("prefill", "uncached_tokens")),
        "tps": rate(c("decode", "tokens_after_first")),
    }
    return cost, model


def _interval(samples: list[float], value: float) -> Param:
    finite = [s for s in samples if math.isfinite(s)]
    if len(finite) < 2:
        return Param(value, math.nan, math.nan)
    alpha = (1 - LEVEL) / 2
    low, high = np.quantile(finite, [alpha, 1 - alpha])
    return Param(value, float(low), float(high))


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
    train = [r for r in usable if r.rollout in set(train_ids)]
    test = [r for r in usable if r.rollout in set(test_ids)]
    staged = all(r.stages_s for r in usable)
    parts = STAGED if staged else WHOLE
    modes = tuple(dict.fromkeys(r.mode for r in usable))
    fitted = _fit_parts(parts, train, modes)

    # Parameters' intervals: refit on training rollouts drawn with replacement.
    by_rollout = {g: [r for r in train if r.rollout == g] for g in train_ids}
    rng = np.random.default_rng(seed + 1)
    boot: list[_Fitted] = []
    for _ in range(PARAM_RESAMPLES if len(train_ids) > 1 else 0):
        pick = rng.integers(0, len(train_ids), size=len(train_ids))
        sample = [r for i in pick for r in by_rollout[train_ids[i]]]
        boot.append(_fit_parts(parts, sample, modes))
    coefficients = {
        p.name: {
            col: _interval(
                [float(b.coef[p.name][j]) for b in boot if b.columns[p.name] == fitted.columns[p.name]],
                float(fitted.coef[p.name][j]),
            )
            for j, col in enumerate(fitted.columns[p.name])
        }
        for p in parts
    }
    if staged:
        cost, model = _profile_values(fitted)
        boot_values = [_profile_values(b) for b in boot]
        profile_params = {k: _interval([bv[0][k] for bv in boot_values], v) for k, v in cost.items()}
        model_params = {k: _interval([bv[1][k] for bv in boot_values], v) for k, v in model.items()}
        profile = CostProfile(name="fitted", **cost)
    else:
        profile_params, model_params, profile = {}, {}, CostProfile(name="fitted")

    ttft_err, e2e_err = _errors(fitted, test)
    groups = [r.rollout for r in test]
    ttft_pred = fitted.predict(test, first_token=True)
    e2e_pred = fitted.predict(test, first_token=False)
    ttft = np.asarray([r.ttft_s for r in test], dtype=float)
    e2e = np.asarray([r.e2e_s for r in test], dtype=float)
    api_error = None
    if staged:
        model_parts = [p for p in parts if p.name in MODEL_PARTS]
        model_pred = sum((fitted.design(p, test) @ fitted.coef[p.name] for p in model_parts), np.zeros(len(test)))
        model_seen = np.asarray([sum(r.stages_s.get(n, 0.0) for n in MODEL_PARTS) for r in test], dtype=float)
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

    return Calibration(
        cost_profile=profile,
        model=model_params,
        profile_params=profile_params,
        coefficients=coefficients,
        jitter={"ttft": spread(ttft, ttft_pred), "e2e": spread(e2e, e2e_pred)},
        ttft_error=_error(ttft_err, groups, seed),
        e2e_error=_error(e2e_err, groups, seed),
        api_error=api_error,
        staged=staged,
        modes=list(modes),
        train_rollouts=train_ids,
        test_rollouts=test_ids,
        seed=seed,
    )


def predict(c: Calibration, records: Sequence[TurnRecord], *, first_token: bool) -> Vector:
    """A fit's prediction of each record's TTFT (`first_token`) or end of turn, from its coefficients."""
    total = np.zeros(len(records))
    for part in STAGED if c.staged else WHOLE:
        if part.before_first_token or not first_token:
            columns = list(c.coefficients[part.name])
            coef = np.asarray([c.coefficients[part.name][col].value for col in columns], dtype=np.float64)
            total += _design(part, records, c.modes, columns) @ coef
    return total


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
    lines = [
        f"fitted on {len(c.train_rollouts)} rollouts, held out {len(c.test_rollouts)} "
        f"({'stage by stage' if c.staged else 'TTFT and the rest of the turn whole'}; modes {', '.join(c.modes)}; "
        f"seed {c.seed})",
        f"per-turn TTFT      {_pct(c.ttft_error)}",
        f"per-turn end time  {_pct(c.e2e_error)}",
        *([f"API part of TTFT   {_pct(c.api_error)} (TTFT less queue and prefill)"] if c.api_error else []),
        f"jitter (std of log measured/predicted, held out): TTFT {c.jitter['ttft']:.3f}, end {c.jitter['e2e']:.3f}",
    ]
    if c.profile_params:
        lines.append("cost profile (95 % CI over refits):")
        lines += [f"  {k:<22} {_num(p)}" for k, p in c.profile_params.items()]
        lines.append("model:")
        lines += [f"  {k:<22} {_num(p)}" for k, p in c.model.items()]
    lines.append("coefficients by part (seconds per unit; mode:X is a per-request wait in mode X):")
    for part, cols in c.coefficients.items():
        shown = ", ".join(f"{col} {_num(p)}" for col, p in cols.items() if p.value or p.ci_high)
        if shown:
            lines.append(f"  {part:<16} {shown}")
    return "\n".join(lines)


class FitFile(msgspec.Struct, frozen=True, kw_only=True):
    """What `--out` writes: `--profile FILE` reads its `cost_profile`; `model` holds the rates
    to pass as `--tps`, `--prefill-tok-per-s` and `--model-latency-s`."""

    cost_profile: CostProfile
    model: dict[str, float]
    calibration: Calibration


def fit_file(c: Calibration) -> FitFile:
    return FitFile(cost_profile=c.cost_profile, model={k: p.value for k, p in c.model.items()}, calibration=c)


def check_profile(c: Calibration, known: CostProfile, model: dict[str, float], *, tolerance: float) -> list[str]:
    """The fitted values farther than `tolerance` (relative) from a known profile and model rates:
    empty when the fit recovers them. Fields the known profile sets to zero must fit below
    `tolerance` × the largest fixed wait."""
    misses: list[str] = []
    floor = tolerance * max(known.routing_s + known.auth_s, known.safety_call_s, known.billing_s, known.rtt_s, 1e-3)
    for k, p in c.profile_params.items():
        want = known.auth_s + known.routing_s if k == "routing_s" else float(getattr(known, k))
        if math.isinf(want) and math.isinf(p.value):
            continue
        if want == 0:
            if abs(p.value) > floor:
                misses.append(f"{k}: {p.value:.4g}, want 0")
        elif not abs(p.value / want - 1) <= tolerance:
            misses.append(f"{k}: {p.value:.4g}, want {want:.4g}")
    for k, want in model.items():
        got = c.model[k].value
        if not abs(got / want - 1) <= tolerance:
            misses.append(f"{k}: {got:.4g}, want {want:.4g}")
    return misses
