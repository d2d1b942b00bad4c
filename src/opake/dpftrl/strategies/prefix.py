"""The first t steps of a resolved mechanism, as a recipe the accountants can bind.

A run stopped after t of its n planned steps has released only the first t rows of C G + Z.
C is lower triangular, so those rows are the t x t leading block C_t applied to the first t
gradients: the same Toeplitz coefficients c_0 .. c_{t-1}, over a horizon of t. Pricing that
block for the participation the sampler guarantees within t steps gives the guarantee of the
releases so far (``PrivateTraining.epsilon_spent``). ``PrefixStrategy(mechanism)`` is that
block as a recipe: ``resolve(t, min_sep, max_participations)`` keeps the mechanism's
parameters (it optimizes nothing) and recomputes the sensitivity for the shorter context with
the closed forms the mechanism's own family uses (BSR24 Thm 2 through ``blt`` or ``toeplitz``).

The first t releases are also a post-processing of all n (drop the rest), so their epsilon is
never above the whole run's; callers may take the minimum of the two bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from opake.dpftrl.participation import Participation
from opake.dpftrl.strategies.strategy import Mechanism
from opake.errors import InvalidArgumentError

__all__ = ["PrefixStrategy"]


@dataclass(frozen=True)
class PrefixStrategy:
    """The leading rows of ``mechanism`` (resolved for n steps), for horizons t <= n."""

    mechanism: Mechanism

    @property
    def bands(self) -> int | None:
        """The band of a banded mechanism (1 for the identity), None for a BLT."""
        return self.mechanism.bands

    def resolve(self, n_steps, min_sep: int = 1, max_participations: int | None = None) -> Mechanism:
        ctx = n_steps if isinstance(n_steps, Participation) else Participation(n_steps, min_sep, max_participations)
        planned = self.mechanism.participation.n_steps
        if ctx.n_steps > planned:
            raise InvalidArgumentError(
                f"a prefix of a mechanism resolved for {planned} steps has at most {planned} steps, got "
                f"n_steps={ctx.n_steps}"
            )
        return self.mechanism.leading(ctx, recipe=self)
