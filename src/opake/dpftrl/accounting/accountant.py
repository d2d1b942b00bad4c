"""The accountant of a sampled run: noise multiplier -> the privacy process that prices it.

A sampler knows which accounting its batches admit (``sampler.accountant(strategy, n_steps,
method)``, in ``opake.dpftrl.sampling``); this module is what it returns. ``Accountant`` fixes
everything but the noise multiplier: the strategy, the horizon, the sampling's parameters and
the method, resolved when the accountant is built (``method=None`` becomes the tightest bound
proven for adaptively chosen gradients, read from ``balls_in_bins``' own rule), so that the
method a plan reports is the method every evaluation computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from opake.dpftrl.accounting.allocation.balls_in_bins import balls_in_bins, proven_method
from opake.dpftrl.accounting.factorized_gaussian import mf_gaussian
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.accounting.poisson import poisson
from opake.errors import InvalidArgumentError

__all__ = ["Accountant", "balls_in_bins_accountant", "poisson_accountant"]

_BINS = (AccountingMethod.RIGOROUS, AccountingMethod.AMPLIFIED, AccountingMethod.ALLOCATION_PLD)


@dataclass(frozen=True)
class Accountant:
    """``accountant(noise_multiplier)`` is the privacy process of the run: ``strategy`` for
    ``n_steps`` steps, sampled by balls in bins (``num_bins``) or cyclic Poisson (``sample_rate``
    and the strategy's bands), priced by ``method``."""

    strategy: object
    n_steps: int
    method: AccountingMethod
    num_bins: int | None = None
    sample_rate: float | None = None

    def __call__(self, noise_multiplier: float):
        inner = mf_gaussian(noise_multiplier, self.strategy)
        if self.method is AccountingMethod.POISSON_PLD:
            return poisson(inner, self.sample_rate, self.n_steps)
        return balls_in_bins(inner, self.num_bins, self.n_steps, method=self.method.value)

    def with_horizon(self, n_steps: int, strategy=None) -> "Accountant":
        """The same sampling and method for another horizon (and strategy): the first steps of a run."""
        return Accountant(self.strategy if strategy is None else strategy, n_steps, self.method, self.num_bins,
                          self.sample_rate)

    def unamplified(self) -> "Accountant | None":
        """The unamplified bound of the same bins (an amplified bound's cap), or None for Poisson."""
        if self.num_bins is None:
            return None
        return Accountant(self.strategy, self.n_steps, AccountingMethod.RIGOROUS, self.num_bins)


def balls_in_bins_accountant(strategy, num_bins: int, n_steps: int, method=None) -> Accountant:
    """Balls in bins (``num_bins`` bins served cyclically) priced by ``method``: None (the tightest
    bound proven for adaptive gradients), "rigorous", "amplified" or "allocation_pld"."""
    if method is None:
        method = proven_method(strategy, num_bins, n_steps)
    method = AccountingMethod(method)
    if method not in _BINS:
        raise InvalidArgumentError(f"balls-in-bins sampling is priced by one of {[m.value for m in _BINS]} (or None, "
                                   f"the tightest proven bound), got {method.value!r}")
    return Accountant(strategy, int(n_steps), method, num_bins=int(num_bins))


def poisson_accountant(strategy, sample_rate: float, n_steps: int) -> Accountant:
    """Cyclic Poisson sampling at ``sample_rate`` (Band23 Thm 4, by PLD)."""
    return Accountant(strategy, int(n_steps), AccountingMethod.POISSON_PLD, sample_rate=float(sample_rate))
