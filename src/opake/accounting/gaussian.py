"""The exact privacy profile of one Gaussian mechanism (Balle and Wang 2018, Theorem 8).

A Gaussian mechanism with L2 sensitivity Delta and noise standard deviation s has noise
multiplier sigma = s / Delta. With mu = 1 / sigma its tight privacy profile is

    delta(eps) = Phi(mu/2 - eps/mu) - e^eps * Phi(-mu/2 - eps/mu)

(BW18, Theorem 8; add/remove and replace-one give the same pair once Delta is set for the
adjacency). Everything is computed in log space with ``scipy.special.log_ndtr`` and
``erfcx`` so that deltas down to the smallest float keep full relative precision, at every
noise multiplier down to the smallest positive float; epsilon(delta) is the root of
ln delta(eps) = ln delta, rounded up so that delta_at(epsilon_at(delta)) <= delta, and is
math.inf when no float epsilon reaches delta (noise multipliers below about 5e-155, where
the root, about 1 / (2 sigma^2), exceeds the largest float).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from fractions import Fraction

import dp_accounting
import scipy.optimize
from scipy.special import erfcx, log_ndtr

from opake.accounting.process import check_delta, check_epsilon, check_noise_multiplier

_LOG_2 = math.log(2.0)
_SQRT_2 = math.sqrt(2.0)
_LARGEST_FLOAT = sys.float_info.max
# Below this size of mu/2 + eps/mu, a = mu/2 - eps/mu is formed in floats (absolute error
# below 2^10 * 2^-52, about 2e-13); above it, exactly in rationals and rounded once.
_FLOAT_SHIFT_LIMIT = 1024.0


def _log_one_minus_exp(x: float) -> float:
    """ln(1 - e^x) for x < 0, accurate for x near 0 and for x very negative."""
    return math.log(-math.expm1(x)) if x > -_LOG_2 else math.log1p(-math.exp(x))


def _log_erfcx(x: float) -> float:
    """ln erfcx(x) for x >= 0 (erfcx(x) = e^(x^2) erfc(x), about 1 / (x sqrt(pi)) for large x)."""
    value = float(erfcx(x))
    return math.log(value) if value > 0.0 else -math.inf


def _shifted_means(noise_multiplier: float, epsilon: float) -> tuple[float, float]:
    """(a, b) = (mu/2 - eps/mu, -mu/2 - eps/mu) for mu = 1 / noise_multiplier.

    b has no cancellation. a does: near the root eps ~ mu^2/2 its two terms agree to many
    digits (for noise multipliers below about 1e-3), so once they exceed 2^10 it is computed
    exactly as the rational (1 - 2 eps sigma^2) / (2 sigma) and rounded once (to -inf or +inf
    beyond the float range). Both use eps/mu = eps * sigma, sigma being the exact input.
    """
    half_mu = 0.5 / noise_multiplier
    eps_over_mu = epsilon * noise_multiplier
    b = -(half_mu + eps_over_mu)
    if not math.isfinite(eps_over_mu):
        return -math.inf, b
    if half_mu + eps_over_mu <= _FLOAT_SHIFT_LIMIT:
        return half_mu - eps_over_mu, b
    sigma = Fraction(noise_multiplier)
    exact = (1 - 2 * Fraction(epsilon) * sigma * sigma) / (2 * sigma)
    try:
        return float(exact), b
    except OverflowError:
        return (math.inf if exact > 0 else -math.inf), b


def gaussian_log_delta(noise_multiplier: float, epsilon: float) -> float:
    """ln delta(epsilon) of the Gaussian mechanism with this noise multiplier (BW18 Thm 8).

    delta = Phi(a) - e^eps Phi(b) with a = mu/2 - eps/mu, b = -mu/2 - eps/mu. Since
    b^2/2 = a^2/2 + eps, e^eps Phi(b) = (1/2) e^(-a^2/2) erfcx(-b/sqrt 2) exactly, and for a < 0
    also Phi(a) = (1/2) e^(-a^2/2) erfcx(-a/sqrt 2); so ln(e^eps Phi(b) / Phi(a)) is formed without
    subtracting large numbers, at every noise multiplier (down to the smallest float, where
    the answer is delta = 1 for every float epsilon).

    No argument checks (hot path of the root finders); callers validate.
    """
    a, b = _shifted_means(noise_multiplier, epsilon)
    # delta = Phi(a) - e^eps Phi(b) = Phi(a) * (1 - e^x), x = ln(e^eps Phi(b)) - ln Phi(a)
    log_phi_a = float(log_ndtr(a))
    if log_phi_a == -math.inf:  # Phi(a) underflows: delta <= Phi(a) < 1e-308
        return -math.inf
    log_erfcx_b = _log_erfcx(-b / _SQRT_2)
    if a < 0.0:
        x = log_erfcx_b - _log_erfcx(-a / _SQRT_2)
    else:
        x = -0.5 * a * a - _LOG_2 + log_erfcx_b - log_phi_a
    if not x < 0.0:
        # Phi(a) and e^eps Phi(b) agree to rounding (mu tiny). Never report less than the truth:
        # delta <= Phi(a) - Phi(b) <= (a - b) * max of the normal density on [b, a], a - b = mu.
        nearest = min(max(0.0, b), a)
        # (+1e-12: the log/exp round trip must not round the bound below the truth)
        return -math.log(noise_multiplier) - 0.5 * nearest * nearest - 0.5 * math.log(2.0 * math.pi) + 1e-12
    return log_phi_a + _log_one_minus_exp(x)


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta(epsilon) <= delta (BW18 Thm 8, inverted by root finding).

    The bracket's upper end mu^2/2 + mu sqrt(2 ln(1/delta)) is always valid: there
    delta(eps) <= Phi(-sqrt(2 ln(1/delta))) <= delta / 2 (Gaussian tail bound).
    The returned value is the root rounded up, so delta(result) <= delta holds as computed.
    When even the largest float epsilon leaves delta(epsilon) > delta (the root is about
    mu^2/2, beyond the float range for noise multipliers below about 5e-155), the result is
    math.inf: no finite epsilon is certified.
    """
    log_target = math.log(delta)

    def excess(eps: float) -> float:
        return gaussian_log_delta(noise_multiplier, eps) - log_target

    if math.exp(gaussian_log_delta(noise_multiplier, 0.0)) <= delta:
        return 0.0
    upper = 0.5 / noise_multiplier / noise_multiplier + math.sqrt(-2.0 * log_target) / noise_multiplier
    upper = min(upper, _LARGEST_FLOAT)
    while excess(upper) > 0.0:  # taken in exact arithmetic only when the bound overflowed
        if upper == _LARGEST_FLOAT:
            return math.inf
        upper = min(2.0 * upper, _LARGEST_FLOAT)
    if excess(0.0) <= 0.0:  # delta(0) equals the target to rounding
        root = 0.0
    else:
        root = scipy.optimize.brentq(excess, 0.0, upper, xtol=1e-300, rtol=1e-15, maxiter=200)
    # round up until delta_at(root), exactly as delta_at computes it, is <= delta
    step = max(root * 4e-16, 1e-20)
    while math.exp(gaussian_log_delta(noise_multiplier, root)) > delta:
        root = min(root + step, upper)
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

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """This mechanism as dp_accounting's ``GaussianDpEvent``, to compose with other releases
        in dp_accounting's RDP or PLD accountants."""
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def delta_at(self, epsilon: float) -> float:
        return math.exp(gaussian_log_delta(self.noise_multiplier, check_epsilon(epsilon)))

    def epsilon_at(self, delta: float) -> float:
        return gaussian_epsilon(self.noise_multiplier, check_delta(delta))


def gaussian(noise_multiplier: float) -> Gaussian:
    """A Gaussian mechanism with noise multiplier ``noise_multiplier`` (std over L2 sensitivity)."""
    return Gaussian(noise_multiplier)
