"""method="rdp": the rigorous amplified balls-in-bins bound through Renyi divergences.

References written here: brute-force enumeration of all b^alpha bin tuples (exact remove-direction
moments), the reference values of docs/math.md section 6, 2-D quadrature of the add direction for
C = I, the Gaussian mechanism's own RDP alpha S^2 / (2 sigma^2), and the Monte Carlo estimate.
"""

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy.special import logsumexp
from accounting_oracles import HAND_BLT, HandBLTRecipe, dense_coefficients, dense_gram

import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.accounting.allocation import rdp as rdp_allocation
from opake.dpftrl.accounting.allocation.rdp import (
    add_rdp_upper_bound,
    exact_remove_rdp,
    majorized_remove_rdp,
    rdp_delta,
    rdp_epsilon,
    remove_rdp_upper_bound,
    weighted_add_rdp,
)
from opake.dpftrl.noise import blt_strategy, identity_strategy


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
    np.testing.assert_allclose(bound, [0.269002, 0.425918, 0.617762], atol=1e-6)  # exact at orders 2..4
    assert np.all(majorized_remove_rdp(gram, 2.0, max_order=4) > bound + 1e-3)
    c_geometric = np.concatenate([[1.0], 0.5 * 0.6 ** np.arange(63)])
    assert brute_force_remove_rdp(dense_gram(c_geometric, 16), 2.0, 2) == pytest.approx(0.383051, abs=1e-6)


@pytest.mark.parametrize("n_steps, num_bins, sigma", [(6, 3, 1.0), (7, 3, 0.8), (8, 2, 1.5)])
def test_remove_bound_is_exact_for_its_majorized_gram_and_above_the_true_value(n_steps, num_bins, sigma):
    gram = dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, n_steps), num_bins)
    majorized_bound = majorized_remove_rdp(gram, sigma, max_order=5)
    bound = remove_rdp_upper_bound(gram, sigma, max_order=5)
    for order in range(2, 6):
        exact = brute_force_remove_rdp(gram, sigma, order)
        assert majorized_bound[order - 2] == pytest.approx(
            brute_force_remove_rdp(majorized(gram), sigma, order), rel=1e-12)
        assert majorized_bound[order - 2] >= exact * (1 - 1e-12)
        assert exact <= bound[order - 2] <= majorized_bound[order - 2]
        if order <= 4:  # summed exactly
            assert bound[order - 2] == pytest.approx(exact, rel=1e-10)


@pytest.mark.parametrize("num_bins, sigma", [(3, 0.7), (5, 1.3), (7, 2.0)])
def test_exact_orders_equal_brute_force_and_never_fall_below_it(num_bins, sigma):
    rng = np.random.default_rng(num_bins)
    factor = rng.uniform(0.0, 1.0, size=(2 * num_bins, num_bins))  # any Gram of a non-negative M
    gram = factor.T @ factor
    exact = exact_remove_rdp(gram, sigma)
    assert sorted(exact) == [2, 3, 4]
    for order, value in exact.items():
        reference = brute_force_remove_rdp(gram, sigma, order)
        assert value >= reference
        assert value == pytest.approx(reference, rel=1e-10)


def test_exact_orders_survive_entries_that_would_overflow():
    gram = np.array([[900.0, 850.0], [850.0, 900.0]])  # exp(900) overflows float64
    exact = exact_remove_rdp(gram, 1.0)
    for order in (2, 3, 4):
        assert math.isfinite(exact[order])
        assert exact[order] == pytest.approx(brute_force_remove_rdp(gram, 1.0, order), rel=1e-12)


def test_exact_orders_are_skipped_where_too_costly(monkeypatch):
    gram = dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, 12), 4)
    monkeypatch.setattr(rdp_allocation, "EXACT_ORDER_4_MAX_BINS", 3)
    assert sorted(exact_remove_rdp(gram, 1.0)) == [2, 3]
    monkeypatch.setattr(rdp_allocation, "EXACT_ORDER_3_MAX_BINS", 3)
    assert sorted(exact_remove_rdp(gram, 1.0)) == [2]
    bound = remove_rdp_upper_bound(gram, 1.0, max_order=5)
    np.testing.assert_array_equal(bound[1:], majorized_remove_rdp(gram, 1.0, max_order=5)[1:])


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


def _quadrature_add_rdp(gram, sigma, orders):
    """D_alpha(P||Q) for b = 2 by 2-D Gauss-Hermite quadrature: E_P[R^-(alpha-1)], R = mean_j X_j."""
    nodes, node_weights = np.polynomial.hermite_e.hermegauss(160)
    node_weights = node_weights / node_weights.sum()
    factor = np.linalg.cholesky(gram / sigma**2)
    z = np.stack(np.meshgrid(nodes, nodes, indexing="ij"), axis=-1).reshape(-1, 2)
    w = (node_weights[:, None] * node_weights[None, :]).reshape(-1)
    log_x = z @ factor.T - np.diag(gram) / (2 * sigma**2)           # ln X_j at each node
    log_r = logsumexp(log_x, axis=1) - math.log(2)
    return np.array([logsumexp(-(a - 1) * log_r, b=w) / (a - 1) for a in orders])


@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_weighted_add_bounds_hold_by_quadrature_for_a_correlated_pair_of_bins(sigma):
    orders = np.arange(2, 7)
    # the quadrature itself: two (almost) identical bins are one Gaussian, alpha S^2 / (2 sigma^2)
    twins = np.array([[5.25, 5.25 - 1e-9], [5.25 - 1e-9, 5.25]])
    np.testing.assert_allclose(_quadrature_add_rdp(twins, sigma, orders), orders * 5.25 / (2 * sigma**2), rtol=1e-6)
    gram = np.array([[5.25, 2.5], [2.5, 3.1]])  # unequal bins: the first bin reaches further
    exact = _quadrature_add_rdp(gram, sigma, orders)
    uniform = weighted_add_rdp(gram, sigma, np.array([0.5, 0.5]), max_order=6)
    best = add_rdp_upper_bound(gram, sigma, max_order=6)
    assert np.all(exact <= best * (1 + 1e-9))
    assert np.all(best <= uniform + 1e-12)
    assert best[0] < uniform[0] - 1e-3  # the weights help when the bins differ
    rng = np.random.default_rng(0)
    for _ in range(20):  # every weight vector gives a valid bound
        pi = rng.dirichlet([1.0, 1.0])
        assert np.all(exact <= weighted_add_rdp(gram, sigma, pi, max_order=6) * (1 + 1e-9))
    assert np.all(exact <= weighted_add_rdp(gram, sigma, np.array([1.0, 0.0]), max_order=6) * (1 + 1e-9))


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
    with pytest.raises(ValueError, match="method='amplified' needs a strategy matrix with non-negative entries"):
        dpftrl_acc.balls_in_bins(signed, num_bins=2, n_steps=4, method="rdp")
    with pytest.raises(ValueError, match="seed apply only to method='monte_carlo'; drop them for method='amplified'"):
        dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(1.0, HAND_BLT), num_bins=2, n_steps=4, method="rdp", seed=0)


def test_each_direction_is_converted_on_its_own():
    inner = dpftrl_acc.mf_gaussian(1.0, HAND_BLT)
    process = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="rdp")
    for delta in [1e-6, 1e-3]:
        per_direction = max(rdp_epsilon(process.remove, delta), rdp_epsilon(process.add, delta))
        assert process.epsilon_at(delta) <= min(per_direction, process.rigorous.epsilon_at(delta)) + 1e-12
        # converting the pointwise maximum with one order for both directions is never tighter
        # (up to the few ulps by which epsilon_at rounds up so that delta_at(epsilon_at(d)) <= d exactly)
        assert process.epsilon_at(delta) <= rdp_epsilon(process.rdp, delta) * (1 + 1e-14)
        assert process.delta_at(process.epsilon_at(delta)) <= delta


def test_seed_example_bound_and_its_monte_carlo_lower_confidence_bound():
    # The seed's example: 100 bins over 500 steps, BLT with up to 10 buffers, sigma = 1, delta = 1e-5.
    # Unamplified 27.23; the majorized RDP bound alone gave 25.88; exact order-2 moments give 23.81;
    # the unsplit direct hockey-stick bounds 22.62; with the split remove bound 22.30. An independent
    # Monte Carlo puts the truth at 22.05; issue 19's target: at most 2% above it.
    inner = dpftrl_acc.mf_gaussian(1.0, blt_strategy(max_buffers=10))
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning):   # a BLT: not proven for adaptive gradients
        process = dpftrl_acc.balls_in_bins(inner, num_bins=100, n_steps=500, method="amplified")
    assert isinstance(process, dpftrl_acc.BallsInBinsRDP)
    epsilon = process.epsilon_at(1e-5)
    assert epsilon <= 22.05 * 1.02
    assert epsilon < process.rigorous.epsilon_at(1e-5) - 4.5
    estimate = dpftrl_acc.balls_in_bins(inner, num_bins=100, n_steps=500, method="monte_carlo",
                                        num_samples=100_000, seed=5, confidence=0.999)
    # the Monte Carlo lower confidence bound on the true delta at our epsilon stays below 1e-5,
    # and so does it at every smaller delta's bound (a bound below the truth would show here)
    assert estimate.delta_estimate(epsilon).lower <= 1e-5
    for delta in [1e-3, 1e-4]:
        assert estimate.epsilon_estimate(delta).lower <= process.epsilon_at(delta)


@pytest.mark.parametrize("sigma", [1e-3, 1e4])
def test_extreme_noise_multipliers_give_finite_answers_never_above_the_unamplified_bound(sigma):
    process = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(sigma, HAND_BLT), num_bins=3, n_steps=12,
                                       method="amplified")
    for delta in [1e-10, 1e-5]:
        epsilon = process.epsilon_at(delta)
        assert math.isfinite(epsilon) and 0.0 <= epsilon <= process.rigorous.epsilon_at(delta)
    for epsilon in [0.5, 1.0, 50.0]:
        assert 0.0 <= process.delta_at(epsilon) <= process.rigorous.delta_at(epsilon) <= 1.0


def test_rdp_is_an_alias_of_amplified():
    inner = dpftrl_acc.mf_gaussian(1.0, HAND_BLT)
    old = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="rdp")
    new = dpftrl_acc.balls_in_bins(inner, num_bins=4, n_steps=12, method="amplified")
    assert type(old) is type(new)
    assert old.epsilon_at(1e-5) == new.epsilon_at(1e-5)


def test_demo_configuration_meets_the_issue_target():
    # The demo: 1200 examples in 30 bins, 600 steps (20 epochs), BLT with up to 10 buffers, sigma
    # 14.388. Unamplified 3.000 (the amplified bound was capped by it); an independent Monte Carlo
    # puts the truth at 2.59 (1e-5) and 3.49 (1e-8). Issue 19: at most 5% above at 1e-5; the
    # one-factor comparison proves 2.667 and 3.585.
    inner = dpftrl_acc.mf_gaussian(14.388, blt_strategy(max_buffers=10))
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning):
        process = dpftrl_acc.balls_in_bins(inner, num_bins=30, n_steps=600, method="amplified")
    epsilon = process.epsilon_at(1e-5)
    assert epsilon <= 2.59 * 1.05
    assert epsilon < process.rigorous.epsilon_at(1e-5) - 0.3
    assert process.delta_at(epsilon) <= 1e-5
    assert process.epsilon_at(1e-8) <= 3.49 * 1.05
    estimate = dpftrl_acc.balls_in_bins(inner, num_bins=30, n_steps=600, method="monte_carlo",
                                        num_samples=120_000, seed=9, confidence=0.999)
    for target in [1e-2, 1e-3]:
        assert estimate.epsilon_estimate(target).lower <= process.epsilon_at(target)
    for eps in [1.0, 1.5, 2.0]:
        mc = estimate.delta_estimate(eps)
        assert mc.remove.lower <= process.remove_delta(eps)
        assert mc.add.lower <= process.add_delta(eps)


def test_weight_fit_emits_no_warnings_where_weights_underflow():
    # diagonal entries far apart relative to sigma^2: the fitted weights of some bins underflow to
    # 0 (the old fit took ln 0 there and warned, then multiplied 0 by -inf)
    b = 200
    lag = np.abs(np.arange(b)[:, None] - np.arange(b)[None, :])
    scale = np.linspace(10.0, 2.0, b)
    gram = np.exp(-lag / 5.0) * np.sqrt(np.outer(scale, scale))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = rdp_allocation.add_weight_candidates(gram, 0.05)
        bound = add_rdp_upper_bound(gram, 0.05, weights=weights)
    assert min(float(w.min()) for w in weights) == 0.0  # the case that used to warn
    assert all(abs(float(w.sum()) - 1.0) < 1e-9 for w in weights)
    uniform = weighted_add_rdp(gram, 0.05, np.full(b, 1.0 / b))
    assert np.all(np.isfinite(bound)) and bound[0] < uniform[0]


def test_majorized_groups_bound_the_ungrouped_product():
    rng = np.random.default_rng(1)
    b = 40
    factor_matrix = rng.uniform(0.0, 1.0, size=(60, b))
    gram = factor_matrix.T @ factor_matrix  # 40 distinct diagonal entries: grouped into 8
    grouped = majorized_remove_rdp(gram, 2.0, max_order=12)
    # the ungrouped product of the f_i, one at a time (the formula of the module docstring)
    tau = gram[~np.eye(b, dtype=bool)].max()
    counts = np.arange(13.0)
    log_factorials = np.array([math.lgamma(c + 1.0) for c in counts])
    pairs = counts * (counts - 1) / 2
    product = np.full(13, -np.inf)
    product[0] = 0.0
    for diagonal in np.diag(gram):
        log_f = (diagonal - tau) * pairs / 4.0 - log_factorials
        product = np.array([logsumexp([product[i] + log_f[k - i] for i in range(k + 1)]) for k in range(13)])
    orders = counts[2:]
    ungrouped = (log_factorials[2:] - orders * math.log(b) + product[2:] + tau * pairs[2:] / 4.0) / (orders - 1)
    assert np.all(grouped >= ungrouped * (1 - 1e-12))
    assert np.all(grouped <= ungrouped + 0.05 * np.abs(ungrouped))
    for order in (2, 3):
        assert brute_force_remove_rdp(gram[:5, :5], 2.0, order) <= majorized_remove_rdp(gram[:5, :5], 2.0, 3)[order - 2] + 1e-12


def test_many_bins_claim_no_majorized_bound_above_its_largest_order(monkeypatch):
    gram = 2.0 * np.eye(6) + 0.5
    monkeypatch.setattr(rdp_allocation, "MANY_BINS", 4)
    bound = remove_rdp_upper_bound(gram, 1.0)
    cap = rdp_allocation.MANY_BINS_MAX_ORDER
    assert np.all(np.isinf(bound[cap - 1:])) and np.all(np.isfinite(bound[:cap - 1]))
    np.testing.assert_allclose(bound[:cap - 1], majorized_remove_rdp(gram, 1.0, cap), rtol=0, atol=0.0)


@pytest.mark.slow
def test_calibration_sizes_are_quiet_and_amplified():
    # issue 19: the plans' calibrations evaluate 976 bins over 3 epochs and 781 bins over 20
    # epochs 10-30 times; each evaluation after the first (which caches the sigma-free parts)
    # must print nothing (their times: benchmarks/accounting.py, "per evaluation at the plans' sizes").
    strategy = blt_strategy()
    for num_bins, n_steps, sigmas in [(976, 2928, (14.6, 5.3, 2.3)), (781, 15620, (48.8, 17.8, 7.5))]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.simplefilter("ignore", dpftrl_acc.UnprovenAmplificationWarning)
            first = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(sigmas[0], strategy), num_bins=num_bins,
                                             n_steps=n_steps, method="amplified")
            first.epsilon_at(1e-6)
            for sigma in sigmas:
                process = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(sigma, strategy), num_bins=num_bins,
                                                   n_steps=n_steps, method="amplified")
                epsilon = process.epsilon_at(1e-6)
                assert epsilon < process.rigorous.epsilon_at(1e-6)  # amplified
