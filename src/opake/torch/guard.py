"""Only the private optimizer moves a private module's parameters.

After ``make_private``, two doors would otherwise let un-noised gradients into the model while
the planned epsilon is printed:

* **``.grad``.** Autograd accumulates the *unclipped* sum of the batch's gradients into
  ``.grad``. Any optimizer (``transformers.Trainer``'s own AdamW, a new ``torch.optim.AdamW``
  over ``model.parameters()``) or a manual ``p -= lr * p.grad`` would apply it. A
  post-accumulate-grad hook on every trainable parameter takes autograd's gradient out of
  ``.grad`` as soon as it is accumulated, so between a backward pass and ``DPOptimizer.step``
  ``.grad`` is None: it never holds an un-noised value. The gradient is kept (summed over the
  backward passes of the logical batch) only while the first step's coverage check reads it
  (``PerExampleClipper.check_coverage``); after that it is dropped at once, which also frees
  a model-sized buffer during backward. ``.grad`` holds the noised gradient from
  ``DPOptimizer.step`` until the next ``zero_grad``.
* **Optimizer steps.** A process-wide optimizer step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``, public since torch 2.0) runs before
  the ``step()`` of every ``torch.optim.Optimizer``. A step of an optimizer that holds a guarded
  parameter is refused, before anything moves, unless that parameter's ``DPOptimizer`` is taking
  its step right now: ``DirectStepError`` for the optimizer given to ``make_private``,
  ``ForeignOptimizerError`` for any other. The refusal is what makes a wrong loop loud; the empty
  ``.grad`` is what keeps a loop that bypasses ``torch.optim`` (or skips None gradients) from
  applying anything private.

The hook is global because an optimizer built after ``make_private`` (Trainer builds its own)
has no other seam; it is installed once, on the first guard, and costs one dictionary lookup per
parameter of a stepping optimizer. Guarded parameters are kept in a weak identity map (a
parameter that is collected leaves it); ``GradientGuard.remove()`` (``PrivateTraining.detach()``)
gives the parameters back.

The guard covers the parameters that were planned. A parameter that joins the module or the
optimizer later (unfrozen, replaced, added in a parameter group) is outside it; the plan's
contract (``opake.torch.contract``) refuses such a change before any gradient is computed for it,
so the claim above holds for every parameter that can receive a gradient.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from opake.errors import InvalidArgumentError, OpakeError

__all__ = ["DirectStepError", "ForeignOptimizerError", "GradientGuard"]


class DirectStepError(OpakeError, RuntimeError):
    """``step()`` of an optimizer given to ``make_private``, called directly instead of through
    the ``DPOptimizer`` that wraps it (it would release gradients without clipping or noise)."""


class ForeignOptimizerError(DirectStepError):
    """``step()`` of an optimizer that was not given to ``make_private`` but holds parameters of a
    private module (a ``transformers.Trainer``'s own optimizer, a new AdamW in the loop)."""


# Parameter -> weak reference to the GradientGuard that owns it (one guard per private run).
_GUARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_HOOK = None


class GradientGuard:
    """Keeps autograd's gradients of ``parameters`` (name -> Parameter) out of ``.grad`` and
    refuses every optimizer step on them but the one ``stepping()`` allows.

    ``wrapped`` is the optimizer given to ``make_private`` (named in its refusal);
    ``autograd_parameters`` (name -> tensor, default ``parameters``) are the tensors autograd
    accumulates the gradients into (under FSDP2, the unsharded parameters). While
    ``collecting`` is on, autograd's gradients are summed per name into ``collected`` (for the
    coverage check); otherwise they are dropped.
    """

    def __init__(self, parameters: dict, wrapped: torch.optim.Optimizer, autograd_parameters: dict | None = None):
        owned = [name for name, p in parameters.items() if _owner(p) is not None]
        if owned:
            raise InvalidArgumentError(
                f"parameters {owned[:3]} already belong to another private run; call that run's detach() "
                f"(private.detach()) before planning a new one on them"
            )
        _install_step_hook()
        accumulating = parameters if autograd_parameters is None else autograd_parameters
        self._names = {id(p): name for name, p in accumulating.items()}
        self._wrapped = weakref.ref(wrapped)
        self._stepping = False
        self.collecting = False
        self.collected: dict[str, torch.Tensor] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._take_grad) for p in accumulating.values()]
        self_ref = weakref.ref(self)
        for p in (*parameters.values(), *accumulating.values()):
            _GUARDED[p] = self_ref

    def _take_grad(self, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        if grad is None:
            return
        if self.collecting:
            name = self._names[id(parameter)]
            held = self.collected.get(name)
            self.collected[name] = grad.detach() if held is None else held + grad.detach()
        parameter.grad = None

    def clear(self) -> None:
        """Forget the collected gradients (a new logical batch)."""
        self.collected = {}

    @contextlib.contextmanager
    def stepping(self):
        """Allow optimizer steps on the guarded parameters (``DPOptimizer.step``, whose ``.grad``
        are the noised gradients)."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def check_step(self, optimizer) -> None:
        if self._stepping:
            return
        if optimizer is self._wrapped():
            raise DirectStepError(
                f"this {type(optimizer).__name__} was given to make_private, and its own step() would apply "
                f"gradients without clipping or noise: outside the privacy guarantee. Call step() on the "
                f"optimizer make_private returned (private.optimizer; its zero_grad() and step() take this "
                f"optimizer's place in the loop). Nothing was changed"
            )
        raise ForeignOptimizerError(
            f"this {type(optimizer).__name__} holds parameters of a module made private by make_private, but "
            f"it is not the private optimizer: its step() would train without clipping or noise while the "
            f"planned epsilon is reported. Step private.optimizer instead (make_private wraps the optimizer "
            f"you pass it); with transformers.Trainer use opake.transformers.DPTrainer (a Trainer given "
            f"private.module builds its own optimizer). To train without privacy, call private.detach() "
            f"first. Nothing was changed"
        )

    def remove(self) -> None:
        """Give the parameters back: ``.grad`` fills again and any optimizer may step them."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for parameter in [p for p, ref in list(_GUARDED.items()) if ref() is self]:
            del _GUARDED[parameter]
        self.collected = {}


def _owner(parameter) -> GradientGuard | None:
    ref = _GUARDED.get(parameter)
    return None if ref is None else ref()


def _refuse_unprivate_steps(optimizer, args, kwargs) -> None:
    if not _GUARDED:
        return
    checked = set()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            guard = _owner(parameter)
            if guard is not None and id(guard) not in checked:
                checked.add(id(guard))
                guard.check_step(optimizer)


def _install_step_hook() -> None:
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_refuse_unprivate_steps)
