"""`sim calibrate --predict`: the one chain (docs/calibration.md, "From a recording to a prediction
on your own workload") and when not to trust a prediction.

The chain: `sim record` in front of longrun's server running a cost profile of its own,
openai-python's `http` and `ws` rollouts through it, then `sim calibrate DIR/capture.jsonl
--predict --trace DIR/workload.jsonl`; append's predicted time saved on the recorded workload is
within 2 points of what longrun measures for append on that workload and profile, or inside the
stated interval. Trust: a prediction on sizes beyond the capture's warns, one inside does not; a
convex cost too mild for the poor-fit alarm is a stated misfit, the model's own costs are not."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from openai import AsyncOpenAI

from sim.__main__ import main
from sim.analysis.calibrate import fit
from sim.analysis.records import TurnRecord
from sim.harness.experiment import CompareConfig, compare
from sim.harness.predict import time_saved, trend_misfit, trust_notes
from sim.rollout.replay import load_trace
from tests.recording import (
    OWN_MODEL,
    OWN_PROFILE,
    draw_profile,
    drawn_capture,
    http_flow,
    own_profile_app,
    predicted_saved,
    recording,
    ws_flow,
)
from tests.support import REPO, served


async def _record(out: Path, conversations: int) -> None:
    async with served(own_profile_app()) as port, recording(f"http://127.0.0.1:{port}", out) as (base, _):
        async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=30) as c:
            for k in range(conversations):
                await http_flow(c, f"Conversation {k}: list the files.")
                await ws_flow(c, f"Conversation {k}: read the logs.")


@pytest.mark.slow
@pytest.mark.wire_unchecked  # the fit reads the loopback's times: per-event validation would be measured in them
async def test_a_recording_of_http_and_ws_predicts_append_on_the_recorded_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _record(tmp_path, 5)
    capture, workload = tmp_path / "capture.jsonl", tmp_path / "workload.jsonl"
    assert {json.loads(x)["mode"] for x in capture.read_text().splitlines()} == {"http", "ws"}
    assert len(load_trace(workload)) == 10
    capsys.readouterr()
    code = main(["calibrate", str(capture), "--predict", "--trace", str(workload), "--refits", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    predicted = predicted_saved(out)
    assert "http_prev  not predicted: state_load_s is not identified" in out  # no http_prev was recorded
    config = CompareConfig.of(trace=str(workload), modes=("http", "ws", "append"), profile=OWN_PROFILE, **OWN_MODEL)
    truth = time_saved(compare(config, virtual=True, free_cpu=True).rollouts)
    saved, low, high = predicted["append"]
    assert low <= saved <= high
    assert abs(saved - truth["append"]) <= 0.02 or low <= truth["append"] <= high, (predicted, truth)


def test_calibrate_refuses_a_trace_without_predict_or_a_bad_one_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = str(REPO / "tests" / "data" / "capture" / "proxy.jsonl")
    bad = tmp_path / "workload.jsonl"
    bad.write_text('{"rollout": "c0", "input_tokens": 90, "output_tokens": 5, "tool_call": true}\n')
    assert main(["calibrate", capture, "--trace", str(bad)]) == 2
    assert capsys.readouterr().err == "error: --trace: the rollouts a prediction runs on; give --predict with it\n"
    assert main(["calibrate", capture, "--predict", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:1: a turn with calls needs") and err.count("\n") == 1


def _convex(records: list[TurnRecord], strength: float) -> list[TurnRecord]:
    """`strength` s × prompt² added to each TTFT: a cost that grows faster than linearly with context."""
    out = []
    for r in records:
        assert r.ttft_s is not None and r.prompt_tokens is not None
        extra = strength * r.prompt_tokens**2
        out.append(msgspec.structs.replace(r, ttft_s=r.ttft_s + extra, e2e_s=r.e2e_s + extra))
    return out


@pytest.mark.parametrize("seed", [11, 13])
def test_a_mild_convex_cost_the_poor_fit_alarm_passes_is_a_stated_misfit(seed: int) -> None:
    profile, model = draw_profile(seed)
    honest = drawn_capture(profile, model, seed)
    assert trend_misfit(fit(honest), honest) is None  # the negative control: no misfit on the model's own costs
    # 3·10⁻⁹ s × prompt²: a thirtieth of the poor-fit control's strength, +0.35 s on a 10,000-token prompt.
    mild = _convex(honest, 3e-9)
    calibration = fit(mild)
    assert calibration.usable  # the poor-fit alarm passes it
    note = trend_misfit(calibration, mild)
    assert note is not None and note.startswith("misfit: at the capture's longest contexts")
    assert "above the fit" in note and "the intervals do not hold" in note


def test_a_prediction_beyond_the_captures_sizes_warns_and_one_inside_does_not() -> None:
    profile, model = draw_profile(11)
    captured = drawn_capture(profile, model, 11)
    calibration = fit(captured)
    same = CompareConfig.of(rollouts=6, tool_calls=4, seed=11)  # the capture's own workload
    assert trust_notes(calibration, captured, same) == []
    longer = trust_notes(calibration, captured, same.updated(rollouts=2, tool_calls=8))
    said = {n.split(" goes ")[0].removeprefix("warning: the predicted workload's "): n for n in longer}
    assert {"context (prompt tokens a turn)", "rollout length (turns)"} <= set(said)
    assert all("the intervals are not widened for it" in n for n in longer)
    assert "goes up to 9, outside the capture's 5–5" in said["rollout length (turns)"]
