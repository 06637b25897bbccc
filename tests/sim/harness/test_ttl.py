"""The idle-timeout sweep (sim/harness/ttl.py, `python -m sim ttl-curve`): TraceLab's trade-off's shape."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.__main__ import main
from sim.fleet.config import FleetConfig
from sim.fleet.engine import simulate
from sim.fleet.sessions import STEP_TEMPLATE_TOKENS, SessionTokens
from sim.harness import console
from sim.harness.capacity import arrivals, point_sessions
from sim.harness.ttl import TTLCurveConfig, _SplitStored, one_ttl_curve, run_ttl_point, tracelab_rule, ttl_curve

SMALL = TTLCurveConfig(sessions=30, load=0.5, ttls_s=(5.0, 60.0, 900.0), seeds=2)


@pytest.fixture(scope="module")
def curve() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    return ttl_curve(SMALL)


def test_hit_rate_and_stored_kv_rise_with_the_timeout_in_every_seed(
    curve: tuple[list[dict[str, float]], list[dict[str, float]]],
) -> None:
    rows, points = curve
    for seed in (0, 1):
        mine = sorted((r for r in rows if r["seed"] == seed), key=lambda r: r["ttl_s"])
        for measure in ("hit_rate", "stored_over_active", "suspended_over_active", "tracelab_hit_rate"):
            values = [r[measure] for r in mine]
            assert values == sorted(values) and values[0] < values[-1], (measure, values)
        # Sessions in flight keep less KV than everything stored (ended sessions, the shared instructions),
        # and about what TraceLab's rule gives for the same gaps and model time.
        assert all(0 < r["suspended_over_active"] < r["stored_over_active"] for r in mine)
        assert all(
            abs(math.log(r["suspended_over_active"] / r["tracelab_storage_ratio"])) < math.log(1.5) for r in mine
        )
    assert [p["n"] for p in points] == [2, 2, 2]
    assert math.isnan(points[0]["hit_rate_rise"]) and points[2]["hit_rate_rise"] > 0


def test_the_timeout_reaches_the_fleet() -> None:
    """At a timeout past every gap the fleet hits as a cache kept until evicted does, below it less:
    a sweep that ignored `cache_ttl_s` would give one value everywhere."""
    sessions = point_sessions(SMALL.workload, 0, SMALL.sessions, 1.0)
    forever = simulate(
        SMALL.mode,
        load_profile(SMALL.profile),
        SMALL.fleet,
        sessions,
        arrivals=arrivals(0, SMALL.sessions, SMALL.load),
        seed=0,
    )
    kept = forever.hit_tokens / forever.prompt_tokens
    longest = max(t for s in sessions for t in s.tool_times_s)
    assert run_ttl_point(SMALL, longest + 60.0, 0)["hit_rate"] == pytest.approx(kept, abs=0)
    short = msgspec.structs.replace(SMALL.fleet, cache_ttl_s=5.0)
    expiring = simulate(
        SMALL.mode,
        load_profile(SMALL.profile),
        short,
        sessions,
        arrivals=arrivals(0, SMALL.sessions, SMALL.load),
        seed=0,
    )
    # Expiring entries at their timeout for the accounts changes no turn.
    assert run_ttl_point(SMALL, 5.0, 0)["hit_rate"] == expiring.hit_tokens / expiring.prompt_tokens < kept
    traced = _SplitStored(SMALL.mode, load_profile(SMALL.profile), short, sessions, 0)
    assert traced.run(arrivals(0, SMALL.sessions, SMALL.load), 0, (), math.inf).sessions == expiring.sessions


def test_tracelab_rule_on_a_session_worked_by_hand() -> None:
    # Prompts 1000, then + 10 output + 100 tool + template, then + 20 output + 200 tool + template.
    s = SessionTokens(
        index=0,
        instruction_tokens=0,
        first_prompt_tokens=1000,
        instruction_bytes=0,
        first_request_bytes=0,
        output_tokens=(10, 20, 5),
        output_bytes=(0, 0, 0),
        tool_times_s=(30.0, 120.0),
        tool_tokens=(100, 200),
        tool_bytes=(0, 0),
    )
    p1 = 1000 + 10 + 100 + STEP_TEMPLATE_TOKENS
    p2 = p1 + 20 + 200 + STEP_TEMPLATE_TOKENS
    hit, ratio = tracelab_rule([s], model_s=10.0, ttl_s=60.0)
    assert hit == pytest.approx((p1 - 100 - STEP_TEMPLATE_TOKENS) / (p1 + p2))  # the 120 s gap misses
    assert ratio == pytest.approx((30.0 + 60.0) / 10.0)  # idle capped at the timeout
    hit, ratio = tracelab_rule([s], model_s=10.0, ttl_s=600.0)
    assert hit == pytest.approx((p1 + p2 - 300 - 2 * STEP_TEMPLATE_TOKENS) / (p1 + p2))
    assert ratio == pytest.approx(15.0)


def test_bad_sweeps_are_refused() -> None:
    with pytest.raises(ValueError, match="ttls_s"):
        TTLCurveConfig(ttls_s=(60.0, 0.0))
    with pytest.raises(ValueError, match="ttls_s"):
        TTLCurveConfig(ttls_s=(300.0, 60.0))
    with pytest.raises(ValueError, match="cache_ttl_s"):
        TTLCurveConfig(fleet=FleetConfig(cache_ttl_s=60.0))
    with pytest.raises(ValueError, match="mode"):
        msgspec.structs.replace(SMALL, mode="steer")


def test_the_cli_prints_and_writes_the_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["ttl-curve", "--sessions=10", "--ttls-s=30,600", "--seeds=2", f"--out={tmp_path}"])
    assert code == 0
    text = capsys.readouterr().out
    assert "TraceLab-rule R" in text and "n = 2 seeds" in text
    with (tmp_path / "points.csv").open() as f:
        points = list(csv.DictReader(f))
    assert [float(p["ttl_s"]) for p in points] == [30.0, 600.0]
    assert main(["ttl-curve", "--ttls-s=0"]) == 2


def test_the_curve_keeps_its_run_in_a_new_folder_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(console.RUNS_ENV, str(runs))
    argv = ["ttl-curve", "--sessions=5", "--ttls-s=30,600", "--seeds=1"]
    assert main(argv) == 0
    (folder,) = runs.iterdir()
    assert re.fullmatch(r"ttl-curve-\d{8}-\d{4}", folder.name) and (folder / "points.csv").is_file()
    assert capsys.readouterr().err.count(f"run folder: {folder}\n") == 2  # at the start and at the end
    assert main([*argv, "--no-save"]) == 0
    assert list(runs.iterdir()) == [folder] and "run folder" not in capsys.readouterr().err
    assert main([*argv, "--no-save", "--out", str(tmp_path / "x")]) == 2
    assert "--no-save: not with --out" in capsys.readouterr().err


def test_the_instructions_on_their_own_ttl_against_one_ttl_for_every_breakpoint(tmp_path: Path) -> None:
    """Sparse sessions (one every 100 s on average) on two replicas: a replica often idles past a
    60 s timeout, so with one TTL the instructions expire and are prefilled again; on a 12 h
    breakpoint of their own they stay. The paired gain is positive at 60 s and none at a timeout
    past every gap; the run folder keeps both arms."""
    config = TTLCurveConfig(sessions=12, load=0.01, ttls_s=(60.0, 40_000.0), seeds=2, one_ttl=True)
    config = msgspec.structs.replace(config, fleet=msgspec.structs.replace(config.fleet, prefix_ttl_s=43_200.0))
    rows, _ = ttl_curve(config)
    one_rows, gains = one_ttl_curve(config, rows)
    own = {(r["ttl_s"], r["seed"]): r["hit_rate"] for r in rows}
    assert all(own[60.0, r["seed"]] > r["hit_rate"] for r in one_rows if r["ttl_s"] == 60.0)  # every seed
    short, past = gains
    assert short["hit_rate_gain"] > 0 and short["n"] == 2, short
    assert past["hit_rate_gain"] == 0 and past["stored_over_active_gain"] == 0, past
    argv = ["ttl-curve", "--sessions=6", "--load=0.01", "--ttls-s=60", "--seeds=2", "--one-ttl"]
    assert main([*argv, "--prefix-ttl-s=43200", f"--out={tmp_path}"]) == 0
    assert (tmp_path / "one_ttl_points.csv").is_file() and (tmp_path / "one_ttl_runs.csv").is_file()


def test_a_prefix_ttl_under_the_longest_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_ttl_s"):
        TTLCurveConfig(ttls_s=(60.0, 900.0), fleet=FleetConfig(prefix_ttl_s=600.0))
