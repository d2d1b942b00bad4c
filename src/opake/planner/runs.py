"""The shape of a run over a data set: examples, batch size, epochs, and what they fix."""

from __future__ import annotations

from dataclasses import dataclass

from opake._checks import integer_at_least
from opake.errors import InvalidArgumentError

__all__ = ["DatasetRun"]


@dataclass(frozen=True)
class DatasetRun:
    """Training on ``num_examples`` examples, ``batch_size`` per step (expected), for ``epochs``.

    Derived: ``num_bins = num_examples // batch_size`` steps per epoch (the balls-in-bins bins),
    ``n_steps = epochs * num_bins``, ``sample_rate = batch_size / num_examples`` (Poisson DP-SGD).
    ``steps`` (optional) cuts the run at that horizon instead, inside its last epoch: ``n_steps`` is
    ``steps`` and ``epochs`` must be the epochs it reaches, ``ceil(steps / num_bins)``.
    """

    num_examples: int
    batch_size: int
    epochs: int
    steps: int | None = None

    def __post_init__(self):
        for name in ("num_examples", "batch_size", "epochs"):
            object.__setattr__(self, name, integer_at_least(name, getattr(self, name)))
        if self.batch_size > self.num_examples:
            raise InvalidArgumentError(
                f"batch_size ({self.batch_size}) must be <= num_examples ({self.num_examples}): a step "
                f"cannot use more examples than the data set holds; lower the batch size"
            )
        if self.steps is not None:
            object.__setattr__(self, "steps", integer_at_least("steps", self.steps))
            if self.epochs != -(-self.steps // self.num_bins):
                raise InvalidArgumentError(
                    f"steps={self.steps} reach {-(-self.steps // self.num_bins)} epoch(s) of {self.num_bins} steps, "
                    f"not epochs={self.epochs}: pass the epochs the horizon reaches")

    @property
    def num_bins(self) -> int:
        return self.num_examples // self.batch_size

    @property
    def n_steps(self) -> int:
        return self.epochs * self.num_bins if self.steps is None else self.steps

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.num_examples
