"""Confidence bounds for the mean of independent [0, 1]-valued samples.

Hoeffding (1963), Theorem 1: for independent X_1..X_N in [0, 1] with mean of means mu and
sample mean m, P(m >= mu + t) <= exp(-N kl(mu + t || mu)) and P(m <= mu - t) <= exp(-N kl(mu - t || mu)),
kl the Bernoulli Kullback-Leibler divergence. Inverting them gives the "KL" confidence bounds

    upper = max{p >= m : N kl(m || p) <= ln(1/gamma)},   lower = min{p <= m : N kl(m || p) <= ln(1/gamma)},

each holding with probability >= 1 - gamma. They need no variance estimate and stay valid
when m = 0 (upper = 1 - gamma^(1/N), about ln(1/gamma)/N), which is the regime of small deltas
where normal approximations fail. The X_i need not be identically distributed.
"""

from __future__ import annotations

import math

import scipy.optimize


def bernoulli_kl(m: float, p: float) -> float:
    """kl(m || p) = m ln(m/p) + (1 - m) ln((1 - m)/(1 - p)), with 0 ln 0 = 0."""
    total = 0.0
    if m > 0.0:
        total += m * (math.log(m) - math.log(p))
    if m < 1.0:
        total += (1.0 - m) * (math.log1p(-m) - math.log1p(-p))
    return total


def kl_upper_bound(mean: float, num_samples: int, failure_probability: float) -> float:
    """Upper confidence bound on the mean, valid with probability >= 1 - failure_probability."""
    budget = math.log(1.0 / failure_probability) / num_samples
    if mean >= 1.0:
        return 1.0
    if mean <= 0.0:
        return -math.expm1(-budget) * (1.0 + 1e-12)  # 1 - gamma^(1/N), rounded outward
    top = math.nextafter(1.0, 0.0)
    if bernoulli_kl(mean, top) <= budget:
        return 1.0
    root = scipy.optimize.brentq(
        lambda p: bernoulli_kl(mean, p) - budget, mean, top, xtol=1e-300, rtol=1e-13, maxiter=300
    )
    return min(1.0, root * (1.0 + 1e-12))  # round outward


def kl_lower_bound(mean: float, num_samples: int, failure_probability: float) -> float:
    """Lower confidence bound on the mean, valid with probability >= 1 - failure_probability."""
    budget = math.log(1.0 / failure_probability) / num_samples
    if mean <= 0.0:
        return 0.0
    if mean >= 1.0:
        return math.exp(-budget) * (1.0 - 1e-12)  # gamma^(1/N), rounded outward
    bottom = 1e-300
    if bernoulli_kl(mean, bottom) <= budget:
        return 0.0
    # the root can be astronomically small (a bound of essentially 0): search in log p
    log_root = scipy.optimize.brentq(
        lambda u: bernoulli_kl(mean, math.exp(u)) - budget, math.log(bottom), math.log(mean),
        xtol=1e-13, rtol=1e-13, maxiter=300,
    )
    return math.exp(log_root) * (1.0 - 1e-12)  # round outward
