"""One audited training run through ``make_private``, and the canaries' scores from its output.

The run is the user's recipe (``TrainingRecipe``): their module and optimizer factories, their
dataset, batch size, epochs, clipping norm, privacy target and ``make_private`` options (strategy,
sampling, amplification), trained with the documented loop (docs/torch.md) on the
``AuditDataset`` (the user's examples, then one slot per canary). Everything the guarantee
depends on is make_private's own: its sampler, per-example clipping, normalization, noise engine
and accountant; ``private.epsilon`` is the claim under audit.

The ``"released"`` score of gradient canaries. At step t the run releases the noisy gradient;
for audit coordinate i, rescaled by normalization / max_grad_norm, it is
y_t = 1{canary i in batch t} + sigma (C^{-1} z)_t, with C the strategy's lower-triangular Toeplitz
matrix (``mechanism.toeplitz_coefficients``) and z standard normal (the engine's contract). So
C y = C g + sigma z. Balls in bins puts canary i in one uniformly random bin j for the whole run,
that is g = u_j = 1{t = j mod b} (b = the participation's min_sep), and coordinate i depends on
nothing else. The statistics

    T_ij = <C y, C u_j> / (sigma ||C u_j||)

are standard normal when canary i is absent, and N(||C u_j|| / sigma, (sigma' / sigma)^2) at its
own bin when it is present (sigma' the noise multiplier the engine really used). The score
is max_j T_ij: the likelihood ratio of "present in bin j" maximized over the unknown bin, which
uses neither the bins nor the coins. (The exact likelihood ratio, the mean over j of
exp(mu T_ij - mu^2 / 2), tends to it as mu grows; at the small mu of a correct run it weighs all
bins alike and loses the very runs an audit is for, those that leak more than they claim.)
<C y, C u_j> = <y, C^T C u_j> is accumulated step by step against the precomputed columns
C^T C u_j (FFT convolutions, O(b n log n)), so the released gradients are never stored. Under
cyclic Poisson sampling (each step of the group drawn with probability q) the same statistic is
a valid score, not the optimal one. sigma is the CLAIMED noise multiplier.

``noise_scale`` (a control, never for a real audit): the engine is replaced, before the first
step, by one with ``noise_scale * sigma`` while the claim stays the plan's: a deliberately broken
run, to show that the audit can catch one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from scipy import signal

from opake._checks import positive_finite
from opake.audit.canaries import AuditDataset, AuditedModule, GradientCanaries, InputCanaries
from opake.dpftrl.noise import mf_gaussian_noise
from opake.errors import InvalidStateError, InvalidTypeError
from opake.random import RngKey
from opake.torch import make_private

__all__ = ["CanaryRun", "TrainingRecipe", "per_example_cross_entropy", "train_with_canaries"]

# make_private arguments the audit sets itself (the recipe cannot override them)
_RESERVED = ("module", "optimizer", "dataset", "batch_size", "epochs", "max_grad_norm", "target_epsilon",
             "target_delta", "noise_multiplier", "key", "loss_reduction", "process_group")


def per_example_cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(outputs, labels, reduction="none")``: one loss per example."""
    return F.cross_entropy(outputs, labels, reduction="none")


@dataclass(frozen=True, eq=False)
class TrainingRecipe:
    """The run to audit, as the arguments of ``make_private`` plus how to build fresh objects.

    ``module_fn()`` returns a fresh module (called once per run); ``optimizer_fn(parameters)``
    an optimizer over them (``lambda p: torch.optim.SGD(p, lr=0.1)``); ``dataset`` yields
    ``(input, label)`` pairs; ``loss_fn(outputs, labels)`` returns one loss per example (its mean
    over the batch is the loss, ``loss_reduction="mean"``); ``options`` go to ``make_private``
    unchanged (``strategy``, ``sampling``, ``amplification``, DataLoader options). Give exactly one
    of ``target_epsilon`` and ``noise_multiplier``, as for ``make_private``.
    """

    module_fn: Callable[[], torch.nn.Module]
    optimizer_fn: Callable
    dataset: object
    batch_size: int
    epochs: int
    max_grad_norm: float
    target_delta: float
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    loss_fn: Callable = per_example_cross_entropy
    options: Mapping = field(default_factory=dict)

    def __post_init__(self):
        positive_finite("max_grad_norm", self.max_grad_norm)
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise InvalidTypeError("a TrainingRecipe needs exactly one of target_epsilon and noise_multiplier")
        reserved = sorted(set(self.options) & set(_RESERVED))
        if reserved:
            raise InvalidTypeError(f"TrainingRecipe.options cannot set {reserved}: they are fields of the recipe "
                                   f"(or fixed by the audit: key, loss_reduction='mean', one process)")
        object.__setattr__(self, "options", dict(self.options))


@dataclass(frozen=True, eq=False)
class CanaryRun:
    """One audited run: a score per canary (larger = more evidence of inclusion) and the claim.

    ``included``: the coins; ``epsilon`` / ``delta``: the run's claim (``private.epsilon`` at
    ``private.delta``); ``noise_multiplier``: the plan's sigma, ``engine_noise_multiplier``: the
    one the engine used (different only in a ``noise_scale`` control). ``participations[i]``:
    how many batches canary i's slot was served in (0 for an absent canary), ``first_steps[i]``:
    the first such step (-1 if none); both are read from the batches for diagnostics, never by the
    scores. ``bin_statistics``: for ``"released"`` gradient canaries, (m, b) values
    <C y_i, C u_j> / (sigma ||C u_j||), standard normal when canary i is absent.
    """

    scores: np.ndarray
    included: np.ndarray
    epsilon: float
    delta: float
    noise_multiplier: float
    engine_noise_multiplier: float
    n_steps: int
    period: int
    participations: np.ndarray
    first_steps: np.ndarray
    bin_statistics: np.ndarray | None
    plan: object
    seconds: float


def train_with_canaries(recipe: TrainingRecipe, canaries, included, key: RngKey,
                        noise_scale: float = 1.0) -> CanaryRun:
    """Train the recipe once on its data plus the ``included`` canaries; score every canary."""
    if not isinstance(recipe, TrainingRecipe):
        raise InvalidTypeError(f"recipe must be an opake.audit.TrainingRecipe, got {type(recipe).__name__}")
    if not isinstance(canaries, (GradientCanaries, InputCanaries)):
        raise InvalidTypeError(f"canaries must be GradientCanaries or InputCanaries, got {type(canaries).__name__}")
    if not isinstance(key, RngKey):
        raise InvalidTypeError(f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}")
    noise_scale = positive_finite("noise_scale", noise_scale)
    start = time.perf_counter()
    included = np.asarray(included, dtype=bool)
    gradient = isinstance(canaries, GradientCanaries)
    module = recipe.module_fn()
    audited = AuditedModule(module, canaries.count if gradient else 0, recipe.max_grad_norm)
    optimizer = recipe.optimizer_fn(audited.parameters())
    dataset = AuditDataset(recipe.dataset, canaries, included)
    budget = ({"target_epsilon": recipe.target_epsilon} if recipe.target_epsilon is not None
              else {"noise_multiplier": recipe.noise_multiplier})
    private = make_private(module=audited, optimizer=optimizer, dataset=dataset, batch_size=recipe.batch_size,
                           epochs=recipe.epochs, max_grad_norm=recipe.max_grad_norm, target_delta=recipe.target_delta,
                           key=key.fold_in("opake.audit.run"), loss_reduction="mean", **budget, **recipe.options)
    mechanism = private.run.noise_fn.mechanism
    if noise_scale != 1.0:
        _replace_noise(private, noise_scale, key)
    participation = private.plan.participation
    n_steps, period = participation.n_steps, participation.min_sep
    released = None
    if gradient and canaries.score == "released":
        released = _ReleasedScore(mechanism.toeplitz_coefficients(n_steps), n_steps, period, canaries.count,
                                  private.noise_multiplier, private.plan.expected_batch_size / recipe.max_grad_norm)
    initial = audited.canary.weight.detach().clone() if gradient else None
    participations = np.zeros(canaries.count, dtype=np.int64)
    first_steps = np.full(canaries.count, -1, dtype=np.int64)
    try:
        for step, (x, y, slot, weight) in enumerate(private.run_data_loader()):
            private.optimizer.zero_grad()
            if y.shape[0]:
                outputs, canary_term = audited(x, slot)
                losses = weight.to(outputs.dtype) * recipe.loss_fn(outputs, y)
                if canary_term is not None:
                    losses = losses + canary_term
                losses.mean().backward()
                _count_canaries(slot, canaries, step, participations, first_steps)
            private.optimizer.step()
            if released is not None:
                released.record(step, audited.canary.weight.grad)
    finally:
        private.detach()
    if released is not None:
        scores, statistics = released.scores()
    elif gradient:
        scores, statistics = (initial - audited.canary.weight.detach()).double().flatten().numpy(), None
    else:
        scores, statistics = _input_scores(module, canaries, recipe.loss_fn), None
    return CanaryRun(
        scores=_frozen(scores), included=_frozen(included.copy()), epsilon=float(private.epsilon),
        delta=float(private.delta), noise_multiplier=float(private.noise_multiplier),
        engine_noise_multiplier=float(private.run.noise_fn.noise_multiplier), n_steps=n_steps, period=period,
        participations=_frozen(participations), first_steps=_frozen(first_steps),
        bin_statistics=None if statistics is None else _frozen(statistics), plan=private.plan,
        seconds=time.perf_counter() - start,
    )


def _count_canaries(slot, canaries, step, participations, first_steps) -> None:
    """Diagnostics: which gradient canaries this batch held (input canaries are not tracked)."""
    if not isinstance(canaries, GradientCanaries):
        return
    present = slot[slot >= 0].numpy()
    participations[present] += 1
    fresh = present[first_steps[present] < 0]
    first_steps[fresh] = step


def _replace_noise(private, noise_scale: float, key: RngKey) -> None:
    """The control of the module docstring: the same mechanism at noise_scale * sigma, claim unchanged."""
    optimizer = private.optimizer
    if optimizer.noise_state.step != 0 or optimizer.reduction.world_size > 1:
        raise InvalidStateError("the noise_scale control replaces the engine of a fresh single-process run only")
    participation = private.plan.participation
    template = {name: p.detach() for name, p in optimizer.parameters.items()}
    noise_fn, noise_state = mf_gaussian_noise(
        template, private.plan.strategy, n_steps=participation.n_steps, min_sep=participation.min_sep,
        max_participations=participation.max_participations,
        noise_multiplier=private.noise_multiplier * noise_scale, key=key.fold_in("opake.audit.control"),
    )
    if noise_fn.mechanism.fingerprint != private.run.noise_fn.mechanism.fingerprint:
        raise InvalidStateError("the control's engine resolved another mechanism than the run's")
    private.run.replace_noise(noise_fn, noise_state)


class _ReleasedScore:
    """Accumulates <y_i, C^T C u_j> over the steps; ``scores()`` forms max_j T_ij (module docstring)."""

    def __init__(self, coefficients: np.ndarray, n_steps: int, period: int, count: int, sigma: float,
                 rescale: float):
        c = np.asarray(coefficients, dtype=np.float64)[:n_steps]
        patterns = np.zeros((period, n_steps))
        for j in range(period):
            patterns[j, j::period] = 1.0                                 # u_j = 1{t = j mod b}
        directions = signal.fftconvolve(patterns, c[None, :], axes=1)[:, :n_steps]        # C u_j
        # C^T v = reverse(C reverse(v)) for a lower-triangular Toeplitz C
        back = signal.fftconvolve(directions[:, ::-1], c[None, :], axes=1)[:, :n_steps][:, ::-1]
        self.columns = back.T.copy()                                      # (n, b): C^T C u_j
        self.norms_squared = np.sum(directions * directions, axis=1)      # ||C u_j||^2
        self.projections = np.zeros((count, period))
        self.sigma = float(sigma)
        self.rescale = float(rescale)
        self.steps = 0

    def record(self, step: int, gradient: torch.Tensor) -> None:
        if step != self.steps:
            raise InvalidStateError(f"released gradients recorded out of order: step {step}, expected {self.steps}")
        y = gradient.detach().double().flatten().numpy() * self.rescale
        self.projections += np.outer(y, self.columns[step])
        self.steps += 1

    def scores(self) -> tuple[np.ndarray, np.ndarray]:
        if self.steps != self.columns.shape[0]:
            raise InvalidStateError(f"the run released {self.steps} of {self.columns.shape[0]} planned steps")
        statistics = self.projections / (self.sigma * np.sqrt(self.norms_squared))[None, :]
        return statistics.max(axis=1), statistics


def _input_scores(module, canaries: InputCanaries, loss_fn) -> np.ndarray:
    """Minus the loss (or the logit margin) of every input canary on the final model."""
    was_training = module.training
    module.eval()
    scores = []
    try:
        with torch.no_grad():
            for begin in range(0, canaries.count, 1024):
                x = canaries.inputs[begin:begin + 1024]
                y = canaries.labels[begin:begin + 1024]
                outputs = module(x)
                if canaries.score == "loss":
                    scores.append(-loss_fn(outputs, y).double())
                else:
                    own = outputs.gather(1, y[:, None]).squeeze(1)
                    others = outputs.scatter(1, y[:, None], float("-inf")).amax(1)
                    scores.append((own - others).double())
    finally:
        module.train(was_training)
    return torch.cat(scores).numpy()


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    array.setflags(write=False)
    return array
