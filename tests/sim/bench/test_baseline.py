"""`python -m sim.bench TARGET --baseline REV`: a target run here and on a git revision, interleaved,
each row's ratio new/old; a revision that does not exist or lacks the target refused in one line."""

from __future__ import annotations

import os

import pytest

from sim.bench import __main__ as bench
from sim.bench import baseline
from sim.bench.report import Row

TURN_3: str = "a804d1e"  # the turn-3 code: its bench has six targets, no `fleet`


def _switches() -> set[str]:
    return {o for a in bench.parser()._actions if a.nargs == 0 for o in a.option_strings}


def test_the_rows_a_run_printed_are_read_back_whatever_their_figures_and_goals() -> None:
    rows = [
        Row(
            "5",
            "virtual 50-turn rollout ms (ws, by turn, 150 ev, 2.1 MB of JSON, a long figure)",
            57.5,
            1.2,
            47.9,
            "<= 20 ms",
            False,
        ),
        Row("9", "fleet turns/CPU s", 1.14e4, 4.248e5, 0.0268, ">= 20,000", None),
    ]
    printed = "\n".join(
        ["target     figure  value", *(r.line() for r in rows), "           a note: 3.0 s", "2 rows ok"]
    )
    read = baseline.parse_rows(printed)
    assert [(m.target, m.figure) for m in read] == [(r.target, r.figure) for r in rows]
    assert [m.value for m in read] == [pytest.approx(57.5), pytest.approx(1.14e4)]
    assert [m.goal for m in read] == ["<= 20 ms", ">= 20,000"]


def test_a_side_gets_the_sizes_but_not_the_targets_nor_the_comparisons_own_options() -> None:
    argv = ["virtual", "--baseline", "main", "--sweep-points", "20", "--baseline-rounds=3", "--smoke", "fleet"]
    argv += ["--report", "page.md", "--virtual-turns=10", "--only", "stats"]
    assert baseline.forwarded(argv, _switches()) == ["--sweep-points", "20", "--smoke", "--virtual-turns=10"]


def test_the_ratio_is_the_median_of_each_rounds_ratio_and_the_spread_their_range() -> None:
    new = [[baseline.Measured("5", "a", v)] for v in (10.0, 30.0, 20.0)]
    old = [[baseline.Measured("5", "a", v)] for v in (20.0, 20.0, 10.0)]
    (pair,) = baseline.pairs("virtual", new, old)
    assert pair.ratios == [0.5, 1.5, 2.0] and pair.ratio == 1.5
    row = pair.row("main")
    assert (row.value, row.floor, row.ratio, row.goal, row.ok) == (20.0, 20.0, 1.5, "0.50-2.00", None)
    assert pair.best_ratio is None  # a goal with no direction: no best round


def test_the_best_rounds_ratio_follows_the_direction_the_goal_gives() -> None:
    # A time (lower is better): each side's fastest round, 10 against 9.
    new = [[baseline.Measured("5", "a", v, "<= 20 ms")] for v in (12.0, 30.0, 10.0)]
    old = [[baseline.Measured("5", "a", v, "<= 20 ms")] for v in (10.0, 20.0, 9.0)]
    (time,) = baseline.pairs("virtual", new, old)
    assert time.ratio == pytest.approx(1.2) and time.best_ratio == pytest.approx(10.0 / 9.0)
    assert time.row("main").goal == "1.11-1.50; best/best 1.11"
    # A rate (higher is better): each side's highest round.
    new = [[baseline.Measured("9", "b", v, ">= 20,000")] for v in (100.0, 300.0)]
    old = [[baseline.Measured("9", "b", v, ">= 20,000")] for v in (200.0, 150.0)]
    (rate,) = baseline.pairs("fleet", new, old)
    assert rate.best_ratio == pytest.approx(1.5)


def test_sides_that_print_different_rows_cannot_be_paired() -> None:
    one = [baseline.Measured("5", "a", 1.0)]
    with pytest.raises(baseline.Refused, match="different numbers of rows"):
        baseline.pairs("virtual", [one, one], [one, one + one])


def test_a_revision_that_does_not_exist_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["fleet", "--baseline", "no-such-revision-anywhere"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'no-such-revision-anywhere' is not a revision" in err


def test_a_revision_whose_bench_lacks_the_target_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["fleet", "--baseline", TURN_3, "--fleet-sessions", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{TURN_3}'s bench has no target 'fleet'" in err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checkout_against_its_own_commit_prints_both_sides_rows_and_ratios_near_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: None)  # keep this process on its cores
    argv = ["fleet", "--baseline", "HEAD", "--baseline-rounds", "2", "--fleet-sessions", "20"]
    assert bench.main([*argv, "--fleet-large-sessions", "0"]) == 0
    out = capsys.readouterr().out
    for side in ("new", "old"):  # each side's own run, echoed: two rounds of its one row
        assert out.count(f"{side} | 9          fleet turns/CPU s (append, 20 sessions") == 2
    (line,) = [x for x in out.splitlines() if x.startswith("fleet ") and "(append, 20 sessions" in x]
    ratio, best, spread = line.split()[-3:]
    low, high = (float(x) for x in spread.split("-"))
    assert 0.25 < low <= float(ratio) <= high < 4.0  # the same code: only the machine's noise apart
    assert 0.25 < float(best) < 4.0
