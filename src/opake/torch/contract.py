"""The plan is a contract: the live module and optimizer are checked against it at every step.

``make_private`` plans a run for the parameters the module has *then*: the per-example hooks sit
on the layers that held trainable parameters, the noise engine keeps buffers for exactly those
parameters, and the private optimizer writes noised gradients into exactly those objects. What
a user changes afterwards would otherwise train outside the plan while the planned epsilon is
printed:

* a parameter frozen at planning and unfrozen later (gradual unfreezing) gets autograd's raw
  batch gradient, with no clipping and no noise, and the optimizer holding it applies it;
* a layer (or a ``Parameter``) replaced after planning has no hooks and no noise: its own
  optimizer trains it on raw gradients, or it silently never trains;
* a parameter group added to the optimizer afterwards (``add_param_group``: a learnable
  temperature) is stepped with its raw gradient by the private step itself.

``PlanContract`` records, when the run is attached, every parameter of the module by name and
object (frozen ones too), whether each is trainable, and the parameter objects of every group of
the optimizer given to ``make_private``. It compares the live objects with that record, by
identity, shape and ``requires_grad`` (never values), in two places:

* before every forward pass of the module that records gradients (a forward pre-hook that runs
  before the clipper's), so that no gradient is computed for a parameter outside the plan, and
  no other optimizer has anything to apply;
* at the start of every ``DPOptimizer.step``, before anything is reduced, noised or released,
  for the module and for the optimizer's groups.

A difference raises ``PlanChangedError`` (an ``OpakeError`` and a ``RuntimeError``) naming the
parameter or group and the way out. Changing the set of trainable parameters during a run is
refused rather than priced: the clipping bound covers the planned parameters together, and a
parameter that joins later would need hooks and noise buffers the run does not have. Gradual
unfreezing has a recipe that stays inside the plan (docs/torch.md, "Gradual unfreezing"): plan
over every parameter that will ever train and hold each stage still with a learning rate of 0.

Cost: one walk over ``named_parameters()`` per forward pass and per step, plus one over the
optimizer's groups per step (identity comparisons only).
"""

from __future__ import annotations

import torch
from torch import nn

from opake.errors import OpakeError

__all__ = ["PlanChangedError", "PlanContract", "RestartedWorkerError"]

_GRADUAL_UNFREEZING = (
    "To unfreeze parameters during a run, plan over every parameter that will ever train: leave them "
    "trainable (requires_grad=True) when calling make_private and hold each later stage still with a "
    "learning rate of 0 in its own parameter group until its stage begins (docs/torch.md, 'Gradual "
    "unfreezing'); or finish this run and plan a new one (private.detach(), then make_private: the two "
    "runs' privacy costs add up)"
)
_REPLAN = (
    "Make the change before calling make_private (build the model and the optimizer, then plan), or finish "
    "this run and plan a new one over the changed model (private.detach(), then make_private: the two runs' "
    "privacy costs add up)"
)


class PlanChangedError(OpakeError, RuntimeError):
    """The module or optimizer changed after planning in a way that would train outside the plan
    (a parameter unfrozen, frozen, replaced, added or removed; a parameter group added or changed).
    Raised before anything is computed or released; nothing was changed."""


class RestartedWorkerError(OpakeError, RuntimeError):
    """The launcher restarted this worker (``TORCHELASTIC_RESTART_COUNT`` > 0) and the run was planned
    afresh without loading its checkpoint: training it would spend the privacy budget a second time."""


class PlanContract:
    """What the run was planned for, checked against the live ``module`` and ``optimizer``.

    ``planned``: the planned (trainable) parameters by name; ``accumulating``: the tensors autograd
    accumulates their gradients into, where those are other objects (an FSDP2 model's unsharded
    parameters, which stand in the module during its forward and backward passes); ``replaying``
    says whether the clipper is replaying a layer per example right now (its functional call
    swaps the layer's parameters, and a model that is one layer would see them at its pre-hook).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, planned: dict,
                 accumulating: dict | None = None, replaying=lambda: False):
        self._module = module
        self._replaying = replaying
        self._optimizer = optimizer
        self._trainable = frozenset(planned)
        self._objects = {name: {id(p)} for name, p in module.named_parameters()}
        self._shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
        for name, tensor in (accumulating or {}).items():
            if tensor is not planned[name]:
                self._objects[name].add(id(tensor))
        self._groups = _group_identities(optimizer)
        self._handle = None
        self.enabled = True
        self.restarts = 0  # > 0: a restarted worker, which must restore the run before training it

    def restored(self) -> None:
        """The run was restored from its checkpoint (or a new run was chosen deliberately)."""
        self.restarts = 0

    def hook(self) -> None:
        """Check before every forward pass of the module that records gradients (first among its
        forward pre-hooks)."""
        self._handle = self._module.register_forward_pre_hook(self._before_forward, prepend=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.enabled = False

    def _before_forward(self, module, args) -> None:
        # A compiled call is the clipper's to refuse (CompiledModuleError): its parameters are traced
        # stand-ins, which this check would misreport as replaced.
        if self.enabled and torch.is_grad_enabled() and not self._replaying() and not torch.compiler.is_compiling():
            self.check_restored()
            self.check_module()

    def check(self) -> None:
        """Raise ``PlanChangedError`` unless the module and the optimizer's groups are as planned (and
        ``RestartedWorkerError`` for a restarted worker that has not restored its run)."""
        if self.enabled:
            self.check_restored()
            self.check_module()
            self.check_optimizer()

    def check_restored(self) -> None:
        if self.restarts:
            raise RestartedWorkerError(
                f"the launcher restarted this worker (TORCHELASTIC_RESTART_COUNT={self.restarts}), and this run "
                f"was planned afresh: its first life already released steps, so training again would spend the "
                f"privacy budget a second time while reporting one run's epsilon. Load the run's last checkpoint "
                f"first (private.load_state_dict(torch.load(path, weights_only=True), draws='replay'), with the "
                f"key saved in it: make_private(..., key=opake.random.RngKey.from_hex(saved['key'])); "
                f"DPTrainer resumes from output_dir's last complete checkpoint by itself). To train a second "
                f"run deliberately (the two runs' privacy costs add up), call private.new_run_after_restart(). "
                f"Nothing was computed or released")

    def check_module(self) -> None:
        """The module's parameters: the same objects and shapes under the same names, and trainable
        exactly where the plan made them trainable."""
        seen = 0
        for name, parameter in self._module.named_parameters():
            objects = self._objects.get(name)
            if objects is None or id(parameter) not in objects:
                if name in self._trainable or parameter.requires_grad:
                    raise PlanChangedError(_replaced(name, objects is None))
                continue  # a frozen parameter outside the plan may change: it trains nothing
            seen += 1
            if parameter.requires_grad != (name in self._trainable):
                raise PlanChangedError(_unfrozen(name) if parameter.requires_grad else _frozen(name))
            if tuple(parameter.shape) != self._shapes[name] and name in self._trainable:
                raise PlanChangedError(
                    f"planned parameter {name!r} changed shape from {self._shapes[name]} to "
                    f"{tuple(parameter.shape)} after make_private; the run's noise and hooks are for the planned "
                    f"shape. {_REPLAN}. Nothing was changed")
        if seen < len(self._trainable):
            present = {name for name, _ in self._module.named_parameters()}
            missing = sorted(self._trainable - present)
            if missing:
                raise PlanChangedError(
                    f"planned parameter(s) {missing[:3]} are no longer parameters of the private module (a "
                    f"layer removed or replaced after make_private). {_REPLAN}. Nothing was changed")

    def check_optimizer(self) -> None:
        """The optimizer's parameter groups hold the same parameter objects as when it was planned."""
        groups = _group_identities(self._optimizer)
        if groups == self._groups:
            return
        if len(groups) > len(self._groups):
            what = (f"{len(groups) - len(self._groups)} parameter group(s) were added to the optimizer given to "
                    f"make_private (add_param_group) after planning")
        else:
            what = "the parameter groups of the optimizer given to make_private changed after planning"
        raise PlanChangedError(
            f"{what}: the private step would apply their autograd gradients, unclipped and without noise. "
            f"Every parameter the optimizer steps must be a parameter of the private module, in a group "
            f"that existed when make_private was called. {_REPLAN}. Nothing was changed")


def _group_identities(optimizer) -> tuple:
    return tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups)


def _replaced(name: str, new: bool) -> str:
    what = ("is a new parameter of the private module (a layer added or replaced after make_private)" if new else
            "is not the Parameter object that was planned (a layer or Parameter replaced after make_private)")
    return (f"parameter {name!r} {what}: no per-example hook clips its gradient and the noise engine holds no "
            f"noise for it, so an optimizer of its own would train it on the raw batch gradient (and the private "
            f"optimizer would never step it). {_REPLAN}. Nothing was changed")


def _unfrozen(name: str) -> str:
    return (f"parameter {name!r} was frozen (requires_grad=False) when the run was planned and is trainable "
            f"now: its gradient would be the raw batch gradient, with no clipping and no noise. "
            f"{_GRADUAL_UNFREEZING}. Nothing was changed")


def _frozen(name: str) -> str:
    return (f"planned parameter {name!r} was frozen (requires_grad=False) after make_private; the run clips and "
            f"noises the planned parameters together, so freezing one changes what the plan computes. To hold it "
            f"still, keep it trainable and set its parameter group's learning rate to 0 (docs/torch.md, 'Gradual "
            f"unfreezing'). Nothing was changed")
