"""``are_state_dict_equal``: whether two state dicts hold the same names and close values (Opacus' name)."""

from __future__ import annotations

import torch

__all__ = ["are_state_dict_equal"]


def are_state_dict_equal(first: dict, second: dict) -> bool:
    """Whether ``first`` and ``second`` have the same names and, name by name, tensors equal within
    ``torch.allclose``'s default tolerances (the same shapes)."""
    if first.keys() != second.keys():
        return False
    return all(a.shape == b.shape and torch.allclose(a, b) for a, b in ((first[k], second[k]) for k in first))
