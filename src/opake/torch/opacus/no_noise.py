"""``make_private(noise_multiplier=0)``: Opacus' clipping-only run, which has no privacy guarantee.

Opacus' tests (and some users' debugging) train with ``noise_multiplier=0`` to see clipping alone.
The adapter plans the run as usual, so the batches are the plan's and every step still checks
that it releases exactly the planned batch, but the released gradients are the clipped sums
divided by the expected batch size, with nothing added: ``NoiseFree`` runs the run's noise engine
(its state advances as in a noised run, so checkpoints keep their form) and throws its draws
away. Nothing is private: ``NoNoiseWarning`` says so when the run is planned, and the epsilon
spent is infinite from the first step on (``NoiseFreeTraining``).

The plan is made at ``PLACEHOLDER_SIGMA`` (its ``plan.noise_multiplier`` and ``plan.epsilon``
describe noise that is never added; read ``privacy_engine.private.noise_multiplier`` and
``get_epsilon``), under a key folded from the run's; its checkpoint's plan record is marked
noise-free, so it never loads into a noised run, whatever key that run is given (which would then
claim a finite epsilon for weights trained without noise). ``opake.torch.make_private`` itself still
refuses a noise multiplier of 0: only the adapter offers this, for Opacus' meaning.
"""

from __future__ import annotations

import math
import warnings

from opake.errors import InvalidArgumentError
from opake.torch.checkpoint import CheckpointError, whole_digest
from opake.torch.private import PrivateTraining
from opake.types import NoisedPytree

__all__ = ["PLACEHOLDER_SIGMA", "NoNoiseWarning", "NoiseFree", "NoiseFreeTraining", "is_no_noise", "no_noise_key",
           "warn_no_noise", "without_noise"]

PLACEHOLDER_SIGMA = 1.0
NOISE_FREE = "noise_free"  # the plan record's mark of a noise-free run's checkpoint


class NoNoiseWarning(UserWarning):
    """A run planned with ``noise_multiplier=0``: clipped gradients are released without noise."""


def is_no_noise(noise_multiplier) -> bool:
    """Whether ``noise_multiplier`` is Opacus' 0 (a real number equal to 0; anything else is checked by the plan)."""
    return isinstance(noise_multiplier, (int, float)) and not isinstance(noise_multiplier, bool) \
        and noise_multiplier == 0


def no_noise_key(key):
    """The key a noise-free run is planned under (module docstring)."""
    return key.fold_in("opake.torch.opacus.no_noise")


def warn_no_noise() -> None:
    """Warn, at the caller of ``PrivacyEngine.make_private``, that the run has no privacy guarantee."""
    warnings.warn("noise_multiplier=0: the clipped gradients are released without noise, so this run has no "
                  "privacy guarantee (get_epsilon returns inf once a step is taken); use it to check clipping "
                  "alone, never to train on private data", NoNoiseWarning, stacklevel=4)


class NoiseFree:
    """A run's noise engine whose steps release the clipped gradients as they are (module docstring)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):  # mechanism, layout, ...: the engine's
        return getattr(self.engine, name)

    def __call__(self, clipped, state):
        noised, state = self.engine(clipped, state)  # advances the state; its noise is discarded
        pytree = {name: gradient.to(dtype=noised.pytree[name].dtype) for name, gradient in clipped.pytree.items()}
        return NoisedPytree(pytree=pytree, step=noised.step, noise_variance=0.0), state


class NoiseFreeTraining(PrivateTraining):
    """``PrivateTraining`` of a run released without noise: sigma 0, epsilon infinite. Its checkpoint's
    plan record says ``"noise_free": True``: a noised run refuses it whatever key it is given (the record
    differs from every noised plan's), and a noise-free run refuses a noised run's checkpoint."""

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["plan"] = {**saved["plan"], NOISE_FREE: True}
        saved["digest"] = whole_digest(saved)
        return saved

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None, fresh_key=None) -> None:
        plan = state_dict.get("plan") if isinstance(state_dict, dict) else None
        if not (isinstance(plan, dict) and plan.get(NOISE_FREE) is True):
            raise CheckpointError("this checkpoint is not a noise-free run's (noise_multiplier=0): load it into a "
                                  "run planned as it was. Nothing was restored")
        if state_dict.get("digest") != whole_digest(state_dict):  # checked before the record is read as a plan
            raise CheckpointError("this checkpoint's contents do not match its digest: it was edited or corrupted "
                                  "after it was saved. Nothing was restored")
        plain = {**state_dict, "plan": {name: value for name, value in plan.items() if name != NOISE_FREE}}
        plain["digest"] = whole_digest(plain)
        super().load_state_dict(plain, draws=draws, fresh_key=fresh_key)

    @property
    def noise_multiplier(self) -> float:
        return 0.0

    @property
    def epsilon(self) -> float:
        return math.inf

    def epsilon_spent(self, delta: float | None = None) -> float:
        """Infinite once a step was taken (0 before: nothing was released)."""
        return math.inf if self.steps_taken else 0.0


def without_noise(private: PrivateTraining) -> None:
    """Turn a freshly planned single-process run into its noise-free form (the same object)."""
    optimizer = private.optimizer
    if optimizer.reduction.world_size > 1:
        raise InvalidArgumentError("noise_multiplier=0 is a single-process check of clipping; under "
                                   "torch.distributed plan a noised run")
    private.run.replace_noise(NoiseFree(private.run.noise_fn), private.run.state.noise)
    optimizer.noise_multiplier = 0.0
    private.__class__ = NoiseFreeTraining  # overrides the privacy figures only: no state moves
