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
deviation in row t is sigma * sqrt(e_t): the error ``opake.torch.choice`` ranks mechanisms by,
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

import copy
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from opake.dpftrl.noise import blt_strategy
from opake.dpftrl.strategies.blt_workload import ParameterWorkload
from opake.dpftrl.strategies.toeplitz import per_query_errors
from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["SCHEDULED_ROWS", "Workload", "strategy_for_optimizer", "workload_of"]

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


def _parameter_errors(inverse: np.ndarray, sgd: ParameterWorkload, learning_rates) -> np.ndarray:
    from scipy.signal import fftconvolve  # imported when a schedule is ranked (scipy.signal is slow to import)

    n = inverse.shape[0]
    f, r = _momentum_filter(sgd, n)
    d = fftconvolve(f, inverse)[:n]
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


def strategy_for_optimizer(optimizer: torch.optim.Optimizer, n_steps: int, lr_scheduler=None):
    """The BLT recipe whose workload is the noise's path through ``optimizer``.

    ``torch.optim.SGD`` moves the parameters along the prefix sums of lr_t times its momentum
    buffer, so its noise in the parameters is S D_lr M C^{-1} z: ``blt_strategy(workload=
    "parameters", momentum, dampening, nesterov, lr_schedule)`` optimizes exactly that (docs/blt.md).
    The schedule is read by stepping deep copies of the optimizer and ``lr_scheduler`` through
    the ``n_steps`` planned steps (the caller's objects are not touched); ``lr_scheduler`` may
    also be a function ``(optimizer, n_steps) -> scheduler``, called on the copy. Plain SGD
    without a schedule is the prefix-sum workload, the default recipe. Optimizers whose update is
    not linear in the gradient (Adam, AdamW, RMSprop, ...) have no exact workload; they get the
    default recipe (prefix sums of the noise, docs/blt.md says why). Several parameter groups
    with different momentum settings also get the default.
    """
    if type(optimizer) is not torch.optim.SGD:
        return blt_strategy()
    settings = {(g["momentum"], g["dampening"], g["nesterov"]) for g in optimizer.param_groups}
    if len(settings) != 1:
        return blt_strategy()
    momentum, dampening, nesterov = settings.pop()
    schedule = None if lr_scheduler is None else _learning_rates(optimizer, lr_scheduler, n_steps)
    if momentum == 0 and schedule is None:
        return blt_strategy()
    return blt_strategy(workload="parameters", momentum=float(momentum), dampening=float(dampening),
                        nesterov=bool(nesterov), lr_schedule=schedule)


def _learning_rates(optimizer, lr_scheduler, n_steps: int) -> tuple:
    """The first group's learning rate at each of the next ``n_steps`` steps, read from copies.

    The optimizer and scheduler are deep-copied together (so the copy's scheduler drives the
    copy's optimizer) with every parameter replaced by a one-element stand-in: the model's
    weights are never copied and never change. A scheduler factory is called on the copy.
    """
    stand_ins = {id(p): nn.Parameter(torch.zeros(1)) for group in optimizer.param_groups for p in group["params"]}
    if _is_factory(lr_scheduler):
        optimizer_copy = copy.deepcopy(optimizer, memo=dict(stand_ins))
        scheduler_copy = lr_scheduler(optimizer_copy, n_steps)
    else:
        optimizer_copy, scheduler_copy = copy.deepcopy((optimizer, lr_scheduler), memo=dict(stand_ins))
    rates = []
    try:
        with warnings.catch_warnings():
            # Only the copied scheduler steps: the copied optimizer's step may be a wrapper bound
            # to the caller's optimizer, so it is never called (torch then warns about the order).
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(n_steps):
                rates.append(float(optimizer_copy.param_groups[0]["lr"]))
                scheduler_copy.step()
    except TypeError as error:
        raise InvalidArgumentError(
            f"cannot read the learning-rate schedule by stepping a copy of {type(scheduler_copy).__name__} "
            f"({error}); pass strategy=blt_strategy(workload='parameters', momentum=..., lr_schedule=[...]) "
            f"with the planned rates yourself"
        ) from None
    return tuple(rates)


def _is_factory(lr_scheduler) -> bool:
    """A function building the scheduler (not a scheduler, which has ``step``)."""
    return callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
