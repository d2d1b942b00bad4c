"""The noise multiplier of an accountant: priced when given, calibrated to a budget when not.

An ``Accountant`` (``opake.dpftrl.accounting.accountant``: a strategy, a horizon, a sampling and
a method, everything but the noise multiplier) is the one object every plan prices with. This
module is the one place its noise multiplier is searched for, by the routine its method needs
(``CALIBRATIONS``, keyed by ``AccountingMethod``):

* ``"rigorous"`` (the unamplified Gaussian bound, microseconds an evaluation): a bisection over
  ``SIGMA_RANGE`` (``opake.accounting.calibrate``);
* ``"amplified"`` and ``"allocation_pld"`` (balls in bins, seconds an evaluation): both are capped
  by the unamplified bound of the same bins, whose calibrated sigma (microseconds) meets the
  budget, so the search starts there and stays below it (``calibrate_capped``, 1 to 5 slow
  evaluations instead of ~20);
* ``"pld"`` (cyclic Poisson, Band23 Thm 4): evaluations slow down as sigma / column norm falls,
  so the search starts near the central-limit guess (or at a ``start`` the caller found on a
  coarser grid, with the slope there) and goes no lower than ``POISSON_FLOOR`` column norms.

Every answer is an exact evaluation of the accountant at the returned sigma, whatever the
search's path. A calibration is kept by (accountant, epsilon, delta, start), process-wide and
bounded: a second identical request (another learning rate or seed of the same run) gets the same
answer, sigma, epsilon, process and evaluation count, without evaluating again. Accountants are
frozen and an evaluation is a pure function of (accountant, sigma), so the kept answer is the one
a new search would return.
"""

from __future__ import annotations

from dataclasses import dataclass

import opake.accounting as acc
from opake._checks import positive_finite
from opake.accounting.calibrate import calibrate_capped
from opake.dpftrl.accounting.accountant import Accountant
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.accounting.poisson import noise_multiplier_guess
from opake.errors import PlanError
from opake.planner.constants import CALIBRATED_LIMIT, EPSILON_RTOL, POISSON_FLOOR, RTOL, SIGMA_RANGE
from opake.progress import Progress, calibration_reporter

__all__ = ["CALIBRATIONS", "NoiseMultiplier", "PoissonStart", "calibrate_noise", "price_noise"]


@dataclass(frozen=True)
class NoiseMultiplier:
    """A noise multiplier, its epsilon at the plan's delta, and the process that priced it."""

    sigma: float
    epsilon: float
    process: object
    evaluations: int = 1


@dataclass(frozen=True)
class PoissonStart:
    """Where a cyclic Poisson search starts when a coarser grid already found the answer nearby:
    ``sigma`` and the slope d ln epsilon / d ln sigma there (None: unknown)."""

    sigma: float
    slope: float | None


def price_noise(accountant: Accountant, noise_multiplier: float, delta: float,
                progress: Progress | None = None) -> NoiseMultiplier:
    """A given noise multiplier priced on ``accountant`` at ``delta``: one evaluation."""
    sigma = positive_finite("noise_multiplier", noise_multiplier)
    with Progress.of(progress).stage(f"pricing noise multiplier {sigma:g} ({accountant.method} bound)"):
        process = accountant(sigma)
        return NoiseMultiplier(sigma, process.epsilon_at(delta), process)


# Calibrations by (accountant, epsilon, delta, start): a cache of results, never a source of
# behaviour (see the module docstring).
_CALIBRATED: dict = {}


def calibrate_noise(accountant: Accountant, budget, *, start: PoissonStart | None = None,
                    progress: Progress | None = None, describe: str = "this plan") -> NoiseMultiplier:
    """The smallest noise multiplier (to the search's tolerance) whose process on ``accountant``
    meets ``budget`` (an ``EpsilonBudget``), by the routine of the accountant's method (module
    docstring). ``start`` seeds a cyclic Poisson search; ``describe`` names the run in errors.

    Raises ``PlanError`` when no noise multiplier in the searched range meets the budget, saying
    which end was reached and what to change.
    """
    key = (accountant, budget.epsilon, budget.delta, start)
    try:
        cached = _CALIBRATED.get(key)
    except TypeError:  # an unhashable strategy: calibrate every time
        key, cached = None, None
    if cached is not None:
        return cached
    routine = CALIBRATIONS[accountant.method]
    try:
        result = routine(accountant, budget, start, Progress.of(progress))
    except acc.CalibrationRangeError as error:
        raise _range_error(accountant, budget, error, describe) from None
    found = NoiseMultiplier(result.param, result.epsilon, result.process, result.num_evaluations)
    if key is not None and len(_CALIBRATED) < CALIBRATED_LIMIT:
        _CALIBRATED[key] = found
    return found


def _bisect(accountant, budget, start, progress):
    with progress.stage(f"calibrating the noise multiplier (balls in bins, {accountant.method} bound)"):
        return acc.calibrate(budget, accountant, *SIGMA_RANGE,
                             on_evaluation=calibration_reporter(progress, budget.epsilon))


def _capped(accountant, budget, start, progress):
    with progress.stage(f"calibrating the noise multiplier (balls in bins, {accountant.method} bound)"):
        unamplified = accountant.unamplified()
        cap = acc.calibrate(budget, unamplified, *SIGMA_RANGE)
        return calibrate_capped(budget, accountant, unamplified, *SIGMA_RANGE, cap=cap,
                                on_evaluation=calibration_reporter(progress, budget.epsilon))


def _near(accountant, budget, start, progress):
    report = calibration_reporter(progress, budget.epsilon)
    with progress.stage("calibrating the noise multiplier (cyclic Poisson, PLD)"):
        if start is not None:
            # A start from a coarser grid (0.02% to 3% above): a step along its slope, 1 to 3 evaluations.
            return acc.calibrate_near(budget, accountant, start.sigma, *SIGMA_RANGE, spread=1.1, rtol=RTOL,
                                      epsilon_rtol=EPSILON_RTOL, slope=start.slope, on_evaluation=report)
        process = accountant(SIGMA_RANGE[1])  # a cheap evaluation: a tiny PLD at a huge sigma
        guess = noise_multiplier_guess(process.sample_rate, process.compositions, process.column_norm, budget)
        return acc.calibrate_near(budget, accountant, guess, POISSON_FLOOR * process.column_norm, SIGMA_RANGE[1],
                                  on_evaluation=report)


CALIBRATIONS = {
    AccountingMethod.RIGOROUS: _bisect,
    AccountingMethod.AMPLIFIED: _capped,
    AccountingMethod.ALLOCATION_PLD: _capped,
    AccountingMethod.POISSON_PLD: _near,
}


def _range_error(accountant, budget, error, describe: str) -> PlanError:
    if accountant.method is AccountingMethod.POISSON_PLD and error.end == "min":
        floor = POISSON_FLOOR * accountant(SIGMA_RANGE[1]).column_norm
        return PlanError(
            f"target_epsilon={budget.epsilon:g} at delta={budget.delta:g} is met with a noise multiplier below "
            f"{floor:.4g} under Poisson sampling, where the PLD accounting gets too costly to calibrate; pass "
            f"noise_multiplier= (at least {floor:.4g}) instead of target_epsilon"
        )
    return PlanError(
        f"target_epsilon={budget.epsilon:g} at delta={budget.delta:g} cannot be met for {describe} with a noise "
        f"multiplier in ({SIGMA_RANGE[0]:g}, {SIGMA_RANGE[1]:g}): {error}. Raise the budget, or train fewer epochs"
    )
