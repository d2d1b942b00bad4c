"""Models as people write them: find what per-example clipping cannot handle, fix it in one call.

Per-example clipping needs every example's gradient to depend on that example alone. Batch
normalization breaks this (each output is normalized with statistics of the whole batch), so
a model with BatchNorm layers in training mode has no per-example gradients at all.
``validate_model(model)`` lists such layers with their paths; ``fix_model(model)`` returns a
copy in which every BatchNorm layer is replaced by a GroupNorm over the same channels (the
common replacement, as in Opacus' ModuleValidator.fix), leaving the caller's model untouched.
Dropout needs no fix: in training mode each example draws its own mask, which is per-example
randomness already.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from opake.errors import OpakeError

__all__ = ["ModelValidationError", "fix_model", "validate_model"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class ModelValidationError(OpakeError, ValueError):
    """The model has layers whose gradients mix examples; the message names them and the fix."""


def validate_model(model: nn.Module) -> list[str]:
    """Descriptions of the layers that mix examples (empty when the model is fine)."""
    return [
        f"{name or '<the model itself>'} ({type(layer).__name__}): batch statistics mix the examples "
        f"of a batch, so no example has a gradient of its own"
        for name, layer in model.named_modules()
        if isinstance(layer, _BATCH_NORMS)
    ]


def require_valid_model(model: nn.Module) -> None:
    """Raise ModelValidationError naming every layer that mixes examples, with the fix."""
    problems = validate_model(model)
    if problems:
        raise ModelValidationError(
            "per-example clipping needs per-example gradients, which these layers prevent: "
            + "; ".join(problems)
            + ". Replace them with GroupNorm: model = opake.torch.fix_model(model) (a fixed copy)"
        )


def fix_model(model: nn.Module, *, max_groups: int = 32) -> nn.Module:
    """A copy of ``model`` with every BatchNorm layer replaced by ``GroupNorm``.

    The group count is the largest divisor of the channel count that is at most ``max_groups``
    (32, as in the GroupNorm paper's default); affine layers keep ``eps`` and get GroupNorm's
    fresh affine parameters (weight 1, bias 0). The caller's model is not modified.
    """
    fixed = copy.deepcopy(model)
    for name, layer in list(fixed.named_modules()):
        if isinstance(layer, _BATCH_NORMS):
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
        raise ModelValidationError(
            "the model itself is a BatchNorm layer; there is nothing to train privately around it"
        )
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, replacement)


def trainable_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> parameter for the parameters that require grad (frozen ones get no noise)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
