"""The private optimizer as Opacus scripts use it: ``expected_batch_size``, skipped steps, closures.

``OpacusDPOptimizer`` is opake's ``DPOptimizer`` with the two calls Opacus' scripts and
``BatchMemoryManager`` make on it. ``expected_batch_size`` is the constant the clipped sum is
divided by (the plan's expected batch size; Opacus' is ``int(len(dataset) * sample_rate)``,
here the exact value, a float). ``signal_skip_step(do_skip=True)`` says that the next
``step()`` ends a physical batch, not a logical one: that step releases nothing and the
following ``zero_grad()`` keeps what was clipped, so the parts of one planned batch add up
before its one real step, which checks, as every step does, that the examples clipped since the
last real ``zero_grad()`` are exactly the planned batch's (``opake.torch.loader``). A skipped
step changes nothing a release depends on, so it cannot weaken the guarantee.

``step(closure)`` runs the closure once, before the release (Opacus' order), and steps the
wrapped optimizer without it: the closure's backward is clipped like any other, and the step's
check of the planned batch still runs, so a closure cannot release gradients outside the plan or
without noise (an optimizer that re-evaluates its closure, as L-BFGS does, never sees it).
``accumulated_iterations`` counts the passes clipped since ``zero_grad()``. ``pre_step()`` makes
the step's release (checks, clipped sums, noise, into ``.grad``) and the next ``step()`` applies
it; ``add_noise()`` alone is refused: the noise is added in that one release.

The adapter turns the ``DPOptimizer`` that ``make_private`` built into this class
(``as_opacus_optimizer``): the same object, so ``private.optimizer`` is the returned optimizer
and ``isinstance(optimizer, DPOptimizer)`` still holds.
"""

from __future__ import annotations

import torch

from opake.errors import InvalidStateError, InvalidTypeError
from opake.torch.loader import UnplannedBatchError
from opake.torch.optimizer import DPOptimizer
from opake.torch.per_example.errors import ClipperUsageError

__all__ = ["OpacusDPOptimizer", "as_opacus_optimizer"]


# A discriminator-style step (Opacus' examples/dcgan.py): a real and a generated batch backpropagated
# through the private module before one step.
_SEVERAL_PASSES = (
    "Several backward passes came before this step with more examples than the planned batch, as a GAN "
    "discriminator trained on a real and a generated batch (Opacus' examples/dcgan.py): only the planned batch "
    "is released in a step, and a generated batch is not part of the plan. Backpropagate the real batch alone "
    "before optimizer.step(), and train on the generated batch with a discriminator that is not private (a copy "
    "whose weights you load from the private one after each step), so that what the private step releases is "
    "exactly the planned batch the accountant priced"
)


class OpacusDPOptimizer(DPOptimizer):
    """``DPOptimizer`` with Opacus' ``expected_batch_size``, ``signal_skip_step``, ``accumulated_iterations``,
    ``pre_step`` and ``step(closure)`` (module docstring)."""

    _skip_queue: list
    _last_step_skipped: bool
    _pending: object  # the release pre_step() made, until step() applies it
    adaptive: object  # AdaptiveBound with clipping="adaptive", else None

    @property
    def expected_batch_size(self) -> float:
        """The constant divisor of the clipped sums: the plan's expected batch size."""
        return self.normalization

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` only ends a physical part of a planned batch (skipped)."""
        self._skip_queue.append(bool(do_skip))

    def clear_skipped_steps(self) -> None:
        """Forget queued skips (a new pass of physical parts starts; a pass left early left some)."""
        self._skip_queue.clear()

    @property
    def accumulated_iterations(self) -> int:
        """The forward/backward passes clipped since the last real ``zero_grad()`` (Opacus counts the
        backward passes accumulated before a step; one per physical part of a planned batch)."""
        return self.clipper.passes

    def pre_step(self, closure=None) -> bool:
        """Opacus' first half of ``step()``: the release (the planned batch's clipped sums, noised,
        written into ``.grad``) without the wrapped optimizer's step; False, releasing nothing, for a
        skipped step. The next ``step()`` applies that release (it releases nothing more); the wrapped
        optimizer's own ``step()`` stays refused. ``closure`` is run first, as in ``step``."""
        if self._pending is not None:
            raise InvalidStateError("pre_step() already released this step; call optimizer.step() to apply it")
        self._run_closure(closure)
        self._expose_sums()
        if self._skip_queue and self._skip_queue.pop(0):
            self._last_step_skipped = True
            return False
        self._last_step_skipped = False
        self._pending = self._release()
        return True

    def _clipped_sums(self, step: int) -> tuple[dict, int]:
        sums, examples = super()._clipped_sums(step)
        self._counts = (examples, self.clipper.clipped_examples if examples else 0)  # for adaptive clipping
        return sums, examples

    def _release(self):
        """The step's release; with adaptive clipping, then the noisy count and the next bound
        (``opake.torch.opacus.adaptive``)."""
        step, passes, examples = self.run.step, self.clipper.passes, self.clipper.examples
        try:
            noisy = super()._release()
        except UnplannedBatchError as error:
            if passes > 1 and step < self.run.n_steps and examples > len(self.run.batches.indices(step)):
                raise UnplannedBatchError(f"{error} {_SEVERAL_PASSES}") from None
            raise
        if self.adaptive is not None:
            self.adaptive.update(self.clipper, step, *self._counts)
        return noisy

    def _check_coverage_once(self, examples: int) -> None:
        """The check that every parameter use went through a hooked layer waits for a step whose passes
        dropped no example for a non-finite gradient (autograd's ``.grad`` holds that example's NaN). The
        release does not depend on it: each example's released contribution is its clipped hooked
        gradient, within the bound either way; the check guards the training, not the bound."""
        if not self._coverage_checked and examples and not self.clipper.coverage_comparable:
            return
        super()._check_coverage_once(examples)

    def add_noise(self) -> None:
        """Refused: the noise is added in the one release of the clipped sums (``pre_step()``/``step()``)."""
        raise InvalidStateError(
            "add_noise() is not available on its own: opake adds the noise in the same release that checks the "
            "planned batch and divides the clipped sum by the expected batch size (Opacus' clip, add_noise and "
            "scale_grad together); call optimizer.pre_step() for that release, or optimizer.step()"
        )

    def step(self, closure=None):
        """Opacus' step: ``closure()`` first, if given, under ``torch.enable_grad()`` (it zeroes the
        gradients, computes the loss on the planned batch and calls ``backward``), then the release,
        whose checks are a closure-less step's (the examples clipped are exactly the planned batch's),
        and the wrapped optimizer's step without the closure. After ``pre_step()`` returned True it
        applies that release (a closure is then refused). Returns the closure's loss (None without)."""
        if self._pending is not None:
            if closure is not None:
                raise InvalidTypeError("pre_step() released this step already: call step() without a closure")
            noisy, self._pending = self._pending, None
            return self._apply(noisy)
        loss = self._run_closure(closure)
        self._expose_sums()
        if self._skip_queue and self._skip_queue.pop(0):
            self._last_step_skipped = True
            return loss
        self._last_step_skipped = False
        returned = super().step()
        return loss if closure is not None else returned

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending = None  # a release pre_step() made and no step() applied is dropped with .grad
        if self._last_step_skipped:
            return  # the clipped parts of this planned batch wait for its real step
        super().zero_grad(set_to_none=set_to_none)
        for param in self.parameters.values():
            param.summed_grad = None
            param.grad_sample = None

    def _expose_sums(self) -> None:
        """Opacus' per-parameter views of the step: ``p.summed_grad``, the sum of the clipped
        per-example gradients since ``zero_grad()`` (before noise and the division by the expected
        batch size), and, where the clipper keeps them (a noise-free run), ``p.grad_sample``, the
        examples' own gradients. Read only: the step releases from the clipper, not from these."""
        if not self.clipper.passes:
            return
        try:
            sums = self.clipper.clipped_sum(copy=False)
        except ClipperUsageError:
            return  # the release names the misuse
        kept = self.clipper.per_example_grads() if self.clipper.keeps_per_example else {}
        for name, param in self.parameters.items():
            param.summed_grad = sums[name]
            if kept:
                param.grad_sample = kept.get(name)

    @staticmethod
    def _run_closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def as_opacus_optimizer(optimizer: DPOptimizer) -> OpacusDPOptimizer:
    """The same ``DPOptimizer`` object, now an ``OpacusDPOptimizer`` with an empty skip queue."""
    if type(optimizer) is not DPOptimizer:
        raise InvalidTypeError(f"expected make_private's DPOptimizer, got {type(optimizer).__name__}")
    optimizer.__class__ = OpacusDPOptimizer  # adds methods only: no state of the run moves
    optimizer._skip_queue = []
    optimizer._last_step_skipped = False
    optimizer._pending = None
    optimizer.adaptive = None  # adaptive clipping's bound (opake.torch.opacus.adaptive.AdaptiveBound), if asked for
    return optimizer
