"""Argument checks shared by every layer: one wording for the same mistake everywhere."""

from __future__ import annotations

import math
import numbers

from opake.errors import InvalidArgumentError, InvalidTypeError


def real_number(name: str, value) -> float:
    """``value`` as a float, or a TypeError naming ``name`` (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def positive_finite(name: str, value, advice: str = "") -> float:
    """``value`` as a finite float > 0, or a ValueError/TypeError naming ``name``."""
    number = real_number(name, value)
    if not (math.isfinite(number) and number > 0.0):
        raise InvalidArgumentError(f"{name} must be finite and > 0, got {value!r}" + (f"; {advice}" if advice else ""))
    return number


def integer_at_least(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: a TypeError for a non-integer (bools included), a
    ValueError naming ``name`` for one below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidTypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value
