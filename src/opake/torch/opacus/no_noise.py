"""``make_private(noise_multiplier=0)``: Opacus' clipping-only run, which has no privacy guarantee.

Opacus' tests (and some users' debugging) train with ``noise_multiplier=0`` to see clipping alone.
The adapter plans the run as usual, so the batches are the plan's and every step still checks
that it releases exactly the planned batch, but the released gradients are the clipped sums
divided by the expected batch size, with nothing added: ``NoiseFree`` runs the run's noise engine
(its state advances as in a noised run, so checkpoints keep their form) and throws its draws
away. Nothing is private: ``NoNoiseWarning`` says so when the run is planned, and the epsilon
spent is infinite from the first step on (``NoiseFreeTraining``).

With ``poisson_sampling=False`` the run trains on the caller's DataLoader's own batches, in its
order, epoch after epoch (``LoaderBatches``), as Opacus' does: a clipping check can then be compared
with a plain run on the same batches. Since nothing is private, nothing depends on how the batches
are drawn.

The plan is made at ``PLACEHOLDER_SIGMA`` (its ``plan.noise_multiplier`` and ``plan.epsilon``
describe noise that is never added, and with the loader's batches its sampler is a placeholder
too; read ``privacy_engine.private.noise_multiplier`` and ``get_epsilon``), under a key folded from
the run's; its checkpoint's plan record is marked noise-free, so it never loads into a noised run
as that run's own checkpoint, whatever key that run is given (which would then claim a finite
epsilon for weights trained without noise): ``opake.torch.opacus.checkpoint`` loads it only by
marking the noised run noise-free too. ``opake.torch.make_private`` itself still refuses a noise
multiplier of 0: only the adapter offers this, for Opacus' meaning.
"""

from __future__ import annotations

import math
import warnings

from opake.errors import InvalidArgumentError, InvalidStateError
from opake.torch.checkpoint import CheckpointError, check_module_state, check_optimizer_state, whole_digest
from opake.torch.loader import DatasetChangedError, PlannedBatches
from opake.torch.opacus.unplanned import UnplannedEpochsTraining
from opake.torch.private import PrivateTraining
from opake.types import NoisedPytree

__all__ = ["PLACEHOLDER_SIGMA", "LoaderBatches", "NoNoiseWarning", "NoiseFree", "NoiseFreeTraining",
           "NoiseFreeWeightsTraining", "is_no_noise", "is_noise_free_checkpoint", "load_noise_free_weights",
           "no_noise_key", "serve_loader_batches", "warn_no_noise", "without_noise"]

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


class _MarkedNoiseFree(PrivateTraining):
    """A run whose released weights carry no noise (the two classes below): its epsilon is infinite
    and its checkpoint's plan record says ``"noise_free": True``, so no noised run takes it for its
    own, whatever key that run is given (the record differs from every noised plan's)."""

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["plan"] = {**saved["plan"], NOISE_FREE: True}
        saved["digest"] = whole_digest(saved)
        return saved

    @property
    def epsilon(self) -> float:
        return math.inf


class NoiseFreeTraining(_MarkedNoiseFree):
    """``PrivateTraining`` of a run released without noise: sigma 0, epsilon infinite, its checkpoint
    marked noise-free (``_MarkedNoiseFree``); it refuses a noised run's checkpoint."""

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None, fresh_key=None) -> None:
        if not is_noise_free_checkpoint(state_dict):
            raise CheckpointError("this checkpoint is not a noise-free run's (noise_multiplier=0): load it into a "
                                  "run planned as it was. Nothing was restored")
        if state_dict.get("digest") != whole_digest(state_dict):  # checked before the record is read as a plan
            raise CheckpointError("this checkpoint's contents do not match its digest: it was edited or corrupted "
                                  "after it was saved. Nothing was restored")
        plain = {**state_dict, "plan": {name: value for name, value in state_dict["plan"].items()
                                        if name != NOISE_FREE}}
        plain["digest"] = whole_digest(plain)
        super().load_state_dict(plain, draws=draws, fresh_key=fresh_key)

    @property
    def noise_multiplier(self) -> float:
        return 0.0

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


class LoaderBatches(PlannedBatches):
    """The batches of the caller's own DataLoader, epoch after epoch: what a noise-free run with
    ``poisson_sampling=False`` trains on, as Opacus' does (its clipping is then compared with a
    plain run on the same batches). Nothing is private in such a run, so nothing depends on how its
    batches are drawn; every step still checks that it releases exactly the batch served.

    ``batch_sampler`` is the DataLoader's (a shuffling one draws its order anew each epoch, from
    torch's generator, as the DataLoader would); ``epochs`` passes of ``len(batch_sampler)`` steps.
    """

    def __init__(self, batch_sampler, epochs: int, num_examples: int):
        steps_per_epoch = len(batch_sampler)
        super().__init__(sampler=None, n_steps=epochs * steps_per_epoch, steps_per_epoch=steps_per_epoch)
        self._batch_sampler = batch_sampler
        self._num_examples = int(num_examples)
        self._epoch: tuple[int, list] | None = None  # the epoch drawn last and its batches

    def indices(self, step: int) -> list[int]:
        epoch, position = divmod(step, self.steps_per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, [list(map(int, batch)) for batch in self._batch_sampler])
        return self._epoch[1][position]

    def units(self, step: int) -> None:
        return None

    def check_dataset(self, dataset) -> None:
        if len(dataset) != self._num_examples:
            raise DatasetChangedError(
                f"the dataset holds {len(dataset)} examples now, but the run was planned over "
                f"{self._num_examples}; keep the dataset as it was, or plan a new run over the new data"
            )


def serve_loader_batches(private: PrivateTraining, batch_sampler, epochs: int) -> None:
    """Serve ``batch_sampler``'s batches (the caller's DataLoader's) in a noise-free run
    (``LoaderBatches``), for ``epochs`` epochs; the same object."""
    if not isinstance(private, NoiseFreeTraining):
        raise InvalidArgumentError("the caller's own batches are served in a noise-free run only: a private run "
                                   "trains on the planned batches its accountant prices")
    batches = LoaderBatches(batch_sampler, epochs, len(private._dataset))
    if batches.n_steps > private.run.n_steps:
        raise InvalidStateError(f"the noise-free plan has {private.run.n_steps} steps, fewer than the loader's "
                                f"{batches.n_steps} (please report this)")
    private.run.batches = batches


class NoiseFreeWeightsTraining(_MarkedNoiseFree):
    """A noised run into which a noise-free run's checkpoint was loaded: its weights were trained without
    noise, so nothing it releases from then on is private. Its epsilon is infinite from the load on,
    whatever steps it takes after (``opake.torch.opacus.checkpoint``); its own checkpoint is marked
    noise-free, as the one it loaded (``_MarkedNoiseFree``), and nothing more loads into it."""

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None, fresh_key=None) -> None:
        raise CheckpointError("this run holds weights trained without noise (a noise-free checkpoint was loaded into "
                              "it): loading another checkpoint would not make it private. Plan a new run")

    def epsilon_spent(self, delta: float | None = None) -> float:
        return math.inf


def is_noise_free_checkpoint(state_dict) -> bool:
    """Whether ``state_dict`` (a run's checkpoint) is marked as a noise-free run's."""
    plan = state_dict.get("plan") if isinstance(state_dict, dict) else None
    return isinstance(plan, dict) and plan.get(NOISE_FREE) is True


def load_noise_free_weights(private: PrivateTraining, state_dict: dict) -> None:
    """Load a noise-free run's checkpoint (its model and optimizer) into the noised run ``private``, which
    is then a ``NoiseFreeWeightsTraining`` (epsilon infinite). Everything is checked before anything is
    replaced; the run's own noise state and batches are kept."""
    if isinstance(private, NoiseFreeWeightsTraining):
        private.load_state_dict(state_dict)  # refused, saying why
    if type(private) not in (PrivateTraining, UnplannedEpochsTraining):
        raise CheckpointError(f"a noise-free checkpoint loads into a run planned by make_private, not into a "
                              f"{type(private).__name__}. Nothing was restored")
    if not is_noise_free_checkpoint(state_dict) or state_dict.get("digest") != whole_digest(state_dict):
        raise CheckpointError("this is not an intact noise-free run's checkpoint (its record or its digest does not "
                              "match). Nothing was restored")
    check_module_state(private.module, state_dict["module"])
    check_optimizer_state(private.optimizer.original_optimizer, state_dict["optimizer"])
    private.module.load_state_dict(state_dict["module"])
    private.optimizer.load_state_dict(state_dict["optimizer"])
    private.__class__ = NoiseFreeWeightsTraining  # overrides the privacy figures and loading only
