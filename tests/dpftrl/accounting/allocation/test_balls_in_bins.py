"""balls_in_bins: the rigorous default, the Gram reduction, and the Monte Carlo estimate.

References independent of the library (here and in tests/accounting_oracles.py): dense C X
products for the Gram matrix; brute-force sensitivity; for C = I the dominating pair is b
orthogonal Gaussians versus N(0, sigma^2 I), whose hockey-stick divergence is a basket-option price E[(mean of b lognormals - e^eps)_+],
computed by quadrature over b - 1 variables with the last one in closed form; for b = 2 and any
C >= 0 the pair reduces to a correlated 2-D Gaussian, computed by 1-D quadrature with a closed-form
inner expectation; for b = 1 it is the plain Gaussian (BW18 formula written out).
"""

import math

import numpy as np
import pytest
from scipy.special import ndtr
from accounting_oracles import (
    HAND_BLT,
    HandBLTRecipe,
    brute_force_sensitivity,
    dense_coefficients,
    dense_gram,
    lognormal_call,
    lognormal_put,
)

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.accounting.allocation.bin_gram import bin_gram_matrix
from opake.dpftrl.noise import blt_strategy, identity_strategy

# --- independent references ------------------------------------------------------------------


def identity_reference(sigma, num_bins, participations, epsilon, points=801, width=10.0):
    """(remove, add) deltas for C = I, every bin with `participations` steps (G = k I).

    Under P the likelihood ratio is the mean of b i.i.d. lognormals U_j = exp(s x_j - s^2/2),
    s = sqrt(k)/sigma: remove = E[(mean U - e^eps)_+], add = E[(1 - e^eps mean U)_+].
    """
    s = math.sqrt(participations) / sigma
    x = np.linspace(-width, width, points)
    w = np.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    u = np.exp(s * x - s * s / 2)
    partial, weights = 0.0, 1.0
    for g, gw in zip(np.meshgrid(*([u] * (num_bins - 1)), indexing="ij", sparse=True),
                     np.meshgrid(*([w] * (num_bins - 1)), indexing="ij", sparse=True)):
        partial, weights = partial + g / num_bins, weights * gw
    big_k = math.exp(epsilon)
    remove = (weights * lognormal_call(-s * s / 2, s * s, num_bins * (big_k - partial))).sum() / num_bins
    add = (weights * lognormal_put(-s * s / 2, s * s, num_bins * (1 / big_k - partial))).sum() * big_k / num_bins
    return float(remove), float(add)


def two_bin_reference(gram, sigma, epsilon, points=4001, width=12.0):
    """(remove, add) deltas for b = 2 and any G: a = M^T y / sigma^2 - diag(G)/(2 sigma^2) ~ N(mu, G/sigma^2) under P."""
    cov = np.asarray(gram) / sigma**2
    mu = -np.diag(gram) / (2 * sigma**2)
    z = np.linspace(-width, width, points)
    w = np.exp(-z * z / 2) / math.sqrt(2 * math.pi) * (z[1] - z[0])
    a1 = mu[0] + math.sqrt(cov[0, 0]) * z
    mean2 = mu[1] + cov[0, 1] / cov[0, 0] * (a1 - mu[0])
    var2 = cov[1, 1] - cov[0, 1] ** 2 / cov[0, 0]
    big_k = math.exp(epsilon)
    remove = 0.5 * (w * lognormal_call(mean2, var2, 2 * big_k - np.exp(a1))).sum()
    add = 0.5 * big_k * (w * lognormal_put(mean2, var2, 2 / big_k - np.exp(a1))).sum()
    return float(remove), float(add)


def test_references_agree_with_each_other_and_with_the_gaussian():
    # C = I, b = 2: both references describe the same pair.
    assert identity_reference(0.8, 2, 1, 0.7) == pytest.approx(two_bin_reference(np.eye(2), 0.8, 0.7), rel=1e-6)
    # b = 1 identity: the plain Gaussian, in both directions.
    mu = 1 / 0.8
    exact = ndtr(mu / 2 - 0.7 / mu) - math.exp(0.7) * ndtr(-mu / 2 - 0.7 / mu)  # BW18 Thm 8
    assert identity_reference(0.8, 1, 1, 0.7)[0] == pytest.approx(exact, rel=1e-9)
    assert identity_reference(0.8, 1, 1, 0.7)[1] == pytest.approx(exact, rel=1e-9)


# --- rigorous (unamplified) --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [identity_strategy(), HAND_BLT], ids=["identity", "blt"])
@pytest.mark.parametrize("n_steps, num_bins", [(12, 4), (11, 4), (9, 9), (10, 1)])
def test_rigorous_is_mf_gaussian_for_the_supplied_participation(strategy, n_steps, num_bins):
    proc = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(1.3, strategy), num_bins=num_bins, n_steps=n_steps,
                                    method="rigorous")
    k = -(-n_steps // num_bins)
    direct = dpftrl_acc.mf_gaussian(1.3, strategy, n_steps=n_steps, min_sep=num_bins, max_participations=k)
    assert proc.is_guarantee is True
    assert "rigorous upper bound" in proc.description
    assert proc.participation == direct.participation
    assert proc.mechanism.fingerprint == direct.mechanism.fingerprint
    for delta in [1e-10, 1e-5]:
        assert proc.epsilon_at(delta) == direct.epsilon_at(delta)
    assert proc.delta_at(2.0) == direct.delta_at(2.0)


# --- Gram matrix ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_steps, num_bins", [(1, 1), (7, 2), (12, 4), (13, 4), (20, 20), (30, 7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gram_matrix_equals_dense_product(n_steps, num_bins, seed):
    rng = np.random.default_rng(seed)
    c = np.concatenate([[1.0], np.sort(rng.uniform(0, 1, n_steps - 1))[::-1]])
    np.testing.assert_allclose(bin_gram_matrix(c, num_bins), dense_gram(c, num_bins), rtol=1e-13, atol=1e-13)


def test_gram_corner_is_the_brute_force_sensitivity_squared():
    c = dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, 12)
    gram = bin_gram_matrix(c, 4)
    assert gram[0, 0] == pytest.approx(brute_force_sensitivity(tuple(c), 4, 3) ** 2, rel=1e-13)


def test_gram_matches_math_md_reference_entries():
    c = np.zeros(64)
    c[:3] = [1.0, 0.5, 0.25]
    gram = bin_gram_matrix(c, 16)
    assert gram[0, 0] == pytest.approx(5.25, rel=1e-14)
    assert gram[0, 1] == pytest.approx(2.5, rel=1e-14)
    assert gram[0, 15] == pytest.approx(1.875, rel=1e-14)


# --- Monte Carlo ---------------------------------------------------------------------------------


def monte_carlo(strategy, noise_multiplier, num_bins, n_steps, num_samples=200_000, seed=3, confidence=0.999):
    return dpftrl_acc.balls_in_bins(
        dpftrl_acc.mf_gaussian(noise_multiplier, strategy), num_bins=num_bins, n_steps=n_steps,
        method="monte_carlo", num_samples=num_samples, seed=seed, confidence=confidence,
    )


def assert_within(estimate, remove, add):
    assert estimate.remove.lower <= remove <= estimate.remove.upper, (estimate.remove, remove)
    assert estimate.add.lower <= add <= estimate.add.upper, (estimate.add, add)
    assert estimate.lower <= max(remove, add) <= estimate.upper


@pytest.mark.parametrize("sigma, epsilon", [(1.0, 1.0), (0.7, 2.0), (2.0, 0.3)])
def test_identity_one_epoch_matches_the_orthogonal_mixture(sigma, epsilon):
    estimate = monte_carlo(identity_strategy(), sigma, num_bins=3, n_steps=3).delta_estimate(epsilon)
    remove, add = identity_reference(sigma, 3, 1, epsilon)
    assert_within(estimate, remove, add)
    assert estimate.estimate == pytest.approx(max(remove, add), rel=0.05)


def test_identity_two_epochs_matches_the_orthogonal_mixture_with_two_steps_per_bin():
    estimate = monte_carlo(identity_strategy(), 1.2, num_bins=3, n_steps=6).delta_estimate(1.5)
    remove, add = identity_reference(1.2, 3, 2, 1.5)
    assert_within(estimate, remove, add)


@pytest.mark.parametrize("n_steps, epsilon", [(7, 1.0), (8, 2.5)])
def test_blt_two_bins_matches_quadrature_of_the_correlated_pair(n_steps, epsilon):
    c = dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, n_steps)
    remove, add = two_bin_reference(dense_gram(c, 2), 1.5, epsilon)
    estimate = monte_carlo(HAND_BLT, 1.5, num_bins=2, n_steps=n_steps).delta_estimate(epsilon)
    assert_within(estimate, remove, add)
    assert estimate.estimate == pytest.approx(max(remove, add), rel=0.05)


def test_one_bin_is_the_unamplified_gaussian():
    proc = monte_carlo(HAND_BLT, 2.0, num_bins=1, n_steps=6)
    exact = proc.rigorous.delta_at(1.0)
    assert proc.rigorous.bound.sensitivity == pytest.approx(
        brute_force_sensitivity(tuple(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, 6)), 1, 6), rel=1e-15
    )
    estimate = proc.delta_estimate(1.0)
    assert estimate.remove.lower <= exact <= estimate.remove.upper
    assert estimate.add.lower <= exact <= estimate.add.upper


def test_amplified_estimate_lies_below_the_rigorous_bound():
    proc = monte_carlo(identity_strategy(), 1.0, num_bins=10, n_steps=10, num_samples=100_000, confidence=0.95)
    assert proc.delta_at(2.0) < 0.5 * proc.rigorous.delta_at(2.0)
    assert proc.epsilon_at(1e-3) < proc.rigorous.epsilon_at(1e-3)


def test_monte_carlo_is_reported_as_an_estimate_with_its_bounds():
    proc = monte_carlo(HAND_BLT, 1.0, num_bins=4, n_steps=12, num_samples=20_000, confidence=0.9)
    assert proc.is_guarantee is False
    assert "ESTIMATE (not a guarantee)" in proc.description and "seed 3" in proc.description
    assert proc.num_samples == 20_000 and proc.confidence == 0.9
    delta = proc.delta_estimate(1.0)
    assert delta.lower <= delta.estimate <= delta.upper == proc.delta_at(1.0)
    epsilon = proc.epsilon_estimate(1e-2)
    assert epsilon.lower <= epsilon.estimate <= epsilon.upper == proc.epsilon_at(1e-2)
    assert proc.delta_at(proc.epsilon_at(1e-2)) <= 1e-2
    assert proc.rigorous.is_guarantee is True


def test_same_seed_same_estimate_and_samples_are_rounded_to_whole_bins():
    first = monte_carlo(HAND_BLT, 1.0, num_bins=4, n_steps=12, num_samples=10_001, seed=5)
    second = monte_carlo(HAND_BLT, 1.0, num_bins=4, n_steps=12, num_samples=10_001, seed=5)
    assert first.num_samples == 10_004
    assert first.epsilon_at(1e-2) == second.epsilon_at(1e-2)
    other = monte_carlo(HAND_BLT, 1.0, num_bins=4, n_steps=12, num_samples=10_001, seed=6)
    assert other.epsilon_at(1e-2) != first.epsilon_at(1e-2)


def test_delta_below_what_the_samples_can_bound_is_refused():
    proc = monte_carlo(identity_strategy(), 1.0, num_bins=2, n_steps=4, num_samples=1000, confidence=0.95)
    with pytest.raises(ValueError, match="below the smallest delta.*raise num_samples.*method='rigorous'"):
        proc.epsilon_at(1e-6)


# --- bad input -----------------------------------------------------------------------------------


def test_bad_bins_and_steps_are_refused():
    inner = dpftrl_acc.mf_gaussian(1.0, identity_strategy())
    with pytest.raises(ValueError, match=r"num_bins must be <= n_steps \(10\), got 11"):
        dpftrl_acc.balls_in_bins(inner, num_bins=11, n_steps=10)
    with pytest.raises(ValueError, match="num_bins must be >= 1, got 0"):
        dpftrl_acc.balls_in_bins(inner, num_bins=0, n_steps=10)
    with pytest.raises(TypeError, match="num_bins must be an integer"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2.5, n_steps=10)
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        dpftrl_acc.balls_in_bins(inner, num_bins=1, n_steps=0)
    with pytest.raises(TypeError, match="n_steps"):
        dpftrl_acc.balls_in_bins(inner, num_bins=3)


def test_bad_inner_is_refused():
    bound = dpftrl_acc.mf_gaussian(1.0, identity_strategy(), n_steps=10)
    with pytest.raises(ValueError, match="inner must be unbound.*without n_steps"):
        dpftrl_acc.balls_in_bins(bound, num_bins=2, n_steps=10)
    with pytest.raises(TypeError, match=r"inner must be an unbound mf_gaussian"):
        dpftrl_acc.balls_in_bins(identity_strategy(), num_bins=2, n_steps=10)


def test_the_default_is_the_tightest_bound_proven_for_adaptive_gradients():
    # A BLT's bins interact: its amplified bound is not proven for adaptive gradients
    # (docs/adaptivity.md), so the default is the unamplified bound and "amplified" warns.
    inner = dpftrl_acc.mf_gaussian(1.3, HAND_BLT)
    default = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12)
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning, match=r"not proven to dominate adaptively"):
        amplified = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="rdp")
    rigorous = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="rigorous")
    assert isinstance(default, dpftrl_acc.BallsInBins)
    for delta in [1e-8, 1e-4]:
        assert default.epsilon_at(delta) == rigorous.epsilon_at(delta)
        assert amplified.epsilon_at(delta) <= rigorous.epsilon_at(delta)
    assert default.participation == rigorous.participation
    assert default.mechanism.fingerprint == rigorous.mechanism.fingerprint
    # bins that do not interact (the identity): the random-allocation PLD, proven and amplified
    identity = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(1.3, identity_strategy()), num_bins=4, n_steps=12)
    assert isinstance(identity, dpftrl_acc.BallsInBinsPLD)
    identity_rigorous = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(1.3, identity_strategy()), num_bins=4,
                                                 n_steps=12, method="rigorous")
    assert identity.epsilon_at(1e-5) < identity_rigorous.epsilon_at(1e-5)
    # a strategy matrix with a negative entry has no amplified bound here: the default is unamplified
    signed = dpftrl_acc.mf_gaussian(1.3, HandBLTRecipe(theta=(0.5,), omega=(-0.3,)))
    fallback = dpftrl_acc.balls_in_bins(signed, num_bins=2, n_steps=4)
    assert isinstance(fallback, dpftrl_acc.BallsInBins)
    assert "without amplification" in fallback.description


def test_bad_method_and_monte_carlo_arguments_are_refused():
    inner = dpftrl_acc.mf_gaussian(1.0, identity_strategy())
    with pytest.raises(ValueError, match="method must be None .the tightest proven bound. or one of"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2, n_steps=4, method="exact")
    with pytest.raises(ValueError, match="seed apply only to method='monte_carlo'"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2, n_steps=4, seed=1)
    with pytest.raises(ValueError, match="seed is required for method='monte_carlo'"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2, n_steps=4, method="monte_carlo")
    with pytest.raises(ValueError, match=r"confidence must be a number in \(0, 1\)"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2, n_steps=4, method="monte_carlo", seed=1, confidence=1.0)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        dpftrl_acc.balls_in_bins(inner, num_bins=2, n_steps=4, method="monte_carlo", seed=1, num_samples=0)


def test_negative_strategy_entries_are_refused_for_monte_carlo():
    signed = HandBLTRecipe(theta=(0.5,), omega=(-0.3,))
    message = "method='monte_carlo' needs a strategy matrix with non-negative entries.*c_1 = -0.3.*method='rigorous'"
    with pytest.raises(ValueError, match=message):
        monte_carlo(signed, 1.0, num_bins=2, n_steps=4, num_samples=100)


def test_poisson_refuses_a_blt_with_the_seed_advice():
    advice = "use BandMF with opake.dpftrl.accounting.poisson instead"
    with pytest.raises(dpftrl_acc.UnsupportedAmplificationError, match=advice):
        dpftrl_acc.poisson(dpftrl_acc.mf_gaussian(1.0, blt_strategy(max_buffers=10)), 0.01)
    assert issubclass(dpftrl_acc.UnsupportedAmplificationError, ValueError)
