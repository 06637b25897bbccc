"""The main job: the same rollouts in every mode, same model-visible tokens; its metrics and run folder."""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import sys
from pathlib import Path

import msgspec
import pytest

from sim.__main__ import build_parser, config_from, main, run, table
from sim.analysis.metrics import headline
from sim.harness import console
from sim.harness.console import points_bar
from sim.harness.experiment import CompareConfig, compare
from tests.fake_engine import fake_engine

SMALL = CompareConfig.of(
    rollouts=2, tool_calls=4, tps=0, tool_time_s=0, seed=7, profile="local", system_prompt_tokens=500
)


@pytest.mark.slow
def test_same_tokens_in_every_mode_and_incremental_bytes() -> None:
    result = run(SMALL, virtual=False)
    by_mode = {m: [r for r in result.rollouts if r.mode == m] for m in ("http", "http_prev", "ws", "append")}
    assert all(len(v) == 2 for v in by_mode.values())
    for i in range(2):
        per_mode = {m: rs[i].turns for m, rs in by_mode.items()}
        assert {len(t) for t in per_mode.values()} == {5}  # 4 tool calls, then the answer
        for k in range(5):
            usages = {m: turns[k].response.usage for m, turns in per_mode.items() if m != "append"}
            assert len({u.input_tokens for u in usages.values() if u}) == 1, (i, k, usages)
            assert len({u.output_tokens for u in usages.values() if u}) == 1
            outputs = {
                m: turns[k].output_items[0].get("arguments") or turns[k].output_items[0]["content"][0]["text"]
                for m, turns in per_mode.items()
            }
            assert len(set(outputs.values())) == 1
        # http resends the growing history; the others send settings plus new items only
        http_bytes = [t.bytes_sent for t in per_mode["http"]]
        assert http_bytes == sorted(http_bytes) and len(set(http_bytes)) == 5
        for mode in ("ws", "http_prev"):
            sent = [t.bytes_sent for t in per_mode[mode]]
            assert abs(sent[0] - http_bytes[0]) < 100 and max(sent) < http_bytes[-1]
        # append: one response whose usage totals the ws turns'; pauses carry usage null
        final = per_mode["append"][-1].response.usage
        assert final is not None and all(t.response.usage is None for t in per_mode["append"][:-1])
        assert final.input_tokens == sum(t.response.usage.input_tokens for t in per_mode["ws"])  # type: ignore[union-attr]
        assert len({t.response.id for t in per_mode["append"]}) == 1
        for a, w in zip(per_mode["append"][1:], per_mode["ws"][1:], strict=True):
            assert a.bytes_sent < w.bytes_sent  # the same tool outputs, without the settings
    summary = {s.mode: s for s in result.summary}
    assert summary["ws"].connection_cache_hit_rate == 1.0 and summary["http_prev"].connection_cache_hit_rate == 0.0
    assert summary["append"].kv_idle_token_s > 0 and summary["ws"].kv_idle_token_s == 0
    assert summary["http"].tokens_rendered_per_turn > 2 * summary["ws"].tokens_rendered_per_turn
    assert "time saved vs http" in table(result.summary)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["compare", "--modes", "grpc", "--rollouts", "1"], "compare: invalid option: unknown mode 'grpc'"),
        (["compare", "--rollouts", "0"], "compare: invalid option: --rollouts: Expected `int` >= 1"),
        (["results", "--rollouts", "0"], "results: invalid option: --rollouts: Expected `int` >= 1"),
        (
            ["compare", "--disable", "token_cache,magic"],
            "compare: invalid option: --disable (item 2): Invalid enum value",
        ),
        (["compare", "--profile", "cloud"], "compare: invalid option: unknown cost profile 'cloud'"),
        (["compare", "--live-rollouts", "-1"], "compare: invalid option: --live-rollouts: must be >= 0"),
        (["compare", "--rollouts", "x"], "compare: argument --rollouts: invalid int value: 'x'"),
        (["results", "--workload", "nope"], "results: argument --workload: invalid choice: 'nope'"),
        (["sweep", "--rollouts", "0"], "sweep: invalid option: --rollouts: Expected `int` >= 1"),
        (["sweep", "--tps", "-5"], "sweep: invalid option: --tps: Expected `float` >= 0.0"),
        (["sweep", "--tool-calls", "2.5"], "sweep: invalid option: --tool-calls: not a comma list of int: '2.5'"),
        (["sweep", "--workers", "0"], "sweep: invalid option: --workers: must be >= 1"),
        (["sweep", "--modes", "grpc"], "sweep: invalid option: unknown mode 'grpc'"),
    ],
)
def test_a_refused_option_is_one_line_naming_it_with_exit_2(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"python -m sim {line}"), captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""


def test_compare_runs_the_modes_of_the_readme_results_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`make compare` (`python -m sim compare`) and `results` run the modes the README's table shows,
    in its order; `--help` says so once."""
    readme = (Path(__file__).parents[3] / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- results:start -->", 1)[1].split("<!-- results:end -->", 1)[0]
    first_table = block.split("\n\n")[1]
    shown = tuple(re.findall(r"^\| `(\w+)` \|", first_table, flags=re.M))
    assert shown == ("http", "http_prev", "ws", "append", "agents")
    for command in ("compare", "results"):
        assert config_from(build_parser().parse_args([command])).modes == shown
        with pytest.raises(SystemExit):
            main([command, "--help"])
        options = re.split(r"\n  (?=-)", capsys.readouterr().out)[1:]  # one entry an option
        entries = [" ".join(o.split()) for o in options]
        assert [e for e in entries if e.count("(default:") > 1] == []  # one default each, the one that runs
        assert [e for e in entries if e.startswith("--modes ")][0].endswith(
            "(default: http,http_prev,ws,append,agents)"
        )
    assert CompareConfig().modes == ("http", "http_prev", "ws", "append")  # a config in code keeps four


def test_help_lists_the_workloads_of_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from sim.rollout.workload import WORKLOADS

    assert "agentic" in WORKLOADS
    for command in ("compare", "results", "long"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert f"--workload {{{','.join(('custom', *WORKLOADS))}}}" in capsys.readouterr().out


SMALL_ARGV = ["--virtual", "--free-cpu", "--rollouts", "1", "--tool-calls", "1", "--tps", "0", "--quiet"]
SMALL_ARGV += ["--profile", "local", "--system-prompt-tokens", "200", "--tool-time-s", "0", "--modes", "http,ws"]


def test_compare_keeps_its_run_in_a_new_folder_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(console.RUNS_ENV, str(runs))
    assert main(["compare", *SMALL_ARGV]) == 0
    (folder,) = runs.iterdir()
    assert re.fullmatch(r"compare-\d{8}-\d{4}", folder.name) and (folder / "summary.json").is_file()
    err = capsys.readouterr().err
    assert err.count(f"run folder: {folder}\n") == 2  # at the start and at the end
    assert main(["compare", *SMALL_ARGV, "--no-save"]) == 0
    assert list(runs.iterdir()) == [folder] and "run folder" not in capsys.readouterr().err
    assert main(["compare", *SMALL_ARGV, "--no-save", "--out", str(tmp_path / "x")]) == 2
    assert "--no-save: not with --out" in capsys.readouterr().err


def test_a_default_run_folder_never_takes_another_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> Frozen:
            return cls(2026, 12, 6, 1, 2, 59, tzinfo=tz)

    monkeypatch.setattr(console.datetime, "datetime", Frozen)
    monkeypatch.setenv(console.RUNS_ENV, str(tmp_path))
    args = build_parser().parse_args(["compare"])
    made = [console.run_folder(args, "compare") for _ in range(3)]
    assert made == [
        tmp_path / "compare-20261206-0102",
        tmp_path / "compare-20261206-0102-2",
        tmp_path / "compare-20261206-0102-3",
    ]
    assert all(p is not None and p.is_dir() for p in made)


def test_sweep_writes_into_a_run_folder_and_overwrites_only_with_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(console.RUNS_ENV, str(runs))
    argv = ["sweep", "--tps", "0", "--tool-calls", "1", "--tool-time-s", "0", "--rollouts", "1", "--modes", "http"]
    argv += ["--workers", "1", "--quiet"]
    assert main(argv) == 0
    (table_,) = runs.glob("sweep-*/sweep.csv")
    assert len(table_.read_text().splitlines()) == 2  # the header and the one (point, mode) row
    mine = tmp_path / "sweep.csv"
    mine.write_text("my own table\n")
    capsys.readouterr()
    assert main([*argv, "--out", str(mine)]) == 2
    assert (
        capsys.readouterr().err
        == f"python -m sim sweep: invalid option: --out: {mine} exists (--force overwrites it)\n"
    )
    assert mine.read_text() == "my own table\n"
    assert main([*argv, "--out", str(mine), "--force"]) == 0
    assert mine.read_text().startswith("tps,tool_calls,") and len(mine.read_text().splitlines()) == 2


@pytest.mark.slow
def test_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert (
        main(
            ["compare", "--virtual", "--free-cpu", "--rollouts", "4", "--tool-calls", "3", "--quiet", "--out", str(out)]
        )
        == 0
    )
    assert "saved vs http" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["seed"] == 0 and config["virtual"] is True and len(config["git_sha"]) >= 7
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"http", "http_prev", "ws", "append", "agents"}  # the default: the README table's
    assert summary["http"]["completion_p50_s"] > 0
    ws = summary["ws"]
    assert ws["n"] == ws["saved_vs_http_n"] == 4
    assert ws["saved_vs_http_ci_low"] <= ws["saved_vs_http"] <= ws["saved_vs_http_ci_high"]
    assert {"completion_p50_ci_low", "completion_p50_ci_high", "completion_p90_ci_low"} <= set(ws)
    pairs = json.loads((out / "pairs.json").read_text())
    assert len(pairs) == 10 and {"n", "saved_ci_low", "saved_ci_high", "difference_ci_low"} <= set(pairs[0])
    with (out / "turns.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 * 4 * 4 and {"mode", "turn", "ttft_s", "tokens_rendered", "decode_s"} <= set(rows[0])
    first = [r for r in rows if r["mode"] == "ws" and r["turn"] == "0"]
    e2e = [float(r["e2e_s"]) for r in first]
    assert {r["n"] for r in first} == {"4"}
    assert float(first[0]["e2e_ci_low"]) <= sum(e2e) / 4 <= float(first[0]["e2e_ci_high"])
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[0]["type"] == "response.created" and {e["mode"] for e in events} == set(summary)
    assert (out / "turns.parquet").stat().st_size > 0
    assert (out / "rollout_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "stages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_profiles_give_each_rollout_its_own_length() -> None:
    from sim.rollout.workload import WORKLOADS, draw_rollouts

    specs, per_conversation = draw_rollouts(WORKLOADS["short"], seed=3, count=20)
    calls = sorted(per_conversation.values())
    assert len(per_conversation) == 20 and len(set(calls)) > 3 and max(calls) <= 49
    assert 12 <= calls[10] <= 24  # median near 18 turns
    assert [len(s.tool_times_s) for s in specs] == [per_conversation[k] for k in per_conversation]
    config = CompareConfig.of(workload="short", rollouts=2, tps=0, profile="local", seed=3, modes=("ws", "append"))
    result = run(config, virtual=True, free_cpu=True)
    for mode in ("ws", "append"):
        lengths = [len(r.turns) for r in result.rollouts if r.mode == mode]
        assert lengths == [per_conversation[k] + 1 for k in list(per_conversation)[:2]]


@pytest.mark.slow
def test_real_tool_subprocesses_keep_the_tokens_of_simulated_tools(capsys: pytest.CaptureFixture[str]) -> None:
    config = CompareConfig.of(
        rollouts=1, tool_calls=2, tps=0, tool_time_s=0.02, seed=5, profile="local", system_prompt_tokens=200
    )
    simulated = run(config, virtual=True, free_cpu=True)
    real = run(msgspec.structs.replace(config, real_tools=True), virtual=False)
    for mode in ("http", "ws", "append"):
        sim_r, real_r = (next(r for r in res.rollouts if r.mode == mode) for res in (simulated, real))
        assert [t.bytes_sent for t in real_r.turns] == [t.bytes_sent for t in sim_r.turns]
        assert real_r.turns[-1].response.usage == sim_r.turns[-1].response.usage
        assert real_r.tool_time_s >= sim_r.tool_time_s  # a real process takes at least its drawn time
    with pytest.raises(ValueError, match="not with virtual time"):
        run(msgspec.structs.replace(config, real_tools=True), virtual=True)
    assert main(["compare", "--virtual", "--tool-command", "true"]) == 2
    assert "not with virtual time" in capsys.readouterr().err


async def test_tool_command_output_and_exit_status_go_back() -> None:
    from prototype.serve.wallclock import AsyncioClock
    from sim.client.tools import CommandTools

    output, seconds = await CommandTools("echo out-$((1 + 1)); echo err >&2; exit 3").run(AsyncioClock(), 9.0, "x")
    assert output == "out-2\nerr\n\n[exit status 3]" and 0 < seconds < 9.0


@pytest.mark.slow
def test_concurrent_rollouts_under_kv_pressure_keep_tokens_and_lose_ws_prefixes() -> None:
    base = CompareConfig.of(
        rollouts=6, tool_calls=6, seed=2, system_prompt_tokens=1500, decode_slots=3, modes=("ws", "append")
    )
    sequential = run(base, virtual=True, free_cpu=True)
    tight = base.updated(concurrency=6, kv_capacity_tokens=20_000)
    crowded = run(tight, virtual=True, free_cpu=True)
    roomy = run(tight.updated(kv_capacity_tokens=1_000_000), virtual=True, free_cpu=True)
    for a, b in zip(sequential.rollouts, crowded.rollouts, strict=True):
        assert (a.mode, a.index) == (b.mode, b.index)
        assert [t.bytes_sent for t in a.turns] == [t.bytes_sent for t in b.turns]  # same rollouts, any interleaving
        assert a.turns[-1].response.usage.output_tokens == b.turns[-1].response.usage.output_tokens  # type: ignore[union-attr]
    hit = {r: {s.mode: s.token_hit_rate for s in res.summary} for r, res in (("crowded", crowded), ("roomy", roomy))}
    assert hit["crowded"]["ws"] < hit["roomy"]["ws"]  # evicted between turns while others ran
    assert hit["crowded"]["append"] > hit["crowded"]["ws"]  # paused responses keep their KV
    turns = {s.mode: s.turns for s in crowded.summary}
    started = sorted(r.started_at for r in crowded.rollouts if r.mode == "ws")
    assert started[-1] < min(r.finished_at for r in crowded.rollouts if r.mode == "ws") and turns["ws"] == 6 * 7


def test_ablation_switches_off_one_optimization() -> None:
    config = CompareConfig(rollouts=1, tool_calls=5, seed=1, system_prompt_tokens=1000, modes=("http", "ws"))
    full = {s.mode: s for s in run(config, virtual=True, free_cpu=True).summary}
    ablated = run(config.updated(disable=("token_cache",)), virtual=True, free_cpu=True)
    no_tokens = {s.mode: s for s in ablated.summary}
    assert full["ws"].tokens_rendered_per_turn < full["http"].tokens_rendered_per_turn / 2
    assert no_tokens["ws"].tokens_rendered_per_turn == no_tokens["http"].tokens_rendered_per_turn
    assert no_tokens["ws"].connection_cache_hit_rate == 1.0  # the state cache still serves
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'magic'"):
        config.updated(disable=("magic",))


async def test_compare_runs_where_an_event_loop_already_runs() -> None:
    """As in a notebook: `compare` is called from a thread whose event loop is running."""
    from sim.harness.experiment import compare

    config = CompareConfig.of(rollouts=1, tool_calls=2, tps=0, seed=3, profile="local", modes=("ws", "append"))
    here = compare(config, virtual=True, free_cpu=True)
    assert [len(r.turns) for r in here.rollouts] == [3, 3]
    assert here.summary == run(config, virtual=True, free_cpu=True).summary  # deterministic in virtual time


def _record(frames: list[tuple[str, bytes]], direction: str, data: bytes) -> None:
    frames.append((direction, data))


def test_the_tap_sees_what_each_client_sent_and_every_event() -> None:
    """`run_compare(tap=...)`: every body and frame the in-process transports carry, as bytes."""
    from sim.harness.experiment import run_compare
    from sim.runtime.virtual import VirtualClock, run_virtual

    for mode in ("http", "http_prev", "ws", "append"):
        frames: list[tuple[str, bytes]] = []
        config = msgspec.structs.replace(SMALL, rollouts=1, modes=(mode,))
        main = run_compare(config, VirtualClock(), virtual=True, tap=functools.partial(_record, frames))
        result = run_virtual(main, charge_cpu=False)
        turns = result.rollouts[0].turns
        up = [data for direction, data in frames if direction == "up"]
        down = [data for direction, data in frames if direction == "down"]
        assert [len(data) for data in up] == [t.bytes_sent for t in turns], mode
        assert len(down) == sum(t.events for t in turns), mode
        assert msgspec.json.decode(down[-1])["type"] == "response.completed", mode


@pytest.mark.slow
def test_ci_width_adds_batches_until_narrow_or_the_cap() -> None:
    base = CompareConfig(
        rollouts=3, tool_calls=3, seed=6, system_prompt_tokens=800, tool_output_tokens=200, modes=("http", "ws")
    )
    capped = run(msgspec.structs.replace(base, ci_width=0.001, max_rollouts=9), virtual=True, free_cpu=True)
    assert capped.stopped.startswith("cap of 9 rollouts reached") and capped.summary[0].n == 9
    # Batches continue the same rollouts on the same server: the run equals one of 9 rollouts.
    whole = run(msgspec.structs.replace(base, rollouts=9), virtual=True, free_cpu=True)
    # The batches' rollouts are put back in mode order, as one run lists them.
    assert [(r.mode, r.index) for r in capped.rollouts] == [(r.mode, r.index) for r in whole.rollouts]
    times = {(r.mode, r.index): r.completion_s for r in capped.rollouts}
    assert times == pytest.approx({(r.mode, r.index): r.completion_s for r in whole.rollouts}, rel=1e-9)
    widest = max(100 * e.half_width for _, e in headline(capped.summary))
    loose = run(msgspec.structs.replace(base, ci_width=widest + 1, max_rollouts=9), virtual=True, free_cpu=True)
    assert loose.summary[0].n in (3, 6) and loose.stopped.startswith("every time-saved interval is narrower")
    assert run(base, virtual=True, free_cpu=True).stopped == ""  # ci_width 0: one batch, nothing to say


@pytest.mark.slow
def test_default_compare_has_a_live_run_beside_the_virtual_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--rollouts", "6", "--live-rollouts", "1", "--tool-calls", "1", "--tps", "0", "--quiet"]
    assert main([*argv, "--profile", "local", "--system-prompt-tokens", "200", "--tool-time-s", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "6 rollouts per mode in virtual time (CPU charged), beside 1 live on loopback" in out
    assert "virtual time, n=6 rollouts per mode" in out and "live loopback, n=1 rollouts per mode" in out
    # The saving with its interval (either sign: CPU-charged time on tiny rollouts is noisy).
    assert re.search(r"ws +6 .* [-−]?\d+\.\d % ± \d+\.\d\n", out)
    assert "virtual vs live: live takes" in out and "over 5 (mode, rollout) pairs" in out  # a pair a mode


def test_live_only_and_virtual_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--rollouts", "1", "--tool-calls", "1", "--tps", "0", "--quiet", "--modes", "http,ws"]
    small = [*argv, "--profile", "local", "--system-prompt-tokens", "200", "--tool-time-s", "0.01"]
    assert main([*small, "--live"]) == 0
    out = capsys.readouterr().out
    assert "1 rollouts per mode live on loopback;" in out and "virtual" not in out
    assert main([*small, "--virtual"]) == 0
    out = capsys.readouterr().out
    assert "in virtual time (CPU charged);" in out and "live" not in out
    with pytest.raises(SystemExit):
        main([*small, "--virtual", "--live"])
    assert main([*small, "--real-tools"]) == 2  # subprocess tools need the real clock: only with --live
    assert "not with virtual time" in capsys.readouterr().err


def test_ci_width_on_the_command_line_says_why_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--virtual", "--free-cpu", "--rollouts", "4", "--tool-calls", "2", "--quiet"]
    assert main([*argv, "--modes", "http,ws", "--ci-width", "0.0001", "--max-rollouts", "8"]) == 0
    out = capsys.readouterr().out
    assert "adding batches until every time saved is within ±0.0001 points" in out
    assert "stopped adding rollouts: cap of 8 rollouts reached (widest ±" in out and "ws           8" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


TWO_MODES = CompareConfig.of(rollouts=2, tool_calls=1, tps=0, modes=("http", "ws"))


def test_progress_draws_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    compare(TWO_MODES, virtual=True, free_cpu=True, progress=True)
    assert "\r" in stderr.getvalue() and "4/4" in stderr.getvalue() and "n=2 per mode" in stderr.getvalue()


def test_progress_is_lines_where_stderr_is_no_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """A log (`make compare > log 2>&1`) gets a line at each tenth of the rollouts, no carriage return."""
    compare(TWO_MODES, virtual=True, free_cpu=True, progress=True)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"progress: {k}/4 rollouts ({25 * k} %), n=2 per mode" for k in (1, 2, 3, 4)]
    main(["compare", "--virtual", "--free-cpu", "--rollouts", "20", "--tool-calls", "1", "--modes", "http,ws"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("progress: ")]
    assert lines == [f"progress: {4 * k}/40 rollouts ({10 * k} %), n=20 per mode" for k in range(1, 11)]
    assert "\r" not in err
    main(["compare", "--virtual", "--free-cpu", "--rollouts", "2", "--tool-calls", "1", "--quiet"])
    assert "progress" not in capsys.readouterr().err


def test_the_terminal_table_fits_100_columns_and_the_folder_has_every_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--virtual", "--free-cpu", "--rollouts", "4", "--tool-calls", "2", "--quiet"]
    assert main([*argv, "--modes", "http,http_prev,ws,append,inject,agents", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert re.search(r"^agents +4 +\d+\.\d{3} \(", out, flags=re.M)
    full = (tmp_path / "table.txt").read_text()
    assert "tool→token ms" in full and "rendered/turn" in full and "tool→token" not in out
    assert [line.split()[0] for line in full.splitlines()[1:]] == [
        "http",
        "http_prev",
        "ws",
        "append",
        "inject",
        "agents",
    ]


@pytest.mark.parametrize(("stderr", "drawn"), [(_Terminal(), True), (io.StringIO(), False)], ids=["tty", "log"])
def test_the_cli_bar_of_points_is_drawn_only_on_a_terminal(
    stderr: io.StringIO, drawn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stderr", stderr)
    with points_bar(3, quiet=False) as on_point:
        for done in (1, 2, 3):
            on_point(done, 3)
    assert "3/3" in stderr.getvalue() and ("\r" in stderr.getvalue()) == drawn
    if not drawn:  # a line a tenth: here each point is at least one
        assert stderr.getvalue().splitlines() == [f"progress: {k}/3 points ({100 * k // 3} %)" for k in (1, 2, 3)]


# -- the server under test, whole -------------------------------------------------------------------

# A value other than the default for every leaf of `ServerConfig`: a field added to the tree fails
# `test_a_virtual_comparison_hands_the_server_every_field` until it is listed here.
NOT_DEFAULT: dict[str, object] = {
    "api_key": "sk-other",
    "profile": "local",
    "disable": ("reuse_routing",),
    "open_responses": True,
    "sse_done": True,
    "max_message_bytes": 1 << 20,
    "render_threads": 0,
    "steer_boundary": "token",
    "lifetime_s": 600.0,
    "append_timeout_s": 30.0,
    "reject_concurrent": True,
    "refuse": True,
    "max_queued": 3,
    "max_cache_bytes": None,
    "max_in_flight": 4,
    "max_named_lanes": 5,
    "max_connections": 7,
    "inject_messages": True,
    "multi_agent_holds_calls": False,
    "lease_s": 12.0,
    "max_idle_sessions": 9,
    "max_subscribers": 3,
    "max_subscriber_bytes": None,
    "context_window": 9_000,
    "max_output_tokens": None,
    "idle_timeout_s": 90.0,
    "sse_keepalive_s": 10.0,
    "ping_interval_s": 15.0,
}


class _Stop(Exception):
    pass


def test_a_virtual_comparison_hands_the_server_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `ServerConfig` field set on a `CompareConfig` (by leaf name, or by its flag on the
    command line) reaches the in-process server's engine and sessions as it is."""
    from prototype.config import ServerConfig
    from prototype.options import flag_of, leaves
    from prototype.pipeline import PROFILES
    from sim.harness import experiment

    assert set(NOT_DEFAULT) == {field.name for _, field in leaves(ServerConfig)}
    seen: list[object] = []

    class Recording(experiment.InProcessServer):  # type: ignore[misc]
        def client(self, mode: object, clock: object) -> object:
            seen.append((self.config, self.engine))
            raise _Stop

    monkeypatch.setattr(experiment, "InProcessServer", Recording)
    config = CompareConfig.of(rollouts=1, tool_calls=1, tps=0, modes=("ws",), **NOT_DEFAULT)
    argv = ["compare"]
    for _, field in leaves(ServerConfig):
        value = NOT_DEFAULT[field.name]
        if isinstance(value, bool):  # a switch: --X sets it, --no-X clears one that defaults to true
            argv.append(flag_of(field) if value else "--no-" + flag_of(field).removeprefix("--"))
        else:
            text = ",".join(value) if isinstance(value, tuple) else "none" if value is None else str(value)
            argv += [flag_of(field), text]
    assert config_from(build_parser().parse_args(argv)).server == config.server
    with pytest.raises(_Stop):
        run(config, virtual=True, free_cpu=True)
    ((server, engine),) = seen
    assert server == msgspec.structs.replace(config.server, profile=PROFILES["local"])
    assert config.server != ServerConfig(profile="hosted")
    assert (engine.context_window, engine.output_token_limit, engine.steer_boundary) == (9_000, None, "token")
    assert engine.multi_agent_holds_calls is False
    assert engine.profile == PROFILES["local"]


def test_a_virtual_comparison_obeys_the_servers_cache_budget() -> None:
    """`max_cache_bytes` of the nested server config, in a virtual run: with no room for an entry,
    a WebSocket continuation (`store: false`) misses the connection cache and, as on the real API,
    gets `previous_response_not_found`: the rollout fails, and the comparison reports it."""
    base = CompareConfig.of(rollouts=1, tool_calls=3, tps=0, profile="local", modes=("ws",), system_prompt_tokens=300)
    roomy = {s.mode: s for s in run(base, virtual=True, free_cpu=True).summary}["ws"]
    assert roomy.connection_cache_hit_rate == 1.0
    starved = run(base.updated(max_cache_bytes=0), virtual=True, free_cpu=True)
    assert starved.rollouts == [] and [f.mode for f in starved.failed] == ["ws"]
    assert starved.failed[0].error.startswith("400 previous_response_not_found: ")


def test_a_rollout_that_fails_is_a_failed_row_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose window rollout 0 outgrows: the server answers 400 `context_length_exceeded`
    over HTTP and WebSocket, and fails the paused response's resume in append; that rollout is a
    failed row of each mode, and the other rollouts and modes report as usual."""
    out = tmp_path / "run"
    argv = ["compare", "--virtual", "--free-cpu", "--quiet", "--rollouts", "3", "--tool-calls", "2"]
    argv += ["--system-prompt-tokens", "500", "--tool-output-tokens", "300", "--context-window", "2000"]
    argv += ["--max-output-tokens", "500", "--modes", "http,ws,append", "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if " failed (rollout 0): " in line]
    assert [line.split()[0] for line in failed] == ["http", "ws", "append"]
    assert all("context_length_exceeded: Your input exceeds the context window" in line for line in failed)
    assert not any("Traceback" in line for line in lines)
    table_rows = [line.split() for line in lines if "failed" not in line and " vs " not in line]
    rows = {words[0]: words[1] for words in table_rows if words[:1] in (["http"], ["ws"], ["append"])}
    assert rows == {"http": "2", "ws": "2", "append": "2"}  # n: the two rollouts that ran
    config = json.loads((out / "config.json").read_text())
    assert [(f["mode"], f["rollout"]) for f in config["failed"]] == [("http", 0), ("ws", 0), ("append", 0)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ws"]["saved_vs_http_n"] == 2


def test_an_engine_fault_mid_run_is_a_failed_row_and_one_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stand-in llama.cpp engine answers the second turn of `ws`'s rollout 0 with a 500: that
    rollout is a failed row with the API's error, the server's log of it one line naming the
    engine's error, no traceback; every other rollout reports."""
    out = tmp_path / "run"
    with fake_engine(fail=frozenset({4})) as engine:  # requests 0-2: http rollout 0; 3-5: ws rollout 0
        argv = ["compare", "--quiet", "--engine", "llamacpp", "--engine-url", engine.url, "--profile", "local"]
        argv += ["--rollouts", "2", "--tool-calls", "2", "--system-prompt-tokens", "300", "--tool-output-tokens"]
        argv += ["60", "--tool-time-s", "0", "--modes", "http,ws,append", "--out", str(out)]
        assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [line for line in lines if " failed (rollout 0): " in line] == [
        "ws           1 failed (rollout 0): response failed server_error: The server had an error while processing "
        "your request. Sorry about that!"
    ]
    table_rows = [line.split() for line in lines if "failed" not in line and " vs " not in line]
    rows = {words[0]: words[1] for words in table_rows if words[:1] in (["http"], ["ws"], ["append"])}
    assert rows == {"http": "2", "ws": "1", "append": "2"}  # n: the rollouts that ran
    logged = [line for line in captured.err.splitlines() if line.startswith("longrun.engine: ")]
    assert len(logged) == 1 and logged[0].endswith("failed: EngineError: llama.cpp answered 500: fake engine fault")
    assert "Traceback" not in captured.out + captured.err
    config = json.loads((out / "config.json").read_text())
    assert [(f["mode"], f["rollout"]) for f in config["failed"]] == [("ws", 0)]


def test_every_rollout_failing_still_reports() -> None:
    result = compare(
        CompareConfig.of(rollouts=2, tool_calls=1, context_window=600, max_output_tokens=100, modes=("http", "ws")),
        virtual=True,
        free_cpu=True,
    )
    assert result.summary == [] and result.rollouts == [] and len(result.failed) == 4
    assert table(result.summary, result.failed).count("failed (rollouts 0, 1): 400 context_length_exceeded") == 2


def test_turns_csv_has_each_turns_own_tokens_in_every_mode() -> None:
    """A paused append/inject/agents turn reports no usage and the response's last turn reports the
    total: each row holds the turn's own tokens, which are those of the same turn in `ws`."""
    from sim.harness.trace import turn_rows

    modes = ("http", "ws", "append", "inject", "agents")
    result = run(SMALL.updated(modes=modes, rollouts=1, tool_calls=3), virtual=True, free_cpu=True)
    rows = turn_rows(result)
    assert [r for r in rows if None in (r["input_tokens"], r["cached_tokens"], r["output_tokens"])] == []
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in modes}
    for mode in modes:
        assert [(r["input_tokens"], r["output_tokens"]) for r in by_mode[mode]] == [
            (r["input_tokens"], r["output_tokens"]) for r in by_mode["ws"]
        ], mode
    for mode in ("append", "inject"):
        (rollout,) = [r for r in result.rollouts if r.mode == mode]
        total = rollout.turns[-1].response.usage
        assert total is not None and total.output_tokens == sum(r["output_tokens"] for r in by_mode[mode])
        assert total.input_tokens == sum(r["input_tokens"] for r in by_mode[mode])
    # append's held KV: from its second turn on, the turn finds more of its prompt cached than ws
    assert all(a["cached_tokens"] >= w["cached_tokens"] for a, w in zip(by_mode["append"], by_mode["ws"], strict=True))


def test_the_figures_say_what_the_run_was_and_draw_only_known_intervals() -> None:
    import dataclasses

    from sim.harness.trace import p50_error_bars, plot_title, turn_rows

    base = SMALL.updated(tps=50.0, modes=("http", "append"), tool_calls=2)
    two = run(base, virtual=True, free_cpu=True)  # n=2: the table's p50 interval is (?–?)
    assert all(math.isnan(s.completion_p50_ci_low) for s in two.summary)
    assert p50_error_bars(two.summary) == (None, "no interval: too few rollouts, n=2")
    six = run(base.updated(rollouts=6), virtual=True, free_cpu=True)
    bars, label = p50_error_bars(six.summary)
    assert label == "95 % interval, n=6" and bars is not None
    assert bars[0] == [s.completion_p50_s - s.completion_p50_ci_low for s in six.summary]
    rows = turn_rows(two)
    assert plot_title(two, rows) == "2 tool calls, 50 tok/s, local profile, seed 7"
    # An engine run: the rate its turns decoded at (here the stand-in's 50), not the simulator's tps.
    engine = dataclasses.replace(two, config=base.updated(engine_kind="llamacpp", tps=1000.0))
    title = plot_title(engine, rows)
    rate = int(title.split("llamacpp engine, ")[1].split(" tok/s measured")[0])
    assert 45 <= rate <= 55 and "1000" not in title


def _first_sent(clock: object, seen: dict[int, float], rollouts: int, direction: str, data: bytes) -> None:
    """Note when each rollout's first request reached the server (its task names its index)."""
    if direction != "up":
        return
    for i in range(rollouts):
        if i not in seen and f"Task {i}:".encode() in data:
            seen[i] = clock.now()  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["http", "ws", "append"])
def test_a_stagger_starts_the_rollouts_in_the_stated_order(mode: str) -> None:
    """`stagger_s`: rollout i reaches the server i × stagger_s after the first (virtual clock:
    exactly), whatever the event loop would have picked; 0 keeps every rollout starting at once."""
    from sim.harness.experiment import run_compare
    from sim.runtime.virtual import VirtualClock, run_virtual

    for stagger in (0.0, 0.25):
        config = SMALL.updated(rollouts=4, concurrency=4, stagger_s=stagger, modes=(mode,), tool_calls=1)
        clock, seen = VirtualClock(), {}  # type: ignore[var-annotated]
        tap = functools.partial(_first_sent, clock, seen, 4)
        result = run_virtual(run_compare(config, clock, virtual=True, tap=tap), charge_cpu=False)
        assert sorted(seen) == [0, 1, 2, 3]
        assert [seen[i] - seen[0] for i in range(4)] == pytest.approx([i * stagger for i in range(4)], abs=1e-9)
        starts = {r.index: r.started_at for r in result.rollouts}
        assert [starts[i] - starts[0] for i in range(4)] == pytest.approx([i * stagger for i in range(4)], abs=1e-9)


def test_cold_rounds_start_every_round_on_a_cold_cache_as_an_engine_run_does() -> None:
    """`cold_rounds`: each round (here one rollout, concurrency 1) finds nothing cached on its first
    turn, as a real engine's comparison erases its slots; off, a later rollout's first turn finds
    the system prompt its mode cached before. Later turns cache their own history either way."""
    base = CompareConfig.of(modes=("http", "ws"), rollouts=3, tool_calls=2, system_prompt_tokens=400, tps=0.0)
    for cold in (False, True):
        result = compare(base.updated(cold_rounds=cold), virtual=True, free_cpu=True)
        assert len(result.rollouts) == 6
        for r in result.rollouts:
            (first, _), *later = r.model_tokens
            warm_start = r.index > 0 and not cold
            assert (first >= 384) is warm_start, (cold, r.mode, r.index, first)
            assert later and all(cached > 0 for cached, _ in later)
