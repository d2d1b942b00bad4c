"""L-BFGS-B with a stall rule, shared by the strategy optimizers (float64, scipy)."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits


def minimize_until_stalled(
    objective: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    *,
    stall: float,
    window: int,
    max_iterations: int,
    ftol: float,
    gtol: float,
    maxcor: int,
    bounds=None,
) -> tuple[np.ndarray, float, int]:
    """The best point L-BFGS-B evaluated, its value, and the number of iterations.

    ``objective(x) -> (value, gradient)``; a non-finite value is reported to L-BFGS-B as a huge
    one with zero gradient, so the line search backs off. Besides scipy's own tests, the run
    stops once ``window`` iterations lowered the best value by less than ``stall``: a parameter
    drifting toward a bound can creep for hundreds of iterations while the value changes in
    the 8th digit.
    """
    best = {"f": math.inf, "x": np.array(x0, dtype=np.float64)}
    history = []

    def tracked(x):
        value, gradient = objective(x)
        if not math.isfinite(value):
            return 1e300, np.zeros_like(x)
        if value < best["f"]:
            best["f"], best["x"] = value, np.array(x)
        return value, gradient

    def stop_when_stalled(_):
        history.append(best["f"])
        if len(history) > window and history[-window - 1] - history[-1] < stall:
            raise StopIteration

    # The linear algebra is tiny (tens to a thousand variables): BLAS threads only add latency.
    with threadpool_limits(limits=1, user_api="blas"):
        minimize(
            tracked, best["x"], jac=True, method="L-BFGS-B", callback=stop_when_stalled, bounds=bounds,
            options={"maxiter": max_iterations, "ftol": ftol, "gtol": gtol, "maxcor": maxcor},
        )
    return best["x"], best["f"], len(history)
