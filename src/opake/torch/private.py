"""``make_private``: private training with correlated noise on standard PyTorch objects.

One call plans the run and returns the objects the user's loop already uses::

    private = make_private(module=model, optimizer=optimizer, dataset=train_ds, batch_size=64,
                           epochs=5, target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0)
    model, optimizer, loader = private.module, private.optimizer, private.data_loader
    for x, y in loader:
        optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
    private.epsilon                       # the whole planned run's guarantee
    torch.save(private.state_dict(), path)

The plan, in order (each piece is one of opake's layers, used as documented there):

1. **Sampler** (``sampling=``), an epoch being ``len(dataset) // batch_size`` steps either way:

   * ``"balls_in_bins"`` (default, any strategy): ``BallsInBinsSampler``, every example in one
     of ``num_bins = len(dataset) // batch_size`` random bins, bins served cyclically, so every
     example appears once per epoch, ``num_bins`` steps apart: participation ``(n_steps =
     epochs * num_bins, min_sep = num_bins, max_participations = epochs)``.
   * ``"poisson"`` (banded strategies only: ``band_mf_strategy(bands=g)`` or
     ``identity_strategy()``, g = 1): ``CyclicPoissonSampler``, every example in one of g random
     groups, group ``t mod g`` served at step t, each of its members included independently
     with probability ``q = batch_size * g / len(dataset)``; with the identity this is the
     Poisson-subsampled DP-SGD of Opacus. Participation ``(n_steps, min_sep = g,
     max_participations = ceil(n_steps / g))``.

   Add/remove adjacency: one more example moves no other; batch sizes vary around
   ``batch_size`` (SECURITY.md). The dataset size is treated as public (it fixes ``num_bins``
   or ``q``), as in Opacus.
2. **Strategy**: by default the BLT optimized for the optimizer's own workload
   (``strategy_for_optimizer``: torch SGD's momentum, dampening and LR schedule; prefix sums
   for Adam-type optimizers), resolved for that participation.
3. **Accountant and noise multiplier**: balls in bins is priced, by default, by the tightest
   bound proven for adaptively chosen gradients (docs/adaptivity.md): for strategies whose bins
   do not interact (the identity) the random-allocation PLD (``accounting="allocation_pld"``),
   for every other strategy (a BLT) the unamplified bound ``method="rigorous"``
   (``accounting="rigorous"``; also ``amplification=False``). ``amplification=True`` asks for
   the amplified bound of the aligned dominating pair (``method="amplified"``), which for a BLT
   is not proven for adaptive gradients and warns. Cyclic Poisson is priced by ``poisson(...)``:
   Band23 Thm 4, PoissonSampled Gaussians composed ``ceil(n_steps / g)`` times, priced by PLD. The noise multiplier is calibrated to
   ``(target_epsilon, target_delta)`` by ``opake.accounting.calibrate`` on that accountant, or
   given (``noise_multiplier=``), in which case ``epsilon`` is computed at ``target_delta``.
   Calibration time (one core): the unamplified bound takes milliseconds; the amplified one
   0.3 to 3 s for 1200 examples in 30 bins and 6 to 11 s for 50,000 examples in 195 bins (1 to
   20 epochs); Poisson's PLD 5 to 14 s at those sizes (DP-SGD, BandMF with 4 bands). The
   amplified bound lowered the noise multiplier for one epoch (by 10% and 6% there) and not at
   all for 10 or 20 epochs.
4. **Clipping** per example during ``backward`` (``opake.torch.per_example``), summed and
   divided by the constant expected batch size (the sampler's ``expected_batch_size``).
5. **Noise** in ``optimizer.step()`` (``DPOptimizer`` over ``mf_gaussian_noise``), checked
   against the accountant before training (``check_accounted_by``); a step past the plan
   raises ``PlanExhaustedError``.

Under torch.distributed (initialized, world size > 1; or ``process_group=``) every rank
builds the same plan from the same key, its data loader serves its part of every global
batch (``batch[rank::world_size]``), its clipped sums are all-reduced, and the noise comes from
the sharded engine (each rank keeps buffers for what it owns): the run equals one process on
the same global batches. Pass the plain module, not ``DistributedDataParallel(module)``.

User-level privacy (``privacy_unit=ids``, one id per example): the protected unit is all the
examples of one id (a user). Users are put in the bins (or Poisson groups), ``batch_size``
counts users per batch, each user's summed gradient is clipped, and the accountant prices users
as it priced examples (``opake.torch.privacy_units``). Not combined with torch.distributed.

Randomness: ``key`` (an ``opake.random.RngKey``) seeds the sampler and the noise; without one,
a 128-bit key is drawn from the operating system (``secrets``), as SECURITY.md recommends for
published runs, and kept in ``state_dict()`` so that a resumed run continues the same bins.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
import secrets
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.accounting.allocation.bin_gram import has_non_negative_entries
from opake.dpftrl.accounting.allocation.pld import orthogonal_bins
from opake.dpftrl.accounting.poisson import noise_multiplier_guess
from opake._checks import positive_finite
from opake.dpftrl.noise import blt_strategy, mf_gaussian_noise, sharded_mf_gaussian_noise
from opake.dpftrl.strategies.band_mf import BandMFStrategy
from opake.dpftrl.strategies.prefix import PrefixStrategy
from opake.dpftrl.strategies.strategy import IdentityStrategy
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import BallsInBinsSampler, CyclicPoissonSampler, UnitSampler
from opake.random import RngKey, key as make_key
from opake.torch.loader import PlannedBatches, PlannedDataLoader
from opake.torch.losses import PerExampleLoss
from opake.torch.optimizer import DPOptimizer
from opake.torch.per_example import PerExampleClipper
from opake.torch.privacy_units import checkpoint_name, description, privacy_units
from opake.dpftrl.sampling import collate_allowing_empty
from opake.torch.validation import require_valid_model, trainable_parameters

__all__ = ["PrivacyPlan", "PrivateTraining", "make_private", "strategy_for_optimizer"]

_FORMAT = "opake.torch.PrivateTraining"
_VERSION = 1
_SIGMA_RANGE = (1e-3, 1e4)
_SAMPLINGS = ("balls_in_bins", "poisson")
# Cyclic Poisson's PLD grid grows as the effective noise multiplier (sigma / column norm) falls:
# one evaluation takes about 1.5 s at 0.5, 9 s at 0.2 and 45 s at 0.1 (600 compositions, one
# core). Calibration searches near a guess and no lower than 0.25 column norms.
_POISSON_FLOOR = 0.25
# What a checkpoint saved before ``sampling=`` existed planned: balls in bins, unamplified.
_PLAN_BEFORE_SAMPLING = {"sampling": "balls_in_bins", "accounting": "rigorous", "num_groups": None,
                         "sample_rate": None}


@dataclass(frozen=True)
class PrivacyPlan:
    """What ``make_private`` decided, before any step (all of it is public information).

    ``sampling`` is ``"balls_in_bins"`` (``num_bins`` bins; ``num_groups`` and ``sample_rate``
    are None) or ``"poisson"`` (``num_groups`` groups, each member drawn with probability
    ``sample_rate``; ``num_bins`` is None). ``accounting`` names the bound ``accountant``
    computes: ``"amplified"`` (balls in bins, amplified), ``"rigorous"`` (balls in bins,
    unamplified) or ``"pld"`` (cyclic Poisson, Band23 Thm 4); ``accountant.description`` says
    it in words. ``loss`` says which loss form the clipping assumes (``opake.torch.losses``),
    ``privacy_unit`` what one protected unit is, ``steps_per_epoch`` how many steps an epoch
    (one pass of ``data_loader``) takes.
    """

    participation: Participation
    num_bins: int | None
    expected_batch_size: float
    strategy: object
    noise_multiplier: float
    epsilon: float
    delta: float
    max_grad_norm: float
    accountant: object
    sampling: str
    accounting: str
    num_groups: int | None
    sample_rate: float | None
    steps_per_epoch: int = 0
    loss: str = ""
    privacy_unit: str = "example"

    @property
    def epochs(self) -> int:
        return -(-self.participation.n_steps // self.steps_per_epoch)


class PrivateTraining:
    """The result of ``make_private``: ``module``, ``optimizer``, ``data_loader`` and the plan.

    ``module`` is the caller's module itself (its ``state_dict`` loads into an unwrapped copy);
    ``optimizer`` is a ``DPOptimizer`` around the caller's optimizer; ``data_loader`` serves the
    planned batches, one epoch per pass, from the next untaken step (``for epoch in range(E):
    for batch in private.data_loader``); ``run_data_loader()`` serves the whole rest of the run
    in one pass. ``detach()`` removes the hooks from the module.
    """

    def __init__(self, module, optimizer: DPOptimizer, dataset, plan: PrivacyPlan, root_key: RngKey,
                 loader_options: dict, loss_hooks: PerExampleLoss):
        self.module = module
        self.optimizer = optimizer
        self.plan = plan
        self._dataset = dataset
        self._root_key = root_key
        self._loader_options = loader_options
        self._loss_hooks = loss_hooks
        self._spent: dict = {}
        self.data_loader = PlannedDataLoader(dataset, optimizer.batches, **loader_options)

    def run_data_loader(self) -> PlannedDataLoader:
        """A loader whose one pass serves every remaining planned step (all epochs)."""
        return PlannedDataLoader(self._dataset, self.optimizer.batches, whole_run=True, **self._loader_options)

    def detach(self) -> None:
        """Remove the per-example hooks (clipping, loss) from the module and give its parameters back
        to every optimizer (``.grad`` fills again, any optimizer may step); the run cannot step after."""
        self.optimizer.clipper.remove()
        self.optimizer.release_wrapped_optimizer()
        self._loss_hooks.remove()
        if getattr(self.module, _MARK, None) is not None and getattr(self.module, _MARK)() is self:
            delattr(self.module, _MARK)

    @property
    def epsilon(self) -> float:
        """The epsilon of the whole planned run at ``delta`` (add/remove adjacency)."""
        return self.plan.epsilon

    @property
    def delta(self) -> float:
        return self.plan.delta

    def epsilon_spent(self, delta: float | None = None) -> float:
        """The epsilon of the releases so far (the first ``steps_taken`` steps) at ``delta``.

        Never above the planned epsilon, equal to it once every planned step is taken, 0 before
        the first step. The first t releases are the leading t x t block of C applied to the
        first t gradients (C is lower triangular), priced by the plan's own accountant for the
        participation the sampler guarantees within t steps, and capped by the whole run's bound
        (dropping the later releases is a post-processing). Before the first full cycle of bins
        (or Poisson groups) the cycle's bound is used: the first t steps are a post-processing
        of the first ``min_sep`` ones. ``delta`` defaults to the plan's.
        """
        delta = self.plan.delta if delta is None else acc.process.check_delta(delta)
        steps = self.steps_taken
        if steps == 0:
            return 0.0
        whole = self.plan.accountant.epsilon_at(delta)
        if steps >= self.plan.participation.n_steps:
            return whole
        cached = self._spent.get((steps, delta))
        if cached is None:
            horizon = max(steps, self.plan.participation.min_sep)
            mechanism = self.plan.accountant.priced_noise.mechanism
            prefix = _accountant_for(PrefixStrategy(mechanism), self.optimizer.batches.sampler, horizon,
                                     self.plan.accounting)(self.plan.noise_multiplier)
            cached = self._spent[(steps, delta)] = min(whole, prefix.epsilon_at(delta))
        return cached

    @property
    def noise_multiplier(self) -> float:
        return self.plan.noise_multiplier

    @property
    def steps_taken(self) -> int:
        return self.optimizer.steps_taken

    def state_dict(self) -> dict:
        """Model, optimizer, noise state, step and key: ``torch.save`` it, load with weights_only=True."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "key": self._root_key.hex(),
            "plan": {"n_steps": self.plan.participation.n_steps, "num_bins": self.plan.num_bins,
                     "noise_multiplier": self.plan.noise_multiplier, "max_grad_norm": self.plan.max_grad_norm,
                     "sampling": self.plan.sampling, "accounting": self.plan.accounting,
                     "num_groups": self.plan.num_groups, "sample_rate": self.plan.sample_rate,
                     "privacy_unit": checkpoint_name(getattr(self.optimizer.batches.sampler, "units", None))},
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "noise": self.optimizer.noise_state.state_dict(),
        }

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None, fresh_key: RngKey | None = None) -> None:
        """Restore a run saved by ``state_dict()`` into this (identically planned) run.

        ``draws="replay"`` or ``fresh_key=k`` is required: the noise of the steps after the
        checkpoint may already have been released (see ``NoiseState.load_state_dict`` and
        SECURITY.md, "Replaying or redrawing noise"). The data loader restarts at the next step.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise ValueError("not a checkpoint of make_private's run: expected PrivateTraining.state_dict()")
        if state_dict.get("version") != _VERSION:
            raise ValueError(f"checkpoint version {state_dict.get('version')!r} is not supported (reads {_VERSION})")
        mine = self.state_dict()
        saved_plan = {**_PLAN_BEFORE_SAMPLING, "privacy_unit": checkpoint_name(None), **state_dict["plan"]}
        if saved_plan.get("accounting") == "rdp":  # the amplified bound's old name
            saved_plan["accounting"] = "amplified"
        if state_dict["key"] != mine["key"] or saved_plan != mine["plan"]:
            raise ValueError(
                "this checkpoint belongs to another plan or key (different sampling, bins, horizon, accounting, "
                "noise or privacy units); build the run with the same make_private arguments and "
                "key=opake.random.RngKey.from_hex(saved['key'])"
            )
        noise_state = self.optimizer.noise_state.load_state_dict(state_dict["noise"], draws=draws, fresh_key=fresh_key)
        self.module.load_state_dict(state_dict["module"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.optimizer.noise_state = noise_state
        self.optimizer.batches.served = None  # the data loader continues at the restored step


def make_private(
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
    batch_size: int,
    epochs: int,
    max_grad_norm: float,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    strategy=None,
    sampling: str = "balls_in_bins",
    amplification: bool | None = None,
    lr_scheduler=None,
    key: RngKey | None = None,
    process_group=None,
    loss_reduction: str = "mean",
    progress: bool | None = None,
    privacy_unit=None,
    **loader_options,
) -> PrivateTraining:
    """Plan a private run and return the module, optimizer and data loader that carry it out.

    Give either ``target_epsilon`` (the noise multiplier is calibrated) or ``noise_multiplier``
    (``epsilon`` is computed); ``target_delta`` always. ``strategy`` defaults to the BLT
    optimized for what ``optimizer`` (and ``lr_scheduler``, if given) will do with the noise
    (``strategy_for_optimizer``); ``loss_reduction`` says whether the loss is the mean (default, as
    ``F.cross_entropy``) or the sum over the batch. Extra keyword arguments go to the
    DataLoader (``num_workers``, ``pin_memory``, ...).

    ``privacy_unit`` (default None: each example is a unit) gives one hashable id per example
    (a list, array or tensor of user ids; or an ``opake.dpftrl.sampling.PrivacyUnits``) for
    user-level privacy: users are sampled, ``batch_size`` is the expected number of users per
    batch, each user's summed gradient is clipped to ``max_grad_norm``, and epsilon is for adding
    or removing one user with all its examples (docs/torch.md, "User-level privacy").

    ``sampling="balls_in_bins"`` (default) works with every strategy. ``amplification=None``
    (default) prices it with the tightest bound proven for adaptively chosen gradients
    (docs/adaptivity.md): the random-allocation PLD for strategies whose bins do not interact
    (the identity: DP-SGD on balls in bins; ``accounting="allocation_pld"``), the unamplified bound
    for every other strategy, a BLT included (``accounting="rigorous"``). ``amplification=False``
    is always the unamplified bound. ``amplification=True`` asks for ``balls_in_bins(...,
    method="amplified")``, the amplified bound of the aligned dominating pair: for a BLT it is not
    proven for adaptive gradients and warns (``UnprovenAmplificationWarning``); it needs a
    strategy matrix with non-negative entries. ``sampling="poisson"`` is cyclic Poisson sampling (Band23 Thm 4,
    priced by PLD) for ``strategy=band_mf_strategy(bands=g)`` (g groups) or
    ``identity_strategy()`` (DP-SGD with Poisson sampling, as in Opacus); the sample rate is
    ``batch_size * g / len(dataset)`` and must be at most 1. The module docstring has the
    details and calibration times.

    Raises, before anything is modified, on a dataset too small for the batch size, an epsilon
    that cannot be met, an optimizer whose parameters are not the module's trainable
    parameters, layers that mix examples, Poisson sampling with a strategy it does not cover
    (a BLT, or no strategy given) and amplification for a strategy with negative entries.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "pass the plain module, not DistributedDataParallel(module): make_private reduces the clipped "
            "per-example gradients across ranks itself (DDP would average unclipped gradients)"
        )
    rank, world_size = _rank_and_world(process_group)
    _refuse_second_plan(module)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DPOptimizer):
        raise TypeError(f"optimizer must be a plain torch.optim.Optimizer over the module's parameters, "
                        f"got {type(optimizer).__name__}")
    batch_size = _positive_int("batch_size", batch_size)
    epochs = _positive_int("epochs", epochs)
    _check_sampling(sampling, amplification)
    max_grad_norm = positive_finite("max_grad_norm", max_grad_norm)
    require_valid_model(module)
    parameters = trainable_parameters(module)
    _check_optimizer_covers(optimizer, module, parameters)
    num_examples = len(dataset)
    units = privacy_units(privacy_unit, num_examples)
    if units is not None and world_size > 1:
        raise ValueError(
            "privacy_unit is not supported under torch.distributed: ranks serve their part of a batch row by "
            "row, which could split one user's examples across ranks (each rank would clip its part on its "
            "own). Train user-level runs in one process"
        )
    num_drawn = num_examples if units is None else units.num_units  # what the sampler draws
    steps_per_epoch = num_drawn // batch_size
    if steps_per_epoch < 1:
        drawn = f"{num_examples} examples" if units is None else f"{num_drawn} privacy units (users)"
        raise ValueError(
            f"the dataset has {drawn}, fewer than batch_size={batch_size}: there is not one batch per epoch; "
            f"use batch_size <= {num_drawn}" + ("" if units is None else " (with privacy_unit, batch_size counts "
                                                                         "users per batch)")
        )
    root_key = _shared_key(process_group, world_size) if key is None else key
    if not isinstance(root_key, RngKey):
        raise TypeError(f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}")
    sampler_key = root_key.fold_in("opake.torch.sampler")
    poisson = sampling == "poisson"
    if poisson:
        groups = _poisson_groups(strategy)
        sampler = CyclicPoissonSampler(num_drawn, num_groups=groups,
                                       sample_rate=_poisson_rate(batch_size, groups, num_drawn,
                                                                 "len(dataset)" if units is None else "users"),
                                       key=sampler_key)
    else:
        sampler = BallsInBinsSampler(num_drawn, steps_per_epoch, sampler_key)
    if units is not None:  # the same draws over users; each drawn user brings all its examples
        sampler = UnitSampler(sampler, units)
    participation = sampler.participation(epochs * steps_per_epoch)
    if strategy is None:
        strategy = strategy_for_optimizer(optimizer, participation.n_steps, lr_scheduler)
    accounting = _accounting(poisson, amplification, strategy, sampler, participation.n_steps)
    accountant_of_sigma = _accountant_for(strategy, sampler, participation.n_steps, accounting)
    plan_key = (strategy, accounting, sampling, getattr(sampler, "num_bins", None), getattr(sampler, "num_groups", None),
                getattr(sampler, "sample_rate", None), participation.n_steps)
    unamplified = _accountant_for(strategy, sampler, participation.n_steps, "rigorous")
    with _each_warning_once():
        sigma, epsilon, delta, accountant = _plan_noise(accountant_of_sigma, accounting, participation, target_epsilon,
                                                        target_delta, noise_multiplier, plan_key, progress, unamplified)
    engine_arguments = dict(
        n_steps=participation.n_steps, min_sep=participation.min_sep,
        max_participations=participation.max_participations, noise_multiplier=sigma,
        key=root_key.fold_in("opake.torch.noise"),
    )
    template = {name: p.detach() for name, p in parameters.items()}
    if world_size > 1:  # every rank noises what it owns; one all-gather shares it (docs/distributed.md)
        noise_fn, noise_state = sharded_mf_gaussian_noise(template, strategy, process_group=process_group,
                                                          **engine_arguments)
    else:
        noise_fn, noise_state = mf_gaussian_noise(template, strategy, **engine_arguments)
    noise_fn.check_accounted_by(accountant)
    loader_options = _planned_loader_options(dataset, sampler, loader_options)
    # Everything above only reads the caller's objects; from here on the module gets hooks.
    clipper = PerExampleClipper(module, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
    loss_hooks = PerExampleLoss(module, loss_reduction)
    plan = PrivacyPlan(participation, None if poisson else sampler.num_bins, sampler.expected_batch_size, strategy,
                       sigma, epsilon, delta, max_grad_norm, accountant, sampling=sampling, accounting=accounting,
                       num_groups=sampler.num_groups if poisson else None,
                       sample_rate=sampler.sample_rate if poisson else None, steps_per_epoch=steps_per_epoch,
                       loss=loss_hooks.description or _USER_LOSS[loss_reduction], privacy_unit=description(units))
    batches = PlannedBatches(sampler, participation.n_steps, steps_per_epoch, part=(rank, world_size))
    if units is not None:  # each served batch's users, to the clipper, before the loop sees the batch
        batches.on_serve = lambda step: clipper.expect_units(batches.units(step))
    private_optimizer = DPOptimizer(optimizer, clipper=clipper, noise_fn=noise_fn, noise_state=noise_state,
                                    parameters=parameters, max_grad_norm=max_grad_norm,
                                    normalization=sampler.expected_batch_size, batches=batches,
                                    noise_multiplier=sigma, process_group=process_group, distributed=world_size > 1)
    private = PrivateTraining(module, private_optimizer, dataset, plan, root_key, loader_options, loss_hooks)
    setattr(module, _MARK, weakref.ref(private))
    return private


def strategy_for_optimizer(optimizer: torch.optim.Optimizer, n_steps: int, lr_scheduler=None):
    """The BLT recipe whose workload is the noise's path through ``optimizer``.

    ``torch.optim.SGD`` moves the parameters along the prefix sums of lr_t times its momentum
    buffer, so its noise in the parameters is S D_lr M C^{-1} z: ``blt_strategy(workload=
    "parameters", momentum, dampening, nesterov, lr_schedule)`` optimizes exactly that (docs/blt.md).
    The schedule is read by stepping deep copies of the optimizer and ``lr_scheduler`` through
    the ``n_steps`` planned steps (the caller's objects are not touched). Plain SGD without a
    schedule is the prefix-sum workload, the default recipe. Optimizers whose update is not
    linear in the gradient (Adam, AdamW, RMSprop, ...) have no exact workload; they get the
    default recipe (prefix sums of the noise, docs/blt.md says why). Several parameter groups
    with different momentum settings also get the default.
    """
    if type(optimizer) is not torch.optim.SGD:
        return blt_strategy()
    settings = {(g["momentum"], g["dampening"], g["nesterov"]) for g in optimizer.param_groups}
    if len(settings) != 1:
        return blt_strategy()
    momentum, dampening, nesterov = settings.pop()
    schedule = None if lr_scheduler is None else _learning_rates(optimizer, lr_scheduler, n_steps)
    if momentum == 0 and schedule is None:
        return blt_strategy()
    return blt_strategy(workload="parameters", momentum=float(momentum), dampening=float(dampening),
                        nesterov=bool(nesterov), lr_schedule=schedule)


def _learning_rates(optimizer, lr_scheduler, n_steps: int) -> tuple:
    """The first group's learning rate at each of the next ``n_steps`` steps, read from copies.

    The optimizer and scheduler are deep-copied together (so the copy's scheduler drives the
    copy's optimizer) with every parameter replaced by a one-element stand-in: the model's
    weights are never copied and never change.
    """
    stand_ins = {id(p): nn.Parameter(torch.zeros(1)) for group in optimizer.param_groups for p in group["params"]}
    optimizer_copy, scheduler_copy = copy.deepcopy((optimizer, lr_scheduler), memo=dict(stand_ins))
    rates = []
    try:
        with warnings.catch_warnings():
            # Only the copied scheduler steps: the copied optimizer's step may be a wrapper bound
            # to the caller's optimizer, so it is never called (torch then warns about the order).
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(n_steps):
                rates.append(float(optimizer_copy.param_groups[0]["lr"]))
                scheduler_copy.step()
    except TypeError as error:
        raise ValueError(
            f"cannot read the learning-rate schedule by stepping a copy of {type(lr_scheduler).__name__} "
            f"({error}); pass strategy=blt_strategy(workload='parameters', momentum=..., lr_schedule=[...]) "
            f"with the planned rates yourself"
        ) from None
    return tuple(rates)


def _rank_and_world(process_group) -> tuple[int, int]:
    """(rank, world size) of ``process_group`` (the default group) when torch.distributed runs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _shared_key(process_group, world_size: int) -> RngKey:
    """A fresh 128-bit key from the operating system, the same on every rank (rank 0's)."""
    seed = [secrets.randbits(128)]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(seed, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)
    return make_key(seed[0])


def _check_sampling(sampling, amplification) -> None:
    if sampling not in _SAMPLINGS:
        raise ValueError(f"sampling must be one of {_SAMPLINGS}, got {sampling!r}")
    if amplification is not None and not isinstance(amplification, bool):
        raise TypeError(f"amplification must be None (the proven default), True or False, got {amplification!r}")
    if sampling == "poisson" and amplification is False:
        raise ValueError(
            "amplification=False applies to sampling='balls_in_bins'; cyclic Poisson sampling is always "
            "priced with its amplification (Band23 Thm 4). For an unamplified bound use "
            "sampling='balls_in_bins', amplification=False"
        )


def _poisson_groups(strategy) -> int:
    """The number of groups g of cyclic Poisson sampling: the strategy's bands (1 for the identity)."""
    if isinstance(strategy, IdentityStrategy):
        return 1
    if isinstance(strategy, BandMFStrategy):
        return strategy.bands
    given = "no strategy (the default is a BLT)" if strategy is None else type(strategy).__name__
    raise dpftrl_acc.UnsupportedAmplificationError(
        f"sampling='poisson' needs a banded strategy, got {given}: Poisson amplification of correlated "
        f"noise is proven only for banded strategies (Band23 Thm 4). Pass strategy=band_mf_strategy(bands=...) "
        f"or strategy=identity_strategy() (DP-SGD), or keep the strategy and use sampling='balls_in_bins'"
    )


def _poisson_rate(batch_size: int, groups: int, num_examples: int, counted: str = "len(dataset)") -> float:
    """q = batch_size * g / len(dataset): a served group of ~len(dataset)/g examples yields ~batch_size
    (with privacy_unit, ``num_examples`` is the number of users, ``counted`` says so, and batch_size
    counts users)."""
    if batch_size * groups > num_examples:
        raise ValueError(
            f"sampling='poisson' with {groups} group(s) and batch_size={batch_size} needs a sample rate "
            f"batch_size * groups / {counted} = {batch_size * groups}/{num_examples} > 1; use at most "
            f"{num_examples // batch_size} bands or a batch size of at most {num_examples // groups}"
        )
    return batch_size * groups / num_examples


def _accountant_for(strategy, sampler, n_steps: int, accounting: str):
    """sigma -> the privacy process of this sampler's run (the bound ``accounting`` names)."""
    if accounting == "pld":
        return lambda sigma: dpftrl_acc.poisson(dpftrl_acc.mf_gaussian(sigma, strategy), sampler.sample_rate,
                                                n_steps)
    # "allocation_pld" is balls_in_bins' default for bins that do not interact: the PLD and the
    # amplified bound of the same (proven) pair, per direction the smaller.
    method = None if accounting == "allocation_pld" else accounting
    return lambda sigma: dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(sigma, strategy), num_bins=sampler.num_bins,
                                                  n_steps=n_steps, method=method)


def _accounting(poisson: bool, amplification, strategy, sampler, n_steps: int) -> str:
    """The bound the plan is priced with (PrivacyPlan.accounting); see make_private's docstring."""
    if poisson:
        return "pld"
    if amplification is False:
        return "rigorous"
    if amplification:
        _check_amplifiable(strategy, sampler, n_steps)
        return "amplified"
    rigorous = _accountant_for(strategy, sampler, n_steps, "rigorous")(1.0)
    if not has_non_negative_entries(rigorous):
        return "rigorous"
    orthogonal = orthogonal_bins(rigorous.mechanism.toeplitz_coefficients(n_steps), sampler.num_bins)
    return "allocation_pld" if orthogonal else "rigorous"


# Calibrated noise multipliers by (strategy, accounting, sampler, horizon, epsilon, delta): the
# calibration is a pure function of these, and the amplified bounds take seconds to calibrate,
# so a second identical plan (another learning rate or seed) reuses the first one's sigma.
_CALIBRATED: dict = {}
_CALIBRATED_LIMIT = 256


@contextlib.contextmanager
def _each_warning_once():
    """Warnings raised while planning, each (category, message) shown once: a calibration evaluates
    its bound several times, and the amplified bound of a BLT warns at every evaluation. They are
    re-issued after planning through the caller's filters ("error" still raises)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen = set()
    for warning in caught:
        key = (warning.category, str(warning.message))
        if key not in seen:
            seen.add(key)
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _plan_noise(accountant, accounting, participation, target_epsilon, target_delta, noise_multiplier,
                plan_key=None, progress=None, unamplified=None):
    """(sigma, epsilon, delta, process) for the plan: the given sigma priced, or sigma calibrated.

    ``unamplified`` (sigma -> the unamplified balls-in-bins process) caps the amplified bound
    and starts its calibration (``_calibrate_noise``); ``progress`` (None: on when stderr is a
    terminal) reports the seconds-long amplified evaluations on stderr (``opake.progress``).
    """
    from opake.progress import Progress

    if target_delta is None:
        raise TypeError("make_private needs target_delta (e.g. 1e-5, below 1 / len(dataset))")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise TypeError("give exactly one of target_epsilon (calibrate the noise) and noise_multiplier")
    reporter = Progress.of(progress)
    summary = None
    try:
        if noise_multiplier is not None:
            with reporter.stage(f"pricing noise multiplier {float(noise_multiplier):g} ({accounting} bound)"):
                process = accountant(positive_finite("noise_multiplier", noise_multiplier))
                epsilon = process.epsilon_at(target_delta)
            summary = f"noise multiplier {float(noise_multiplier):g} gives epsilon {epsilon:.6g} at delta {target_delta:g}"
            return float(noise_multiplier), epsilon, float(target_delta), process
        budget = acc.epsilon_budget(target_epsilon, target_delta)
        cache_key = None if plan_key is None else plan_key + (budget.epsilon, budget.delta)
        try:
            cached = _CALIBRATED.get(cache_key)
        except TypeError:  # an unhashable strategy: calibrate every time
            cache_key, cached = None, None
        if cached is not None:
            with reporter.stage(f"checking the calibrated noise multiplier {cached:.6g} of an identical plan"):
                process = accountant(cached)
                epsilon = process.epsilon_at(target_delta)
            summary = f"noise multiplier {cached:.6g}: epsilon {epsilon:.6g} <= {budget.epsilon:g}"
            return cached, epsilon, float(target_delta), process
        sigma, epsilon, delta, process = _calibrate_noise(accountant, accounting, participation, budget,
                                                          target_epsilon, target_delta, reporter, unamplified)
        if cache_key is not None and len(_CALIBRATED) < _CALIBRATED_LIMIT:
            _CALIBRATED[cache_key] = sigma
        summary = f"noise multiplier {sigma:.6g}: epsilon {epsilon:.6g} <= {budget.epsilon:g} at delta {delta:g}"
        return sigma, epsilon, delta, process
    finally:
        reporter.close(summary)


def _calibrate_noise(accountant, accounting, participation, budget, target_epsilon, target_delta,
                     progress=None, unamplified=None):
    """Calibrate sigma to ``budget`` on the plan's accountant; ``progress`` reports the evaluations.

    The amplified bounds (seconds per evaluation) go through ``calibrate_capped`` from the
    unamplified sigma (1 to 5 evaluations instead of ~20; epsilon within 0.1% of the target, as
    ``opake.plan.plan_dataset`` calibrates it); every result is an exact evaluation at its sigma.
    """
    from opake.accounting.calibrate import calibrate_capped
    from opake.progress import Progress, calibration_reporter

    progress = Progress.of(progress)
    report = calibration_reporter(progress, budget.epsilon)
    low, high = _SIGMA_RANGE
    try:
        if accounting == "pld":
            # PLD evaluations slow down as sigma / column norm falls, so the search starts near the
            # answer and stops at _POISSON_FLOOR column norms.
            with progress.stage("calibrating the noise multiplier (cyclic Poisson, PLD)"):
                process = accountant(high)  # a cheap evaluation: a tiny PLD at a huge sigma
                low = _POISSON_FLOOR * process.column_norm
                guess = noise_multiplier_guess(process.sample_rate, process.compositions, process.column_norm,
                                               budget)
                result = acc.calibrate_near(budget, accountant, guess, low, high, on_evaluation=report)
        elif accounting in ("amplified", "allocation_pld") and unamplified is not None:
            # Both amplified balls-in-bins bounds are capped by the unamplified one, so its calibrated
            # sigma (microseconds) meets the budget: the search's first guess and upper end.
            with progress.stage(f"calibrating the noise multiplier (balls in bins, {accounting} bound)"):
                cap = acc.calibrate(budget, unamplified, low, high)
                result = calibrate_capped(budget, accountant, unamplified, low, high, cap=cap, on_evaluation=report)
        else:
            with progress.stage(f"calibrating the noise multiplier (balls in bins, {accounting} bound)"):
                result = acc.calibrate(budget, accountant, low, high, on_evaluation=report)
    except acc.CalibrationRangeError as error:
        if accounting == "pld" and error.end == "min":
            raise ValueError(
                f"target_epsilon={target_epsilon} at delta={target_delta} is met with a noise multiplier "
                f"below {low:.4g} under Poisson sampling, where the PLD accounting gets too costly to "
                f"calibrate; pass noise_multiplier= (at least {low:.4g}) instead of target_epsilon"
            ) from None
        raise ValueError(
            f"target_epsilon={target_epsilon} at delta={target_delta} cannot be met for this plan "
            f"({participation}) with a noise multiplier in ({low:.4g}, {high:g}): {error}. Raise the "
            f"budget, or train fewer epochs"
        ) from None
    return result.param, result.epsilon, float(target_delta), result.process


def _check_amplifiable(strategy, sampler, n_steps: int) -> None:
    """Refuse, with the fix, a strategy the amplified balls-in-bins bound does not cover: its
    dominating pair is the worst case only for a strategy matrix C >= 0 entrywise (bin_gram.py)."""
    if not has_non_negative_entries(_accountant_for(strategy, sampler, n_steps, "rigorous")(1.0)):
        raise ValueError(
            "amplification=True prices balls-in-bins sampling with the amplified Renyi bound, which holds "
            "only for a strategy matrix with non-negative entries, and this strategy's has a negative one. "
            "Pass amplification=False (the unamplified bound), or a strategy without negative coefficients"
        )


def _check_optimizer_covers(optimizer, module, parameters: dict) -> None:
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = optimized - {id(p) for p in module.parameters()}
    missing = [name for name, p in parameters.items() if id(p) not in optimized]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the module; "
            f"build the optimizer from this module's parameters (module.parameters())"
        )
    if missing:
        raise ValueError(
            f"the module's trainable parameters {missing[:5]} are not in the optimizer; add them, or "
            f"freeze them (requires_grad_(False)) so that they get no noise"
        )


_MARK = "_opake_private_training"
_USER_LOSS = {"mean": "the caller's loss: a mean over the batch's examples of per-example terms (loss_reduction='mean')",
              "sum": "the caller's loss: a sum over the batch's examples of per-example terms (loss_reduction='sum')"}


def _refuse_second_plan(module) -> None:
    """A module already made private carries the first run's hooks: a second set would clip twice."""
    first = getattr(module, _MARK, None)
    if first is not None and first() is not None:
        raise ValueError(
            "make_private was already called on this module, whose hooks clip for that first run; use the "
            "first call's result, or call its detach() (private.detach()) before planning a new run"
        )


def _planned_loader_options(dataset, sampler, loader_options: dict) -> dict:
    """The DataLoader options of the planned loaders: the caller's, less what would replace the batches."""
    if len(dataset) != sampler.num_examples:
        raise ValueError(f"the dataset has {len(dataset)} examples but the plan has {sampler.num_examples}")
    conflicting = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_options))
    if conflicting:
        raise TypeError(
            f"make_private does not take {conflicting}: the batches come from the plan's sampler, whose "
            f"participation the accountant priced (batch_size= sets their expected size)"
        )
    options = dict(loader_options)
    if options.get("collate_fn") is None:
        options["collate_fn"] = collate_allowing_empty(dataset[0])
    return options


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
