"""opake.dpftrl.strategies.toeplitz against the dense / brute-force oracles of tests/dense.py.

Tolerances: the oracles are float64 dense solves and sums over at most a few thousand terms of
O(1) size, exact to ~1e-14 relative for these well-conditioned unit-lower-triangular matrices;
the structured algorithms do the same arithmetic in another order. 1e-10 relative (with an
absolute floor of 1e-12 times the largest entry where entries can cancel to ~0) leaves a wide
margin for rounding while still catching any wrong index, shift or off-by-one.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dense
from opake.dpftrl.strategies import toeplitz

RTOL = 1e-10


@st.composite
def nonincreasing_coefs(draw, min_n=1, max_n=40):
    """Non-negative non-increasing first columns, c_0 > 0; sometimes banded (trailing zeros)."""
    n = draw(st.integers(min_n, max_n))
    values = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    c = np.sort(np.asarray(values, dtype=np.float64))[::-1].copy()
    c[0] = 1.0
    if draw(st.booleans()):  # BandMF-like: only the first `bands` lags are non-zero
        bands = draw(st.integers(1, n))
        c[bands:] = 0.0
    scale = draw(st.sampled_from([1.0, 0.25, 3.0]))
    return c * scale


@st.composite
def schedules(draw, n):
    kind = draw(st.sampled_from(["none", "random", "decay"]))
    if kind == "none":
        return None
    if kind == "decay":
        return np.linspace(1.0, 0.05, n)
    return np.asarray(draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n)))


# ---------------------------------------------------------------------------------------------
# inverse_coefficients


@given(nonincreasing_coefs())
def test_inverse_coefficients_match_dense_inverse(c):
    got = toeplitz.inverse_coefficients(c)
    cmat = dense.lower_toeplitz(c)
    want = dense.inverse_matrix(cmat)[:, 0]
    assert got.dtype == np.float64 and got.shape == c.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-12 * np.max(np.abs(want)))
    # Invariance C C^{-1} = I with the returned coefficients as the Toeplitz inverse.
    np.testing.assert_allclose(cmat @ dense.lower_toeplitz(got), np.eye(len(c)), rtol=0, atol=1e-11)


@pytest.mark.parametrize(
    "c, want",
    [
        ([1.0], [1.0]),
        ([2.0], [0.5]),
        ([1.0, 0.5, 0.0, 0.0, 0.0], [1.0, -0.5, 0.25, -0.125, 0.0625]),  # 1 / (1 + x/2)
        ([1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 0.0]),  # 1 / (1 + x + x^2 + x^3) = (1 - x) / (1 - x^4)
        ([1.0, 0.5, 0.25, 0.125], [1.0, -0.5, 0.0, 0.0]),  # 1 / (1 - x/2)
    ],
)
def test_inverse_coefficients_hand_cases(c, want):
    np.testing.assert_allclose(toeplitz.inverse_coefficients(np.array(c)), want, rtol=0, atol=1e-15)


@given(nonincreasing_coefs(max_n=60), st.sampled_from([1, 2, 5, 60]))
def test_filter_and_substitution_inverses_match_the_dense_inverse_and_each_other(c, support):
    # both fast paths of inverse_coefficients, on any band (support <= n) and on the full column
    c = c.copy()
    c[support:] = 0.0
    want = dense.inverse_matrix(dense.lower_toeplitz(c))[:, 0]
    width = int(np.flatnonzero(c)[-1]) + 1
    by_filter = toeplitz._inverse_by_filter(c[:width], len(c))
    by_loop = toeplitz._inverse_by_substitution(c, width)
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(by_filter, want, rtol=1e-12, atol=1e-13 * scale)
    np.testing.assert_allclose(by_loop, want, rtol=1e-12, atol=1e-13 * scale)
    np.testing.assert_allclose(by_filter, by_loop, rtol=1e-12, atol=1e-14 * scale)


@pytest.mark.parametrize("bands", [2, 8, 64, 1024])
def test_long_banded_inverse_by_the_filter_matches_the_substitution_loop(bands):
    # n = 20000 (the dense inverse does not fit): an optimizer-like band (non-negative,
    # non-increasing, near flat: its inverse oscillates for thousands of terms) against the loop
    n = 20000
    k = np.arange(1, bands, dtype=np.float64)
    c = np.zeros(n)
    c[:bands] = np.concatenate(([1.0], 1.0 - 0.3 * np.sqrt(k / bands)))
    got = toeplitz.inverse_coefficients(c)
    want = toeplitz._inverse_by_substitution(c, bands)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14 * np.max(np.abs(want)))
    # and C c_hat = e_0 to rounding, over the whole horizon (C applied by a convolution)
    residual = np.convolve(c[:bands], got)[:n]
    residual[0] -= 1.0
    assert np.max(np.abs(residual)) < 1e-12 * np.max(np.abs(got)) * bands


def test_wide_columns_go_through_the_substitution_loop(monkeypatch):
    # beyond _FILTER_MAX_SUPPORT the loop runs (the filter is never called), and both agree
    c = np.concatenate(([1.0], 0.5 ** np.arange(1, 40)))
    want = dense.inverse_matrix(dense.lower_toeplitz(c))[:, 0]
    monkeypatch.setattr(toeplitz, "_FILTER_MAX_SUPPORT", 10)
    monkeypatch.setattr(toeplitz, "_inverse_by_filter", None)  # calling it would raise TypeError
    np.testing.assert_allclose(toeplitz.inverse_coefficients(c), want, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# minsep_sensitivity_squared


@given(nonincreasing_coefs(max_n=11))
def test_minsep_sensitivity_matches_brute_force_for_every_b_and_k(c):
    n = len(c)
    table = dense.PatternTable(dense.lower_toeplitz(c))
    for b in range(1, n + 1):
        cap = -(-n // b)
        for k in [None, *range(1, cap + 2)]:
            got = toeplitz.minsep_sensitivity_squared(c, b, k)
            want = table.sensitivity_squared(b, k)
            np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"n={n} min_sep={b} k={k}")


@given(nonincreasing_coefs(min_n=12, max_n=200), st.data())
def test_minsep_sensitivity_matches_worst_pattern_rows_up_to_n_200(c, data):
    n = len(c)
    b = data.draw(st.integers(1, n))
    k = data.draw(st.one_of(st.none(), st.integers(1, n)))
    kp = dense.effective_participations(n, b, k)
    u = dense.minsep_worst_pattern_rows(c, b, kp)
    np.testing.assert_allclose(toeplitz.minsep_sensitivity_squared(c, b, k), math.fsum(u * u), rtol=RTOL)


def test_minsep_default_max_participations_is_every_allowed_step():
    c = np.array([1.0, 0.6, 0.3, 0.1, 0.05, 0.0, 0.0])
    for b in range(1, 8):
        assert toeplitz.minsep_sensitivity_squared(c, b) == toeplitz.minsep_sensitivity_squared(c, b, None)
        assert toeplitz.minsep_sensitivity_squared(c, b) == toeplitz.minsep_sensitivity_squared(c, b, 100)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_minsep_identity_is_k_prime(n):
    c = np.zeros(n)
    c[0] = 1.0
    for b in range(1, n + 1):
        for k in [None, *range(1, n + 2)]:
            kp = min(k if k is not None else n, -(-n // b))
            assert toeplitz.minsep_sensitivity_squared(c, b, k) == pytest.approx(kp, rel=1e-15)


@pytest.mark.parametrize("a", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n", [1, 2, 6, 7])
def test_minsep_two_banded_hand_formula(n, a):
    # C = I + a * (sub-diagonal). A participation at t < n-1 contributes 1 + a^2, one at n-1
    # only 1; with b = 1 every adjacent pair adds the cross term 2a. The worst pattern
    # 0, b, .., (k'-1)b lands on n-1 only when (k'-1) b = n-1, and then every k'-pattern does.
    c = np.zeros(n)
    c[0] = 1.0
    if n > 1:
        c[1] = a
    for b in range(1, n + 1):
        for k in [None, *range(1, n + 1)]:
            kp = min(k if k is not None else n, -(-n // b))
            want = kp * (1 + a * a) + (2 * a * (kp - 1) if b == 1 else 0.0) - (a * a if (kp - 1) * b == n - 1 else 0.0)
            assert toeplitz.minsep_sensitivity_squared(c, b, k) == pytest.approx(want, rel=1e-14, abs=1e-14)


@pytest.mark.parametrize(
    "c",
    [
        [1.0, -0.1, 0.0],
        [1.0, 0.5, -1e-300],
        [1.0, 0.5, 0.6],  # increases
        [0.5, 1.0],
        [1.0, 0.0, 0.1],  # zero then positive: not non-increasing
        [1.0, float("nan"), 0.0],
    ],
)
def test_minsep_rejects_negative_or_increasing_coefficients(c):
    with pytest.raises(ValueError):
        toeplitz.minsep_sensitivity_squared(np.array(c), 1)


# ---------------------------------------------------------------------------------------------
# per_query_errors


@given(nonincreasing_coefs(), st.data())
def test_per_query_errors_match_dense_workload(c, data):
    n = len(c)
    momentum = data.draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
    schedule = data.draw(schedules(n))
    chat = dense.inverse_matrix(dense.lower_toeplitz(c))[:, 0]  # oracle's own inverse
    got = toeplitz.per_query_errors(chat, momentum=momentum, lr_schedule=schedule)
    want = dense.per_query_errors(dense.lower_toeplitz(c), momentum, schedule)
    assert got.shape == (n,)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-12 * np.max(want))


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 0.999])
def test_long_per_query_errors_with_momentum_match_the_written_out_recurrence(momentum):
    # n = 30000 with a sign-changing inverse column: the C filter against dense.py's Python loop
    rng = np.random.default_rng(7)
    chat = rng.standard_normal(30000) * np.exp(-np.arange(30000) / 5000.0)
    eta = 0.01 + 0.5 * (1.0 + np.cos(np.pi * np.arange(30000) / 30000))
    got = toeplitz.per_query_errors(chat, momentum=momentum, lr_schedule=eta)
    want = dense.toeplitz_per_query_errors_long(chat, momentum, eta)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_per_query_errors_defaults_are_prefix_sums():
    # C = I: row t of A is t+1 ones.
    n = 9
    chat = np.zeros(n)
    chat[0] = 1.0
    np.testing.assert_allclose(toeplitz.per_query_errors(chat), np.arange(1, n + 1), rtol=1e-15)
    # C = A (all ones): C^{-1} is the first-difference matrix, A C^{-1} = I.
    np.testing.assert_allclose(
        toeplitz.per_query_errors(np.r_[1.0, -1.0, np.zeros(n - 2)]), np.ones(n), rtol=1e-15
    )


def test_per_query_errors_momentum_and_schedule_hand_case():
    # C = I, W[t, s] = eta_t beta^(t-s): e_t = eta_t^2 sum_{j<=t} beta^(2j).
    n, beta = 6, 0.5
    eta = np.array([1.0, 2.0, 0.5, 1.0, 3.0, 0.1])
    chat = np.r_[1.0, np.zeros(n - 1)]
    want = eta**2 * np.cumsum(beta ** (2 * np.arange(n)))
    np.testing.assert_allclose(toeplitz.per_query_errors(chat, momentum=beta, lr_schedule=eta), want, rtol=1e-14)
