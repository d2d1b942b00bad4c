"""The private optimizer as Opacus scripts use it: ``expected_batch_size`` and skipped steps.

``OpacusDPOptimizer`` is opake's ``DPOptimizer`` with the two calls Opacus' scripts and
``BatchMemoryManager`` make on it. ``expected_batch_size`` is the constant the clipped sum is
divided by (the plan's expected batch size; Opacus' is ``int(len(dataset) * sample_rate)``,
here the exact value, a float). ``signal_skip_step(do_skip=True)`` says that the next
``step()`` ends a physical batch, not a logical one: that step releases nothing and the
following ``zero_grad()`` keeps what was clipped, so the parts of one planned batch add up
before its one real step, which checks, as every step does, that the examples clipped since the
last real ``zero_grad()`` are exactly the planned batch's (``opake.torch.loader``). A skipped
step changes nothing a release depends on, so it cannot weaken the guarantee.

The adapter turns the ``DPOptimizer`` that ``make_private`` built into this class
(``as_opacus_optimizer``): the same object, so ``private.optimizer`` is the returned optimizer
and ``isinstance(optimizer, DPOptimizer)`` still holds.
"""

from __future__ import annotations

from opake.errors import InvalidTypeError
from opake.torch.optimizer import DPOptimizer

__all__ = ["OpacusDPOptimizer", "as_opacus_optimizer"]


class OpacusDPOptimizer(DPOptimizer):
    """``DPOptimizer`` with Opacus' ``expected_batch_size`` and ``signal_skip_step`` (module docstring)."""

    _skip_queue: list
    _last_step_skipped: bool

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

    def step(self, closure=None):
        if self._skip_queue and self._skip_queue.pop(0):
            if closure is not None:
                raise InvalidTypeError("DPOptimizer.step does not take a closure; call loss.backward() before step()")
            self._last_step_skipped = True
            return None
        self._last_step_skipped = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._last_step_skipped:
            return  # the clipped parts of this planned batch wait for its real step
        super().zero_grad(set_to_none=set_to_none)


def as_opacus_optimizer(optimizer: DPOptimizer) -> OpacusDPOptimizer:
    """The same ``DPOptimizer`` object, now an ``OpacusDPOptimizer`` with an empty skip queue."""
    if type(optimizer) is not DPOptimizer:
        raise InvalidTypeError(f"expected make_private's DPOptimizer, got {type(optimizer).__name__}")
    optimizer.__class__ = OpacusDPOptimizer  # adds methods only: no state of the run moves
    optimizer._skip_queue = []
    optimizer._last_step_skipped = False
    return optimizer
