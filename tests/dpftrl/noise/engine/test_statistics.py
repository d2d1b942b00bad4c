"""The generated noise has covariance sigma^2 clip^2 / norm^2 * C^{-1} C^{-T} across steps.

Every element of the model gets an independent copy of the n-step noise vector, so one run
with d elements gives d samples of it. With x = L w (w standard normal in R^n, L = s C^{-1})
the sample second moment M_ij = (1/N) sum_k x_ik x_jk is unbiased for Sigma = L L^T.

Tolerance (false-failure probability below 1e-6 per test, no normal approximation):
x_i x_j = w^T A w with A = (l_i l_j^T + l_j l_i^T) / 2, whose only non-zero eigenvalues are
lambda_+- = (Sigma_ij +- sqrt(Sigma_ii Sigma_jj)) / 2. Hence
    N (M_ij - Sigma_ij) = lambda_+ (chi2_N - N) + lambda_- (chi2'_N - N)
with two independent chi-square variables of N degrees of freedom. Laurent & Massart (2000,
Lemma 1): P(chi2_N - N >= 2 sqrt(N t) + 2 t) <= e^-t and P(chi2_N - N <= -2 sqrt(N t)) <= e^-t.
So |M_ij - Sigma_ij| <= sqrt(Sigma_ii Sigma_jj) (2 sqrt(t / N) + 2 t / N) fails with probability
at most 4 e^-t, and over the n (n + 1) / 2 entries at most 2 n (n + 1) e^-t. We pick
t = log(2 n (n + 1) / 1e-6). The same bound with the chi-square of N samples also covers the
diagonal (lambda_- = 0). For n = 6, N ~ 1.05e6 the tolerance is about 0.84% of the scale.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.random import key
from opake.types import clipped
from engine_support import dense_blt_matrix, hand_blt

FALSE_FAILURE = 1e-6
N_STEPS = 6
# One leaf spanning two noise blocks and a small one: d = 2**20 + 1003 samples.
TEMPLATE = {"big": torch.zeros(2**20 + 3), "small": torch.zeros(1000)}


def _samples(strategy, sigma, l2_bound, normalization, seed):
    noise_fn, state = mf_gaussian_noise(TEMPLATE, strategy, n_steps=N_STEPS, noise_multiplier=sigma, key=key(seed))
    rows = []
    for _ in range(N_STEPS):
        grads = clipped({name: torch.zeros_like(t) for name, t in TEMPLATE.items()}, l2_bound, normalization)
        noisy, state = noise_fn(grads, state)
        rows.append(torch.cat([noisy.pytree["big"], noisy.pytree["small"]]).to(torch.float64).numpy())
    return np.stack(rows)  # (n, N)


def _check_second_moment(samples: np.ndarray, sigma_matrix: np.ndarray) -> None:
    n, count = samples.shape
    moment = samples @ samples.T / count
    t = math.log(2 * n * (n + 1) / FALSE_FAILURE)
    scale = np.sqrt(np.outer(np.diag(sigma_matrix), np.diag(sigma_matrix)))
    tolerance = scale * (2 * math.sqrt(t / count) + 2 * t / count)
    excess = np.abs(moment - sigma_matrix) / tolerance
    assert excess.max() <= 1.0, (
        f"second moment off by {excess.max():.2f} tolerances\nempirical:\n{moment}\nexpected:\n{sigma_matrix}"
    )


@pytest.mark.parametrize("name", ["three_buffers", "near_one_decay"])
def test_blt_noise_covariance_matches_the_mechanism(name):
    sigma, l2_bound, normalization = 1.3, 2.0, 4.0
    recipe = hand_blt(name)
    samples = _samples(recipe, sigma, l2_bound, normalization, seed=11)
    inverse = np.linalg.inv(dense_blt_matrix(recipe.omega, recipe.one_minus_theta, N_STEPS))
    s = sigma * l2_bound / normalization
    _check_second_moment(samples, s**2 * inverse @ inverse.T)


def test_identity_noise_covariance_is_diagonal():
    sigma, l2_bound, normalization = 0.8, 1.0, 1.0
    samples = _samples(identity_strategy(), sigma, l2_bound, normalization, seed=12)
    _check_second_moment(samples, sigma**2 * np.eye(N_STEPS))


def test_the_check_has_power_against_wrong_correlation():
    # Sanity check of the test itself: identity noise is clearly rejected as the BLT's noise.
    recipe = hand_blt("three_buffers")
    samples = _samples(identity_strategy(), 1.0, 1.0, 1.0, seed=13)
    inverse = np.linalg.inv(dense_blt_matrix(recipe.omega, recipe.one_minus_theta, N_STEPS))
    with pytest.raises(AssertionError, match="second moment off"):
        _check_second_moment(samples, inverse @ inverse.T)
