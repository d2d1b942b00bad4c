"""opake.planner.calibration: one search per accounting method, every answer an exact evaluation.

Each routine of the registry is checked the same way: the returned noise multiplier meets the
budget on an accountant built independently from the sampling's numbers (its epsilon re-evaluated
here, not read from the result), and 1% less noise misses it (the negative control: a search that
returned any passing sigma, however large, would fail it). The plan takes the choice's priced
process as is, and only on the accountant its own sampler builds.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from opake.accounting import epsilon_budget
from opake.dpftrl.accounting import UnprovenAmplificationWarning
from opake.dpftrl.accounting.accountant import balls_in_bins_accountant, poisson_accountant
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.errors import PlanError
from opake.planner import CALIBRATIONS, calibrate_noise, price_noise
from opake.planner.calibration import PoissonStart
from opake.random import key
from opake.torch import plan_privacy

DELTA = 1e-5


def _accountants():
    return {
        "rigorous": balls_in_bins_accountant(blt_strategy(max_buffers=2), 20, 60, "rigorous"),
        "amplified": balls_in_bins_accountant(blt_strategy(max_buffers=2), 20, 60, "amplified"),
        "allocation_pld": balls_in_bins_accountant(identity_strategy(), 20, 60, "allocation_pld"),
        "pld": poisson_accountant(band_mf_strategy(bands=2), 0.1, 60),
    }


def test_the_registry_has_a_search_for_every_method_a_sampler_prices_with():
    assert set(CALIBRATIONS) == {AccountingMethod.RIGOROUS, AccountingMethod.AMPLIFIED,
                                 AccountingMethod.ALLOCATION_PLD, AccountingMethod.POISSON_PLD}


@pytest.mark.parametrize("method", ["rigorous", "amplified", "allocation_pld", "pld"])
def test_each_search_meets_the_budget_and_a_little_less_noise_misses_it(method):
    accountant = _accountants()[method]
    budget = epsilon_budget(4.0, DELTA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnprovenAmplificationWarning)
        result = calibrate_noise(accountant, budget)
        assert accountant.method.value == method
        assert accountant(result.sigma).epsilon_at(DELTA) == pytest.approx(result.epsilon, rel=1e-12)
        assert result.epsilon <= 4.0
        assert accountant(0.99 * result.sigma).epsilon_at(DELTA) > 4.0


def test_a_start_from_a_coarser_grid_lands_on_the_same_answer_within_the_tolerance():
    accountant = _accountants()["pld"]
    budget = epsilon_budget(4.0, DELTA)
    fresh = calibrate_noise(accountant, budget)
    started = calibrate_noise(accountant, budget, start=PoissonStart(1.02 * fresh.sigma, None))
    assert started.sigma == pytest.approx(fresh.sigma, rel=2e-3) and started.epsilon <= 4.0


def test_a_repeated_calibration_is_the_first_answer_without_evaluating_again():
    """A second identical request (another learning rate or seed of one run) gets the first answer,
    process included, and no evaluation; another budget is searched on its own."""
    evaluated = []

    @dataclasses.dataclass(frozen=True)
    class Counting:
        inner: object

        def __call__(self, sigma):
            evaluated.append(sigma)
            return self.inner(sigma)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    accountant = Counting(balls_in_bins_accountant(blt_strategy(max_buffers=2), 20, 60, "rigorous"))
    first = calibrate_noise(accountant, epsilon_budget(3.5, DELTA))
    searched = len(evaluated)
    assert searched > 1
    assert calibrate_noise(accountant, epsilon_budget(3.5, DELTA)) == first and len(evaluated) == searched
    other = calibrate_noise(accountant, epsilon_budget(5.0, DELTA))
    assert len(evaluated) > searched and other.sigma < first.sigma


def test_a_given_noise_multiplier_is_priced_once_and_bad_values_are_refused():
    accountant = _accountants()["rigorous"]
    priced = price_noise(accountant, 2.0, DELTA)
    assert priced.sigma == 2.0 and priced.epsilon == accountant(2.0).epsilon_at(DELTA)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            price_noise(accountant, bad, DELTA)


def test_a_budget_no_noise_multiplier_meets_is_a_plan_error():
    accountant = balls_in_bins_accountant(identity_strategy(), 20, 60, "rigorous")
    with pytest.raises(PlanError, match="cannot be met"):
        calibrate_noise(accountant, epsilon_budget(1e-9, 1e-12))


def test_the_plan_takes_the_choices_priced_process_on_its_own_samplers_accountant():
    plan = plan_privacy(num_examples=600, batch_size=20, epochs=2, max_grad_norm=1.0, key=key(0),
                        target_epsilon=4.0, target_delta=DELTA)
    choice = plan.choice
    assert choice is not None
    assert plan.accountant is choice.process and plan.noise_multiplier == choice.noise_multiplier
    assert plan.epsilon == choice.epsilon <= 4.0
    assert plan.sampler.accountant(plan.strategy, plan.n_steps) == choice.accountant
    named = plan_privacy(num_examples=600, batch_size=20, epochs=2, max_grad_norm=1.0, key=key(0),
                         target_epsilon=4.0, target_delta=DELTA, strategy=blt_strategy())
    assert named.choice is None  # control: a named strategy is calibrated by the plan itself
