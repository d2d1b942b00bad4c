"""``ModuleValidator``: Opacus' model checks and fixes, as opake's ``validate_model`` / ``fix_model``.

``validate(module, strict=False)`` lists what per-example clipping cannot handle (errors, one a
layer; ``strict=True`` raises one naming them all, the list at its ``errors``),
``is_valid(module)``, ``fix(module)`` returns a fixed copy (BatchNorm to GroupNorm, recurrent
layers to opake's, same weights), ``fix_and_validate``.
"""

from __future__ import annotations

from torch import nn

from opake.torch.validation import ModelValidationError, fix_model, require_valid_model, validate_model

__all__ = ["ModuleValidator"]


class ModuleValidator:
    """Opacus' ``ModuleValidator`` calls (module docstring)."""

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list:
        """One ``ModelValidationError`` (a ``ValueError``) a layer per-example clipping cannot handle, as
        Opacus returns its errors; ``strict=True`` raises one naming them all, the list at ``.errors``."""
        errors = [ModelValidationError(problem) for problem in validate_model(module)]
        if strict and errors:
            try:
                require_valid_model(module)
            except ModelValidationError as error:
                error.errors = errors
                raise
        return errors

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        return not validate_model(module)

    @staticmethod
    def fix(module: nn.Module, **options) -> nn.Module:
        """A fixed copy (``fix_model``; ``max_groups=`` for GroupNorm's group count)."""
        return fix_model(module, **options)

    @staticmethod
    def fix_and_validate(module: nn.Module) -> nn.Module:
        fixed = fix_model(module)
        require_valid_model(fixed)
        return fixed
