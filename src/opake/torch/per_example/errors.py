"""Errors of the per-example clipper, each a subclass of the builtin its caller expects, and its one warning."""

from __future__ import annotations

from opake.dpftrl.clipping import NonFiniteGradientError
from opake.errors import OpakeError

__all__ = [
    "BatchDimensionError", "ClipperUsageError", "CompiledModuleError", "FallbackWarning", "NonFiniteGradientError", "UnhookedUseError",
    "UnsupportedModuleError",
]


class UnsupportedModuleError(OpakeError, ValueError):
    """A module of the model cannot be clipped per example (it mixes examples, or no rule fits)."""


class ClipperUsageError(OpakeError, RuntimeError):
    """The clipper was used out of order (no backward pass, a layer called outside the model)."""


class CompiledModuleError(OpakeError, RuntimeError):
    """A compiled call (``torch.compile``, ``module.compile()``, ``torch.export``) of a module whose
    gradients are clipped per example; refused before it computes anything."""


class BatchDimensionError(OpakeError, RuntimeError):
    """A hooked layer saw a leading dimension other than the batch size of the forward pass."""


class UnhookedUseError(OpakeError, RuntimeError):
    """A trainable parameter got gradient from a use the per-example hooks did not see."""


class FallbackWarning(UserWarning):
    """Layers without a closed-form rule take the slower torch.func fallback (the message says its cost)."""
