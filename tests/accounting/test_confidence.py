"""KL (Chernoff-Hoeffding) confidence bounds for bounded means.

References: the binomial distribution (scipy.stats.binom), for which the bound must hold
(Bernoulli variables are among the [0, 1] variables it covers), and Clopper-Pearson (exact
for Bernoulli, so the KL bound can never be tighter than it).
"""

import math

import numpy as np
import pytest
from scipy import stats

from opake.accounting.confidence import bernoulli_kl, kl_lower_bound, kl_upper_bound

CASES = [(n, k) for n in (100, 10_000, 1_000_000) for k in (0, 1, 5, 50)] + [(1000, 900), (1000, 1000)]


@pytest.mark.parametrize("num_samples, successes", CASES)
@pytest.mark.parametrize("gamma", [0.05, 1e-3])
def test_upper_bound_is_valid_for_binomial_and_no_tighter_than_clopper_pearson(num_samples, successes, gamma):
    mean = successes / num_samples
    upper = kl_upper_bound(mean, num_samples, gamma)
    assert upper >= mean
    if upper < 1.0:
        # at the bound, observing <= the seen count has probability <= gamma
        assert stats.binom.cdf(successes, num_samples, upper) <= gamma
        clopper_pearson = stats.beta.ppf(1 - gamma, successes + 1, num_samples - successes)
        assert upper >= clopper_pearson * (1 - 1e-9)
        assert upper <= clopper_pearson * 2.5 + 10 / num_samples


@pytest.mark.parametrize("num_samples, successes", CASES)
@pytest.mark.parametrize("gamma", [0.05, 1e-3])
def test_lower_bound_is_valid_for_binomial(num_samples, successes, gamma):
    mean = successes / num_samples
    lower = kl_lower_bound(mean, num_samples, gamma)
    assert 0.0 <= lower <= mean
    if lower > 0.0:
        assert stats.binom.sf(successes - 1, num_samples, lower) <= gamma


def test_zero_mean_closed_form_and_kl_at_the_bound():
    assert kl_upper_bound(0.0, 1000, 0.05) == pytest.approx(1 - 0.05 ** (1 / 1000), rel=1e-11)
    upper = kl_upper_bound(0.01, 5000, 0.01)
    assert 5000 * bernoulli_kl(0.01, upper) == pytest.approx(math.log(100), rel=1e-9)


def test_bernoulli_kl_matches_direct_formula():
    for m, p in [(0.2, 0.3), (1e-6, 1e-4), (0.9, 0.5)]:
        direct = m * np.log(m / p) + (1 - m) * np.log((1 - m) / (1 - p))
        assert bernoulli_kl(m, p) == pytest.approx(direct, rel=1e-12)
    assert bernoulli_kl(0.0, 0.25) == pytest.approx(-math.log(0.75), rel=1e-15)


def test_coverage_on_bounded_non_bernoulli_samples():
    rng = np.random.default_rng(7)
    true_mean = 0.002  # uniform on [0, 0.004]
    trials, misses = 400, 0
    for _ in range(trials):
        sample = rng.uniform(0, 0.004, size=2000)
        if kl_upper_bound(float(sample.mean()), sample.size, 0.05) < true_mean:
            misses += 1
    assert misses <= 0.05 * trials
