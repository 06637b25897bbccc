"""Intervals at their nominal coverage on synthetic rollouts with a known answer (sim/analysis/stats.py).

Each check draws many independent experiments (seeds), computes the 95 % interval of each,
and counts how often it covers the true value. With 1,000 experiments the binomial
standard error of a 95 % rate is 0.7 points; the stated tolerance is 3 points for the
bootstrap (its percentile interval runs slightly narrow at small n) and 3 standard errors
around the exact coverage for the order-statistic interval (exact by construction).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.analysis.stats import LEVEL, agreement, paired_difference, paired_saving, quantile_interval

EXPERIMENTS = 1000
BOOTSTRAP_TOLERANCE = 0.03


def _covered(low: float, high: float, truth: float) -> bool:
    return low <= truth <= high


def _synthetic_pairs(rng: np.random.Generator, n: int, saving: float) -> tuple[np.ndarray, np.ndarray]:
    """`n` rollouts: http times lognormal (rollout-to-rollout spread much larger than the
    effect), and each rollout's own saving = `saving` + skewed noise of mean 0 (exponential − 1)."""
    http = 20.0 * np.exp(0.4 * rng.standard_normal(n))
    per_rollout = saving + 0.04 * (rng.exponential(1.0, n) - 1.0)
    return http, http * (1 - per_rollout)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 16, 40])
def test_paired_saving_covers_the_true_saving_at_its_nominal_rate(n: int) -> None:
    truth = 0.30
    hits = 0
    widths = []
    for seed in range(EXPERIMENTS):
        rng = np.random.default_rng(np.random.SeedSequence([seed, n, 17]))
        http, ws = _synthetic_pairs(rng, n, truth)
        e = paired_saving(http, ws, seed=seed)
        hits += _covered(e.ci_low, e.ci_high, truth)
        widths.append(e.half_width)
    coverage = hits / EXPERIMENTS
    assert abs(coverage - LEVEL) <= BOOTSTRAP_TOLERANCE, coverage
    # Pairing removes the 40 % spread between rollouts: the interval is of the 4-point noise.
    assert float(np.median(widths)) < 2.5 * 0.04 / math.sqrt(n)


def test_an_unpaired_reading_of_the_same_data_would_be_far_wider() -> None:
    """Why pairing: the same rollouts, compared as two independent samples, give an
    interval several times as wide, because rollout-to-rollout spread does not cancel."""
    rng = np.random.default_rng(3)
    http, ws = _synthetic_pairs(rng, 16, 0.3)
    paired = paired_saving(http, ws, seed=3)
    shuffled = paired_saving(http, rng.permutation(ws), seed=3)  # pairs broken
    assert shuffled.half_width > 4 * paired.half_width


@pytest.mark.parametrize(("q", "n"), [(0.5, 16), (0.5, 40), (0.9, 60)])
def test_quantile_interval_covers_the_true_quantile_at_its_exact_rate(q: float, n: int) -> None:
    mu, sigma = math.log(20.0), 0.5
    z = {0.5: 0.0, 0.9: 1.2815515655446004}[q]
    truth = math.exp(mu + sigma * z)
    hits = 0
    for seed in range(EXPERIMENTS):
        rng = np.random.default_rng(np.random.SeedSequence([seed, n, 29]))
        e = quantile_interval(np.exp(mu + sigma * rng.standard_normal(n)), q)
        hits += _covered(e.ci_low, e.ci_high, truth)
    # The exact coverage of the ranks the interval picks, from the binomial (>= 95 % by construction).
    x = np.arange(1.0, n + 1)
    e = quantile_interval(x, q)
    lo, hi = int(e.ci_low), int(e.ci_high)  # 1-based ranks (x[k-1] == k)
    exact = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(lo, hi))
    assert exact >= LEVEL
    standard_error = math.sqrt(exact * (1 - exact) / EXPERIMENTS)
    assert abs(hits / EXPERIMENTS - exact) <= 3 * standard_error + 1e-9, (hits / EXPERIMENTS, exact)


def test_quantile_bounds_that_need_more_samples_are_missing_not_narrow() -> None:
    five = quantile_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.5)
    assert five.value == 3.0 and math.isnan(five.ci_low) and math.isnan(five.ci_high)  # 2 x 1/32 > 5 %
    six = quantile_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.5)
    assert (six.ci_low, six.ci_high, six.n) == (1.0, 6.0, 6)
    assert math.isnan(quantile_interval(range(34), 0.9).ci_high)  # p90's upper bound needs n >= 35
    assert not math.isnan(quantile_interval(range(40), 0.9).ci_high)


def test_difference_and_agreement_are_paired_and_seeded() -> None:
    rng = np.random.default_rng(5)
    virtual = 10 + rng.standard_normal(12)
    live = virtual * 1.02 + 0.01 * rng.standard_normal(12)  # live 2 % slower, rollout by rollout
    a = agreement(virtual, live, seed=1)
    assert a.n == 12 and a.ci_low < 0.02 < a.ci_high and a.ci_low > 0.015 and a.ci_high < 0.025
    assert a == agreement(virtual, live, seed=1)  # the same interval twice
    d = paired_difference(virtual, live, seed=1)
    assert d.value == pytest.approx(float(np.mean(live - virtual))) and d.ci_low < d.value < d.ci_high
    with pytest.raises(ValueError, match="same rollouts"):
        paired_saving([1.0, 2.0], [1.0])
    one = paired_saving([10.0], [7.0])
    assert one.value == pytest.approx(0.3) and one.n == 1 and math.isnan(one.half_width)


def test_the_quantile_is_numpys_to_the_bit() -> None:
    """`quantile_interval`'s value is `np.quantile`'s (linear method) on the same samples, bit for
    bit, over sizes, quantiles, ties, infinities and NaN."""
    rng = np.random.default_rng(7)
    specials = np.array([1.0, 1.5, -2.25, 1e308, -1e308, np.inf, -np.inf, 3.3, 1e-300])
    for _ in range(3000):
        n = int(rng.integers(1, 30))
        if rng.random() < 0.3:
            x = rng.choice(specials, size=n)
        else:
            x = rng.uniform(-10, 1000, size=n) * 10.0 ** rng.integers(-5, 5, size=n)
        if rng.random() < 0.05:
            x[rng.integers(n)] = np.nan
        q = float(rng.choice([0.5, 0.9, 0.1, 0.0, 1.0, rng.random()]))
        with np.errstate(invalid="ignore", over="ignore"):
            expected = float(np.quantile(np.sort(x), q))
        got = quantile_interval(x, q).value
        assert (np.isnan(expected) and np.isnan(got)) or np.float64(got).tobytes() == np.float64(expected).tobytes()
