"""Balls-in-bins: each protected unit sits in one bin for the whole run, bins processed cyclically.

With num_bins = b, step t processes bin t mod b, so a unit contributes at most
k = ceil(n_steps / b) times, any two contributions exactly b steps apart. ``balls_in_bins``
supplies that participation (min_sep = b, max_participations = k) to an unbound
``mf_gaussian`` and prices the run:

* ``method="rigorous"``: the unamplified single-Gaussian bound for that participation
  (docs/math.md section 6). A proven upper bound; it ignores the randomness of the bin assignment.
* ``method="amplified"`` (``"rdp"`` is its old name, still accepted): a rigorous *amplified* bound
  of the dominating pair, per direction the better of Renyi divergences (``allocation/rdp.py``)
  and direct hockey-stick bounds (``allocation/hockey_stick.py``; derivations in
  docs/balls_in_bins_rdp.md), capped by the unamplified bound. Needs C >= 0 entrywise (true for
  a BLT and the identity).
* ``method="allocation_pld"``: for *orthogonal bins* (C >= 0 with c_l = 0 for every lag l not
  divisible by b; the identity strategy, i.e. DP-SGD), the privacy loss distribution of random
  allocation with pessimistic discretization (``allocation/pld.py``, docs/allocation_pld.md) and
  the amplified bound's Renyi divergences of the same pair, per direction the smaller, capped by
  the unamplified bound (about 1 to 3 s for 100 bins). Refused for other strategies.
* default (``method=None``): the tightest bound proven for adaptively chosen gradients
  (docs/adaptivity.md): ``"allocation_pld"`` for orthogonal bins, ``"rigorous"`` for every other
  strategy (a BLT, BandMF with several bands). The process says which (``process.method``).
* For a strategy whose bins interact, ``method="amplified"`` prices the aligned dominating pair
  (the same unit gradient at every participation). That pair is not proven to dominate
  adaptively chosen gradients (nor fixed gradients of varying directions): building it emits
  ``UnprovenAmplificationWarning``, and it is never a default.
* ``method="monte_carlo"``: an *estimate* of the amplified privacy of the dominating pair,
  with confidence bounds (``monte_carlo.py``); never a guarantee.

Adaptively chosen gradients: docs/adaptivity.md says which of these bounds are proven for them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from opake._checks import integer_at_least
from opake.dpftrl.accounting.allocation.bin_gram import has_non_negative_entries
from opake.dpftrl.accounting.factorized_gaussian import MFGaussian, mf_gaussian
from opake.dpftrl.accounting.allocation.monte_carlo import BallsInBinsMonteCarlo, monte_carlo
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.priced import PricedNoise
from opake.dpftrl.accounting.allocation.pld import BallsInBinsPLD, allocation_pld, orthogonal_bins
from opake.dpftrl.accounting.allocation.rdp import BallsInBinsRDP, rdp_allocation
from opake.errors import InvalidArgumentError, InvalidTypeError

METHODS = ("rigorous", "monte_carlo", "amplified", "allocation_pld")


class UnprovenAmplificationWarning(UserWarning):
    """An amplified balls-in-bins bound whose dominating pair is not proven for adaptive gradients."""


UNPROVEN_ADVICE = (
    "balls_in_bins(method='amplified') for a strategy whose bins interact (a BLT, BandMF with several "
    "bands) prices the aligned dominating pair, which is not proven to dominate adaptively chosen "
    "gradients, as training produces (docs/adaptivity.md); the epsilon may be too small. The default "
    "(method=None) is the unamplified bound, proven for adaptive gradients"
)
# Old names of a method, still accepted: "rdp" said Renyi only, before the direct hockey-stick bounds.
METHOD_ALIASES = {"rdp": "amplified"}


@dataclass(frozen=True)
class BallsInBins:
    """Rigorous balls-in-bins bound: the inner mechanism priced for its supplied participation.

    ``bound`` is the bound mf_gaussian (its ``mechanism`` carries the fingerprint the noise
    engine must match); ``epsilon_at`` / ``delta_at`` are exactly ``bound``'s.
    """

    bound: MFGaussian
    num_bins: int
    n_steps: int

    is_guarantee = True
    method = AccountingMethod.RIGOROUS

    @property
    def mechanism(self):
        return self.bound.mechanism

    @property
    def participation(self):
        return self.bound.participation

    @property
    def priced_noise(self) -> PricedNoise:
        """The inner mechanism bound to (n_steps, min_sep=num_bins, ceil(n_steps/num_bins)), sigma."""
        return self.bound.priced_noise

    @property
    def dp_event(self):
        """The unamplified bound as dp_accounting's ``GaussianDpEvent`` (exactly this process)."""
        return self.bound.dp_event

    @property
    def description(self) -> str:
        return (
            f"balls-in-bins, {self.num_bins} bins over {self.n_steps} steps: rigorous upper bound "
            f"without amplification (min_sep={self.num_bins}, max_participations="
            f"{self.participation.max_participations}); {self.bound.description}"
        )

    def epsilon_at(self, delta: float) -> float:
        return self.bound.epsilon_at(delta)

    def delta_at(self, epsilon: float) -> float:
        return self.bound.delta_at(epsilon)


def _orthogonal(rigorous: BallsInBins) -> bool:
    return orthogonal_bins(rigorous.mechanism.toeplitz_coefficients(rigorous.n_steps), rigorous.num_bins)


def proven_method(strategy, num_bins: int, n_steps: int) -> AccountingMethod:
    """``balls_in_bins``' default method for ``strategy`` on these bins: the tightest bound proven
    for adaptively chosen gradients (``"allocation_pld"`` for orthogonal bins, else ``"rigorous"``)."""
    max_participations = -(-n_steps // num_bins)
    rigorous = BallsInBins(mf_gaussian(1.0, strategy).bind(n_steps, num_bins, max_participations), num_bins, n_steps)
    if has_non_negative_entries(rigorous) and _orthogonal(rigorous):
        return AccountingMethod.ALLOCATION_PLD
    return AccountingMethod.RIGOROUS


def balls_in_bins(
    inner: MFGaussian,
    num_bins: int,
    n_steps: int,
    *,
    method: str | None = None,
    num_samples: int | None = None,
    seed: int | None = None,
    confidence: float | None = None,
) -> BallsInBins | BallsInBinsRDP | BallsInBinsPLD | BallsInBinsMonteCarlo:
    """Price a run whose units are assigned to ``num_bins`` fixed bins, processed cyclically.

    Args:
      inner: an unbound ``mf_gaussian(noise_multiplier, strategy)`` (no n_steps): this
        function supplies n_steps, min_sep=num_bins and max_participations=ceil(n_steps/num_bins).
      num_bins: number of bins b, 1 <= b <= n_steps.
      n_steps: number of training steps.
      method: None (default: the tightest bound proven for adaptive gradients: for orthogonal
        bins, e.g. the identity strategy, the allocation PLD and the amplified bound together;
        else "rigorous"), "rigorous" (proven, unamplified), "amplified" (Renyi and direct
        hockey-stick bounds of the aligned pair; needs C >= 0; proven for adaptive gradients only
        for orthogonal bins, otherwise it warns; "rdp" is an alias), "allocation_pld" (proven:
        the random-allocation PLD; needs orthogonal bins) or "monte_carlo" (estimate; needs C >= 0).
      num_samples, seed, confidence: Monte Carlo only. seed is required; num_samples
        defaults to 100_000 (rounded up to a multiple of num_bins), confidence to 0.95.

    Every result satisfies the privacy-process protocol; check ``.is_guarantee``.
    """
    if not isinstance(inner, MFGaussian):
        raise InvalidTypeError(
            f"inner must be an unbound mf_gaussian(noise_multiplier, strategy), got {type(inner).__name__}"
        )
    if inner.is_bound:
        raise InvalidArgumentError(
            "inner must be unbound: build it as mf_gaussian(noise_multiplier, strategy) without "
            f"n_steps; balls_in_bins supplies the participation (got {inner.participation})"
        )
    n_steps = integer_at_least("n_steps", n_steps)
    num_bins = integer_at_least("num_bins", num_bins)
    if num_bins > n_steps:
        raise InvalidArgumentError(
            f"num_bins must be <= n_steps ({n_steps}), got {num_bins}; with more bins than steps "
            "some bins are never processed; use num_bins <= n_steps"
        )
    method = METHOD_ALIASES.get(method, method)
    if method is not None and method not in METHODS:
        raise InvalidArgumentError(
            f"method must be None (the tightest proven bound) or one of {METHODS}, got {method!r}"
        )
    if method != "monte_carlo":
        given = (("num_samples", num_samples), ("seed", seed), ("confidence", confidence))
        extra = [name for name, value in given if value is not None]
        if extra:
            raise InvalidArgumentError(
                f"{', '.join(extra)} apply only to method='monte_carlo'; drop them for "
                f"{'the default method' if method is None else f'method={method!r}'}, or pass "
                "method='monte_carlo' for an estimate"
            )
    max_participations = -(-n_steps // num_bins)
    rigorous = BallsInBins(inner.bind(n_steps, num_bins, max_participations), num_bins, n_steps)
    if method is None:
        proven = has_non_negative_entries(rigorous) and _orthogonal(rigorous)
        method = "allocation_pld" if proven else "rigorous"
    if method == "rigorous":
        return rigorous
    if method == "amplified":
        if has_non_negative_entries(rigorous) and not _orthogonal(rigorous):
            warnings.warn(UNPROVEN_ADVICE, UnprovenAmplificationWarning, stacklevel=2)
        return rdp_allocation(rigorous)
    if method == "allocation_pld":
        proven = has_non_negative_entries(rigorous) and _orthogonal(rigorous)
        return allocation_pld(rigorous, rdp_allocation(rigorous) if proven else None)  # refuses unless proven
    return monte_carlo(
        rigorous,
        num_samples=100_000 if num_samples is None else num_samples,
        seed=seed,
        confidence=0.95 if confidence is None else confidence,
    )
