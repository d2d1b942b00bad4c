"""opake.types: ClippedPytree / NoisedPytree / clipped()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from opake.types import ClippedPytree, NoisedPytree, clipped


def test_clipped_wraps_a_pytree_with_its_bound_and_normalization():
    grads = {"w": torch.ones(3), "layers": [torch.zeros(2), (torch.ones(1),)]}
    wrapped = clipped(grads, 0.5, normalization=4)
    assert isinstance(wrapped, ClippedPytree)
    assert wrapped.pytree is grads and wrapped.l2_bound == 0.5 and wrapped.normalization == 4.0
    assert isinstance(wrapped.normalization, float)
    assert wrapped.sensitivity == 0.125
    assert clipped(torch.ones(2), 1.0).normalization == 1.0


@pytest.mark.parametrize("name, value", [("l2_bound", 0.0), ("l2_bound", -1.0), ("l2_bound", float("inf")),
                                         ("l2_bound", float("nan")), ("normalization", 0.0),
                                         ("normalization", float("inf"))])
def test_bounds_must_be_positive_and_finite(name, value):
    arguments = {"l2_bound": 1.0, "normalization": 1.0, name: value}
    with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
        clipped(torch.ones(2), **arguments)


@pytest.mark.parametrize("value", [True, "1.0", None])
def test_bounds_must_be_numbers(value):
    with pytest.raises(TypeError, match="l2_bound must be a real number"):
        clipped(torch.ones(2), value)


def test_leaves_must_be_tensors():
    with pytest.raises(TypeError, match=r"leaf at 'b' is float.*named_parameters"):
        clipped({"a": torch.ones(1), "b": 1.0}, 1.0)


def test_wrappers_are_frozen_and_distinct_types():
    wrapped = clipped(torch.ones(2), 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wrapped.l2_bound = 2.0
    noised = NoisedPytree(pytree=torch.ones(2), step=3)
    assert not isinstance(noised, ClippedPytree) and noised.step == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        noised.step = 4
