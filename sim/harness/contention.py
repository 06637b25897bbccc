"""The fleet model against the engine under contention: more rollouts in flight than the
engine's slots, so the designs do different engine work (docs/validation.md, "Contention").

`contention` takes a run measured live on a real engine with every rollout in flight at once
(`concurrency` ≥ `rollouts`) and:

1. **fits** longrun's model of the turn (`sim.analysis.calibrate.fit`) on the `http` and `ws`
   turns the run measured, of the *training* rollouts only (`validate`'s seeded split), and
   turns the fit's four model rates into the fleet model's step costs
   (`sim.fleet.compute.model_step_cost`): under verified decoding, each decoding turn's pass of k
   tokens shares a step with the other slots' work, as the engine batches it (the run's k, from
   its config);
2. **predicts** every measured mode with the fleet model (`sim.fleet.predict.predict_turns`): the
   same rollouts' prompts, the engine's decoded tokens per turn, the client's tool times, and
   the arrival order of the config (`stagger_s`: rollout i starts i × stagger_s after the
   first). Which slot semantics it runs is the engine kind's (`EngineConfig.pinned_slots`:
   llama.cpp's slot is one sequence and its KV), not a choice made after seeing the engine;
3. **scores** the held-out turns: the held-out rollouts of `http` and `ws`, and each held-out
   design (`append`, `agents`) on the held-out rollouts: n as turns and rollouts, the median
   per-turn error with its bootstrap interval over rollouts, its p90 and max.

Nothing the prediction is meant to predict is read from the engine's measurement. A run saved
without a stagger (its rollouts started together; the order they reached the engine was the
event loop's) is scored over every order of its rollouts (the median of the per-order median
errors and their range), or, as a named what-if, in the order the engine measured.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from sim.analysis.calibrate import Calibration
from sim.analysis.records import TurnRecord, read_records, records_from_rollouts
from sim.analysis.stats import Estimate
from sim.engine.config import EngineConfig
from sim.engine.model import EngineTurn
from sim.fleet.compute import StepCost, model_step_cost
from sim.fleet.predict import TurnPrediction, predict_turns
from sim.fleet.sessions import STEP_TEMPLATE_TOKENS
from sim.harness.experiment import CompareConfig, CompareResult
from sim.harness.trace import read_config, read_engine_turns
from sim.harness.validate import (
    POOR_FIT,
    Score,
    fit_training,
    pct_text,
    score_lines,
    score_pairs,
    score_records,
    split_rollouts,
)
from sim.model.config import ModelConfig

__all__ = [
    "CONTENTION_MODES",
    "HELD_OUT_DESIGNS",
    "MAX_ORDER_ROLLOUTS",
    "WHAT_IFS",
    "Contention",
    "Replicate",
    "SlotRules",
    "contention",
    "contention_records",
    "contention_text",
    "fitted_step_cost",
    "saved_contention",
]

TRAIN_MODES: Final = ("http", "ws")
HELD_OUT_DESIGNS: Final = ("append", "agents")
CONTENTION_MODES: Final = (*TRAIN_MODES, *HELD_OUT_DESIGNS)
TIE_S: Final = 1e-3  # an unstaggered run's order: its rollouts this far apart, in that order
MAX_ORDER_ROLLOUTS: Final = 6  # every order of an unstaggered run's rollouts: 720 at 6, too many past it
NEEDED_RATES: Final = ("prefill_tok_per_s", "tps")  # the fit must identify these alone to price a step
# The named what-ifs of `contention_records` as `python -m sim validate --contention` takes them:
# the option, the keyword, what it does.
WHAT_IFS: Final = (
    (
        "--other-slots",
        "other_slots",
        "predict with the other engine kind's slots (llama.cpp's pinned slots for an OpenAI-compatible engine, "
        "vLLM's paged KV for llama.cpp)",
    ),
    (
        "--one-token-decode",
        "one_token_decode",
        "price a verified run's decode a token a step, as ordinary decoding, not in the engine's passes of k "
        "tokens, each sharing a step with the other slots' work",
    ),
    (
        "--no-round-trip",
        "no_round_trip",
        "a verified run's passes without the client's round trip: a pass answered at a step's end joins the next "
        "step even when that step starts on other work",
    ),
    (
        "--no-host-cache",
        "no_host_cache",
        "llama.cpp's slots without the host-RAM prompt cache a run had on, whose rule saves a slot's long last "
        "prompt when another conversation takes the slot",
    ),
)


@dataclass(frozen=True, slots=True)
class SlotRules:
    """The fleet model's slot semantics (`predict_turns`): `held_slot`, a paused response keeps
    its slot; `slot_cache`, a create finds only the KV the slot it lands on last served."""

    held_slot: bool
    slot_cache: bool

    @classmethod
    def of(cls, engine: EngineConfig, *, other: bool = False) -> SlotRules:
        """The engine kind's semantics; `other`: the what-if of the other kind's."""
        pinned = engine.pinned_slots != other
        return cls(held_slot=pinned, slot_cache=pinned)

    def text(self) -> str:
        if self.held_slot:
            return "pinned slots (a paused response keeps its slot; a slot keeps only its last sequence's KV)"
        return "paged KV (a paused response frees its slot; the prefix cache follows each conversation)"


@dataclass(frozen=True, slots=True)
class Contention:
    calibration: Calibration
    cost: StepCost | None  # the step costs from the fit (None: no usable fit)
    rules: SlotRules
    arrival: str  # where the arrival order came from
    notes: list[str]  # named what-ifs (departures from the engine kind's slots and the config's order), failed rollouts
    scores: list[Score]
    train_rollouts: list[str]
    test_rollouts: list[str]
    orders: int = 1  # arrival orders scored (an unstaggered run: every order)
    # Per score, over the orders: the range of the median TTFT and turn-time errors.
    ranges: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    fit_source: str = ""  # a fit made on another run (`--fit-from`): that run's folder; "": this run's
    # The engine against itself: per held-out set, a replicate run's turns (the same config and
    # seed measured again) scored against this run's, as a prediction would be (`replicate_source`).
    floor: list[Score] = field(default_factory=list)
    replicate_source: str = ""


def fit_elsewhere(records: Sequence[TurnRecord], *, seed: int = 0) -> Calibration:
    """A fit on another run's `http` and `ws` turns (every rollout of it; the fit keeps its own
    hold-out): the engine's rates measured where its streams did not share it."""
    training = [r for r in records if r.mode in TRAIN_MODES]
    rollouts = {r.rollout for r in training}
    return fit_training(training, rollouts=len(rollouts), seed=seed)


def fitted_step_cost(c: Calibration, slots: int, *, verify_k: int = 1, round_trip: bool = False) -> StepCost:
    """The fleet model's step costs from a fit's model rates: latency, prefill rate, attention
    term and decode rate, each stream at the fitted rate (`model_step_cost`, the conversion's
    one place); `verify_k` > 1, verified decoding's passes of that many tokens, with
    `round_trip` each request after its answer (`StepCost.request_round_trip`). A rate the fit
    did not identify on its own is refused; an unidentified latency or attention term is 0."""
    missing = [k for k in NEEDED_RATES if k not in c.model]
    if missing:
        raise ValueError(f"the fit identifies no {', '.join(missing)} alone: no step cost to predict with")
    value = {k: p.value for k, p in c.model.items()}
    model = ModelConfig(
        tps=value["tps"],
        prefill_tok_per_s=value["prefill_tok_per_s"],
        model_latency_s=value.get("model_latency_s", 0.0),
        prefill_s_per_token_ctx=value.get("prefill_s_per_token_ctx", 0.0),
    )
    return model_step_cost(
        model, slots=slots, name="fitted", decode_tokens_per_step=verify_k, request_round_trip=round_trip
    )


@dataclass(frozen=True, slots=True)
class _Mode:
    """One mode's rollouts as the fleet model reads them, in rollout order."""

    names: list[str]
    prompts: list[list[int]]
    outputs: list[list[int]]
    tools: list[list[float]]
    first_wait: list[float]  # the engine's measured wait for a slot at each first turn (a what-if reads it)
    measured: list[list[TurnRecord]]


def _mode_rollouts(mode: str, records: Sequence[TurnRecord], engine_turns: Sequence[EngineTurn]) -> _Mode:
    by_conversation: dict[int, list[EngineTurn]] = {}
    for t in engine_turns:
        if t.tag == mode:
            by_conversation.setdefault(t.conversation_key, []).append(t)
    engine_of = {
        tuple(x.prompt_tokens for x in sorted(v, key=lambda x: x.turn_index)): v for v in by_conversation.values()
    }
    rollouts: dict[str, list[TurnRecord]] = {}
    for r in records:
        if r.mode == mode:
            rollouts.setdefault(r.rollout, []).append(r)
    out = _Mode([], [], [], [], [], [])
    for name in sorted(rollouts, key=int):
        turns = sorted(rollouts[name], key=lambda r: r.turn)
        engine = engine_of.get(tuple(t.prompt_tokens or 0 for t in turns))
        if engine is None or len(engine) != len(turns):
            raise ValueError(f"{mode} rollout {name}: its engine turns cannot be matched")
        engine = sorted(engine, key=lambda x: x.turn_index)
        decoded = [t.predicted_n for t in engine]
        grown = [turns[0].prompt_tokens or 0]
        for k in range(1, len(turns)):  # the fleet's template is a floor on growth
            grown.append(max(turns[k].prompt_tokens or 0, grown[-1] + decoded[k - 1] + STEP_TEMPLATE_TOKENS))
        out.names.append(name)
        out.prompts.append(grown)
        out.outputs.append(decoded)
        out.tools.append([t.tool_s or 0.0 for t in turns[:-1]])
        out.first_wait.append(engine[0].queued_s)
        out.measured.append(turns)
    return out


def _orders(config: CompareConfig, rollouts: int, *, measured_order: bool) -> tuple[str, list[str]]:
    """Where the arrival order comes from, and the what-if that names it (if any)."""
    if config.stagger_s > 0:
        if measured_order:
            raise ValueError("a staggered run's order is its config's: there is no measured order to take")
        return f"the config's: rollout i starts i × {config.stagger_s:g} s after the first", []
    if measured_order:
        what_if = "what-if: the order the rollouts reached the engine, read from its measurement (first turns' waits)"
        return "the engine's measured order (a what-if)", [what_if]
    if rollouts > MAX_ORDER_ROLLOUTS:
        raise ValueError(
            f"a run without a stagger is scored over every order of its rollouts, at most {MAX_ORDER_ROLLOUTS}; "
            f"it has {rollouts}: run it with --stagger-s"
        )
    return f"none in the run (no stagger): every order of its {rollouts} rollouts scored", []


def contention(result: CompareResult, **options: object) -> Contention:
    """`contention_records` on a comparison's result (module doc)."""
    records = records_from_rollouts(result.rollouts, source="longrun-live")
    return contention_records(result.config, records, result.engine_turns, **options)  # type: ignore[arg-type]


def contention_records(
    config: CompareConfig,
    records: Sequence[TurnRecord],
    engine_turns: Sequence[EngineTurn],
    *,
    train_share: float = 0.5,
    seed: int = 0,
    other_slots: bool = False,
    measured_order: bool = False,
    one_token_decode: bool = False,
    no_round_trip: bool = False,
    no_host_cache: bool = False,
    calibration: Calibration | None = None,
    fit_source: str = "",
    replicate: Replicate | None = None,
) -> Contention:
    """The contention check on a run's records and engine turns (a run folder's records.jsonl
    and engine.jsonl). `other_slots`: the what-if of the other engine kind's slot semantics;
    `measured_order` (a run without a stagger): the what-if of the engine's measured order;
    `one_token_decode`: the what-if of a verified run's decode priced as ordinary decoding (a
    token a step); `no_round_trip`: the what-if of a verified run's passes each in the step
    after its last, the client's round trip left out; `no_host_cache`: the what-if of
    llama.cpp's slots without the host-RAM prompt cache the run had on.
    `calibration`: a fit made elsewhere (`fit_elsewhere`: another run of the same engine, one
    rollout a slot; `fit_source` names it) instead of one on this run's training rollouts, every
    score still on this run's held-out rollouts.
    `replicate`: the same config and seed measured again; each held-out set's turns of it are
    scored against this run's as a prediction is (the engine against itself: the error no
    model of this engine can beat on these turns)."""
    if config.engine.engine_kind == "none":
        raise ValueError("the contention check needs a run measured live on a real engine (--engine)")
    if config.concurrency < config.rollouts or config.ci_width > 0:
        raise ValueError("a contention run has every rollout of a mode in flight at once (--concurrency ≥ --rollouts)")
    modes = [m for m in config.modes if m in CONTENTION_MODES]
    train_modes = [m for m in modes if m in TRAIN_MODES]
    if not train_modes:
        raise ValueError("the contention check fits on http or ws turns: the run measured neither")
    rollouts = sorted({r.rollout for r in records if r.mode in modes}, key=int)
    if len(rollouts) < 3:
        raise ValueError("the contention check needs at least 3 rollouts: 2 or more to fit on, 1 held out")
    arrival, notes = _orders(config, len(rollouts), measured_order=measured_order)
    rules = SlotRules.of(config.engine, other=other_slots)
    if other_slots:
        notes.append(f"what-if: the other engine kind's slots, {rules.text()}")
    verify_k, round_trip, host = _priced_engine(
        config.engine, rules, one_token_decode=one_token_decode, no_round_trip=no_round_trip,
        no_host_cache=no_host_cache, notes=notes,
    )  # fmt: skip
    train, test = split_rollouts(rollouts, train_share, seed=seed)
    if replicate is not None and replicate.config != config:
        raise ValueError(f"the replicate {replicate.source} is not a run of the same config and seed")
    training = [r for r in records if r.rollout in train and r.mode in train_modes]
    c = fit_training(training, rollouts=len(train), seed=seed) if calibration is None else calibration
    blocking = [p for p in c.problems if not p.startswith(POOR_FIT)]
    slots = config.engine.engine_slots
    try:
        cost = None if blocking else fitted_step_cost(c, slots, verify_k=verify_k, round_trip=round_trip)
    except ValueError as exc:
        blocking, cost = [str(exc)], None
    if cost is None:
        return Contention(c, None, rules, arrival, notes, [], train, test, problems=blocking, fit_source=fit_source)
    by_mode = {m: _mode_rollouts(m, records, engine_turns) for m in modes}
    for m in modes:  # a failed rollout has no records: predicted without it, and said so
        gone = [r for r in rollouts if r not in by_mode[m].names]
        if gone:
            notes.append(f"{m}: rollouts {', '.join(gone)} failed; predicted without their load on the engine")
    # The system prompt's KV (less the engine's BOS) as the engine reused it on a first turn: a
    # count of the workload, the same in every order.
    shared = max((t.cache_n - 1 for t in engine_turns if t.turn_index == 0), default=0)

    def predicted(mode: str, position: dict[str, int]) -> list[list[TurnPrediction]]:
        m = by_mode[mode]
        spacing = config.stagger_s if config.stagger_s > 0 else TIE_S
        starts = [position[name] * spacing for name in m.names]
        return predict_turns(
            mode, slots, m.prompts, m.outputs, m.tools, engine=cost, starts_s=starts,
            held_slot=rules.held_slot, slot_cache=rules.slot_cache, shared_tokens=shared,
            block_tokens=config.engine.prefix_block_tokens, host_cache_tokens=host,
        )  # fmt: skip

    sets = [(f"held-out rollouts ({', '.join(train_modes)})", train_modes)]
    sets += [(f"held-out design ({d}, held-out rollouts)", [d]) for d in modes if d in HELD_OUT_DESIGNS]
    # Each order: per mode, each rollout's position among those started together.
    if config.stagger_s > 0:  # the config's: a rollout's index (one group: every rollout in flight)
        orders = [{m: {name: int(name) for name in by_mode[m].names} for m in modes}]
    elif measured_order:  # each mode's rollouts in the order their first turns got a slot
        orders = [{m: _ranks(by_mode[m].names, by_mode[m].first_wait) for m in modes}]
    else:
        orders = [dict.fromkeys(modes, {name: p for p, name in enumerate(o)}) for o in itertools.permutations(rollouts)]
    per_order: list[list[Score]] = []
    one = len(orders) == 1  # one order: each median with its interval; many: their range instead
    for order in orders:
        runs = {m: predicted(m, order[m]) for m in modes}
        per_order.append([_set_score(name, members, by_mode, runs, test, seed, one) for name, members in sets])
    scores, ranges = (per_order[0], {}) if len(per_order) == 1 else _over_orders(per_order)
    floor = [_floor_score(name, members, records, replicate, test, seed) for name, members in sets] if replicate else []
    return Contention(
        c, cost, rules, arrival, notes, scores, train, test, orders=len(orders), ranges=ranges, fit_source=fit_source,
        floor=floor, replicate_source=replicate.source if replicate else "",
    )  # fmt: skip


def saved_contention(folder: Path, *, replicate: Path | None = None, **options: object) -> Contention:
    """`contention_records` on a saved run folder (`write_run`'s config.json, records.jsonl and
    engine.jsonl), its seed; `replicate`: a second folder, the same config and seed measured again."""
    config = read_config(folder)
    again = None if replicate is None else Replicate(str(replicate), read_config(replicate), read_records([replicate]))
    turns, records = read_engine_turns(folder), read_records([folder])  # a run without engine.jsonl: named first
    return contention_records(config, records, turns, seed=config.seed, replicate=again, **options)  # type: ignore[arg-type]


def _priced_engine(
    engine: EngineConfig, rules: SlotRules, *, one_token_decode: bool, no_round_trip: bool, no_host_cache: bool,
    notes: list[str],
) -> tuple[int, bool, int]:  # fmt: skip
    """What the run's engine config says the fleet model prices: the tokens of a verified pass
    (1: ordinary decoding), whether its requests pay the client's round trip (every verified
    run's do), and llama.cpp's host-RAM prompt cache in tokens (0: none; with `--cache-ram` on,
    the server's whole context, the byte limit of a positive size not modelled). A what-if
    that changes any is added to `notes`."""
    verify_k = engine.engine_verify_k if engine.engine_decode == "verified" else 1
    if one_token_decode and verify_k > 1:
        notes.append(f"what-if: the decode priced a token a step, not in the engine's verified passes of {verify_k}")
        verify_k = 1
    round_trip = verify_k > 1
    if no_round_trip and round_trip:
        notes.append("what-if: the passes without the client's round trip, each in the step after its last")
        round_trip = False
    host, ctx = 0, engine.engine_ctx_per_slot
    if rules.slot_cache and engine.engine_cache_ram_mib != 0 and ctx is not None:  # a run sizes its slots
        host = engine.engine_slots * ctx
        if no_host_cache:
            notes.append("what-if: llama.cpp's slots without the host-RAM prompt cache the run had on")
            host = 0
    return verify_k, round_trip, host


@dataclass(frozen=True, slots=True)
class Replicate:
    """A second engine run of the same config and seed (`source` names it): its config and turns."""

    source: str
    config: CompareConfig
    records: Sequence[TurnRecord]


def _floor_score(
    name: str, members: Sequence[str], records: Sequence[TurnRecord], replicate: Replicate, test: Sequence[str],
    seed: int,
) -> Score:  # fmt: skip
    """One held-out set's turns of the replicate against the run's, each (mode, rollout, turn)
    measured in both (a rollout failed in either is left out), scored as a prediction is."""
    run = {(r.mode, r.rollout, r.turn): r for r in records if r.mode in members and r.rollout in test}
    again = {(r.mode, r.rollout, r.turn): r for r in replicate.records}
    return score_records(name, run, again, [k for k in run if k in again], seed=seed)


def _ranks(names: Sequence[str], waits: Sequence[float]) -> dict[str, int]:
    ranked = sorted(range(len(names)), key=waits.__getitem__)
    return {names[i]: rank for rank, i in enumerate(ranked)}


def _set_score(
    name: str,
    members: Sequence[str],
    by_mode: dict[str, _Mode],
    runs: dict[str, list[list[TurnPrediction]]],
    test: Sequence[str],
    seed: int,
    interval: bool,
) -> Score:
    ttft: list[tuple[str, float, float]] = []
    turn: list[tuple[str, float, float]] = []
    for mode in members:
        m = by_mode[mode]
        for rollout, p_turns, m_turns in zip(m.names, runs[mode], m.measured, strict=True):
            if rollout not in test:
                continue
            for p, r in zip(p_turns, m_turns, strict=True):
                if r.ttft_s:
                    ttft.append((rollout, p.ttft_s, r.ttft_s))
                if r.e2e_s > 0:
                    turn.append((rollout, p.turn_s, r.e2e_s))
    return score_pairs(name, ttft, turn, rollouts=len({r for r, _, _ in turn}), seed=seed, interval=interval)


def _over_orders(per_order: list[list[Score]]) -> tuple[list[Score], dict[str, tuple[float, float, float, float]]]:
    """Per set, the median over orders of each figure (no interval: the spread is the orders'
    range, kept beside)."""
    scores, ranges = [], {}
    for column in zip(*per_order, strict=True):
        first = column[0]

        def med(values: list[float]) -> float:
            return float(np.median(values))

        ttft = [s.ttft.value for s in column]
        turn = [s.turn.value for s in column]
        scores.append(
            Score(
                first.name,
                Estimate(med(ttft), math.nan, math.nan, first.ttft.n),
                Estimate(med(turn), math.nan, math.nan, first.turn.n),
                med([s.ttft_bias for s in column]),
                first.turns,
                first.rollouts,
                med([s.ttft_p90 for s in column]),
                med([s.ttft_max for s in column]),
                med([s.turn_p90 for s in column]),
                med([s.turn_max for s in column]),
            )
        )
        ranges[first.name] = (min(ttft), max(ttft), min(turn), max(turn))
    return scores, ranges


def contention_text(v: Contention) -> str:
    c = v.calibration
    where = f"another run's rollouts ({v.fit_source})" if v.fit_source else f"rollouts {', '.join(v.train_rollouts)}"
    lines = [
        f"fit on {where} ({', '.join(c.modes)}): its coefficients from rollouts {', '.join(c.train_rollouts)}, its "
        f"own hold-out {', '.join(c.test_rollouts)}; held out here: rollouts {', '.join(v.test_rollouts)}",
    ]
    if v.problems:
        return "\n".join([*lines, "no usable fit: " + "; ".join(v.problems)])
    model = ", ".join(f"{k} {p.value:.4g}" for k, p in v.calibration.model.items())
    lines.append(f"fitted model (the fleet model's step costs): {model}")
    lines.append(f"slots: {v.rules.text()}")
    if v.cost is not None and v.cost.decode_tokens_per_step > 1:
        trip = ", sent when the last is answered" if v.cost.request_round_trip else ""
        lines.append(
            f"decode: the engine's verified passes of {v.cost.decode_tokens_per_step} tokens{trip}, each priced as "
            "a prefill of its tokens in a step beside the other slots' work"
        )
    lines.append(f"arrival order: {v.arrival}")
    lines.extend(v.notes)
    floor = {f.name: f for f in v.floor}
    for s in v.scores:
        lines.append(f"contention, {s.name}, {s.turns} turns of {s.rollouts} rollouts:")
        if s.name in floor:
            f = floor[s.name]
            lines.append(
                f"  the engine against itself ({v.replicate_source}, the same config and seed; {f.turns} turns "
                f"of {f.rollouts} rollouts): TTFT {pct_text(f.ttft, f.ttft_p90, f.ttft_max)}"
            )
            lines.append(f"  the engine against itself, turn time: {pct_text(f.turn, f.turn_p90, f.turn_max)}")
        if s.name in v.ranges:
            lo, hi, tlo, thi = v.ranges[s.name]
            lines.append(
                f"  per-turn TTFT error, median over {v.orders} orders: {100 * s.ttft.value:.1f} % (range "
                f"{100 * lo:.1f}–{100 * hi:.1f}); p90 {100 * s.ttft_p90:.1f} %, max {100 * s.ttft_max:.1f} %; "
                f"median signed {100 * s.ttft_bias:+.1f} %"
            )
            lines.append(
                f"  per-turn turn-time error, median over {v.orders} orders: {100 * s.turn.value:.1f} % (range "
                f"{100 * tlo:.1f}–{100 * thi:.1f}); p90 {100 * s.turn_p90:.1f} %, max {100 * s.turn_max:.1f} %"
            )
            continue
        lines.extend(score_lines(s))
    return "\n".join(lines)
