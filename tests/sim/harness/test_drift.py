"""An engine comparison's modes interleaved round by round, and the check that the engine's speed
held (sim/harness/drift.py), on synthetic engine turns and on a stand-in engine."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import msgspec
import pytest

from sim.__main__ import main
from sim.engine.model import EngineTurn
from sim.harness.drift import DRIFT_BOUND, carry, drift_report, drift_text, rotation, round_size
from sim.harness.experiment import CompareConfig, compare
from tests.fake_engine import fake_engine

MODES = ("http", "ws", "append")


def test_the_modes_rotate_round_by_round() -> None:
    assert [rotation(MODES, r) for r in range(4)] == [
        ("http", "ws", "append"),
        ("ws", "append", "http"),
        ("append", "http", "ws"),
        ("http", "ws", "append"),
    ]
    assert rotation((), 3) == ()
    assert round_size(1, 0) == 1 and round_size(4, 0) == 4
    assert round_size(1, 2) == 2 and round_size(3, 2) == 4  # whole groups of lanes


def _turns(change: float, rounds: int = 6, turns: int = 4) -> list[EngineTurn]:
    """An engine.jsonl of an interleaved run whose decode and prefill rates move linearly by
    `change` from the first turn to the last: rounds of every mode, `turns` turns a rollout."""
    order = [m for r in range(rounds) for m in rotation(MODES, r) for _ in range(turns)]
    out = []
    for i, mode in enumerate(order):
        speed = 1 + change * i / (len(order) - 1)
        out.append(
            EngineTurn(
                tag=mode,
                conversation_key=i // turns,
                turn_index=i % turns,
                slot=0,
                resident=False,
                prompt_tokens=800,
                prompt_n=800 if i % turns == 0 else 200,
                cache_n=0 if i % turns == 0 else 600,
                prompt_ms=1e3 * (800 if i % turns == 0 else 200) / (250 * speed),
                predicted_n=100,
                predicted_ms=1e3 * 100 / (25 * speed),
                queued_s=0.0,
                ttft_s=1.0,
                total_s=5.0,
            )
        )
    return out


def _read_back(turns: list[EngineTurn], tmp_path: Path) -> list[EngineTurn]:
    path = tmp_path / "engine.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in turns))
    return [msgspec.json.decode(line, type=EngineTurn) for line in path.read_bytes().splitlines()]


@pytest.mark.parametrize(("change", "flagged"), [(0.20, True), (0.02, False), (-0.20, True)])
def test_a_drift_beyond_the_bound_is_flagged_and_a_small_one_passes(
    change: float, flagged: bool, tmp_path: Path
) -> None:
    """Interleaved, a 20 % change over the run falls on every mode alike: the modes' rates agree
    within the bound, and the first third against the last shows the change."""
    d = drift_report(_read_back(_turns(change), tmp_path), MODES)
    assert d.bound == DRIFT_BOUND and d.within_bound is not flagged
    assert [r.mode for r in d.modes] == list(MODES) and all(r.turns == 24 for r in d.modes)
    assert d.decode_across_modes < 0.05 and d.prefill_across_modes < 0.05
    # Thirds 8 rollouts of 4 turns apart, their rates averaged: most of the whole change.
    assert abs(d.decode_over_run) == pytest.approx(abs(change) * 2 / 3, rel=0.15)
    assert (d.prefill_over_run > DRIFT_BOUND) is flagged
    assert all(r.decode_tok_s == pytest.approx(25 * (1 + change / 2), rel=0.05) for r in d.modes)
    assert ("WARNING" in drift_text(d)) is flagged


def test_modes_run_one_after_another_are_flagged_across_modes(tmp_path: Path) -> None:
    """The same 20 % change with the modes run mode after mode: it reads as a difference between
    modes, which the check reports."""
    turns = sorted(_turns(0.20), key=lambda t: MODES.index(t.tag))  # not interleaved
    for i, t in enumerate(turns):  # the engine's speed follows the run's order, not the modes'
        speed = 1 + 0.20 * i / (len(turns) - 1)
        turns[i] = dataclasses.replace(t, predicted_ms=1e3 * 100 / (25 * speed))
    d = drift_report(turns, MODES)
    assert d.decode_across_modes > DRIFT_BOUND and not d.within_bound


def test_no_engine_time_is_no_evidence_either_way() -> None:
    d = drift_report([], MODES)
    assert d.within_bound and all(r.turns == 0 for r in d.modes)
    assert "n/a" in drift_text(d)


def test_the_drift_is_carried_into_the_saving_by_what_the_rates_explain() -> None:
    """`ws` decoded at 4/5 of the others' rate: its extra engine seconds over the base's total
    time widen its interval on both sides; `append`, at the pooled rate, gains almost nothing."""
    turns = _turns(0.0)
    for i, t in enumerate(turns):
        if t.tag == "ws":
            turns[i] = dataclasses.replace(t, predicted_ms=1.25 * t.predicted_ms)
    d = drift_report(turns, MODES)
    carried = carry(d, turns, [("ws", 0.05, 0.03, 0.07), ("append", 0.05, 0.03, 0.07)], base="http", base_total_s=200.0)
    ws, append = carried.carried
    decode_s = {m: sum(t.predicted_ms for t in turns if t.tag == m) / 1000 for m in MODES}
    pooled = sum(t.predicted_n for t in turns) / sum(decode_s.values())
    lost = {m: decode_s[m] - sum(t.predicted_n for t in turns if t.tag == m) / pooled for m in MODES}
    assert ws.bias == pytest.approx((lost["ws"] - lost["http"]) / 200.0)
    assert ws.bias > 0.01  # the slow engine made ws look slower: its saving is understated
    assert (ws.ci_low, ws.ci_high) == pytest.approx((0.03 - ws.bias, 0.07 + ws.bias))
    assert abs(append.bias) < ws.bias / 4 and append.saved == 0.05
    assert "with the drift carried" in drift_text(carried)
    assert carry(d, turns, [("ws", 0.05, 0.03, 0.07)], base="http", base_total_s=0.0).carried == []


ENGINE_RUN = CompareConfig.of(
    engine_kind="llamacpp",
    engine_ctx_per_slot=4096,
    modes=MODES,
    profile="local",
    rollouts=3,
    tool_calls=2,
    system_prompt_tokens=300,
    tool_output_tokens=60,
    tool_time_s=0.0,
)


def test_an_engine_comparison_interleaves_the_modes_and_reports_the_engines_speed() -> None:
    """On a stand-in engine: rollout by rollout, every mode, the order rotating; the slots erased
    before each; the engine's rates per mode in the result."""
    with fake_engine() as engine:
        result = compare(ENGINE_RUN.updated(engine_url=engine.url), virtual=False)
    assert not result.failed and len(result.rollouts) == 9
    # The engine's turns in the order it served them, one entry per rollout of a mode.
    order = [tag for (tag, _), _ in itertools.groupby((t.tag, t.conversation_key) for t in result.engine_turns)]
    assert order == [*rotation(MODES, 0), *rotation(MODES, 1), *rotation(MODES, 2)]
    assert len(engine.erased) == 9 * ENGINE_RUN.engine.engine_slots  # every mode of every round starts cold
    assert [s.mode for s in result.summary] == list(MODES)  # the table keeps the modes' order
    assert result.drift is not None and result.drift.within_bound
    assert all(r.decode_tok_s == pytest.approx(25.0) for r in result.drift.modes)
    assert all(r.prefill_tok_s == pytest.approx(250.0) for r in result.drift.modes)
    # One rollout a slot: the rates are carried into the savings, and at one speed they explain nothing.
    assert [(c.mode, c.base) for c in result.drift.carried] == [("ws", "http"), ("append", "http")]
    assert all(c.bias == pytest.approx(0.0, abs=1e-9) for c in result.drift.carried)


def test_the_drift_is_beside_the_table_and_in_the_run_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that slows by a third over the run: the warning beside the table, drift.json
    in the folder."""
    out = tmp_path / "run"
    with fake_engine(rates=lambda n: (250.0 / (1 + n / 30), 25.0 / (1 + n / 30))) as engine:
        argv = ["compare", "--quiet", "--engine", "llamacpp", "--engine-url", engine.url, "--profile", "local"]
        argv += ["--rollouts", "3", "--tool-calls", "2", "--system-prompt-tokens", "300"]
        argv += ["--tool-output-tokens", "60", "--tool-time-s", "0", "--modes", "http,ws,append", "--out", str(out)]
        assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "the engine's own speed" in printed and "WARNING: the engine's speed moved" in printed
    drift = json.loads((out / "drift.json").read_text())
    assert drift["within_bound"] is False and drift["decode_over_run"] > DRIFT_BOUND
    assert [m["mode"] for m in drift["modes"]] == list(MODES)
    assert "WARNING" in (out / "table.txt").read_text()
