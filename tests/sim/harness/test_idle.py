"""`python -m sim idle`: per design, the rollouts an intermediary's idle timeout cuts, without and
with the server's keepalive, in virtual time."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from sim.__main__ import main
from sim.harness.idle import IdleConfig, IdleRollout, run_idle, summarize

# A timeout shorter than a quarter of `short`'s tool calls (lognormal, median 0.5 s, σ 1.0), so
# a socket held through 18 of them is all but surely cut; pings and comments well inside it.
SMALL = IdleConfig(
    workload="short",
    rollouts=3,
    modes=("http", "ws", "agents"),
    idle_timeout_s=1.0,
    ping_interval_s=0.4,
    sse_keepalive_s=0.4,
)


def test_sockets_held_through_tool_calls_are_cut_and_keepalive_saves_them() -> None:
    rollouts, summaries = run_idle(SMALL)
    by = {(s.mode, s.setting): s for s in summaries}
    assert by["http", "none"].cut == 0  # nothing held open between requests; streams carry deltas
    assert by["ws", "none"].cut > 0 and by["agents", "none"].cut > 0
    for mode in SMALL.modes:
        assert by[mode, "keepalive"].cut == 0
        assert by[mode, "keepalive"].lost_s == 0.0
    # The time lost is the cut rollouts' time up to the error their client saw.
    cut = [r for r in rollouts if r.cut and r.mode == "ws"]
    assert by["ws", "none"].lost_s == pytest.approx(sum(r.end_s - r.start_s for r in cut) / SMALL.rollouts)
    assert all("ClientConnectionResetError" in r.error for r in cut)
    assert by["ws", "keepalive"].keepalives_per_rollout > 0 and by["ws", "none"].keepalives_per_rollout == 0


def test_the_figures_of_handmade_rollouts() -> None:
    rows = [
        IdleRollout("ws", "none", 0, 0.0, 100.0, 5, True, "boom"),
        IdleRollout("ws", "none", 1, 100.0, 300.0, 9, False, ""),
        IdleRollout("ws", "none", 2, 300.0, 330.0, 3, True, "boom"),
        IdleRollout("ws", "none", 3, 330.0, 400.0, 8, False, ""),
    ]
    s = summarize(rows, keepalives=6)
    assert (s.n, s.cut, s.cut_share) == (4, 2, 0.5)
    assert s.cut_low < 0.5 < s.cut_high
    assert s.lost_s == (100.0 + 30.0) / 4 and 0.0 <= s.lost_low <= s.lost_s <= s.lost_high
    assert s.turns_before_cut == 4.0 and s.keepalives_per_rollout == 1.5 and s.error == "boom"
    none = summarize(rows[1::2], keepalives=0)
    assert none.cut == 0 and none.lost_s == 0.0 and math.isnan(none.turns_before_cut)
    other = summarize([*rows, IdleRollout("ws", "none", 4, 400.0, 410.0, 1, False, "400 bad")], keepalives=0)
    assert (other.failed, other.cut, other.lost_s) == (1, 2, 130.0 / 5)  # a failure that is no cut is apart


def test_the_job_runs_small_and_writes_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["idle", "--workload=short", "--rollouts=2", "--modes=http,append", "--idle-timeout-s=1", "--quiet"]
    assert main([*argv, f"--out={tmp_path}"]) == 0
    text = capsys.readouterr().out
    assert "idle timeout 1 s; workload short; n = 2 rollouts" in text
    with (tmp_path / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert [(r["mode"], r["setting"]) for r in summary] == [
        ("http", "none"),
        ("http", "keepalive"),
        ("append", "none"),
        ("append", "keepalive"),
    ]
    assert (tmp_path / "rollouts.csv").exists() and (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("flag", "says"),
    [("--modes=async", "modes: each one of"), ("--workload=nope", "workload: one of"), ("--idle-timeout-s=0", "")],
)
def test_a_bad_option_is_refused_in_one_line(flag: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["idle", flag, "--no-save"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m sim idle: invalid option") and says in err and err.count("\n") == 1
