"""The participation context of a run: how often, and how far apart, one unit contributes."""

from __future__ import annotations

from dataclasses import dataclass

from opake._checks import integer_at_least
from opake.errors import InvalidArgumentError


def _positive_int(name: str, value, upper: int | None = None, upper_name: str = "") -> int:
    value = integer_at_least(name, value)
    if upper is not None and value > upper:
        raise InvalidArgumentError(f"{name} must be <= {upper_name} ({upper}), got {value}")
    return value


@dataclass(frozen=True)
class Participation:
    """One frozen value for ``(n_steps, min_sep, max_participations)``.

    A protected unit contributes to at most ``max_participations`` steps of the ``n_steps``
    steps, any two of them at least ``min_sep`` steps apart (min_sep = b, max_participations =
    k in the papers). ``max_participations=None`` means every contribution the horizon and the
    separation allow, ceil(n_steps / min_sep).
    """

    n_steps: int
    min_sep: int = 1
    max_participations: int | None = None

    def __post_init__(self):
        n = _positive_int("n_steps", self.n_steps)
        b = _positive_int("min_sep", self.min_sep, upper=n, upper_name="n_steps")
        k = self.max_participations
        if k is not None:
            k = _positive_int("max_participations", k)
        object.__setattr__(self, "n_steps", n)
        object.__setattr__(self, "min_sep", b)
        object.__setattr__(self, "max_participations", k)

    @property
    def max_possible_participations(self) -> int:
        """ceil(n_steps / min_sep): the most participations the separation allows."""
        return -(-self.n_steps // self.min_sep)

    @property
    def effective_participations(self) -> int:
        """k' = min(k, ceil(n / b)); the number of participations sensitivity is computed for."""
        cap = self.max_possible_participations
        return cap if self.max_participations is None else min(self.max_participations, cap)

    @property
    def canonical(self) -> "Participation":
        """This context with ``max_participations`` written one way: None when it does not bind
        (k >= ceil(n_steps / min_sep)), else k. ``max_participations=None`` and an explicit
        k >= ceil(n / b) describe the same runs; equal canonical values have the same
        sensitivity and resolve to the same mechanism, with the same fingerprint."""
        k = self.effective_participations
        return Participation(self.n_steps, self.min_sep, None if k == self.max_possible_participations else k)

    @property
    def is_single(self) -> bool:
        return self.effective_participations == 1

    def __str__(self) -> str:
        k = self.max_participations
        return f"n_steps={self.n_steps}, min_sep={self.min_sep}, max_participations={k} (k'={self.effective_participations})"
