"""The validation against a real engine (sim/harness/validate.py), checked where the truth is known:
a virtual run standing in for the engine's measurement, so the simulator must predict it closely."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from sim.__main__ import main
from sim.analysis.records import read_records, records_from_rollouts
from sim.engine.model import EngineTurn
from sim.harness.experiment import CompareConfig, compare, config_of
from sim.harness.validate import (
    as_capture,
    contention_records,
    engine_step_cost,
    predicted_config,
    validate_records,
    validation_text,
)
from tests.support import REPO

pytestmark = pytest.mark.timeout(300)

MEASURED = CompareConfig.of(
    modes=("http", "ws", "append"),
    profile="hosted",
    rollouts=5,
    tool_calls=3,
    system_prompt_tokens=600,
    tool_output_tokens=120,
    tps=50.0,
    prefill_tok_per_s=250.0,
    model_latency_s=0.02,
)


@pytest.fixture(scope="module")
def measured() -> list:  # type: ignore[type-arg]
    result = compare(MEASURED, virtual=True, free_cpu=True)
    return records_from_rollouts(result.rollouts, source="longrun-live")


@pytest.mark.slow  # a calibration fit, twice
@pytest.mark.parametrize("capture", [False, True], ids=["staged", "capture"])
def test_a_run_the_simulator_made_is_predicted_closely(measured: list, capture: bool) -> None:  # type: ignore[type-arg]
    # Scored as if an engine with the simulator's 16-token blocks had measured it.
    as_engine = MEASURED.updated(engine_kind="llamacpp", engine_block_tokens=16)
    v = validate_records(measured, as_engine, train_share=0.6, seed=0, capture=capture)
    assert not v.problems, v.problems
    assert set(v.test_rollouts).isdisjoint(v.train_rollouts) and v.test_rollouts
    fitted = v.calibration.model
    assert fitted["tps"].value == pytest.approx(50.0, rel=0.1)
    for score in v.scores:
        assert score.turns > 0
        assert score.ttft.value < 0.05, (score.name, score.ttft)
        assert score.turn.value < 0.05, (score.name, score.turn)
    e = v.measured_saved["append"]
    assert abs(v.predicted_saved["append"] - e.value) < 0.02
    assert "held-out design (append" in validation_text(v)


def test_a_capture_keeps_times_sizes_and_usage_only(measured: list) -> None:  # type: ignore[type-arg]
    r = as_capture(measured[3])
    assert r.source == "capture" and r.stages_s == {} and r.tokens_rendered is None
    assert (r.e2e_s, r.ttft_s, r.prompt_tokens, r.cached_tokens) == (
        measured[3].e2e_s,
        measured[3].ttft_s,
        measured[3].prompt_tokens,
        measured[3].cached_tokens,
    )


def test_validation_refuses_what_it_cannot_score(measured: list) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match="real engine"):
        validate_records(measured, MEASURED)
    with pytest.raises(ValueError, match="modes"):
        validate_records(measured, MEASURED.updated(engine_kind="llamacpp", modes=("http", "ws")))
    two = [r for r in measured if r.rollout in ("0", "1")]
    with pytest.raises(ValueError, match="at least 3 rollouts"):
        validate_records(two, MEASURED.updated(engine_kind="llamacpp"))


def test_the_prediction_reuses_prefixes_at_the_engines_granularity() -> None:
    """The simulator standing for the engine caches as the engine does: token-exact for
    llama.cpp's slots, 16-token blocks for an OpenAI-compatible (vLLM) engine or as stated."""
    fit = SimpleNamespace(profile_params={})  # no profile field identified: the measured profile stays
    llamacpp = MEASURED.updated(engine_kind="llamacpp")
    assert predicted_config(fit, llamacpp).model.prefix_block_tokens == 1  # type: ignore[arg-type]
    vllm = MEASURED.updated(engine_kind="openai", engine_url="http://127.0.0.1:8000")
    assert predicted_config(fit, vllm).model.prefix_block_tokens == 16  # type: ignore[arg-type]
    stated = llamacpp.updated(engine_block_tokens=4)
    predicted = predicted_config(fit, stated)  # type: ignore[arg-type]
    assert predicted.model.prefix_block_tokens == 4 and predicted.engine.engine_kind == "none"
    assert MEASURED.model.prefix_block_tokens == 16  # the simulator's own runs keep vLLM's blocks


def test_step_costs_come_from_the_engines_own_rates() -> None:
    rates = {
        "prefill_cold_tok_s_at_500": 270.0,
        "prefill_cold_tok_s_at_2000": 240.0,
        "decode_forced_tok_s": 25.0,
        "decode_aggregate_tok_s_1_streams": 50.0,
        "decode_aggregate_tok_s_2_streams": 40.0,
    }
    cost = engine_step_cost(rates)
    # Both measured cold prefills come back exactly: a per-token cost and its attention term.
    assert cost.prefill_alone_s(0, 500) == pytest.approx(500 / 270)
    assert cost.prefill_alone_s(0, 2000) == pytest.approx(2000 / 240)
    assert cost.prefill_s_per_token_ctx > 0 and cost.prefill_s_per(1500, 500) > cost.prefill_s_per(0, 500)
    assert cost.decode_s(1) == pytest.approx(1 / 25)
    assert cost.decode_s(2) == pytest.approx(2 * 1.25 / 25)
    # A longer prefill measured faster a token (noise) gives no negative attention term.
    flat = engine_step_cost({**rates, "prefill_cold_tok_s_at_2000": 280.0})
    assert flat.prefill_s_per_token_ctx == 0.0 and not math.isnan(flat.prefill_alone_s(0, 100))


@pytest.mark.parametrize("run", ["contention", "contention-2"])
def test_a_saved_contention_run_is_scored_again_without_the_engine(run: str) -> None:
    """The committed engine runs (docs/validation.md): the fleet model with the engine's own
    slot semantics (`slot_cache`, and `held_slot` for append) predicts its turns; the default,
    a cache that follows each conversation, puts ws turns early."""
    folder = REPO / "docs" / "results" / "engine" / run
    config = config_of(msgspec.json.decode((folder / "config.json").read_bytes())["config"])
    turns = [msgspec.json.decode(line, type=EngineTurn) for line in (folder / "engine.jsonl").read_bytes().splitlines()]
    cost = engine_step_cost(json.loads((folder / "rates.json").read_text()))
    scores = {s.name: s for s in contention_records(config, read_records([folder]), turns, cost, seed=config.seed)}
    ws_follows = scores["contention, ws: 4 rollouts on 2 slots"]
    ws_slots = next(s for name, s in scores.items() if name.startswith("contention, ws") and "slot_cache" in name)
    append = next(s for name, s in scores.items() if "held_slot" in name)
    assert ws_slots.ttft.value < 0.10 < 0.20 < ws_follows.ttft.value and ws_follows.ttft_bias < -0.15
    assert ws_slots.turn.value < 0.10 and append.ttft.value < 0.20 and ws_slots.turns == append.turns == 16
    with pytest.raises(ValueError, match="in flight"):
        contention_records(config.updated(concurrency=2), read_records([folder]), turns, cost)


def test_the_cli_scores_a_saved_contention_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = REPO / "docs" / "results" / "engine" / "contention"
    assert main(["validate", "--contention", "--from", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.count("per-turn TTFT error") == 4 and "slot_cache" in out and "held_slot" in out
    # A folder without the engine's turns: one line naming the file, no traceback.
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert main(["validate", "--contention", "--from", str(tmp_path)]) == 2
    assert "engine.jsonl" in capsys.readouterr().err
