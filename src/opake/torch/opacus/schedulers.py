"""Opacus' noise and clipping schedulers, for a plan that fixes both: ``StepNoise``, ``StepGradClip``.

Opacus' ``StepNoise(optimizer, step_size, gamma)`` multiplies ``optimizer.noise_multiplier`` by
``gamma`` every ``step_size`` calls of its ``step()`` (``StepGradClip`` does so to
``max_grad_norm``), and its accountant prices each step at the multiplier it ran with. Here the
plan fixes the noise multiplier and the clipping bound for the whole run, and the noise engine and
accountant are built for exactly those. These schedulers keep Opacus' interface and counting
(``step()``, ``state_dict()``, ``load_state_dict()``, and a first ``step()`` when built), and a
``step()`` that would change the value is refused before anything changes
(``ScheduleChangesPlanError``): plan the run at the noise and bound it trains with. A step that
leaves the value as it is (``gamma=1``, or the zero multiplier of a noise-free run) is accepted,
which is what Opacus' own checkpoint tests do with them.
"""

from __future__ import annotations

from opake.errors import InvalidArgumentError, OpakeError

__all__ = ["ScheduleChangesPlanError", "StepGradClip", "StepNoise"]


class ScheduleChangesPlanError(OpakeError, ValueError):
    """A scheduler's step would change the noise multiplier or the clipping bound the run was planned with."""


class _StepSchedule:
    """Multiply the optimizer's ``attribute`` by ``gamma`` every ``step_size`` steps (module docstring)."""

    attribute = ""

    def __init__(self, *, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise InvalidArgumentError(f"step_size must be an integer >= 1, got {step_size!r}")
        self.optimizer = optimizer
        self.step_size = step_size
        self.gamma = float(gamma)
        self.last_epoch = int(last_epoch)
        self.step()  # as Opacus' schedulers do when built

    def _scheduled(self, current: float) -> float:
        if self.last_epoch == 0 or self.last_epoch % self.step_size:
            return current
        return self.gamma * current

    def step(self) -> None:
        current = getattr(self.optimizer, self.attribute)
        self.last_epoch += 1
        value = self._scheduled(current)
        if value != current:
            self.last_epoch -= 1
            raise ScheduleChangesPlanError(
                f"{type(self).__name__}.step() would change {self.attribute} from {current} to {value}, but the run "
                f"was planned, and its accountant prices it, at {current} for every step; nothing was changed. Plan "
                f"the run at the value it trains with (make_private's {self.attribute}=), or drop the scheduler"
            )

    def state_dict(self) -> dict:
        """What Opacus' schedulers save: every setting but the optimizer."""
        return {"step_size": self.step_size, "gamma": self.gamma, "last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        for name in ("step_size", "gamma", "last_epoch"):
            setattr(self, name, state_dict[name])


class StepNoise(_StepSchedule):
    """Opacus' ``StepNoise`` over ``optimizer.noise_multiplier``; refuses to change it (module docstring)."""

    attribute = "noise_multiplier"


class StepGradClip(_StepSchedule):
    """Opacus' ``StepGradClip`` over ``optimizer.max_grad_norm``; refuses to change it (module docstring)."""

    attribute = "max_grad_norm"
