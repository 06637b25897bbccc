"""The fleet model against the engine under contention (sim/harness/contention.py): the fit's
rates as step costs, the arrival order from the config and never from the measurement, the
engine kind's slot semantics, and the committed engine runs scored again."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from sim.__main__ import main
from sim.analysis.calibrate import Param
from sim.analysis.records import TurnRecord, read_records, records_from_rollouts
from sim.engine.model import EngineTurn
from sim.fleet.compute import model_step_cost
from sim.harness.contention import (
    Contention,
    Replicate,
    SlotRules,
    contention_records,
    contention_text,
    fit_elsewhere,
    fitted_step_cost,
    saved_contention,
)
from sim.harness.experiment import CompareConfig, compare
from sim.harness.trace import read_config, read_engine_turns
from sim.model.config import ModelConfig
from tests.support import REPO

pytestmark = pytest.mark.timeout(300)

# A contention run the simulator makes, standing in for the engine's: 4 rollouts of each mode in
# flight on 2 decode slots, started 0.3 s apart (the hosted profile: the fit has API stages to fit).
RUN = CompareConfig.of(
    modes=("http", "ws", "append"),
    profile="hosted",
    rollouts=4,
    concurrency=4,
    stagger_s=0.3,
    decode_slots=2,
    tool_calls=2,
    tool_time_s=0.5,
    system_prompt_tokens=600,
    tool_output_tokens=120,
    tps=40.0,
    prefill_tok_per_s=400.0,
    model_latency_s=0.02,
    seed=3,
)
MODES = {"http": 0, "ws": 1, "append": 2}


def _engine_turns(records: list[TurnRecord], waits: dict[tuple[str, str], float]) -> list[EngineTurn]:
    """The engine's own per-turn counters as a llama.cpp run would log them for these turns;
    `waits`: each first turn's wait for a slot."""
    return [
        EngineTurn(
            tag=r.mode,
            conversation_key=1000 * MODES[r.mode] + int(r.rollout),
            turn_index=r.turn,
            slot=0,
            resident=False,
            prompt_tokens=r.prompt_tokens or 0,
            prompt_n=(r.uncached_tokens or 0) + 1,
            cache_n=(r.cached_tokens or 0) + 1,
            prompt_ms=0.0,
            predicted_n=r.output_tokens or 1,
            predicted_ms=0.0,
            queued_s=waits.get((r.mode, r.rollout), 0.0) if r.turn == 0 else 0.0,
            ttft_s=r.ttft_s or 0.0,
            total_s=r.e2e_s,
        )
        for r in records
    ]


@pytest.fixture(scope="module")
def measured() -> list[TurnRecord]:
    return records_from_rollouts(compare(RUN, virtual=True, free_cpu=True).rollouts, source="longrun-live")


def _waits(order: list[int]) -> dict[tuple[str, str], float]:
    """First-turn waits that rank the rollouts in `order` (the first listed waited least)."""
    return {(mode, str(i)): 0.1 * rank for mode in MODES for rank, i in enumerate(order)}


@pytest.mark.slow  # a calibration fit per scoring
def test_the_prediction_reads_no_measured_order(measured: list[TurnRecord]) -> None:
    """A staggered run's prediction takes its starts from the config: permuting the engine's
    measured first-turn waits leaves it as it is. The what-if that reads them is named."""
    as_engine = RUN.updated(engine_kind="llamacpp")
    scored = [
        contention_records(as_engine, measured, _engine_turns(measured, _waits(order)), seed=0)
        for order in ([0, 1, 2, 3], [3, 1, 0, 2])
    ]
    assert not scored[0].problems, scored[0].problems
    assert scored[0].scores == scored[1].scores and scored[0].orders == 1
    names = [s.name for s in scored[0].scores]
    assert names == ["held-out rollouts (http, ws)", "held-out design (append, held-out rollouts)"]
    test = scored[0].test_rollouts
    assert test and set(test).isdisjoint(scored[0].train_rollouts)
    for s in scored[0].scores:  # n as turns and rollouts, of the held-out rollouts only
        assert s.rollouts == len(test) and s.turns == len(test) * 3 * (2 if "http" in s.name else 1)
        assert s.ttft_p90 >= s.ttft.value and s.ttft_max >= s.ttft_p90
    text = contention_text(scored[0])
    assert "arrival order: the config's: rollout i starts i × 0.3 s after the first" in text and "what-if" not in text
    # Unstaggered, the same turns are scored over every order: the waits are not read either ...
    unstaggered = as_engine.updated(stagger_s=0.0)
    every = [
        contention_records(unstaggered, measured, _engine_turns(measured, _waits(order)), seed=0)
        for order in ([0, 1, 2, 3], [3, 1, 0, 2])
    ]
    assert every[0].orders == 24 and every[0].scores == every[1].scores and every[0].ranges == every[1].ranges
    low, high, _, _ = every[0].ranges["held-out rollouts (http, ws)"]
    assert low <= every[0].scores[0].ttft.value <= high
    # ... and the what-if that takes the engine's order does read them, and says so.
    what_if = [
        contention_records(unstaggered, measured, _engine_turns(measured, _waits(order)), seed=0, measured_order=True)
        for order in ([0, 1, 2, 3], [3, 2, 1, 0])
    ]
    assert what_if[0].scores != what_if[1].scores
    assert "what-if: the order the rollouts reached the engine" in contention_text(what_if[0])
    with pytest.raises(ValueError, match="no measured order"):
        contention_records(as_engine, measured, _engine_turns(measured, {}), measured_order=True)
    # A rollout that failed mid-run has no records: the others are predicted, and the text says so.
    survived = [r for r in measured if (r.mode, r.rollout) != ("ws", "1")]
    partial = contention_records(as_engine, survived, _engine_turns(survived, {}), seed=0)
    assert not partial.problems and "ws: rollouts 1 failed" in contention_text(partial)


def test_the_slots_follow_the_engine_kind() -> None:
    """llama.cpp's slot is one sequence and its KV; an OpenAI-compatible engine (vLLM) pages KV
    apart from its sequences; the other kind's semantics only as a named what-if."""
    llamacpp = CompareConfig.of(engine_kind="llamacpp").engine
    openai = CompareConfig.of(engine_kind="openai", engine_url="http://127.0.0.1:8000").engine
    assert SlotRules.of(llamacpp) == SlotRules(held_slot=True, slot_cache=True)
    assert SlotRules.of(openai) == SlotRules(held_slot=False, slot_cache=False)
    assert SlotRules.of(llamacpp, other=True) == SlotRules.of(openai)
    assert SlotRules.of(openai, other=True) == SlotRules.of(llamacpp)


def test_the_step_cost_comes_from_the_fit() -> None:
    """The fit's four model rates are the step costs (one conversion, `model_step_cost`); a fit
    that does not identify a decode or prefill rate alone is refused."""
    rates = {"model_latency_s": 0.15, "prefill_tok_per_s": 285.0, "prefill_s_per_token_ctx": 5e-7, "tps": 10.0}
    c = SimpleNamespace(model={k: Param(v, v, v) for k, v in rates.items()})
    cost = fitted_step_cost(c, 2)  # type: ignore[arg-type]
    assert cost == model_step_cost(ModelConfig(**rates), slots=2, name="fitted")
    assert cost.prefill_alone_s(700, 330) == pytest.approx(0.15 + 330 / 285 + 5e-7 * 330 * (700 + 165))
    assert cost.decode_s(1) == cost.decode_s(2) == pytest.approx(0.1)  # each stream at the fitted rate
    verified = fitted_step_cost(c, 2, verify_k=64)  # type: ignore[arg-type]
    assert verified == msgspec.structs.replace(cost, decode_tokens_per_step=64)
    del c.model["tps"]
    with pytest.raises(ValueError, match="no tps"):
        fitted_step_cost(c, 2)  # type: ignore[arg-type]


def _saved(run: str) -> tuple[CompareConfig, list[TurnRecord], list[EngineTurn]]:
    folder = REPO / "docs" / "results" / "engine" / run
    config = read_config(folder)
    turns = read_engine_turns(folder)
    return config, read_records([folder]), turns


def _on_each_fit(run: str, fit_run: str, what_ifs: tuple[str, ...]) -> dict[str, Contention]:
    """A committed run scored on its own fit ("own"), on the same day's uncontended run ("same
    day"), and on that fit with each what-if (keywords of `contention_records`, "+" between two
    taken together), each score on the 32 held-out `http`/`ws` turns and the 16 `append` turns of
    4 rollouts."""
    engine = REPO / "docs" / "results" / "engine"
    same_day: dict[str, Any] = {"calibration": fit_elsewhere(read_records([engine / fit_run]))}
    out = {"own": saved_contention(engine / run), "same day": saved_contention(engine / run, **same_day)}
    out.update((w, saved_contention(engine / run, **same_day, **dict.fromkeys(w.split("+"), True))) for w in what_ifs)
    for v in out.values():
        held, design = v.scores
        assert (held.turns, held.rollouts, design.turns, design.rollouts) == (32, 4, 16, 4)
    return out


# The page's figures (docs/validation.md, "Contention"): per committed run, the median over the
# 24 orders of the median per-turn TTFT error, held-out ws rollouts and held-out append rollouts.
PAGE: dict[str, tuple[float, float]] = {"contention": (0.335, 0.196), "contention-2": (0.378, 0.114)}


@pytest.mark.slow  # a calibration fit per run
@pytest.mark.parametrize("run", ["contention", "contention-2"])
def test_a_saved_contention_run_is_scored_again_without_the_engine(run: str) -> None:
    """The committed engine runs had no stagger: each is scored over every order of its 4
    rollouts, on the fit of two rollouts' ws turns, with llama.cpp's pinned slots."""
    config, records, turns = _saved(run)
    v = contention_records(config, records, turns, seed=config.seed)
    assert not v.problems and v.orders == 24 and v.rules == SlotRules(held_slot=True, slot_cache=True)
    ws, append = v.scores
    assert (ws.name, ws.turns, ws.rollouts) == ("held-out rollouts (ws)", 8, 2)
    assert (ws.ttft.value, append.ttft.value) == pytest.approx(PAGE[run], abs=0.001)
    with pytest.raises(ValueError, match="in flight"):
        contention_records(config.updated(concurrency=2), records, turns)


def test_the_cli_scores_a_saved_contention_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = REPO / "docs" / "results" / "engine" / "contention"
    assert main(["validate", "--contention", "--from", str(folder), "--measured-order"]) == 0
    out = capsys.readouterr().out
    assert out.count("per-turn TTFT error") == 2 and "what-if: the order the rollouts reached the engine" in out
    assert "p90" in out and "8 turns of 2 rollouts" in out
    # A folder without the engine's turns: one line naming the file, no traceback.
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert main(["validate", "--contention", "--from", str(tmp_path)]) == 2
    assert "engine.jsonl" in capsys.readouterr().err


# The page's figures for the fresh staggered runs (docs/validation.md): the median per-turn TTFT
# error of held-out http/ws rollouts and of the held-out design append, on the run's own fit and
# on a fit of the same engine's uncontended run (`--fit-from`, a variant chosen after looking at
# `contention-fast`; `contention-fast-2`, seed 1, is its check on a fresh run).
FRESH: dict[tuple[str, str], tuple[float, float]] = {
    ("contention-fast", "own fit"): (0.516, 0.701),
    ("contention-fast", "uncontended fit"): (0.071, 0.125),
    ("contention-fast-2", "own fit"): (0.897, 0.731),
    ("contention-fast-2", "uncontended fit"): (0.312, 0.398),
}


@pytest.mark.slow  # two calibration fits a run
@pytest.mark.parametrize("run", ["contention-fast", "contention-fast-2"])
def test_the_fresh_contention_runs_score_as_the_page_says(run: str, capsys: pytest.CaptureFixture[str]) -> None:
    config, records, turns = _saved(run)
    own = contention_records(config, records, turns, seed=config.seed)
    assert own.orders == 1 and not own.fit_source  # the config's order: one prediction, one score
    uncontended = REPO / "docs" / "results" / "engine" / "curve-t1" / "verified-k64"
    elsewhere = contention_records(
        config, records, turns, seed=config.seed,
        calibration=fit_elsewhere(read_records([uncontended])), fit_source=str(uncontended),
    )  # fmt: skip
    for name, v in (("own fit", own), ("uncontended fit", elsewhere)):
        held, design = v.scores
        assert (held.turns, held.rollouts, design.turns, design.rollouts) == (32, 4, 16, 4)
        assert (held.ttft.value, design.ttft.value) == pytest.approx(FRESH[run, name], abs=0.001)
        assert held.ttft_bias > 0  # the fleet model slower than the engine, on every fit
    assert main(["validate", "--contention", "--from", str(REPO / "docs" / "results" / "engine" / run),
                 "--fit-from", str(uncontended)]) == 0  # fmt: skip
    assert "fit on another run's rollouts" in capsys.readouterr().out
    # A --fit-from that is no run: one line, before anything is scored.
    assert main(["validate", "--contention", "--fit-from", "/nonexistent", "--stagger-s", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fit-from /nonexistent" in err


@pytest.mark.slow  # three calibration fits
def test_the_third_contention_run_scores_as_the_page_says_on_each_fit() -> None:
    """`contention-3` (docs/validation.md): the fit on the same day's uncontended run
    (`uncontended-s3`) against the run's own and the other day's curve point."""
    config, records, turns = _saved("contention-3")
    engine = REPO / "docs" / "results" / "engine"
    medians = {}
    for name, source in (("own", None), ("same day", "uncontended-s3"), ("other day", "curve-t1/verified-k64")):
        extra: dict[str, Any] = {}
        if source is not None:
            extra = {"calibration": fit_elsewhere(read_records([engine / source])), "fit_source": source}
        v = contention_records(config, records, turns, seed=config.seed, **extra)
        assert v.cost is not None and v.cost.decode_tokens_per_step == config.engine.engine_verify_k == 64
        held, design = v.scores
        assert (held.turns, held.rollouts, design.turns, design.rollouts) == (32, 4, 16, 4)
        medians[name] = (held.ttft.value, design.ttft.value)
    # The what-if of the decode at a token a step, as the fleet priced it before.
    one = contention_records(config, records, turns, seed=config.seed, one_token_decode=True, **extra)
    assert one.cost is not None and one.cost.decode_tokens_per_step == 1
    assert any(n.startswith("what-if: the decode priced a token a step") for n in one.notes)
    assert medians["own"] == pytest.approx((0.563, 0.351), abs=0.001)
    assert medians["same day"] == pytest.approx((0.053, 0.232), abs=0.001)
    assert medians["other day"][0] == pytest.approx(1.713, abs=0.001)
    assert medians["same day"][0] < medians["own"][0] < medians["other day"][0]  # the day, more than the fit
    assert medians["same day"][0] > 0.05  # the goal is still missed
    same_day = fit_elsewhere(read_records([engine / "uncontended-s3"]))
    for what_ifs, page in (
        (("no_round_trip",), (0.054, 0.232)),
        (("no_round_trip", "no_host_cache"), (0.096, 0.232)),
        (("one_token_decode",), (0.195, 0.197)),
    ):
        v = contention_records(
            config, records, turns, seed=config.seed, calibration=same_day, **dict.fromkeys(what_ifs, True)
        )
        assert (v.scores[0].ttft.value, v.scores[1].ttft.value) == pytest.approx(page, abs=0.001)


@pytest.mark.slow  # three calibration fits
def test_the_fourth_contention_run_checks_the_verified_passes_on_a_fresh_run() -> None:
    """`contention-4` (docs/validation.md): measured while the verified passes and the match at a
    slot's admission were written down, scored on the same day's uncontended run
    (`uncontended-s5`), and then with the host-RAM cache's rule, found on it. `http`/`ws` stay
    slower than the engine; the what-ifs without each change are named beside it."""
    v = _on_each_fit(
        "contention-4", "uncontended-s5",
        ("one_token_decode", "no_host_cache", "no_round_trip", "no_host_cache+no_round_trip",
         "one_token_decode+no_host_cache"),
    )  # fmt: skip
    medians = {name: (c.scores[0].ttft.value, c.scores[1].ttft.value) for name, c in v.items()}
    assert medians["own"] == pytest.approx((0.735, 0.322), abs=0.001)
    assert medians["same day"] == pytest.approx((0.125, 0.081), abs=0.001)
    assert medians["one_token_decode"] == pytest.approx((0.135, 0.142), abs=0.001)
    assert medians["no_host_cache"] == pytest.approx((0.176, 0.081), abs=0.001)
    assert medians["no_round_trip"] == pytest.approx((0.214, 0.121), abs=0.001)
    assert medians["no_host_cache+no_round_trip"] == pytest.approx((0.356, 0.121), abs=0.001)  # as checked
    assert medians["one_token_decode+no_host_cache"] == pytest.approx((0.195, 0.142), abs=0.001)
    assert v["same day"].scores[0].ttft_bias > 0.1  # the fleet slower than the engine for http and ws
    assert min(medians["same day"]) > 0.05  # the goal is still missed


@pytest.mark.slow  # three calibration fits
def test_the_fifth_contention_run_checks_the_host_cache_on_a_fresh_run(capsys: pytest.CaptureFixture[str]) -> None:
    """`contention-5` (docs/validation.md): measured after the first three changes were
    committed, scored on the same day's uncontended run (`uncontended-s7`). Each beats its what-if
    for `http`/`ws` there; the round trip, found on this run, moves both sets a little; the goal of
    5 % is missed."""
    v = _on_each_fit(
        "contention-5", "uncontended-s7",
        ("no_host_cache", "one_token_decode", "no_round_trip", "no_host_cache+no_round_trip"),
    )  # fmt: skip
    medians = {name: (c.scores[0].ttft.value, c.scores[1].ttft.value) for name, c in v.items()}
    held = v["same day"].scores[0]
    assert (held.ttft.ci_low, held.ttft.ci_high) == pytest.approx((0.041, 0.072), abs=0.001)
    for name, c in v.items():
        trip = [n for n in c.notes if n.startswith("what-if: the passes without the client's round trip")]
        assert len(trip) == ("no_round_trip" in name)
    assert medians["own"] == pytest.approx((0.430, 0.273), abs=0.001)
    assert medians["same day"] == pytest.approx((0.065, 0.096), abs=0.001)
    assert medians["no_host_cache"] == pytest.approx((0.129, 0.096), abs=0.001)
    assert medians["no_round_trip"] == pytest.approx((0.069, 0.128), abs=0.001)
    assert medians["no_host_cache+no_round_trip"] == pytest.approx((0.134, 0.128), abs=0.001)  # as checked
    assert medians["one_token_decode"] == pytest.approx((0.248, 0.139), abs=0.001)
    assert medians["same day"][0] < min(medians["no_host_cache"][0], medians["one_token_decode"][0])
    assert min(medians["same day"]) > 0.05  # the goal is still missed
    # The what-ifs from the command line, each named in what it prints.
    engine = REPO / "docs" / "results" / "engine"
    argv = [
        "validate",
        "--contention",
        "--from",
        str(engine / "contention-5"),
        "--fit-from",
        str(engine / "uncontended-s7"),
    ]
    assert main([*argv, "--no-host-cache", "--one-token-decode"]) == 0
    out = capsys.readouterr().out
    assert "what-if: llama.cpp's slots without the host-RAM prompt cache" in out
    assert "what-if: the decode priced a token a step" in out and "each priced as a prefill" not in out


@pytest.mark.slow  # a calibration fit
def test_a_replicate_is_scored_against_the_run_as_a_prediction_is(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine against itself: a replicate's turns, each (mode, rollout, turn) against the
    run's, on the same held-out sets; a replicate of another config or seed is refused."""
    config, records, turns = _saved("contention-5")
    slower = [msgspec.structs.replace(r, ttft_s=1.1 * r.ttft_s, e2e_s=0.8 * r.e2e_s) for r in records]
    v = contention_records(config, records, turns, seed=config.seed, replicate=Replicate("again", config, slower))
    assert [f.name for f in v.floor] == [s.name for s in v.scores] and v.replicate_source == "again"
    for f, s in zip(v.floor, v.scores, strict=True):
        assert (f.turns, f.rollouts) == (s.turns, s.rollouts)
        assert f.ttft.value == pytest.approx(0.1) and f.ttft_bias == pytest.approx(0.1)
        assert f.turn.value == pytest.approx(0.2) and f.ttft.ci_low == pytest.approx(0.1)
    gone = [r for r in slower if r.rollout != v.test_rollouts[0]]  # a rollout failed in the replicate
    v = contention_records(config, records, turns, seed=config.seed, replicate=Replicate("again", config, gone))
    assert [f.rollouts for f in v.floor] == [s.rollouts - 1 for s in v.scores]
    other, _, _ = _saved("contention-4")
    with pytest.raises(ValueError, match="not a run of the same config and seed"):
        contention_records(config, records, turns, seed=config.seed, replicate=Replicate("c4", other, records))
    assert main(["validate", "--contention", "--replicate", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--from" in err
    assert main(["validate", "--replicate", "x", "--no-round-trip"]) == 2  # the contention check's options only
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--replicate, --no-round-trip go with --contention" in err


@pytest.mark.slow  # six calibration fits
def test_the_engine_against_itself_is_the_floor_the_page_states(capsys: pytest.CaptureFixture[str]) -> None:
    """`contention-5r` and `contention-5r2` (docs/validation.md): `contention-5`'s config and seed,
    twice on one day. The engine differs from itself by about 7 % a turn, above the 5 % goal;
    the model, fitted on the same day's uncontended run, is above that floor."""
    engine = REPO / "docs" / "results" / "engine"
    same_day = fit_elsewhere(read_records([engine / "uncontended-s8"]))
    first = saved_contention(engine / "contention-5r", calibration=same_day, replicate=engine / "contention-5r2")
    second = saved_contention(engine / "contention-5r2", calibration=same_day, replicate=engine / "contention-5r")
    floor = [(f.ttft.value, f.turns, f.rollouts) for f in second.floor]
    assert floor == [(pytest.approx(0.073, abs=0.001), 32, 4), (pytest.approx(0.077, abs=0.001), 16, 4)]
    assert [f.ttft.value for f in first.floor] == pytest.approx([0.068, 0.077], abs=0.001)
    assert min(f.ttft.value for f in first.floor + second.floor) > 0.05  # the goal is below the floor
    assert [s.ttft.value for s in first.scores] == pytest.approx([0.151, 0.067], abs=0.001)
    assert [s.ttft.value for s in second.scores] == pytest.approx([0.103, 0.161], abs=0.001)
    other_day = saved_contention(engine / "contention-5r", calibration=same_day, replicate=engine / "contention-5")
    assert [f.ttft.value for f in other_day.floor] == pytest.approx([0.097, 0.024], abs=0.001)
    argv = ["validate", "--contention", "--from", str(engine / "contention-5r2"), "--fit-from",
            str(engine / "uncontended-s8"), "--replicate", str(engine / "contention-5r")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("the engine against itself (") == 2 and "TTFT 7.3 % (95 % CI 4.8–9.3" in out


@pytest.mark.slow  # five calibration fits
def test_the_round_trip_checked_on_a_fresh_run_scores_as_the_page_says() -> None:
    """`contention-7` (docs/validation.md): measured after the round trip was committed, scored on
    the same day's uncontended run (`uncontended-s9`): no gain from the round trip there; the host
    cache and the passes still beat their what-ifs."""
    v = _on_each_fit("contention-7", "uncontended-s9", ("no_round_trip", "no_host_cache", "one_token_decode"))
    medians = {name: (c.scores[0].ttft.value, c.scores[1].ttft.value) for name, c in v.items()}
    assert medians["own"] == pytest.approx((1.190, 0.667), abs=0.001)
    assert medians["same day"] == pytest.approx((0.097, 0.157), abs=0.001)
    assert medians["no_round_trip"] == pytest.approx((0.098, 0.082), abs=0.001)
    assert medians["no_host_cache"] == pytest.approx((0.103, 0.157), abs=0.001)
    assert medians["one_token_decode"] == pytest.approx((0.189, 0.220), abs=0.001)
    assert v["no_host_cache"].scores[0].ttft_p90 > 2 * v["same day"].scores[0].ttft_p90


def test_a_new_contention_run_is_refused_without_a_stagger(capsys: pytest.CaptureFixture[str]) -> None:
    """Before the engine starts: the arrival order is an input, so a run needs one; and every
    rollout must be in flight at once."""
    assert main(["validate", "--contention", "--stagger-s", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs --stagger-s > 0" in err
    assert main(["validate", "--contention", "--rollouts", "8", "--concurrency", "4"]) == 2
    assert "in flight at once" in capsys.readouterr().err
    assert main(["validate", "--contention", "--measured-order"]) == 2
    assert "--from" in capsys.readouterr().err


def test_the_contention_defaults_are_the_fast_regime() -> None:
    from sim.__main__ import CONTENTION_DEFAULTS as d

    assert d.stagger_s > 0 and d.concurrency >= d.rollouts >= 3 and d.engine.engine_decode == "verified"
    assert {"http", "ws", "append"} <= set(d.modes) and d.rollouts > d.engine.engine_slots


@pytest.mark.slow  # live: ~30 s of a stand-in engine's paced turns
def test_the_complete_command_runs_and_its_folder_scores_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`validate --contention --stagger-s S --out DIR` against a stand-in llama.cpp: the run, the
    fit, the prediction in the config's order; its folder scored again (`--from`) gives the same
    scores, the order being the config's."""
    from tests.fake_engine import fake_engine

    out = tmp_path / "run"
    with fake_engine() as engine:
        argv = ["validate", "--contention", "--quiet", "--engine-url", engine.url, "--stagger-s", "0.1"]
        argv += ["--rollouts", "4", "--concurrency", "4", "--tool-calls", "2", "--tool-time-s", "0.05"]
        argv += ["--system-prompt-tokens", "300", "--tool-output-tokens", "60", "--out", str(out)]
        assert main(argv) in (0, 1)  # 1: a fit with problems, said in the output
    live = capsys.readouterr().out
    scores = live[live.index("fit on rollouts") :]
    assert "arrival order: the config's: rollout i starts i × 0.1 s after the first" in scores
    assert "held-out rollouts (http, ws)" in scores and "held-out design (append, held-out rollouts)" in scores
    assert main(["validate", "--contention", "--from", str(out)]) in (0, 1)
    assert capsys.readouterr().out.strip() == scores.strip()
