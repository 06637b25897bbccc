"""The capacity job (sim/harness/capacity.py, `python -m sim capacity`)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from prototype.options import struct_from_args
from sim.__main__ import build_parser, main
from sim.fleet.config import FleetConfig
from sim.harness import console
from sim.harness.capacity import (
    POINT_COLUMNS,
    CapacityConfig,
    Variant,
    arrivals,
    crossover_table,
    point_sessions,
    run_capacity,
    run_point,
)
from sim.harness.sweep import dask_executor
from sim.model.config import HOSTED_MODEL
from tests.support import approx_numbers

SMALL = CapacityConfig(
    workload="interactive",
    sessions=40,
    loads=(0.5, 4.0),
    kv_budgets=(120_000,),
    tool_tails=(1.0,),
    seeds=2,
    fleet=FleetConfig(replicas=2, cache_ttl_s=60.0, model=msgspec.structs.replace(HOSTED_MODEL, decode_slots=8)),
)


def test_arrivals_scale_with_the_load_on_the_same_draws() -> None:
    slow, fast = arrivals(0, 50, 1.0), arrivals(0, 50, 4.0)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert all(b > a for a, b in zip(slow, slow[1:], strict=False))
    assert arrivals(1, 50, 1.0) != slow


def test_a_point_serves_every_variant_the_same_sessions_and_loses_none() -> None:
    rows = run_point(SMALL, 4.0, 120_000, 1.0, 0)
    assert [(r["mode"], r["policy"], r["preempt"]) for r in rows] == [
        ("http", "-", "-"),
        ("http_prev", "-", "-"),
        ("ws", "-", "-"),
        ("append", "hold", "wait"),
        ("append", "hold", "preempt"),
        ("append", "ttl", "wait"),
        ("append", "ttl", "preempt"),
        ("append", "release", "-"),
        ("append", "offload", "-"),
    ]
    for r in rows:
        assert r["sessions_arrived"] == r["sessions_completed"] == SMALL.sessions
        assert r["kv_peak_tokens"] <= r["kv_budget_tokens"]
        assert 0 <= r["goodput"] <= 4.0
        # Priced compute reports which resource saturates, per replica and per session.
        assert r["prefill_tok_per_s"] > 0 and 0 < r["busy_share"] <= 1 and 0 < r["model_share"] < 1
    # At the overload point the KV budget binds: something waits or is preempted.
    assert any(r["admission_wait_p90_s"] > 0 or r["preemptions"] > 0 for r in rows)


@pytest.mark.slow
def test_goodput_has_an_interval_over_seeds_and_falls_with_a_tighter_slo() -> None:
    _, points = run_capacity(SMALL)
    assert {p["n"] for p in points} == {2}
    for p in points:
        assert p["goodput_ci_low"] <= p["goodput"] <= p["goodput_ci_high"]
    strict = msgspec.structs.replace(SMALL, ttft_slo_s=0.05)
    _, strict_points = run_capacity(strict)
    assert sum(p["goodput"] for p in strict_points) < sum(p["goodput"] for p in points)


def test_a_tool_tail_changes_the_times_and_nothing_else() -> None:
    base = point_sessions("agentic", 0, 30, 1.0)
    light = point_sessions("agentic", 0, 30, 0.5)
    assert [s.output_tokens for s in light] == [s.output_tokens for s in base]
    assert [s.tool_tokens for s in light] == [s.tool_tokens for s in base]
    times = [t for s in base for t in s.tool_times_s]
    lighter = [t for s in light for t in s.tool_times_s]
    # The same draws: the median stays (within sampling of the same points), the tail shrinks.
    assert np.median(lighter) == pytest.approx(np.median(times), rel=0.35)
    assert np.quantile(lighter, 0.99) < 0.5 * np.quantile(times, 0.99)
    assert all((a > 0.3) == (b > 0.3) for a, b in zip(times, lighter, strict=True))  # same side of the median


@pytest.mark.slow
def test_held_kv_that_waits_loses_to_ws_where_preempting_it_does_not() -> None:
    """The crossover in small: a budget the held KV overflows; waiting for it collapses, preempting
    it does not, and the paired comparison against ws says so with its interval. Free compute, so
    that KV is the only resource short (with priced compute both saturate at this load)."""
    config = msgspec.structs.replace(
        SMALL,
        loads=(4.0,),
        kv_budgets=(60_000,),
        modes=("ws", "append"),
        policies=("hold",),
        seeds=3,
        fleet=msgspec.structs.replace(SMALL.fleet, compute="free"),
    )
    _, points = run_capacity(config)
    by = {p["preempt"]: p for p in points if p["mode"] == "append"}
    assert by["wait"]["saved_vs_ws_ci_high"] < 0 < by["wait"]["admission_wait_p90_s"]
    assert by["wait"]["goodput_vs_ws"] < 0
    assert by["preempt"]["saved_vs_ws_pct"] > by["wait"]["saved_vs_ws_ci_high"]
    assert by["preempt"]["admission_wait_p90_s"] < by["wait"]["admission_wait_p90_s"]
    text = crossover_table(config, points)
    wait_line = next(line for line in text.splitlines() if line.startswith("append hold wait"))
    assert wait_line.rstrip().endswith("-")
    # With room for every held context, holding saves against ws.
    roomy = msgspec.structs.replace(config, loads=(0.5,), kv_budgets=(0,))
    _, points = run_capacity(roomy)
    (wait,) = [p for p in points if p["preempt"] == "wait"]
    assert wait["saved_vs_ws_ci_low"] > 0 and wait["admission_wait_p90_s"] == 0


def test_a_closed_loop_serves_every_session_with_users_as_the_load() -> None:
    config = msgspec.structs.replace(SMALL, users=(2, 8), think_median_s=5.0, modes=("ws",), seeds=2)
    rows, points = run_capacity(config)
    assert {r["users"] for r in rows} == {2, 8} and {r["offered_load"] for r in rows} == {0.0}
    assert all(r["sessions_arrived"] == r["sessions_completed"] == SMALL.sessions for r in rows)
    few, many = sorted(points, key=lambda p: p["users"])
    assert many["goodput"] > few["goodput"]  # more users finish the same sessions sooner


def test_the_grid_is_every_load_budget_tail_and_seed() -> None:
    config = msgspec.structs.replace(SMALL, kv_budgets=(0, 60_000), tool_tails=(0.5, 1.0), seeds=2)
    assert len(config.grid()) == 2 * 2 * 2 * 2
    assert len(set(config.grid())) == len(config.grid())
    with pytest.raises(ValueError, match="kv_budgets"):
        msgspec.structs.replace(SMALL, fleet=FleetConfig(kv_budget_tokens=1000))
    assert Variant("append", "hold", "wait").label == "append hold wait"


@pytest.mark.slow
def test_a_sweep_runs_on_a_dask_cluster_with_the_same_rows() -> None:
    config = msgspec.structs.replace(SMALL, loads=(1.0,), modes=("ws", "append"), policies=("hold",))
    local, _ = run_capacity(config)
    with dask_executor("local", workers=2) as executor:
        remote, _ = run_capacity(config, executor)
    assert remote == local


@pytest.mark.slow
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
            "--kv-budgets=80000",
            "--preempt=false",
            "--tool-tails=1",
            "--decode-slots=8",
            "--workers=1",
            "--quiet",
            f"--out={out}",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "append hold wait" in text and "release" in text
    assert "session time saved vs ws" in text
    busy = text.split("busy share / prefill k tokens/s")[1]  # which resource saturates, per variant and cell
    assert "ws" in busy and "append hold wait" in busy and "k;" in busy
    cache = text.split("prefix-hit rate % (95 % CI) / cached M tokens evicted")[1]  # the cache, per variant and cell
    assert "tail blocks first" in cache.splitlines()[0] and "append release" in cache and "M" in cache
    with (out / "points.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == POINT_COLUMNS
    for row in rows:  # the hit rate's interval over the two seeds holds its mean
        assert float(row["hit_rate_ci_low"]) <= float(row["hit_rate"]) <= float(row["hit_rate_ci_high"])
    assert len(rows) == 3 * 2  # (ws, append hold wait, append release) x 2 loads
    assert (out / "frontier.png").stat().st_size > 0 and (out / "crossover.png").stat().st_size > 0
    saved = msgspec.json.decode((out / "config.json").read_bytes())
    assert saved["kv_budgets"] == [80000] and saved["preempt"] == [False]


def test_minwaste_and_a_host_budget_are_reached_from_the_command_line() -> None:
    """`--policies ...,minwaste` adds the min-waste variant (the default leaves it out), and
    `--offload-host-gb` bounds offload's host memory: rows count each choice and the host's use."""
    assert "minwaste" not in SMALL.policies
    args = build_parser().parse_args(
        ["capacity", "--policies=offload,minwaste", "--offload-host-gb=2", "--pause-mean-s=0.5", "--modes=append"]
    )
    config = msgspec.structs.replace(struct_from_args(args, CapacityConfig), workload="interactive", sessions=40)
    assert config.policies == ("offload", "minwaste") and config.fleet.offload_host_gb == 2.0
    offload, minwaste = run_point(config, 4.0, 120_000, 1.0, 0)
    assert (offload["policy"], minwaste["policy"]) == ("offload", "minwaste")
    assert 0 < offload["host_peak_gb"] <= 2.0 and offload["host_drops"] > 0 and offload["link_busy_share"] > 0
    assert offload["preserved"] == offload["discarded"] == offload["swapped"] == 0
    pauses = sum(minwaste[c] for c in ("preserved", "discarded", "swapped"))
    assert pauses > 0 and minwaste["preserved"] > 0  # a 0.5 s expected pause keeps small contexts


def test_the_eviction_rule_is_reached_from_the_command_line_and_counted() -> None:
    """`--no-evict-tail` reaches the point's fleet: whole entries go where tail blocks would do,
    so ws evicts more cached tokens for the same sessions; each row counts them."""
    args = build_parser().parse_args(["capacity", "--no-evict-tail", "--modes=ws"])
    whole = msgspec.structs.replace(struct_from_args(args, CapacityConfig), workload="interactive", sessions=40)
    assert not whole.fleet.evict_tail
    tail = msgspec.structs.replace(whole, fleet=msgspec.structs.replace(whole.fleet, evict_tail=True))
    (by_tail,), (by_whole,) = run_point(tail, 4.0, 60_000, 1.0, 0), run_point(whole, 4.0, 60_000, 1.0, 0)
    assert 0 < by_tail["evicted_tokens"] < by_whole["evicted_tokens"]


def test_the_cli_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--policies=forever", "--quiet"]) == 2
    assert "policies" in capsys.readouterr().err
    assert main(["capacity", "--router=roundrobin", "--quiet"]) == 2
    assert "router" in capsys.readouterr().err


def test_a_point_split_by_replica_gives_the_same_rows() -> None:
    config = msgspec.structs.replace(
        SMALL,
        seeds=1,
        modes=("ws", "append"),
        policies=("hold",),
        fleet=msgspec.structs.replace(SMALL.fleet, router="hash"),
    )
    whole, _ = run_capacity(config)
    split, _ = run_capacity(config, split=True)
    assert len(split) == len(whole)
    for a, b in zip(split, whole, strict=True):
        assert a == approx_numbers(b, rel=1e-9)  # the KV shares: a float sum in another order; labels exactly
    # The comparison can fail: another label, or a figure off by more than the tolerance.
    row = whole[0]
    assert row != approx_numbers({**row, "mode": "append"}, rel=1e-9)
    assert row != approx_numbers({**row, "e2e_mean_s": row["e2e_mean_s"] * (1 + 1e-6)}, rel=1e-9)
    with pytest.raises(ValueError, match="least loaded; use hash"):
        run_capacity(SMALL, split=True)


def test_the_cli_refuses_to_split_a_point_whose_replicas_share_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--sessions=4", "--seeds=1", "--router=least", "--split-point"]) == 2
    assert "does not split by replica" in capsys.readouterr().err


def test_capacity_keeps_its_run_in_a_new_folder_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(console.RUNS_ENV, str(runs))
    argv = ["capacity", "--workload=interactive", "--sessions=5", "--loads=1", "--seeds=1", "--modes=ws,append"]
    argv += ["--policies=hold", "--preempt=false", "--kv-budgets=80000", "--tool-tails=1", "--decode-slots=8"]
    argv += ["--workers=1", "--quiet"]
    assert main(argv) == 0
    (folder,) = runs.iterdir()
    assert re.fullmatch(r"capacity-\d{8}-\d{4}", folder.name) and (folder / "points.csv").is_file()
    assert capsys.readouterr().err.count(f"run folder: {folder}\n") == 2  # at the start and at the end
    assert main([*argv, "--no-save"]) == 0
    assert list(runs.iterdir()) == [folder] and "run folder" not in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "config.json").is_file() and list(runs.iterdir()) == [folder]
