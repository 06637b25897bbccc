"""Calibration: per-turn records, the fit, its held-out error, and the fit file as a profile.

Recovery: records of a virtual run whose CPU is free are exactly what a known profile and the
simulator's rates say, so a fit must give them back; with noise on every stage, within a stated
tolerance. The negative control: records of another profile miss the known one by more than it.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import msgspec
import numpy as np
import pytest

from prototype.pipeline import PROFILES, CostProfile, load_profile
from sim.__main__ import main
from sim.analysis.calibrate import check_profile, fit, predict
from sim.analysis.records import TurnRecord, read_records, records_from_rollouts
from sim.harness.experiment import CompareConfig, compare
from sim.harness.trace import write_run

MODES = ("http", "http_prev", "ws", "append")
# The hosted model's rates, with an attention term: about a fifth of a late turn's prefill.
RATES = {"model_latency_s": 0.05, "prefill_tok_per_s": 20_000.0, "prefill_s_per_token_ctx": 1e-9, "tps": 1000.0}
TOLERANCE = 0.10  # relative, for every fitted cost and rate, with 5 % noise on every stage
OTHER = msgspec.structs.replace(
    PROFILES["hosted"], name="other", rtt_s=0.08, routing_s=0.16, inference_hop_s=0.05, billing_s=0.03
)


@cache
def _records(profile: str, rollouts: int = 6) -> tuple[TurnRecord, ...]:
    ctx = RATES["prefill_s_per_token_ctx"]
    config = CompareConfig.of(
        rollouts=rollouts, tool_calls=6, modes=MODES, profile=profile, prefill_s_per_token_ctx=ctx
    )
    result = compare(config, virtual=True, free_cpu=True)
    return tuple(records_from_rollouts(result.rollouts, source="longrun-virtual"))


def _noisy(records: tuple[TurnRecord, ...], sigma: float, seed: int = 1) -> list[TurnRecord]:
    """Each stage times a lognormal factor; TTFT and the turn's end move by what their stages moved."""
    rng = np.random.default_rng(seed)
    out = []
    for r in records:
        stages = {k: v * float(rng.lognormal(0.0, sigma)) for k, v in r.stages_s.items()}
        moved = {k: stages[k] - v for k, v in r.stages_s.items()}
        before = sum(v for k, v in moved.items() if k not in ("decode", "post_inference"))
        assert r.ttft_s is not None
        out.append(
            msgspec.structs.replace(r, stages_s=stages, ttft_s=r.ttft_s + before, e2e_s=r.e2e_s + sum(moved.values()))
        )
    return out


@pytest.mark.slow
def test_every_turn_has_one_record_with_the_servers_counts(tmp_path: Path) -> None:
    config = CompareConfig(rollouts=2, tool_calls=3, modes=MODES)
    result = compare(config, virtual=True, free_cpu=True)
    records = read_records([write_run(result, tmp_path)])
    assert len(records) == sum(len(r.turns) for r in result.rollouts)
    for rec in records:
        assert rec.source == "longrun-virtual" and rec.mode in MODES
        assert rec.prompt_tokens and rec.uncached_tokens is not None and rec.cached_tokens is not None
        assert 0 < rec.uncached_tokens <= rec.prompt_tokens
        assert rec.output_tokens and rec.output_tokens > 0
        assert rec.ttft_s is not None and 0 < rec.ttft_s < rec.e2e_s
        assert rec.stages_s["prefill"] > 0
    by = {(r.mode, r.rollout, r.turn): r for r in records}
    # Append holds the KV across a pause: a resumed turn prefills less than a ws turn re-prefills.
    assert by[("append", "0", 1)].uncached_tokens < by[("ws", "0", 1)].uncached_tokens  # type: ignore[operator]
    # The same seeded rollout: every mode's model decodes the same tokens.
    assert len({by[(m, "0", 1)].output_tokens for m in MODES}) == 1
    # The last turn has no tool after it; the others do.
    last = max(r.turn for r in records if r.mode == "http" and r.rollout == "0")
    assert by[("http", "0", last)].tool_s is None and by[("http", "0", 0)].tool_s is not None


@pytest.mark.slow
def test_a_noiseless_fit_gives_the_profile_back() -> None:
    calibration = fit(_records("hosted"))
    assert calibration.staged
    assert check_profile(calibration, PROFILES["hosted"], RATES, tolerance=0.02) == []
    assert calibration.ttft_error.median < 0.01 and calibration.e2e_error.median < 0.01


@pytest.mark.slow
def test_a_noisy_fit_recovers_the_profile_within_the_tolerance() -> None:
    calibration = fit(_noisy(_records("hosted"), sigma=0.05))
    assert check_profile(calibration, PROFILES["hosted"], RATES, tolerance=TOLERANCE) == []
    # The noise is the floor of the held-out error: about 0.05 × √(2/π) per stage, summed.
    assert 0.005 < calibration.ttft_error.median < 0.05
    # The API's part alone (TTFT less queue and prefill) carries the same noise, without the
    # model's large exact part to dilute it.
    assert calibration.api_error is not None and calibration.ttft_error.median < calibration.api_error.median < 0.1
    assert calibration.ttft_error.ci_low <= calibration.ttft_error.median <= calibration.ttft_error.ci_high
    for p in calibration.profile_params.values():
        assert p.ci_low <= p.value <= p.ci_high or not np.isfinite(p.value)


@pytest.mark.slow
def test_the_negative_control_misses_the_known_profile(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_bytes(msgspec.json.encode(OTHER))
    calibration = fit(_noisy(_records(str(path)), sigma=0.05))
    misses = check_profile(calibration, PROFILES["hosted"], RATES, tolerance=TOLERANCE)
    assert {m.split(":")[0] for m in misses} >= {"rtt_s", "auth_s+routing_s", "inference_hop_s", "billing_s"}
    assert check_profile(calibration, OTHER, RATES, tolerance=TOLERANCE) == []


def _capture(records: list[TurnRecord] | tuple[TurnRecord, ...]) -> list[TurnRecord]:
    """What a client or proxy records of http and ws turns: no stages, no server counts."""
    return [
        msgspec.structs.replace(r, stages_s={}, tokens_rendered=None, tokens_classified=None, source="capture")
        for r in records
        if r.mode in ("http", "ws")
    ]


@pytest.mark.slow
def test_a_capture_without_stages_names_what_it_cannot_identify() -> None:
    """Without stages the turn is fitted whole on the table's rows: what every turn pays once is
    identified only as a sum, a wait no captured design pays is unidentified, never zero; a
    noiseless capture gives every identified value back."""
    calibration = fit(_capture(_records("hosted")))
    assert not calibration.staged and calibration.api_error is None and calibration.usable
    assert set(calibration.coefficients) == {"ttft", "after_first_token"}
    assert "state_load_s" in calibration.unidentified and "state_load_s" not in calibration.cost_profile
    assert ["rtt_s", "safety_call_s", "inference_hop_s", "model_latency_s"] in calibration.sums
    assert ["auth_s", "routing_s"] in calibration.sums
    assert check_profile(calibration, PROFILES["hosted"], RATES, tolerance=0.02) == []
    noisy = fit(_capture(_noisy(_records("hosted"), sigma=0.05)))
    assert noisy.usable and noisy.ttft_error.median < 0.05
    for k in ("billing_s", "auth_s+routing_s", "tps", "prefill_tok_per_s"):
        assert noisy.profile_params[k].ci_low <= noisy.profile_params[k].value <= noisy.profile_params[k].ci_high


@pytest.mark.slow
def test_the_split_holds_out_whole_rollouts() -> None:
    calibration = fit(_records("hosted"), holdout=0.5, seed=3)
    assert set(calibration.train_rollouts).isdisjoint(calibration.test_rollouts)
    assert len(calibration.test_rollouts) == 3
    assert calibration.ttft_error.n == sum(1 for r in _records("hosted") if r.rollout in calibration.test_rollouts)
    assert fit(_records("hosted"), holdout=0.5, seed=3) == calibration  # seeded: the same fit twice


@pytest.mark.slow
def test_the_cli_prints_the_held_out_error_and_writes_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records.jsonl"
    records.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in _noisy(_records("hosted"), sigma=0.05)))
    out = tmp_path / "fit.json"
    assert main(["calibrate", str(records), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    line = r"held-out error: \d+\.\d % \(95 % CI \d+\.\d–\d+\.\d\), n=\d+ turns"
    assert re.search(r"per-turn TTFT\s+" + line, text) and re.search(r"per-turn end time\s+" + line, text)
    profile = load_profile(str(out))
    assert isinstance(profile, CostProfile) and profile.name == "fitted"
    assert abs(profile.rtt_s / PROFILES["hosted"].rtt_s - 1) < TOLERANCE
    assert set(json.loads(out.read_text())["model"]) == set(RATES)


def test_bad_records_are_an_error_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"mode": "http", "rollout": "0", "turn": 0, "e2e_s": 1.0, "bytes_in": 10}\n{"mode": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_records([bad])
    assert main(["calibrate", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


@pytest.mark.slow
def test_predict_is_the_fits_own_prediction() -> None:
    records = _noisy(_records("hosted"), sigma=0.05)
    calibration = fit(records)
    test = [r for r in records if r.rollout in set(calibration.test_rollouts)]
    errors = np.abs(predict(calibration, test, first_token=True) / np.array([r.ttft_s for r in test]) - 1)
    assert float(np.median(errors)) == pytest.approx(calibration.ttft_error.median)
