"""The simulator validated against a real engine: held-out errors, as serving simulators report them.

`validate` takes a comparison measured live on a real engine (`CompareConfig.engine`) and:

1. **fits** longrun's model of the turn (`sim.analysis.calibrate.fit`: the cost profile's stages
   and the model's latency, prefill and decode rates) to the engine's `http` and `ws` turns of
   the *training* rollouts only;
2. **predicts** the same seeded rollouts in every measured mode by running the simulator (virtual
   time, CPU charged) on the fit, with the engine's slot count as its decode slots;
3. **scores** the prediction turn by turn against the measurement on what the fit never saw:
   the held-out rollouts of `http` and `ws`, and each held-out design (every other measured mode:
   `append`, `inject`, `agents`, ...) on every rollout.
   Per-turn TTFT and turn time: the median relative error, with a bootstrap interval over
   rollouts; time saved against `http`: the prediction against the measured paired interval.

The result is a value (`Validation`); `python -m sim validate` runs the engine comparison and
prints it (docs/validation.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from msgspec import structs

from sim.analysis.calibrate import Calibration, fit
from sim.analysis.records import TurnRecord, records_from_rollouts
from sim.analysis.stats import Estimate, paired_saving
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.harness.predict import profile_settings

__all__ = [
    "TRAIN_MODES",
    "Score",
    "Validation",
    "error_tail",
    "pct_text",
    "score_pairs",
    "score_records",
    "score_lines",
    "split_rollouts",
    "as_capture",
    "fit_training",
    "held_out_designs",
    "modes_refusal",
    "predicted_config",
    "validate",
    "validate_records",
    "validation_text",
]

TRAIN_MODES: Final = ("http", "ws")
BASE: Final = "http"
RESAMPLES: Final = 2000
POOR_FIT: Final = "the fit is poor"  # sim.analysis.calibrate's wording for a held-out error above its bound


@dataclass(frozen=True, slots=True)
class Score:
    """One held-out set: median relative per-turn errors with their intervals, and n."""

    name: str
    ttft: Estimate  # median |predicted / measured − 1| of per-turn TTFT
    turn: Estimate  # the same for turn time (request sent → terminal or pause event)
    ttft_bias: float  # median predicted / measured − 1 (sign: the simulator is slow or fast)
    turns: int
    rollouts: int
    # The tail the medians hide: p90 and max of the same per-turn errors (NaN: no turn).
    ttft_p90: float = math.nan
    ttft_max: float = math.nan
    turn_p90: float = math.nan
    turn_max: float = math.nan


@dataclass(frozen=True, slots=True)
class Validation:
    calibration: Calibration
    config: CompareConfig  # the simulator's config the prediction ran
    scores: list[Score]
    measured_saved: dict[str, Estimate]  # per mode: time saved vs http on the engine, paired by rollout
    predicted_saved: dict[str, float]  # the simulator's, on the same rollouts
    train_rollouts: list[str]
    test_rollouts: list[str]
    problems: list[str] = field(default_factory=list)


def predicted_config(c: Calibration, measured: CompareConfig) -> CompareConfig:
    """The simulator's config for the measured run: the fit's profile and model rates, the
    engine's slots as decode slots and its prefix-cache granularity as the model's blocks,
    everything else (workload, seed, modes) as measured."""
    values = {k: p.value for k, p in c.profile_params.items()}
    settings = profile_settings(values, {})
    engine = measured.engine
    return measured.updated(
        engine_kind="none",
        decode_slots=engine.engine_slots,
        prefix_block_tokens=engine.prefix_block_tokens,
        **settings,
    )


def _key(r: TurnRecord) -> tuple[str, str, int]:
    return (r.mode, r.rollout, r.turn)


def _median_error(
    pairs: list[tuple[str, float, float]], *, seed: int, resamples: int = RESAMPLES
) -> tuple[Estimate, float]:
    """Median |p/m − 1| over (rollout, predicted, measured) pairs, bootstrap over rollouts
    (`resamples`; 0: no interval); and the median signed error."""
    if not pairs:
        return Estimate(math.nan, math.nan, math.nan, 0), math.nan
    rollouts = sorted({r for r, _, _ in pairs})
    by = {r: np.array([abs(p / m - 1) for rr, p, m in pairs if rr == r]) for r in rollouts}
    every = np.concatenate(list(by.values()))
    value = float(np.median(every))
    signed = float(np.median([p / m - 1 for _, p, m in pairs]))
    if len(rollouts) < 2 or resamples == 0:
        return Estimate(value, math.nan, math.nan, len(every)), signed
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(every), 0xE11]))
    medians = [
        float(np.median(np.concatenate([by[rollouts[i]] for i in rng.integers(0, len(rollouts), len(rollouts))])))
        for _ in range(resamples)
    ]
    low, high = np.quantile(medians, [0.025, 0.975])
    return Estimate(value, float(low), float(high), len(every)), signed


def error_tail(pairs: Sequence[tuple[str, float, float]]) -> tuple[float, float]:
    """p90 (linear between order statistics) and max of |p/m − 1| over (rollout, predicted,
    measured) pairs; NaN for none."""
    if not pairs:
        return math.nan, math.nan
    errors = np.array([abs(p / m - 1) for _, p, m in pairs])
    return float(np.quantile(errors, 0.9)), float(errors.max())


def score_pairs(
    name: str,
    ttft: Sequence[tuple[str, float, float]],
    turn: Sequence[tuple[str, float, float]],
    *,
    rollouts: int,
    seed: int,
    interval: bool = True,
) -> Score:
    """A `Score` of per-turn (rollout, predicted, measured) TTFT and turn-time pairs; without
    `interval`, the medians' bootstrap is skipped."""
    resamples = RESAMPLES if interval else 0
    ttft_err, bias = _median_error(list(ttft), seed=seed, resamples=resamples)
    turn_err, _ = _median_error(list(turn), seed=seed, resamples=resamples)
    return Score(name, ttft_err, turn_err, bias, len(turn), rollouts, *error_tail(ttft), *error_tail(turn))


def score_records(
    name: str, measured: dict[tuple[str, str, int], TurnRecord], predicted: dict[tuple[str, str, int], TurnRecord],
    keys: list[tuple[str, str, int]], *, seed: int,
) -> Score:  # fmt: skip
    """A `Score` of the turns `keys` ((mode, rollout, turn)): `predicted`'s against `measured`'s,
    each key `predicted` holds."""
    ttft = [
        (k[1], predicted[k].ttft_s, measured[k].ttft_s)
        for k in keys
        if k in predicted and measured[k].ttft_s and predicted[k].ttft_s
    ]
    turn = [(k[1], predicted[k].e2e_s, measured[k].e2e_s) for k in keys if k in predicted and measured[k].e2e_s > 0]
    return score_pairs(name, ttft, turn, rollouts=len({k[1] for k in keys}), seed=seed)  # type: ignore[arg-type]


def _rollout_times(records: Sequence[TurnRecord]) -> dict[tuple[str, str], float]:
    """A rollout's time from its records: its turns and the client's time between them."""
    out: dict[tuple[str, str], float] = {}
    for r in records:
        out[(r.mode, r.rollout)] = out.get((r.mode, r.rollout), 0.0) + r.e2e_s + (r.tool_s or 0.0)
    return out


def split_rollouts(rollouts: Sequence[str], train_share: float, *, seed: int) -> tuple[list[str], list[str]]:
    """The rollouts a fit sees (at least 2, at least 1 left) and the held-out rest, seeded."""
    n_train = max(2, min(len(rollouts) - 1, round(train_share * len(rollouts))))
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(rollouts), 0xF17]))
    train = sorted(rng.choice(list(rollouts), size=n_train, replace=False).tolist(), key=int)
    return train, [r for r in rollouts if r not in train]


def fit_training(training: Sequence[TurnRecord], *, rollouts: int, seed: int) -> Calibration:
    """The fit on a training share of `rollouts` rollouts: its own hold-out half of them when
    fewer than 4, else 30 % (the validation's and the contention check's one rule)."""
    return fit(training, holdout=0.5 if rollouts < 4 else 0.3, seed=seed)


def as_capture(r: TurnRecord) -> TurnRecord:
    """What a user's proxy or client capture of the same turn holds: times, sizes and `usage`,
    no server stages and no counts only the server knows (docs/calibration.md)."""
    return structs.replace(r, source="capture", tokens_rendered=None, tokens_classified=None, stages_s={})


def validate(result: CompareResult, *, train_share: float = 0.5, seed: int = 0, capture: bool = False) -> Validation:
    """Fit on the training rollouts' `http` and `ws` turns of the engine run `result`, predict
    every mode it measured with the simulator, and score the held-out turns (module doc)."""
    if result.virtual:
        raise ValueError("validate needs a comparison measured live on a real engine (--engine)")
    records = records_from_rollouts(result.rollouts, source="longrun-live")
    return validate_records(records, result.config, train_share=train_share, seed=seed, capture=capture)


def held_out_designs(config: CompareConfig) -> list[str]:
    """The designs the fit never sees: every measured mode but the training modes, in the run's order."""
    return [m for m in config.modes if m not in TRAIN_MODES]


def modes_refusal(config: CompareConfig) -> str | None:
    """Why the run's modes cannot be validated (the training modes missing, or nothing left to
    hold out as a design), or None: checked before a new run starts and on a saved one."""
    missing = [m for m in TRAIN_MODES if m not in config.modes]
    if missing:
        return f"validate needs the modes {', '.join(missing)} in the measured run"
    if not held_out_designs(config):
        return f"validate needs a measured mode besides {', '.join(TRAIN_MODES)} to hold out as a design (e.g. append)"
    return None


def validate_records(
    measured_records: list[TurnRecord],
    measured_config: CompareConfig,
    *,
    train_share: float = 0.5,
    seed: int = 0,
    capture: bool = False,
) -> Validation:
    """`validate` on a run's records and config (a run folder's records.jsonl and config.json).
    `capture`: fit on what a capture of the training turns would hold (`as_capture`), as a user
    who records their own http and ws traffic can (issue 41's path), instead of the server's stages."""
    if measured_config.engine.engine_kind == "none":
        raise ValueError("validate needs a comparison measured live on a real engine (--engine)")
    refused = modes_refusal(measured_config)
    if refused:
        raise ValueError(refused)
    rollouts = sorted({r.rollout for r in measured_records}, key=int)
    if len(rollouts) < 3:
        raise ValueError(
            "validate needs at least 3 rollouts: 2 or more to fit on (one held out inside the fit), 1 held out"
        )
    train, test = split_rollouts(rollouts, train_share, seed=seed)
    training = [r for r in measured_records if r.rollout in train and r.mode in TRAIN_MODES]
    if capture:
        training = [as_capture(r) for r in training]
    c = fit_training(training, rollouts=len(train), seed=seed)
    # A poor fit is what this measures (its held-out error says how poor); a fit that identifies
    # too little to run the simulator on is refused.
    blocking = [p for p in c.problems if not p.startswith(POOR_FIT)]
    if blocking:
        return Validation(c, measured_config, [], {}, {}, train, test, problems=blocking)
    config = predicted_config(c, measured_config)
    predicted_result = compare(config, virtual=True)
    predicted_records = records_from_rollouts(predicted_result.rollouts, source="longrun-virtual")
    measured = {_key(r): r for r in measured_records}
    predicted = {_key(r): r for r in predicted_records}
    held_rollouts = [k for k in measured if k[0] in TRAIN_MODES and k[1] in test]
    scores = [score_records("held-out rollouts (http, ws)", measured, predicted, held_rollouts, seed=seed)]
    for design in held_out_designs(measured_config):
        held = [k for k in measured if k[0] == design]
        scores.append(score_records(f"held-out design ({design}, every rollout)", measured, predicted, held, seed=seed))
    m_times, p_times = _rollout_times(measured_records), _rollout_times(predicted_records)
    measured_saved: dict[str, Estimate] = {}
    predicted_saved: dict[str, float] = {}
    for mode in measured_config.modes:
        if mode == BASE:
            continue
        base = [m_times[(BASE, r)] for r in rollouts]
        measured_saved[mode] = paired_saving(base, [m_times[(mode, r)] for r in rollouts], seed=seed)
        p = [1 - p_times[(mode, r)] / p_times[(BASE, r)] for r in rollouts if (mode, r) in p_times]
        predicted_saved[mode] = float(np.mean(p)) if p else math.nan
    return Validation(c, config, scores, measured_saved, predicted_saved, train, test)


def pct_text(e: Estimate, p90: float = math.nan, top: float = math.nan) -> str:
    """A median relative error with its interval and n, and (given) its p90 and max."""
    tail = "" if math.isnan(p90) else f"; p90 {100 * p90:.1f} %, max {100 * top:.1f} %"
    if math.isnan(e.ci_low):
        return f"{100 * e.value:.1f} % (n={e.n}: no interval){tail}"
    return f"{100 * e.value:.1f} % (95 % CI {100 * e.ci_low:.1f}–{100 * e.ci_high:.1f}, n={e.n} turns){tail}"


def score_lines(s: Score) -> list[str]:
    """A score's two error lines: median with its interval, signed median, p90 and max."""
    return [
        f"  per-turn TTFT error (median |pred/meas − 1|): {pct_text(s.ttft, s.ttft_p90, s.ttft_max)}; "
        f"median signed {100 * s.ttft_bias:+.1f} %",
        f"  per-turn turn-time error: {pct_text(s.turn, s.turn_p90, s.turn_max)}",
    ]


def validation_text(v: Validation) -> str:
    lines = [
        f"fit on rollouts {', '.join(v.train_rollouts)} ({', '.join(TRAIN_MODES)}); held out: rollouts "
        f"{', '.join(v.test_rollouts)} and the designs {', '.join(held_out_designs(v.config))}",
    ]
    if v.problems:
        return "\n".join([*lines, "no usable fit: " + "; ".join(v.problems)])
    c = v.calibration
    lines.append(
        f"the fit's coefficients come from rollouts {', '.join(c.train_rollouts)}; its own hold-out (the fit's "
        f"error, inside the training share): rollouts {', '.join(c.test_rollouts)}"
    )
    model = ", ".join(f"{k} {p.value:.4g}" for k, p in c.model.items())
    lines.append(f"fitted model: {model}")
    for s in v.scores:
        lines.append(f"{s.name}, {s.turns} turns of {s.rollouts} rollouts:")
        lines.extend(score_lines(s))
    lines.append("time saved against http, every rollout (engine measured, paired 95 % CI → simulator predicted):")
    for mode, e in v.measured_saved.items():
        p = v.predicted_saved.get(mode, math.nan)
        inside = e.ci_low <= p <= e.ci_high if not math.isnan(e.ci_low) else False
        lines.append(
            f"  {mode}: {100 * e.value:.1f} % ({100 * e.ci_low:.1f}–{100 * e.ci_high:.1f}, n={e.n}) → "
            f"{100 * p:.1f} %{'' if inside else '  (outside the measured interval)'}"
        )
    return "\n".join(lines)
