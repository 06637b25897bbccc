"""The capture formats calibration reads (docs/calibration.md, "Input formats"): longrun's own
records, a JSONL proxy log, and a proxy log with Codex timing frames; bad lines are errors that
name the file and line.

The examples in tests/data/capture/ are the http and ws turns of one virtual run on a profile
drawn far from `hosted` (tests/data/capture/truth.json), with 5 % noise on the times, written in
each format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.__main__ import main
from sim.analysis.calibrate import fit
from sim.analysis.records import read_records
from tests.support import TESTS

DATA = TESTS / "data" / "capture"
TRUTH = json.loads((DATA / "truth.json").read_text())


def test_the_three_formats_give_the_same_turns() -> None:
    records, proxy, codex = (read_records([DATA / f"{name}.jsonl"]) for name in ("records", "proxy", "codex_timing"))
    assert len(records) == len(proxy) == len(codex) > 0
    for a, b in zip(records, proxy, strict=True):
        assert (a.mode, a.turn, a.bytes_in, a.prompt_tokens, a.uncached_tokens, a.output_tokens) == (
            b.mode,
            b.turn,
            b.bytes_in,
            b.prompt_tokens,
            b.uncached_tokens,
            b.output_tokens,
        )
        assert b.ttft_s == pytest.approx(a.ttft_s, abs=1e-5) and b.e2e_s == pytest.approx(a.e2e_s, abs=1e-5)
    assert all(set(r.stages_s) == {"inference_hop", "prefill", "decode"} for r in codex if r.mode == "ws")
    assert all(not r.stages_s for r in codex if r.mode == "http")


def test_timing_frames_identify_the_hop_a_capture_cannot() -> None:
    whole = fit(read_records([DATA / "proxy.jsonl"]))
    framed = fit(read_records([DATA / "codex_timing.jsonl"]))
    assert ["rtt_s", "safety_call_s", "inference_hop_s", "model_latency_s"] in whole.sums
    assert ["rtt_s", "safety_call_s"] in framed.sums
    assert "inference_hop_s" in framed.profile_params and "model_latency_s" in framed.profile_params
    truth = TRUTH["cost_profile"]
    got = framed.profile_params["rtt_s+safety_call_s"].value
    assert got == pytest.approx(truth["rtt_s"] + truth["safety_call_s"], rel=0.1)
    assert framed.profile_params["model_latency_s"].value == pytest.approx(TRUTH["model"]["model_latency_s"], rel=0.1)


BAD = {
    "missing": (
        '{"conversation": "c", "mode": "http", "sent_at": 1.0, "done_at": 2.0, "usage": '
        '{"input_tokens": 10, "output_tokens": 2}}',
        "request_bytes",
    ),
    "negative": (
        '{"conversation": "c", "mode": "http", "sent_at": 5.0, "first_token_at": 4.0, "done_at": 6.0, '
        '"request_bytes": 10, "usage": {"input_tokens": 10, "output_tokens": 2}}',
        "negative time",
    ),
    "orphan": (
        '{"conversation": "c", "mode": "ws", "turn": 3, "sent_at": 1.0, "first_token_at": 1.5, '
        '"done_at": 2.0, "request_bytes": 10, "usage": {"input_tokens": 10, "output_tokens": 2}}',
        "without its turn 2",
    ),
    "unknown previous": (
        '{"conversation": "c", "mode": "ws", "sent_at": 1.0, "first_token_at": 1.5, '
        '"done_at": 2.0, "request_bytes": 10, "previous_response_id": "resp_x", '
        '"usage": {"input_tokens": 10, "output_tokens": 2}}',
        "not an earlier response",
    ),
    "unknown mode": (
        '{"conversation": "c", "mode": "grpc", "sent_at": 1.0, "first_token_at": 1.5, '
        '"done_at": 2.0, "request_bytes": 10, "usage": {"input_tokens": 10, "output_tokens": 2}}',
        "mode 'grpc'",
    ),
    "record negative": ('{"mode": "http", "rollout": "0", "turn": 0, "e2e_s": -1.0, "bytes_in": 10}', "negative"),
    "record orphan": (
        '{"mode": "http", "rollout": "0", "turn": 1, "e2e_s": 1.0, "bytes_in": 10}',
        "without its turn 0",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_line_is_an_error_naming_it(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    line, message = BAD[case]
    good = (
        (DATA / "proxy.jsonl").read_text().splitlines()[0]
        if "record" not in case
        else ('{"mode": "ws", "rollout": "9", "turn": 0, "e2e_s": 1.0, "bytes_in": 10}')
    )
    path = tmp_path / "capture.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"capture.jsonl:2: .*{message}"):
        read_records([path])
    assert main(["calibrate", str(path)]) == 2
    assert "capture.jsonl:2" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_predicts_every_design_from_a_capture(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    args = ["calibrate", str(DATA / "codex_timing.jsonl"), "--out", str(out), "--predict"]
    assert main([*args, "--rollouts", "2", "--tool-calls", "3", "--refits", "2"]) == 0
    text = capsys.readouterr().out
    for mode in ("ws", "append", "inject", "async", "steer"):
        assert any(line.startswith(mode + " ") and "%" in line for line in text.splitlines()), mode
    assert "http_prev  not predicted: state_load_s is not identified" in text
    fitted = json.loads(out.read_text())
    assert "state_load_s" in fitted["unidentified"] and "state_load_s" not in fitted["cost_profile"]
    # compare takes the fit for the designs it identifies, and refuses one that pays what it does not.
    assert (
        main(
            [
                "compare",
                "--virtual",
                "--free-cpu",
                "--rollouts",
                "1",
                "--tool-calls",
                "2",
                "--modes",
                "http,ws",
                "--profile",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(["compare", "--virtual", "--free-cpu", "--rollouts", "1", "--modes", "http_prev", "--profile", str(out)])
        == 2
    )
    assert "state_load_s is not identified" in capsys.readouterr().err
