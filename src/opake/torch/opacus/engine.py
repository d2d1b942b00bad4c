"""``PrivacyEngine``: Opacus' calls, with Opacus' meaning, on top of ``opake.torch.make_private``.

``make_private(noise_multiplier=S)`` runs Opacus' mechanism: DP-SGD with Poisson sampling
(``strategy=identity_strategy(), sampling="poisson"``), each example in each step independently
with probability ``q = batch_size / len(dataset)``, ``len(dataset) // batch_size`` steps an
epoch, priced by the PLD of the Poisson-subsampled Gaussian composed once per step
(dp_accounting, add/remove adjacency; no larger than Opacus' PRV accountant for the same sigma,
rate and steps: benchmarks/opacus_epsilon.py). ``poisson_sampling=False`` is DP-SGD on
balls-in-bins batches (every example in one random bin, so once an epoch), priced by the
random-allocation PLD, a bound proven for it: Opacus there keeps the loader's shuffled batches
and prices them as if Poisson, which no theorem covers. Correlated noise is asked for by name,
``strategy=blt_strategy()`` (balls in bins, unamplified) or ``strategy=band_mf_strategy(g)``
(cyclic Poisson).

``epochs`` is optional for DP-SGD, as in Opacus: its noise does not depend on the horizon, so the
run is planned for ``UNPLANNED_EPOCHS`` epochs, a limit on the loop (a pass beyond it raises
``PlanExhaustedError``), and ``get_epsilon(delta)`` reports what the steps taken have spent (with
``poisson_sampling=False``, the epochs begun: ``opake.torch.opacus.unplanned``). ``private.epsilon``
is then the epsilon of all those epochs, not of your run. Correlated noise depends on the horizon,
so it needs ``epochs=``.

Opacus' other options: ``clipping="per_layer"`` and ``"adaptive"`` (``opake.torch.opacus.clipping``,
``adaptive``), ``batch_first=False`` (the clipper reads the batch on dimension 1),
``noise_multiplier=0`` (``no_noise``: with ``poisson_sampling=False`` on the loader's own batches).
An example whose gradient is not finite contributes 0, as Opacus' clip factor for an infinite norm.

``make_private_with_epsilon(target_epsilon=)`` takes the mechanism with the least noise at the
budget among those proven for adaptively chosen gradients (``opake.planner.choice``): BLT on
balls in bins, BandMF with cyclic Poisson, DP-SGD with Poisson sampling, DP-SGD on balls in bins.
``privacy_engine.choice`` holds the comparison (``choice.table()``, ``choice.reason``) and
``privacy_engine.private.plan`` what runs. ``poisson_sampling=False`` keeps only the mechanisms
whose batches hold every example once an epoch (balls in bins).

Randomness: without ``key=``, the key comes from torch's default generator (``secure_mode=False``,
Opacus' default: ``torch.manual_seed`` reproduces a run) or from the operating system
(``secure_mode=True``); ``opake.torch.opacus.keys``. One engine plans one run.
"""

from __future__ import annotations

from torch import nn

from opake.dpftrl.noise import identity_strategy
from opake.errors import InvalidArgumentError, InvalidStateError, InvalidTypeError
from opake.torch.opacus.accountant import RunAccountant
from opake.torch.opacus.adaptive import (ADAPTIVE_OPTIONS, AdaptiveBound, AdaptiveClipping, AdaptiveNoise,
                                         gradient_noise_multiplier)
from opake.torch.opacus.checkpoint import load_checkpoint, save_checkpoint
from opake.torch.opacus.keys import run_key
from opake.torch.opacus.clipping import clipping_of
from opake.torch.opacus.no_noise import (PLACEHOLDER_SIGMA, is_no_noise, no_noise_key, serve_loader_batches,
                                         warn_no_noise, without_noise)
from opake.torch.opacus.optimizer import as_opacus_optimizer
from opake.torch.opacus.options import from_loader, own_batch_sampler, refuse_other_options, remember_source
from opake.torch.opacus.unplanned import UNPLANNED_EPOCHS, is_dp_sgd, priced_as_it_goes, unplanned_horizon
from opake.torch.private import PrivateTraining, make_private
from opake.torch.request import PrivacySpec
from opake.torch.validation import fix_model, require_valid_model

__all__ = ["UNPLANNED_EPOCHS", "PrivacyEngine"]

_OPACUS_ACCOUNTANTS = ("prv", "rdp", "gdp")


class PrivacyEngine:
    """Opacus' ``PrivacyEngine`` interface on opake's planned runs (module docstring).

    ``accountant`` accepts Opacus' names ("prv", "rdp", "gdp") and ignores them: a run is priced
    by the accountant proven for its mechanism (for Poisson DP-SGD a PLD, tighter than the three).
    ``privacy_engine.accountant`` is the run's (``get_epsilon``, ``mechanism``, ``history``).
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        if accountant not in _OPACUS_ACCOUNTANTS:
            raise InvalidArgumentError(
                f"accountant must be one of Opacus' names {_OPACUS_ACCOUNTANTS} (each means the run's "
                f"own proven accountant here), got {accountant!r}"
            )
        self.secure_mode = bool(secure_mode)
        self.private: PrivateTraining | None = None
        self.choice = None
        self.accountant = RunAccountant(self)

    # -- planning -----------------------------------------------------------------------------------

    def make_private(self, *, module, optimizer, data_loader, noise_multiplier, max_grad_norm, criterion=None,
                     epochs=None, target_delta=None, batch_first=True, loss_reduction="mean", poisson_sampling=True,
                     clipping="flat", noise_generator=None, grad_sample_mode="hooks", wrap_model=True,
                     rand_on_empty=False, strategy=None, lr_scheduler=None, key=None, progress=None,
                     noise_correction=None, **kwargs):
        """Opacus' noise-multiplier form: returns ``(module, optimizer, data_loader)``.

        DP-SGD with Poisson sampling by default (module docstring); ``epochs`` optional for it.
        ``target_delta`` (default ``min(1e-5, 1 / len(dataset))``) is the delta of
        ``self.private.epsilon``; ``get_epsilon(delta)`` answers for any delta. ``grad_sample_mode``
        takes any of Opacus' modes (``GRAD_SAMPLE_MODES``) and changes nothing computed; with
        ``"ghost"`` the return is Opacus' ``(module, optimizer, criterion, data_loader)``, the
        criterion as given (``criterion`` is otherwise unused). ``strategy``,
        ``lr_scheduler``, ``key``, ``progress`` and ``noise_correction`` are ``opake.torch.make_private``'s
        (an Adam or AdamW is stepped with its second moment corrected for the noise unless
        ``noise_correction=False``: post-processing, the epsilon is the same).
        ``noise_multiplier=0`` is Opacus' clipping-only run: the planned batches, clipped, released
        without noise; it warns (``NoNoiseWarning``) and its epsilon is infinite
        (``opake.torch.opacus.no_noise``).
        """
        adaptive = _adaptive_settings(clipping, kwargs)
        self._check(kwargs, dict(clipping=clipping, max_grad_norm=max_grad_norm, grad_sample_mode=grad_sample_mode,
                                 noise_generator=noise_generator, batch_first=batch_first, wrap_model=wrap_model,
                                 rand_on_empty=rand_on_empty), module, optimizer)
        no_noise = is_no_noise(noise_multiplier)
        if adaptive is not None and (no_noise or (strategy is not None and not is_dp_sgd(strategy))):
            raise InvalidArgumentError(
                "clipping='adaptive' runs in DP-SGD with noise (its count shares the noise multiplier's budget, and "
                "correlated noise cannot follow a bound that changes every step): drop strategy= and give "
                "noise_multiplier > 0, or clip flat")
        if no_noise:  # Opacus' clipping-only run (opake.torch.opacus.no_noise)
            if noise_correction:
                raise InvalidArgumentError("noise_correction=True with noise_multiplier=0: there is no noise to "
                                           "correct the optimizer's second moment for; drop noise_correction")
            noise_multiplier, noise_correction = PLACEHOLDER_SIGMA, False
        strategy = identity_strategy() if strategy is None else strategy
        sampling = _sampling(strategy, poisson_sampling)
        unplanned = epochs is None
        if unplanned:
            epochs = unplanned_horizon(strategy)
        dataset, batch_size, loader_options = from_loader(data_loader)
        # A noise-free run without Poisson sampling trains on the loader's own batches, as Opacus'
        # (no_noise.LoaderBatches); its plan only carries the noise engine's state: twice the epochs,
        # so that it covers the loader's ceil(N / B) steps an epoch, on the sampler cheapest to plan.
        own_batches = no_noise and not poisson_sampling
        plan_epochs, plan_sampling = epochs, sampling
        if own_batches:
            plan_epochs, plan_sampling = 2 * epochs, ("poisson" if is_dp_sgd(strategy) else sampling)
        if target_delta is None:
            target_delta = min(1e-5, 1.0 / len(dataset))
        request = PrivacySpec(batch_size=batch_size, epochs=plan_epochs, max_grad_norm=clipping_of(
                                  clipping, max_grad_norm, module),
                              noise_multiplier=noise_multiplier, target_delta=target_delta, strategy=strategy,
                              sampling=plan_sampling)
        returned = self._attach(request, module=module, optimizer=optimizer, dataset=dataset,
                                lr_scheduler=lr_scheduler, key=key, loss_reduction=loss_reduction, progress=progress,
                                noise_correction=noise_correction, loader_options=loader_options,
                                no_noise=no_noise, batch_first=batch_first, adaptive=adaptive)
        if own_batches:
            serve_loader_batches(self.private, own_batch_sampler(data_loader, batch_size), epochs)
        elif unplanned and sampling == "balls_in_bins" and not no_noise:
            priced_as_it_goes(self.private)  # the epochs begun, priced as the loop runs (unplanned.py)
        return _as_opacus_returns(returned, grad_sample_mode, criterion)

    def make_private_with_epsilon(self, *, module, optimizer, data_loader, target_epsilon, target_delta, epochs,
                                  max_grad_norm, criterion=None, batch_first=True, loss_reduction="mean",
                                  poisson_sampling=True, clipping="flat", noise_generator=None,
                                  grad_sample_mode="hooks", wrap_model=True, strategy=None, lr_scheduler=None,
                                  key=None, progress=None, noise_correction=None, **kwargs):
        """The mechanism with the least noise at ``(target_epsilon, target_delta)`` over ``epochs``.

        ``self.choice`` says which and why (``opake.planner.choice``); ``strategy=`` keeps the
        choice to that strategy; ``poisson_sampling=False`` to balls-in-bins batches. The
        returned optimizer's run meets the budget: ``self.private.epsilon <= target_epsilon``.
        """
        if clipping == "adaptive":
            raise InvalidArgumentError(
                "clipping='adaptive' is priced at a given noise multiplier (its count shares that budget): use "
                "make_private(noise_multiplier=..., clipping='adaptive', ...), or clip flat to meet a target epsilon")
        self._check(kwargs, dict(clipping=clipping, max_grad_norm=max_grad_norm, grad_sample_mode=grad_sample_mode,
                                 noise_generator=noise_generator, batch_first=batch_first, wrap_model=wrap_model),
                    module, optimizer)
        from opake.torch import choose_mechanism  # the public name (opake.torch imports this module first)

        dataset, batch_size, loader_options = from_loader(data_loader)
        choice = choose_mechanism(num_examples=len(dataset), batch_size=batch_size, epochs=epochs,
                                  target_epsilon=target_epsilon, target_delta=target_delta, optimizer=optimizer,
                                  lr_scheduler=lr_scheduler, strategy=strategy,
                                  sampling=None if poisson_sampling else "balls_in_bins", progress=progress)
        # The choice calibrated the noise on the accountant this plan builds: the request names it.
        request = PrivacySpec(batch_size=batch_size, epochs=epochs, max_grad_norm=clipping_of(
                                  clipping, max_grad_norm, module),
                              noise_multiplier=choice.noise_multiplier, target_delta=target_delta,
                              strategy=choice.strategy, sampling=choice.sampling)
        returned = self._attach(request, module=module, optimizer=optimizer, dataset=dataset,
                                lr_scheduler=lr_scheduler, key=key, loss_reduction=loss_reduction,
                                progress=progress, noise_correction=noise_correction, loader_options=loader_options,
                                batch_first=batch_first)
        planned = self.private.epsilon
        if not planned <= choice.target_epsilon:  # the choice priced this accountant at this sigma: never
            self.private.detach()
            self.private = None
            raise InvalidStateError(f"the planned run's epsilon {planned} exceeds the target {choice.target_epsilon}; "
                                    f"nothing was trained (please report this)")
        self.choice = choice
        return _as_opacus_returns(returned, grad_sample_mode, criterion)

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far, by the steps taken, at ``delta`` (``self.accountant.get_epsilon``)."""
        return self.accountant.get_epsilon(delta)

    # -- Opacus' other calls ------------------------------------------------------------------------------

    @classmethod
    def get_compatible_module(cls, module):
        """A copy of ``module`` opake can clip per example (``opake.torch.fix_model``: BatchNorm to
        GroupNorm, nn.LSTM/GRU/RNN and Opacus' DPLSTM/DPGRU to opake's); raises
        ``ModelValidationError`` for what it cannot fix."""
        fixed = fix_model(module)
        require_valid_model(fixed)
        return fixed

    @classmethod
    def is_compatible(cls, *, module, **ignored) -> bool:
        """Whether ``make_private`` would accept ``module``'s layers."""
        from opake.torch.validation import validate_model

        return not validate_model(module)

    def save_checkpoint(self, *, path, module, optimizer=None, **options) -> None:
        """Opacus' call: the run's checkpoint plus ``checkpoint_dict`` (``opake.torch.opacus.checkpoint``)."""
        save_checkpoint(self, path=path, module=module, optimizer=optimizer, **options)

    def load_checkpoint(self, *, path, module, optimizer=None, draws=None, fresh_key=None, **options) -> dict:
        """Opacus' call; the noise after the checkpoint is new unless ``draws="replay"``
        (``opake.torch.opacus.checkpoint`` says why). Returns the rest of the saved dict."""
        return load_checkpoint(self, path=path, module=module, optimizer=optimizer, draws=draws,
                               fresh_key=fresh_key, **options)

    # -- inside ----------------------------------------------------------------------------------------

    def _check(self, extra: dict, options: dict, module, optimizer) -> None:
        if self.private is not None:
            raise InvalidArgumentError("this PrivacyEngine has planned a run already; build a new PrivacyEngine for "
                                       "another run (opake prices one planned run, it does not compose runs)")
        if extra:
            raise InvalidTypeError(f"opake's PrivacyEngine does not take {sorted(extra)} (Opacus options it does not "
                                   f"implement); see docs/from_opacus.md")
        refuse_other_options(**options)
        _require_optimizer_of(module, optimizer)
        clipping_of(options["clipping"], options["max_grad_norm"], module)  # refused before anything is planned
        require_valid_model(module)  # before the seconds a choice can take

    def _attach(self, request: PrivacySpec, *, loader_options: dict, key, batch_first: bool, no_noise=False,
                adaptive=None, **arguments):
        key = run_key(key, self.secure_mode)
        if adaptive is not None:  # the gradients' share of sigma, checked before anything is planned
            ratio = gradient_noise_multiplier(request.noise_multiplier, adaptive.unclipped_num_std) / \
                request.noise_multiplier
        private = make_private(privacy=request, key=no_noise_key(key) if no_noise else key, **arguments,
                               **loader_options)
        if adaptive is not None:  # opake.torch.opacus.adaptive: priced at sigma, gradients noised at sigma_g
            private.run.replace_noise(AdaptiveNoise(private.run.noise_fn, ratio), private.run.state.noise)
            private.optimizer.noise_multiplier = request.noise_multiplier * ratio
        # As Opacus' clip factor for an infinite norm: an example with a non-finite gradient contributes 0.
        private.optimizer.clipper.drop_nonfinite(True)
        if not batch_first:  # Opacus' sequence-first models: the clipper reads each layer's batch on dimension 1
            try:
                private.optimizer.clipper.batch_second(True)
            except Exception:
                private.detach()
                raise
        if no_noise:
            without_noise(private)
            private.optimizer.clipper.keep_per_example_grads(True)  # p.grad_sample, as Opacus' tests read it
            warn_no_noise()  # once the run is planned: a refused call says only why
        as_opacus_optimizer(private.optimizer)
        if adaptive is not None:
            private.optimizer.adaptive = AdaptiveBound(adaptive, key.fold_in("opake.torch.opacus.adaptive"),
                                                       private.plan.expected_batch_size)
        remember_source(private.data_loader, request.batch_size, loader_options)  # a later run may reuse it
        self.private = private
        return private.module, private.optimizer, private.data_loader  # one epoch of the plan per pass


def _as_opacus_returns(returned: tuple, grad_sample_mode: str, criterion) -> tuple:
    """Opacus' returns: ``(module, optimizer, criterion, data_loader)`` for ``grad_sample_mode="ghost"``
    (the criterion as given, Opacus' default ``nn.CrossEntropyLoss()`` without one: its plain backward is
    clipped per example by the module's hooks), ``(module, optimizer, data_loader)`` otherwise."""
    if grad_sample_mode != "ghost":
        return returned
    module, optimizer, data_loader = returned
    return module, optimizer, nn.CrossEntropyLoss() if criterion is None else criterion, data_loader


def _adaptive_settings(clipping: str, kwargs: dict):
    """Opacus' AdaClip options, taken out of ``kwargs``, for ``clipping="adaptive"`` (else None)."""
    if clipping != "adaptive":
        return None
    return AdaptiveClipping.from_options({name: kwargs.pop(name) for name in ADAPTIVE_OPTIONS if name in kwargs})


def _require_optimizer_of(module, optimizer) -> None:
    """Opacus' check, in its words: the optimizer must hold the module's own parameters (a model fixed or
    copied after the optimizer was built has new ones)."""
    held = {id(param) for group in getattr(optimizer, "param_groups", []) for param in group["params"]}
    if held - {id(param) for param in module.parameters()}:
        raise InvalidArgumentError(
            "Module parameters are different than optimizer Parameters: the optimizer holds parameters that are not "
            "the module's (a model fixed by ModuleValidator.fix or get_compatible_module, or copied, after the "
            "optimizer was built has new ones); build the optimizer from module.parameters() after fixing the model"
        )


def _sampling(strategy, poisson_sampling: bool) -> str:
    """Poisson for a banded strategy unless ``poisson_sampling=False``; a BLT on balls in bins always
    (Poisson amplification is not proven for it)."""
    if getattr(strategy, "bands", None) is None:
        return "balls_in_bins"
    return "poisson" if poisson_sampling else "balls_in_bins"


