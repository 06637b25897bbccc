"""The simulator validated against a real engine: held-out errors, as serving simulators report them.

`validate` takes a comparison measured live on a real engine (`CompareConfig.engine`) and:

1. **fits** longrun's model of the turn (`sim.analysis.calibrate.fit`: the cost profile's stages
   and the model's latency, prefill and decode rates) to the engine's `http` and `ws` turns of
   the *training* rollouts only;
2. **predicts** the same seeded rollouts in every measured mode by running the simulator (virtual
   time, CPU charged) on the fit, with the engine's slot count as its decode slots;
3. **scores** the prediction turn by turn against the measurement on what the fit never saw:
   the held-out rollouts of `http` and `ws`, and the held-out design `append` on every rollout.
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
from sim.engine.model import EngineTurn
from sim.fleet.compute import StepCost
from sim.fleet.predict import predict_turns
from sim.fleet.sessions import STEP_TEMPLATE_TOKENS
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.harness.predict import profile_settings

__all__ = [
    "CONTENTION_MODES",
    "HELD_OUT_DESIGN",
    "TRAIN_MODES",
    "Score",
    "Validation",
    "as_capture",
    "contention",
    "contention_records",
    "engine_step_cost",
    "predicted_config",
    "validate",
    "scores_text",
    "validate_records",
    "validation_text",
]

TRAIN_MODES: Final = ("http", "ws")
HELD_OUT_DESIGN: Final = "append"
BASE: Final = "http"
RESAMPLES: Final = 2000
TIE_S: Final = 1e-3  # apart, rollouts started together reach the engine in its measured order
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


def _median_error(pairs: list[tuple[str, float, float]], *, seed: int) -> tuple[Estimate, float]:
    """Median |p/m − 1| over (rollout, predicted, measured) pairs, bootstrap over rollouts; and
    the median signed error."""
    if not pairs:
        return Estimate(math.nan, math.nan, math.nan, 0), math.nan
    rollouts = sorted({r for r, _, _ in pairs})
    by = {r: np.array([abs(p / m - 1) for rr, p, m in pairs if rr == r]) for r in rollouts}
    every = np.concatenate(list(by.values()))
    value = float(np.median(every))
    signed = float(np.median([p / m - 1 for _, p, m in pairs]))
    if len(rollouts) < 2:
        return Estimate(value, math.nan, math.nan, len(every)), signed
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(every), 0xE11]))
    medians = [
        float(np.median(np.concatenate([by[rollouts[i]] for i in rng.integers(0, len(rollouts), len(rollouts))])))
        for _ in range(RESAMPLES)
    ]
    low, high = np.quantile(medians, [0.025, 0.975])
    return Estimate(value, float(low), float(high), len(every)), signed


def _score(
    name: str, measured: dict[tuple[str, str, int], TurnRecord], predicted: dict[tuple[str, str, int], TurnRecord],
    keys: list[tuple[str, str, int]], *, seed: int,
) -> Score:  # fmt: skip
    ttft = [
        (k[1], predicted[k].ttft_s, measured[k].ttft_s)
        for k in keys
        if k in predicted and measured[k].ttft_s and predicted[k].ttft_s
    ]
    turn = [(k[1], predicted[k].e2e_s, measured[k].e2e_s) for k in keys if k in predicted and measured[k].e2e_s > 0]
    ttft_err, bias = _median_error(ttft, seed=seed)  # type: ignore[arg-type]
    turn_err, _ = _median_error(turn, seed=seed)
    return Score(name, ttft_err, turn_err, bias, len(turn), len({k[1] for k in keys}))


def _rollout_times(records: Sequence[TurnRecord]) -> dict[tuple[str, str], float]:
    """A rollout's time from its records: its turns and the client's time between them."""
    out: dict[tuple[str, str], float] = {}
    for r in records:
        out[(r.mode, r.rollout)] = out.get((r.mode, r.rollout), 0.0) + r.e2e_s + (r.tool_s or 0.0)
    return out


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
    missing = [m for m in (*TRAIN_MODES, HELD_OUT_DESIGN) if m not in measured_config.modes]
    if missing:
        raise ValueError(f"validate needs the modes {', '.join(missing)} in the measured run")
    rollouts = sorted({r.rollout for r in measured_records}, key=int)
    if len(rollouts) < 3:
        raise ValueError(
            "validate needs at least 3 rollouts: 2 or more to fit on (one held out inside the fit), 1 held out"
        )
    n_train = max(2, min(len(rollouts) - 1, round(train_share * len(rollouts))))
    rng = np.random.default_rng(np.random.SeedSequence([seed, len(rollouts), 0xF17]))
    train = sorted(rng.choice(rollouts, size=n_train, replace=False).tolist(), key=int)
    test = [r for r in rollouts if r not in train]
    training = [r for r in measured_records if r.rollout in train and r.mode in TRAIN_MODES]
    if capture:
        training = [as_capture(r) for r in training]
    c = fit(training, holdout=0.5 if len(train) < 4 else 0.3, seed=seed)
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
    held_design = [k for k in measured if k[0] == HELD_OUT_DESIGN]
    scores = [
        _score("held-out rollouts (http, ws)", measured, predicted, held_rollouts, seed=seed),
        _score(f"held-out design ({HELD_OUT_DESIGN}, every rollout)", measured, predicted, held_design, seed=seed),
    ]
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


def _pct(e: Estimate) -> str:
    if math.isnan(e.ci_low):
        return f"{100 * e.value:.1f} % (n={e.n}: no interval)"
    return f"{100 * e.value:.1f} % (95 % CI {100 * e.ci_low:.1f}–{100 * e.ci_high:.1f}, n={e.n} turns)"


def validation_text(v: Validation) -> str:
    lines = [
        f"fit on rollouts {', '.join(v.train_rollouts)} ({', '.join(TRAIN_MODES)}); held out: rollouts "
        f"{', '.join(v.test_rollouts)} and the design {HELD_OUT_DESIGN}",
    ]
    if v.problems:
        return "\n".join([*lines, "no usable fit: " + "; ".join(v.problems)])
    model = ", ".join(f"{k} {p.value:.4g}" for k, p in v.calibration.model.items())
    lines.append(f"fitted model: {model}")
    for s in v.scores:
        lines.append(f"{s.name}, {s.rollouts} rollouts:")
        lines.append(
            f"  per-turn TTFT error (median |pred/meas − 1|): {_pct(s.ttft)}; median signed {100 * s.ttft_bias:+.1f} %"
        )
        lines.append(f"  per-turn turn-time error: {_pct(s.turn)}")
    lines.append("time saved against http, every rollout (engine measured, paired 95 % CI → simulator predicted):")
    for mode, e in v.measured_saved.items():
        p = v.predicted_saved.get(mode, math.nan)
        inside = e.ci_low <= p <= e.ci_high if not math.isnan(e.ci_low) else False
        lines.append(
            f"  {mode}: {100 * e.value:.1f} % ({100 * e.ci_low:.1f}–{100 * e.ci_high:.1f}, n={e.n}) → "
            f"{100 * p:.1f} %{'' if inside else '  (outside the measured interval)'}"
        )
    return "\n".join(lines)


# -- contention: the fleet model against the engine ------------------------------------------------

CONTENTION_MODES: Final = ("ws", "append")


def engine_step_cost(rates: dict[str, float]) -> StepCost:
    """The fleet model's step costs for an engine from its measured rates
    (`sim.engine.rates.measure`, the engine driven directly): prefill seconds per token and its
    attention term from the cold prefills of 500 and 2,000 tokens (a cold prefill of L tokens
    costs a + k × L / 2 a token: two points, two unknowns), forced decode seconds per token alone,
    and a second stream's slowdown (the free decode's aggregate at 1 stream over 2, applied to the
    forced rate)."""
    short, long = 1 / rates["prefill_cold_tok_s_at_500"], 1 / rates["prefill_cold_tok_s_at_2000"]
    ctx = max(0.0, (long - short) / ((2000 - 500) / 2))
    decode = 1 / rates["decode_forced_tok_s"]
    slowdown = rates["decode_aggregate_tok_s_1_streams"] / rates["decode_aggregate_tok_s_2_streams"]
    return StepCost(
        name="measured-engine",
        step_s=0.0,
        prefill_s_per_token=short - ctx * 500 / 2,
        prefill_s_per_token_ctx=ctx,
        decode_batch=(1, 2),
        decode_s_per_token=(decode, decode * slowdown),
        decode_s_per_ctx_token=0.0,
        token_budget=2048,
    )


def contention(result: CompareResult, cost: StepCost, *, seed: int = 0) -> list[Score]:
    """The fleet model's prediction (`sim.fleet.predict.predict_turns`) of a contention run on
    the engine (more rollouts in flight than slots), turn by turn against the measurement: the
    same rollouts' prompts, the engine's decoded tokens per turn, the client's tool times and
    start times. One score per mode and cache variant."""
    records = records_from_rollouts(result.rollouts, source="longrun-live")
    first = min((r.started_at for r in result.rollouts), default=0.0)
    starts: dict[tuple[str, str], float] = {(str(r.mode), str(r.index)): r.started_at - first for r in result.rollouts}
    return contention_records(result.config, records, result.engine_turns, cost, starts=starts, seed=seed)


def contention_records(
    config: CompareConfig,
    records: Sequence[TurnRecord],
    engine_turns: Sequence[EngineTurn],
    cost: StepCost,
    *,
    starts: dict[tuple[str, str], float] | None = None,
    seed: int = 0,
) -> list[Score]:
    """`contention` on a run's records and engine turns (a saved run folder's records.jsonl and
    engine.jsonl). Without `starts` every rollout starts at once, which a run with as many in
    flight as rollouts does (its start times are not in the records: refused otherwise)."""
    if starts is None and config.concurrency < config.rollouts:
        raise ValueError("a saved contention run must have every rollout in flight at once (--concurrency)")
    slots = config.engine.engine_slots
    by_conversation: dict[tuple[str, int], list[EngineTurn]] = {}
    for t in engine_turns:
        by_conversation.setdefault((t.tag, t.conversation_key), []).append(t)
    # The system prompt's KV (less the engine's BOS) as the engine reused it on a first turn.
    shared = max((t.cache_n - 1 for v in by_conversation.values() for t in v if t.turn_index == 0), default=0)
    scores = []
    for mode in [m for m in config.modes if m in CONTENTION_MODES]:
        engine_of = {tuple(x.prompt_tokens for x in sorted(v, key=lambda x: x.turn_index)): v
                     for (tag, _), v in by_conversation.items() if tag == mode}  # fmt: skip
        rollouts: dict[str, list[TurnRecord]] = {}
        for r in records:
            if r.mode == mode:
                rollouts.setdefault(r.rollout, []).append(r)
        prompts, outputs, tools, start_s, measured = [], [], [], [], []
        first_wait: list[float] = []
        for name in sorted(rollouts, key=int):
            turns = sorted(rollouts[name], key=lambda r: r.turn)
            engine = engine_of.get(tuple(t.prompt_tokens or 0 for t in turns))
            if engine is None or len(engine) != len(turns):
                raise ValueError(f"{mode} rollout {name}: its engine turns cannot be matched")
            out = [t.predicted_n for t in sorted(engine, key=lambda x: x.turn_index)]
            grown = [turns[0].prompt_tokens or 0]
            for k in range(1, len(turns)):  # the fleet's template is a floor on growth
                grown.append(max(turns[k].prompt_tokens or 0, grown[-1] + out[k - 1] + STEP_TEMPLATE_TOKENS))
            prompts.append(grown)
            outputs.append(out)
            tools.append([t.tool_s or 0.0 for t in turns[:-1]])
            start_s.append(starts.get((mode, name), 0.0) if starts is not None else 0.0)
            first_wait.append(min(engine, key=lambda x: x.turn_index).queued_s)
            measured.append(turns)
        # Rollouts started together reach the engine in an order the API's work decides (ms
        # apart); the engine's own order at the first turn (who waited for a slot) breaks the tie,
        # so the prediction serves the same rollouts first rather than a coin flip's.
        rank = sorted(range(len(start_s)), key=lambda i: (round(start_s[i], 2), first_wait[i]))
        for position, i in enumerate(rank):
            start_s[i] += position * TIE_S
        # The fleet's default frees a paused response's slot (vLLM); llama.cpp keeps it pinned. A
        # create turn's prefix: following the conversation (a host-RAM cache), or only what the
        # slot it lands on last served (`slot_cache`), the shared system prompt reusable from any.
        variants = [(False, False), (True, True)] if mode == "append" else [(False, False), (False, True)]
        for held_slot, slot_cache in variants:
            predicted = predict_turns(
                mode,
                slots,
                prompts,
                outputs,
                tools,
                engine=cost,
                starts_s=start_s,
                held_slot=held_slot,
                slot_cache=slot_cache,
                shared_tokens=shared,
                block_tokens=config.engine.prefix_block_tokens,
            )
            ttft, turn = [], []
            for i, (p_turns, m_turns) in enumerate(zip(predicted, measured, strict=True)):
                for p, m in zip(p_turns, m_turns, strict=True):
                    if m.ttft_s:
                        ttft.append((str(i), p.ttft_s, m.ttft_s))
                    turn.append((str(i), p.turn_s, m.e2e_s))
            ttft_err, bias = _median_error(ttft, seed=seed)
            turn_err, _ = _median_error(turn, seed=seed)
            slot = ", the paused response keeps its slot (held_slot)" if held_slot else ""
            slot += ", each slot keeps only its last sequence's KV (slot_cache)" if slot_cache else ""
            scores.append(
                Score(f"contention, {mode}: {len(measured)} rollouts on {slots} slots{slot}", ttft_err, turn_err,
                      bias, len(turn), len(measured))
            )  # fmt: skip
    return scores


def scores_text(scores: Sequence[Score]) -> str:
    lines = []
    for s in scores:
        lines.append(f"{s.name}:")
        signed = f"{100 * s.ttft_bias:+.1f} %"
        lines.append(f"  per-turn TTFT error (median |pred/meas − 1|): {_pct(s.ttft)}; median signed {signed}")
        lines.append(f"  per-turn turn-time error: {_pct(s.turn)}")
    return "\n".join(lines)
