"""The exact privacy profile of one Gaussian mechanism (Balle and Wang 2018, Theorem 8).

A Gaussian mechanism with L2 sensitivity Delta and noise standard deviation s has noise
multiplier sigma = s / Delta. With mu = 1 / sigma its tight privacy profile is

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps * Phi(-mu/2 - eps/mu)

(BW18, Theorem 8; add/remove and replace-one give the same pair once Delta is set for the
adjacency). Everything is computed in log space with ``scipy.special.log_ndtr`` so that
deltas down to the smallest float keep full relative precision; epsilon(delta) is the root
of ln delta(eps) = ln delta, rounded up so that delta_at(epsilon_at(delta)) <= delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import scipy.optimize
from scipy.special import log_ndtr

from opake.accounting.process import check_delta, check_epsilon, check_noise_multiplier

_LOG_2 = math.log(2.0)


def _log_one_minus_exp(x: float) -> float:
    """ln(1 - e^x) for x < 0, accurate for x near 0 and for x very negative."""
    return math.log(-math.expm1(x)) if x > -_LOG_2 else math.log1p(-math.exp(x))


def gaussian_log_delta(noise_multiplier: float, epsilon: float) -> float:
    """ln delta(epsilon) of the Gaussian mechanism with this noise multiplier (BW18 Thm 8).

    No argument checks (hot path of the root finders); callers validate.
    """
    mu = 1.0 / noise_multiplier
    a, b = 0.5 * mu - epsilon / mu, -0.5 * mu - epsilon / mu
    # delta = Phi(a) - e^eps Phi(b) = Phi(a) * (1 - exp(eps + ln Phi(b) - ln Phi(a)))
    log_phi_a = float(log_ndtr(a))
    if log_phi_a == -math.inf:  # Phi(a) underflows: delta <= Phi(a) < 1e-308
        return -math.inf
    log_phi_b = float(log_ndtr(b))
    x = epsilon + log_phi_b - log_phi_a
    if not x < 0.0:
        # Phi(a) and Phi(b) agree to rounding (mu tiny). Never report less than the truth:
        # delta <= Phi(a) - Phi(b) <= (a - b) * max of the normal density on [b, a].
        nearest = min(max(0.0, b), a)
        # (+1e-12: the log/exp round trip must not round the bound below the truth)
        return math.log(mu) - 0.5 * nearest * nearest - 0.5 * math.log(2.0 * math.pi) + 1e-12
    return log_phi_a + _log_one_minus_exp(x)


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta(epsilon) <= delta (BW18 Thm 8, inverted by root finding).

    The bracket's upper end mu^2/2 + mu sqrt(2 ln(1/delta)) is always valid: there
    delta(eps) <= Phi(-sqrt(2 ln(1/delta))) <= delta / 2 (Gaussian tail bound).
    The returned value is the root rounded up, so delta(result) <= delta holds as computed.
    """
    log_target = math.log(delta)

    def excess(eps: float) -> float:
        return gaussian_log_delta(noise_multiplier, eps) - log_target

    if math.exp(gaussian_log_delta(noise_multiplier, 0.0)) <= delta:
        return 0.0
    mu = 1.0 / noise_multiplier
    upper = 0.5 * mu * mu + mu * math.sqrt(-2.0 * log_target)
    while excess(upper) > 0.0:  # never taken in exact arithmetic; guards rounding
        upper *= 2.0
    if excess(0.0) <= 0.0:  # delta(0) equals the target to rounding
        root = 0.0
    else:
        root = scipy.optimize.brentq(excess, 0.0, upper, xtol=1e-300, rtol=1e-15, maxiter=200)
    # round up until delta_at(root), exactly as delta_at computes it, is <= delta
    step = max(root * 4e-16, 1e-20)
    while math.exp(gaussian_log_delta(noise_multiplier, root)) > delta:
        root += step
        step *= 2.0
    return root


@dataclass(frozen=True)
class Gaussian:
    """One Gaussian mechanism, given by its noise multiplier sigma = noise std / sensitivity.

    A rigorous privacy process: ``epsilon_at`` and ``delta_at`` are exact up to float rounding
    (rounded toward weaker privacy).
    """

    noise_multiplier: float

    def __post_init__(self):
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))

    is_guarantee = True

    @property
    def description(self) -> str:
        return f"Gaussian mechanism with noise multiplier {self.noise_multiplier:.6g} (exact, BW18 Thm 8)"

    def delta_at(self, epsilon: float) -> float:
        return math.exp(gaussian_log_delta(self.noise_multiplier, check_epsilon(epsilon)))

    def epsilon_at(self, delta: float) -> float:
        return gaussian_epsilon(self.noise_multiplier, check_delta(delta))


def gaussian(noise_multiplier: float) -> Gaussian:
    """A Gaussian mechanism with noise multiplier ``noise_multiplier`` (std over L2 sensitivity)."""
    return Gaussian(noise_multiplier)
