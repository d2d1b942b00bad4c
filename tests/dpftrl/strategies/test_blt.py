"""opake.dpftrl.strategies.blt against independent oracles (tests/dense.py, mpmath, hand formulas).

Tolerances (why they are what they are):
- dense oracles (n <= 64) and direct sums are accurate to ~1e-14 relative: unit-diagonal
  triangular solves of well-conditioned matrices and sums of O(1) positive terms. The library's
  closed forms and the oracles agree, for correct code, to a few 1e-15; RTOL = 1e-10 leaves a
  margin of 10^4 while catching any formula slip (a wrong exponent or a missing term is >= 1e-3).
- near 1, a naive float64 evaluation of (1 - r^m) / (1 - r) with m (1 - r) tiny (short horizons,
  decays within 1e-10 of 1) cancels: 1 - r^m keeps only ~ -log10(m (1 - r)) - 16 digits
  (e.g. 2e-9 relative at 1 - theta = 1e-10, n = 64); the hard-case table contains such inputs.
- mpmath references evaluate the exact definition of the float64 inputs at 60 digits, so they
  are exact to double precision; RTOL applies there too.
- quantities that can cancel to 0 (coefficients of C^{-1}) get an absolute floor of 1e-12
  times their largest entry (which is 1 = chat_0).
"""

from __future__ import annotations

import dataclasses
import math

import mpmath
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import dense
from opake.dpftrl.strategies import blt, toeplitz
from opake.dpftrl.participation import Participation

RTOL = 1e-10


def P(theta, omega) -> blt.BLTParams:
    return blt.BLTParams(np.asarray(theta, dtype=np.float64), np.asarray(omega, dtype=np.float64))


# ---------------------------------------------------------------------------------------------
# Parameter generators


@st.composite
def omega_for(draw, num_buffers, min_total=0.0, max_total=0.999):
    """omega > 0 (or a zero total) as fractions of a total < 1, so sum(omega) < 1."""
    total = draw(st.floats(min_total, max_total))
    weights = np.asarray(draw(st.lists(st.floats(0.01, 1.0), min_size=num_buffers, max_size=num_buffers)))
    return total * weights / weights.sum()


@st.composite
def valid_params(draw, max_buffers=4):
    """Anything inside the min-sep preconditions: theta in [0, 1] (ends included, repeats
    allowed), omega >= 0, sum(omega) < 1."""
    b = draw(st.integers(1, max_buffers))
    theta = np.asarray(draw(st.lists(st.floats(0.0, 1.0), min_size=b, max_size=b)))
    return P(theta, draw(omega_for(b)))


@st.composite
def separated_params(draw, max_buffers=4):
    """Distinct decays in (0, 1) whose distances to 1 differ by >= 12% (log10 gap >= 0.05),
    theta from ~2e-4 up to 1 - 1e-6, omega > 0 with sum(omega) < 1: the regime where C^{-1}
    is a BLT with real, well-separated decays."""
    b = draw(st.integers(1, max_buffers))
    x = np.sort(np.asarray(draw(st.lists(st.floats(1e-4, 6.0), min_size=b, max_size=b))))
    assume(b == 1 or np.min(np.diff(x)) >= 0.05)
    theta = 1.0 - 10.0 ** (-x)
    return P(theta, draw(omega_for(b, min_total=1e-6)))


def _interlaced(num_buffers: int, first_gap_exp: float, last_gap_exp: float) -> blt.BLTParams:
    """A realistic optimizer-like BLT (docs/math.md sec. 5 barrier-free construction), test data only.

    2B values x in (0, 1) with 1 - x log-spaced from 10^-first to 10^-last, read alternately
    as theta_hat_1 < theta_1 < theta_hat_2 < ...; omega_i = prod_j (theta_i - theta_hat_j) /
    prod_{j != i} (theta_i - theta_j) (partial fractions of 1 + sum_i omega_i / (l - theta_i) =
    prod_j (l - theta_hat_j) / prod_i (l - theta_i)), evaluated in mpmath, then rounded to float64.
    """
    with mpmath.workdps(60):
        exps = np.linspace(first_gap_exp, last_gap_exp, 2 * num_buffers)
        x = [1 - mpmath.mpf(10) ** (-mpmath.mpf(float(e))) for e in exps]
        theta_hat, theta = x[0::2], x[1::2]
        omega = []
        for i, ti in enumerate(theta):
            num = mpmath.fprod(ti - th for th in theta_hat)
            den = mpmath.fprod(ti - tj for j, tj in enumerate(theta) if j != i)
            omega.append(num / den)
        out = P([float(t) for t in theta], [float(o) for o in omega])
    assert np.all(out.omega > 0) and out.omega.sum() < 1
    return out


# The curated table of numerically hard (but valid) parameters.
HARD = {
    "one-buffer": P([0.9], [0.6]),
    "theta0-one-buffer": P([0.0], [0.7]),
    "theta-near-0": P([1e-12, 0.5], [0.4, 0.4]),
    "tiny-omega": P([0.9, 0.5], [1e-12, 1e-9]),
    "near1-1e-10": P([1.0 - 1e-10], [0.3]),
    "near1-1e-11-mixed": P([1.0 - 1e-11, 0.999, 0.5], [1e-4, 0.05, 0.5]),
    "near1-1e-11-large-omega": P([1.0 - 1e-11, 0.9], [0.6, 0.3]),
    "near-equal-1e-9-at-1-1e-9": P([1.0 - 2e-9, 1.0 - 1e-9], [0.4, 0.5]),
    "zero-omega-buffer": P([0.6, 0.3], [0.0, 0.2]),
    "near-equal-1e-9": P([0.999, 0.999 + 1e-9], [0.2, 0.3]),
    "near-equal-near1": P([1.0 - 2e-6, 1.0 - 2e-6 + 1e-9], [0.1, 0.1]),
    "sum-omega-exactly-1": P([0.8, 0.3], [0.5, 0.5]),
    "realistic-3": _interlaced(3, 0.3, 7.0),
    "realistic-5-to-1e-11": _interlaced(5, 0.3, 11.0),
}
HARD_IDS = list(HARD)
# theta = 1 is inside the preconditions, but the n -> infinity sensitivity is infinite there.
HAS_THETA_ONE = {"theta-exactly-1": P([1.0, 0.5], [0.01, 0.3])}


def _dense_c(params, n):
    return dense.lower_toeplitz(dense.blt_coefs(params.theta, params.omega, n))


def mp_sensitivity_squared(params, n):
    """1 + sum_ij omega_i omega_j sum_{m=0}^{n-2} (theta_i theta_j)^m, exactly (60 digits).

    That is the squared norm of column 0 of C: c_0^2 + sum_{k=1}^{n-1} (sum_i omega_i
    theta_i^(k-1))^2, expanded. n = None: the infinite sum 1 / (1 - theta_i theta_j).
    """
    with mpmath.workdps(60):
        th = [mpmath.mpf(float(v)) for v in params.theta]
        om = [mpmath.mpf(float(v)) for v in params.omega]
        total = mpmath.mpf(1)
        for i in range(len(th)):
            for j in range(len(th)):
                r = th[i] * th[j]
                if n is None:
                    g = 1 / (1 - r)
                elif r == 1:
                    g = mpmath.mpf(n - 1)
                else:
                    g = (1 - r ** (n - 1)) / (1 - r)
                total += om[i] * om[j] * g
        return float(total)


def optimal_toeplitz(n):
    return dense.optimal_toeplitz_sqrt_max_loss(n)


def sum_of_squares(x) -> float:
    """sum x_k^2 of a long vector: exactly rounded (math.fsum) up to 2e5 terms, numpy's pairwise
    summation beyond (positive terms: relative error <= ~log2(n) eps < 3e-15)."""
    sq = np.asarray(x, dtype=np.float64) ** 2
    return math.fsum(sq.tolist()) if sq.shape[0] <= 200_000 else float(np.sum(sq))


# ---------------------------------------------------------------------------------------------
# BLTParams


def test_params_are_frozen_readonly_float64_copies():
    theta_in = np.array([0.9, 0.5])
    omega_in = [0.25, 0.125]
    p = blt.BLTParams(theta_in, omega_in)
    assert p.num_buffers == 2
    for arr in (p.theta, p.omega):
        assert arr.dtype == np.float64 and not arr.flags.writeable
    with pytest.raises(ValueError):
        p.theta[0] = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.theta = np.array([0.1, 0.2])
    theta_in[0] = 0.1  # the caller's array is not aliased
    assert p.theta[0] == 0.9
    np.testing.assert_array_equal(p.one_minus_theta, [1.0 - 0.9, 0.5])
    assert p.one_minus_theta[0] == 1.0 - 0.9


# ---------------------------------------------------------------------------------------------
# coefficients


@given(valid_params(), st.integers(1, 40))
def test_coefficients_match_definition(params, n):
    got = blt.coefficients(params, n)
    assert got.shape == (n,) and got.dtype == np.float64
    np.testing.assert_allclose(got, dense.blt_coefs(params.theta, params.omega, n), rtol=RTOL, atol=0)


def test_coefficients_hand_cases():
    # theta = 0: the 2-banded C with c_1 = omega; theta = 1: c_k = omega for every k >= 1.
    np.testing.assert_array_equal(blt.coefficients(P([0.0], [0.3]), 5), [1.0, 0.3, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(blt.coefficients(P([1.0], [0.3]), 4), [1.0, 0.3, 0.3, 0.3])
    np.testing.assert_allclose(
        blt.coefficients(P([0.5, 0.25], [0.5, 0.25]), 4),
        [1.0, 0.75, 0.25 + 0.0625, 0.125 + 0.015625],
        rtol=1e-15,
    )
    np.testing.assert_array_equal(blt.coefficients(P([0.5], [0.5]), 1), [1.0])


# ---------------------------------------------------------------------------------------------
# inverse


@given(separated_params(), st.integers(1, 40))
def test_inverse_params_give_the_dense_inverse(params, n):
    inv = blt.inverse(params)
    assert isinstance(inv, blt.BLTParams) and inv.num_buffers == params.num_buffers
    chat_from_params = dense.blt_coefs(inv.theta, inv.omega, n)
    cmat = _dense_c(params, n)
    want = dense.inverse_matrix(cmat)[:, 0]
    np.testing.assert_allclose(chat_from_params, want, rtol=RTOL, atol=1e-12)
    # Invariance: C C^{-1} = I with C^{-1} built from the inverse parameters alone.
    np.testing.assert_allclose(cmat @ dense.lower_toeplitz(chat_from_params), np.eye(n), rtol=0, atol=1e-11)
    # ... and the streamed inverse coefficients.
    np.testing.assert_allclose(blt.inverse_coefficients(params, n), want, rtol=RTOL, atol=1e-12)


@given(separated_params())
def test_inverse_structure_for_positive_omega(params):
    # docs/math.md sec. 2 (Inv25): real decays interlacing with theta, all omega_hat < 0,
    # theta_hat > 0 exactly when P = sum(omega / theta) < 1.
    inv = blt.inverse(params)
    theta = np.sort(params.theta)
    order = np.argsort(inv.theta)
    theta_hat, omega_hat = inv.theta[order], inv.omega[order]
    assert np.all(np.isfinite(theta_hat)) and np.all(np.isfinite(omega_hat))
    assert np.all(theta_hat <= theta)
    assert np.all(theta_hat[1:] >= theta[:-1])
    assert np.all(omega_hat < 0)
    pillutla = float(np.sum(params.omega / params.theta))
    if abs(pillutla - 1.0) > 1e-9:
        assert (theta_hat[0] > 0) == (pillutla < 1)


@given(separated_params(), st.integers(1, 30))
def test_inverse_of_inverse_is_the_original_matrix(params, n):
    back = blt.inverse(blt.inverse(params))
    np.testing.assert_allclose(
        dense.blt_coefs(back.theta, back.omega, n), dense.blt_coefs(params.theta, params.omega, n), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("theta, omega", [(0.9, 0.6), (0.5, 0.1), (0.0, 0.7), (0.3, 0.9)])
def test_inverse_of_one_buffer_by_hand(theta, omega):
    # 1 + omega / (l - theta) = 0 at l = theta - omega; omega_hat = (theta_hat - theta) / 1 = -omega.
    inv = blt.inverse(P([theta], [omega]))
    np.testing.assert_allclose(inv.theta, [theta - omega], rtol=1e-14, atol=1e-16)
    np.testing.assert_allclose(inv.omega, [-omega], rtol=1e-14)
    # theta = 0: C is 2-banded, C^{-1} has chat_k = (-omega)^k.
    if theta == 0.0:
        np.testing.assert_allclose(blt.inverse_coefficients(P([0.0], [omega]), 6), (-omega) ** np.arange(6), rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# single-participation sensitivity


@given(valid_params(), st.integers(1, 40))
def test_sensitivity_squared_is_max_column_norm(params, n):
    want = dense.single_participation_sensitivity_squared(_dense_c(params, n))
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), want, rtol=RTOL)


@pytest.mark.parametrize("theta", [0.0, 0.3, 0.9, 0.999, 1.0 - 1e-9])
@pytest.mark.parametrize("omega", [0.05, 0.7])
@pytest.mark.parametrize("n", [1, 2, 10, 1000])
def test_sensitivity_squared_one_buffer_hand_formula(theta, omega, n):
    # sum_{k=1}^{n-1} omega^2 theta^(2(k-1)) = omega^2 (1 - theta^(2(n-1))) / (1 - theta^2);
    # 1 - theta^2 = (1 - theta)(1 + theta) keeps full precision near 1.
    one_minus = 1.0 - theta
    geometric = -math.expm1(2 * (n - 1) * math.log1p(-one_minus)) / (one_minus * (1.0 + theta)) if theta > 0 else min(n - 1, 1)
    want = 1.0 + omega**2 * geometric
    np.testing.assert_allclose(blt.sensitivity_squared(P([theta], [omega]), n), want, rtol=1e-12)


@given(valid_params())
def test_sensitivity_squared_limit_matches_exact_infinite_sum(params):
    assume(np.max(params.theta) < 1.0)
    np.testing.assert_allclose(blt.sensitivity_squared(params, None), mp_sensitivity_squared(params, None), rtol=RTOL)
    # Monotone in n and below the limit.
    assert blt.sensitivity_squared(params, 50) <= blt.sensitivity_squared(params, None) * (1 + 1e-14)


@pytest.mark.parametrize(
    "params",
    [P([0.9], [0.6]), P([0.99, 0.5, 0.1], [0.1, 0.3, 0.2]), P([0.0, 0.95], [0.4, 0.4])],
)
def test_sensitivity_squared_limit_equals_huge_finite_n_when_decays_are_far_from_1(params):
    # theta_max^(2 * 10^5) underflows to 0 for theta_max <= 0.99: the finite sum is the limit.
    np.testing.assert_allclose(
        blt.sensitivity_squared(params, None), blt.sensitivity_squared(params, 100_000), rtol=1e-14
    )


def test_sensitivity_squared_identity_and_two_banded_by_hand():
    assert blt.sensitivity_squared(P([0.5], [0.0]), 7) == pytest.approx(1.0, rel=1e-15)
    assert blt.sensitivity_squared(P([0.0], [0.4]), 1) == pytest.approx(1.0, rel=1e-15)
    assert blt.sensitivity_squared(P([0.0], [0.4]), 9) == pytest.approx(1.16, rel=1e-15)
    assert blt.sensitivity_squared(P([0.0], [0.4]), None) == pytest.approx(1.16, rel=1e-15)
    # theta = 1: c_k = omega for k >= 1, so sens^2 = 1 + (n - 1) omega^2.
    assert blt.sensitivity_squared(P([1.0], [0.3]), 11) == pytest.approx(1.9, rel=1e-14)


# ---------------------------------------------------------------------------------------------
# min-sep sensitivity


@settings(max_examples=25)  # each example makes ~60 library calls
@given(valid_params(), st.integers(1, 11))
def test_minsep_sensitivity_matches_brute_force_for_every_b_and_k(params, n):
    table = dense.PatternTable(_dense_c(params, n))
    for b in range(1, n + 1):
        cap = -(-n // b)
        for k in [None, *range(1, cap + 2)]:
            got = blt.minsep_sensitivity_squared(params, Participation(n, b, k))
            np.testing.assert_allclose(got, table.sensitivity_squared(b, k), rtol=RTOL, err_msg=f"n={n} b={b} k={k}")


@given(valid_params(), st.integers(12, 200), st.data())
def test_minsep_sensitivity_matches_worst_pattern_and_toeplitz_algorithm(params, n, data):
    b = data.draw(st.integers(1, n))
    k = data.draw(st.one_of(st.none(), st.integers(1, n)))
    c = dense.blt_coefs(params.theta, params.omega, n)
    u = dense.minsep_worst_pattern_rows(c, b, dense.effective_participations(n, b, k))
    got = blt.minsep_sensitivity_squared(params, Participation(n, b, k))
    np.testing.assert_allclose(got, math.fsum(u * u), rtol=RTOL)
    np.testing.assert_allclose(got, toeplitz.minsep_sensitivity_squared(c, b, k), rtol=RTOL)


@given(valid_params(), st.integers(1, 60))
def test_minsep_with_one_participation_is_single_participation(params, n):
    for b in (1, n):
        np.testing.assert_allclose(
            blt.minsep_sensitivity_squared(params, Participation(n, b, 1)), blt.sensitivity_squared(params, n), rtol=RTOL
        )


@pytest.mark.parametrize("n", [1, 5, 12])
def test_minsep_identity_blt_is_k_prime(n):
    params = P([0.7], [0.0])  # omega = 0: C = I
    for b in range(1, n + 1):
        for k in [None, *range(1, n + 1)]:
            kp = min(k if k is not None else n, -(-n // b))
            assert blt.minsep_sensitivity_squared(params, Participation(n, b, k)) == pytest.approx(kp, rel=1e-14)


@pytest.mark.parametrize("omega", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n", [1, 2, 7, 12])
def test_minsep_theta0_is_two_banded_hand_formula(n, omega):
    # theta = 0 gives C = I + omega * subdiagonal; see test_toeplitz.py for the derivation.
    params = P([0.0], [omega])
    for b in range(1, n + 1):
        for k in [None, *range(1, n + 1)]:
            kp = min(k if k is not None else n, -(-n // b))
            want = kp * (1 + omega**2) + (2 * omega * (kp - 1) if b == 1 else 0.0)
            want -= omega**2 if (kp - 1) * b == n - 1 else 0.0
            got = blt.minsep_sensitivity_squared(params, Participation(n, b, k))
            assert got == pytest.approx(want, rel=1e-13, abs=1e-13), (b, k)


# ---------------------------------------------------------------------------------------------
# preconditions


@pytest.mark.parametrize(
    "theta, omega",
    [
        ([1.0 + 1e-12], [0.5]),
        ([1.5, 0.5], [0.2, 0.2]),
        ([-1e-300], [0.5]),
        ([-0.5, 0.5], [0.2, 0.2]),
        ([0.5], [-1e-12]),
        ([0.9, 0.5], [0.7, -0.1]),
        ([0.9, 0.5], [0.5, 0.5 + 1e-12]),
        ([0.9, 0.5, 0.1], [0.4, 0.4, 0.4]),
    ],
    ids=["theta>1", "theta=1.5", "theta=-tiny", "theta<0", "omega=-tiny", "omega<0", "sum(omega)=1+", "sum(omega)=1.2"],
)
def test_parameters_outside_preconditions_raise(theta, omega):
    params = P(theta, omega)
    with pytest.raises(ValueError):
        blt.check_minsep_preconditions(params)
    with pytest.raises(ValueError):
        blt.minsep_sensitivity_squared(params, Participation(10, 2, 3))
    with pytest.raises(ValueError):
        blt.minsep_sensitivity_squared(params, Participation(10, 1, 1))


@pytest.mark.parametrize(
    "theta, omega",
    [([float("nan")], [0.5]), ([0.5], [float("nan")]), ([0.5], [float("inf")]), ([float("-inf")], [0.5])],
)
def test_non_finite_parameters_raise(theta, omega):
    # Rejected when the parameters are built or, at the latest, by the precondition check.
    with pytest.raises(ValueError):
        blt.check_minsep_preconditions(P(theta, omega))


@pytest.mark.parametrize(
    "theta, omega",
    [([0.0], [0.0]), ([1.0], [1.0]), ([0.0, 1.0], [0.5, 0.5]), ([0.5, 0.5], [0.25, 0.75]), ([0.9], [0.3])],
)
def test_boundary_of_preconditions_is_accepted(theta, omega):
    blt.check_minsep_preconditions(P(theta, omega))


# ---------------------------------------------------------------------------------------------
# errors


@given(separated_params(), st.integers(1, 40), st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
def test_max_and_mean_error_match_dense(params, n, momentum):
    e = dense.per_query_errors(_dense_c(params, n), momentum)
    np.testing.assert_allclose(blt.max_error(params, n, momentum=momentum), np.max(e), rtol=RTOL)
    np.testing.assert_allclose(blt.mean_error(params, n, momentum=momentum), np.mean(e), rtol=RTOL)


@given(separated_params(), st.integers(1, 40), st.data())
def test_per_query_errors_match_dense_with_momentum_and_schedule(params, n, data):
    momentum = data.draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
    schedule = data.draw(st.one_of(st.none(), st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n).map(np.asarray)))
    want = dense.per_query_errors(_dense_c(params, n), momentum, schedule)
    got = blt.per_query_errors(params, n, momentum=momentum, lr_schedule=schedule)
    assert got.shape == (n,)
    np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.parametrize("n", [1, 2, 17, 1000])
def test_errors_of_identity_blt(n):
    params = P([0.6], [0.0])  # C = I: e_t = t + 1
    assert blt.max_error(params, n) == pytest.approx(n, rel=1e-13)
    assert blt.mean_error(params, n) == pytest.approx((n + 1) / 2, rel=1e-13)
    np.testing.assert_allclose(blt.per_query_errors(params, n), np.arange(1, n + 1), rtol=1e-13)


# ---------------------------------------------------------------------------------------------
# docs/math.md sec. 1: the seed page's convention vs ours


def _seed_finite(params, n):
    """Seed page: S^2 = 1 + sum_ij w_i w_j G(theta_i theta_j, n - 1), G(rho, m) = sum_{k=1..m} rho^k."""
    w = params.omega / params.theta
    total = 1.0
    for i in range(len(w)):
        for j in range(len(w)):
            rho = params.theta[i] * params.theta[j]
            total += w[i] * w[j] * math.fsum(rho**k for k in range(1, n))
    return total


def _seed_infinite(params):
    """Seed page: S^2 = 1 + sum_ij w_i w_j / (1 - theta_i theta_j)."""
    w = params.omega / params.theta
    th = params.theta
    return 1.0 + float(np.sum(np.outer(w, w) / (1.0 - np.outer(th, th))))


@pytest.mark.parametrize(
    "params", [P([0.9], [0.6]), P([0.99, 0.5, 0.1], [0.1, 0.3, 0.02]), P([0.7, 0.95], [0.05, 0.4])]
)
@pytest.mark.parametrize("n", [1, 2, 3, 50, 400])
def test_seed_finite_formula_with_w_equals_omega_over_theta_is_our_sensitivity(params, n):
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), _seed_finite(params, n), rtol=1e-12)


@pytest.mark.parametrize(
    "params", [P([0.9], [0.6]), P([0.99, 0.5, 0.1], [0.1, 0.3, 0.02]), P([0.7, 0.95], [0.05, 0.4])]
)
def test_seed_infinite_formula_overstates_our_limit_by_sum_w_squared(params):
    # w_i w_j (1 - theta_i theta_j) / (1 - theta_i theta_j) summed over i, j = (sum w)^2.
    ours = blt.sensitivity_squared(params, None)
    w = params.omega / params.theta
    np.testing.assert_allclose(_seed_infinite(params) - ours, np.sum(w) ** 2, rtol=1e-12)
    assert _seed_infinite(params) > ours


# ---------------------------------------------------------------------------------------------
# docs/math.md sec. 5: optimal Toeplitz reference values and the lower bound they give


OPTIMAL_TOEPLITZ_TABLE = {  # docs/math.md sec. 5, sqrt(max loss) rounded to 6 decimals
    100: 2.531352, 1000: 3.265003, 2000: 3.485678, 10_000: 3.998010,
    100_000: 4.730953, 1_000_000: 5.463889, 10_000_000: 6.196825,
}


def test_optimal_toeplitz_table():
    # One pass to 10^7: s_k = s_{k-1} (2k - 1) / (2k) (cumulative product), then running sums of
    # s_k^2. Sequential float64 sums of 10^7 positive terms are good to ~1e-9 relative, far
    # below the table's rounding (5e-7).
    n_max = max(OPTIMAL_TOEPLITZ_TABLE)
    k = np.arange(1, n_max, dtype=np.float64)
    s = np.concatenate(([1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))))
    prefix = np.cumsum(s * s)
    for n, table in OPTIMAL_TOEPLITZ_TABLE.items():
        assert abs(prefix[n - 1] - table) <= 5e-7 + 1e-12, (n, prefix[n - 1], table)
        if n <= 10_000:  # and the helper used by the bound tests agrees
            assert abs(optimal_toeplitz(n) - prefix[n - 1]) <= 1e-12


def test_optimal_toeplitz_small_n_by_hand():
    # n = 2: c = (1, 1/2), so sum c^2 = 5/4; the loss of a 2x2 Toeplitz C = (1, a) is
    # (1 + a^2)(1 + (1 - a)^2), minimized at a = 1/2: 25/16 = (5/4)^2.
    assert optimal_toeplitz(2) == 1.25
    assert optimal_toeplitz(3) == 1.25 + 9 / 64


@given(separated_params(), st.integers(1, 40))
def test_no_blt_beats_the_optimal_toeplitz_max_loss(params, n):
    bound = optimal_toeplitz(n) ** 2
    # The oracle itself confirms the bound (validates the claim on these inputs) ...
    cmat = _dense_c(params, n)
    dense_loss = dense.single_participation_sensitivity_squared(cmat) * np.max(dense.per_query_errors(cmat))
    assert dense_loss >= bound * (1 - 1e-12)
    # ... and the library's closed forms must respect it too.
    loss = blt.sensitivity_squared(params, n) * blt.max_error(params, n)
    assert loss >= bound * (1 - 1e-12)


@pytest.mark.parametrize("n", [100, 1000, 2000, 10_000])
@pytest.mark.parametrize("name", ["one-buffer", "realistic-3", "realistic-5-to-1e-11", "near1-1e-11-mixed"])
def test_no_blt_beats_the_optimal_toeplitz_max_loss_at_table_n(name, n):
    params = HARD[name]
    loss = blt.sensitivity_squared(params, n) * blt.max_error(params, n)
    assert loss >= optimal_toeplitz(n) ** 2 * (1 - 1e-12)


# ---------------------------------------------------------------------------------------------
# round_for_float32


def _assert_float32_ready(rounded, original):
    one_minus = 1.0 - rounded.theta
    assert np.all(np.float32(rounded.omega).astype(np.float64) == rounded.omega)
    assert np.all(np.float32(one_minus).astype(np.float64) == one_minus)
    np.testing.assert_array_equal(rounded.one_minus_theta, one_minus)
    blt.check_minsep_preconditions(rounded)
    # Close, buffer by buffer: float32 has a 24-bit significand, so one rounding moves a value
    # by <= 2^-24 relative (2^-23 allowing a directed rounding that keeps the preconditions),
    # or by <= 2^-149 (the smallest float32 subnormal) for values that underflow. The order of
    # the buffers carries no meaning: compare them sorted by (1 - theta, omega). An
    # implementation may merge buffers whose decays round to the same float32 value.
    if rounded.num_buffers == original.num_buffers:
        got = sorted(zip(one_minus.tolist(), rounded.omega.tolist()))
        want = sorted(zip((1.0 - original.theta).tolist(), original.omega.tolist()))
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2.0**-23, atol=2.0**-149)
    else:
        assert rounded.num_buffers < original.num_buffers
    # Close as a matrix: |c'_k - c_k| <= sum_i |d omega_i| theta_i^(k-1) + omega_i |d theta_i^(k-1)|
    # <= 2^-23 sum(omega) + max_k (k-1) theta^(k-2) 2^-23 (1 - theta) <= 2^-22, for every k.
    n = 300
    np.testing.assert_allclose(
        dense.blt_coefs(rounded.theta, rounded.omega, n),
        dense.blt_coefs(original.theta, original.omega, n),
        rtol=0,
        atol=2.0**-21,
    )


@given(valid_params())
def test_round_for_float32(params):
    _assert_float32_ready(blt.round_for_float32(params), params)


@pytest.mark.parametrize("name", HARD_IDS)
def test_round_for_float32_hard_cases(name):
    params = HARD[name]
    rounded = blt.round_for_float32(params)
    _assert_float32_ready(rounded, params)
    # Idempotent.
    again = blt.round_for_float32(rounded)
    np.testing.assert_array_equal(again.theta, rounded.theta)
    np.testing.assert_array_equal(again.omega, rounded.omega)


# ---------------------------------------------------------------------------------------------
# The table of numerically hard cases


@pytest.mark.parametrize("n", [2, 5, 64])
@pytest.mark.parametrize("name", HARD_IDS + list(HAS_THETA_ONE))
def test_hard_cases_against_dense(name, n):
    params = {**HARD, **HAS_THETA_ONE}[name]
    c = dense.blt_coefs(params.theta, params.omega, n)
    cmat = dense.lower_toeplitz(c)
    np.testing.assert_allclose(blt.coefficients(params, n), c, rtol=RTOL, atol=0)
    chat = dense.inverse_matrix(cmat)[:, 0]
    np.testing.assert_allclose(blt.inverse_coefficients(params, n), chat, rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), dense.single_participation_sensitivity_squared(cmat), rtol=RTOL)
    for momentum in (1.0, 0.9):
        e = dense.per_query_errors(cmat, momentum)
        np.testing.assert_allclose(blt.max_error(params, n, momentum=momentum), np.max(e), rtol=RTOL)
        np.testing.assert_allclose(blt.mean_error(params, n, momentum=momentum), np.mean(e), rtol=RTOL)
    schedule = np.linspace(1.0, 0.05, n)
    np.testing.assert_allclose(
        blt.per_query_errors(params, n, momentum=0.9, lr_schedule=schedule),
        dense.per_query_errors(cmat, 0.9, schedule),
        rtol=RTOL,
    )
    small = min(n, 12)
    table = dense.PatternTable(_dense_c(params, small))
    for b, k in [(1, None), (1, 3), (2, None), (3, 2), (5, None), (12, None)]:
        if b > small:
            continue
        np.testing.assert_allclose(
            blt.minsep_sensitivity_squared(params, Participation(small, b, k)), table.sensitivity_squared(b, k), rtol=RTOL
        )


@pytest.mark.parametrize("name", HARD_IDS)
def test_hard_cases_inverse_params(name):
    params = HARD[name]
    n = 64
    inv = blt.inverse(params)
    chat = dense.inverse_matrix(_dense_c(params, n))[:, 0]
    np.testing.assert_allclose(dense.blt_coefs(inv.theta, inv.omega, n), chat, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("n", [100_000, 1_000_000])
@pytest.mark.parametrize("name", HARD_IDS + list(HAS_THETA_ONE))
def test_hard_cases_sensitivity_long_horizon_direct_sum(name, n):
    params = {**HARD, **HAS_THETA_ONE}[name]
    c = dense.blt_coefs(params.theta, params.omega, n)
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), sum_of_squares(c), rtol=RTOL)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 64, 1000, 100_000, 1_000_000, 10_000_000, None])
@pytest.mark.parametrize("name", HARD_IDS)
def test_hard_cases_sensitivity_exact_closed_form(name, n):
    # Small n matter as much as large: with m (1 - r) tiny, 1 - r**m cancels to a few digits.
    params = HARD[name]
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), mp_sensitivity_squared(params, n), rtol=RTOL)


@pytest.mark.parametrize("name", ["realistic-5-to-1e-11", "near1-1e-11-large-omega"])
def test_sensitivity_at_ten_million_steps_direct_sum(name):
    params = HARD[name]
    n = 10_000_000
    c = dense.blt_coefs(params.theta, params.omega, n)
    np.testing.assert_allclose(blt.sensitivity_squared(params, n), sum_of_squares(c), rtol=RTOL)


@pytest.mark.parametrize("n, b, k", [(100_000, 1000, None), (100_000, 7, 20), (1_000_000, 100_000, 3)])
@pytest.mark.parametrize("name", HARD_IDS + list(HAS_THETA_ONE))
def test_hard_cases_minsep_long_horizon(name, n, b, k):
    params = {**HARD, **HAS_THETA_ONE}[name]
    c = dense.blt_coefs(params.theta, params.omega, n)
    u = dense.minsep_worst_pattern_rows(c, b, dense.effective_participations(n, b, k))
    np.testing.assert_allclose(blt.minsep_sensitivity_squared(params, Participation(n, b, k)), sum_of_squares(u), rtol=RTOL)


@pytest.mark.parametrize("name", HARD_IDS + list(HAS_THETA_ONE))
def test_hard_cases_errors_long_horizon(name):
    # O(n B) streaming inverse (no inverse parameters), then cumulative sums: e_t = sum_{k<=t} b_k^2.
    params = {**HARD, **HAS_THETA_ONE}[name]
    n = 20_000
    chat = dense.blt_inverse_coefs_streaming(params.theta, params.omega, n)
    np.testing.assert_allclose(blt.inverse_coefficients(params, n), chat, rtol=RTOL, atol=1e-12)
    e = dense.toeplitz_per_query_errors_long(chat)
    np.testing.assert_allclose(blt.max_error(params, n), np.max(e), rtol=RTOL)
    np.testing.assert_allclose(blt.mean_error(params, n), math.fsum(e.tolist()) / n, rtol=RTOL)
    schedule = 1.0 / np.sqrt(1.0 + np.arange(n) / 100.0)
    np.testing.assert_allclose(
        blt.per_query_errors(params, n, momentum=0.95, lr_schedule=schedule),
        dense.toeplitz_per_query_errors_long(chat, 0.95, schedule),
        rtol=RTOL,
    )
