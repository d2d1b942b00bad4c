"""The analytic Gaussian mechanism (BW18 Thm 8) against independent references.

References: a 60-digit mpmath evaluation of the Balle-Wang formula written here (delta
directly, epsilon by mpmath bisection), dp_accounting's exact ``get_epsilon_gaussian`` (an
independent implementation), and dp_accounting's PLD accountant (pessimistic discretization).
"""

import math

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
