"""Dense references of the DP-FTRL accountants, shared by the tests of opake.dpftrl.accounting
(and opake.torch's): none calls opake's math.

A BLT's coefficients and its Toeplitz C written out from the definition (docs/math.md section 1),
its sensitivity by brute force over every participation pattern (``HandBLTRecipe``: a fixed BLT,
no optimizer), the Gram matrix of the bins as a dense product, lognormal call and put prices, and
the exact hockey-stick divergences of the balls-in-bins pair (closed form for one bin,
quadrature for two and three).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from opake.dpftrl.noise import Mechanism
from opake.dpftrl.participation import Participation


def dense_coefficients(theta, omega, n):
    """c_0 = 1, c_k = sum_i omega_i theta_i^(k-1) (docs/math.md section 1), written out here."""
    c = np.zeros(n)
    c[0] = 1.0
    for k in range(1, n):
        c[k] = sum(w * t ** (k - 1) for t, w in zip(theta, omega))
    return c


def dense_toeplitz(c):
    n = len(c)
    return np.array([[c[t - s] if t >= s else 0.0 for s in range(n)] for t in range(n)])


@functools.lru_cache(maxsize=None)
def brute_force_sensitivity(coefficients: tuple, min_sep: int, max_participations: int) -> float:
    """max over patterns (>= min_sep apart, <= k steps) of ||C 1_pattern|| (C >= 0: aligned gradients)."""
    c_matrix = dense_toeplitz(np.array(coefficients))
    n = c_matrix.shape[0]
    best = 0.0
    for size in range(1, max_participations + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in zip(pattern, pattern[1:])):
                best = max(best, float(np.sum(c_matrix[:, list(pattern)].sum(axis=1) ** 2)))
    return math.sqrt(best)


@dataclass(frozen=True)
class HandBLTRecipe:
    """Test-only recipe: a fixed BLT whose sensitivity is found by brute force."""

    theta: tuple
    omega: tuple

    def resolve(self, n_steps, min_sep=1, max_participations=None):
        context = Participation(n_steps, min_sep, max_participations)
        c = dense_coefficients(self.theta, self.omega, context.n_steps)
        sensitivity = brute_force_sensitivity(tuple(c), context.min_sep, context.effective_participations)
        return Mechanism(
            recipe=None, participation=context, theta=np.array(self.theta), omega=np.array(self.omega),
            sensitivity=sensitivity, max_loss=0.0, mean_loss=0.0,
        )


HAND_BLT = HandBLTRecipe(theta=(0.9, 0.4), omega=(0.3, 0.2))


def dense_gram(c, num_bins):
    n = len(c)
    bins = np.zeros((n, num_bins))
    bins[np.arange(n), np.arange(n) % num_bins] = 1.0
    m = dense_toeplitz(c) @ bins
    return m.T @ m


def lognormal_call(mean, variance, strike):
    """E[(e^X - strike)_+], X ~ N(mean, variance) (strike may be <= 0)."""
    sd = np.sqrt(variance)
    positive = strike > 0
    log_strike = np.log(np.where(positive, strike, 1.0))
    forward = np.exp(mean + variance / 2)
    call = forward * ndtr((mean + variance - log_strike) / sd) - strike * ndtr((mean - log_strike) / sd)
    return np.where(positive, call, forward - strike)


def lognormal_put(mean, variance, strike):
    """E[(strike - e^X)_+], X ~ N(mean, variance)."""
    sd = np.sqrt(variance)
    positive = strike > 0
    log_strike = np.log(np.where(positive, strike, 1.0))
    forward = np.exp(mean + variance / 2)
    put = strike * ndtr((log_strike - mean) / sd) - forward * ndtr((log_strike - mean - variance) / sd)
    return np.where(positive, put, 0.0)


def gaussian_hockey_stick(mu: float, epsilon: float) -> float:
    """H_{e^eps}(N(mu, 1) || N(0, 1)), the same both ways (Balle-Wang 2018)."""
    return float(ndtr(mu / 2 - epsilon / mu) - math.exp(epsilon) * ndtr(-mu / 2 - epsilon / mu))


def two_bin_divergences(gram, epsilon, points=2401):
    """Exact (H(Q||P), H(P||Q)) for b = 2 by quadrature over the 2-D Gaussian (U_1, U_2) ~ N(0, G)."""
    factor = np.linalg.cholesky(gram)
    span = 9.0 + 2.0 * math.sqrt(gram.max())  # (R - gamma)_+ phi peaks near z = sqrt(G_jj)
    z = np.linspace(-span, span, points)
    step = z[1] - z[0]
    z1, z2 = np.meshgrid(z, z, indexing="ij")
    weight = np.exp(-(z1 * z1 + z2 * z2) / 2) / (2 * math.pi) * step * step
    u1 = factor[0, 0] * z1
    u2 = factor[1, 0] * z1 + factor[1, 1] * z2
    ratio = 0.5 * (np.exp(u1 - gram[0, 0] / 2) + np.exp(u2 - gram[1, 1] / 2))
    gamma = math.exp(epsilon)
    remove = float((weight * np.clip(ratio - gamma, 0, None)).sum())
    add = float((weight * np.clip(1 - gamma * ratio, 0, None)).sum())
    return remove, add


def three_bin_remove(gram, epsilon, points=121):
    """E_P[(R - gamma)_+] for b = 3 by a tensor grid over U = L z, z ~ N(0, I_3) (|z_k| <= 7)."""
    factor_l = np.linalg.cholesky(gram + 1e-12 * np.eye(3))
    z = np.linspace(-7.0, 7.0, points)
    step = z[1] - z[0]
    weights = np.exp(-z * z / 2) / math.sqrt(2 * math.pi) * step
    grid = np.stack(np.meshgrid(z, z, z, indexing="ij"), axis=-1).reshape(-1, 3)
    w = (weights[:, None, None] * weights[None, :, None] * weights[None, None, :]).reshape(-1)
    u = grid @ factor_l.T
    ratio = np.exp(u - np.diag(gram) / 2).mean(axis=1)
    return float((w * np.clip(ratio - math.exp(epsilon), 0, None)).sum())
