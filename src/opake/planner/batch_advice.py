"""Which batch size and how many epochs give the chosen mechanism the least noise per example.

A private run's update after n steps of batch B carries the signal of the B * n examples it
processed and the noise of the workload (the worst step's noise standard deviation on it, the
error the choice ranks by, ``opake.planner.choice``). So the number to compare across batch sizes
and epochs at one budget is the **noise per example processed**: that error divided by B * n
(= N * E, every example once an epoch). The noise multiplier a budget allows grows with the
batch's sampling rate and with the number of epochs, but more slowly than the examples processed
do in the regimes the papers measure, which is why large batches and several epochs pay
(the noise-batch ratio sigma / B of Ponomareva et al., "How to DP-fy ML", JAIR 2023).

``batch_advice(choice, num_examples)`` recalibrates the chosen mechanism (same kind, same
recipe, same band count) at batch sizes B/4 .. 4B and epochs E/2 .. 2E at the same budget and
ranks them: the setting with the least noise per example processed is the advice. Noise alone:
the compute each setting costs, and how the optimizer and the learning rate respond to larger
batches, are not counted (more epochs cost more compute). The Poisson mechanisms are calibrated
on the coarse ranking grid (``CHOICE_DISCRETIZATION``, sigmas up to 3% above the plan's), the
BLT exactly; a learning-rate schedule is dropped from the workload (its length is the run's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from opake.accounting import epsilon_budget
from opake.dpftrl.accounting.accountant import balls_in_bins_accountant
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.planner.bands import coarse_band_candidate
from opake.planner.calibration import calibrate_noise
from opake.planner.runs import DatasetRun
from opake.planner.workload import Workload

__all__ = ["BatchAdvice", "BatchSetting", "batch_advice"]

BATCH_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
EPOCH_FACTORS = (0.5, 1.0, 2.0)


@dataclass(frozen=True)
class BatchSetting:
    """One (batch size, epochs) at the budget: the noise multiplier, the workload error (worst
    step's noise standard deviation, clip norm 1, before dividing by the batch size) and that
    error per example processed."""

    batch_size: int
    epochs: int
    n_steps: int
    noise_multiplier: float
    error: float

    @property
    def noise_per_example(self) -> float:
        return self.error / (self.batch_size * self.n_steps)


@dataclass(frozen=True)
class BatchAdvice:
    """The chosen mechanism at each setting tried; ``best`` has the least noise per example
    processed, ``current`` is the requested run."""

    mechanism: str
    settings: tuple
    current: BatchSetting
    best: BatchSetting

    def table(self) -> str:
        lines = [f"{self.mechanism} at the same budget, by batch size and epochs (noise per example processed = "
                 f"worst-step error / (batch size * steps); lower is better):",
                 f"  {'batch':>7} {'epochs':>6} {'steps':>7} {'noise mult.':>11} {'error':>10} {'per example':>12}"]
        for s in self.settings:
            mark = "  <- least" if s == self.best else ("  <- requested" if s == self.current else "")
            lines.append(f"  {s.batch_size:>7} {s.epochs:>6} {s.n_steps:>7} {s.noise_multiplier:>11.4g} "
                         f"{s.error:>10.4g} {s.noise_per_example:>12.4g}{mark}")
        gain = self.current.noise_per_example / self.best.noise_per_example
        largest = (self.best.batch_size == max(s.batch_size for s in self.settings)
                   and self.best.epochs == max(s.epochs for s in self.settings))
        if largest:
            lines.append("The noise per example keeps falling toward larger batches and more epochs (the largest "
                         "tried is least): grow them as far as compute allows.")
        if self.best == self.current:
            lines.append("The requested setting has the least noise per example among those tried.")
        else:
            lines.append(f"Batch {self.best.batch_size} for {self.best.epochs} epoch(s) has {gain:.2f}x less noise per "
                         f"example processed than the requested batch {self.current.batch_size}, "
                         f"{self.current.epochs} epoch(s) (noise alone: compute and learning rate not counted).")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def batch_advice(choice, num_examples: int, *, batch_factors=BATCH_FACTORS, epoch_factors=EPOCH_FACTORS) -> BatchAdvice:
    """The chosen mechanism of ``choice`` (a ``MechanismChoice`` for ``num_examples`` examples)
    recalibrated at batch sizes ``batch_factors`` x and epochs ``epoch_factors`` x the request's
    (module docstring)."""
    chosen = choice.chosen
    n_steps = chosen.accountant.n_steps
    batch_size = _requested_batch(chosen, num_examples, n_steps)
    epochs = max(1, round(n_steps / (num_examples // batch_size)))
    budget = epsilon_budget(choice.target_epsilon, choice.target_delta)
    workload = Workload(choice.workload.sgd)  # the schedule's rates are the requested run's length
    settings, current = [], None
    for batch in sorted({max(1, int(round(batch_size * f))) for f in batch_factors}):
        for passes in sorted({max(1, int(round(epochs * f))) for f in epoch_factors}):
            if not 2 * batch <= num_examples:
                continue
            setting = _setting(chosen, DatasetRun(num_examples, batch, passes), budget, workload)
            if setting is None:
                continue
            settings.append(setting)
            if batch == batch_size and passes == epochs:
                current = setting
    best = min(settings, key=lambda s: s.noise_per_example)
    return BatchAdvice(chosen.name, tuple(settings), current if current is not None else best, best)


def _requested_batch(chosen, num_examples: int, n_steps: int) -> int:
    if chosen.sampling == "poisson":
        groups = int(getattr(chosen.strategy, "bands", 1))
        return int(round(chosen.sample_rate * num_examples / groups))
    return num_examples // chosen.accountant.num_bins


def _setting(chosen, run: DatasetRun, budget, workload: Workload) -> BatchSetting | None:
    strategy = chosen.strategy
    if chosen.sampling == "poisson":
        bands = int(getattr(strategy, "bands", 1))
        if run.batch_size * bands > run.num_examples or bands > max(1, run.num_bins):
            return None
        candidate = coarse_band_candidate(run.num_examples, run.batch_size, run.epochs, budget.epsilon, budget.delta,
                                          strategy)
        sigma = candidate.noise_multiplier
        mechanism = strategy.resolve(run.n_steps, bands, -(-run.n_steps // bands))
    else:
        if getattr(strategy, "lr_schedule", None) is not None:
            strategy = dataclasses.replace(strategy, lr_schedule=None)
        method = AccountingMethod(chosen.accounting)
        accountant = balls_in_bins_accountant(strategy, run.num_bins, run.n_steps, method)
        result = calibrate_noise(accountant, budget)
        sigma, mechanism = result.sigma, result.process.mechanism
    error = workload.rmse(sigma, mechanism.inverse_coefficients(run.n_steps))
    if not math.isfinite(error):
        return None
    return BatchSetting(run.batch_size, run.epochs, run.n_steps, sigma, error)
