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
Under torch.distributed each rank clips its part of the global batch, the clipped sums are
all-reduced, and the sharded noise engine adds the noise once (bit-identical on every rank).

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

from opake.torch.guard import DirectStepError, ForeignOptimizerError, GradientGuard
from opake.torch.loader import PlanExhaustedError, PlannedBatches
from opake.torch.per_example.bookkeeping import sum_dtype
from opake.torch.per_example.errors import ClipperUsageError
from opake.types import clipped

__all__ = ["DPOptimizer", "DirectStepError", "ForeignOptimizerError", "PlanExhaustedError"]


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``step()`` replaces the gradients by clipped sums plus noise first.

    Built by ``make_private``; ``noise_fn`` / ``noise_state`` are the noise engine's pair,
    ``clipper`` the per-example clipper of the module, ``parameters`` the trainable parameters
    by name (the engine's template), ``normalization`` the constant divisor of the clipped sum,
    ``batches`` the plan's batches (``step()`` releases only those), ``noise_multiplier`` the
    plan's sigma (read by Opacus-style scripts as ``optimizer.noise_multiplier``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, clipper, noise_fn, noise_state, parameters: dict,
                 max_grad_norm: float, normalization: float, batches: PlannedBatches, noise_multiplier: float,
                 process_group=None, distributed: bool = False):
        # Not Optimizer.__init__: the wrapped optimizer owns the groups and the state.
        self.original_optimizer = optimizer
        self.guard = GradientGuard(parameters, optimizer)
        self.clipper = clipper
        self.noise_fn = noise_fn
        self.noise_state = noise_state
        self.parameters = parameters
        self.max_grad_norm = float(max_grad_norm)
        self.normalization = float(normalization)
        self.noise_multiplier = float(noise_multiplier)
        self.batches = batches
        batches.next_step = lambda: self.noise_state.step
        self.last_step_examples = 0
        self.distributed = distributed
        self.process_group = process_group
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
        raise RuntimeError(
            "a private optimizer's parameters are fixed by its privacy plan (the noise engine holds "
            "buffers for exactly those parameters); build the optimizer with every parameter group "
            "before calling make_private"
        )

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    def release_wrapped_optimizer(self) -> None:
        """Give the parameters back to every optimizer (``make_private``'s ``detach()``)."""
        self.guard.remove()

    # -- the step -------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients and start a new logical batch."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.clipper.reset()
        self.guard.clear()

    @property
    def steps_taken(self) -> int:
        return self.noise_state.step

    @property
    def steps_planned(self) -> int:
        return self.noise_state.n_steps

    def step(self, closure=None):
        """Noise the clipped sum of the examples since ``zero_grad`` and take the optimizer step."""
        if closure is not None:
            raise TypeError(
                "DPOptimizer.step does not take a closure: a closure re-evaluates the loss, which "
                "would release gradients without noise; call loss.backward() before step()"
            )
        step = self.noise_state.step
        if step >= self.noise_state.n_steps:
            raise PlanExhaustedError(
                f"optimizer.step() was called after all {self.noise_state.n_steps} planned steps were taken "
                f"(one per batch of the plan); a further step would release gradients the reported epsilon "
                f"does not cover. Take one step per batch of private.data_loader, and plan the epochs the "
                f"loop runs (make_private(..., epochs=...))"
            )
        try:
            sums = self.clipper.clipped_sum(copy=False)  # read only: divided below into new tensors
            examples = self.clipper.examples
        except ClipperUsageError:
            if self.clipper.passes:  # backward passes were clipped: a misuse the clipper named
                raise
            if self.batches.indices(step):
                raise ClipperUsageError(
                    f"optimizer.step() was called without a backward pass since zero_grad(), but planned batch "
                    f"{step} has examples; run loss.backward() on that batch first"
                ) from None
            sums, examples = None, 0  # an empty planned batch: its release is noise only
        self.batches.check_step(step, examples)
        if sums is None:
            sums = {name: torch.zeros_like(p, dtype=sum_dtype(p.dtype)) for name, p in self.parameters.items()}
        self.last_step_examples = examples
        if not self._coverage_checked and examples:
            self.clipper.check_coverage(autograd_gradients=self.guard.collected)
            self._coverage_checked = True
            self.clipper.track_coverage(False)
            self.clipper.skip_autograd_weight_gradients(True)
            self.guard.collecting = False
            self.guard.clear()
        if self.distributed:
            sums = _all_reduced(sums, self.process_group)
        gradients = clipped({name: sums[name] / self.normalization for name in self.parameters},
                            l2_bound=self.max_grad_norm, normalization=self.normalization)
        noisy, self.noise_state = self.noise_fn(gradients, self.noise_state)
        for name, parameter in self.parameters.items():
            parameter.grad = noisy.pytree[name]
        self.clipper.reset()
        with self.guard.stepping():
            return self.original_optimizer.step()


def _all_reduced(sums: dict, process_group) -> dict:
    """The sum over ranks of every rank's clipped sums: one all-reduce per dtype.

    Each rank clipped its own part of the global batch; the clipped sum of the global batch is
    the sum of the parts (clipping is per example), so every rank then holds the same sum and
    the sharded noise engine adds the noise once.
    """
    import torch.distributed as dist

    result = {}
    for dtype in sorted({tensor.dtype for tensor in sums.values()}, key=str):
        names = [name for name, tensor in sums.items() if tensor.dtype == dtype]
        flat = torch.cat([sums[name].reshape(-1) for name in names])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        for name, piece in zip(names, flat.split([sums[name].numel() for name in names])):
            result[name] = piece.view(sums[name].shape)
    return result
