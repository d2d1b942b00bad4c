"""Calibrate a noise multiplier (or any privacy parameter) to a budget.

``calibrate(budget, process_factory, param_min, param_max)`` finds the smallest parameter p in
[param_min, param_max] whose process meets the budget, assuming more noise never costs
privacy: ``process_factory(p).epsilon_at(budget.delta)`` is non-increasing in p. The search is
a bracketing one in log p (regula falsi with the Illinois modification, Dowell and Jarratt
1971, plus bisection steps), which keeps a failing parameter below and a passing one above and
stops when they are within a factor 1 + rtol. The *passing* end is returned, so the result
always meets the budget (rounded toward more noise) and is at most (1 + rtol) times the
smallest parameter that does.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

from opake._checks import positive_finite
from opake.accounting.budget import EpsilonBudget

_MAX_EVALUATIONS = 200


class CalibrationRangeError(ValueError):
    """The budget is not crossed inside [param_min, param_max]; the message says which end to move.

    ``end`` is "max" (even param_max misses the budget) or "min" (param_min already meets it).
    """

    def __init__(self, message: str, end: str | None = None):
        super().__init__(message)
        self.end = end


class EstimateNotAllowedError(ValueError):
    """calibrate was given an estimate (``is_guarantee`` not True) without ``allow_estimates=True``."""


@dataclass(frozen=True)
class CalibrationResult:
    """The calibrated parameter and the guarantee it achieves.

    Fields:
      param: the returned parameter (e.g. noise multiplier); meets the budget.
      epsilon: ``process.epsilon_at(budget.delta)``, <= budget.epsilon.
      delta: ``process.delta_at(budget.epsilon)``, <= budget.delta.
      budget: the target.
      process: ``process_factory(param)``.
      param_failing: the largest parameter seen that does not meet the budget; the smallest
        passing parameter lies in (param_failing, param] and param <= (1 + rtol) * param_failing.
      rtol: the relative tolerance the search ran to.
      num_evaluations: number of ``epsilon_at`` evaluations.
    """

    param: float
    epsilon: float
    delta: float
    budget: EpsilonBudget
    process: object
    param_failing: float
    rtol: float
    num_evaluations: int


def calibrate(
    budget: EpsilonBudget,
    process_factory: Callable[[float], object],
    param_min: float,
    param_max: float,
    *,
    rtol: float = 1e-6,
    allow_estimates: bool = False,
) -> CalibrationResult:
    """Smallest parameter in [param_min, param_max] whose process meets ``budget``.

    >>> import opake.accounting as acc
    >>> result = acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0)
    >>> round(result.param, 4)
    1.9938

    Raises CalibrationRangeError (a ValueError) when param_max does not meet the budget
    (raise param_max or relax the budget) or when param_min already does (lower param_min).

    Only proven bounds are calibrated to by default: a process whose ``is_guarantee`` is not
    True (a Monte Carlo estimate such as ``balls_in_bins(..., method="monte_carlo")``) raises
    EstimateNotAllowedError (a ValueError), since a parameter that meets an estimated budget
    is not proven to meet the budget. ``allow_estimates=True`` calibrates to the estimate
    anyway; the result's ``process.is_guarantee`` then says it is one.
    """
    if not isinstance(budget, EpsilonBudget):
        raise TypeError(
            f"budget must be an EpsilonBudget, got {type(budget).__name__}; "
            "build one with opake.accounting.epsilon_budget(epsilon, delta)"
        )
    if not callable(process_factory):
        raise TypeError(
            "process_factory must be a callable param -> privacy process, e.g. "
            "lambda sigma: mf_gaussian(sigma, strategy, n_steps=...)"
        )
    param_min = positive_finite("param_min", param_min)
    param_max = positive_finite("param_max", param_max)
    if not param_min < param_max:
        raise ValueError(f"param_min must be < param_max, got param_min={param_min!r}, param_max={param_max!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not (1e-12 <= rtol <= 0.5):
        raise ValueError(f"rtol must be a number in [1e-12, 0.5], got {rtol!r}")
    rtol = float(rtol)
    if not isinstance(allow_estimates, bool):
        raise TypeError(f"allow_estimates must be True or False, got {allow_estimates!r}")

    target = budget.epsilon
    evaluations = 0

    def evaluate(param: float):
        nonlocal evaluations
        evaluations += 1
        process = process_factory(param)
        if not hasattr(process, "epsilon_at"):
            raise TypeError(
                f"process_factory({param!r}) returned {type(process).__name__}, which has no "
                "epsilon_at(delta); return a privacy process such as mf_gaussian(...)"
            )
        if not allow_estimates and getattr(process, "is_guarantee", None) is not True:
            described = getattr(process, "description", type(process).__name__)
            raise EstimateNotAllowedError(
                f"process_factory({param!r}) returned a process that is not a proven bound "
                f"(is_guarantee={getattr(process, 'is_guarantee', None)!r}: {described}); an estimate is "
                "not a guarantee, so a parameter calibrated to it is not proven to meet the budget. "
                "Calibrate to a rigorous process (e.g. balls_in_bins(..., method='rigorous' or 'rdp')), "
                "or pass allow_estimates=True to accept an estimated budget knowingly"
            )
        epsilon = float(process.epsilon_at(budget.delta))
        if math.isnan(epsilon):
            raise ValueError(f"process_factory({param!r}).epsilon_at({budget.delta!r}) returned nan")
        return epsilon, process

    epsilon_hi, process_hi = evaluate(param_max)
    g_hi = epsilon_hi - target
    if g_hi > 0.0:
        raise CalibrationRangeError(
            f"budget (epsilon={target!r}, delta={budget.delta!r}) is unreachable inside the range: "
            f"even param_max={param_max!r} gives epsilon={epsilon_hi!r}; "
            "raise param_max (more noise) or relax the budget",
            end="max",
        )
    epsilon_lo, _ = evaluate(param_min)
    g_lo = epsilon_lo - target
    if g_lo <= 0.0:
        raise CalibrationRangeError(
            f"budget (epsilon={target!r}, delta={budget.delta!r}) is already met at "
            f"param_min={param_min!r} (epsilon={epsilon_lo!r}), so the smallest parameter "
            "meeting it lies below the range; lower param_min",
            end="min",
        )

    p_lo, p_hi = param_min, param_max
    u_lo, u_hi = math.log(p_lo), math.log(p_hi)
    width_goal = math.log1p(rtol)
    last_side = 0
    iteration = 0
    while u_hi - u_lo > width_goal:
        iteration += 1
        if evaluations >= _MAX_EVALUATIONS:
            raise RuntimeError(
                f"calibrate did not converge in {_MAX_EVALUATIONS} evaluations; is "
                "epsilon_at non-increasing in the parameter?"
            )
        finite = math.isfinite(g_lo) and math.isfinite(g_hi) and g_lo != g_hi
        if finite and iteration % 5 != 0:
            # regula falsi on g(u) = epsilon(e^u) - target, kept at least width_goal/2 inside
            u = (u_lo * g_hi - u_hi * g_lo) / (g_hi - g_lo)
            margin = min(0.5 * width_goal, 0.25 * (u_hi - u_lo))
            u = min(max(u, u_lo + margin), u_hi - margin)
        else:
            u = 0.5 * (u_lo + u_hi)
        p = math.exp(u)
        if not p_lo < p < p_hi:
            break  # the bracket is down to adjacent floats
        epsilon, process = evaluate(p)
        g = epsilon - target
        if g <= 0.0:
            p_hi, u_hi, g_hi, process_hi = p, u, g, process
            epsilon_hi = epsilon
            if last_side == 1:
                g_lo *= 0.5  # Illinois: the low end was kept twice in a row
            last_side = 1
        else:
            p_lo, u_lo, g_lo = p, u, g
            if last_side == -1:
                g_hi *= 0.5
            last_side = -1

    return CalibrationResult(
        param=p_hi,
        epsilon=epsilon_hi,
        delta=float(process_hi.delta_at(budget.epsilon)),
        budget=budget,
        process=process_hi,
        param_failing=p_lo,
        rtol=rtol,
        num_evaluations=evaluations,
    )


def calibrate_near(
    budget: EpsilonBudget,
    process_factory: Callable[[float], object],
    guess: float,
    param_min: float,
    param_max: float,
    *,
    spread: float = 2.0,
    rtol: float = 1e-6,
    allow_estimates: bool = False,
) -> CalibrationResult:
    """``calibrate``, starting from a bracket around ``guess`` instead of at the range's ends.

    For processes that are slow to evaluate far from the answer (a PLD at a small noise
    multiplier spans a wide range of privacy losses): the bracket [guess / spread, guess *
    spread], clipped to [param_min, param_max], is widened by factors of 4 until its upper end
    meets the budget and its lower end does not, then ``calibrate`` searches inside it. Each
    parameter's process is built once. Raises CalibrationRangeError (with ``end``) exactly when
    ``calibrate(budget, process_factory, param_min, param_max)`` would.
    """
    guess = positive_finite("guess", guess)
    if isinstance(spread, bool) or not isinstance(spread, numbers.Real) or not spread > 1.0:
        raise ValueError(f"spread must be a number > 1, got {spread!r}")
    processes = {}

    def process(param: float):
        if param not in processes:
            processes[param] = process_factory(param)
        return processes[param]

    def meets(param: float) -> bool:
        return float(process(param).epsilon_at(budget.delta)) <= budget.epsilon

    low = min(max(guess / spread, param_min), param_max)
    high = max(min(guess * spread, param_max), param_min)
    while not meets(high):
        if high >= param_max:
            return calibrate(budget, process, param_min, param_max, rtol=rtol, allow_estimates=allow_estimates)
        low, high = high, min(4.0 * high, param_max)
    while low >= high or meets(low):
        if low <= param_min:
            return calibrate(budget, process, param_min, param_max, rtol=rtol, allow_estimates=allow_estimates)
        low, high = max(low / 4.0, param_min), low
    return calibrate(budget, process, low, high, rtol=rtol, allow_estimates=allow_estimates)
