"""Models as people write them: find what per-example clipping cannot handle, fix it in one call.

Per-example clipping needs every example's gradient to depend on that example alone. Batch
normalization breaks this (each output is normalized with statistics of the whole batch), so
a model with BatchNorm layers in training mode has no per-example gradients at all.
``validate_model(model)`` lists such layers with their paths; ``fix_model(model)`` returns a
copy in which every BatchNorm layer is replaced by a GroupNorm over the same channels (the
common replacement, as in Opacus' ModuleValidator.fix), leaving the caller's model untouched.
Dropout needs no fix: in training mode each example draws its own mask, which is per-example
randomness already.

Recurrent layers are the other kind listed: ``nn.LSTM``/``nn.GRU``/``nn.RNN`` run a fused
multi-step kernel, and the cells (``nn.LSTMCell``, ...) and Opacus' ``DPLSTM``/``DPGRU``/
``DPRNN`` are one layer called at every time step; the per-example rules cannot split either
gradient by example (the replay of a layer sees one call), so ``make_private`` refuses them
before anything is hooked. ``fix_model`` replaces ``nn.LSTM``/``nn.GRU``/``nn.RNN`` and Opacus'
``DPLSTM``/``DPGRU`` by ``opake.torch.DPLSTM``/``DPGRU``/``DPRNN`` with the same weights
(``opake.torch.recurrent``: the same interface and outputs, gates in ``nn.Linear`` layers,
clipped exactly); a cell has no drop-in replacement and stays listed.

A compiled model (``torch.compile(model)``, ``model.compile()``, or a compiled submodule) is refused
by ``require_uncompiled`` before anything is hooked: the per-example hooks cannot be traced
(``opake.torch.per_example.clipper``, "Compiled calls"), and the fix is to pass the uncompiled
module (``model._orig_mod`` of ``torch.compile(model)``).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from opake.errors import OpakeError
from opake.torch import recurrent
from opake.torch.per_example.errors import CompiledModuleError

__all__ = ["ModelValidationError", "fix_model", "require_uncompiled", "validate_model"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# Opacus' recurrent layers, by qualified class name (opake never imports Opacus): what replaces them
_OPACUS_RECURRENT = {"opacus.layers.dp_rnn.DPLSTM": recurrent.DPLSTM, "opacus.layers.dp_rnn.DPGRU": recurrent.DPGRU,
                     "opacus.layers.dp_rnn.DPRNN": None}
_RECURRENT_ADVICE = ("replace it by opake.torch.DPLSTM / DPGRU / DPRNN (nn.LSTM's interface, gates in nn.Linear "
                     "layers, clipped exactly): model = opake.torch.fix_model(model) does it for nn.LSTM, nn.GRU, "
                     "nn.RNN and Opacus' DPLSTM and DPGRU, keeping their weights; write a recurrence of cells with "
                     "nn.Linear gates")


class ModelValidationError(OpakeError, ValueError):
    """The model has layers whose gradients mix examples; the message names them and the fix."""


def validate_model(model: nn.Module) -> list[str]:
    """Descriptions of the layers per-example clipping cannot handle (empty when the model is fine):
    layers that mix examples (BatchNorm) and recurrent layers whose gradient the rules cannot split."""
    problems = []
    for name, layer in model.named_modules():
        where = f"{name or '<the model itself>'} ({type(layer).__name__})"
        if isinstance(layer, _BATCH_NORMS):
            problems.append(f"{where}: batch statistics mix the examples of a batch, so no example has a "
                            f"gradient of its own; replace it with GroupNorm")
        elif _is_recurrent(layer):
            problems.append(f"{where}: a recurrent layer (a fused multi-step kernel, or one layer called at every "
                            f"time step) whose gradient opake cannot split by example; {_RECURRENT_ADVICE}")
    return problems


def require_valid_model(model: nn.Module) -> None:
    """Raise ModelValidationError naming every layer clipping cannot handle, with the fix."""
    problems = validate_model(model)
    if problems:
        raise ModelValidationError(
            "per-example clipping needs each example's own gradient, which these layers prevent: "
            + "; ".join(problems)
            + ". model = opake.torch.fix_model(model) returns a fixed copy (BatchNorm to GroupNorm; nn.LSTM, "
            "nn.GRU, nn.RNN and Opacus' DPLSTM and DPGRU to opake's, same weights); build the optimizer after it"
        )


def require_uncompiled(model: nn.Module) -> None:
    """Raise ``CompiledModuleError`` when ``model`` or one of its submodules is compiled: wrapped by
    ``torch.compile`` (an ``OptimizedModule``) or compiled in place (``module.compile()``)."""
    for name, layer in model.named_modules():
        where = "the module" if not name else f"its submodule {name!r}"
        if _is_compiled_wrapper(layer):
            fix = ("pass the module it wraps: make_private(module=model._orig_mod, ...)" if not name else
                   "put the module it wraps (its ._orig_mod) back in its place first")
        elif getattr(layer, "_compiled_call_impl", None) is not None:  # where module.compile() keeps it
            fix = "build it again without .compile() (a module compiled in place stays compiled), then plan"
        else:
            continue
        raise CompiledModuleError(
            f"{where} is compiled ({type(layer).__name__}), and per-example clipping cannot run under "
            f"torch.compile: its hooks carry Python state from each layer call to the backward pass, which "
            f"the compiler cannot trace exactly. Nothing was hooked or planned: {fix}. Train the uncompiled "
            f"module; to compile it for inference once the run is over, call private.detach() first"
        )


def _is_compiled_wrapper(layer: nn.Module) -> bool:
    """Whether ``layer`` is ``torch.compile``'s wrapper (never when the compiler was not even imported)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(layer, dynamo.OptimizedModule)


def _is_recurrent(layer: nn.Module) -> bool:
    if isinstance(layer, (nn.RNNBase, nn.RNNCellBase)):
        return True
    return any(f"{kind.__module__}.{kind.__qualname__}" in _OPACUS_RECURRENT for kind in type(layer).__mro__)


def _replacement(layer: nn.Module) -> nn.Module | None:
    """opake's recurrent layer for ``layer`` (same weights), or None when there is none."""
    if type(layer) in (nn.LSTM, nn.GRU, nn.RNN):
        return recurrent.from_module(layer)
    kind = _OPACUS_RECURRENT.get(f"{type(layer).__module__}.{type(layer).__qualname__}")
    return None if kind is None else recurrent.from_parameters(kind, layer)


def fix_model(model: nn.Module, *, max_groups: int = 32) -> nn.Module:
    """A copy of ``model`` with every BatchNorm layer replaced by ``GroupNorm``, and every
    ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (and Opacus' ``DPLSTM``/``DPGRU``) by opake's recurrent layer
    of the same interface and weights (``opake.torch.recurrent``).

    The group count is the largest divisor of the channel count that is at most ``max_groups``
    (32, as in the GroupNorm paper's default); affine layers keep ``eps`` and get GroupNorm's
    fresh affine parameters (weight 1, bias 0). The caller's model is not modified.
    """
    fixed = copy.deepcopy(model)
    for name, layer in list(fixed.named_modules()):
        replacement = _replacement(layer) if _is_recurrent(layer) else None
        if replacement is not None:
            _replace(fixed, name, replacement)
        elif isinstance(layer, _BATCH_NORMS):
            replacement = nn.GroupNorm(
                _groups(layer.num_features, max_groups), layer.num_features, eps=layer.eps, affine=layer.affine,
            )
            if layer.affine:
                replacement = replacement.to(device=layer.weight.device, dtype=layer.weight.dtype)
            _replace(fixed, name, replacement)
    return fixed


def _groups(channels: int, max_groups: int) -> int:
    return max(d for d in range(1, min(channels, max_groups) + 1) if channels % d == 0)


def _replace(root: nn.Module, name: str, replacement: nn.Module) -> None:
    if not name:
        if isinstance(replacement, recurrent.DPLSTM | recurrent.DPGRU | recurrent.DPRNN):
            raise ModelValidationError("the model itself is a recurrent layer: use opake.torch.recurrent.from_module"
                                       "(model) for its replacement")
        raise ModelValidationError(
            "the model itself is a BatchNorm layer; there is nothing to train privately around it"
        )
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, replacement)


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter for the parameters that require grad (frozen ones get no noise)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
