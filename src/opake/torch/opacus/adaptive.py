"""``clipping="adaptive"``: the clipping bound follows a quantile of the gradient norms, privately.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021), as Opacus' ``AdaClipDPOptimizer`` runs it in DP-SGD. Each step, besides the clipped
sum, releases how many examples were not clipped: the sum of ``b_i - 1/2`` over the batch
(``b_i = 1`` when example i's gradient norm is at most the bound ``C_t``), plus Gaussian noise of
standard deviation ``sigma_b`` (``unclipped_num_std``). The unclipped fraction is estimated as that
release over the expected batch size, plus 1/2, and the bound moves geometrically toward the
``target_unclipped_quantile``:

    C_{t+1} = clamp(C_t * exp(-eta * (fraction - target)), min_clipbound, max_clipbound).

Privacy. Adding or removing one example moves the clipped sum by at most ``C_t`` and the centred
count by exactly 1/2 (hence ``b_i - 1/2``: with ``b_i`` alone it would be 1, and the paper's
accounting would not hold). With the gradient noise at ``sigma_g * C_t`` the step is one Gaussian
mechanism on the pair, whose sensitivity over noise is ``sqrt(sigma_g^-2 + (2 sigma_b)^-2)``: the
same as a single Gaussian of noise multiplier ``sigma`` exactly when

    sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)      (needs 2 sigma_b > sigma),

the paper's Theorem 1. The run is planned and priced at the user's ``noise_multiplier`` sigma
(its accountant is DP-SGD's, unchanged: the pair's privacy loss, subsampled or not, is the single
Gaussian's), and the gradients get the larger ``sigma_g`` (``gradient_noise_multiplier``). The bound
``C_t`` is a function of earlier releases, chosen adaptively like the gradients themselves.
DP-SGD only: a correlated-noise mechanism adds noise across steps, which a bound that changes from
step to step would not scale consistently. The count's noise is drawn from the run's key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from opake.dpftrl.clipping import FlatClipping
from opake.errors import InvalidArgumentError
from opake.random import RngKey

__all__ = ["ADAPTIVE_OPTIONS", "AdaptiveClipping", "AdaptiveNoise", "gradient_noise_multiplier"]

ADAPTIVE_OPTIONS = ("target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound",
                    "unclipped_num_std")


def gradient_noise_multiplier(noise_multiplier: float, unclipped_num_std: float) -> float:
    """``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradients' noise multiplier that, with the
    count's noise ``sigma_b``, makes each step a Gaussian mechanism of noise multiplier ``sigma``."""
    sigma, count = float(noise_multiplier), float(unclipped_num_std)
    if not (math.isfinite(sigma) and sigma > 0 and math.isfinite(count) and 2 * count > sigma):
        raise InvalidArgumentError(
            f"adaptive clipping needs 2 * unclipped_num_std > noise_multiplier (the count's noise takes part of "
            f"the privacy budget sigma), got unclipped_num_std={unclipped_num_std!r}, noise_multiplier="
            f"{noise_multiplier!r}: Opacus' examples use unclipped_num_std = expected batch size / 20"
        )
    return (sigma ** -2 - (2 * count) ** -2) ** -0.5


@dataclass(frozen=True)
class AdaptiveClipping:
    """Opacus' adaptive-clipping settings (module docstring), checked."""

    target_unclipped_quantile: float
    clipbound_learning_rate: float
    max_clipbound: float
    min_clipbound: float
    unclipped_num_std: float

    def __post_init__(self):
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                   for value in values.values()):
            raise InvalidArgumentError(f"adaptive clipping's settings must be finite numbers, got {values}")
        if not 0 <= self.target_unclipped_quantile <= 1 or self.clipbound_learning_rate < 0:
            raise InvalidArgumentError("target_unclipped_quantile must be in [0, 1] and clipbound_learning_rate >= 0")
        if not 0 < self.min_clipbound <= self.max_clipbound:
            raise InvalidArgumentError("adaptive clipping needs 0 < min_clipbound <= max_clipbound")

    @classmethod
    def from_options(cls, options: dict) -> AdaptiveClipping:
        missing = [name for name in ADAPTIVE_OPTIONS if name not in options]
        if missing:
            raise InvalidArgumentError(f"clipping='adaptive' needs {list(ADAPTIVE_OPTIONS)} (Opacus' AdaClip "
                                       f"settings); missing {missing}")
        return cls(**{name: options[name] for name in ADAPTIVE_OPTIONS})

    def next_bound(self, bound: float, fraction: float) -> float:
        """The bound after a step whose unclipped fraction was estimated as ``fraction``."""
        moved = bound * math.exp(-self.clipbound_learning_rate * (fraction - self.target_unclipped_quantile))
        return min(self.max_clipbound, max(self.min_clipbound, moved))


class AdaptiveNoise:
    """The run's noise engine, adding the gradients' noise at ``sigma_g * C_t`` instead of
    ``sigma * C_t`` (``ratio = sigma_g / sigma``, module docstring)."""

    def __init__(self, engine, ratio: float):
        self.engine = engine
        self.ratio = float(ratio)

    def __getattr__(self, name):  # mechanism, layout, ...: the engine's
        return getattr(self.engine, name)

    def __call__(self, clipped, state):
        return self.engine(dataclasses.replace(clipped, l2_bound=clipped.l2_bound * self.ratio), state)


class AdaptiveBound:
    """The optimizer's side: after each release, the noisy centred count and the next bound."""

    def __init__(self, settings: AdaptiveClipping, key: RngKey, expected_batch_size: float):
        self.settings = settings
        self.key = key
        self.expected_batch_size = float(expected_batch_size)
        self.last_fraction: float | None = None

    def count_noise(self, step: int) -> float:
        """The count's noise at ``step``: ``sigma_b`` times a standard normal drawn from the run's key."""
        seed = int.from_bytes(self.key.derive_bytes("opake.torch.opacus.adaptive.count", [step], 8), "little")
        generator = torch.Generator().manual_seed(seed & (2**63 - 1))
        return self.settings.unclipped_num_std * float(torch.randn((), generator=generator, dtype=torch.float64))

    def update(self, clipper, step: int, examples: int, clipped: int) -> float:
        """Release the step's noisy centred count, move ``clipper``'s bound; returns the new bound."""
        released = (examples - clipped) - examples / 2 + self.count_noise(step)
        self.last_fraction = released / self.expected_batch_size + 0.5
        bound = self.settings.next_bound(clipper.max_grad_norm, self.last_fraction)
        clipper.rule = FlatClipping(bound)
        clipper.max_grad_norm = bound
        return bound
