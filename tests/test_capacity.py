"""The capacity job (sim/harness/capacity.py, `python -m sim capacity`)."""

from __future__ import annotations

import csv
from pathlib import Path

import msgspec
import pytest

from sim.__main__ import main
from sim.fleet.engine import FleetConfig
from sim.harness.capacity import POINT_COLUMNS, CapacityConfig, arrivals, run_capacity, run_point
from sim.harness.sweep import dask_executor

SMALL = CapacityConfig(
    workload="interactive",
    sessions=40,
    loads=(0.5, 4.0),
    seeds=2,
    fleet=FleetConfig(replicas=2, decode_slots=8, kv_budget_tokens=120_000, cache_ttl_s=60.0),
)


def test_arrivals_scale_with_the_load_on_the_same_draws() -> None:
    slow, fast = arrivals(0, 50, 1.0), arrivals(0, 50, 4.0)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert all(b > a for a, b in zip(slow, slow[1:], strict=False))
    assert arrivals(1, 50, 1.0) != slow


def test_a_point_serves_every_variant_the_same_sessions_and_loses_none() -> None:
    rows = run_point(SMALL, 4.0, 0)
    assert [(r["mode"], r["policy"]) for r in rows] == [
        ("http", "-"),
        ("http_prev", "-"),
        ("ws", "-"),
        ("append", "hold"),
        ("append", "ttl"),
        ("append", "release"),
        ("append", "offload"),
    ]
    for r in rows:
        assert r["sessions_arrived"] == r["sessions_completed"] == SMALL.sessions
        assert r["kv_peak_tokens"] <= r["kv_budget_tokens"]
        assert 0 <= r["goodput"] <= 4.0
    # At the overload point the KV budget binds: something waits or is preempted.
    assert any(r["admission_wait_p90_s"] > 0 or r["preemptions"] > 0 for r in rows)


def test_goodput_has_an_interval_over_seeds_and_falls_with_a_tighter_slo() -> None:
    _, points = run_capacity(SMALL)
    assert {p["n"] for p in points} == {2}
    for p in points:
        assert p["goodput_ci_low"] <= p["goodput"] <= p["goodput_ci_high"]
    strict = msgspec.structs.replace(SMALL, ttft_slo_s=0.05)
    _, strict_points = run_capacity(strict)
    assert sum(p["goodput"] for p in strict_points) < sum(p["goodput"] for p in points)


def test_a_sweep_runs_on_a_dask_cluster_with_the_same_rows() -> None:
    config = msgspec.structs.replace(SMALL, loads=(1.0,), modes=("ws", "append"), policies=("hold",))
    local, _ = run_capacity(config)
    with dask_executor("local", workers=2) as executor:
        remote, _ = run_capacity(config, executor)
    assert remote == local


def test_the_cli_writes_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap"
    code = main(
        [
            "capacity",
            "--workload=interactive",
            "--sessions=20",
            "--loads=1,2",
            "--seeds=2",
            "--modes=ws,append",
            "--policies=hold,release",
            "--kv-budget-tokens=80000",
            "--decode-slots=8",
            "--workers=1",
            "--quiet",
            f"--out={out}",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "append" in text and "release" in text
    with (out / "points.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == POINT_COLUMNS
    assert len(rows) == 3 * 2  # (ws, append hold, append release) x 2 loads
    assert (out / "frontier.png").stat().st_size > 0
    assert msgspec.json.decode((out / "config.json").read_bytes())["fleet"]["kv_budget_tokens"] == 80000


def test_the_cli_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--policies=forever", "--quiet"]) == 2
    assert "policies" in capsys.readouterr().err
    assert main(["capacity", "--router=roundrobin", "--quiet"]) == 2
    assert "router" in capsys.readouterr().err
