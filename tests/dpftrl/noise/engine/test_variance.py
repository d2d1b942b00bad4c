"""The noise variance each release states (NoisedPytree.noise_variance, engine/variance.py).

Oracle: the dense inverse of C built from its coefficients (tests/dense.py, no opake code), whose
row t gives step t's noise s (C^{-1} z)_t; and, statistically, the empirical variance of released
noise over many coordinates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dense import blt_coefs, inverse_matrix, lower_toeplitz
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy, mf_gaussian_noise
from opake.random import key
from opake.types import clipped

N = 24
STRATEGIES = {
    "blt": lambda: blt_strategy(max_buffers=3),
    "identity": identity_strategy,
    "band_mf": lambda: band_mf_strategy(bands=4),
}


def _dense_row_norms(mechanism) -> np.ndarray:
    if mechanism.bands is not None and mechanism.num_buffers == 0 and mechanism.bands == 1:
        coefs = np.eye(1, N)[0]
    elif getattr(mechanism, "coefs", None) is not None:
        coefs = np.concatenate([mechanism.coefs, np.zeros(N - len(mechanism.coefs))])
    else:
        coefs = blt_coefs(mechanism.theta, mechanism.omega, N)
    return (inverse_matrix(lower_toeplitz(coefs)) ** 2).sum(axis=1)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_row_norms_match_the_dense_inverse(name):
    mechanism = STRATEGIES[name]().resolve(N, 6, 4)
    np.testing.assert_allclose(mechanism.noise_row_norms_squared(), _dense_row_norms(mechanism), rtol=1e-12)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_release_states_its_noise_variance_and_the_noise_has_it(name):
    sigma, clip, normalization, size = 1.3, 0.7, 5.0, 40_000
    template = {"w": torch.zeros(size, dtype=torch.float64)}
    noise_fn, state = mf_gaussian_noise(template, STRATEGIES[name](), n_steps=N, min_sep=6, max_participations=4,
                                        noise_multiplier=sigma, key=key(3), dtype=torch.float64)
    expected = (sigma * clip / normalization) ** 2 * _dense_row_norms(noise_fn.mechanism)
    for step in range(N):
        noisy, state = noise_fn(clipped({"w": torch.zeros(size, dtype=torch.float64)}, clip, normalization), state)
        assert noisy.step == step
        assert noisy.noise_variance == pytest.approx(expected[step], rel=1e-12)
        empirical = float(noisy.pytree["w"].var())
        assert empirical == pytest.approx(expected[step], rel=0.04)  # 40,000 draws: sd of the estimate 0.7%
    # negative control: the identity's constant variance is not a BLT's growing one
    if name == "blt":
        assert expected[-1] > 1.1 * expected[0]
