"""Which bound a privacy process computes: one name per bound, read from the process itself.

Every process of ``opake.dpftrl.accounting`` carries its ``method``; the call that built it takes
the same name back (``balls_in_bins(inner, b, n, method=process.method)`` rebuilds the process),
so a front end reads what was priced instead of deciding it again. The values are the strings
``PrivacyPlan.accounting`` and the checkpoints have always used.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["AccountingMethod"]


class AccountingMethod(StrEnum):
    """The bound a privacy process computes (``process.method``)."""

    GAUSSIAN = "gaussian"
    """``mf_gaussian`` bound to a participation: one Gaussian, sigma / sensitivity (exact)."""
    RIGOROUS = "rigorous"
    """``balls_in_bins(method="rigorous")``: the same Gaussian for the bins' participation, no amplification."""
    AMPLIFIED = "amplified"
    """``balls_in_bins(method="amplified")``: Renyi and hockey-stick bounds of the aligned dominating pair."""
    ALLOCATION_PLD = "allocation_pld"
    """``balls_in_bins(method="allocation_pld")``, the default for orthogonal bins (DP-SGD): the
    random-allocation PLD with the amplified bound's Renyi divergences, per direction the smaller."""
    MONTE_CARLO = "monte_carlo"
    """``balls_in_bins(method="monte_carlo")``: an estimate, never a guarantee."""
    POISSON_PLD = "pld"
    """``poisson(...)``: cyclic Poisson sampling, Band23 Thm 4, priced by PLD."""
