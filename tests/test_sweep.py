"""Sweeps: the grid, reproducible rows, and the same rows from a Dask cluster on loopback."""

from __future__ import annotations

import math
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from sim.__main__ import main
from sim.experiment import CompareConfig
from sim.sweep import SweepConfig, dask_executor, points, run_sweep

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
    assert [(p.tps, p.rtt_s) for p in grid] == [(65.0, 0.04), (65.0, 0.1), (1000.0, 0.04), (1000.0, 0.1)]
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
