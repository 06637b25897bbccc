"""Prometheus text exposition (format 0.0.4) of the engine's stage timings. Pure: no I/O.

One histogram per stage (`longrun_stage_seconds{stage="…"}`), observed once per
response with that response's seconds in the stage (append mode: summed over its
segments), plus counters of the service's work. Bucket bounds follow the
Prometheus client default, extended down to 100 µs because rendering and
classification of a few new items take well under a millisecond.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = ["BUCKETS_S", "Histogram", "render"]

BUCKETS_S: Final = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: Iterable[float] = BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        try:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
        except IndexError:  # above the last bound: in the +Inf bucket (`count`) alone
            pass
        self.count += 1
        self.sum += value


def render(histograms: Mapping[str, Histogram], counters: Mapping[str, float]) -> str:
    """`histograms`: stage name → histogram; `counters`: metric suffix → value."""
    lines = [
        "# HELP longrun_stage_seconds Seconds one response spent in each API stage.",
        "# TYPE longrun_stage_seconds histogram",
    ]
    for stage, h in sorted(histograms.items()):
        cumulative = 0
        for bound, n in zip(h.bounds, h.counts, strict=True):
            cumulative += n
            lines.append(f'longrun_stage_seconds_bucket{{stage="{stage}",le="{bound}"}} {cumulative}')
        lines.append(f'longrun_stage_seconds_bucket{{stage="{stage}",le="+Inf"}} {h.count}')
        lines.append(f'longrun_stage_seconds_sum{{stage="{stage}"}} {h.sum!r}')
        lines.append(f'longrun_stage_seconds_count{{stage="{stage}"}} {h.count}')
    for name, value in sorted(counters.items()):
        lines.append(f"# TYPE longrun_{name} counter")
        lines.append(f"longrun_{name} {value!r}")
    return "\n".join(lines) + "\n"
