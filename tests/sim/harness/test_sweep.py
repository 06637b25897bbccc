"""Sweeps: the grid, reproducible rows, and the same rows from a Dask cluster on loopback."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgspec
import pytest

from sim.__main__ import main
from sim.harness.experiment import CompareConfig, compare
from sim.harness.specs import first_rollouts
from sim.harness.sweep import SweepConfig, dask_executor, points, run_sweep
from sim.rollout.result import TurnResult

TINY = SweepConfig(
    tps=(65.0, 1000.0),
    tool_calls=(3,),
    tool_time_s=(0.3,),
    rtt_s=(0.04, 0.1),
    profile=("hosted",),
    base=CompareConfig(rollouts=1, system_prompt_tokens=1000, tool_output_tokens=200),
)


def test_grid_order_and_values() -> None:
    grid = points(TINY)
    assert [(p.model.tps, p.rtt_s) for p in grid] == [(65.0, 0.04), (65.0, 0.1), (1000.0, 0.04), (1000.0, 0.1)]
    assert all(p.tool_calls == 3 and p.rollouts == 1 and p.system_prompt_tokens == 1000 for p in grid)


def _rows_key(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row.values()) for row in rows]


def test_sweep_rows_are_reproducible_and_show_the_crossover() -> None:
    rows = run_sweep(TINY)
    assert len(rows) == 4 * 4
    assert _rows_key(rows) == _rows_key(run_sweep(TINY))
    with ProcessPoolExecutor(max_workers=2) as pool:
        assert _rows_key(run_sweep(TINY, pool)) == _rows_key(rows)
    saved = {(r["tps"], r["rtt_s"]): r["saved_vs_http"] for r in rows if r["mode"] == "ws"}
    assert saved[(1000.0, 0.04)] > saved[(65.0, 0.04)] > 0  # the gain grows with decode speed


@pytest.mark.slow
def test_the_same_sweep_on_a_dask_cluster_on_loopback() -> None:
    pytest.importorskip("distributed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cluster's own deprecation and resource warnings
        with dask_executor("local", workers=2) as executor:
            rows = run_sweep(TINY, executor)
    assert _rows_key(rows) == _rows_key(run_sweep(TINY))


def test_cli_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "sweep.parquet"
    argv = ["sweep", "--tps", "1000", "--tool-calls", "2", "--tool-time-s", "0.3", "--rollouts", "1"]
    assert main([*argv, "--workers", "1", "--quiet", "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def _turn_content(turn: TurnResult) -> list[tuple[str, str, str]]:
    """What the model said in a turn, without per-response ids."""
    out = []
    for item in turn.output_items:
        if item.get("type") == "function_call":
            out.append(("function_call", item["name"], item["arguments"]))
        else:
            text = "".join(part.get("text", "") for part in item.get("content", []))
            out.append((item.get("type", ""), "", text))
    return out


def test_sweep_points_share_their_draws() -> None:
    """Common random numbers: rollout r's first turns are the same at 5 and 10 tool calls and
    at 65 and 1000 tokens/s (same tool outputs, tool times and model tokens)."""
    grid = points(
        SweepConfig(
            tps=(65.0, 1000.0),
            tool_calls=(5, 10),
            tool_time_s=(0.3,),
            modes=("ws",),
            base=CompareConfig(rollouts=2, system_prompt_tokens=500, tool_output_tokens=100, seed=11),
        )
    )
    specs = {(p.model.tps, p.tool_calls): first_rollouts(p)[0] for p in grid}
    runs = {(p.model.tps, p.tool_calls): compare(p, virtual=True, free_cpu=True) for p in grid}
    for r in range(2):
        short, long = specs[(1000.0, 5)][r], specs[(1000.0, 10)][r]
        assert long.tool_times_s[:5] == short.tool_times_s and long.tool_outputs[:5] == short.tool_outputs
        assert long.tool_times_s[5:] != short.tool_times_s  # five more turns of their own
        assert specs[(65.0, 10)][r] == long  # decode speed draws nothing
        by_point = {key: next(x for x in run.rollouts if x.index == r) for key, run in runs.items()}
        reference = [_turn_content(t) for t in by_point[(1000.0, 10)].turns]
        assert len(reference) == 11 and all(reference)
        for key, rollout in by_point.items():
            k = key[1]  # tool calls: turns 0..k-1 call a tool, turn k answers
            assert [_turn_content(t) for t in rollout.turns[:k]] == reference[:k], key
            # The tool step between turns takes the drawn time at every point.
            gaps = [b.sent_at - a.done_at for a, b in itertools.pairwise(rollout.turns)]
            assert gaps == pytest.approx(list(short.tool_times_s[: min(k, 5)]) + list(long.tool_times_s[5:k]))
    # The speeds differ in timing only: same tokens, other times.
    slow, fast = runs[(65.0, 10)].rollouts[0], runs[(1000.0, 10)].rollouts[0]
    assert [_turn_content(t) for t in slow.turns] == [_turn_content(t) for t in fast.turns]
    assert slow.completion_s > fast.completion_s


def test_workload_rollouts_share_their_draws_whatever_else_is_drawn() -> None:
    from sim.rollout.workload import WORKLOADS, draw_rollouts

    ten, _ = draw_rollouts(WORKLOADS["swe-long"], seed=4, count=10)
    tail, _ = draw_rollouts(WORKLOADS["swe-long"], seed=4, count=3, start=7)
    assert ten[7:] == tail
    slower = msgspec.structs.replace(
        WORKLOADS["swe-long"],
        tool_time=tuple(msgspec.structs.replace(c, median_s=2 * c.median_s) for c in WORKLOADS["swe-long"].tool_time),
    )
    doubled, _ = draw_rollouts(slower, seed=4, count=3)
    for a, b in zip(ten[:3], doubled, strict=True):
        assert a.tool_outputs == b.tool_outputs  # another tool-time median: the same outputs
        assert [min(2 * t, 900.0) for t in a.tool_times_s] == pytest.approx(list(b.tool_times_s))


# -- an interrupted job stops its workers --------------------------------------------------------


def _children(pid: int) -> set[int]:
    """Every descendant of `pid`: psutil's view if it is installed, else /proc's (Linux)."""
    try:
        import psutil
    except ImportError:
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                parents[int(stat.parent.name)] = int(fields[1])
        found, frontier = set(), {pid}
        while frontier:
            frontier = {child for child, parent in parents.items() if parent in frontier} - found
            found |= frontier
        return found
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited and not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _command_line(pid: int) -> str:
    """`pid`'s command line ("" once it has gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _still_running_after(pids: set[int], bound_s: float) -> set[int]:
    """Those of `pids` still running `bound_s` after the call: each one's exit is awaited on a
    pidfd (an event, not a sleep), so the call returns as soon as all have gone."""
    deadline = time.monotonic() + bound_s
    left = set()
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            continue
        try:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
        if not readable and _running(pid):
            left.add(pid)
    return left


def _descendants_once_working(proc: subprocess.Popen[str], count: int, bound_s: float) -> set[int]:
    """The job's descendant processes once it has at least `count` (polled, up to `bound_s`)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        kids = _children(proc.pid)
        if len(kids) >= count:
            return kids
        with contextlib.suppress(subprocess.TimeoutExpired):  # the bounded wait between two looks
            proc.wait(timeout=0.05)
        assert proc.returncode is None, f"the job ended before it had workers: {proc.communicate()}"
    raise AssertionError(f"the job had no {count} workers after {bound_s} s")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("executor", [["--workers", "2"], ["--dask", "local", "--workers", "2"]], ids=["pool", "dask"])
def test_a_job_stopped_by_sigterm_stops_its_workers(executor: list[str], tmp_path: Path) -> None:
    """`sim capacity` under a timeout (SIGTERM): the job unwinds as on Ctrl-C and no worker is left."""
    command = [sys.executable, "-m", "sim", "capacity", "--sessions", "3000", "--quiet", *executor]
    proc = subprocess.Popen(
        [*command, "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal to the test's own group does not reach it
    )
    try:
        descendants = _descendants_once_working(proc, 2, 120)
        # multiprocessing's resource tracker is no worker: it ends on its own once the job's end
        # closes its pipe, so it may outlive the job by a moment. It must end soon after.
        trackers = {pid for pid in descendants if "resource_tracker" in _command_line(pid)}
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        # The job joined its workers before it exited: none may be running now.
        left = [pid for pid in descendants - trackers if _running(pid)]
        trackers_left = _still_running_after(trackers, 30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the job's group, on any outcome
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    assert left == [], "workers left running"
    assert trackers_left == set(), "multiprocessing's resource tracker outlived the job"
    assert proc.returncode == 130, err
    # Its one line (Dask's own shutdown logging may follow it when the signal came while the
    # cluster was still starting).
    assert "python -m sim capacity: interrupted" in err.splitlines(), err
    assert not (tmp_path / "run").exists()  # an interrupted job writes no results
