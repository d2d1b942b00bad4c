"""The privacy-process protocol and the checks every process applies to its arguments.

A *privacy process* is anything that can state its (epsilon, delta)-DP guarantee in both
directions: ``epsilon_at(delta)`` (the smallest epsilon it certifies at that delta) and
``delta_at(epsilon)`` (the smallest delta it certifies at that epsilon). Both are
non-increasing in their argument. Processes are frozen values; amplifiers wrap them and
``calibrate`` searches over a family of them.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from opake._checks import positive_finite, real_number
from opake.errors import ConvergenceError, InvalidArgumentError


@runtime_checkable
class PrivacyProcess(Protocol):
    """What ``calibrate`` and the amplifiers need from a privacy process.

    ``is_guarantee`` is True when the numbers are proven upper bounds, False when they are
    estimates (for example Monte Carlo); ``description`` says in words what was computed.
    """

    is_guarantee: bool
    description: str

    def epsilon_at(self, delta: float) -> float:
        """Smallest epsilon such that the process is (epsilon, delta)-DP."""
        ...

    def delta_at(self, epsilon: float) -> float:
        """Smallest delta such that the process is (epsilon, delta)-DP."""
        ...


def check_delta(delta, name: str = "delta") -> float:
    """``delta`` as a float in the open interval (0, 1), or a ValueError/TypeError saying why not."""
    value = real_number(name, delta)
    if not (0.0 < value < 1.0):
        raise InvalidArgumentError(
            f"{name} must be in the open interval (0, 1), got {delta!r}; "
            "a usual choice is 1e-5 or below 1 / (number of protected units)"
        )
    return value


def check_epsilon(epsilon, name: str = "epsilon") -> float:
    """``epsilon`` as a finite float >= 0, or a ValueError/TypeError saying why not."""
    value = real_number(name, epsilon)
    if not (math.isfinite(value) and value >= 0.0):
        raise InvalidArgumentError(
            f"{name} must be a finite number >= 0, got {epsilon!r}; "
            "use epsilon=0 for the pure hockey-stick divergence at e^0 = 1"
        )
    return value


def check_noise_multiplier(noise_multiplier, name: str = "noise_multiplier") -> float:
    """A finite noise multiplier > 0 (the noise standard deviation over the clip norm)."""
    return positive_finite(name, noise_multiplier,
                           "to find one for a privacy budget use opake.accounting.calibrate")


def smallest_epsilon(delta_of_epsilon, delta: float, upper: float, *, rtol: float = 1e-12) -> float | None:
    """The smallest epsilon in [0, upper] with ``delta_of_epsilon(epsilon) <= delta``, or None.

    ``delta_of_epsilon`` must be non-increasing (every delta(epsilon) curve is). Brent's method
    on ln(delta(epsilon)) - ln(delta) (delta(epsilon) falls roughly exponentially, so this is
    smooth), to ``rtol``; the root is then moved up until the curve, as computed, is <= delta,
    so the result is never below what the curve certifies. None when even ``upper`` misses delta.
    """
    import scipy.optimize

    if delta_of_epsilon(0.0) <= delta:
        return 0.0
    if not (math.isfinite(upper) and delta_of_epsilon(upper) <= delta):
        return None
    log_delta = math.log(delta)

    def excess(epsilon: float) -> float:
        return math.log(max(delta_of_epsilon(epsilon), 5e-324)) - log_delta

    root = scipy.optimize.brentq(excess, 0.0, upper, xtol=rtol * max(1.0, upper), rtol=max(rtol, 4e-16))
    return certified_epsilon(delta_of_epsilon, delta, root, upper=upper, first_step=rtol * max(1.0, root))


def certified_epsilon(delta_of_epsilon, delta: float, epsilon: float, *, upper: float = math.inf,
                      first_step: float = 0.0) -> float:
    """``epsilon``, rounded up until ``delta_of_epsilon(epsilon) <= delta`` holds as computed.

    An inversion in closed form or by root finding lands within a few ulps of the root, on
    either side; the side that matters is the one ``delta_at`` then sees. This moves epsilon up
    (first by ``first_step`` or one ulp, then by doubling steps, never past ``upper``, where the
    caller has checked the curve is <= delta) until the curve, evaluated exactly as the process
    evaluates it, is <= delta, so ``delta_at(epsilon_at(d)) <= d`` holds in floats, not only in
    exact arithmetic. ``delta_of_epsilon`` must be non-increasing. An infinite epsilon is
    returned as it is (nothing finite is certified). Raises RuntimeError if 2000 steps do not
    reach a certified value (a curve that never falls to delta below ``upper``).
    """
    value = float(epsilon)
    if not math.isfinite(value):
        return value
    step = max(float(first_step), math.ulp(max(value, 1.0)))
    for _ in range(2000):
        if delta_of_epsilon(value) <= delta:
            return value
        if value >= upper:
            break
        value = min(value + step, upper) if value + step > value else math.nextafter(value, math.inf)
        step *= 2.0
    raise ConvergenceError(
        f"could not certify delta={delta!r}: the delta(epsilon) curve stays above it up to epsilon={value!r}; "
        "this is a bug in the process's delta_at or epsilon_at, please report it"
    )
