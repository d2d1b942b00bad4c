"""The workload recipe of a torch optimizer: what it does with the noise, read from the optimizer.

``strategy_for_optimizer(optimizer, n_steps, lr_scheduler)`` is the BLT recipe whose workload is
the noise's path through ``optimizer`` (its momentum, dampening, Nesterov and learning-rate
schedule, read from copies); ``opake.planner.workload`` computes that workload's errors.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from opake.dpftrl.noise import blt_strategy
from opake.errors import InvalidArgumentError

__all__ = ["strategy_for_optimizer"]


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
