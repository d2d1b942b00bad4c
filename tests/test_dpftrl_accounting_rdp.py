"""method="rdp": the rigorous amplified balls-in-bins bound through Renyi divergences.

References written here: brute-force enumeration of all b^alpha bin tuples (exact remove-direction
moments), the reference values of MATH.md section 6, 2-D quadrature of the add direction for
C = I, the Gaussian mechanism's own RDP alpha S^2 / (2 sigma^2), and the Monte Carlo estimate.
"""

import itertools
import math

import numpy as np
import pytest
from scipy.special import logsumexp
from test_dpftrl_accounting_balls_in_bins import dense_gram
from test_dpftrl_accounting_gaussian import HAND_BLT, HandBLTRecipe, dense_coefficients

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.accounting.rdp_allocation import (
    add_rdp_upper_bound,
    rdp_delta,
    rdp_epsilon,
    remove_rdp_upper_bound,
)
from opake.dpftrl.noise import identity_strategy


def brute_force_remove_rdp(gram, sigma, order):
    """D_alpha(Q||P) = ln(b^-alpha sum_tuples exp(sum_{r<s} G[j_r, j_s] / sigma^2)) / (alpha - 1)."""
    b = gram.shape[0]
    exponents = [
        sum(gram[t[r], t[s]] for r in range(order) for s in range(r + 1, order)) / sigma**2
        for t in itertools.product(range(b), repeat=order)
    ]
    return (logsumexp(exponents) - order * math.log(b)) / (order - 1)


def majorized(gram):
    """diag(G) with every off-diagonal entry raised to the largest one (the bound's G)."""
    tau = gram[~np.eye(gram.shape[0], dtype=bool)].max()
    out = np.full_like(gram, tau)
    np.fill_diagonal(out, np.diag(gram))
    return out


def test_brute_force_reproduces_math_md_reference_values():
    c = np.zeros(64)
    c[:3] = [1.0, 0.5, 0.25]
    gram = dense_gram(c, 16)
    assert brute_force_remove_rdp(gram, 2.0, 2) == pytest.approx(0.269002, abs=1e-6)
    assert brute_force_remove_rdp(gram, 2.0, 3) == pytest.approx(0.425918, abs=1e-6)
    bound = remove_rdp_upper_bound(gram, 2.0, max_order=4)
    assert np.all(bound >= [0.269002, 0.425918, 0.617762])
    c_geometric = np.concatenate([[1.0], 0.5 * 0.6 ** np.arange(63)])
    assert brute_force_remove_rdp(dense_gram(c_geometric, 16), 2.0, 2) == pytest.approx(0.383051, abs=1e-6)


@pytest.mark.parametrize("n_steps, num_bins, sigma", [(6, 3, 1.0), (7, 3, 0.8), (8, 2, 1.5)])
def test_remove_bound_is_exact_for_its_majorized_gram_and_above_the_true_value(n_steps, num_bins, sigma):
    gram = dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, n_steps), num_bins)
    bound = remove_rdp_upper_bound(gram, sigma, max_order=5)
    for order in range(2, 6):
        exact = brute_force_remove_rdp(gram, sigma, order)
        assert bound[order - 2] == pytest.approx(brute_force_remove_rdp(majorized(gram), sigma, order), rel=1e-12)
        assert bound[order - 2] >= exact * (1 - 1e-12)


def test_remove_bound_is_exact_for_the_identity():
    gram = 2.0 * np.eye(4)  # C = I, two epochs
    bound = remove_rdp_upper_bound(gram, 1.3, max_order=5)
    for order in range(2, 6):
        assert bound[order - 2] == pytest.approx(brute_force_remove_rdp(gram, 1.3, order), rel=1e-12)


def test_add_bound_holds_for_the_identity_by_quadrature():
    # b = 2, C = I: P/Q = 1 / mean(U_1, U_2), U_j = exp(x_j / sigma - 1/(2 sigma^2)) under P.
    sigma = 1.0
    x = np.linspace(-12, 12, 2001)
    w = np.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    u = np.exp(x / sigma - 1 / (2 * sigma**2))
    mean_u = (u[:, None] + u[None, :]) / 2
    weights = w[:, None] * w[None, :]
    bound = add_rdp_upper_bound(np.eye(2), sigma, max_order=6)
    for order in range(2, 7):
        exact = math.log((weights * mean_u ** (-(order - 1))).sum()) / (order - 1)
        assert exact <= bound[order - 2]
        assert bound[order - 2] < order / (2 * sigma**2)  # and below the unamplified Gaussian RDP


def test_one_bin_is_the_gaussian_rdp_in_both_directions():
    sensitivity_squared = 5.25
    gram = np.array([[sensitivity_squared]])
    expected = np.arange(2, 11) * sensitivity_squared / (2 * 1.7**2)
    np.testing.assert_allclose(remove_rdp_upper_bound(gram, 1.7, max_order=10), expected, rtol=1e-12)
    np.testing.assert_allclose(add_rdp_upper_bound(gram, 1.7, max_order=10), expected, rtol=1e-12)


def test_conversion_is_valid_for_the_gaussian_and_round_trips():
    import dp_accounting

    sigma = 2.0
    rdp = np.arange(2, 257) / (2 * sigma**2)  # the Gaussian mechanism's RDP
    for delta in [1e-10, 1e-5]:
        eps = rdp_epsilon(rdp, delta)
        exact = dp_accounting.get_epsilon_gaussian(sigma, delta)
        assert exact <= eps <= 1.3 * exact
        assert rdp_delta(rdp, eps) == pytest.approx(delta, rel=1e-9)


def test_conversion_matches_dp_accounting_rdp_conversion():
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = np.arange(2, 257)
    rdp = remove_rdp_upper_bound(dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, 12), 4), 1.5)
    for delta in [1e-8, 1e-4]:
        expected, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
        assert rdp_epsilon(rdp, delta) == pytest.approx(expected, rel=1e-12)
    for epsilon in [4.0, 6.0]:  # deltas well below 1 (dp_accounting adds a KL bound near delta = 1)
        expected, _ = rdp_privacy_accountant.compute_delta(orders, rdp, epsilon)
        assert expected < 0.1
        assert rdp_delta(rdp, epsilon) == pytest.approx(expected, rel=1e-9)


def test_rdp_lies_between_the_monte_carlo_estimate_and_the_unamplified_bound():
    inner = dpftrl_acc.mf_gaussian(1.0, identity_strategy())
    rdp = dpftrl_acc.balls_in_bins(inner, num_bins=10, n_steps=10, method="rdp")
    estimate = dpftrl_acc.balls_in_bins(
        inner, num_bins=10, n_steps=10, method="monte_carlo", num_samples=200_000, seed=11, confidence=0.999
    )
    for delta in [1e-3, 1e-4]:
        rigorous = rdp.rigorous.epsilon_at(delta)
        assert rdp.epsilon_at(delta) < 0.8 * rigorous  # a real amplification
        assert estimate.epsilon_estimate(delta).lower <= rdp.epsilon_at(delta)
    assert rdp.is_guarantee is True
    assert "rigorous amplified upper bound" in rdp.description
    assert rdp.delta_at(rdp.epsilon_at(1e-4)) <= 1e-4 * (1 + 1e-9)


def test_rdp_for_a_blt_is_between_monte_carlo_and_unamplified():
    inner = dpftrl_acc.mf_gaussian(2.0, HAND_BLT)
    rdp = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="rdp")
    estimate = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="monte_carlo", seed=2, confidence=0.999)
    delta = 1e-3
    assert estimate.epsilon_estimate(delta).lower <= rdp.epsilon_at(delta) <= rdp.rigorous.epsilon_at(delta)
    assert rdp.delta_at(1.0) <= rdp.rigorous.delta_at(1.0)


def test_rdp_refuses_negative_entries_and_monte_carlo_arguments():
    signed = dpftrl_acc.mf_gaussian(1.0, HandBLTRecipe(theta=(0.5,), omega=(-0.3,)))
    with pytest.raises(ValueError, match="method='rdp' needs a strategy matrix with non-negative entries"):
        dpftrl_acc.balls_in_bins(signed, num_bins=2, n_steps=4, method="rdp")
    with pytest.raises(ValueError, match="seed apply only to method='monte_carlo'; drop them for method='rdp'"):
        dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(1.0, HAND_BLT), num_bins=2, n_steps=4, method="rdp", seed=0)
