"""``DPOptimizer``: any ``torch.optim`` optimizer, stepping on clipped sums plus correlated noise.

The user's loop does not change: ``optimizer.zero_grad(); loss.backward(); optimizer.step()``.
During ``backward`` the per-example clipper (``opake.torch.per_example``) records what it needs;
``step()`` asks it for the sum of the clipped per-example gradients, divides by the run's
constant normalization (the sampler's expected batch size, never the realized one), adds
the mechanism's noise through the noise engine (``mf_gaussian_noise``: one streaming step of
sigma * C * C^{-1} z), writes the noised gradients into the parameters' ``.grad`` and calls
the wrapped optimizer's ``step``. On the first step with examples it also checks that
autograd's ``.grad`` equals the unclipped sum the hooks saw (``PerExampleClipper.
check_coverage``): a parameter used outside its layer would escape the clipping. After that
check, autograd no longer computes the unclipped weight gradients of hooked layers that are
not first in the graph (``PerExampleClipper.skip_autograd_weight_gradients``): they cost a
third of a Linear layer's backward and are never released, so their ``.grad`` stays None
until ``step()`` writes the noised gradient. Several
``backward`` calls before one ``step`` form one logical batch (virtual batches / microbatching: each example is clipped on its own, the sums
add up). Frozen parameters (``requires_grad=False``) get no noise and take no noise state.
Under torch.distributed each rank clips its part of the global batch, and the run's reduction
(``opake.torch.reduction``) forms the global clipped sum and adds the noise once (bit-identical
on every rank). The run's state (noise state, the batch served last) belongs to the run
(``opake.torch.run.PrivateRun``); the step asks it to check and release.

A wrapped ``torch.optim.AdamW`` or ``Adam`` is, by default, stepped with its second moment
corrected for the noise (``opake.torch.adamw.corrected_adam_step``, DP-AdamBC floored at the
noise's own variance: ``make_private(..., noise_correction=)``, decided by ``noise_correction_for``);
its ``step`` is then not called, so step hooks registered on it do not run (the learning-rate
schedulers built on it still count the step). A wrapped optimizer with a
``set_noise_variance(variance)`` method (``opake.torch.DPAdamW``) is told, before each of its
steps, the variance of every coordinate of that step's noise (``NoisedPytree.noise_variance``,
exact for every mechanism); others are stepped as they are.

The wrapper shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer, so
learning-rate schedulers built on either object drive the same learning rates, and the
optimizer's ``state_dict`` is the wrapped one's.

Only the plan's batches are released, each once and in order (``opake.torch.loader``): before
anything is released, ``step()`` checks that the planned loader served this step's batch last
and that the examples clipped since ``zero_grad()`` are exactly that batch's; otherwise it
raises ``UnplannedBatchError`` and changes nothing. A planned batch can be empty (balls in bins
draws bin sizes); its step may be taken without a backward pass and releases noise only.

Only the private optimizer applies a private module's gradients (``opake.torch.guard``): autograd's
unclipped gradients are taken out of ``.grad`` as soon as backward accumulates them, and a step
of any other optimizer holding these parameters is refused before anything moves. The optimizer
given to ``make_private`` raises ``DirectStepError`` when stepped on its own (``DPOptimizer``
steps it, through its own ``step``, so a learning-rate scheduler built on it before
``make_private`` keeps counting); any other raises ``ForeignOptimizerError``. ``detach()`` gives
the parameters back.
"""

from __future__ import annotations

import torch

from opake.errors import InvalidTypeError
from opake.torch.adamw import NoiseCorrection, corrected_adam_step
from opake.torch.contract import PlanChangedError
from opake.torch.guard import DirectStepError, ForeignOptimizerError, GradientGuard
from opake.torch.loader import PlanExhaustedError
from opake.torch.per_example.bookkeeping import sum_dtype
from opake.torch.per_example.errors import ClipperUsageError
from opake.torch.reduction import SingleProcess
from opake.types import clipped

__all__ = ["DPOptimizer", "DirectStepError", "ForeignOptimizerError", "PlanExhaustedError"]


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``step()`` replaces the gradients by clipped sums plus noise first.

    Built by ``make_private``: ``run`` is the run's ``PrivateRun`` (planned batches, noise engine
    and state), ``clipper`` the per-example clipper of the module (its clipping rule, normalised
    once when the run was planned, is the one bound: ``max_grad_norm`` reads it), ``parameters``
    the trainable parameters by name (the engine's template), ``normalization`` the constant
    divisor of the clipped sum, ``noise_multiplier`` the plan's sigma (read by Opacus-style
    scripts as ``optimizer.noise_multiplier``), ``reduction`` how the
    sums meet across processes (``opake.torch.reduction``), ``autograd_parameters`` the tensors
    autograd accumulates into when they are not the parameters (FSDP's unsharded ones),
    ``noise_correction`` whether the wrapped Adam's second moment is corrected for the noise
    (``opake.torch.adamw.NoiseCorrection``, from ``noise_correction_for``), ``contract`` the plan's
    record of the module and the optimizer (``opake.torch.contract``), checked first in every step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, run, clipper, parameters: dict, normalization: float,
                 noise_multiplier: float, noise_correction: NoiseCorrection, contract, reduction=None,
                 autograd_parameters=None):
        # Not Optimizer.__init__: the wrapped optimizer owns the groups and the state.
        self.original_optimizer = optimizer
        self.noise_correction = noise_correction
        self.guard = GradientGuard(parameters, optimizer, autograd_parameters)
        self.run = run
        self.clipper = clipper
        self.contract = contract
        self.parameters = parameters
        self.normalization = float(normalization)
        self.noise_multiplier = float(noise_multiplier)
        self.reduction = SingleProcess() if reduction is None else reduction
        self.last_step_examples = 0
        # Until one step with examples has shown that autograd's .grad equals what the hooks
        # saw, every parameter use is not known to go through a hooked layer: check it.
        self._coverage_checked = False
        clipper.track_coverage(True)
        self.guard.collecting = True

    # -- what torch.optim users and schedulers read ------------------------------------------

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        raise PlanChangedError(
            "a private optimizer's parameters are fixed by its privacy plan (the noise engine holds "
            "buffers for exactly those parameters); build the optimizer with every parameter group "
            "before calling make_private. Nothing was changed"
        )

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    def release_wrapped_optimizer(self) -> None:
        """Give the parameters back to every optimizer (``make_private``'s ``detach()``)."""
        self.guard.remove()

    # -- the run, as Opacus-style code reads it ----------------------------------------------

    @property
    def max_grad_norm(self) -> float:
        """The clipping bound C: the clipper's rule's sensitivity (the one value the plan normalised)."""
        return self.clipper.max_grad_norm

    @property
    def noise_state(self):
        return self.run.state.noise

    @property
    def batches(self):
        return self.run.batches

    @property
    def steps_taken(self) -> int:
        return self.run.step

    @property
    def steps_planned(self) -> int:
        return self.run.n_steps

    # -- the step -------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients and start a new logical batch."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.clipper.reset()
        self.guard.clear()

    def step(self, closure=None):
        """Noise the clipped sum of the examples since ``zero_grad`` and take the optimizer step."""
        if closure is not None:
            raise InvalidTypeError(
                "DPOptimizer.step does not take a closure: a closure re-evaluates the loss, which "
                "would release gradients without noise; call loss.backward() before step()"
            )
        return self._apply(self._release())

    def _release(self):
        """The step's release: checks the planned batch, noises the clipped sums, writes them into
        ``.grad`` (the ``NoisedPytree``); the wrapped optimizer is not stepped (``_apply``)."""
        step = self.run.step
        if step >= self.run.n_steps:
            raise PlanExhaustedError(
                f"optimizer.step() was called after all {self.run.n_steps} planned steps were taken "
                f"(one per batch of the plan); a further step would release gradients the reported epsilon "
                f"does not cover. Take one step per batch of private.data_loader, and plan the epochs the "
                f"loop runs (make_private(..., epochs=...))"
            )
        failure, sums, examples = None, None, 0
        try:
            self.contract.check()  # the module and the groups are still the plan's
            sums, examples = self._clipped_sums(step)
            self.run.check(step, examples)
            self._check_coverage_once(examples)
        except Exception as error:  # every rank learns of it before any collective of the step
            failure = error
        self.reduction.agree(step, failure)
        # The sums are the step's alone from here: the reduction may drop each full-size sum once it
        # has sent it (Sharded does, bucket by bucket), which frees memory only if the clipper lets go.
        self.clipper.reset()
        sums = self.reduction.reduce(sums)
        gradients = clipped({name: sums[name] / self.normalization for name in self.parameters},
                            l2_bound=self.clipper.max_grad_norm, normalization=self.normalization)
        noisy = self.run.release(gradients)
        self.reduction.write(self.parameters, noisy.pytree)
        self.last_step_examples = examples
        return noisy

    def _apply(self, noisy):
        """The wrapped optimizer's step on the released gradients ``noisy`` (already in ``.grad``)."""
        correction = self.noise_correction
        if correction.enabled and not correction.by_optimizer:
            with self.guard.stepping():
                corrected_adam_step(self.original_optimizer, noisy.noise_variance, correction.floor)
            _count_scheduled_step(self.original_optimizer)
            return None
        set_noise_variance = getattr(self.original_optimizer, "set_noise_variance", None)
        if callable(set_noise_variance):  # a DP-aware optimizer (opake.torch.DPAdamW) corrects for the noise
            set_noise_variance(noisy.noise_variance)
        with self.guard.stepping():
            return self.original_optimizer.step()

    def _clipped_sums(self, step: int) -> tuple[dict, int]:
        """The clipper's sums since ``zero_grad`` (read only) and their examples; zeros for an empty
        planned batch, whose release is noise only."""
        try:
            return self.clipper.clipped_sum(copy=False), self.clipper.examples
        except ClipperUsageError:
            if self.clipper.passes:  # backward passes were clipped: a misuse the clipper named
                raise
            if self.run.batches.indices(step):
                raise ClipperUsageError(
                    f"optimizer.step() was called without a backward pass since zero_grad(), but planned batch "
                    f"{step} has examples; run loss.backward() on that batch first"
                ) from None
        zeros = {name: torch.zeros(p.shape, dtype=sum_dtype(p.dtype), device=p.device)
                 for name, p in self.parameters.items()}
        return zeros, 0

    def _check_coverage_once(self, examples: int) -> None:
        """On the first step with examples: every parameter use went through a hooked layer (then
        autograd's unclipped weight gradients are no longer computed, nor kept)."""
        if self._coverage_checked or not examples:
            return
        self.clipper.check_coverage(autograd_gradients=self.guard.collected)
        self._coverage_checked = True
        self.clipper.track_coverage(False)
        self.clipper.skip_autograd_weight_gradients(True)
        self.guard.collecting = False
        self.guard.clear()


def _count_scheduled_step(optimizer) -> None:
    """What the optimizer's own ``step`` would have told a learning-rate scheduler built on it (torch's
    schedulers wrap ``step`` to note that it ran, and warn at their step when it has not)."""
    if hasattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched"):
        optimizer._opt_called = True
