"""Virtual time against live loopback on a CPU-heavy configuration, with a negative control.

The configuration has no modeled waits to speak of (the `local` profile, unpaced decode, no
tool time, free prefill): a turn is the server's real work, and `http_prev` re-renders and
re-classifies a 40k-token system prompt every turn while `ws` renders only the new items.
With CPU charged, virtual time must report what live reports: completion time, TTFT,
overhead share, the per-turn `http_prev - ws` difference and the `render` stage. With CPU
free (the negative control) every one of those must miss: the control shows that each check
can fail. CPU charged only between loop iterations (not inside the callback doing the work)
fails the `render` check: the stage then reads zero.

Nothing sleeps in this configuration, so a loaded machine's late wake-ups (which virtual time
leaves out, docs/fidelity.md) do not enter. `http_prev` rather than `http`: the full history
then stays on the server, and what differs between the modes is the server's CPU work, not
the upload. Tolerances are wide on purpose: the live side runs on a machine other jobs may
share, where a millisecond of CPU takes one to several milliseconds of wall time, and the
live transport's own cost (the kernel, aiohttp's HTTP and SSE handling, the client's parsing:
a few milliseconds a turn here, where three events a turn echo the 40k-token instructions,
and over ten under heavy load) is not charged, so turn times may differ by a factor of two
or more; the render stage has no transport in it and is held tighter. The control misses
each check by far more: with CPU free its turns take no time at all.
`python -m sim fidelity` is the instrument with the tight targets.

A second, transport-heavy configuration checks the live transport's costs (`LiveCosts`,
calibrated here): with them charged, the part of an `http - ws` turn outside every server
stage agrees with live; without them (the negative control) it reads a fraction of live's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import msgspec
import pytest
import uvloop

from sim.__main__ import main
from sim.harness.experiment import CompareConfig, CompareResult, compare
from sim.harness.fidelity import (
    FidelityReport,
    calibrate,
    compare_runs,
    format_report,
    paired_bootstrap,
    run_pairs,
    write_live_costs,
)
from tests.support import REPO

# Every test here times live clients (docs/testing.md): no per-event validation on their path.
pytestmark = pytest.mark.wire_unchecked

CPU_HEAVY = CompareConfig.of(
    profile="local",
    system_prompt_tokens=40_000,
    tool_calls=8,
    rollouts=1,
    tps=0.0,
    tool_time_s=0.0,
    tool_time_sigma=0.0,
    model_latency_s=0.0,  # nothing sleeps: a loaded machine's late wake-ups are not part of this check
    prefill_tok_per_s=0.0,
    tool_output_tokens=30,  # short items: rendered on the event loop in both runs, never offloaded
    modes=("http_prev", "ws"),
)
RATIO = (0.25, 4.0)  # completion time and TTFT: virtual / live (they include the live transport)
DIFF_RATIO = (0.25, 4.0)  # the paired per-turn http_prev - ws difference: virtual / live
STAGE_RATIO = (0.5, 2.0)  # the render stage (the same work on both sides) and http_prev's overhead share


def _within(ratio: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= ratio <= bounds[1]


def checks(report: FidelityReport) -> dict[str, bool]:
    """Each check by name: does virtual time agree with live on it?"""
    out = {}
    for mode in CPU_HEAVY.modes:
        out[f"{mode} completion"] = _within(report.row(mode, "completion").ratio, RATIO)
        out[f"{mode} ttft"] = _within(report.row(mode, "ttft").ratio, RATIO)
    # `ws`'s overhead share here is a ratio of two small sums whose split between model stages and
    # overhead depends on which task runs while the server awaits: only the CPU-heavy mode's is held.
    out["http_prev overhead share"] = _within(report.row("http_prev", "overhead_share").ratio, STAGE_RATIO)
    out["http_prev-ws per turn"] = _within(report.row("http_prev-ws", "turn").ratio, DIFF_RATIO)
    # The re-rendering is charged inside its stage, not to whichever stage's clock read comes next.
    out["http_prev render stage"] = _within(report.row("http_prev", "render").ratio, STAGE_RATIO)
    return out


Runs = tuple[list[CompareResult], list[CompareResult], CompareResult]


@pytest.fixture(scope="module")
def runs() -> Runs:
    # Alternating: a load change hits both sides. Live on uvloop, as `python -m sim` runs it.
    live, charged = run_pairs(CPU_HEAVY, repeats=5, loop_factory=uvloop.new_event_loop)
    free = compare(CPU_HEAVY, virtual=True, free_cpu=True)  # CPU free, nothing waits: rollouts of 0 s
    return live, charged, free


@pytest.mark.slow
def test_with_cpu_charged_virtual_time_agrees_with_live_on_a_cpu_heavy_config(runs: Runs) -> None:
    live, charged, _ = runs
    report = compare_runs(live, charged)
    assert report.row("http_prev", "overhead_share").live.estimate > 0.5  # CPU-heavy, live says so
    assert report.row("http_prev-ws", "turn").live.estimate > 0.005
    failed = [name for name, ok in checks(report).items() if not ok]
    assert not failed, f"{failed}\n{format_report(report)}"


@pytest.mark.slow
def test_negative_control_with_cpu_free_every_check_disagrees(runs: Runs) -> None:
    live, _, free = runs
    report = compare_runs(live, free, free_cpu=True)
    agreed = [name for name, ok in checks(report).items() if ok]
    assert not agreed, f"{agreed}\n{format_report(report)}"
    assert not report.agrees


# Small contexts and short items: per turn, `http` and `ws` differ mostly in the live transport
# (an HTTP request and its response against a WebSocket message, each after the loop slept
# through the tool's time), which virtual time charges only with `live_costs`. The check is on
# that part of the turn, outside every server stage (`client`); paced decode keeps the client's
# parsing of the deltas inside the decode, as live.
TRANSPORT_HEAVY = CompareConfig.of(
    profile="local",
    system_prompt_tokens=1000,
    tool_calls=6,
    rollouts=1,
    tool_time_s=0.05,
    tool_time_sigma=0.0,
    tool_output_tokens=30,
    modes=("http", "ws"),
)
TRANSPORT_RATIO = (0.5, 2.0)  # the paired per-turn http - ws `client` difference: virtual / live


# The live side is timed in a fresh interpreter: in the whole suite's process, what earlier tests
# leave behind (threads, executors, a cluster's clients, the heap) moved its per-turn timings past
# the ratio's bounds, where the same check in its own process agrees.
_INNER: Final = "LONGRUN_FIDELITY_TRANSPORT_INNER"


def _transport_runs(tmp_path: Path) -> tuple[list[CompareResult], ...]:
    # 40 repeats left the medians of a loaded machine far enough apart run to run to miss the ratio's bounds.
    costs = calibrate(repeats=120, stream_bytes=200_000, loop_factory=uvloop.new_event_loop)
    path = write_live_costs(costs, tmp_path / "live-costs.json")
    config = msgspec.structs.replace(TRANSPORT_HEAVY, live_costs=str(path))
    live, charged = run_pairs(config, repeats=3, loop_factory=uvloop.new_event_loop)
    uncharged = [compare(TRANSPORT_HEAVY, virtual=True) for _ in range(3)]  # CPU charged, no live costs
    return live, charged, uncharged


@pytest.mark.slow
def test_with_live_costs_charged_the_transport_difference_agrees_and_without_them_it_does_not(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if os.environ.get(_INNER) != "1":  # run this test alone in a new process, and pass on its verdict
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
        done = subprocess.run(
            argv, cwd=REPO, env={**os.environ, _INNER: "1"}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
        return
    live, charged, uncharged = _transport_runs(tmp_path)
    with_costs, without = compare_runs(live, charged), compare_runs(live, uncharged)
    row = with_costs.row("http-ws", "client")
    assert row.live.estimate > 0.0003, format_report(with_costs)  # live: the transports differ per turn
    assert _within(row.ratio, TRANSPORT_RATIO), format_report(with_costs)
    # The negative control: the same CPU-charged virtual runs without the transport's costs.
    assert without.row("http-ws", "client").ratio < TRANSPORT_RATIO[0] / 2, format_report(without)


def test_paired_bootstrap_is_seeded_and_brackets_its_estimate() -> None:
    values = [0.001 * (i % 7) + 0.010 for i in range(40)] + [0.5]  # one preemption-sized outlier
    a, b = paired_bootstrap(values, seed=3), paired_bootstrap(values, seed=3)
    assert a == b
    assert a.low <= a.estimate <= a.high
    assert a.high < 0.02  # the trimmed mean is not moved by the outlier
    assert math.isnan(paired_bootstrap([]).estimate)


def test_the_command_prints_both_sides_the_pairs_and_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fidelity", "local", "--tool-calls", "2", "--rollouts", "1", "--tps", "0", "--tool-time-s", "0"]
    status = main([*argv, "--model-latency-s", "0.001", "--modes", "ws,append"])
    out = capsys.readouterr().out
    assert '"tool_calls": 2' in out and '"profile": "local"' in out  # the preset, overridden
    rows = [line.split()[:2] for line in out.splitlines()]
    for mode in ("ws", "append"):
        for metric in ("turn", "ttft", "completion", "overhead_share", "render", "safety"):
            assert [mode, metric] in rows
    assert ["ws-append", "turn"] in rows and ["http-ws", "turn"] not in rows
    verdict = out.strip().splitlines()[-1]
    assert verdict == f"virtual time with CPU charged: {'agrees' if status == 0 else 'DISAGREES'} with live"


def test_the_command_refuses_an_unknown_config_before_running_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fidelity", "nope"]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err
    assert main(["fidelity", "local", "--modes", "ws,carrier-pigeon"]) == 2
    assert "unknown mode" in capsys.readouterr().err


def test_calibrate_measures_each_named_live_cost() -> None:
    costs = calibrate(repeats=20, stream_bytes=200_000, loop_factory=uvloop.new_event_loop)
    names = [c.name for c in costs]
    assert names == [
        "timer_wakeup",
        "work_after_wait",
        "render_hop",
        "render_offload",
        "http_request",
        "http_request_after_wait",
        "http_response",
        "http_response_after_wait",
        "sse_per_mb",
        "ws_message",
        "ws_message_after_wait",
        "ws_per_mb",
    ]
    for c in costs:
        assert c.median_s <= c.p90_s, c
        # `render_offload`, `work_after_wait` and `sse_per_mb` are differences of two timings, which
        # noise on a shared machine may exceed: only the direct measurements must be positive.
        if c.name not in ("render_offload", "work_after_wait", "sse_per_mb"):
            assert c.median_s > 0, c
