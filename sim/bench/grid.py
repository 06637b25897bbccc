"""The 1,000-point sweep grid the `virtual` and `stats` targets time, and its samples.

A run measures `points` of its points and scales the time to the whole grid. The sample is the
grid's first values: the tool times are cut first, then the tool-call counts, then the rates, so
100 points keep every rate and tool-call count, and a smoke run's 2 points are two rates.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CALLS", "GRID_POINTS", "TOOLS", "TPS", "sample"]

TPS: Final = (65.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0, 32000.0, 64000.0)
CALLS: Final = (1, 2, 3, 5, 8, 10, 15, 20, 30, 50)
TOOLS: Final = (0.1, 0.3, 1.0, 4.5, 10.0, 0.2, 0.5, 2.0, 3.0, 6.0)
GRID_POINTS: Final = len(TPS) * len(CALLS) * len(TOOLS)


def sample(points: int) -> tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]]:
    """(rates, tool-call counts, tool times): at most `points` points of the grid (at least one)."""
    tools = TOOLS[: max(1, min(len(TOOLS), points // (len(TPS) * len(CALLS))))]
    calls = CALLS[: max(1, min(len(CALLS), points // (len(TPS) * len(tools))))]
    tps = TPS[: max(1, min(len(TPS), points // (len(calls) * len(tools))))]
    return tps, calls, tools
