"""Privacy budgets: the (epsilon, delta) target a run must meet."""

from __future__ import annotations

from dataclasses import dataclass

from opake.accounting.process import check_delta, check_epsilon


@dataclass(frozen=True)
class EpsilonBudget:
    """An (epsilon, delta)-DP target: the process must satisfy epsilon_at(delta) <= epsilon."""

    epsilon: float
    delta: float

    def __post_init__(self):
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        object.__setattr__(self, "delta", check_delta(self.delta))

    def is_met_by(self, process) -> bool:
        """True when ``process.epsilon_at(self.delta) <= self.epsilon``."""
        return process.epsilon_at(self.delta) <= self.epsilon


def epsilon_budget(epsilon: float, delta: float) -> EpsilonBudget:
    """The budget "(epsilon, delta)-DP": epsilon >= 0 finite, delta in (0, 1)."""
    return EpsilonBudget(epsilon, delta)
