"""Cyclic Poisson amplification for banded strategies (Band23 Thm 4): a placeholder.

A later issue implements ``poisson`` for BandMF and the identity strategy: split the data into
b groups, Poisson-sample group t mod b at step t, and compose PoissonSampled(q, Gaussian)
ceil(n/b) times. The theorem needs a b-banded C, so it is not valid for a BLT, whose C has
infinitely many non-zero diagonals; a BLT is refused here with the advice of the BLT page.
"""

from __future__ import annotations

from opake.dpftrl.accounting.gaussian import MFGaussian

BLT_ADVICE = (
    "Poisson subsampling amplification is not valid for a BLT strategy (its C is not banded); "
    "if you need subsampling amplification with correlated noise, use BandMF with "
    "opake.dpftrl.accounting.poisson instead; for multi-epoch BLT training use "
    "balls_in_bins or mf_gaussian with min_sep and max_participations"
)


class UnsupportedAmplificationError(ValueError):
    """The strategy cannot be amplified this way; the message says what to use instead."""


def poisson(inner: MFGaussian, *args, **kwargs):
    """Cyclic Poisson amplification (not yet implemented; refuses a BLT strategy)."""
    from opake.dpftrl.noise.strategy import BLTStrategy

    if not isinstance(inner, MFGaussian):
        raise TypeError(
            f"inner must be an unbound mf_gaussian(noise_multiplier, strategy), got {type(inner).__name__}"
        )
    if isinstance(inner.strategy, BLTStrategy):
        raise UnsupportedAmplificationError(BLT_ADVICE)
    raise NotImplementedError(
        "opake.dpftrl.accounting.poisson (cyclic Poisson for BandMF / identity) is not implemented "
        "yet; use balls_in_bins, or mf_gaussian with the participation bounds"
    )
