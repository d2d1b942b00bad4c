"""A whole matrix-factorization run priced as one Gaussian mechanism.

The noisy gradients are a post-processing of C G + sigma * Z (sigma = noise multiplier times
the clip norm), a Gaussian mechanism whose L2 sensitivity is clip * S, S the sensitivity of the
strategy C for the participation context (add/remove adjacency; docs/math.md section 6, after
ME23 and BSR24 Thm 2). So the run is exactly one Gaussian with noise multiplier
sigma_eff = noise_multiplier / S, priced by the analytic Gaussian formula.

S comes from ``strategy.resolve(n_steps, min_sep, max_participations)``, the same cached
resolution the noise engine uses; the resolved Mechanism is kept as ``.mechanism`` so its
``fingerprint`` can be compared with the noise engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from opake.accounting.gaussian import Gaussian
from opake.accounting.process import check_delta, check_epsilon, check_noise_multiplier
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.priced import PricedNoise
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError


class UnboundMechanismError(OpakeError, ValueError):
    """An mf_gaussian without a participation context was asked for a privacy value."""


_UNBOUND_ADVICE = (
    "this mf_gaussian has no participation context (n_steps was not given), so it has no "
    "sensitivity and no privacy value on its own; wrap it in an amplifier that supplies the "
    "context, e.g. balls_in_bins(mf_gaussian(noise_multiplier, strategy), num_bins=..., "
    "n_steps=...), or give n_steps (and min_sep, max_participations) to mf_gaussian"
)


@dataclass(frozen=True)
class MFGaussian:
    """Matrix-factorization Gaussian mechanism: ``noise_multiplier`` over strategy ``strategy``.

    Bound (``mechanism`` is not None): a rigorous privacy process, one Gaussian with noise
    multiplier ``noise_multiplier / mechanism.sensitivity``. Unbound: only an amplifier can
    price it (it supplies the participation through :meth:`bind`).
    """

    noise_multiplier: float
    strategy: object
    mechanism: object = None  # opake.dpftrl.noise.Mechanism once bound

    is_guarantee = True
    method = AccountingMethod.GAUSSIAN

    @property
    def is_bound(self) -> bool:
        return self.mechanism is not None

    @property
    def participation(self) -> Participation | None:
        return None if self.mechanism is None else self.mechanism.participation

    @property
    def priced_noise(self) -> PricedNoise:
        """The noise this process prices (bound only; an unbound one priced none)."""
        if self.mechanism is None:
            raise UnboundMechanismError(
                "an unbound mf_gaussian priced no particular noise (it has no resolved mechanism): "
                + _UNBOUND_ADVICE
            )
        return PricedNoise(self.mechanism, self.noise_multiplier)

    @property
    def sensitivity(self) -> float:
        """S of the resolved strategy (gradients clipped to norm 1, add/remove adjacency)."""
        return self._bound_mechanism().sensitivity

    @property
    def effective_noise_multiplier(self) -> float:
        """sigma_eff = noise_multiplier / S: the noise multiplier of the equivalent Gaussian."""
        return self.noise_multiplier / self.sensitivity

    @property
    def gaussian(self) -> Gaussian:
        """The single Gaussian mechanism this run is exactly equivalent to."""
        return Gaussian(self.effective_noise_multiplier)

    @property
    def dp_event(self):
        """The run as dp_accounting's ``GaussianDpEvent(noise_multiplier / S)``, exactly (bound only).

        The whole run is one Gaussian mechanism with that noise multiplier (docs/math.md section 6),
        so dp_accounting's RDP and PLD accountants can compose it with other releases of the
        same data; an unbound mf_gaussian raises (it has no sensitivity yet).
        """
        return self.gaussian.dp_event

    @property
    def description(self) -> str:
        if self.mechanism is None:
            return f"unbound mf_gaussian (noise multiplier {self.noise_multiplier:.6g}); needs an amplifier"
        return (
            f"mf_gaussian: noise multiplier {self.noise_multiplier:.6g} / sensitivity "
            f"{self.sensitivity:.6g} = Gaussian with noise multiplier "
            f"{self.effective_noise_multiplier:.6g} ({self.participation}); exact"
        )

    def _bound_mechanism(self):
        if self.mechanism is None:
            raise UnboundMechanismError(_UNBOUND_ADVICE)
        return self.mechanism

    def bind(self, n_steps: int, min_sep: int = 1, max_participations: int | None = None) -> "MFGaussian":
        """The same noise and strategy, resolved for a participation context (used by amplifiers)."""
        mechanism = self.strategy.resolve(n_steps, min_sep, max_participations)
        return MFGaussian(self.noise_multiplier, self.strategy, mechanism)

    def epsilon_at(self, delta: float) -> float:
        check_delta(delta)
        self._bound_mechanism()
        return self.gaussian.epsilon_at(delta)

    def delta_at(self, epsilon: float) -> float:
        check_epsilon(epsilon)
        self._bound_mechanism()
        return self.gaussian.delta_at(epsilon)


def mf_gaussian(
    noise_multiplier: float,
    strategy,
    n_steps: int | None = None,
    min_sep: int = 1,
    max_participations: int | None = None,
) -> MFGaussian:
    """Price a matrix-factorization run with correlated Gaussian noise.

    Args:
      noise_multiplier: noise standard deviation over the clip norm (> 0, finite).
      strategy: a strategy recipe (``blt_strategy(...)``, ``identity_strategy()``); it is
        resolved for the context exactly as the noise engine resolves it.
      n_steps, min_sep, max_participations: the participation context. Leave all three unset
        to build an unbound mechanism for an amplifier (``balls_in_bins``) to bind.

    The result's ``epsilon_at(delta)`` and ``delta_at(epsilon)`` are exact (BW18 Thm 8) for
    sigma_eff = noise_multiplier / S.
    """
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    if not callable(getattr(strategy, "resolve", None)):
        raise InvalidTypeError(
            f"strategy must be a strategy recipe with .resolve(n_steps, min_sep, max_participations), "
            f"got {type(strategy).__name__}; use opake.dpftrl.noise.blt_strategy(...) or identity_strategy()"
        )
    unbound = MFGaussian(noise_multiplier, strategy)
    if n_steps is None:
        if min_sep != 1 or max_participations is not None:
            raise InvalidArgumentError(
                "min_sep and max_participations were given without n_steps; give n_steps too, "
                "or leave all three unset so that an amplifier (balls_in_bins) supplies them"
            )
        return unbound
    return unbound.bind(n_steps, min_sep, max_participations)
