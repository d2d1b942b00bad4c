"""Calibrate a noise multiplier (or any privacy parameter) to a budget.

``calibrate(budget, process_factory, param_min, param_max)`` finds the smallest parameter p in
[param_min, param_max] whose process meets the budget, assuming more noise never costs
privacy: ``process_factory(p).epsilon_at(budget.delta)`` is non-increasing in p. The search keeps
a bracket, a failing parameter below and a passing one above, and returns the *passing* end: the
result always meets the budget, checked by an exact evaluation at that very parameter (rounded
toward more noise). It stops when the ends are within a factor 1 + rtol or, with
``epsilon_rtol``, as soon as a passing parameter's epsilon lies in [target (1 - epsilon_rtol),
target].

Few evaluations, because one evaluation of an amplified bound takes seconds:

* the search interpolates ln epsilon against ln p, where the Gaussian-type bounds are close to
  straight lines (epsilon ~ 1/sigma at small epsilon, ~ 1/sigma^2 at large): inverse quadratic
  interpolation through the last three evaluations (as in Brent's method), else the secant
  through the last two, else the chord between the bracket's ends (regula falsi);
* each interpolated point is moved half the tolerance past the estimated root, and once an end
  is within the tolerance of the estimate the next point goes just under the tolerance from
  that end (as Brent's method steps at least its tolerance): an accurate estimate then closes
  the bracket in one or two evaluations instead of creeping to the root from one side;
* with ``epsilon_rtol`` the interpolation aims at the middle of the accepted window, so an
  accurate estimate lands in it and the search stops there;
* every parameter is evaluated once; a bisection step is taken whenever three evaluations have
  not halved the bracket, so the search converges whatever the curve looks like.

Measured: a Gaussian over [0.01, 1000] at rtol 1e-6 takes 7 to 14 evaluations (the earlier
regula falsi took 15 to 26); the amplified balls-in-bins bound through ``calibrate_capped``
takes 1 to 5 (it took 15 to 20).

``calibrate_near`` starts from a guess instead of the range's ends (for processes that are slow
to evaluate far from the answer); ``calibrate_capped`` calibrates a slow process under a fast
cap (the amplified balls-in-bins bound under the unamplified one) from the cap's answer.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from opake._checks import positive_finite
from opake.accounting.budget import EpsilonBudget
from opake.errors import ConvergenceError, InvalidArgumentError, InvalidStateError, InvalidTypeError, OpakeError

_MAX_EVALUATIONS = 200
# The interpolated point goes this fraction of the tolerance past the estimated root, and a
# closing step this fraction of it from the near end (just under 1, so the bracket it leaves
# is inside the tolerance even after rounding of ln and exp).
_OVERSHOOT = 0.5
_CLOSING = 0.98


class CalibrationRangeError(OpakeError, ValueError):
    """The budget is not crossed inside [param_min, param_max]; the message says which end to move.

    ``end`` is "max" (even param_max misses the budget) or "min" (param_min already meets it).
    """

    def __init__(self, message: str, end: str | None = None):
        super().__init__(message)
        self.end = end


class EstimateNotAllowedError(OpakeError, ValueError):
    """calibrate was given an estimate (``is_guarantee`` not True) without ``allow_estimates=True``."""


@dataclass(frozen=True)
class CalibrationResult:
    """The calibrated parameter and the guarantee it achieves.

    Fields:
      param: the returned parameter (e.g. noise multiplier); meets the budget.
      epsilon: ``process.epsilon_at(budget.delta)``, <= budget.epsilon.
      delta (a property, computed on first use: for an amplified bound it costs about as much
        as an evaluation): ``process.delta_at(budget.epsilon)``, <= budget.delta.
      budget: the target.
      process: ``process_factory(param)``.
      param_failing: the largest parameter seen that does not meet the budget; the smallest
        passing parameter lies in (param_failing, param]. The search stopped either with
        param <= (1 + rtol) * param_failing or (``epsilon_rtol``) with epsilon >=
        (1 - epsilon_rtol) * budget.epsilon; None when it stopped on epsilon before any
        failing parameter was evaluated (``calibrate_near`` only).
      rtol: the relative tolerance on the parameter the search ran to.
      num_evaluations: number of ``epsilon_at`` evaluations.
      epsilon_rtol: the relative tolerance on epsilon that could also stop the search (None: off).
    """

    param: float
    epsilon: float
    budget: EpsilonBudget
    process: object
    param_failing: float | None
    rtol: float
    num_evaluations: int
    epsilon_rtol: float | None = None

    @functools.cached_property
    def delta(self) -> float:
        return float(self.process.delta_at(self.budget.epsilon))


@dataclass(frozen=True)
class _Point:
    """One evaluation: the parameter, its logarithm, epsilon there and the process."""

    param: float
    log_param: float
    epsilon: float
    process: object


class _Evaluations:
    """Evaluates each parameter once, checks what the factory returns, and counts."""

    def __init__(self, budget, process_factory, allow_estimates, epsilon_rtol, on_evaluation):
        self.budget = budget
        self.factory = process_factory
        self.allow_estimates = allow_estimates
        self.on_evaluation = on_evaluation
        self.target = budget.epsilon
        # epsilon accepted at once: [target (1 - epsilon_rtol), target]; interpolation aims at its middle
        self.accept_from = math.inf if epsilon_rtol is None else self.target * (1.0 - epsilon_rtol)
        self.aim = self.target if epsilon_rtol is None else self.target * (1.0 - 0.5 * epsilon_rtol)
        self.points: dict = {}
        self.order: list = []

    @property
    def count(self) -> int:
        return len(self.order)

    def __call__(self, param: float) -> _Point:
        if param in self.points:
            return self.points[param]
        if self.count >= _MAX_EVALUATIONS:
            raise ConvergenceError(
                f"calibrate did not converge in {_MAX_EVALUATIONS} evaluations; is "
                "epsilon_at non-increasing in the parameter?"
            )
        process = self.factory(param)
        if not hasattr(process, "epsilon_at"):
            raise InvalidTypeError(
                f"process_factory({param!r}) returned {type(process).__name__}, which has no "
                "epsilon_at(delta); return a privacy process such as mf_gaussian(...)"
            )
        if not self.allow_estimates and getattr(process, "is_guarantee", None) is not True:
            described = getattr(process, "description", type(process).__name__)
            raise EstimateNotAllowedError(
                f"process_factory({param!r}) returned a process that is not a proven bound "
                f"(is_guarantee={getattr(process, 'is_guarantee', None)!r}: {described}); an estimate is "
                "not a guarantee, so a parameter calibrated to it is not proven to meet the budget. "
                "Calibrate to a rigorous process (e.g. balls_in_bins(..., method='rigorous' or 'rdp')), "
                "or pass allow_estimates=True to accept an estimated budget knowingly"
            )
        epsilon = float(process.epsilon_at(self.budget.delta))
        if math.isnan(epsilon):
            raise InvalidArgumentError(f"process_factory({param!r}).epsilon_at({self.budget.delta!r}) returned nan")
        point = _Point(param, math.log(param), epsilon, process)
        self.points[param] = point
        self.order.append(point)
        if self.on_evaluation is not None:
            self.on_evaluation(param, epsilon)
        return point

    def passes(self, point: _Point) -> bool:
        return point.epsilon <= self.target

    def accepted(self, point: _Point) -> bool:
        """Passing, with epsilon in the window that stops the search at once (epsilon_rtol)."""
        return self.accept_from <= point.epsilon <= self.target

    def excess(self, point: _Point, logarithmic: bool) -> float:
        """How far epsilon is above the aim: ln(epsilon / aim), or epsilon - aim (linear)."""
        if not logarithmic:
            return point.epsilon - self.aim
        if point.epsilon <= 0.0:
            return -math.inf
        return math.log(point.epsilon / self.aim)

    def result(self, passing: _Point, failing: _Point | None, rtol: float, epsilon_rtol) -> CalibrationResult:
        return CalibrationResult(
            param=passing.param,
            epsilon=passing.epsilon,
            budget=self.budget,
            process=passing.process,
            param_failing=None if failing is None else failing.param,
            rtol=rtol,
            num_evaluations=self.count,
            epsilon_rtol=epsilon_rtol,
        )


def _check_common(budget, process_factory, rtol, allow_estimates, epsilon_rtol, on_evaluation):
    if not isinstance(budget, EpsilonBudget):
        raise InvalidTypeError(
            f"budget must be an EpsilonBudget, got {type(budget).__name__}; "
            "build one with opake.accounting.epsilon_budget(epsilon, delta)"
        )
    if not callable(process_factory):
        raise InvalidTypeError(
            "process_factory must be a callable param -> privacy process, e.g. "
            "lambda sigma: mf_gaussian(sigma, strategy, n_steps=...)"
        )
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not (1e-12 <= rtol <= 0.5):
        raise InvalidArgumentError(f"rtol must be a number in [1e-12, 0.5], got {rtol!r}")
    if epsilon_rtol is not None and (isinstance(epsilon_rtol, bool) or not isinstance(epsilon_rtol, numbers.Real)
                                     or not (1e-12 <= epsilon_rtol <= 0.5)):
        raise InvalidArgumentError(f"epsilon_rtol must be None or a number in [1e-12, 0.5], got {epsilon_rtol!r}")
    if not isinstance(allow_estimates, bool):
        raise InvalidTypeError(f"allow_estimates must be True or False, got {allow_estimates!r}")
    if on_evaluation is not None and not callable(on_evaluation):
        raise InvalidTypeError(f"on_evaluation must be None or a callable (param, epsilon), got {on_evaluation!r}")
    return float(rtol), None if epsilon_rtol is None else float(epsilon_rtol)


def _max_error(evaluations, point, param_max):
    return CalibrationRangeError(
        f"budget (epsilon={evaluations.target!r}, delta={evaluations.budget.delta!r}) is unreachable inside "
        f"the range: even param_max={param_max!r} gives epsilon={point.epsilon!r}; "
        "raise param_max (more noise) or relax the budget",
        end="max",
    )


def _min_error(evaluations, point, param_min):
    return CalibrationRangeError(
        f"budget (epsilon={evaluations.target!r}, delta={evaluations.budget.delta!r}) is already met at "
        f"param_min={param_min!r} (epsilon={point.epsilon!r}), so the smallest parameter "
        "meeting it lies below the range; lower param_min",
        end="min",
    )


def calibrate(
    budget: EpsilonBudget,
    process_factory: Callable[[float], object],
    param_min: float,
    param_max: float,
    *,
    rtol: float = 1e-6,
    allow_estimates: bool = False,
    epsilon_rtol: float | None = None,
    on_evaluation: Callable[[float, float], None] | None = None,
) -> CalibrationResult:
    """Smallest parameter in [param_min, param_max] whose process meets ``budget``.

    >>> import opake.accounting as acc
    >>> result = acc.calibrate(acc.epsilon_budget(2.0, 1e-5), acc.gaussian, 0.1, 10.0)
    >>> round(result.param, 4)
    1.9938

    The result meets the budget and is at most (1 + rtol) times the smallest parameter that
    does; with ``epsilon_rtol`` the search may stop sooner, at a passing parameter whose epsilon
    is at least (1 - epsilon_rtol) times the target. ``on_evaluation(param, epsilon)`` is
    called after every evaluation (progress reports).

    Raises CalibrationRangeError (a ValueError) when param_max does not meet the budget
    (raise param_max or relax the budget) or when param_min already does (lower param_min).

    Only proven bounds are calibrated to by default: a process whose ``is_guarantee`` is not
    True (a Monte Carlo estimate such as ``balls_in_bins(..., method="monte_carlo")``) raises
    EstimateNotAllowedError (a ValueError), since a parameter that meets an estimated budget
    is not proven to meet the budget. ``allow_estimates=True`` calibrates to the estimate
    anyway; the result's ``process.is_guarantee`` then says it is one.
    """
    rtol, epsilon_rtol = _check_common(budget, process_factory, rtol, allow_estimates, epsilon_rtol, on_evaluation)
    param_min = positive_finite("param_min", param_min)
    param_max = positive_finite("param_max", param_max)
    if not param_min < param_max:
        raise InvalidArgumentError(
            f"param_min must be < param_max, got param_min={param_min!r}, param_max={param_max!r}"
        )
    evaluations = _Evaluations(budget, process_factory, allow_estimates, epsilon_rtol, on_evaluation)
    high = evaluations(param_max)
    if not evaluations.passes(high):
        raise _max_error(evaluations, high, param_max)
    low = evaluations(param_min)
    if evaluations.passes(low):
        raise _min_error(evaluations, low, param_min)
    return _search(evaluations, low, high, rtol, epsilon_rtol)


def _search(evaluations: _Evaluations, low: _Point, high: _Point, rtol: float, epsilon_rtol) -> CalibrationResult:
    """Shrink the bracket (``low`` fails, ``high`` passes) to the tolerance (module docstring)."""
    width_goal = math.log1p(rtol)
    widths = [high.log_param - low.log_param]
    while high.log_param - low.log_param > width_goal and not evaluations.accepted(high):
        u_lo, u_hi = low.log_param, high.log_param
        width = u_hi - u_lo
        u = _interpolated(evaluations, low, high)
        if u is None or (len(widths) > 3 and width > 0.5 * widths[-4]):
            u = 0.5 * (u_lo + u_hi)  # bisection: no usable interpolation, or three steps did not halve
        elif min(u - u_lo, u_hi - u) < width_goal:
            # the estimate is within the tolerance of an end: step just under it from that end
            u = u_lo + _CLOSING * width_goal if u - u_lo <= u_hi - u else u_hi - _CLOSING * width_goal
        else:
            # land past the estimated root, on the side of the farther end
            u += _OVERSHOOT * width_goal if u_hi - u > u - u_lo else -_OVERSHOOT * width_goal
        margin = min(0.25 * width_goal, 0.25 * width)
        u = min(max(u, u_lo + margin), u_hi - margin)
        param = math.exp(u)
        if not low.param < param < high.param:
            break  # the bracket is down to adjacent floats
        point = evaluations(param)
        if evaluations.passes(point):
            high = point
        else:
            low = point
        widths.append(high.log_param - low.log_param)
    return evaluations.result(high, low, rtol, epsilon_rtol)


def _interpolated(evaluations: _Evaluations, low: _Point, high: _Point) -> float | None:
    """ln p where the interpolated excess is 0, strictly inside the bracket, or None (bisect).

    Tried in order: inverse quadratic interpolation through the last three points (ln p as a
    quadratic in the excess, as in Brent's method), the secant through the last two, the chord
    between the bracket's ends.
    """
    logarithmic = evaluations.aim > 0.0 and low.epsilon < math.inf and high.epsilon > 0.0
    recent = evaluations.order[-3:]
    for points in (recent, recent[-2:], [low, high]):
        if len(points) < 2:
            continue
        values = [evaluations.excess(point, logarithmic) for point in points]
        if not all(math.isfinite(h) for h in values) or len(set(values)) < len(values):
            continue
        # Lagrange form of the interpolating polynomial of ln p in the excess, at excess 0
        u = 0.0
        for i, point in enumerate(points):
            weight = 1.0
            for j, h in enumerate(values):
                if j != i:
                    weight *= h / (h - values[i])
            u += point.log_param * weight
        if low.log_param < u < high.log_param:
            return u
    return None


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
    epsilon_rtol: float | None = None,
    slope: float | None = None,
    on_evaluation: Callable[[float, float], None] | None = None,
) -> CalibrationResult:
    """``calibrate``, starting from ``guess`` instead of at the range's ends.

    For processes that are slow to evaluate far from the answer (a PLD at a small noise
    multiplier spans a wide range of privacy losses), and for an amplified bound capped by a
    cheap one (``calibrate_capped``). The guess (clipped to the range) is evaluated first; the
    next point is where ln epsilon would cross the target if it fell along ``slope`` (d ln
    epsilon / d ln param near the guess; default -1, epsilon ~ 1 / param as for a Gaussian at
    small epsilon: the true curves are steeper, so this step usually crosses), at most a factor
    ``spread`` away. While the budget is not crossed, each further step goes where the secant of
    the last two points crosses it, at most 4 times farther than the step before; then
    ``calibrate``'s search runs inside the bracket. Each parameter is evaluated once. Raises
    CalibrationRangeError (with ``end``) when it reaches param_max without meeting the budget
    or param_min meeting it, exactly when ``calibrate(budget, process_factory, param_min,
    param_max)`` would (unless ``epsilon_rtol`` stopped the search first).
    """
    rtol, epsilon_rtol = _check_common(budget, process_factory, rtol, allow_estimates, epsilon_rtol, on_evaluation)
    guess = positive_finite("guess", guess)
    param_min = positive_finite("param_min", param_min)
    param_max = positive_finite("param_max", param_max)
    if not param_min < param_max:
        raise InvalidArgumentError(
            f"param_min must be < param_max, got param_min={param_min!r}, param_max={param_max!r}"
        )
    if isinstance(spread, bool) or not isinstance(spread, numbers.Real) or not spread > 1.0:
        raise InvalidArgumentError(f"spread must be a number > 1, got {spread!r}")
    if slope is not None and (isinstance(slope, bool) or not isinstance(slope, numbers.Real)
                              or not (math.isfinite(slope) and slope < 0.0)):
        raise InvalidArgumentError(f"slope must be None or a finite number < 0 (epsilon falls as the parameter grows), "
                                   f"got {slope!r}")
    evaluations = _Evaluations(budget, process_factory, allow_estimates, epsilon_rtol, on_evaluation)
    logarithmic = evaluations.aim > 0.0
    u_min, u_max = math.log(param_min), math.log(param_max)
    shortest = _CLOSING * math.log1p(rtol)
    point, previous = evaluations(min(max(guess, param_min), param_max)), None
    step = math.log(spread)
    if evaluations.accepted(point):
        return evaluations.result(point, None, rtol, epsilon_rtol)
    while True:
        passing = evaluations.passes(point)
        if passing and point.param <= param_min:
            raise _min_error(evaluations, point, param_min)
        if not passing and point.param >= param_max:
            raise _max_error(evaluations, point, param_max)
        distance = _distance_to_crossing(evaluations, point, previous, -1.0 if slope is None else slope, logarithmic)
        longest = step if previous is None else 4.0 * step
        step = longest if distance is None else min(max(distance, shortest), longest)
        u = max(point.log_param - step, u_min) if passing else min(point.log_param + step, u_max)
        other = evaluations(param_min if u <= u_min else param_max if u >= u_max else math.exp(u))
        if evaluations.passes(other) != passing:
            low, high = (other, point) if passing else (point, other)
            if evaluations.accepted(high):
                return evaluations.result(high, low, rtol, epsilon_rtol)
            return _search(evaluations, low, high, rtol, epsilon_rtol)
        if evaluations.accepted(other):
            return evaluations.result(other, None, rtol, epsilon_rtol)
        point, previous = other, point


def _distance_to_crossing(evaluations, point, previous, slope: float, logarithmic: bool) -> float | None:
    """|ln param| from ``point`` to where ln epsilon crosses the aim: along the secant through
    ``previous`` when it falls, else along ``slope``; None on a linear scale or an infinite excess."""
    if not logarithmic:
        return None
    excess = evaluations.excess(point, True)
    if not math.isfinite(excess):
        return None
    if previous is not None:
        before = evaluations.excess(previous, True)
        if math.isfinite(before) and before != excess:
            secant = (excess - before) / (point.log_param - previous.log_param)
            if secant < 0.0:
                slope = secant
    return abs(excess / slope)


def calibrate_capped(
    budget: EpsilonBudget,
    process_factory: Callable[[float], object],
    cap_factory: Callable[[float], object],
    param_min: float,
    param_max: float,
    *,
    cap: CalibrationResult | None = None,
    rtol: float = 1e-4,
    epsilon_rtol: float | None = 1e-3,
    allow_estimates: bool = False,
    on_evaluation: Callable[[float, float], None] | None = None,
) -> CalibrationResult:
    """Calibrate a slow process whose epsilon never exceeds a fast one's (its cap) at the same parameter.

    The amplified balls-in-bins bound is such a process: it takes the smaller of its amplified
    epsilon and the unamplified bound's, which costs microseconds where the amplified one costs
    seconds. The cap's calibrated parameter p_cap (``calibrate(budget, cap_factory, param_min,
    param_max)``, or ``cap`` when already computed) then meets the budget for the slow process
    too, and the smallest one that does is <= p_cap: the search is ``calibrate_near`` with p_cap
    as its guess and its param_max, and the cap's own slope (d ln epsilon / d ln param over the
    1% below p_cap) as the slope of its first step. Where the amplification gains nothing, the
    first evaluation (at p_cap) is within ``epsilon_rtol`` of the target and the search stops
    there; otherwise the first step lands near the crossing and a secant finishes, if needed.

    The defaults suit an amplified noise multiplier: at most about 0.1% above the smallest one
    that meets the budget (epsilon within 0.1% of the target, or the parameter within 0.01%).
    The result always meets the budget: it is the evaluated process at the returned parameter.
    Raises CalibrationRangeError as ``calibrate`` does for the cap, or as ``calibrate_near`` when
    param_min already meets the budget; RuntimeError when the process misses the budget at p_cap
    (cap_factory does not cap it).
    """
    if cap is None:
        cap = calibrate(budget, cap_factory, param_min, param_max)
    elif not isinstance(cap, CalibrationResult):
        raise InvalidTypeError(f"cap must be None or the CalibrationResult of cap_factory, got {type(cap).__name__}")
    elif cap.budget != budget:
        raise InvalidArgumentError(
            f"cap was calibrated to {cap.budget}, not to {budget}; calibrate the cap to the same budget"
        )
    try:
        return calibrate_near(budget, process_factory, cap.param, param_min, cap.param, rtol=rtol,
                              allow_estimates=allow_estimates, epsilon_rtol=epsilon_rtol,
                              slope=_cap_slope(cap_factory, cap, budget.delta), on_evaluation=on_evaluation)
    except CalibrationRangeError as error:
        if error.end != "max":
            raise
        raise InvalidStateError(
            f"the process misses the budget (epsilon={budget.epsilon!r}, delta={budget.delta!r}) at "
            f"param={cap.param!r}, where cap_factory's process meets it: cap_factory does not cap "
            f"process_factory; calibrate the process with calibrate(...) instead"
        ) from None


def _cap_slope(cap_factory, cap: CalibrationResult, delta: float) -> float | None:
    """d ln epsilon / d ln param of the cap over the 1% below its calibrated parameter (None if flat)."""
    lower = float(cap_factory(cap.param * math.exp(-0.01)).epsilon_at(delta))
    if not (0.0 < cap.epsilon < math.inf and 0.0 < lower < math.inf):
        return None
    slope = (math.log(lower) - math.log(cap.epsilon)) / -0.01
    return slope if math.isfinite(slope) and slope < 0.0 else None
