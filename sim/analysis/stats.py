"""Estimates with their uncertainty: point value, confidence interval and `n`. Pure.

Two interval methods, each where it holds (docs/statistics.md):

* **Quantiles** (p50, p90 of rollout time, a mode's median TTFT): the distribution-free
  order-statistic interval. For a continuous distribution the number of draws below
  its q-quantile is Binomial(n, q), so the pair of order statistics (x₍ₗ₎, x₍ᵤ₎) picked
  from that binomial covers the true quantile with probability ≥ the level, exactly, for
  any n and any shape (no resampling, no normality). Where n is too small for a bound at
  the level (the median needs n ≥ 6 at 95 %, p90's upper bound n ≥ 35), that bound is NaN:
  an honest "not enough rollouts" rather than a too-narrow interval.
* **Paired savings and differences** (time saved vs `http`, mode-vs-mode): every mode runs
  the same seeded rollouts, so rollout i gives one pair (tᵢ(a), tᵢ(b)) and the estimate is
  the mean over rollouts of a per-rollout quantity (1 − tᵢ(b)/tᵢ(a), or tᵢ(b) − tᵢ(a)), so
  the rollout-to-rollout spread that both modes share cancels. Its interval is a seeded
  studentized (bootstrap-t) interval over rollouts: resample the pairs, take the quantiles
  of (mean* − mean)/se*, map them back through the sample's standard error. Not Student's
  t, and not the plain percentile bootstrap: both run narrow when the per-rollout values are
  skewed (a heavy tool-time tail, as swe-long's 30-s steps), the percentile one markedly so
  at n ≤ 16; the studentized one corrects for skew. Seeded, so a config gives the same
  interval twice.

`tests/sim/analysis/test_stats.py` checks both at their nominal coverage on synthetic rollouts with a
known answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "LEVEL",
    "Estimate",
    "agreement",
    "paired_difference",
    "paired_mean",
    "paired_saving",
    "quantile_interval",
]

LEVEL: Final = 0.95
BOOTSTRAP_RESAMPLES: Final = 2000  # percentile-interval bounds move by < 0.1 of their width past ~1000

Floats = Sequence[float] | npt.NDArray[np.float64]


class Estimate(msgspec.Struct, frozen=True):
    """A point estimate, its confidence interval at `LEVEL` (NaN bounds: too few samples for
    that bound) and the number of samples (rollouts, or pairs) it rests on."""

    value: float
    ci_low: float
    ci_high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width (the `±` figure); NaN when a bound is missing."""
        return (self.ci_high - self.ci_low) / 2

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.value * factor, self.ci_low * factor, self.ci_high * factor, self.n)


NAN_ESTIMATE: Final = Estimate(math.nan, math.nan, math.nan, 0)


def _binomial_cdf(n: int, q: float) -> npt.NDArray[np.float64]:
    pmf = [math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(n + 1)]
    cdf: npt.NDArray[np.float64] = np.cumsum(pmf)
    return cdf


def _linear_quantile(x: list[float], q: float) -> float:
    """`float(np.quantile(x, q))` of sorted `x` (numpy's default, linear method), by numpy's own
    steps in the same float operations (its virtual index, the neighbours clipped to the ends, its
    two-sided interpolation), so the value is the same to the bit (but for the sign of a zero
    where 0.0 and -0.0 meet: numpy's partition may swap equal values): numpy's call costs far
    more than the arithmetic on the few values a summary has."""
    n = len(x)
    if math.isnan(x[-1]):  # NaN sorts last: numpy's quantile of data with a NaN is NaN
        return math.nan
    virtual = (n - 1) * q  # numpy's virtual index of the linear method
    if virtual >= n - 1:
        below = above = -1
    elif virtual < 0:
        below = above = 0
    else:
        below = math.floor(virtual)
        above = below + 1
    t = virtual - below
    a, b = x[below], x[above]
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def quantile_interval(samples: Floats, q: float, *, level: float = LEVEL) -> Estimate:
    """The q-quantile of `samples` (numpy's linear interpolation, as `np.percentile`) with
    the order-statistic interval: the smallest symmetric-in-probability pair of ranks
    (l, u) with P(l ≤ B < u) ≥ level for B ~ Binomial(n, q)."""
    x = np.sort(np.asarray(samples, dtype=np.float64))
    n = len(x)
    if n == 0:
        return NAN_ESTIMATE
    value = _linear_quantile(x.tolist(), q)
    alpha = (1 - level) / 2
    # Lower bound x₍ₗ₎ (1-based rank l): P(B ≥ l) ≥ 1 − alpha ⇔ P(B ≤ l − 1) ≤ alpha. The
    # largest such l is binom.ppf-based; rank 0 means no order statistic is low enough.
    cdf = _binomial_cdf(n, q)  # cdf[k] = P(B ≤ k), k = 0..n
    lows = np.nonzero(cdf <= alpha)[0]  # k with P(B ≤ k) ≤ alpha: rank l = k + 1 works
    low = float(x[lows[-1]]) if len(lows) else math.nan  # x[k] is the (k+1)-th order statistic
    highs = np.nonzero(cdf >= 1 - alpha)[0]  # upper rank u = k + 1 with P(B ≤ k) ≥ 1 − alpha
    high = float(x[highs[0]]) if len(highs) and highs[0] < n else math.nan
    return Estimate(value, low, high, n)


def _bootstrap_indices(n: int, seed: int, resamples: int) -> npt.NDArray[np.intp]:
    rng = np.random.default_rng(np.random.SeedSequence([seed, n, 0x5EED]))
    indices: npt.NDArray[np.intp] = rng.integers(0, n, size=(resamples, n))
    return indices


def paired_mean(
    values: Floats, *, seed: int = 0, level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES
) -> Estimate:
    """The mean of per-rollout (already paired) values with its seeded studentized-bootstrap
    interval: the quantiles of t* = (mean* − mean) / se* over resamples of the rollouts,
    mapped back through the sample's standard error. A bound the resamples cannot pin down
    (n = 1, or so few rollouts that a resample's spread is zero) is NaN."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n == 0:
        return NAN_ESTIMATE
    value = float(v.mean())
    if n == 1:
        return Estimate(value, math.nan, math.nan, 1)
    se = float(v.std(ddof=1)) / math.sqrt(n)
    if se == 0:  # every rollout gives the same value: no spread to resample
        return Estimate(value, value, value, n)
    drawn = v[_bootstrap_indices(n, seed, resamples)]
    means = drawn.mean(axis=1)
    ses = drawn.std(axis=1, ddof=1) / math.sqrt(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(ses > 0, (means - value) / ses, np.sign(means - value) * np.inf)
    alpha = (1 - level) / 2
    # Order statistics, not interpolation: t* is ±inf where a resample has no spread.
    t_low = np.quantile(t, alpha, method="lower")
    t_high = np.quantile(t, 1 - alpha, method="higher")
    low = value - float(t_high) * se
    high = value - float(t_low) * se
    return Estimate(value, low if math.isfinite(low) else math.nan, high if math.isfinite(high) else math.nan, n)


def _pairs(base: Floats, other: Floats) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(other, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples need the same rollouts: {a.shape} against {b.shape}")
    return a, b


def paired_saving(base: Floats, other: Floats, *, seed: int = 0, level: float = LEVEL) -> Estimate:
    """Time saved by `other` against `base`, rollout by rollout: mean of 1 − otherᵢ/baseᵢ
    (a fraction), bootstrap interval over rollouts. `base[i]` and `other[i]` are the same
    seeded rollout in the two modes. A rollout of 0 s in `base` (CPU free, nothing waits) has no
    ratio: the estimate is then NaN, not an error."""
    a, b = _pairs(base, other)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = 1 - b / a
    return paired_mean(ratios, seed=seed, level=level)


def paired_difference(base: Floats, other: Floats, *, seed: int = 0, level: float = LEVEL) -> Estimate:
    """Mean of otherᵢ − baseᵢ (seconds), bootstrap interval over rollouts."""
    a, b = _pairs(base, other)
    return paired_mean(b - a, seed=seed, level=level)


def agreement(reference: Floats, measured: Floats, *, seed: int = 0, level: float = LEVEL) -> Estimate:
    """How far `measured` runs from `reference`, pair by pair, as a relative difference:
    mean of measuredᵢ/referenceᵢ − 1 with its bootstrap interval. For virtual-versus-live
    agreement pass the same (mode, rollout) pairs of both runs, live as `measured`: an
    interval that contains 0 means no detectable disagreement at this n, and its bounds say
    how large a disagreement the data still allow."""
    a, b = _pairs(reference, measured)
    with np.errstate(divide="ignore", invalid="ignore"):  # a reference of 0 s: NaN, as in paired_saving
        ratios = b / a - 1
    return paired_mean(ratios, seed=seed, level=level)
