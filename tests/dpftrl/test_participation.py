"""Participation: validation, k' = min(k, ceil(n/b)), immutability and equality."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from opake.dpftrl.participation import Participation


def test_defaults_are_every_step_allowed():
    p = Participation(10)
    assert (p.n_steps, p.min_sep, p.max_participations) == (10, 1, None)
    assert p.effective_participations == 10  # b = 1, k = None: every step


@pytest.mark.parametrize(
    "n, b, k, expected",
    [
        (10, 1, None, 10),
        (10, 3, None, 4),  # steps 0, 3, 6, 9
        (10, 4, None, 3),  # steps 0, 4, 8
        (10, 10, None, 1),
        (10, 3, 2, 2),
        (10, 3, 4, 4),
        (10, 3, 99, 4),  # k beyond what the separation allows is clipped
        (1, 1, None, 1),
        (1, 1, 5, 1),
        (5000, 100, 5, 5),
        (5000, 100, None, 50),
        (5001, 100, None, 51),
    ],
)
def test_effective_participations_table(n, b, k, expected):
    assert Participation(n, b, k).effective_participations == expected


@given(n=st.integers(1, 500), data=st.data())
def test_effective_participations_is_the_largest_feasible_pattern(n, data):
    b = data.draw(st.integers(1, n))
    k = data.draw(st.one_of(st.none(), st.integers(1, 600)))
    p = Participation(n, b, k)
    kp = p.effective_participations
    # The densest pattern 0, b, 2b, ... fits exactly floor((n - 1) / b) + 1 steps.
    most = (n - 1) // b + 1
    assert kp == (most if k is None else min(k, most))
    assert p.is_single == (kp == 1)


def test_numpy_integers_are_accepted_and_normalized():
    p = Participation(np.int64(20), np.int32(5), np.int16(2))
    assert p == Participation(20, 5, 2)
    assert type(p.n_steps) is int and type(p.min_sep) is int and type(p.max_participations) is int


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(n_steps=0), r"n_steps"),
        (dict(n_steps=-3), r"n_steps"),
        (dict(n_steps=10, min_sep=0), r"min_sep"),
        (dict(n_steps=10, min_sep=-1), r"min_sep"),
        (dict(n_steps=10, min_sep=11), r"min_sep"),
        (dict(n_steps=10, max_participations=0), r"max_participations"),
        (dict(n_steps=10, max_participations=-2), r"max_participations"),
    ],
)
def test_out_of_range_values_raise_value_error_naming_the_argument(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Participation(**kwargs)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(n_steps=True), r"n_steps"),
        (dict(n_steps=10.0), r"n_steps"),
        (dict(n_steps="10"), r"n_steps"),
        (dict(n_steps=10, min_sep=False), r"min_sep"),
        (dict(n_steps=10, min_sep=2.0), r"min_sep"),
        (dict(n_steps=10, max_participations=True), r"max_participations"),
        (dict(n_steps=10, max_participations=1.5), r"max_participations"),
    ],
)
def test_bools_floats_and_strings_raise_type_error_naming_the_argument(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        Participation(**kwargs)


def test_frozen_hashable_and_compared_by_value():
    p = Participation(100, 10, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n_steps = 5
    assert p == Participation(100, 10, 3)
    assert hash(p) == hash(Participation(100, 10, 3))
    assert p != Participation(100, 10, None)
    assert len({p, Participation(100, 10, 3), Participation(100, 10, 4)}) == 2


def test_str_names_every_field_and_k_prime():
    text = str(Participation(10, 3, None))
    for part in ("n_steps=10", "min_sep=3", "max_participations=None", "4"):
        assert part in text
