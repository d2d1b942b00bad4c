"""The one-factor comparison bound of the remove direction (allocation/factor.py).

Oracles written here and in tests/accounting_oracles.py: the exact remove divergence
E_P[(R - gamma)_+] by quadrature over the Gaussian U ~ N(0, G) for one, two and three bins (any Gram matrix, the comparison's G' too), the
Black-Scholes form of psi through an independent lognormal call, adaptive and high-precision
quadrature of the truncated moment generating function and of the lognormal tail, and the Monte
Carlo lower confidence bound for more bins.
"""

import math

import numpy as np
import pytest
import scipy.integrate
from accounting_oracles import (
    HAND_BLT,
    dense_coefficients,
    dense_gram,
    gaussian_hockey_stick,
    lognormal_call,
    three_bin_remove,
    two_bin_divergences,
)

from opake.accounting.confidence import kl_lower_bound
from opake.dpftrl.accounting.allocation import factor
from opake.dpftrl.accounting.allocation.monte_carlo import sample_privacy_losses


def random_gram(rng, b):
    m = rng.uniform(0.0, 1.0, size=(2 * b, b))
    return m.T @ m


def certificate_matrix(certificate):
    b = int(certificate.counts.sum())
    d = np.repeat(certificate.levels, certificate.counts)
    return certificate.common * np.ones((b, b)) + np.diag(d)


@pytest.mark.parametrize("b", [2, 3, 5, 8])
def test_certificates_are_copositive_above_the_gram(b):
    rng = np.random.default_rng(b)
    gram = random_gram(rng, b) * rng.uniform(0.2, 3.0)
    for certificate in factor.factor_certificates(gram):
        difference = certificate_matrix(certificate) - gram
        # Schur's test proves D - A+ positive semidefinite and A+ - A >= 0 entrywise
        positive = np.maximum(gram - certificate.common, 0.0)
        d = np.diag(np.repeat(certificate.levels, certificate.counts))
        assert np.linalg.eigvalsh(d - positive).min() >= -1e-12 * max(1.0, np.abs(positive).max())
        vectors = rng.uniform(0.0, 1.0, size=(2000, b)) ** 3  # some nearly sparse
        vectors = np.concatenate([vectors, np.eye(b)])
        assert np.einsum("ki,ij,kj->k", vectors, difference, vectors).min() >= -1e-12


def test_the_entrywise_certificate_is_the_largest_off_diagonal_entry():
    gram = np.array([[3.0, 1.0, 0.5], [1.0, 2.0, 0.8], [0.5, 0.8, 2.5]])
    largest = factor.certify(gram, 1.0)  # kappa^2 = max off-diagonal: A+ is diagonal
    assert largest.levels[0] == pytest.approx(2.0, rel=1e-12)  # max_j (G_jj - 1)


@pytest.mark.parametrize("gram, raised", [
    (np.array([[2.0, 1.0], [1.0, 2.0]]), np.array([[3.0, 0.5], [0.5, 3.0]])),     # + a PSD matrix
    (np.array([[2.0, 0.2], [0.2, 1.5]]), np.array([[2.0, 1.2], [1.2, 1.5]])),     # off-diagonal raised
])
def test_comparison_raises_the_remove_divergence_by_quadrature(gram, raised):
    for epsilon in [0.1, 0.5, 1.0, 2.0]:
        lower, _ = two_bin_divergences(gram, epsilon)
        upper, _ = two_bin_divergences(raised, epsilon)
        assert lower <= upper * (1 + 1e-9)
    # and the inequality is strict somewhere: the comparison is not vacuous
    assert two_bin_divergences(gram, 0.5)[0] < 0.99 * two_bin_divergences(raised, 0.5)[0]


def test_comparison_with_a_real_certificate_on_three_bins():
    rng = np.random.default_rng(4)
    gram = random_gram(rng, 3) * 0.6
    for certificate in factor.factor_certificates(gram)[:4]:
        raised = certificate_matrix(certificate)
        for epsilon in [0.25, 1.0]:
            assert three_bin_remove(gram, epsilon) <= three_bin_remove(raised, epsilon) * (1 + 1e-6)


@pytest.mark.parametrize("kappa, epsilon", [(0.3, 1.0), (0.7, 3.0), (2.0, 0.5)])
def test_psi_matches_an_independent_lognormal_call_and_is_log_concave(kappa, epsilon):
    log_s = np.linspace(epsilon - 4.0, epsilon + 2.0, 601)
    log_psi, slope, accurate = factor._log_psi_and_slope(log_s, kappa, epsilon)
    # psi(s) = E[(s e^W - gamma)_+], W ~ N(-kappa^2/2, kappa^2)
    reference = lognormal_call(log_s - kappa**2 / 2, kappa**2, math.exp(epsilon))
    keep = accurate & (reference > 1e-200)
    np.testing.assert_allclose(np.exp(log_psi[keep]), reference[keep], rtol=1e-9)
    assert np.diff(log_psi[keep], 2).max() <= 1e-9              # ln psi concave in ln s, hence in s
    s, h = np.exp(log_s), 1e-6  # theta0 = psi'/psi against a central difference of the reference
    numeric_slope = (lognormal_call(np.log(s * (1 + h)) - kappa**2 / 2, kappa**2, math.exp(epsilon))
                     - lognormal_call(np.log(s * (1 - h)) - kappa**2 / 2, kappa**2, math.exp(epsilon))) / (2 * s * h)
    np.testing.assert_allclose(slope[keep], numeric_slope[keep] / reference[keep], rtol=1e-4)
    assert np.all(np.diff(reference) >= 0) and np.all(np.diff(reference) / np.diff(s) <= 1 + 1e-9)


@pytest.mark.parametrize("variance, t", [(0.05, 4.0), (0.4, 6.0), (1.5, 8.5), (2.4, 5.0)])
def test_truncated_moment_generating_function_is_above_quadrature(variance, t):
    sd = math.sqrt(variance)
    top = math.exp(sd * t - variance / 2)
    u = np.array([0.01, 0.3, 2.0])
    bounds, excess = factor._log_mgf_one_level(variance, t, u)
    for value, rate in zip(bounds, u):
        if rate * top > 600.0:  # e^(u T) overflows the reference; the bound is +inf or useless there
            continue

        def integrand(z, rate=rate):
            return math.exp(rate * min(math.exp(sd * z - variance / 2), top)) * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        exact = sum(scipy.integrate.quad(integrand, a, c, epsabs=0, epsrel=1e-13, limit=200)[0]
                    for a, c in [(-40, -5), (-5, 0), (0, t), (t, t + 40)])
        assert math.log(exact) <= value
        if rate * top <= 30.0:  # where the bound can be of use, the chord rule's O(h^2 f''/f) error is small
            assert value <= math.log(exact) + 1e-4 * max(1.0, math.log(exact))
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    cap = mpmath.e ** (mpmath.mpf(sd) * t - mpmath.mpf(variance) / 2)
    tail = float(mpmath.quad(lambda z: max(mpmath.e ** (sd * z - mpmath.mpf(variance) / 2) - cap, 0) * mpmath.npdf(z),
                             [t, t + 5, t + 40]))
    assert tail <= excess <= tail * (1 + 1e-8) + 1e-300


@pytest.mark.parametrize("mu", [0.4, 1.0, 2.0])
def test_one_bin_is_the_gaussian_within_two_percent(mu):
    gram = np.array([[mu * mu]])
    tables = [factor.factor_table(c, 1.0) for c in factor.factor_certificates(gram)]
    for epsilon in [0.2, 1.0, 2.5]:
        exact = gaussian_hockey_stick(mu, epsilon)
        bound = factor.factor_remove_deltas(tables, epsilon)
        assert exact <= bound <= exact * 1.02


@pytest.mark.parametrize("gram", [
    np.array([[2.0, 0.0], [0.0, 2.0]]),
    np.array([[0.6, 0.45], [0.45, 0.5]]),
    np.array([[4.0, 3.6], [3.6, 4.0]]),
])
def test_two_bins_bound_is_above_the_exact_divergence(gram):
    tables = [factor.factor_table(c, 1.0) for c in factor.factor_certificates(gram)]
    for epsilon in [0.1, 0.5, 1.5]:
        exact, _ = two_bin_divergences(gram, epsilon)
        assert exact * (1 - 1e-6) <= factor.factor_remove_deltas(tables, epsilon)


def test_three_bins_bound_is_above_the_exact_divergence():
    rng = np.random.default_rng(7)
    gram = random_gram(rng, 3) * 0.3
    tables = [factor.factor_table(c, 1.0) for c in factor.factor_certificates(gram)]
    for epsilon in [0.1, 0.5, 1.0]:
        exact = three_bin_remove(gram, epsilon)
        bound = factor.factor_remove_deltas(tables, epsilon)
        assert exact * (1 - 1e-6) <= bound < 1.0


@pytest.mark.parametrize("num_bins, n_steps, sigma", [(30, 600, 8.0), (20, 400, 5.0)])
def test_never_below_the_monte_carlo_lower_confidence_bound(num_bins, n_steps, sigma):
    gram = dense_gram(dense_coefficients(HAND_BLT.theta, HAND_BLT.omega, n_steps), num_bins)
    tables = [factor.factor_table(c, sigma) for c in factor.factor_certificates(gram)]
    samples = 240_000 // num_bins * num_bins
    under_q, _ = sample_privacy_losses(gram, sigma, samples, seed=11)
    own_bin = math.sqrt(float(np.diag(gram).max())) / sigma  # one bin alone, no amplification
    useful = 0
    for epsilon in [0.25, 0.5, 1.0, 1.5]:
        mean = float(np.clip(-np.expm1(epsilon - under_q), 0.0, None).mean())
        lower = kl_lower_bound(mean, samples, 5e-4)
        bound = factor.factor_remove_deltas(tables, epsilon)
        assert lower <= bound
        useful += bound < 0.8 * gaussian_hockey_stick(own_bin, epsilon)  # and it amplifies
    assert useful >= 2


def test_certificates_are_cached_per_gram_and_filtered_per_sigma():
    gram = random_gram(np.random.default_rng(2), 6)
    first = factor.cached_certificates(gram)
    assert factor.cached_certificates(gram.copy()) is first
    assert factor.cached_certificates(gram * 1.01) is not first
    for sigma in [0.1, 1.0, 10.0]:
        kept = factor.useful_certificates(gram, sigma)
        assert len(kept) <= factor._KEEP
        assert all(float(c.levels.max()) / sigma**2 <= factor._USEFUL_LEVEL for c in kept)
    assert factor.useful_certificates(gram, 1e-3) == ()  # sigma tiny: every d / sigma^2 is huge
