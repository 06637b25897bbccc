"""The benchmark (`python -m sim.bench`): the command lines its targets send their servers, and
that its targets run to the end (at small sizes; the full sizes are `python -m sim.bench`'s job)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import pytest
import uvloop

from prototype.config import ServerConfig
from prototype.options import struct_from_args
from sim.bench import __main__ as bench
from sim.bench import server as bench_server
from sim.rollout.result import ClientError


def _server_config(argv: list[str]) -> ServerConfig:
    """The config a bench server started with `argv` serves with."""
    config: ServerConfig = struct_from_args(bench_server.parser().parse_args(argv), ServerConfig)
    return config


def test_the_memory_targets_uncapped_server_keeps_the_default_cache_cap() -> None:
    # The regression: the uncapped run passed `--max-cache-bytes 0`, which the generated option
    # reads as a cap of 0 bytes (nothing cached, the warm-up's second turn not found).
    uncapped = _server_config(bench.memory_server_args(10, None))
    assert uncapped.websocket.max_cache_bytes == ServerConfig().websocket.max_cache_bytes
    assert uncapped.websocket.max_cache_bytes is None or uncapped.websocket.max_cache_bytes > 0


def test_the_memory_targets_capped_server_gets_the_cap() -> None:
    assert _server_config(bench.memory_server_args(10, 12_345)).websocket.max_cache_bytes == 12_345
    assert _server_config(bench.memory_server_args(10, 0)).websocket.max_cache_bytes == 0


def test_only_a_missing_previous_response_is_a_chain_ended_by_the_cap() -> None:
    not_found = {"type": "invalid_request_error", "code": "previous_response_not_found", "message": "x"}
    assert bench.chain_ended_by_cap(ClientError(400, not_found))
    assert not bench.chain_ended_by_cap(ClientError(400, {**not_found, "code": "invalid_value"}))
    assert not bench.chain_ended_by_cap(ClientError(500, "Internal Server Error"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cap", [None, 20_000], ids=["default-cap", "small-cap"])
def test_the_memory_target_runs_to_the_end(cap: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    """A bench server in its own process, a warm-up chain, then one held connection: the row is
    printed. Under a small cap the chain ends early (the row says where) instead of crashing."""
    rows = len(bench.ROWS)
    uvloop.run(bench.memory(1, 8, 500, cap))
    (row,) = bench.ROWS[rows:]
    assert row.target == "6" and row.value == row.value  # not NaN
    if cap is None:
        assert "8-turn cache" in row.figure
    else:
        assert f"max_cache_bytes={cap}" in row.figure
        turn = int(row.figure.split("turn ~")[1].rstrip(")"))
        assert 1 <= turn < 8  # the cap ended the chain before its last turn
    assert row.line() in capsys.readouterr().out


# -- the smoke run ----------------------------------------------------------------------------------

NOT_SIZES = {"help", "targets", "only", "smoke", "server_arg", "report"}  # what to run, not how much


def test_the_smoke_run_runs_every_target_the_full_run_runs() -> None:
    full, smoke = bench.parse([]), bench.parse(["--smoke"])
    assert bench.selected(smoke) == bench.selected(full) == list(bench.TARGETS)
    assert set(bench.jobs(smoke)) == set(bench.jobs(full)) == set(bench.TARGETS)
    assert bench.selected(bench.parse(["--smoke", "memory", "--only", "fleet"])) == ["memory", "fleet"]


def test_every_sizing_option_has_a_smoke_size_no_larger_than_the_full_one() -> None:
    """A new target's sizes cannot be left at their full values in the CI's smoke run."""
    options = {a.dest: a.default for a in bench.parser()._actions if a.dest not in NOT_SIZES}
    assert set(bench.SMOKE) == set(options)
    full, smoke = vars(bench.parse([])), vars(bench.parse(["--smoke"]))
    for name, size in bench.SMOKE.items():
        assert smoke[name] == size, name
        if isinstance(full[name], int | float) and full[name]:
            assert 0 <= size <= full[name], name
    assert bench.parse(["--smoke", "--turns", "20"]).turns == 20  # given sizes win


def test_a_smoke_run_does_not_write_the_performance_page(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse(["--smoke", "--report", "docs/performance.md"])
    assert exit_.value.code == 2 and "--report" in capsys.readouterr().err


def _run(monkeypatch: pytest.MonkeyPatch, argv: list[str], table: Mapping[str, Callable[[], object]]) -> int:
    monkeypatch.setattr(bench, "jobs", lambda args: table)
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: None)  # keep this process on its cores
    monkeypatch.setattr(bench, "ROWS", [])
    monkeypatch.setattr(bench, "VERDICTS", [True])
    return bench.main(argv)


def _failing_row() -> None:
    bench.report("1", "a figure under its goal", 1.0, 2.0, 0.5, ">= 0.6", False)


def _crash() -> None:
    raise RuntimeError("this target crashed")


def test_a_smoke_run_prints_figures_without_verdicts_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(monkeypatch, ["--smoke", "throughput"], {"throughput": _failing_row}) == 0
    (row,) = bench.ROWS
    assert row.ok is None and row.goal == "(smoke)"
    out = capsys.readouterr().out
    assert "FAIL" not in out and "PASS" not in out and "a figure under its goal" in out
    # The same row in a full run is a failure.
    assert _run(monkeypatch, ["throughput"], {"throughput": _failing_row}) == 1


def test_a_crashed_target_fails_the_run_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    table = {"throughput": _crash, "fleet": lambda: ran.append("fleet")}
    assert _run(monkeypatch, ["--smoke", "throughput", "fleet"], table) == 1
    assert ran == ["fleet"]
    err = capsys.readouterr().err
    assert "this target crashed" in err and "crashed: throughput" in err
