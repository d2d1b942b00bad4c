"""``make_private``: private training with correlated noise on standard PyTorch objects.

One call plans the run and returns the objects the user's loop already uses::

    private = make_private(module=model, optimizer=optimizer, dataset=train_ds, batch_size=64,
                           epochs=5, target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0)
    model, optimizer, loader = private.module, private.optimizer, private.data_loader
    for x, y in loader:
        optimizer.zero_grad(); F.cross_entropy(model(x), y).backward(); optimizer.step()
    private.epsilon                       # the whole planned run's guarantee
    torch.save(private.state_dict(), path)

``make_private`` is request, plan, then attach. Its privacy keyword arguments (or ``privacy=``)
make one ``PrivacySpec`` (``opake.torch.request``); the plan
(``opake.torch.planning.plan_request``: sampler, strategy, accountant, noise multiplier, epsilon)
touches nothing; attaching it hooks the module for per-example clipping
(``opake.torch.per_example``) and Hugging Face's per-example loss (``opake.torch.losses``), takes
the parameters' gradients out of the reach of every other optimizer (``opake.torch.guard``),
builds the noise engine (checked against the accountant, ``check_accounted_by``) and the run's
state (``opake.torch.run``), and wraps the optimizer (``DPOptimizer``: clipped sums divided by the
sampler's constant expected batch size, noise in ``optimizer.step()``, a step past the plan raises
``PlanExhaustedError``).

Under torch.distributed (initialized, world size > 1; or ``process_group=``) every rank
builds the same plan from the same key and must hold the same data set (checked), its data
loader serves its part of every global batch (``batch[rank::world_size]``), and the run's
reduction (``opake.torch.reduction``) forms the global clipped sum and adds the noise once:
replicated (rank 0's weights broadcast to every rank; each rank noises the parameters it owns,
``ownership``, and one all-gather shares them) or, for a module sharded with FSDP2's
``fully_shard``, sharded (the sums reduce-scattered, each rank noising its own shards). Either
equals one process on the same global batches with the same key. Pass the plain (or
``fully_shard``-ed) module, not ``DistributedDataParallel(module)`` (docs/distributed.md).

User-level privacy (``privacy_unit=ids``, one id per example): the protected unit is all the
examples of one id (a user). Users are put in the bins (or Poisson groups), ``batch_size``
counts users per batch, each user's summed gradient is clipped, and the accountant prices users
as it priced examples (``opake.torch.privacy_units``). Not combined with torch.distributed.

Randomness: ``key`` (an ``opake.random.RngKey``) seeds the sampler and the noise; without one,
a 128-bit key is drawn from the operating system (``secrets``), as SECURITY.md recommends for
published runs, and kept in ``state_dict()`` so that a resumed run continues the same bins.
The checkpoint format is ``opake.torch.checkpoint``'s.
"""

from __future__ import annotations

import hashlib
import weakref

import torch
from torch import nn

import opake.accounting as acc
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.distributed.ownership import OWNERSHIP_MODES, balanced_ownership
from opake.dpftrl.noise.engine.layout import Layout
from opake.dpftrl.sampling import require_map_style, sampled_loader_options
from opake.dpftrl.strategies.prefix import PrefixStrategy
from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.random import RngKey
from opake.torch.adamw import NoiseCorrection, noise_correction_for
from opake.torch.checkpoint import (FORMAT, VERSION, CheckpointError, check_checkpoint, check_module_state,
                                    check_optimizer_state, clipping_record, plan_record, whole_digest)
from opake.torch.contract import PlanContract
from opake.torch.loader import PlannedBatches, PlannedDataLoader
from opake.torch.losses import PerExampleLoss, loss_form
from opake.torch.optimizer import DPOptimizer
from opake.torch.per_example import PerExampleClipper
from opake.torch.planning import PrivacyPlan, plan_request, strategy_for_optimizer
from opake.torch.ranks import (agree, broadcast_module, dataset_digest, launcher_restarts,
                              rank_and_world as _rank_and_world, require_one_run, shared_key)
from opake.torch.reduction import Replicated, Sharded, SingleProcess
from opake.torch.request import PrivacySpec, request_of
from opake.torch.run import PrivateRun
from opake.torch.short_run import warn_if_short
from opake.torch.validation import require_uncompiled, require_valid_model, trainable_parameters

__all__ = ["PrivacyPlan", "PrivateTraining", "make_private", "strategy_for_optimizer"]

_MARK = "_opake_private_training"
# Bounds that grow with the horizon: single Gaussians (sigma / sensitivity of the leading block,
# whose sensitivity grows: a pattern of t rows is one of t + 1 rows, and C >= 0 adds non-negative
# terms) and cyclic Poisson's PLD (ceil(t / g) compositions of one mechanism).
_GROWS_WITH_THE_HORIZON = (AccountingMethod.RIGOROUS, AccountingMethod.GAUSSIAN, AccountingMethod.POISSON_PLD)


class PrivateTraining:
    """The result of ``make_private``: ``module``, ``optimizer``, ``data_loader`` and the plan.

    ``module`` is the caller's module itself (its ``state_dict`` loads into an unwrapped copy);
    ``optimizer`` is a ``DPOptimizer`` around the caller's optimizer; ``data_loader`` serves the
    planned batches, one epoch per pass, from the next untaken step (``for epoch in range(E):
    for batch in private.data_loader``); ``run_data_loader()`` serves the whole rest of the run
    in one pass; ``run`` owns the run's state (``opake.torch.run``). ``detach()`` removes the
    hooks from the module.
    """

    def __init__(self, module, optimizer: DPOptimizer, dataset, plan: PrivacyPlan, loader_options: dict,
                 loss_hooks: PerExampleLoss):
        self.module = module
        self.optimizer = optimizer
        self.plan = plan
        self.run = optimizer.run
        self._dataset = dataset
        self._loader_options = loader_options
        self._loss_hooks = loss_hooks
        self._spent: dict = {}
        self._reported: dict = {}  # delta -> the largest epsilon_spent reported (monotone bounds)
        self.data_loader = PlannedDataLoader(dataset, self.run, **loader_options)

    def run_data_loader(self) -> PlannedDataLoader:
        """A loader whose one pass serves every remaining planned step (all epochs)."""
        return PlannedDataLoader(self._dataset, self.run, whole_run=True, **self._loader_options)

    def detach(self) -> None:
        """Remove the per-example hooks (clipping, loss) from the module and give its parameters back
        to every optimizer (``.grad`` fills again, any optimizer may step); the run cannot step after."""
        warn_if_short(self, "private.detach()")
        self.optimizer.clipper.remove()
        self.optimizer.contract.remove()
        self.optimizer.release_wrapped_optimizer()
        self._loss_hooks.remove()
        if getattr(self.module, _MARK, None) is not None and getattr(self.module, _MARK)() is self:
            delattr(self.module, _MARK)

    @property
    def epsilon(self) -> float:
        """The epsilon of the whole planned run at ``delta`` (add/remove adjacency); read after the
        first step and before the last, it warns (``ShortRunWarning``) with what was spent so far."""
        warn_if_short(self, "private.epsilon", once=True)
        return self.plan.epsilon

    @property
    def delta(self) -> float:
        return self.plan.delta

    def epsilon_spent(self, delta: float | None = None) -> float:
        """The epsilon of the releases so far (the first ``steps_taken`` steps) at ``delta``.

        Never above the planned epsilon, equal to it once every planned step is taken, 0 before
        the first step, and non-decreasing in the step. The first t releases are the leading
        t x t block of C applied to the first t gradients (C is lower triangular), priced by the
        plan's own accountant for the participation the sampler guarantees within t steps. They
        are also a post-processing of the first t' releases for every t' > t (drop the rest),
        so any later prefix's bound holds for them too: the reported value is the smallest of
        the bounds at t, at the end of every later cycle of bins (or Poisson groups) and of the
        whole run. An amplified bound is not monotone in the horizon to the last digit (it
        minimizes over orders and bounding routes), so without the later bounds the reported
        epsilon could fall from one step to the next. Before the first full cycle the cycle's
        bound is used: the first t steps are a post-processing of the first ``min_sep`` ones.
        A single Gaussian bound (unamplified) and cyclic Poisson's composition grow with the
        horizon (a longer prefix is a longer composition), so they are priced at the current step
        only; the amplified balls-in-bins bounds at cycle ends (one evaluation per epoch and delta,
        kept).
        ``delta`` defaults to the plan's.
        """
        delta = self.plan.delta if delta is None else acc.process.check_delta(delta)
        steps = self.steps_taken
        if steps == 0:
            return 0.0
        n_steps, cycle = self.plan.n_steps, self.plan.participation.min_sep
        whole = self.plan.accountant.epsilon_at(delta)
        if steps >= n_steps:
            return whole
        if self.plan.accounting in _GROWS_WITH_THE_HORIZON:
            # The later bounds are no smaller; the running maximum only shields the report from
            # the last digits of a numerical bound (each value it keeps is itself a valid bound).
            value = min(whole, self._prefix_epsilon(max(steps, cycle), delta))
            value = self._reported[delta] = max(value, self._reported.get(delta, 0.0))
            return value
        horizons = range(-(-max(steps, cycle) // cycle) * cycle, n_steps, cycle)  # later cycle ends
        return min([whole] + [self._prefix_epsilon(horizon, delta) for horizon in horizons])

    def _prefix_epsilon(self, horizon: int, delta: float) -> float:
        """The plan's accountant's epsilon for the first ``horizon`` releases (cached)."""
        cached = self._spent.get((horizon, delta))
        if cached is None:
            mechanism = self.plan.accountant.priced_noise.mechanism
            prefix = self.plan.sampler.accountant(PrefixStrategy(mechanism), horizon,
                                                  self.plan.accounting)(self.plan.noise_multiplier)
            cached = self._spent[(horizon, delta)] = prefix.epsilon_at(delta)
        return cached

    @property
    def noise_multiplier(self) -> float:
        return self.plan.noise_multiplier

    @property
    def noise_correction(self) -> NoiseCorrection:
        """Whether the optimizer's second moment is corrected for the noise, and why
        (``opake.torch.adamw.NoiseCorrection``; ``str()`` says it in words)."""
        return self.optimizer.noise_correction

    @property
    def steps_taken(self) -> int:
        return self.run.step

    @property
    def sharded(self) -> bool:
        """Whether the module is sharded (FSDP2): each rank holds its shards of the parameters, the
        optimizer state and the noise state, and ``state_dict()`` is this rank's part of the run."""
        return isinstance(self.optimizer.reduction, Sharded)

    def state_dict(self) -> dict:
        """Model, optimizer, noise state, step and key, under one digest: ``torch.save`` it, load with
        weights_only=True."""
        saved = {"format": FORMAT, "version": VERSION, "key": self.plan.key.hex(), "plan": plan_record(self.plan),
                 "module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "noise": self.run.state.noise.state_dict()}
        saved["digest"] = whole_digest(saved)
        return saved

    def load_state_dict(self, state_dict: dict, *, draws: str | None = None, fresh_key: RngKey | None = None) -> None:
        """Restore a run saved by ``state_dict()`` into this (identically planned) run.

        ``draws="replay"`` or ``fresh_key=k`` is required: the noise of the steps after the
        checkpoint may already have been released (see ``NoiseState.load_state_dict`` and
        SECURITY.md, "Replaying or redrawing noise"). The data loader restarts at the next step.

        The checkpoint is validated whole before anything is replaced (its digest over the model,
        the optimizer and the noise state; its plan and key; the model's names and shapes; the
        optimizer's groups; the noise engine's configuration): a refused load leaves the run exactly
        as it was. A checkpoint older than the steps this run has already taken is refused
        (``CheckpointError``): those releases were made, and rewinding would make ``epsilon_spent()``
        forget them (and, with replayed draws, release their noise again on other gradients).
        """
        check_checkpoint(state_dict, self.plan, self.plan.key.hex())
        saved_step = state_dict["noise"].get("step") if isinstance(state_dict["noise"], dict) else None
        if isinstance(saved_step, int) and saved_step < self.steps_taken:
            raise CheckpointError(
                f"this checkpoint is at step {saved_step}, but this run has already released {self.steps_taken} "
                f"steps: loading it would rewind the run, and epsilon_spent() would no longer count the releases "
                f"already made (replayed draws would also release their noise again, on other gradients). Load "
                f"checkpoints into a freshly built run (the same make_private arguments and key), never into a "
                f"live one that is past them. Nothing was restored")
        check_module_state(self.module, state_dict["module"])
        check_optimizer_state(self.optimizer.original_optimizer, state_dict["optimizer"])
        # The noise state validates everything it needs before it retires the current state; the module
        # and optimizer were validated above, so nothing below fails half-way.
        noise_state = self.run.state.noise.load_state_dict(state_dict["noise"], draws=draws, fresh_key=fresh_key)
        self.module.load_state_dict(state_dict["module"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.run.restore(noise_state)
        self.optimizer.contract.restored()
        self._reported = {}

    def new_run_after_restart(self) -> None:
        """Train this run although the launcher restarted the worker (``TORCHELASTIC_RESTART_COUNT`` > 0)
        and no checkpoint was loaded: a deliberate second run over the same data, whose privacy cost adds
        up with the first's (``opake.torch.ranks.launcher_restarts``)."""
        self.optimizer.contract.restored()


def make_private(
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
    batch_size: int | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    max_grad_norm: float | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    strategy=None,
    sampling: str | None = None,
    amplification: bool | None = None,
    lr_scheduler=None,
    key: RngKey | None = None,
    process_group=None,
    loss_reduction: str = "mean",
    progress: bool | None = None,
    privacy_unit=None,
    ownership: str | None = None,
    clipping: str | None = None,
    noise_correction: bool | None = None,
    privacy: PrivacySpec | None = None,
    **loader_options,
) -> PrivateTraining:
    """Plan a private run and return the module, optimizer and data loader that carry it out.

    Give either ``target_epsilon`` (the noise multiplier is calibrated) or ``noise_multiplier``
    (``epsilon`` is computed); ``target_delta`` always. Without ``strategy``, a ``target_epsilon``
    run takes the mechanism with the least noise at that budget for what ``optimizer`` (and
    ``lr_scheduler``) does with the noise, among those proven for adaptively chosen gradients
    (``private.plan.choice`` says which and why; ``opake.planner.choice``); a ``noise_multiplier``
    run takes the BLT optimized for that workload (``strategy_for_optimizer``); ``loss_reduction`` says whether the loss is the mean (default, as
    ``F.cross_entropy``) or the sum over the batch. Extra keyword arguments go to the
    DataLoader (``num_workers``, ``pin_memory``, ...).

    ``steps`` (instead of ``epochs``) plans a horizon in steps, the last epoch cut where it ends: the
    noise is calibrated for exactly those steps, and the planned loader stops there.

    ``privacy_unit`` (default None: each example is a unit) gives one id per example (a list,
    array or tensor of user ids; or an ``opake.dpftrl.sampling.PrivacyUnits``) for user-level
    privacy: users are sampled, ``batch_size`` is the expected number of users per batch, each
    user's summed gradient is clipped to ``max_grad_norm``, and epsilon is for adding or removing
    one user with all its examples (docs/torch.md, "User-level privacy").

    ``max_grad_norm`` is the clipping bound C (or a clipping rule value, e.g.
    ``opake.dpftrl.clipping.AutomaticClipping(1.0, stability=0.01)``); ``clipping="automatic"``
    clips each unit's gradient by automatic clipping (AUTO-S, Bu et al. 2023): scaled by
    C / (||g|| + 0.01) rather than min(1, C / ||g||). The bound C, the noise and epsilon are the
    same; the learning rate is not (docs/torch.md, "Automatic clipping").

    ``sampling="balls_in_bins"`` (the default with a named strategy) works with every strategy;
    ``sampling=`` without a strategy restricts the choice. ``amplification=None``
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
    ``batch_size * g / len(dataset)`` and must be at most 1. ``opake.torch.planning`` has the
    details and calibration times. Under torch.distributed with a replicated model,
    ``ownership`` chooses which rank noises which parameters ("tensors", "blocks", "even"; None:
    whole tensors when they balance to within 10%, else an even split of the elements).

    ``privacy=PrivacySpec(...)`` gives the request whole (``opake.torch.request``) instead of its
    keyword arguments (``batch_size``, ``epochs`` or ``steps``, ``max_grad_norm``, ``clipping``,
    ``target_epsilon``, ``target_delta``, ``noise_multiplier``, ``strategy``, ``sampling``,
    ``amplification``, ``privacy_unit``); giving both is refused. Either way
    ``private.plan.request`` is the request the plan meets.

    ``noise_correction`` (None: on for a plain ``torch.optim.AdamW`` or ``Adam``) steps the
    optimizer with its second moment corrected for the noise: DP-AdamBC floored at the noise's own
    variance (``opake.torch.adamw``), post-processing that changes no privacy figure and suits the
    learning rate AdamW was tuned with. ``False`` steps the optimizer as it is; ``True`` raises
    if the optimizer cannot take it. ``private.noise_correction`` says which, and why.

    Raises, before anything is modified, on a dataset too small for the batch size, an epsilon
    that cannot be met, an optimizer whose parameters are not the module's trainable
    parameters, layers that mix examples, Poisson sampling with a strategy it does not cover
    (a BLT, or no strategy given) and amplification for a strategy with negative entries.
    """
    # Under torch.distributed every local refusal is shared before the next collective
    # (opake.torch.ranks.agree): a rank that refused alone would leave the others waiting in it.
    _, world_size = _rank_and_world(process_group)
    reduction, correction, failure = None, None, None
    try:
        require_one_run(process_group, world_size)
        require_map_style(dataset, "make_private")  # before len(dataset) is read for the plan
        unit = privacy_unit if privacy is None else getattr(privacy, "privacy_unit", None)
        reduction = _check_attachable(module, optimizer, process_group, unit, ownership)
        correction = noise_correction_for(optimizer, noise_correction)
    except Exception as error:
        failure = error
    agree(process_group, world_size, failure, reduction=type(reduction).__name__,
          dataset=dataset_digest(dataset) if world_size > 1 else None)
    parameters = trainable_parameters(module)
    root_key = shared_key(reduction.process_group, reduction.world_size) if key is None else key
    plan = None
    try:
        request = request_of(privacy, "make_private", batch_size=batch_size, epochs=epochs, steps=steps,
                             max_grad_norm=max_grad_norm, clipping=clipping, target_epsilon=target_epsilon,
                             target_delta=target_delta, noise_multiplier=noise_multiplier, strategy=strategy,
                             sampling=sampling, amplification=amplification, privacy_unit=privacy_unit)
        plan = plan_request(request, num_examples=len(dataset), key=root_key, optimizer=optimizer,
                            lr_scheduler=lr_scheduler, loss=loss_form(module, loss_reduction), progress=progress)
    except Exception as error:
        failure = error
    agree(process_group, world_size, failure, plan=None if plan is None else _plan_digest(plan))
    return attach(plan, module=module, optimizer=optimizer, dataset=dataset, parameters=parameters,
                  reduction=reduction, loss_reduction=loss_reduction, loader_options=loader_options,
                  noise_correction=correction)


def attach(plan: PrivacyPlan, *, module: nn.Module, optimizer: torch.optim.Optimizer, dataset, parameters: dict,
           reduction, loss_reduction: str, loader_options: dict, noise_correction: NoiseCorrection) -> PrivateTraining:
    """Carry out ``plan`` on ``module``: the noise engine, the hooks, the run and the private optimizer
    (``noise_correction``: ``noise_correction_for``'s decision for ``optimizer``)."""
    if isinstance(reduction, Replicated):  # replicas start from rank 0's weights (opake.torch.ranks)
        broadcast_module(module, reduction.process_group)
    engine_arguments = dict(
        n_steps=plan.n_steps, min_sep=plan.participation.min_sep,
        max_participations=plan.participation.max_participations, noise_multiplier=plan.noise_multiplier,
        key=plan.key.fold_in("opake.torch.noise"),
    )
    template = {name: p.detach() for name, p in parameters.items()}
    noise_fn, noise_state = reduction.noise(template, plan.strategy, **engine_arguments)
    noise_fn.check_accounted_by(plan.accountant)
    loader_options = sampled_loader_options(plan.sampler, dataset, loader_options, "make_private",
                                            "batch_size= sets their expected size")
    # Everything above only reads the caller's objects; from here on the module gets hooks.
    clipper = PerExampleClipper(module, max_grad_norm=plan.clipping, loss_reduction=loss_reduction)
    loss_hooks = PerExampleLoss(module, loss_reduction)
    batches = PlannedBatches(plan.sampler, plan.n_steps, plan.steps_per_epoch,
                             part=(reduction.rank, reduction.world_size), placeholder=isinstance(reduction, Sharded))
    run = PrivateRun(batches, noise_fn, noise_state, clipper)
    autograd_parameters = reduction.autograd_parameters(module, parameters)
    contract = PlanContract(module, optimizer, parameters, autograd_parameters, replaying=lambda: clipper.replaying)
    contract.hook()  # registered first: runs before the clipper's hooks
    contract.restarts = launcher_restarts()  # a restarted worker restores its run before training it
    private_optimizer = DPOptimizer(optimizer, run=run, clipper=clipper, parameters=parameters,
                                    autograd_parameters=autograd_parameters, normalization=plan.expected_batch_size,
                                    noise_multiplier=plan.noise_multiplier, reduction=reduction,
                                    noise_correction=noise_correction, contract=contract)
    private = PrivateTraining(module, private_optimizer, dataset, plan, loader_options, loss_hooks)
    setattr(module, _MARK, weakref.ref(private))
    return private


def _plan_digest(plan: PrivacyPlan) -> str:
    """What every rank's plan must share, as a short digest: horizon, participation, noise, the
    resolved mechanism and the key."""
    text = repr((plan.participation, plan.noise_multiplier, plan.max_grad_norm, clipping_record(plan.clipping),
                 str(plan.accounting),
                 plan.accountant.priced_noise.mechanism.fingerprint, plan.key.hex()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_attachable(module, optimizer, process_group, privacy_unit, ownership=None):
    """Refuse what cannot carry a plan (before planning); return the run's reduction."""
    if not isinstance(module, nn.Module):
        raise InvalidTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    require_uncompiled(module)  # torch.compile cannot trace the per-example hooks
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise InvalidTypeError(
            "pass the plain module, not DistributedDataParallel(module): make_private reduces the clipped "
            "per-example gradients across ranks itself (DDP would average unclipped gradients)"
        )
    _refuse_second_plan(module)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DPOptimizer):
        raise InvalidTypeError(f"optimizer must be a plain torch.optim.Optimizer over the module's parameters, "
                               f"got {type(optimizer).__name__}")
    require_valid_model(module)
    parameters = trainable_parameters(module)
    _check_optimizer_covers(optimizer, module, parameters)
    reduction = _reduction(process_group, parameters, ownership)
    if privacy_unit is not None and reduction.world_size > 1:
        raise InvalidArgumentError(
            "privacy_unit is not supported under torch.distributed: ranks serve their part of a batch row by "
            "row, which could split one user's examples across ranks (each rank would clip its part on its "
            "own). Train user-level runs in one process"
        )
    return reduction


def _reduction(process_group, parameters: dict, ownership: str | None):
    """How this process's clipped sums meet the others': one process, every rank of the group with
    the whole model (replicated), or every rank with a shard of each parameter (FSDP2)."""
    rank, world_size = _rank_and_world(process_group)
    if any(_is_dtensor(p) for p in parameters.values()):
        if ownership is not None:
            raise InvalidArgumentError(
                "ownership= chooses who noises what in a replicated run; a sharded (FSDP2) model's "
                "ranks each noise their own shards: drop ownership="
            )
        return Sharded(parameters, process_group, rank, world_size)
    if world_size == 1:
        return SingleProcess()
    if ownership is None:
        ownership = balanced_ownership(Layout.from_template(parameters), world_size)
    if ownership not in OWNERSHIP_MODES:
        raise InvalidArgumentError(f"ownership must be None (balanced automatically) or one of {OWNERSHIP_MODES}, got "
                                   f"{ownership!r}")
    return Replicated(process_group, rank, world_size, ownership, device=_device_of(parameters))


def _device_of(parameters: dict):
    """The device the reduction's collectives use: the parameters' (nccl needs CUDA tensors)."""
    return next(iter(parameters.values())).device


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _check_optimizer_covers(optimizer, module, parameters: dict) -> None:
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = optimized - {id(p) for p in module.parameters()}
    missing = [name for name, p in parameters.items() if id(p) not in optimized]
    if foreign:
        raise InvalidArgumentError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the module; "
            f"build the optimizer from this module's parameters (module.parameters())"
        )
    if missing:
        raise InvalidArgumentError(
            f"the module's trainable parameters {missing[:5]} are not in the optimizer; add them, or "
            f"freeze them (requires_grad_(False)) so that they get no noise"
        )


def _refuse_second_plan(module) -> None:
    """A module already made private carries the first run's hooks: a second set would clip twice."""
    first = getattr(module, _MARK, None)
    if first is not None and first() is not None:
        raise InvalidArgumentError(
            "make_private was already called on this module, whose hooks clip for that first run; use the "
            "first call's result, or call its detach() (private.detach()) before planning a new run"
        )
