"""A run that ends short of its plan says what it spent: ``ShortRunWarning``.

``private.epsilon`` is the guarantee of the whole planned run, reached at its last step. A loop
that stops early (one pass over ``private.data_loader`` of a five-epoch plan, an early-stopping
callback) has spent less, ``private.epsilon_spent()``, and has also trained less than planned:
both are worth knowing before an epsilon is reported. Nothing can tell "stopped" from "not yet
done" while a run is between steps, so the warning is given where a short run shows itself:

* reading ``private.epsilon`` after the first step and before the last (once per run): the value
  read is not what the steps so far spent;
* ``private.detach()`` before the last step: the run is ended on purpose, short;
* ``DPTrainer.train()`` returning before the last step (a callback stopped it).

Not at garbage collection or interpreter exit: a script, notebook or test that drops a run it
no longer needs would be warned about a run nobody reports, and the cost of ``epsilon_spent()``
would land on whatever code happens to trigger the collection. Reading ``private.epsilon`` before
the first step (to see the plan) or after the last, and ``epsilon_spent()`` at any time, never warn.
"""

from __future__ import annotations

import warnings

__all__ = ["ShortRunWarning", "warn_if_short"]


class ShortRunWarning(UserWarning):
    """A private run ended (or its planned epsilon was read) before its last planned step."""


def warn_if_short(private, what: str, *, once: bool = False, stacklevel: int = 3) -> None:
    """Warn (``ShortRunWarning``) if ``private`` (a ``PrivateTraining``) has taken some but not all
    of its planned steps. ``what`` names the call that found it; ``once=True`` warns at most once
    per run for that call (``private.epsilon`` may be read every step by a logging loop)."""
    steps, planned = private.steps_taken, private.plan.n_steps
    if not 0 < steps < planned:
        return
    if once:
        warned = private.__dict__.setdefault("_short_run_warned", set())
        if what in warned:
            return
        warned.add(what)
    warnings.warn(
        f"{what}: this private run has taken {steps} of its {planned} planned steps. It has spent epsilon "
        f"{private.epsilon_spent():.4g} at delta {private.delta:g} (private.epsilon_spent()); the planned "
        f"{private.plan.epsilon:.4g} (private.epsilon) is the guarantee of all {planned} steps. If training "
        f"stopped here, report epsilon_spent() and check the loop: each pass over private.data_loader serves "
        f"one planned epoch of {private.plan.steps_per_epoch} steps",
        ShortRunWarning, stacklevel=stacklevel)
