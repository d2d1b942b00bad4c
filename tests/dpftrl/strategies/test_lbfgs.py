"""The stall rules of ``lbfgs.minimize_until_stalled`` (shared by the BandMF and BLT optimizers)."""

from __future__ import annotations

import numpy as np
import pytest

from opake.dpftrl.strategies.lbfgs import minimize_until_stalled

RULES = dict(stall=1e-9, window=20, max_iterations=2000, ftol=1e-15, gtol=1e-12, maxcor=10)


def _noisy_bowl():
    """An ill-conditioned quadratic around 25 (the size of a log loss) with noise of 1e-13 in
    its value, like the rounding of a long sum: once converged, L-BFGS-B's line searches fail on
    the noise (up to 20 evaluations each). Records the values it returns."""
    scale = np.array([1.0, 1e3, 1e6])
    values = []

    def objective(x):
        diff = x - 1.0
        value = 25.0 + float(np.sum(scale * diff * diff)) + 1e-13 * np.sin(1e9 * float(np.sum(x)))
        values.append(value)
        return value, 2.0 * scale * diff

    return objective, values


def test_the_evaluation_rule_stops_a_converged_run_that_only_fails_line_searches():
    objective, plain = _noisy_bowl()
    x_plain, f_plain, _ = minimize_until_stalled(objective, np.zeros(3), **RULES)
    objective, windowed = _noisy_bowl()
    x, f, _ = minimize_until_stalled(objective, np.zeros(3), evaluation_window=10, **RULES)
    assert len(windowed) < len(plain)
    # it stopped exactly when the last 10 evaluations had gained less than the stall tolerance
    best = np.minimum.accumulate(windowed)
    gains = best[:-10] - best[10:]
    assert gains[-1] < RULES["stall"] and np.all(gains[:-1] >= RULES["stall"])
    # and returns the best point it evaluated, as good as the plain run's up to the tolerance
    assert f == best[-1] and f <= f_plain + RULES["stall"]
    np.testing.assert_allclose(x, 1.0, atol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_non_finite_values_are_never_the_best_point(window):
    # the second evaluation reports -inf (an overflow far out on a line search, say): L-BFGS-B sees
    # a huge value and backs off, and the point is never returned as the best
    calls, finite = [], []

    def objective(x):
        calls.append(np.array(x))
        if len(calls) == 2:
            return float("-inf"), np.zeros(1)
        finite.append(float((x[0] - 1.0) ** 2))
        return finite[-1], np.array([2.0 * (x[0] - 1.0)])

    x, f, _ = minimize_until_stalled(objective, np.array([-30.0]), evaluation_window=window, **RULES)
    assert len(calls) > 2 and f == min(finite) and not np.array_equal(x, calls[1])
