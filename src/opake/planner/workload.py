"""The noise error of what an optimizer does with the noise, for any strategy with a Toeplitz C^{-1}.

A private step adds sigma * (C^{-1} z)_t to the clipped gradient sum (clip norm 1, before the
division by the batch size). What reaches the model depends on the optimizer, and
``strategy_for_optimizer`` states it as the BLT recipe's workload:

* prefix sums (Adam-type optimizers, and plain SGD without a schedule): the noise in the sum of
  the first t + 1 updates, row t of S C^{-1};
* torch.optim.SGD with momentum, dampening, Nesterov or a learning-rate schedule: the noise in
  the parameters after step t, row t of S D_eta F C^{-1} (``blt_workload.ParameterWorkload``;
  F is SGD's momentum filter, D_eta the learning rates).

``Workload.errors(inverse_coefficients)`` returns e_t = ||row t||^2, so the noise's standard
deviation in row t is sigma * sqrt(e_t): the error ``opake.planner.choice`` ranks mechanisms by,
at equal privacy. Every strategy opake runs (BLT, BandMF, the identity) has a lower-triangular
Toeplitz C^{-1}, given by the first column of its inverse (``Mechanism.inverse_coefficients``).

How, for SGD. torch's buffer starts as a copy of the first gradient (m_0 = g_0, undamped), then
m_t = beta m_{t-1} + (1 - tau) g_t; the update is m_t (Nesterov: g_t + beta m_t). So F is
Toeplitz with f_k = (1 - tau) beta^k (Nesterov: [k = 0] + beta^(k + 1); beta = 0: the identity)
except column 0, which is beta^t, and G = F C^{-1} is Toeplitz with d = f * c_hat except column
0, which adds r_t = (F[t, 0] - f_t) c_hat_0 = tau beta^t. Row t of P = S D_eta G holds
P[t, j] = sum_{s=j..t} eta_s d_{s-j} (plus sum_{s<=t} eta_s r_s at j = 0). Without a schedule
this is D_{t-j} with D = cumsum(d), and e_t = sum_{m<t} D_m^2 + (D_t + R_t)^2 for all t in O(n).
With a schedule each row is one FFT correlation (O(t log t)), so at most ``SCHEDULED_ROWS``
evenly spaced rows (and the last) are evaluated: the ranking's maximum is then over those rows.
Tested against torch.optim.SGD itself stepping on unit impulses (tests/torch/test_choice.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from opake.dpftrl.strategies.blt_workload import ParameterWorkload
from opake.dpftrl.strategies.toeplitz import per_query_errors
from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["SCHEDULED_ROWS", "Workload", "workload_of"]

# Rows evaluated under a learning-rate schedule (each an FFT of its length): enough to place the
# worst row within 1/512 of the run, a few tenths of a second at 10^4 steps.
SCHEDULED_ROWS = 512


@dataclass(frozen=True)
class Workload:
    """The noise's path into the model: prefix sums (``sgd`` None) or torch SGD's parameters.

    ``sgd`` is the ``ParameterWorkload`` (momentum, dampening, Nesterov) of torch.optim.SGD and
    ``learning_rates`` its planned schedule (None: constant, which scales every error alike and
    so leaves the ranking unchanged).
    """

    sgd: ParameterWorkload | None = None
    learning_rates: tuple | None = None

    @property
    def description(self) -> str:
        if self.sgd is None:
            return "prefix sums of the noise (the sum of the updates)"
        parts = [f"momentum {self.sgd.momentum:g}"]
        if self.sgd.effective_dampening:
            parts.append(f"dampening {self.sgd.effective_dampening:g}")
        if self.sgd.nesterov:
            parts.append("Nesterov")
        if self.learning_rates is not None:
            parts.append("its learning-rate schedule")
        return f"noise in the parameters of torch SGD ({', '.join(parts)})"

    def errors(self, inverse_coefficients) -> np.ndarray:
        """e_t for the evaluated rows t (all rows, or ``SCHEDULED_ROWS`` of them under a schedule)."""
        inverse = np.asarray(inverse_coefficients, dtype=np.float64)
        if self.sgd is None:
            return per_query_errors(inverse, momentum=1.0)
        return _parameter_errors(inverse, self.sgd, self.learning_rates)

    def max_error(self, inverse_coefficients) -> float:
        """max_t e_t: sigma * sqrt of it is the worst row's noise standard deviation."""
        return float(np.max(self.errors(inverse_coefficients)))

    def rmse(self, noise_multiplier: float, inverse_coefficients) -> float:
        return float(noise_multiplier) * math.sqrt(self.max_error(inverse_coefficients))


def workload_of(recipe) -> Workload:
    """The workload a BLT recipe from ``strategy_for_optimizer`` was optimized for."""
    sgd = getattr(recipe, "parameter_workload", None)
    if sgd is None:
        return Workload()
    rates = recipe.lr_schedule
    if rates is not None and not isinstance(rates, tuple):
        raise InvalidTypeError("a workload needs the schedule's values, not a callable; pass lr_schedule as a sequence")
    return Workload(sgd, rates)


def _momentum_filter(sgd: ParameterWorkload, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(f, r): F's Toeplitz coefficients and column 0's excess over them (times c_hat_0 = 1)."""
    beta, tau = sgd.momentum, sgd.effective_dampening
    f, r = np.zeros(n), np.zeros(n)
    if beta == 0.0:
        f[0] = 1.0
        return f, r
    powers = beta ** np.arange(n, dtype=np.float64)  # underflows to 0: those lags carry nothing
    if sgd.nesterov:  # tau = 0: column 0 is Toeplitz too
        f[:] = beta * powers
        f[0] += 1.0
        return f, r
    return (1.0 - tau) * powers, tau * powers


def _momentum_filtered(inverse: np.ndarray, sgd: ParameterWorkload) -> np.ndarray:
    """d = f * c_hat (the first n terms): F's Toeplitz part applied to C^{-1}'s column, as the
    one-pole recursive filter f is (f_k = (1 - tau) beta^k, or [k = 0] + beta^(k + 1) with
    Nesterov): O(n), where the FFT convolution it equals costs O(n log n) and 2n points."""
    from scipy.signal import lfilter

    beta, tau = sgd.momentum, sgd.effective_dampening
    if beta == 0.0:
        return inverse.copy()
    if sgd.nesterov:  # (1 + beta - beta z^-1) / (1 - beta z^-1)
        return lfilter([1.0 + beta, -beta], [1.0, -beta], inverse)
    return lfilter([1.0 - tau], [1.0, -beta], inverse)


def _parameter_errors(inverse: np.ndarray, sgd: ParameterWorkload, learning_rates) -> np.ndarray:
    from scipy.signal import fftconvolve  # imported when a schedule is ranked (scipy.signal is slow to import)

    n = inverse.shape[0]
    f, r = _momentum_filter(sgd, n)
    d = _momentum_filtered(inverse, sgd)
    if learning_rates is None:
        cumulative, excess = np.cumsum(d), np.cumsum(r)
        earlier = np.concatenate(([0.0], np.cumsum(cumulative[:-1] ** 2)))
        return earlier + (cumulative + excess) ** 2
    eta = np.asarray(learning_rates, dtype=np.float64)
    if eta.shape != (n,):
        raise InvalidArgumentError(f"the schedule has {eta.shape[0]} rates for {n} steps")
    rows = np.unique(np.linspace(0, n - 1, min(n, SCHEDULED_ROWS)).round().astype(np.int64))
    scaled_excess = np.cumsum(eta * r)
    errors = np.empty(rows.shape[0])
    for index, t in enumerate(rows):
        # P[t, j] = sum_{s=j..t} eta_s d_{s-j}: a correlation of eta[:t+1] with d[:t+1]
        row = fftconvolve(eta[: t + 1], d[t::-1])[t: 2 * t + 1]
        row[0] += scaled_excess[t]
        errors[index] = float(np.dot(row, row))
    return errors
