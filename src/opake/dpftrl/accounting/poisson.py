"""Cyclic Poisson amplification for banded strategies: BandMF and the identity (Band23 Thm 4).

Sampling (``opake.dpftrl.sampling.CyclicPoissonSampler`` with ``num_groups = bands``): the data
are split once into b groups; at step t each member of group t mod b is included independently
with probability q. An example can then contribute only at steps t = g (mod b) of its group g:
at most k = ceil(n/b) times, any two b steps apart.

Theorem (Band23 Thm 4). For a b-banded lower-triangular C whose columns have L2 norm at most 1,
the correlated-noise run C G + sigma Z under this sampling is dominated by
PoissonSampled(q, Gaussian(sigma)) self-composed ceil(n/b) times. Here C has c_0 = 1, not unit
columns; rescaling C to unit max column norm rescales the noise the same way, so the theorem
applies with sigma_eff = noise_multiplier / max_j ||column_j(C)|| = noise_multiplier / ||c||_2
(the first column holds the whole band when bands <= n_steps).

The identity strategy is the case b = 1 (||c|| = 1): plain DP-SGD with Poisson sampling of the
whole data set, n_steps compositions of PoissonSampled(q, Gaussian(noise_multiplier)).

A BLT's C has a non-zero entry on every diagonal (it is not banded for any b < n), so the
theorem does not apply and a BLT is refused with the advice below.

The composition is priced with dp_accounting's PLD accountant (add/remove adjacency). Its
Gaussian PLDs use ``pessimistic_estimate=True`` (the default of
``PrivacyLossDistribution.from_gaussian_mechanism`` as the accountant calls it), so the
discretization rounds privacy losses up: the numbers are upper bounds (``is_guarantee``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

import dp_accounting
from dp_accounting.pld import PLDAccountant

from opake._checks import integer_at_least
from opake.accounting.calibrate import calibrate
from opake.accounting.gaussian import gaussian
from opake.accounting.process import certified_epsilon, check_delta, check_epsilon
from opake.dpftrl.accounting.factorized_gaussian import MFGaussian
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.priced import PricedNoise
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError

BLT_ADVICE = (
    "Poisson subsampling amplification is not valid for a BLT strategy (its C is not banded); "
    "if you need subsampling amplification with correlated noise, use BandMF with "
    "opake.dpftrl.accounting.poisson instead; for multi-epoch BLT training use "
    "balls_in_bins or mf_gaussian with min_sep and max_participations"
)

DEFAULT_DISCRETIZATION = 1e-4


class UnsupportedAmplificationError(OpakeError, ValueError):
    """The strategy cannot be amplified this way; the message says what to use instead."""


@dataclass(frozen=True)
class CyclicPoisson:
    """A BandMF / identity run under cyclic Poisson sampling, priced by Band23 Thm 4.

    ``bound`` is the inner mf_gaussian bound to the sampler's participation
    (``Participation(n_steps, min_sep=num_groups, max_participations=compositions)``); its
    ``mechanism`` carries the fingerprint the noise engine must match. ``epsilon_at`` and
    ``delta_at`` come from the PLD of PoissonSampled(sample_rate, Gaussian(
    effective_noise_multiplier)) composed ``compositions`` times (``dp_event``).
    """

    bound: MFGaussian
    sample_rate: float
    n_steps: int
    num_groups: int
    compositions: int
    column_norm: float
    value_discretization_interval: float
    _accountant: PLDAccountant = field(repr=False, compare=False, default=None)

    is_guarantee = True
    method = AccountingMethod.POISSON_PLD

    @property
    def mechanism(self):
        return self.bound.mechanism

    @property
    def participation(self) -> Participation:
        return self.bound.participation

    @property
    def priced_noise(self) -> PricedNoise:
        """The inner mechanism bound to the sampler's participation, and sigma (not sigma_eff)."""
        return self.bound.priced_noise

    @property
    def effective_noise_multiplier(self) -> float:
        """sigma_eff = noise_multiplier / (max column norm of C)."""
        return self.bound.noise_multiplier / self.column_norm

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """The dominating event of Band23 Thm 4, as dp_accounting composes it."""
        return _event(self.sample_rate, self.effective_noise_multiplier, self.compositions)

    @property
    def description(self) -> str:
        return (
            f"cyclic Poisson (Band23 Thm 4), {self.num_groups} group(s) over {self.n_steps} steps, "
            f"sample rate {self.sample_rate:.6g}: PoissonSampled Gaussian with noise multiplier "
            f"{self.bound.noise_multiplier:.6g} / column norm {self.column_norm:.6g} = "
            f"{self.effective_noise_multiplier:.6g}, composed {self.compositions} times; PLD "
            f"accounting (pessimistic discretization {self.value_discretization_interval:g}): "
            f"an upper bound"
        )

    def epsilon_at(self, delta: float) -> float:
        delta = check_delta(delta)
        # dp_accounting inverts its own curve; round up so delta_at(epsilon_at(d)) <= d in floats.
        return certified_epsilon(self.delta_at, delta, float(self._accountant.get_epsilon(delta)))

    def delta_at(self, epsilon: float) -> float:
        epsilon = check_epsilon(epsilon)
        return float(self._accountant.get_delta(epsilon))


def _event(sample_rate: float, noise_multiplier: float, count: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)),
        count,
    )


def _check_sample_rate(sample_rate) -> float:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real):
        raise InvalidTypeError(f"sample_rate must be a real number, got {sample_rate!r} ({type(sample_rate).__name__})")
    rate = float(sample_rate)
    if not (0.0 < rate <= 1.0):
        raise InvalidArgumentError(
            f"sample_rate must be in (0, 1] (the probability that a member of the served group is "
            f"included), got {sample_rate!r}"
        )
    return rate


def _check_n_steps(n_steps) -> int:
    if n_steps is None:
        raise InvalidArgumentError(
            "n_steps is required: poisson(mf_gaussian(noise_multiplier, strategy), sample_rate, n_steps)"
        )
    return integer_at_least("n_steps", n_steps)


def strategy_bands(strategy) -> int:
    """The number of bands b of a strategy the theorem covers (``strategy.bands``: 1 for the
    identity, the band of BandMF and of a banded run's prefix); refuses everything else."""
    bands = getattr(strategy, "bands", None)  # recipes state their bands; None: not banded (a BLT)
    if bands is None:
        from opake.dpftrl.strategies.strategy import BLTStrategy

        if isinstance(strategy, BLTStrategy) or hasattr(strategy, "bands"):
            raise UnsupportedAmplificationError(BLT_ADVICE)
        raise UnsupportedAmplificationError(
            f"cyclic Poisson amplification (Band23 Thm 4) needs a banded strategy; got "
            f"{type(strategy).__name__}. Use band_mf_strategy(bands) or identity_strategy(), or price "
            f"this strategy with mf_gaussian / balls_in_bins"
        )
    return int(bands)


def poisson(
    inner: MFGaussian,
    sample_rate: float,
    n_steps: int | None = None,
    *,
    value_discretization_interval: float = DEFAULT_DISCRETIZATION,
) -> CyclicPoisson:
    """Price a BandMF or DP-SGD run under cyclic Poisson sampling (Band23 Thm 4).

    Args:
      inner: an unbound ``mf_gaussian(noise_multiplier, strategy)`` with
        ``strategy = band_mf_strategy(bands)`` or ``identity_strategy()`` (bands = 1).
      sample_rate: q in (0, 1], the inclusion probability of a member of the served group.
      n_steps: the number of steps n.
      value_discretization_interval: the PLD grid (smaller is tighter and slower).

    The sampling this assumes is exactly ``CyclicPoissonSampler(num_examples, num_groups=bands,
    sample_rate=q, key=...)``; the result's ``participation`` equals that sampler's
    ``participation(n_steps)``, and its ``mechanism`` is what the noise engine must run.
    """
    if not isinstance(inner, MFGaussian):
        raise InvalidTypeError(
            f"inner must be an unbound mf_gaussian(noise_multiplier, strategy), got {type(inner).__name__}"
        )
    bands = strategy_bands(inner.strategy)
    rate = _check_sample_rate(sample_rate)
    n = _check_n_steps(n_steps)
    if bands > n:
        raise InvalidArgumentError(
            f"bands ({bands}) must be <= n_steps ({n}): cyclic Poisson serves group t mod bands at "
            f"step t, so every group must be served at least once"
        )
    interval = float(value_discretization_interval)
    if not (math.isfinite(interval) and interval > 0.0):
        raise InvalidArgumentError(
            f"value_discretization_interval must be finite and > 0, got {value_discretization_interval!r}"
        )
    compositions = -(-n // bands)
    participation = Participation(n, bands, compositions)
    if inner.is_bound and inner.participation.canonical != participation.canonical:
        raise InvalidArgumentError(
            f"inner was bound to ({inner.participation}), but cyclic Poisson sampling with {bands} "
            f"group(s) guarantees ({participation}); pass the unbound mf_gaussian(noise_multiplier, "
            f"strategy) and let poisson supply the participation"
        )
    bound = inner if inner.is_bound else inner.bind(n, bands, compositions)
    column_norm = banded_column_norm(bound.mechanism)
    accountant = _composed(rate, bound.noise_multiplier / column_norm, compositions, interval)
    return CyclicPoisson(
        bound=bound, sample_rate=rate, n_steps=n, num_groups=bands, compositions=compositions,
        column_norm=column_norm, value_discretization_interval=interval, _accountant=accountant,
    )


# A plan evaluates the same PLD many times (a calibration's last step, the choice's candidates, the
# plan it then makes, each learning rate of a sweep): 229 builds of 34 distinct ones in the quality
# benchmark's quick run. The composed accountant is a pure function of these four numbers and is
# only read afterwards (get_epsilon / get_delta), so the processes share it. A few recent ones
# are kept: a PLD of a long run holds up to about a megabyte.
@functools.lru_cache(maxsize=32)
def _composed(sample_rate: float, effective_noise_multiplier: float, compositions: int,
              interval: float) -> PLDAccountant:
    accountant = PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=interval,
    )
    accountant.compose(_event(sample_rate, effective_noise_multiplier, compositions))
    return accountant


def banded_column_norm(mechanism) -> float:
    """||c||_2 of a banded mechanism's first column (1 for the identity): Band23 Thm 4's sigma_eff
    is the noise multiplier divided by it (the first column holds the whole band)."""
    return math.sqrt(math.fsum(float(v) * float(v) for v in mechanism.toeplitz_coefficients(mechanism.bands)))


def noise_multiplier_guess(sample_rate: float, compositions: int, column_norm: float, budget) -> float:
    """A starting point for calibrating ``poisson`` (not a bound; ``calibrate_near`` brackets it).

    For small rates a composition of k Poisson-sampled Gaussians behaves like one Gaussian with
    mu ~ q sqrt(k) / sigma_eff (the central limit regime of Dong, Roth and Su 2022), so
    sigma_eff ~ q sqrt(k) sigma_gauss(budget); below about 0.6 that regime ends and 0.6 is used.
    """
    sigma_gauss = calibrate(budget, gaussian, 1e-3, 1e4, rtol=1e-3).param
    return column_norm * max(0.6, sample_rate * math.sqrt(compositions) * sigma_gauss)
