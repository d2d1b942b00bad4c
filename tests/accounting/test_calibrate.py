"""calibrate: hits the budget within its stated tolerance, is monotone, and refuses bad ranges.

Reference: dp_accounting.get_sigma_gaussian (exact Gaussian calibration, independent code),
and the definition itself (param meets the budget, param / (1 + rtol) does not).
"""

import math

import dp_accounting
import pytest
from hypothesis import given
from hypothesis import strategies as st

import opake.accounting as acc
from opake.accounting.calibrate import calibrate_capped


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-3])
def test_gaussian_calibration_matches_dp_accounting_within_tolerance(epsilon, delta):
    budget = acc.epsilon_budget(epsilon, delta)
    result = acc.calibrate(budget, acc.gaussian, 0.01, 1000.0, rtol=1e-7)
    reference = dp_accounting.get_sigma_gaussian(epsilon, delta)
    # the returned param meets the budget and is within rtol above the exact minimum
    assert reference * (1 - 1e-10) <= result.param <= reference * (1 + 1e-7) * (1 + 1e-10)
    assert result.epsilon <= epsilon
    assert result.delta <= delta
    assert result.epsilon == pytest.approx(acc.gaussian(result.param).epsilon_at(delta), rel=0, abs=0)
    assert result.param <= result.param_failing * (1 + result.rtol)
    assert acc.gaussian(result.param_failing).epsilon_at(delta) > epsilon
    assert result.budget == budget
    assert result.process == acc.gaussian(result.param)


@pytest.mark.parametrize("rtol", [1e-3, 1e-6, 1e-10])
def test_returned_param_is_within_rtol_of_the_smallest_meeting_one(rtol):
    budget = acc.epsilon_budget(2.0, 1e-5)
    result = acc.calibrate(budget, acc.gaussian, 0.1, 100.0, rtol=rtol)
    assert acc.gaussian(result.param).epsilon_at(1e-5) <= 2.0
    assert acc.gaussian(result.param / (1 + rtol)).epsilon_at(1e-5) > 2.0
    assert result.param == pytest.approx(dp_accounting.get_sigma_gaussian(2.0, 1e-5), rel=2 * rtol)


@given(
    epsilon=st.floats(min_value=0.2, max_value=20.0),
    log10_delta=st.floats(min_value=-10.0, max_value=-3.0),
)
def test_calibration_is_monotone_in_the_budget(epsilon, log10_delta):
    delta = 10.0**log10_delta
    base = acc.calibrate(acc.epsilon_budget(epsilon, delta), acc.gaussian, 0.01, 1000.0).param
    looser_epsilon = acc.calibrate(acc.epsilon_budget(epsilon * 1.05, delta), acc.gaussian, 0.01, 1000.0).param
    looser_delta = acc.calibrate(acc.epsilon_budget(epsilon, delta * 2), acc.gaussian, 0.01, 1000.0).param
    assert looser_epsilon < base
    assert looser_delta < base


def test_generic_process_factory_with_a_scaled_parameter():
    # A process whose noise multiplier is param / 3 (e.g. sensitivity 3): the answer scales by 3.
    result = acc.calibrate(acc.epsilon_budget(1.0, 1e-6), lambda p: acc.gaussian(p / 3.0), 0.1, 100.0)
    assert result.param == pytest.approx(3 * dp_accounting.get_sigma_gaussian(1.0, 1e-6), rel=2e-6)


def test_unreachable_budget_names_param_max():
    with pytest.raises(acc.CalibrationRangeError, match="unreachable.*param_max=2.0.*raise param_max"):
        acc.calibrate(acc.epsilon_budget(0.1, 1e-5), acc.gaussian, 0.1, 2.0)


def test_budget_already_met_at_param_min_names_param_min():
    with pytest.raises(acc.CalibrationRangeError, match="already met at param_min=5.0.*lower param_min"):
        acc.calibrate(acc.epsilon_budget(10.0, 1e-5), acc.gaussian, 5.0, 50.0)


def test_range_error_is_a_value_error():
    assert issubclass(acc.CalibrationRangeError, ValueError)


@pytest.mark.parametrize(
    "param_min, param_max, message",
    [
        (0.0, 1.0, "param_min must be finite and > 0"),
        (-1.0, 1.0, "param_min must be finite and > 0"),
        (0.1, math.inf, "param_max must be finite and > 0"),
        (2.0, 1.0, "param_min must be < param_max"),
    ],
)
def test_bad_range_is_refused(param_min, param_max, message):
    with pytest.raises(ValueError, match=message):
        acc.calibrate(acc.epsilon_budget(1.0, 1e-5), acc.gaussian, param_min, param_max)


def test_bad_budget_and_factory_are_type_errors():
    with pytest.raises(TypeError, match="budget must be an EpsilonBudget.*epsilon_budget"):
        acc.calibrate((1.0, 1e-5), acc.gaussian, 0.1, 10.0)
    with pytest.raises(TypeError, match="process_factory must be a callable"):
        acc.calibrate(acc.epsilon_budget(1.0, 1e-5), 3.0, 0.1, 10.0)
    with pytest.raises(TypeError, match="has no epsilon_at"):
        acc.calibrate(acc.epsilon_budget(1.0, 1e-5), lambda p: p, 0.1, 10.0)


@pytest.mark.parametrize("rtol", [0.0, 1e-15, 0.9])
def test_bad_rtol_is_refused(rtol):
    with pytest.raises(ValueError, match=r"rtol must be a number in \[1e-12, 0.5\]"):
        acc.calibrate(acc.epsilon_budget(1.0, 1e-5), acc.gaussian, 0.1, 10.0, rtol=rtol)


@pytest.mark.parametrize(
    "epsilon, delta, message",
    [
        (-1.0, 1e-5, "epsilon must be a finite number >= 0"),
        (math.inf, 1e-5, "epsilon must be a finite number >= 0"),
        (1.0, 0.0, r"delta must be in the open interval \(0, 1\)"),
        (1.0, 1.0, r"delta must be in the open interval \(0, 1\)"),
    ],
)
def test_bad_budget_values_are_refused(epsilon, delta, message):
    with pytest.raises(ValueError, match=message):
        acc.epsilon_budget(epsilon, delta)


def test_budget_is_frozen_and_checks_a_process():
    budget = acc.epsilon_budget(2.0, 1e-5)
    with pytest.raises(AttributeError):
        budget.epsilon = 3.0
    assert budget.is_met_by(acc.gaussian(2.0))
    assert not budget.is_met_by(acc.gaussian(1.9))


# ---------------------------------------------------------------------------------------------
# Estimates (is_guarantee not True) only with allow_estimates=True


def _monte_carlo_factory(sigma):
    from opake.dpftrl.accounting import balls_in_bins, mf_gaussian
    from opake.dpftrl.noise import identity_strategy

    return balls_in_bins(mf_gaussian(sigma, identity_strategy()), num_bins=4, n_steps=8,
                         method="monte_carlo", num_samples=4000, seed=0)


class _UndeclaredProcess:
    """A hand-written process that does not say whether its numbers are proven."""

    def __init__(self, sigma):
        self.inner = acc.gaussian(sigma)

    def epsilon_at(self, delta):
        return self.inner.epsilon_at(delta)

    def delta_at(self, epsilon):
        return self.inner.delta_at(epsilon)


def test_a_monte_carlo_estimate_is_refused_by_default():
    with pytest.raises(acc.EstimateNotAllowedError,
                       match=r"not a proven bound \(is_guarantee=False: Monte Carlo ESTIMATE.*allow_estimates=True"):
        acc.calibrate(acc.epsilon_budget(2.0, 0.05), _monte_carlo_factory, 0.3, 30.0)


def test_a_process_that_does_not_declare_is_guarantee_is_refused_by_default():
    with pytest.raises(ValueError, match=r"is_guarantee=None.*an estimate is not a guarantee"):
        acc.calibrate(acc.epsilon_budget(2.0, 1e-5), _UndeclaredProcess, 0.1, 10.0)


def test_allow_estimates_calibrates_to_the_estimate_and_says_so():
    budget = acc.epsilon_budget(2.0, 0.05)
    result = acc.calibrate(budget, _monte_carlo_factory, 0.3, 30.0, rtol=1e-4, allow_estimates=True)
    assert result.process.is_guarantee is False
    # the definition, evaluated independently of the search
    assert _monte_carlo_factory(result.param).epsilon_at(0.05) <= 2.0
    assert _monte_carlo_factory(result.param_failing).epsilon_at(0.05) > 2.0
    # the estimate is below the proven (unamplified) bound's parameter for the same budget
    rigorous = acc.calibrate(budget, lambda s: _monte_carlo_factory(s).rigorous, 0.3, 30.0, rtol=1e-4)
    assert result.param < rigorous.param


def test_guarantees_pass_whatever_allow_estimates_says():
    for allow in (False, True):
        result = acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0, allow_estimates=allow)
        assert result.process.is_guarantee is True


@pytest.mark.parametrize("value", [1, "yes", None])
def test_allow_estimates_must_be_a_bool(value):
    with pytest.raises(TypeError, match="allow_estimates must be True or False"):
        acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0, allow_estimates=value)


# --- calibrate_near: the same answer from a bracket around a guess -------------------------------


@pytest.mark.parametrize("guess", [0.05, 1.0, 3.0, 500.0])
def test_calibrate_near_finds_what_calibrate_finds_from_any_guess(guess):
    budget = acc.epsilon_budget(2.0, 1e-5)
    built = []

    def factory(sigma):
        built.append(sigma)
        return acc.gaussian(sigma)

    near = acc.calibrate_near(budget, factory, guess, 1e-3, 1e4, rtol=1e-9)
    assert near.param == pytest.approx(dp_accounting.get_sigma_gaussian(2.0, 1e-5), rel=1e-8)
    assert near.epsilon <= 2.0
    assert len(built) == len(set(built))  # each parameter's process is built once


def test_calibrate_near_raises_like_calibrate_at_either_end():
    budget = acc.epsilon_budget(2.0, 1e-5)
    with pytest.raises(acc.CalibrationRangeError) as missed:
        acc.calibrate_near(budget, acc.gaussian, 1.0, 0.1, 1.5)   # 1.5 is not enough noise
    assert missed.value.end == "max"
    with pytest.raises(acc.CalibrationRangeError) as met:
        acc.calibrate_near(budget, acc.gaussian, 5.0, 3.0, 10.0)  # 3.0 already meets it
    assert met.value.end == "min"
    with pytest.raises(ValueError, match="spread must be a number > 1"):
        acc.calibrate_near(budget, acc.gaussian, 1.0, 0.1, 10.0, spread=1.0)


# --- smallest_epsilon: inverting a delta(epsilon) curve --------------------------------------------


@pytest.mark.parametrize("sigma", [0.5, 1.0, 4.0])
def test_smallest_epsilon_inverts_the_exact_gaussian(sigma):
    from opake.accounting.process import smallest_epsilon

    process = acc.gaussian(sigma)
    for delta in [1e-10, 1e-5, 1e-2]:
        epsilon = smallest_epsilon(process.delta_at, delta, 1e3)
        assert process.delta_at(epsilon) <= delta
        assert epsilon == pytest.approx(dp_accounting.get_epsilon_gaussian(sigma, delta), rel=1e-9)
    assert smallest_epsilon(process.delta_at, 1e-5, 1e-3) is None   # the bracket's end misses delta
    assert smallest_epsilon(lambda eps: 0.0, 1e-5, 10.0) == 0.0


# --- fewer evaluations: interpolation on ln epsilon vs ln param, closing steps, epsilon_rtol ------


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 3.0, 8.0, 30.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5])
def test_gaussian_calibration_needs_few_evaluations(epsilon, delta):
    # The bracket's regula falsi took 18 to 26 evaluations here; the secant search takes about 8.
    result = acc.calibrate(acc.epsilon_budget(epsilon, delta), acc.gaussian, 0.01, 1000.0, rtol=1e-6)
    reference = dp_accounting.get_sigma_gaussian(epsilon, delta)
    assert reference * (1 - 1e-10) <= result.param <= reference * (1 + 1e-6) * (1 + 1e-10)
    assert result.num_evaluations <= 12


@pytest.mark.parametrize("epsilon", [0.5, 3.0, 8.0])
def test_epsilon_rtol_stops_inside_the_window_and_still_meets_the_budget(epsilon):
    budget = acc.epsilon_budget(epsilon, 1e-5)
    result = acc.calibrate(budget, acc.gaussian, 0.01, 1000.0, rtol=1e-9, epsilon_rtol=1e-3)
    # epsilon from dp_accounting (independent code) at the returned noise multiplier
    independent = dp_accounting.get_epsilon_gaussian(result.param, 1e-5)
    assert epsilon * (1 - 1e-3) * (1 - 1e-9) <= independent <= epsilon * (1 + 1e-9)
    assert result.epsilon <= epsilon and result.epsilon_rtol == 1e-3
    assert result.param >= dp_accounting.get_sigma_gaussian(epsilon, 1e-5) * (1 - 1e-10)
    tight = acc.calibrate(budget, acc.gaussian, 0.01, 1000.0, rtol=1e-9)
    assert result.num_evaluations < tight.num_evaluations


def test_on_evaluation_sees_every_evaluation():
    seen = []
    result = acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0,
                           on_evaluation=lambda param, epsilon: seen.append((param, epsilon)))
    assert len(seen) == result.num_evaluations == len({param for param, _ in seen})
    for param, epsilon in seen:
        assert epsilon == pytest.approx(dp_accounting.get_epsilon_gaussian(param, 1e-5), rel=1e-6)
    assert (result.param, result.epsilon) in seen
    with pytest.raises(TypeError, match="on_evaluation must be None or a callable"):
        acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0, on_evaluation=3)


@pytest.mark.parametrize("value", [0.0, 0.9, "1e-3"])
def test_bad_epsilon_rtol_is_refused(value):
    with pytest.raises(ValueError, match=r"epsilon_rtol must be None or a number in \[1e-12, 0.5\]"):
        acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0, epsilon_rtol=value)


class _Kinked:
    """epsilon(p) with a kink and a flat stretch: the search must still bracket and converge."""

    is_guarantee = True

    def __init__(self, p):
        self.p = p

    def epsilon_at(self, delta):
        return 5.0 if self.p < 1.0 else (4.0 if self.p < 3.0 else 1.0 / self.p)

    def delta_at(self, epsilon):
        return 1e-5


def test_a_curve_interpolation_cannot_follow_is_bisected_to_the_tolerance():
    # The smallest parameter with epsilon <= 2 is exactly 3 (the jump), so bracketing alone finds it.
    result = acc.calibrate(acc.epsilon_budget(2.0, 1e-5), _Kinked, 0.01, 100.0, rtol=1e-6)
    assert 3.0 <= result.param <= 3.0 * (1 + 1e-6)
    assert result.param_failing < 3.0


@pytest.mark.parametrize("slope", [-0.5, -1.0, -3.0])
def test_calibrate_near_with_a_slope_hint_finds_the_same_answer(slope):
    budget = acc.epsilon_budget(3.0, 1e-5)
    near = acc.calibrate_near(budget, acc.gaussian, 1.0, 1e-3, 1e4, rtol=1e-9, slope=slope)
    assert near.param == pytest.approx(dp_accounting.get_sigma_gaussian(3.0, 1e-5), rel=1e-8)
    with pytest.raises(ValueError, match="slope must be None or a finite number < 0"):
        acc.calibrate_near(budget, acc.gaussian, 1.0, 1e-3, 1e4, slope=0.5)


def test_calibrate_near_stops_at_an_accepted_guess():
    budget = acc.epsilon_budget(3.0, 1e-5)
    exact = dp_accounting.get_sigma_gaussian(3.0, 1e-5)
    result = acc.calibrate_near(budget, acc.gaussian, exact * (1 + 1e-5), 1e-3, 1e4, epsilon_rtol=1e-3)
    assert result.num_evaluations == 1 and result.param == exact * (1 + 1e-5)
    assert result.param_failing is None  # no failing parameter was needed
    assert dp_accounting.get_epsilon_gaussian(result.param, 1e-5) <= 3.0


# --- calibrate_capped: a slow process under a fast cap -------------------------------------------


def _counting(factory):
    calls = []

    def counted(param):
        calls.append(param)
        return factory(param)

    return counted, calls


@pytest.mark.parametrize("gain", [1.0, 1.02, 1.3])
def test_capped_calibration_of_a_scaled_gaussian(gain):
    # process(p) = Gaussian(gain * p) has epsilon <= Gaussian(p)'s: the cap. Its smallest passing
    # parameter is exactly sigma_gauss / gain (dp_accounting's calibration, independent code).
    budget = acc.epsilon_budget(3.0, 1e-5)
    slow, calls = _counting(lambda p: acc.gaussian(gain * p))
    result = calibrate_capped(budget, slow, acc.gaussian, 1e-3, 1e4)
    exact = dp_accounting.get_sigma_gaussian(3.0, 1e-5) / gain
    assert dp_accounting.get_epsilon_gaussian(gain * result.param, 1e-5) <= 3.0
    # stopped with epsilon within 0.1% of the target or the parameter within 0.01%: either way
    # within 0.1% of the smallest passing parameter (the Gaussian's slope is steeper than -1 here)
    assert exact * (1 - 1e-10) <= result.param <= exact * (1 + 1e-3)
    assert len(calls) == result.num_evaluations == len(set(calls))
    assert result.num_evaluations <= (1 if gain == 1.0 else 3)


def test_capped_calibration_reuses_a_given_cap_and_checks_it():
    budget = acc.epsilon_budget(3.0, 1e-5)
    cap = acc.calibrate(budget, acc.gaussian, 1e-3, 1e4)
    given = calibrate_capped(budget, lambda p: acc.gaussian(1.1 * p), acc.gaussian, 1e-3, 1e4, cap=cap)
    again = calibrate_capped(budget, lambda p: acc.gaussian(1.1 * p), acc.gaussian, 1e-3, 1e4)
    assert given == again
    with pytest.raises(ValueError, match="cap was calibrated to .* not to"):
        calibrate_capped(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, acc.gaussian, 1e-3, 1e4, cap=cap)
    with pytest.raises(TypeError, match="cap must be None or the CalibrationResult"):
        calibrate_capped(budget, acc.gaussian, acc.gaussian, 1e-3, 1e4, cap=2.0)


def test_a_process_above_its_cap_is_an_error_not_a_silent_guess():
    with pytest.raises(RuntimeError, match="cap_factory does not cap process_factory"):
        calibrate_capped(acc.epsilon_budget(3.0, 1e-5), lambda p: acc.gaussian(0.9 * p), acc.gaussian, 1e-3, 1e4)


@pytest.mark.filterwarnings("ignore::opake.dpftrl.accounting.UnprovenAmplificationWarning")  # priced knowingly
def test_capped_amplified_balls_in_bins_matches_the_slow_search():
    # The amplified balls-in-bins bound (capped by the unamplified one) on a small run: the fast
    # search agrees with calibrate over the whole range at rtol 1e-6, within its own tolerance.
    from opake.dpftrl.accounting import balls_in_bins, mf_gaussian
    from opake.dpftrl.noise import blt_strategy

    strategy = blt_strategy(max_buffers=3)
    budget = acc.epsilon_budget(3.0, 1e-5)

    def amplified(sigma):
        return balls_in_bins(mf_gaussian(sigma, strategy), num_bins=10, n_steps=20, method="amplified")

    def unamplified(sigma):
        return balls_in_bins(mf_gaussian(sigma, strategy), num_bins=10, n_steps=20, method="rigorous")

    fast = calibrate_capped(budget, amplified, unamplified, 1e-3, 1e4)
    slow = acc.calibrate(budget, amplified, 1e-3, 1e4, rtol=1e-6)
    assert amplified(fast.param).epsilon_at(1e-5) <= 3.0
    assert slow.param / (1 + 1e-6) <= fast.param <= slow.param * (1 + 2e-3)
    assert fast.param <= acc.calibrate(budget, unamplified, 1e-3, 1e4).param
    assert fast.num_evaluations <= 4 < slow.num_evaluations
