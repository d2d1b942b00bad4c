"""Monte Carlo estimate of balls-in-bins amplification for a matrix-factorization run.

Dominating pair (docs/math.md section 6, after NearExact25 and BnB25): with M = C X the bin columns
m_j = C x_j and sigma the noise multiplier (clip norm 1),

    P = N(0, sigma^2 I_n),    Q = (1/b) sum_j N(m_j, sigma^2 I_n).

Its privacy loss L(y) = ln(Q/P)(y) = ln((1/b) sum_j exp(<m_j, y>/sigma^2 - G_jj/(2 sigma^2)))
depends on y only through the b inner products <m_j, y>, so everything reduces to the b x b
Gram matrix G = M^T M:

  under Q (bin J, y = m_J + sigma z):  <m_j, y> = G[j, J] + sigma w_j,
  under P (y = sigma z):               <m_j, y> = sigma w_j,

with w = M^T z ~ N(0, G), drawn as R xi (G = R R^T, xi ~ N(0, I_b)). Cost O(N b^2), none of it
depending on n. The hockey-stick divergences are expectations of [0, 1]-valued terms:

  remove: delta_r(eps) = E_Q[(1 - e^(eps - L))_+],    add: delta_a(eps) = E_P[(1 - e^(eps + L))_+],

and delta(eps) = max(delta_r, delta_a). Under Q the bin J runs through 0..b-1 in turn
(stratified: every bin gets N/b samples, so the sample mean is unbiased), and each direction
gets a one-sided KL confidence bound (Hoeffding 1963 Thm 1, ``opake.accounting.confidence``)
at failure probability (1 - confidence)/2; by the union bound the reported upper bound holds
with probability >= confidence over the draws. This is a high-probability statement about an
estimate, never a guarantee.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from opake.accounting.confidence import kl_lower_bound, kl_upper_bound
from opake.accounting.process import check_delta, check_epsilon, smallest_epsilon
from opake.dpftrl.accounting.allocation.bin_gram import bin_gram_of_run
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.priced import PricedNoise
from opake.errors import InvalidArgumentError, InvalidTypeError

_CHUNK_ENTRIES = 1 << 21  # samples x bins per chunk (16 MiB of float64)


def _gram_factor(gram: np.ndarray) -> np.ndarray:
    """R with R R^T = G (Cholesky; eigen-factor with clipped eigenvalues if G is singular)."""
    try:
        return np.linalg.cholesky(gram)
    except np.linalg.LinAlgError:
        values, vectors = np.linalg.eigh(gram)
        return vectors * np.sqrt(np.clip(values, 0.0, None))


def _log_mean_exp(exponents: np.ndarray) -> np.ndarray:
    top = exponents.max(axis=1)
    return top + np.log(np.exp(exponents - top[:, None]).mean(axis=1))


def sample_privacy_losses(gram: np.ndarray, noise_multiplier: float, num_samples: int, seed: int):
    """Samples of L = ln(Q/P) under Q (bins stratified) and under P; each (num_samples,) float64.

    ``num_samples`` must be a multiple of b = gram.shape[0].
    """
    b = gram.shape[0]
    sigma = float(noise_multiplier)
    factor_t = _gram_factor(gram).T
    half_diagonal = np.diag(gram) / (2.0 * sigma * sigma)
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_ENTRIES // (b * b)) * b
    under_q = np.empty(num_samples)
    under_p = np.empty(num_samples)
    for start in range(0, num_samples, chunk):
        stop = min(start + chunk, num_samples)
        w = rng.standard_normal((stop - start, b)) @ factor_t  # rows ~ N(0, G)
        bins = np.arange(start, stop) % b
        # exponent_j = <m_j, y>/sigma^2 - G_jj/(2 sigma^2) for y = m_J + sigma z, then y = sigma z
        under_q[start:stop] = _log_mean_exp((gram[bins] + sigma * w) / (sigma * sigma) - half_diagonal)
        under_p[start:stop] = _log_mean_exp(w / sigma - half_diagonal)
    return under_q, under_p


@dataclass(frozen=True)
class Interval:
    """A Monte Carlo point estimate with its one-sided lower and upper confidence bounds."""

    estimate: float
    lower: float
    upper: float


@dataclass(frozen=True)
class DeltaEstimate:
    """delta(epsilon) of the amplified pair: the max of the remove and add directions.

    ``upper`` holds (true delta <= upper) with probability >= ``confidence`` over the Monte
    Carlo draws, as does ``lower`` (true delta >= lower); neither is a guarantee.
    """

    epsilon: float
    estimate: float
    lower: float
    upper: float
    remove: Interval
    add: Interval
    confidence: float
    num_samples: int


@dataclass(frozen=True)
class EpsilonEstimate:
    """epsilon(delta) read off the estimate and off each confidence bound of delta(epsilon)."""

    delta: float
    estimate: float
    lower: float
    upper: float
    confidence: float
    num_samples: int


@dataclass(frozen=True, eq=False)
class BallsInBinsMonteCarlo:
    """Monte Carlo estimate of balls-in-bins amplification; NOT a guarantee (``is_guarantee`` False).

    ``delta_at`` and ``epsilon_at`` return the upper confidence bounds (level ``confidence``),
    so ``calibrate`` on this process is conservative with that probability. ``rigorous`` is
    the proven (unamplified) bound for the same run.
    """

    rigorous: object  # BallsInBins
    num_samples: int
    seed: int
    confidence: float
    remove_losses: np.ndarray  # L under Q, sorted descending
    add_losses: np.ndarray  # L under P, sorted ascending

    is_guarantee = False
    method = AccountingMethod.MONTE_CARLO

    @property
    def priced_noise(self) -> PricedNoise:
        """The same noise as the unamplified bound: the bound inner mechanism and sigma."""
        return self.rigorous.priced_noise

    @property
    def dp_event(self):
        """Refused: an estimate has no dominating event. Compose ``rigorous.dp_event`` instead."""
        raise InvalidTypeError(
            "a Monte Carlo estimate is not a proven bound, so it has no dp_event to compose; use "
            "the rigorous process's event (this_process.rigorous.dp_event) or method='amplified'"
        )

    @property
    def description(self) -> str:
        inner = self.rigorous.bound
        return (
            f"Monte Carlo ESTIMATE (not a guarantee) of balls-in-bins amplification: "
            f"{self.rigorous.num_bins} bins, {self.rigorous.n_steps} steps, noise multiplier "
            f"{inner.noise_multiplier:.6g}, {self.num_samples} samples, seed {self.seed}; "
            f"epsilon_at/delta_at are upper confidence bounds at level {self.confidence} over the "
            f"sampling. Proven bound: {self.rigorous.description}"
        )

    # --- per-direction sample means ---------------------------------------------------------

    def _direction_means(self, epsilon: float) -> tuple[float, float]:
        n = self.num_samples
        # remove: terms 1 - e^(eps - L) for L > eps (remove_losses sorted descending)
        count_r = int(np.searchsorted(-self.remove_losses, -epsilon, side="left"))
        remove = float(-np.expm1(epsilon - self.remove_losses[:count_r]).sum()) / n
        # add: terms 1 - e^(eps + L) for L < -eps (add_losses sorted ascending)
        count_a = int(np.searchsorted(self.add_losses, -epsilon, side="left"))
        add = float(-np.expm1(epsilon + self.add_losses[:count_a]).sum()) / n
        return remove, add

    def _failure_probability(self) -> float:
        return 0.5 * (1.0 - self.confidence)

    def _upper(self, epsilon: float) -> float:
        gamma = self._failure_probability()
        return max(kl_upper_bound(m, self.num_samples, gamma) for m in self._direction_means(epsilon))

    def _lower(self, epsilon: float) -> float:
        gamma = self._failure_probability()
        return max(kl_lower_bound(m, self.num_samples, gamma) for m in self._direction_means(epsilon))

    def _estimate(self, epsilon: float) -> float:
        return max(self._direction_means(epsilon))

    # --- public ---------------------------------------------------------------------------------

    def delta_estimate(self, epsilon: float) -> DeltaEstimate:
        epsilon = check_epsilon(epsilon)
        gamma = self._failure_probability()
        intervals = [
            Interval(m, kl_lower_bound(m, self.num_samples, gamma), kl_upper_bound(m, self.num_samples, gamma))
            for m in self._direction_means(epsilon)
        ]
        remove, add = intervals
        return DeltaEstimate(
            epsilon=epsilon,
            estimate=max(remove.estimate, add.estimate),
            lower=max(remove.lower, add.lower),
            upper=max(remove.upper, add.upper),
            remove=remove,
            add=add,
            confidence=self.confidence,
            num_samples=self.num_samples,
        )

    def delta_at(self, epsilon: float) -> float:
        """Upper confidence bound (level ``confidence``) on delta(epsilon); an estimate."""
        return self._upper(check_epsilon(epsilon))

    def epsilon_at(self, delta: float) -> float:
        """Smallest epsilon whose upper confidence bound on delta is <= delta; an estimate."""
        delta = check_delta(delta)
        epsilon = self._smallest_epsilon(self._upper, delta)
        if epsilon is None:
            floor = kl_upper_bound(0.0, self.num_samples, self._failure_probability())
            needed = math.ceil(math.log(1.0 / self._failure_probability()) / delta)
            raise InvalidArgumentError(
                f"delta={delta!r} is below the smallest delta that num_samples={self.num_samples} "
                f"samples can bound at confidence {self.confidence} ({floor:.3g}); raise num_samples "
                f"to more than {needed}, or use balls_in_bins(..., method='rigorous')"
            )
        return epsilon

    def epsilon_estimate(self, delta: float) -> EpsilonEstimate:
        delta = check_delta(delta)
        upper = self.epsilon_at(delta)
        return EpsilonEstimate(
            delta=delta,
            estimate=self._smallest_epsilon(self._estimate, delta),
            lower=self._smallest_epsilon(self._lower, delta),
            upper=upper,
            confidence=self.confidence,
            num_samples=self.num_samples,
        )

    def _smallest_epsilon(self, curve, delta: float):
        """Smallest eps >= 0 with curve(eps) <= delta (curve non-increasing); None if none."""
        top = max(float(self.remove_losses[0]), float(-self.add_losses[0]), 0.0)
        top = top + 1e-9 * max(1.0, top)  # beyond the largest loss every term is zero
        return smallest_epsilon(curve, delta, top)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def monte_carlo(rigorous, num_samples: int, seed: int, confidence: float) -> BallsInBinsMonteCarlo:
    """Build the Monte Carlo estimate for the run priced (unamplified) by ``rigorous``."""
    num_samples = _check_int("num_samples", num_samples, 1)
    if seed is None:
        raise InvalidArgumentError(
            "seed is required for method='monte_carlo' (an integer >= 0); opake never picks a "
            "random seed for you, so that the estimate can be reproduced"
        )
    seed = _check_int("seed", seed, 0)
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not 0.0 < confidence < 1.0:
        raise InvalidArgumentError(f"confidence must be a number in (0, 1), e.g. 0.95, got {confidence!r}")
    num_bins = rigorous.num_bins
    num_samples = -(-num_samples // num_bins) * num_bins  # every bin equally often
    gram = bin_gram_of_run(rigorous, "monte_carlo")
    under_q, under_p = sample_privacy_losses(gram, rigorous.bound.noise_multiplier, num_samples, seed)
    under_q = np.sort(under_q)[::-1].copy()
    under_p = np.sort(under_p)
    under_q.setflags(write=False)
    under_p.setflags(write=False)
    return BallsInBinsMonteCarlo(rigorous, num_samples, seed, float(confidence), under_q, under_p)
