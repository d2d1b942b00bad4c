"""The analytic Gaussian mechanism (BW18 Thm 8) against independent references.

References: a 60-digit mpmath evaluation of the Balle-Wang formula written here (delta
directly, epsilon by mpmath bisection), dp_accounting's exact ``get_epsilon_gaussian`` (an
independent implementation), and dp_accounting's PLD accountant (pessimistic discretization).
"""

import math
import sys

import dp_accounting
import mpmath
import pytest
from dp_accounting.pld import privacy_loss_distribution
from hypothesis import given
from hypothesis import strategies as st

import opake.accounting as acc

SIGMAS = [0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
DELTAS = [1e-10, 1e-8, 1e-5, 1e-3]
EPSILONS = [0.0, 0.05, 0.5, 1.0, 3.0, 8.0, 20.0, 40.0]

mpmath.mp.dps = 60


def reference_delta(sigma, epsilon) -> mpmath.mpf:
    """delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), mu = 1/sigma, in 60 digits."""
    mu = 1 / mpmath.mpf(sigma)
    eps = mpmath.mpf(epsilon)
    return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)


def reference_epsilon(sigma, delta) -> float:
    """Root of delta(eps) = delta by bisection in mpmath (delta(eps) is decreasing)."""
    target = mpmath.mpf(delta)
    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    while reference_delta(sigma, hi) > target:
        lo, hi = hi, 2 * hi
    for _ in range(90):
        mid = (lo + hi) / 2
        if reference_delta(sigma, mid) > target:
            lo = mid
        else:
            hi = mid
    return float(hi)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_delta_matches_mpmath_to_1e_9(sigma):
    for epsilon in EPSILONS:
        expected = float(reference_delta(sigma, epsilon))
        if expected < 1e-300:
            continue
        got = acc.gaussian(sigma).delta_at(epsilon)
        assert got == pytest.approx(expected, rel=1e-9, abs=0), (sigma, epsilon)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_epsilon_matches_mpmath_and_dp_accounting_to_1e_9(sigma):
    for delta in DELTAS:
        expected = reference_epsilon(sigma, delta)
        got = acc.gaussian(sigma).epsilon_at(delta)
        assert got == pytest.approx(expected, rel=1e-9, abs=0), (sigma, delta)
        assert got == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma, delta), rel=1e-9, abs=0)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_round_trip_both_directions(sigma):
    process = acc.gaussian(sigma)
    for delta in DELTAS:
        epsilon = process.epsilon_at(delta)
        back = process.delta_at(epsilon)
        assert back <= delta  # epsilon_at rounds toward weaker privacy
        assert back == pytest.approx(delta, rel=1e-9)
    for epsilon in [0.1, 1.0, 4.0]:
        delta = process.delta_at(epsilon)
        if 1e-300 < delta < 1:
            assert process.epsilon_at(delta) == pytest.approx(epsilon, rel=1e-9)


@pytest.mark.parametrize("sigma, expected", [(1.0, 4.377178), (2.0, 1.993091), (5.0, 0.725522)])
def test_check_values_of_math_md(sigma, expected):
    assert acc.gaussian(sigma).epsilon_at(1e-5) == pytest.approx(expected, abs=5e-7)


@pytest.mark.parametrize("sigma", [1.0, 3.0, 30.0])
def test_pld_accountant_is_a_pessimistic_close_upper_estimate(sigma):
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, sensitivity=1.0, value_discretization_interval=1e-3
    )
    for delta in [1e-8, 1e-5]:
        exact = acc.gaussian(sigma).epsilon_at(delta)
        pld_epsilon = pld.get_epsilon_for_delta(delta)
        assert exact <= pld_epsilon + 1e-12
        assert pld_epsilon == pytest.approx(exact, rel=1e-3)


def test_large_noise_gives_epsilon_zero_when_delta_at_zero_is_met():
    process = acc.gaussian(1000.0)
    delta_at_zero = float(reference_delta(1000.0, 0.0))  # about 4e-4
    assert process.epsilon_at(delta_at_zero * 1.01) == 0.0
    assert process.epsilon_at(delta_at_zero * 0.99) > 0.0


@given(
    sigma=st.floats(min_value=0.3, max_value=30.0),
    log10_delta=st.floats(min_value=-10.0, max_value=-3.0),
)
def test_epsilon_is_decreasing_in_sigma_and_delta(sigma, log10_delta):
    delta = 10.0**log10_delta
    epsilon = acc.gaussian(sigma).epsilon_at(delta)
    assert acc.gaussian(sigma * 1.01).epsilon_at(delta) < epsilon
    assert acc.gaussian(sigma).epsilon_at(delta * 1.5) < epsilon
    assert acc.gaussian(sigma).delta_at(epsilon) <= delta


def test_gaussian_is_a_privacy_process_and_a_guarantee():
    process = acc.gaussian(2.0)
    assert isinstance(process, acc.PrivacyProcess)
    assert process.is_guarantee is True
    assert "exact" in process.description


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 1.5, math.nan, math.inf])
def test_delta_outside_open_unit_interval_is_refused(delta):
    with pytest.raises(ValueError, match=r"delta must be in the open interval \(0, 1\)"):
        acc.gaussian(1.0).epsilon_at(delta)


@pytest.mark.parametrize("epsilon", [-0.1, math.inf, math.nan])
def test_bad_epsilon_is_refused(epsilon):
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0"):
        acc.gaussian(1.0).delta_at(epsilon)


@pytest.mark.parametrize("sigma", [0.0, -1.0, math.inf, math.nan])
def test_bad_noise_multiplier_is_refused(sigma):
    with pytest.raises(ValueError, match="noise_multiplier must be finite and > 0.*calibrate"):
        acc.gaussian(sigma)


@pytest.mark.parametrize("value", ["1e-5", None, True])
def test_non_numbers_are_type_errors(value):
    with pytest.raises(TypeError, match="delta must be a real number"):
        acc.gaussian(1.0).epsilon_at(value)


# ---------------------------------------------------------------------------------------------
# Extreme noise multipliers: the reference at 60 + 2 log10(1/sigma) digits

TINY_FINITE_SIGMAS = [1e-4, 1e-8, 1e-30, 1e-100, 1e-150, 1e-154, 6e-155]  # root ~ 1/(2 sigma^2) <= 1.4e308
TINY_OVERFLOW_SIGMAS = [5e-155, 1e-155, 1e-200, 1e-300, 5e-324]  # 1/(2 sigma^2) >= 2e308: beyond the floats


def _normal_cdf_wide(x: mpmath.mpf) -> mpmath.mpf:
    """Phi(x) through the upper incomplete gamma function (mpmath's ncdf overflows beyond 1e154):
    Phi(x) = Gamma(1/2, x^2/2) / (2 sqrt(pi)) for x <= 0."""
    tail = mpmath.gammainc(mpmath.mpf(1) / 2, x * x / 2) / (2 * mpmath.sqrt(mpmath.pi))
    return tail if x <= 0 else 1 - tail


def _digits_for(sigma) -> int:
    """Enough digits for a = mu/2 - eps/mu (cancels mu/2 ~ 1/sigma) and for e^eps Phi(b),
    whose exponents eps ~ b^2/2 ~ 1/(2 sigma^2) must cancel to an absolute error well below 1."""
    return 60 + 2 * max(0, int(-math.log10(sigma)))


def _reference_delta_wide(sigma, epsilon) -> mpmath.mpf:
    """The Balle-Wang delta(eps), valid for mu up to the float range and beyond."""
    with mpmath.workdps(_digits_for(sigma)):
        mu = 1 / mpmath.mpf(sigma)
        eps = mpmath.mpf(epsilon)
        return _normal_cdf_wide(mu / 2 - eps / mu) - mpmath.exp(eps) * _normal_cdf_wide(-mu / 2 - eps / mu)


def _reference_epsilon_bracket(sigma, delta) -> tuple[mpmath.mpf, mpmath.mpf]:
    """(lo, hi) with delta(lo) > delta >= delta(hi) and hi - lo <= 2^-80 hi, by bisection.

    For delta <= 1/2 the root lies within 40 mu of mu^2/2 (there a = mu/2 - eps/mu is +-40)."""
    with mpmath.workdps(_digits_for(sigma)):
        target = mpmath.mpf(delta)
        mu = 1 / mpmath.mpf(sigma)
        lo, hi = mu * mu / 2 - 40 * mu, mu * mu / 2 + 40 * mu
        assert _reference_delta_wide(sigma, hi) <= target < _reference_delta_wide(sigma, lo)
        for _ in range(200):
            if hi - lo <= hi * mpmath.mpf(2) ** -80:
                break
            mid = (lo + hi) / 2
            if _reference_delta_wide(sigma, mid) > target:
                lo = mid
            else:
                hi = mid
        return lo, hi


@pytest.mark.parametrize("sigma", TINY_FINITE_SIGMAS)
def test_tiny_noise_multiplier_gives_the_huge_epsilon_rounded_up(sigma):
    for delta in [1e-12, 1e-5, 0.5]:
        got = acc.gaussian(sigma).epsilon_at(delta)
        below_root, above_root = _reference_epsilon_bracket(sigma, delta)
        assert math.isfinite(got)
        assert got > below_root  # never below the true epsilon
        assert _reference_delta_wide(sigma, got) <= delta  # so got certifies delta
        assert got <= above_root * (1 + 1e-14), (sigma, delta, got, float(above_root))


@pytest.mark.parametrize("sigma", TINY_OVERFLOW_SIGMAS)
def test_noise_multiplier_whose_epsilon_exceeds_every_float_gives_infinity(sigma):
    # the reference says: even at the largest float epsilon, delta(eps) is far above any target
    assert _reference_delta_wide(sigma, sys.float_info.max) > mpmath.mpf("0.99")
    for delta in [1e-12, 1e-5, 0.5]:
        assert acc.gaussian(sigma).epsilon_at(delta) == math.inf


@pytest.mark.parametrize("sigma", TINY_FINITE_SIGMAS + TINY_OVERFLOW_SIGMAS)
def test_delta_at_tiny_noise_multiplier_matches_the_wide_reference(sigma):
    half_mu_squared = 0.5 / sigma / sigma
    epsilons = [0.0, 1.0, 1e300, sys.float_info.max]
    if math.isfinite(half_mu_squared):  # around the root, where a = mu/2 - eps/mu cancels
        epsilons += [half_mu_squared * (1 - 1e-15), half_mu_squared, half_mu_squared * (1 + 1e-15)]
    for epsilon in epsilons:
        expected = float(_reference_delta_wide(sigma, epsilon))
        got = acc.gaussian(sigma).delta_at(epsilon)
        if expected < 1e-300:
            assert got < 1e-290, (sigma, epsilon, got)
        else:
            assert got == pytest.approx(expected, rel=1e-9, abs=0), (sigma, epsilon)


def test_calibrate_over_a_range_reaching_tiny_multipliers_does_not_fail():
    result = acc.calibrate(acc.epsilon_budget(1.0, 1e-5), acc.gaussian, 1e-300, 100.0)
    assert result.param == pytest.approx(reference_sigma_for(1.0, 1e-5), rel=1e-5)


def reference_sigma_for(epsilon, delta) -> float:
    """Smallest sigma with reference delta(eps) <= delta, by bisection in mpmath."""
    lo, hi = mpmath.mpf("0.1"), mpmath.mpf(100)
    for _ in range(60):
        mid = (lo + hi) / 2
        if reference_delta(mid, epsilon) > delta:
            lo = mid
        else:
            hi = mid
    return float(hi)
