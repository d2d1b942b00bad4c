"""A lower bound on the privacy of DP-SGD on balls-in-bins batches: a test on the bins' sums.

Not a guarantee (nothing here ever prices a run): it tells, in microseconds, that a noise
multiplier is certainly too small for a budget, so that a planner can rule out DP-SGD on
balls in bins without calibrating its random-allocation PLD (seconds per evaluation).

The mechanism. Balls in bins with b bins, each served ``participations`` = k times (n_steps =
k b), the identity strategy (independent Gaussian noise of standard deviation sigma per step,
clip norm 1). Take one unit whose clipped gradient is the same unit vector at every step and
every other unit's gradient zero (an adversary who knows them subtracts them): a gradient
sequence the mechanism must protect, so any valid upper bound on its privacy, the allocation
PLD among them, is at least this sequence's. Along that vector the sums of each bin's k releases,
divided by sigma sqrt(k), are b independent N(0, 1) without the unit (P), and with it
(Q) the same except that the unit's bin, uniform among the b, has mean a = sqrt(k) / sigma.

The test S = {max_j T_j > tau} gives, for every tau (post-processing),

    delta(epsilon) >= Q(S) - e^epsilon P(S),
    P(S) = 1 - Phi(tau)^b,  Q(S) = 1 - Phi(tau)^(b - 1) Phi(tau - a),

for the remove direction; ``delta_lower_bound`` maximizes it over a grid of tau (any tau is a
valid bound, so the grid only loosens it). Its likelihood ratio on S is about
e^(a tau - a^2/2) / b, that of the optimal test at the crossing, so the bound is close where the
unit's own bin dominates (several epochs, where balls in bins is weakest); for one epoch it is
loose, and a planner then calibrates the PLD. Checked below the allocation PLD and against a
Monte Carlo of the test in tests/torch/test_choice.py.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

from opake._checks import integer_at_least, positive_finite
from opake.errors import InvalidArgumentError

__all__ = ["delta_lower_bound", "noise_multiplier_lower_bound"]

_GRID = 4001
_SIGMA_RANGE = (1e-3, 1e4)


def delta_lower_bound(noise_multiplier: float, num_bins: int, participations: int, epsilon: float) -> float:
    """A lower bound on delta(epsilon) of DP-SGD on ``num_bins`` bins each served ``participations``
    times with noise multiplier ``noise_multiplier`` (add/remove adjacency; module docstring)."""
    sigma = positive_finite("noise_multiplier", noise_multiplier)
    bins = integer_at_least("num_bins", num_bins)
    k = integer_at_least("participations", participations)
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise InvalidArgumentError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    a = math.sqrt(k) / sigma
    # where the test's likelihood ratio e^(a tau - a^2/2) / b crosses e^epsilon, and around it
    crossing = (epsilon + math.log(bins)) / a + a / 2.0
    taus = np.concatenate((np.linspace(crossing - 8.0, crossing + 8.0, _GRID), np.linspace(-4.0, a + 40.0, _GRID)))
    log_phi = log_ndtr(taus)
    p = -np.expm1(bins * log_phi)
    q = -np.expm1((bins - 1) * log_phi + log_ndtr(taus - a))
    return float(max(0.0, np.max(q - math.exp(epsilon) * p)))


def noise_multiplier_lower_bound(num_bins: int, participations: int, epsilon: float, delta: float) -> float:
    """A noise multiplier below which DP-SGD on these bins certainly misses (epsilon, delta): the
    smallest sigma in (1e-3, 1e4) at which ``delta_lower_bound`` does not exceed delta (bisection
    on log sigma; the test's delta falls as sigma grows). 1e-3 when even that passes the test."""
    low, high = _SIGMA_RANGE
    if delta_lower_bound(low, num_bins, participations, epsilon) <= delta:
        return low
    if delta_lower_bound(high, num_bins, participations, epsilon) > delta:
        return high
    for _ in range(60):
        middle = math.sqrt(low * high)
        if delta_lower_bound(middle, num_bins, participations, epsilon) > delta:
            low = middle
        else:
            high = middle
        if high / low < 1.0 + 1e-6:
            break
    return low  # fails the test: every sigma up to here misses the budget
