"""DP-SGD runs planned without ``epochs=``: the horizon they are planned for, and the epsilon they report.

Opacus' ``make_private(noise_multiplier=S)`` takes no number of epochs: its noise does not depend
on the horizon and its accountant composes the steps as they are taken. The adapter does the same
for DP-SGD (the identity strategy), whose noise is independent from step to step, on both samplers:

* Poisson sampling (the default): the run is planned for ``UNPLANNED_EPOCHS`` epochs and
  ``PrivateTraining.epsilon_spent`` prices the steps taken (the PLD of the Poisson-subsampled
  Gaussian composed once per step taken).
* Balls in bins (``poisson_sampling=False``, as Opacus' examples/imdb.py): every example is put
  in one random bin of ``k = len(dataset) // batch_size`` when the run is planned and keeps it
  (bin j is the batch of step j of every epoch). The first ``e`` epochs are then exactly the
  plan's mechanism over a horizon of ``e * k`` steps, priced by the plan's own accountant for that
  prefix (the random-allocation PLD, a bound proven for it); a step inside epoch ``e`` is priced
  as the whole epoch (its releases are a post-processing of the epoch's), so ``get_epsilon``
  grows epoch by epoch as the loop runs (one evaluation per epoch and delta, kept: about 3 s an
  epoch at IMDB's 25000 examples and batch 64). ``UnplannedEpochsTraining`` reports it.

Every other mechanism's noise or accounting depends on the horizon and needs ``epochs=``. The
planned horizon is a limit on the loop, not a claim: a pass beyond it raises ``PlanExhaustedError``,
and ``private.epsilon`` is the epsilon of all ``UNPLANNED_EPOCHS`` epochs.
"""

from __future__ import annotations

import opake.accounting as acc
from opake.errors import InvalidTypeError
from opake.torch.private import PrivateTraining

__all__ = ["UNPLANNED_EPOCHS", "UnplannedEpochsTraining", "unplanned_horizon", "priced_as_it_goes"]

# Beyond the runs Opacus' examples train (10 to 90 epochs). Planning prices the whole horizon once
# (0.5 to 3 s: the Poisson PLD composed 100 epochs' steps, or the random allocation over them).
UNPLANNED_EPOCHS = 100


def is_dp_sgd(strategy) -> bool:
    """Whether ``strategy`` is DP-SGD's (the identity: one band, noise independent across steps)."""
    return getattr(strategy, "bands", None) == 1


def unplanned_horizon(strategy) -> int:
    """The epochs a run without ``epochs=`` is planned for: ``UNPLANNED_EPOCHS`` for DP-SGD on either
    sampler; refused for every other strategy (its noise or accounting depends on the horizon)."""
    if is_dp_sgd(strategy):
        return UNPLANNED_EPOCHS
    raise InvalidTypeError(
        f"make_private without epochs= plans DP-SGD only (its noise is independent across steps, priced as the "
        f"steps are taken); {type(strategy).__name__}'s correlated noise is optimized and priced for the run's "
        f"length: add epochs=EPOCHS (the number of epochs the loop runs)"
    )


class UnplannedEpochsTraining(PrivateTraining):
    """A balls-in-bins DP-SGD run planned without ``epochs=``: ``epsilon_spent`` prices the epochs begun
    (module docstring)."""

    def epsilon_spent(self, delta: float | None = None) -> float:
        """The epsilon of the epochs begun so far (the plan's accountant over their whole horizon), at
        ``delta`` (default the plan's); 0 before the first step, never falling."""
        delta = self.plan.delta if delta is None else acc.process.check_delta(delta)
        steps = self.steps_taken
        if steps == 0:
            return 0.0
        cycle, n_steps = self.plan.participation.min_sep, self.plan.n_steps
        horizon = min(n_steps, -(-steps // cycle) * cycle)  # the end of the epoch this step is in
        value = self.plan.accountant.epsilon_at(delta) if horizon >= n_steps else self._prefix_epsilon(horizon, delta)
        # Each value is a valid bound for the steps taken; the running maximum only shields the report
        # from the last digits of a numerical bound.
        value = self._reported[delta] = max(value, self._reported.get(delta, 0.0))
        return value


def priced_as_it_goes(private: PrivateTraining) -> None:
    """Make a freshly planned balls-in-bins DP-SGD run report the epochs begun (the same object)."""
    if type(private) is not PrivateTraining:
        raise InvalidTypeError(f"expected make_private's PrivateTraining, got {type(private).__name__}")
    private.__class__ = UnplannedEpochsTraining  # overrides epsilon_spent only: no state moves
