"""What noise an accountant priced, and the check that a noise stage runs exactly that noise.

Every privacy process of ``opake.dpftrl.accounting`` (a bound ``mf_gaussian``, ``balls_in_bins``
with each method, ``poisson``) states the noise its numbers are about as ``priced_noise``, a
:class:`PricedNoise`: the resolved mechanism (strategy recipe resolved for the participation
context the process supplied or was given; for an amplifier, the context its sampling
guarantees) and the noise multiplier. An epsilon is this run's guarantee only when the run's
noise is that noise; :func:`check_noise_priced` compares the two and is what
``noise_fn.check_accounted_by(process)`` runs (single-process engine and distributed stages).
It lives in the noise layer, which the accounting imports, so the engine never imports upward;
``opake.dpftrl.accounting`` re-exports its names.
"""

from __future__ import annotations

from dataclasses import dataclass

from opake.errors import InvalidTypeError, OpakeError


class AccountingMismatchError(OpakeError, ValueError):
    """The accountant priced other noise than the noise stage runs; the message lists what differs."""


_PROCESS_ADVICE = (
    "price the run with opake.dpftrl.accounting.mf_gaussian(noise_multiplier, strategy, n_steps=..., "
    "min_sep=..., max_participations=...), balls_in_bins(mf_gaussian(noise_multiplier, strategy), "
    "num_bins=..., n_steps=...) or poisson(mf_gaussian(noise_multiplier, strategy), sample_rate=..., "
    "n_steps=...)"
)


@dataclass(frozen=True)
class PricedNoise:
    """The noise a privacy process priced.

    Fields:
      mechanism: the resolved strategy (``opake.dpftrl.noise.Mechanism``) for the participation
        context the process accounts for; its ``fingerprint`` identifies recipe, context and
        parameters.
      noise_multiplier: sigma, the noise standard deviation over the clip norm, as the noise
        engine takes it (before any division by the sensitivity).
    """

    mechanism: object
    noise_multiplier: float

    @property
    def participation(self):
        """The participation context the mechanism was resolved for."""
        return self.mechanism.participation


def priced_noise_of(process) -> PricedNoise:
    """``process.priced_noise``, or a TypeError saying which processes can state it."""
    if not hasattr(type(process), "priced_noise"):
        raise InvalidTypeError(
            f"{type(process).__name__} does not state which noise it priced (it has no priced_noise), "
            f"so it cannot vouch for a correlated-noise run; {_PROCESS_ADVICE}"
        )
    priced = process.priced_noise  # an unbound mf_gaussian raises UnboundMechanismError here
    if not isinstance(priced, PricedNoise):
        raise InvalidTypeError(
            f"{type(process).__name__}.priced_noise must be a PricedNoise, got {type(priced).__name__}"
        )
    return priced


def _same_context(first, second) -> bool:
    return first.canonical == second.canonical


def check_noise_priced(process, *, mechanism, participation, noise_multiplier: float) -> None:
    """Raise unless ``process`` priced exactly the noise of (mechanism, participation, noise_multiplier).

    Compared: the mechanism fingerprint (recipe, context and resolved parameters; a callable
    learning-rate schedule that changed its values changes it), the strategy recipe, the
    participation context (``max_participations=None`` equals its explicit equivalent
    min(k, ceil(n / b))) and the noise multiplier (exactly: a process priced at another
    sigma certifies another run). Raises UnboundMechanismError for an unbound mf_gaussian,
    TypeError for a process that does not state its noise, AccountingMismatchError (a
    ValueError) listing every difference otherwise.
    """
    priced = priced_noise_of(process)
    problems = []
    if getattr(priced.mechanism, "fingerprint", None) != getattr(mechanism, "fingerprint", ""):
        problems.append(f"mechanism: the accountant priced {priced.mechanism!r}, the noise runs {mechanism!r}")
    priced_recipe, recipe = getattr(priced.mechanism, "recipe", None), getattr(mechanism, "recipe", None)
    if priced_recipe != recipe:
        problems.append(f"strategy: the accountant priced the recipe {priced_recipe!r}, the noise runs {recipe!r}")
    if not _same_context(priced.participation, participation):
        problems.append(
            f"participation: the accountant priced ({priced.participation}), the noise runs ({participation})"
        )
    if priced.noise_multiplier != float(noise_multiplier):
        problems.append(f"noise_multiplier: accountant {priced.noise_multiplier!r}, noise {float(noise_multiplier)!r}")
    if problems:
        raise AccountingMismatchError(
            "accounting and noise disagree (" + "; ".join(problems) + "); build both from the same "
            "strategy recipe, participation context and noise multiplier"
        )
