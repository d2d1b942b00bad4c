"""``privacy_engine.accountant``: Opacus' accountant calls, answered from the planned run.

Opacus' examples print ``privacy_engine.accountant.get_epsilon(delta=...)`` every epoch (or
every few steps); Opacus' checkpoints save ``accountant.state_dict()``. Here the accountant is a
view of the run the engine planned: ``get_epsilon(delta)`` is the epsilon spent by the steps
taken so far (``PrivateTraining.epsilon_spent``), ``mechanism()`` the bound that prices the run
(``"pld"``, ``"rigorous"``, ``"allocation_pld"``: ``AccountingMethod``), ``history`` the run
in Opacus' form ``[(noise_multiplier, sample_rate, steps)]``. It keeps nothing of its own: the
steps taken are the run's, restored with the run's checkpoint (``load_checkpoint``).

``get_epsilon`` is ``PrivateTraining.epsilon_spent``: the guarantee of the first t releases,
never above the planned run's and non-decreasing in t (one PLD evaluation per call and step for
Poisson sampling, cached; 0.1 to 2 s at 10^4 steps, as Opacus' PRV).

``history`` is what the run's weights went through: the run's own steps, after any steps a
noise-free checkpoint loaded into it had taken (``inherited``: ``opake.torch.opacus.checkpoint``,
which then also makes ``get_epsilon`` infinite). ``state_dict()`` is that history, as Opacus'
accountants save theirs.
"""

from __future__ import annotations

from opake.errors import InvalidTypeError

__all__ = ["RunAccountant"]


class RunAccountant:
    """Opacus' accountant interface over the engine's planned run (module docstring)."""

    def __init__(self, engine):
        self._engine = engine
        self.inherited: list = []  # the noise-free steps a loaded checkpoint's weights went through

    @property
    def _private(self):
        return self._engine.private

    def get_epsilon(self, delta: float, **ignored) -> float:
        """The epsilon spent by the steps taken so far, at ``delta`` (0 before a run is planned).

        Opacus' keyword options (``eps_error``, ``delta_error``, ``poisson``) are accepted and
        ignored: opake's bound has its own, tighter, discretization.
        """
        if self._private is None:
            return 0.0
        return self._private.epsilon_spent(delta)

    def mechanism(self) -> str:
        """The bound pricing the run (``"pld"``, ``"rigorous"``, ``"allocation_pld"``); "none" unplanned."""
        return "none" if self._private is None else str(self._private.plan.accounting)

    @property
    def history(self) -> list:
        """The run so far as Opacus states it: ``[(noise_multiplier, sample_rate, steps)]`` (the rate
        is None for balls in bins and the loader's own batches), after ``inherited``."""
        private = self._private
        if private is None or private.steps_taken == 0:
            return list(self.inherited)
        rate = private.plan.sample_rate if private.run.batches.sampler is not None else None  # None: the loader's
        return [*self.inherited, (private.noise_multiplier, rate, private.steps_taken)]

    def __len__(self) -> int:
        return len(self.history)

    def state_dict(self) -> dict:
        """The history (plain values), as Opacus' accountants save theirs."""
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        raise InvalidTypeError(
            "the accountant keeps nothing of its own: the steps taken are the run's and come back with the run's "
            "checkpoint; use privacy_engine.load_checkpoint(path=..., module=..., optimizer=...)"
        )
