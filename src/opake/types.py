"""Value types that carry privacy-relevant metadata between the stages of a DP training step.

Clipping produces a :class:`ClippedPytree`: the gradients together with the bound on how much
one protected unit can change them. The noise stage accepts only that type (a bare tensor or
dict is refused, so noise is never scaled for the wrong bound) and returns a distinct
:class:`NoisedPytree`. Gradients clipped by hand are wrapped with :func:`clipped`.

Meaning of the fields. ``pytree`` holds the sum of clipped per-example gradients divided by
``normalization`` (for example the batch size, to get a mean): adding or removing one protected
unit changes it by at most ``l2_bound / normalization`` in L2 norm over all leaves together.
The noise stage therefore adds ``noise_multiplier * l2_bound / normalization`` times unit
Gaussian (correlated) noise to it.

Pytrees are handled by optree: a tensor, or dicts, lists and tuples (nested) of tensors. For an
``nn.Module`` pass ``dict(model.named_parameters())``.

>>> import torch
>>> from opake.types import clipped
>>> grads = clipped({"w": torch.zeros(3)}, l2_bound=1.0, normalization=32)
>>> grads.l2_bound, grads.normalization
(1.0, 32.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake._checks import positive_finite
from opake.errors import InvalidTypeError

__all__ = ["ClippedPytree", "NoisedPytree", "clipped"]


def _check_tensor_leaves(name: str, pytree) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(pytree)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            where = "/".join(str(p) for p in path) or "<root>"
            raise InvalidTypeError(
                f"{name} leaves must be torch.Tensor; the leaf at {where!r} is "
                f"{type(leaf).__name__}. For an nn.Module pass dict(model.named_parameters())"
            )


@dataclass(frozen=True, eq=False)
class ClippedPytree:
    """Clipped, summed and normalized gradients with the bound that makes them private.

    ``pytree``: tensors (sum of clipped per-example gradients divided by ``normalization``).
    ``l2_bound``: the per-unit L2 clipping bound (> 0, finite).
    ``normalization``: the divisor already applied to the sum (> 0, finite; 1.0 for a plain sum).
    """

    pytree: Any
    l2_bound: float
    normalization: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "l2_bound", positive_finite("l2_bound", self.l2_bound))
        object.__setattr__(self, "normalization", positive_finite("normalization", self.normalization))
        _check_tensor_leaves("ClippedPytree.pytree", self.pytree)

    @property
    def sensitivity(self) -> float:
        """How much one protected unit can move ``pytree`` in L2: l2_bound / normalization."""
        return self.l2_bound / self.normalization


@dataclass(frozen=True, eq=False)
class NoisedPytree:
    """Gradients with the mechanism's noise added: safe to release or apply to the model.

    ``pytree`` has the structure, shapes, dtypes and device of the noise engine's
    ``grad_template`` (usually the parameters: bfloat16 parameters get bfloat16 noisy gradients
    even when their clipped sums came in float32); ``step`` is the 0-based training step whose
    noise was added; ``noise_variance`` the variance of every coordinate of that noise,
    (noise_multiplier * l2_bound / normalization)^2 ||row step of C^{-1}||^2 (what a DP-aware
    optimizer corrects its second moments by; None when the stage does not state it).
    """

    pytree: Any
    step: int
    noise_variance: float | None = None


def clipped(pytree, l2_bound: float, normalization: float = 1.0) -> ClippedPytree:
    """Wrap gradients you clipped yourself, stating their L2 bound and normalization.

    Use this when the gradients did not come from opake's clipping; the noise stage takes only
    a :class:`ClippedPytree`, so the bound that scales the noise is always stated explicitly.
    Form the sum in float32 or wider even for half-precision parameters (as ``clipped_grad``
    does): a bfloat16 sum of a large batch moves by more than one example's contribution, so
    it would not have the sensitivity ``l2_bound / normalization``. The noised gradients come
    back in the noise engine's template dtypes either way.
    """
    return ClippedPytree(pytree=pytree, l2_bound=l2_bound, normalization=normalization)
