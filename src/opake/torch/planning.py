"""Planning a private run: the user's settings in, one frozen ``PrivacyPlan`` out, nothing touched.

``plan_request(request, num_examples=, key=)`` is a pure function of its arguments (it reads the
optimizer and scheduler to choose the strategy, on copies, and hooks nothing); the request is one
frozen ``PrivacySpec`` (``opake.torch.request``), which ``plan_privacy`` builds from its keyword
arguments. ``make_private``, ``PrivacyEngine`` and ``DPTrainer`` build a request, plan it here and
then attach the plan to the model (``opake.torch.private``).
The plan, in order (each piece is one of opake's layers, used as documented there):

1. **Sampler** (``sampling=``), an epoch being ``num_units // batch_size`` steps either way
   (units: examples, or users with ``privacy_unit``):

   * ``"balls_in_bins"`` (default, any strategy): ``BallsInBinsSampler``, every unit in one of
     ``num_bins = num_units // batch_size`` random bins, bins served cyclically, so every unit
     appears once per epoch, ``num_bins`` steps apart: participation ``(n_steps = epochs *
     num_bins, min_sep = num_bins, max_participations = epochs)``.
   * ``"poisson"`` (banded strategies only: ``band_mf_strategy(bands=g)`` or
     ``identity_strategy()``, g = 1): ``CyclicPoissonSampler``, every unit in one of g random
     groups, group ``t mod g`` served at step t, each of its members included independently
     with probability ``q = batch_size * g / num_units``; with the identity this is the
     Poisson-subsampled DP-SGD of Opacus. Participation ``(n_steps, min_sep = g,
     max_participations = ceil(n_steps / g))``.

   Add/remove adjacency: one more unit moves no other; batch sizes vary around ``batch_size``
   (SECURITY.md). The number of units is treated as public (it fixes ``num_bins`` or ``q``), as
   in Opacus.
2. **Strategy**: by default the BLT optimized for the optimizer's own workload
   (``strategy_for_optimizer``: torch SGD's momentum, dampening and LR schedule; prefix sums
   for Adam-type optimizers), resolved for that participation.
3. **Accountant and noise multiplier**: the sampler states the accounting its batches admit
   (``sampler.accountant(strategy, n_steps, method)``, whose ``method`` the plan reports as
   ``plan.accounting``). Balls in bins is priced, by default, by the tightest bound proven for
   adaptively chosen gradients (docs/adaptivity.md): the random-allocation PLD for strategies
   whose bins do not interact (the identity; ``"allocation_pld"``), the unamplified bound for
   every other strategy, a BLT included (``"rigorous"``; also ``amplification=False``).
   ``amplification=True`` asks for the amplified bound of the aligned dominating pair
   (``"amplified"``), which for a BLT is not proven for adaptive gradients and warns. Cyclic
   Poisson is priced by ``poisson(...)``: Band23 Thm 4, Poisson-sampled Gaussians composed
   ``ceil(n_steps / g)`` times, by PLD (``"pld"``). The noise multiplier is calibrated to
   ``(target_epsilon, target_delta)`` by ``opake.accounting.calibrate`` on that accountant, or
   given (``noise_multiplier=``), in which case ``epsilon`` is computed at ``target_delta``.
   Calibration time (one core): the unamplified bound takes milliseconds; the amplified one
   0.3 to 3 s for 1200 examples in 30 bins and 6 to 11 s for 50,000 examples in 195 bins (1 to
   20 epochs); Poisson's PLD 5 to 14 s at those sizes (DP-SGD, BandMF with 4 bands).

A plan also names the clipping rule and its bound (flat, or automatic clipping: AUTO-S, Bu et
al. 2023, ``opake.dpftrl.clipping.AutomaticClipping``; both bound one unit's clipped gradient by
``max_grad_norm``, which is all the accountant and the noise read), the loss form the clipping
assumes and the privacy unit:
everything the guarantee depends on is in one value.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

import opake.accounting as acc
from opake.dpftrl.accounting.allocation.bin_gram import has_non_negative_entries
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.accounting.poisson import UnsupportedAmplificationError
from opake.dpftrl.noise import blt_strategy
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import (BallsInBinsSampler, CyclicPoissonSampler, PrivacyUnits, UnitSampler,
                                   steps_per_epoch_of)
from opake.errors import InvalidStateError, InvalidTypeError, PlanError
from opake.planner import MAX_STATE_ROWS, DatasetRun, MechanismChoice, calibrate_noise, price_noise
from opake.planner import choose_mechanism as _choose
from opake.progress import Progress
from opake.random import RngKey
from opake.torch.privacy_units import description, privacy_units
from opake.torch.request import OPTIMIZER_BLT, SAMPLINGS, PrivacySpec
from opake.torch.workload import strategy_for_optimizer

# strategy_for_optimizer is workload's, SAMPLINGS the request's, PlanError the errors', re-exported
__all__ = ["SAMPLINGS", "PlanError", "PrivacyPlan", "choose_mechanism", "plan_privacy", "plan_request",
           "strategy_for_optimizer"]


@dataclass(frozen=True)
class PrivacyPlan:
    """What a private run guarantees and how, decided before any step.

    ``sampler`` draws the batches (its key is secret: it decides the batches); ``participation``
    is what it guarantees every unit over the run; ``strategy`` the noise's recipe;
    ``accountant`` the privacy process priced at ``noise_multiplier`` (its ``method`` is
    ``accounting``; ``description`` says it in words); ``epsilon`` at ``delta`` for add/remove
    adjacency of one ``privacy_unit``; ``clipping`` the clipping rule (``FlatClipping`` or
    ``AutomaticClipping``; its ``sensitivity`` is ``max_grad_norm``, the bound the noise is
    scaled to and the accountant prices, whichever the rule); ``loss`` the loss
    form the clipping assumes (``opake.torch.losses``); ``steps_per_epoch`` how many steps an
    epoch (one pass of the planned loader) takes; ``key`` the run's root key (the sampler's and
    the noise's keys are derived from it); ``choice`` the comparison that chose the mechanism
    when none was named (``opake.planner.MechanismChoice``: ``choice.table()``,
    ``choice.reason``), else None; ``request`` the ``PrivacySpec`` the plan meets.
    """

    sampler: object
    participation: Participation
    strategy: object
    accountant: object
    noise_multiplier: float
    epsilon: float
    delta: float
    clipping: object
    steps_per_epoch: int
    loss: str = ""
    privacy_unit: str = "example"
    key: RngKey | None = field(default=None, repr=False, compare=False)
    choice: object = field(default=None, repr=False, compare=False)
    request: PrivacySpec | None = field(default=None, repr=False, compare=False)

    @property
    def max_grad_norm(self) -> float:
        """The bound on one unit's clipped gradient (``clipping.sensitivity``)."""
        return self.clipping.sensitivity

    @property
    def n_steps(self) -> int:
        return self.participation.n_steps

    @property
    def epochs(self) -> int:
        return -(-self.participation.n_steps // self.steps_per_epoch)

    @property
    def expected_batch_size(self) -> float:
        """The constant divisor of the clipped sums: expected units (examples or users) per batch."""
        return self.sampler.expected_batch_size

    @property
    def accounting(self) -> AccountingMethod:
        """The bound ``accountant`` computes (``AccountingMethod``; compares equal to its string)."""
        return self.accountant.method

    @property
    def sampling(self) -> str:
        """``"balls_in_bins"`` or ``"poisson"`` (cyclic Poisson)."""
        return _sampling_name(self.sampler)

    @property
    def num_bins(self) -> int | None:
        """Balls in bins: the number of bins (None for Poisson sampling)."""
        return self.sampler.num_bins if self.sampling == "balls_in_bins" else None

    @property
    def num_groups(self) -> int | None:
        """Cyclic Poisson: the number of groups (None for balls in bins)."""
        return self.sampler.num_groups if self.sampling == "poisson" else None

    @property
    def sample_rate(self) -> float | None:
        """Cyclic Poisson: each served group member's inclusion probability (None for balls in bins)."""
        return self.sampler.sample_rate if self.sampling == "poisson" else None

    @property
    def units(self) -> PrivacyUnits | None:
        """The assignment of examples to users, or None when the unit is the example."""
        return self.sampler.units if isinstance(self.sampler, UnitSampler) else None


def _sampling_name(sampler) -> str:
    inner = sampler.unit_sampler if isinstance(sampler, UnitSampler) else sampler
    return "poisson" if isinstance(inner, CyclicPoissonSampler) else "balls_in_bins"


def plan_privacy(
    *,
    num_examples: int,
    batch_size: int,
    epochs: int | None = None,
    max_grad_norm,
    key: RngKey,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    strategy=None,
    sampling: str | None = None,
    amplification: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    privacy_unit=None,
    loss: str = "",
    progress: bool | None = None,
    clipping: str | None = None,
    steps: int | None = None,
) -> PrivacyPlan:
    """The plan of a private run over ``num_examples`` examples (module docstring); touches nothing.

    The run's length is ``epochs`` passes, or ``steps`` (a horizon in steps, the last epoch cut
    where it ends; the noise is calibrated for exactly those steps).

    ``strategy=None`` with ``target_epsilon`` (and no ``amplification``): the mechanism with the
    least noise at that budget among those proven for adaptively chosen gradients, for what
    ``optimizer`` does with the noise (``opake.planner.choice``; restricted to ``sampling`` when
    given): a BLT on balls in bins, BandMF with cyclic Poisson sampling, DP-SGD with Poisson
    sampling or DP-SGD on balls in bins. ``plan.choice`` holds the comparison and the reason.
    Otherwise (``noise_multiplier`` given, or ``amplification`` set) ``strategy=None`` is the BLT
    for ``optimizer``'s workload on balls in bins (``strategy_for_optimizer``, with
    ``lr_scheduler``: a scheduler built on ``optimizer``, or a function ``(optimizer, n_steps) ->
    scheduler`` for trainers that build it from the run's length). ``privacy_unit`` (one id per
    example, or a ``PrivacyUnits``) makes the unit a user. ``max_grad_norm`` is the clipping
    bound C, or a clipping rule value (``opake.dpftrl.clipping.FlatClipping``,
    ``AutomaticClipping``); ``clipping`` (None, ``"flat"``, ``"automatic"``) picks the rule for a
    bound (``clipping_rule``): automatic clipping (AUTO-S) scales each unit's gradient by
    C / (||g|| + 0.01), with the same bound C, so the accountant and the noise do not change.
    Every argument check happens before anything is built (``PrivacySpec`` checks the request,
    ``plan_request`` the rest): a dataset too small for the batch size, an epsilon that cannot be
    met, Poisson sampling with a strategy it does not cover, amplification for a strategy with
    negative entries.
    """
    request = PrivacySpec(batch_size=batch_size, epochs=epochs, steps=steps, max_grad_norm=max_grad_norm,
                          clipping=clipping,
                          target_epsilon=target_epsilon, target_delta=target_delta, noise_multiplier=noise_multiplier,
                          strategy=strategy, sampling=sampling, amplification=amplification, privacy_unit=privacy_unit)
    return plan_request(request, num_examples=num_examples, key=key, optimizer=optimizer, lr_scheduler=lr_scheduler,
                        loss=loss, progress=progress)


def plan_request(request: PrivacySpec, *, num_examples: int, key: RngKey,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None, loss: str = "",
                 progress: bool | None = None) -> PrivacyPlan:
    """The plan of ``request`` (a ``PrivacySpec``) over ``num_examples`` examples, with the run's root
    ``key``; ``optimizer`` and ``lr_scheduler`` shape the default strategy, ``loss`` is the loss form
    the clipping assumes, ``progress`` reports long calibrations. Touches nothing; ``plan.request``
    is ``request`` (``plan_privacy`` has the details).
    """
    if not isinstance(request, PrivacySpec):
        raise InvalidTypeError(f"request must be an opake.torch.PrivacySpec, got {type(request).__name__}")
    if not isinstance(key, RngKey):
        raise InvalidTypeError(f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}")
    units = request.units
    if units is not None and units.num_examples != num_examples:
        units = privacy_units(request.privacy_unit, num_examples)  # refuses, in the words of the form given
    num_drawn = num_examples if units is None else units.num_units
    steps_per_epoch = steps_per_epoch_of(num_drawn, request.batch_size, users=units is not None)
    n_steps = request.epochs * steps_per_epoch if request.steps is None else request.steps
    epochs = -(-n_steps // steps_per_epoch)  # the epochs the run reaches, the last one cut at a steps horizon
    choice = None
    if request.strategy is None and request.calibrated and request.amplification is None:
        choice = choose_mechanism(num_examples=num_drawn, batch_size=request.batch_size, epochs=epochs,
                                  steps=request.steps,
                                  target_epsilon=request.target_epsilon, target_delta=request.target_delta,
                                  optimizer=optimizer, lr_scheduler=lr_scheduler, sampling=request.sampling,
                                  progress=progress)
        strategy, sampling = choice.strategy, choice.sampling
    else:
        strategy, sampling = request.strategy, request.sampling or "balls_in_bins"
        if strategy is None or strategy == OPTIMIZER_BLT:
            strategy = blt_strategy() if optimizer is None else strategy_for_optimizer(optimizer, n_steps,
                                                                                       lr_scheduler)
    sampler = _sampler(sampling, strategy, num_drawn, request.batch_size, key.fold_in("opake.torch.sampler"), units)
    participation = sampler.participation(n_steps)
    if request.amplification:
        _check_amplifiable(sampler, strategy, n_steps)
    method = None if request.amplification is None else (AccountingMethod.AMPLIFIED if request.amplification
                                                         else AccountingMethod.RIGOROUS)
    accountant = sampler.accountant(strategy, n_steps, method)
    if choice is not None:
        reporter = Progress.of(progress)
        with reporter.stage(f"{choice.chosen.name}: the plan's accountant is the one the choice calibrated"):
            if accountant != choice.accountant:
                raise InvalidStateError(f"the sampler's accountant {accountant} is not the one the choice "
                                        f"calibrated {choice.accountant}; this is a bug in opake, please report it")
        sigma, epsilon, process = choice.noise_multiplier, choice.epsilon, choice.process
        reporter.close(f"{choice.chosen.name}: noise multiplier {sigma:.6g} gives epsilon {epsilon:.6g} at delta "
                       f"{request.target_delta:g}")
    else:
        with _each_warning_once():
            sigma, epsilon, process = _plan_noise(accountant, participation, request, progress)
    return PrivacyPlan(sampler, participation, strategy, process, sigma, epsilon, float(request.target_delta),
                       request.clipping_rule, steps_per_epoch, loss=loss, privacy_unit=description(units), key=key,
                       choice=choice, request=request)


def _sampler(sampling: str, strategy, num_drawn: int, batch_size: int, sampler_key: RngKey, units):
    """The run's sampler over ``num_drawn`` units (examples, or users whose examples it serves)."""
    if sampling == "poisson":
        groups = _poisson_groups(strategy)
        counted = "len(dataset)" if units is None else "users"
        sampler = CyclicPoissonSampler(num_drawn, num_groups=groups,
                                       sample_rate=_poisson_rate(batch_size, groups, num_drawn, counted),
                                       key=sampler_key)
    else:
        sampler = BallsInBinsSampler(num_drawn, num_drawn // batch_size, sampler_key)
    return sampler if units is None else UnitSampler(sampler, units)


def _poisson_groups(strategy) -> int:
    """The number of groups g of cyclic Poisson sampling: the strategy's bands (1 for the identity)."""
    bands = getattr(strategy, "bands", None)  # recipes state their band; None: not banded (a BLT)
    if bands is None:
        given = "no strategy (the default is a BLT)" if strategy is None else type(strategy).__name__
        raise UnsupportedAmplificationError(
            f"sampling='poisson' needs a banded strategy, got {given}: Poisson amplification of correlated "
            f"noise is proven only for banded strategies (Band23 Thm 4). Pass strategy=band_mf_strategy(bands=...) "
            f"or strategy=identity_strategy() (DP-SGD), or keep the strategy and use sampling='balls_in_bins'"
        )
    return int(bands)


def _poisson_rate(batch_size: int, groups: int, num_examples: int, counted: str = "len(dataset)") -> float:
    """q = batch_size * g / num_examples: a served group of ~num_examples/g units yields ~batch_size."""
    if batch_size * groups > num_examples:
        raise PlanError(
            f"sampling='poisson' with {groups} group(s) and batch_size={batch_size} needs a sample rate "
            f"batch_size * groups / {counted} = {batch_size * groups}/{num_examples} > 1; use at most "
            f"{num_examples // batch_size} bands or a batch size of at most {num_examples // groups}"
        )
    return batch_size * groups / num_examples


def _check_amplifiable(sampler, strategy, n_steps: int) -> None:
    """Refuse, with the fix, a strategy the amplified balls-in-bins bound does not cover: its
    dominating pair is the worst case only for a strategy matrix C >= 0 entrywise (bin_gram.py)."""
    if not has_non_negative_entries(sampler.accountant(strategy, n_steps, AccountingMethod.RIGOROUS)(1.0)):
        raise PlanError(
            "amplification=True prices balls-in-bins sampling with the amplified Renyi bound, which holds "
            "only for a strategy matrix with non-negative entries, and this strategy's has a negative one. "
            "Pass amplification=False (the unamplified bound), or a strategy without negative coefficients"
        )


# -- the noise multiplier ----------------------------------------------------------------------

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


def _plan_noise(accountant, participation, request: PrivacySpec, progress=None):
    """(sigma, epsilon, process) for the plan: the request's noise multiplier priced, or one calibrated
    to its budget (``opake.planner.calibration``). ``progress`` (None: on when stderr is a terminal)
    reports the seconds-long amplified evaluations on stderr (``opake.progress``)."""
    reporter = Progress.of(progress)
    summary = None
    try:
        if not request.calibrated:
            priced = price_noise(accountant, request.noise_multiplier, request.target_delta, reporter)
            summary = (f"noise multiplier {priced.sigma:g} gives epsilon {priced.epsilon:.6g} at delta "
                       f"{request.target_delta:g}")
        else:
            budget = acc.epsilon_budget(request.target_epsilon, request.target_delta)
            priced = calibrate_noise(accountant, budget, progress=reporter, describe=f"this plan ({participation})")
            summary = (f"noise multiplier {priced.sigma:.6g}: epsilon {priced.epsilon:.6g} <= {budget.epsilon:g} "
                       f"at delta {budget.delta:g}")
        return priced.sigma, priced.epsilon, priced.process
    finally:
        reporter.close(summary)


def choose_mechanism(*, num_examples: int, batch_size: int, epochs: int, target_epsilon: float, target_delta: float,
                     optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None, strategy=None,
                     sampling: str | None = None, max_state_rows: int | None = MAX_STATE_ROWS,
                     steps: int | None = None, progress: bool | None = None) -> MechanismChoice:
    """The mechanism ``make_private`` takes without a strategy (``opake.planner.choose_mechanism``),
    for what ``optimizer`` (with ``lr_scheduler``, as for ``make_private``) does with the noise: its
    workload recipe is read from it (``strategy_for_optimizer``); without one, the prefix sums."""
    run = DatasetRun(num_examples, batch_size, epochs, steps)
    recipe = None if optimizer is None else strategy_for_optimizer(optimizer, run.n_steps, lr_scheduler)
    try:
        return _choose(num_examples=num_examples, batch_size=batch_size, epochs=epochs, target_epsilon=target_epsilon,
                       target_delta=target_delta, recipe=recipe, strategy=strategy, sampling=sampling,
                       max_state_rows=max_state_rows, steps=steps, progress=progress)
    except acc.CalibrationRangeError as error:
        raise PlanError(
            f"target_epsilon={target_epsilon} at delta={target_delta} cannot be met by any mechanism for this "
            f"run ({run.epochs} epoch(s) of {run.num_bins} steps) with a noise multiplier in "
            f"the searched range: {error}. Raise the budget, or train fewer epochs"
        ) from None
