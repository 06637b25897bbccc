"""The README's results table is the rendering of the committed headline run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Final

import pytest

from sim.__main__ import main
from sim.harness.results import MARKERS, readme_block, render_results
from tests.support import REPO

HEADLINE: Final = REPO / "docs" / "results" / "headline"


def test_readme_results_block_is_the_rendering_of_the_committed_summary() -> None:
    assert readme_block((REPO / "README.md").read_text()) == render_results(HEADLINE.relative_to(REPO))


def test_the_committed_headline_has_intervals_within_two_points() -> None:
    """The default compare's claim: n rollouts per mode give every time saved within ±2 points."""
    summary = json.loads((HEADLINE / "summary.json").read_text())
    config = json.loads((HEADLINE / "config.json").read_text())
    assert config["virtual"] is True and set(summary) == set(config["config"]["modes"])
    for mode, row in summary.items():
        assert row["n"] == config["config"]["rollouts"]
        if mode != "http":
            half = 100 * (row["saved_vs_http_ci_high"] - row["saved_vs_http_ci_low"]) / 2
            assert not math.isnan(half) and half < 2.0, (mode, half)
    assert (HEADLINE / "live" / "summary.json").exists() and (HEADLINE / "agreement.json").exists()
    assert not list(HEADLINE.rglob("*.parquet")) and not list(HEADLINE.rglob("*.csv"))  # small enough to commit


def test_render_reads_a_folder_and_the_markers_are_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r"
    argv = ["results", "--virtual", "--free-cpu", "--rollouts", "4", "--tool-calls", "2", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pairs.json", "summary.json"]
    text = render_results(out)
    assert capsys.readouterr().out.endswith(text + "\n")
    assert "| `ws` | 4 |" in text and " % ± " in text
    assert main(["results", "--render", "--out", str(out)]) == 0
    assert capsys.readouterr().out == text + "\n"
    block = f"intro\n{MARKERS[0]}\n{text}{MARKERS[1]}\nrest\n"
    assert readme_block(block) == text
    with pytest.raises(ValueError, match="results:start"):
        readme_block("no markers here")
