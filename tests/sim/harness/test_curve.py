"""The post's curve on an engine (sim/harness/curve.py): points read from engine run folders, the
figure, the table and curve.csv written, the command's one-line refusals.

Two kinds of point folders: virtual runs standing in for an engine's (the truth known: the
simulator must predict its own runs, at the decode rate it ran), and runs on the stand-in engine
(tests/fake_engine.py) made by `python -m sim curve --points`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import msgspec
import pytest

from sim.__main__ import main
from sim.analysis.records import read_records
from sim.engine.model import EngineTurn
from sim.harness.curve import (
    MARKERS,
    Curve,
    CurveError,
    CurveRow,
    PointSpec,
    curve_markdown,
    curve_of,
    curve_text,
    draw_curve,
    parse_points,
    read_curve_csv,
    replace_block,
)
from sim.harness.drift import DRIFT_BOUND
from sim.harness.experiment import CompareConfig, compare
from sim.harness.trace import write_run
from tests.fake_engine import fake_engine
from tests.support import REPO

pytestmark = pytest.mark.timeout(600)

STAND_IN = CompareConfig.of(
    modes=("http", "ws", "append"),
    profile="hosted",
    rollouts=5,
    tool_calls=3,
    system_prompt_tokens=600,
    tool_output_tokens=120,
    prefill_tok_per_s=250.0,
    model_latency_s=0.02,
)


def _stand_in(folder: Path, tps: float, decode: str, k: int | None = None) -> Path:
    """A virtual run at `tps` written as an engine comparison's folder: config.json says llama.cpp
    (with the simulator's 16-token blocks, so the prediction caches as the stand-in did) at
    `decode`, engine.jsonl the turns' own prefill and decode as the engine would report them."""
    write_run(compare(STAND_IN.updated(tps=tps), virtual=True, free_cpu=True), folder, tables=True)
    meta = json.loads((folder / "config.json").read_text())
    meta["config"]["engine"].update(engine_kind="llamacpp", engine_block_tokens=16, engine_decode=decode)
    meta["config"]["model"]["tps"] = STAND_IN.model.tps  # an engine run's config: the rate is the engine's
    if k is not None:
        meta["config"]["engine"]["engine_verify_k"] = k
    (folder / "config.json").write_text(json.dumps(meta))
    with (folder / "engine.jsonl").open("wb") as f:
        for r in read_records([folder]):
            turn = EngineTurn(
                tag=r.mode,
                conversation_key=int(r.rollout),
                turn_index=r.turn,
                slot=0,
                resident=False,
                prompt_tokens=r.prompt_tokens,
                prompt_n=r.uncached_tokens,
                cache_n=r.cached_tokens,
                prompt_ms=1e3 * r.stages_s["prefill"],
                predicted_n=r.output_tokens,
                predicted_ms=1e3 * r.stages_s["decode"],
                queued_s=0.0,
                ttft_s=r.ttft_s or 0.0,
                total_s=r.ttft_s + r.stages_s["decode"] if r.ttft_s else 0.0,
            )
            f.write(msgspec.json.encode(turn) + b"\n")
    return folder


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("points")
    return [
        _stand_in(root / "verified-16", 400.0, "verified", 16),
        _stand_in(root / "forced", 25.0, "forced"),
        _stand_in(root / "free", 50.0, "length"),
    ]


@pytest.fixture(scope="module")
def curve(stand_ins: list[Path]) -> Curve:
    return curve_of(stand_ins)


def test_points_name_their_decode_setting() -> None:
    assert parse_points("forced, free,verified:8") == [
        PointSpec("forced"),
        PointSpec("length"),
        PointSpec("verified", 8),
    ]
    assert [p.name for p in parse_points("forced,free,verified:32")] == ["forced", "free", "verified-32"]
    config = PointSpec("verified", 8).config(CompareConfig.of(engine_kind="llamacpp"))
    assert (config.engine.engine_decode, config.engine.engine_verify_k) == ("verified", 8)
    for bad in ("fast", "verified", "verified:0", "verified:513", "forced:2", "forced,forced"):
        with pytest.raises(ValueError, match="--points"):
            parse_points(bad)


@pytest.mark.slow  # three calibration fits
def test_each_point_reads_its_decode_rate_and_the_simulator_predicts_its_own_runs(curve: Curve) -> None:
    """Slowest first; the effective decode rate the stand-in decoded at (its first token of each
    turn is the prefill's, so the rate is a token in a turn above `tps`); each mode's time saved
    measured with its interval and n, the prediction of the simulator's own run inside it."""
    assert [p.label for p in curve.points] == ["forced", "free", "verified k=16"]
    for p, tps in zip(curve.points, (25.0, 50.0, 400.0), strict=True):
        assert p.engine_decode_tok_s == pytest.approx(tps, rel=0.05)
        assert p.wall_decode_tok_s == pytest.approx(tps, rel=0.01)  # the tokens after the first
        assert p.prefill_tok_s == pytest.approx(250.0, rel=0.05)  # its stage holds the fixed latency too
        assert p.drift.within_bound and not p.problems and not p.failed
        assert [s.mode for s in p.saved] == ["ws", "append"]
        for s in p.saved:
            assert s.measured.n == STAND_IN.rollouts
            assert s.inside and s.measured.ci_low <= s.predicted <= s.measured.ci_high, (p.label, s)
            assert abs(s.predicted - s.measured.value) < 0.02
    # The post's curve: the faster the decode, the larger the share of time the API path saves.
    ws = [next(s.measured.value for s in p.saved if s.mode == "ws") for p in curve.points]
    assert ws == sorted(ws) and ws[-1] > ws[0]
    text = curve_text(curve)
    assert "verified k=16" in text and "inside" in text and "outside" not in text


@pytest.mark.slow  # three calibration fits (the module's fixture)
def test_the_folder_holds_the_csv_table_and_figure(curve: Curve, tmp_path: Path) -> None:
    from sim.harness.curve import write_curve

    write_curve(curve, tmp_path)
    back = read_curve_csv(tmp_path / "curve.csv")
    assert msgspec.json.encode(back) == msgspec.json.encode(curve.rows())  # NaN as null on both sides
    assert len(back) == 3 * 2 and {r.point for r in back} == {"forced", "free", "verified k=16"}
    assert [r.verify_k for r in back if r.mode == "ws"] == [None, None, 16]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "curve.txt").read_text().startswith("the curve on the engine:")
    markdown = curve_markdown(back)
    assert markdown.count("\n") == 2 + len(back) and "| verified k=16 |" in markdown


def test_the_page_block_between_the_markers_is_replaced_alone() -> None:
    start, end = MARKERS
    page = f"# t\n\nbefore\n\n{start}\nold table\n{end}\n\nafter\n"
    new = replace_block(page, [])
    assert new.startswith("# t\n\nbefore\n\n" + start + "\n| point |") and new.endswith(f"{end}\n\nafter\n")
    assert "old table" not in new
    with pytest.raises(ValueError, match="curve:start"):
        replace_block("# no markers\n", [])


def test_the_validation_page_shows_the_committed_curve_or_says_how_to_make_it() -> None:
    """docs/validation.md's block is curve.csv's table when the curve is committed, and otherwise
    says that it is not yet measured."""
    page = (REPO / "docs" / "validation.md").read_text()
    start, end = MARKERS
    block = page.split(start + "\n", 1)[1].split(end, 1)[0]
    committed = REPO / "docs" / "results" / "engine" / "curve" / "curve.csv"
    if committed.exists():
        assert block == curve_markdown(read_curve_csv(committed))
    else:
        assert "python -m sim curve" in block and "|" not in block


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("python -m sim curve: ")
    return err[0]


def _copy(name: str, target: Path) -> Path:
    shutil.copytree(REPO / "docs" / "results" / "engine" / name, target)
    return target


def test_what_is_no_engine_run_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in _one_line(capsys, ["curve", str(empty), "--out", str(out)])
    no_engine = _copy("validate", tmp_path / "no-engine")
    (no_engine / "engine.jsonl").unlink()
    assert "no engine.jsonl" in _one_line(capsys, ["curve", str(no_engine), "--out", str(out)])
    virtual = _copy("validate", tmp_path / "virtual")
    meta = json.loads((virtual / "config.json").read_text())
    meta["config"]["engine"]["engine_kind"] = "none"
    (virtual / "config.json").write_text(json.dumps(meta))
    assert "is not an engine run" in _one_line(capsys, ["curve", str(virtual), "--out", str(out)])
    assert not out.exists()  # refused before the run folder is made


def test_points_that_are_not_the_same_rollouts_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _copy("validate", tmp_path / "a")
    other = _copy("validate", tmp_path / "b")
    meta = json.loads((other / "config.json").read_text())
    meta["config"]["seed"] = 7
    meta["config"]["engine"]["engine_decode"] = "verified"  # a decode setting may differ, the seed not
    (other / "config.json").write_text(json.dumps(meta))
    line = _one_line(capsys, ["curve", str(first), str(other), "--no-save"])
    assert "not the same rollouts" in line and "differ in seed" in line
    with pytest.raises(CurveError, match="differ in seed"):
        curve_of([first, other])


def test_the_commands_options_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    point = _copy("validate", tmp_path / "a")
    assert "--points to run them" in _one_line(capsys, ["curve", "--no-save"])
    assert "not both" in _one_line(capsys, ["curve", str(point), "--points", "forced", "--no-save"])
    assert "need --points" in _one_line(capsys, ["curve", str(point), "--rollouts", "3", "--no-save"])
    assert "verified:K" in _one_line(capsys, ["curve", "--points", "forced,quick", "--out", str(tmp_path / "o")])
    line = _one_line(capsys, ["curve", "--points", "forced", "--engine-decode", "verified", "--out", str(tmp_path)])
    assert "--engine-decode" in line
    assert "--no-save" in _one_line(capsys, ["curve", "--points", "forced", "--no-save"])
    line = _one_line(capsys, ["curve", str(point), "--no-save", "--doc", str(REPO / "README.md")])
    assert "--doc: the page needs the lines <!-- curve:start -->" in line


@pytest.mark.slow  # three engine comparisons and three calibration fits
def test_points_run_live_on_the_engine_then_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--points`: each point an engine comparison in its own folder, then the curve of them: the
    stand-in engine prefills at 250 tokens/s and decodes at 25, so forced and free decode at 25 and
    verified at k=8 at 8 tokens a pass of 8/250 + 1/25 s (≈ 111 tokens/s)."""
    out = tmp_path / "curve"
    with fake_engine() as engine:
        argv = ["curve", "--quiet", "--points", "forced,free,verified:8", "--engine-url", engine.url]
        argv += ["--rollouts", "3", "--tool-calls", "2", "--system-prompt-tokens", "300", "--tool-output-tokens", "60"]
        argv += ["--tool-time-s", "0", "--modes", "http,ws,append", "--profile", "local", "--out", str(out)]
        assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("the curve on the engine: 2 tool calls, 3 rollouts, local profile")
    for name in ("forced", "free", "verified-8"):
        assert {"config.json", "records.jsonl", "engine.jsonl", "pairs.json", "table.txt"} <= {
            p.name for p in (out / name).iterdir()
        }
    rows = read_curve_csv(out / "curve.csv")
    by_point = {r.point: r for r in rows if r.mode == "ws"}
    assert set(by_point) == {"forced", "free", "verified k=8"}
    assert by_point["forced"].engine_decode_tok_s == pytest.approx(25.0, rel=0.01)
    assert by_point["free"].engine_decode_tok_s == pytest.approx(25.0, rel=0.01)
    assert by_point["verified k=8"].engine_decode_tok_s > 3 * by_point["forced"].engine_decode_tok_s
    for r in rows:
        assert r.n == 3 and r.drift_within_bound
        assert r.drift_decode_across_modes < DRIFT_BOUND
        assert r.inside == (r.saved_ci_low <= r.predicted <= r.saved_ci_high)  # False when NaN
        assert not math.isnan(r.predicted) or "no prediction" in printed


def test_a_point_whose_engine_drifted_says_so_in_the_table_and_figure(tmp_path: Path) -> None:
    from sim.harness.trace import write_figure

    row = dict(point="verified k=8", decode="verified", verify_k=8, engine_decode_tok_s=180.0)
    row |= dict(wall_decode_tok_s=150.0, prefill_tok_s=260.0, mode="ws", saved=0.12, saved_ci_low=0.05)
    row |= dict(saved_ci_high=0.2, n=6, predicted=float("nan"), inside=False, drift_within_bound=False)
    row |= dict(drift_decode_across_modes=0.25, drift_decode_over_run=float("nan"), failed=0, folder="x")
    rows = [msgspec.convert(row, CurveRow), msgspec.convert(row | {"drift_within_bound": True}, CurveRow)]
    markdown = curve_markdown(rows)
    assert "| DRIFT (25 %) |" in markdown and "| held (25 %) |" in markdown
    assert "| 12.0 % (5.0 to 20.0) | 6 | n/a | no prediction |" in markdown
    drawn: list[str] = []

    def draw(ax: object) -> None:
        draw_curve(ax, rows[:1])
        drawn.extend(t.get_text() for t in ax.texts)  # type: ignore[attr-defined]

    write_figure(draw, tmp_path / "c.png")
    assert drawn == ["drift"]
