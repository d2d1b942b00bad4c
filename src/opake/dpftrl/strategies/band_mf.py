"""BandMF: a banded lower-triangular Toeplitz strategy (Band23), optimized per context.

C[t, s] = c_{t-s} for 0 <= t - s < bands, zero from lag ``bands`` on, c_0 = 1. The noise
engine streams C^{-1} z with the last ``bands - 1`` outputs as state (``BandedInverse``), and
the banded structure is what makes cyclic Poisson amplification valid (Band23 Thm 4,
``opake.dpftrl.accounting.poisson``), which a BLT does not allow.

``band_mf_strategy(bands, error)`` is a frozen recipe with the same ``resolve`` interface as
the BLT recipe. The resolved :class:`BandedMechanism` is a :class:`Mechanism` with no BLT
buffers (``theta`` and ``omega`` are empty, ``num_buffers`` is 0) and the band's coefficients
as ``coefs`` (float64, length ``bands``, float32-exact, non-negative, non-increasing); its state
is ``bands - 1`` rows of d floats (``state_rows``).

Sensitivity is exact: the coefficients satisfy the preconditions of the Toeplitz min-sep
theorem (BSR24 Thm 2) by construction of the optimizer, are checked again after rounding, and
the sensitivity is computed from the rounded coefficients by ``toeplitz.minsep_sensitivity_squared``.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass

import numpy as np

from opake.dpftrl.strategies import toeplitz
from opake.dpftrl.strategies.strategy import Mechanism, _context, _digest, _readonly
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError

_ERRORS = ("max", "mean")

# Resolution cost (one CPU core): a resolution takes roughly 15 to 150 L-BFGS evaluations of the
# loss and its gradient (20 to 30 for 2 to 8 bands at n_steps = 1e6), each of the cost
# ``band_mf_optimize.evaluation_seconds`` estimates: about 1 ms up to 16 bands at any n_steps
# (doubling the horizon), 0.1 s for 64 bands at 1e6 (recursive filters), 0.25 s beyond 64 bands
# at 1e6 (FFT).
TYPICAL_EVALUATIONS = (15, 150)
SLOW_RESOLUTION_SECONDS = 10.0  # a resolution that may take this long (high estimate) warns


class SlowResolutionWarning(UserWarning):
    """Resolving a BandMF recipe for this many steps is expected to take long (the message says how long)."""


@dataclass(frozen=True, eq=False)
class BandedMechanism(Mechanism):
    """A resolved banded strategy: ``coefs`` is C's first column up to the band (c_0 = 1).

    Everything else is as in :class:`Mechanism`; equality is by ``fingerprint``, which covers
    ``coefs``.
    """

    coefs: np.ndarray = None

    def __post_init__(self):
        if self.coefs is None:
            raise InvalidArgumentError("a BandedMechanism needs coefs (C's first column within the band)")
        object.__setattr__(self, "coefs", _readonly(self.coefs))
        if not self.fingerprint:
            fp = _digest("banded", type(self.recipe).__name__, self.recipe, self.participation.canonical, self.coefs)
            object.__setattr__(self, "fingerprint", fp)
        super().__post_init__()

    @property
    def bands(self) -> int:
        return int(self.coefs.shape[0])

    @property
    def state_rows(self) -> int:
        """Rows of d floats the noise engine keeps: the last bands - 1 outputs."""
        return self.bands - 1

    def inverse_coefficients(self, n: int | None = None) -> np.ndarray:
        """First column of C^{-1} by forward substitution on the band (O(n * bands))."""
        return toeplitz.inverse_coefficients(self.toeplitz_coefficients(n))

    def leading(self, participation: Participation, recipe) -> "BandedMechanism":
        return mechanism_from_coefs(self.coefs[: participation.n_steps], participation, recipe=recipe)

    def streaming_description(self) -> dict:
        return {"kind": "banded", "coefs": [float(v) for v in self.coefs]}

    def toeplitz_coefficients(self, n: int | None = None) -> np.ndarray:
        """First column c_0..c_{n-1} of C (zeros beyond the band; default n = n_steps)."""
        n = self.participation.n_steps if n is None else int(n)
        out = np.zeros(n)
        width = min(n, self.bands)
        out[:width] = self.coefs[:width]
        return out

    def __repr__(self) -> str:
        return (
            f"BandedMechanism(bands={self.bands}, {self.participation}, "
            f"sensitivity={self.sensitivity:.6g}, max_loss={self.max_loss:.6g}, "
            f"mean_loss={self.mean_loss:.6g})"
        )


def _check_bands(bands) -> int:
    if isinstance(bands, bool) or not isinstance(bands, numbers.Integral):
        raise InvalidTypeError(f"bands must be an integer, got {bands!r} ({type(bands).__name__})")
    if bands < 1:
        raise InvalidArgumentError(f"bands must be >= 1 (1 is the identity strategy, DP-SGD), got {bands}")
    return int(bands)


@dataclass(frozen=True)
class BandMFStrategy:
    """Recipe for a BandMF strategy (Band23) with ``bands`` non-zero diagonals.

    Fields:
      bands: number of non-zero diagonals b >= 1 (b = 1 is C = I, DP-SGD); the noise state is
        b - 1 rows of d floats; must not exceed the run's n_steps.
      error: "max" or "mean" prefix-sum error, the utility the coefficients are optimized for.
    """

    bands: int
    error: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "bands", _check_bands(self.bands))
        if self.error not in _ERRORS:
            raise InvalidArgumentError(f"error must be one of {_ERRORS}, got {self.error!r}")

    def resolve(self, n_steps, min_sep: int = 1, max_participations: int | None = None) -> BandedMechanism:
        """The optimized banded C for this participation context (deterministic, cached).

        Cost: L-BFGS over the band, typically 15 to 150 evaluations, each O(bands^4 log n_steps)
        or O(n_steps x bands) up to 64 bands and O(n_steps log n_steps) beyond
        (``expected_resolution_seconds``): about 0.1 s for 2 to 16 bands at n_steps = 1e6,
        seconds for 64 bands there. A resolution that is not already cached and may take
        ``SLOW_RESOLUTION_SECONDS`` or more emits a ``SlowResolutionWarning`` with the estimate.
        The result is cached per (recipe, context) in this process, so the accountant and the
        noise engine share one resolution.
        """
        ctx = _context(n_steps, min_sep, max_participations)
        if self.bands > ctx.n_steps:
            raise InvalidArgumentError(
                f"bands ({self.bands}) must be <= n_steps ({ctx.n_steps}): a band wider than the "
                f"run has diagonals no step reaches; use band_mf_strategy(bands={ctx.n_steps}) or fewer"
            )
        return _resolve_band_mf(self, ctx)


def band_mf_strategy(bands: int, error: str = "max") -> BandMFStrategy:
    """A BandMF strategy recipe; resolve it for a participation context to get the mechanism.

    >>> strategy = band_mf_strategy(bands=64)
    >>> mech = strategy.resolve(n_steps=2000, min_sep=64)
    >>> mech.coefs.shape
    (64,)
    """
    return BandMFStrategy(bands=bands, error=error)


def round_for_float32(coefs: np.ndarray) -> np.ndarray:
    """Coefficients exactly representable in float32, rounded toward zero.

    Rounding toward zero is monotone and keeps c >= 0, so a non-increasing, non-negative c stays
    so; c_0 = 1 is exact.
    """
    c32 = np.float32(coefs)
    too_far = c32.astype(np.float64) > coefs
    return np.where(too_far, np.nextafter(c32, np.float32(0)), c32).astype(np.float64)


def mechanism_from_coefs(coefs, participation: Participation, recipe=None) -> BandedMechanism:
    """A BandedMechanism for given coefficients (used exactly as given); checks the preconditions.

    Sensitivity by BSR24 Thm 2 (``toeplitz.minsep_sensitivity_squared``) on the length-n column,
    which raises ValueError unless c is non-negative and non-increasing; losses from
    ``toeplitz.inverse_coefficients`` and ``toeplitz.per_query_errors`` in O(n * bands).
    """
    c = np.asarray(coefs, dtype=np.float64).reshape(-1)
    n = participation.n_steps
    if c.shape[0] < 1 or c.shape[0] > n:
        raise InvalidArgumentError(f"coefs must have 1..n_steps ({n}) values, got {c.shape[0]}")
    if c[0] != 1.0:
        raise InvalidArgumentError(f"coefs[0] must be 1 (the normalization c_0 = 1), got {c[0]!r}")
    column = np.zeros(n)
    column[: c.shape[0]] = c
    sens2 = toeplitz.minsep_sensitivity_squared(column, participation.min_sep, participation.max_participations)
    errors = toeplitz.per_query_errors(toeplitz.inverse_coefficients(column))
    return BandedMechanism(
        recipe=recipe, participation=participation, theta=np.zeros(0), omega=np.zeros(0),
        sensitivity=math.sqrt(sens2), max_loss=sens2 * float(np.max(errors)),
        mean_loss=sens2 * float(np.mean(errors)), coefs=c,
    )


def expected_resolution_seconds(bands: int, n_steps: int) -> tuple[float, float]:
    """(low, high) estimate of the seconds one resolution takes on one core (the constants above)."""
    from opake.dpftrl.strategies.band_mf_optimize import evaluation_seconds

    per_evaluation = min(evaluation_seconds(bands, n_steps).values())
    low, high = (per_evaluation * count for count in TYPICAL_EVALUATIONS)
    return low, high


def _warn_if_slow(recipe: BandMFStrategy, ctx: Participation) -> None:
    if recipe.bands == 1:
        return
    low, high = expected_resolution_seconds(recipe.bands, ctx.n_steps)
    if high < SLOW_RESOLUTION_SECONDS:
        return
    warnings.warn(
        f"resolving band_mf_strategy(bands={recipe.bands}) for n_steps={ctx.n_steps} optimizes the band "
        f"by L-BFGS, typically {TYPICAL_EVALUATIONS[0]} to {TYPICAL_EVALUATIONS[1]} evaluations at about "
        f"{high / TYPICAL_EVALUATIONS[1]:.2g} s each: expect about {low:.0f} to {high:.0f} s on one core. "
        f"The result is cached in this process for this recipe and context, so resolve it once "
        f"(accounting and noise then share it)",
        SlowResolutionWarning,
        stacklevel=4,
    )


@functools.lru_cache(maxsize=256)
def _resolve_band_mf(recipe: BandMFStrategy, ctx: Participation) -> BandedMechanism:
    from opake.dpftrl.strategies import band_mf_optimize

    _warn_if_slow(recipe, ctx)
    result = band_mf_optimize.optimize(ctx, recipe.bands, recipe.error)
    return mechanism_from_coefs(round_for_float32(result.coefs), ctx, recipe)
