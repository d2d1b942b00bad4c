"""The Gram matrix cache of allocation/bin_gram.py (the matrix itself is tested against a dense
product in test_balls_in_bins.py)."""

import numpy as np
import pytest
from accounting_oracles import HAND_BLT, dense_coefficients, dense_gram

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.accounting.allocation.bin_gram import bin_gram_of_run


def rigorous(sigma, num_bins, n_steps):
    return dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(sigma, HAND_BLT), num_bins=num_bins,
                                    n_steps=n_steps, method="rigorous")


def test_one_gram_per_strategy_and_bins_shared_across_noise_multipliers():
    first = bin_gram_of_run(rigorous(1.0, 4, 12), "amplified")
    again = bin_gram_of_run(rigorous(3.0, 4, 12), "amplified")  # sigma does not enter G
    assert again is first
    np.testing.assert_allclose(first, dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, 12), 4),
                               rtol=1e-12)
    other = bin_gram_of_run(rigorous(1.0, 3, 12), "amplified")  # other bins: another matrix
    assert other.shape == (3, 3)
    with pytest.raises(ValueError):
        first[0, 0] = 0.0  # shared, so read-only
