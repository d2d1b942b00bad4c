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
    evaluation_window: int | None = None,
) -> tuple[np.ndarray, float, int]:
    """The best point L-BFGS-B evaluated, its value, and the number of iterations.

    ``objective(x) -> (value, gradient)``; a non-finite value is reported to L-BFGS-B as a huge
    one with zero gradient, so the line search backs off. Besides scipy's own tests, the run
    stops once ``window`` iterations lowered the best value by less than ``stall``: a parameter
    drifting toward a bound can creep for hundreds of iterations while the value changes in
    the 8th digit. Given ``evaluation_window``, it also stops once that many evaluations lowered
    the best value by less than ``stall``: at a converged point the line searches fail on
    rounding noise, and each failure costs up to 20 evaluations without an iteration.
    """
    best = {"f": math.inf, "x": np.array(x0, dtype=np.float64)}
    history = []      # the best value after each iteration
    evaluations = []  # ... and after each evaluation

    def stop_when_stalled(values, span):
        # StopIteration: from the callback it is scipy's protocol to stop; from the objective
        # (a line search in progress) it leaves minimize, and is caught below
        if len(values) > span and values[-span - 1] - values[-1] < stall:
            raise StopIteration

    def tracked(x):
        value, gradient = objective(x)
        finite = math.isfinite(value)
        if finite and value < best["f"]:
            best["f"], best["x"] = value, np.array(x)
        if evaluation_window is not None:
            evaluations.append(best["f"])
            stop_when_stalled(evaluations, evaluation_window)
        if not finite:
            return 1e300, np.zeros_like(x)
        return value, gradient

    def after_iteration(_):
        history.append(best["f"])
        stop_when_stalled(history, window)

    # The linear algebra is tiny (tens to a thousand variables): BLAS threads only add latency.
    with threadpool_limits(limits=1, user_api="blas"):
        try:
            minimize(
                tracked, best["x"], jac=True, method="L-BFGS-B", callback=after_iteration, bounds=bounds,
                options={"maxiter": max_iterations, "ftol": ftol, "gtol": gtol, "maxcor": maxcor},
            )
        except StopIteration:
            pass  # the evaluation rule stopped a line search: the best point so far is the answer
    return best["x"], best["f"], len(history)
