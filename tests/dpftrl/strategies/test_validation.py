"""Argument validation of strategy recipes (no optimizer output is checked here).

Every bad input must fail fast with a ValueError (or TypeError) whose message names the
argument; `resolve` must validate the schedule and the participation context before it starts
optimizing. The identity strategy's numbers are checked against hand formulas.
"""

import math

import numpy as np
import pytest

from opake.dpftrl.strategies import blt, blt_strategy, identity_strategy
from opake.dpftrl.strategies.strategy import mechanism_from_blt
from opake.dpftrl.participation import Participation


@pytest.mark.parametrize("max_buffers", [0, -1, 21, 100, 2.0, 2.5, "3", None, True])
def test_max_buffers_outside_1_to_20_or_not_an_int(max_buffers):
    with pytest.raises(ValueError, match=r"max_buffers"):
        blt_strategy(max_buffers=max_buffers)


@pytest.mark.parametrize("max_buffers", [1, 10, 20, np.int64(7)])
def test_max_buffers_in_range_is_accepted(max_buffers):
    assert blt_strategy(max_buffers=max_buffers).max_buffers == int(max_buffers)


@pytest.mark.parametrize("error", ["MAX", "average", "", None, 1])
def test_unknown_error_kind(error):
    with pytest.raises(ValueError, match=r"error"):
        blt_strategy(error=error)


@pytest.mark.parametrize("momentum", [0.0, -0.5, 1.0000001, 2.0, float("nan"), float("inf"), "0.9", None, True])
def test_momentum_outside_0_1(momentum):
    with pytest.raises(ValueError, match=r"momentum"):
        blt_strategy(momentum=momentum)


@pytest.mark.parametrize("momentum", [1e-6, 0.5, 0.9, 1.0, 1])
def test_momentum_in_range_is_accepted(momentum):
    assert blt_strategy(momentum=momentum).momentum == float(momentum)


N = 8


@pytest.mark.parametrize(
    "schedule",
    [
        [1.0] * (N - 1),  # too short
        [1.0] * (N + 1),  # too long
        [1.0] * (N - 1) + [float("nan")],
        [1.0] * (N - 1) + [float("inf")],
        [1.0] * (N - 1) + [0.0],
        [1.0] * (N - 1) + [-0.1],
        [[1.0] * N],  # 2-D
        [],
        ["a"] * N,
        lambda t: 1.0 if t < N - 1 else 0.0,  # callable: non-positive at the last step
        lambda t: float("nan") if t == 3 else 1.0,
        lambda t: -1.0,
        lambda t: "fast",
    ],
    ids=[
        "short", "long", "nan", "inf", "zero", "negative", "2d", "empty", "strings",
        "callable-zero", "callable-nan", "callable-negative", "callable-string",
    ],
)
def test_bad_lr_schedule_is_rejected_before_optimizing(schedule):
    # Either the recipe or resolve may reject it; neither may start the optimizer.
    with pytest.raises(ValueError, match=r"lr_schedule"):
        blt_strategy(lr_schedule=schedule).resolve(N)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        ((0,), ValueError, r"n_steps"),
        ((10, 0), ValueError, r"min_sep"),
        ((10, 11), ValueError, r"min_sep"),
        ((10, 2, 0), ValueError, r"max_participations"),
        ((10.0,), TypeError, r"n_steps"),
        ((10, True), TypeError, r"min_sep"),
    ],
)
def test_resolve_rejects_a_bad_participation_context(args, error, pattern):
    with pytest.raises(error, match=pattern):
        blt_strategy().resolve(*args)


def test_sequence_schedule_is_stored_as_a_tuple_and_takes_part_in_equality():
    a = blt_strategy(lr_schedule=np.array([1.0, 0.75, 0.5, 0.25, 0.125]))
    b = blt_strategy(lr_schedule=[1.0, 0.75, 0.5, 0.25, 0.125])
    assert isinstance(a.lr_schedule, tuple)
    assert a == b and hash(a) == hash(b)
    assert a != blt_strategy(lr_schedule=[1.0, 0.75, 0.5, 0.25, 0.25])


@pytest.mark.parametrize("n, b, k", [(1, 1, None), (10, 1, None), (10, 3, None), (10, 3, 2), (50, 7, 1)])
def test_identity_strategy_matches_hand_formulas(n, b, k):
    # C = I: sens^2 = k' (k' disjoint unit columns); prefix-sum errors e_t = t + 1.
    mech = identity_strategy().resolve(n, b, k)
    kp = min(k if k is not None else n, -(-n // b))
    assert mech.num_buffers == 0
    assert mech.sensitivity == pytest.approx(math.sqrt(kp), rel=1e-15)
    assert mech.max_loss == pytest.approx(kp * n, rel=1e-15)
    assert mech.mean_loss == pytest.approx(kp * (n + 1) / 2, rel=1e-15)


@pytest.mark.parametrize(
    "theta, omega",
    [([1.2], [0.5]), ([-0.1], [0.5]), ([0.5], [-0.1]), ([0.5, 0.6], [0.6, 0.5])],
    ids=["theta>1", "theta<0", "omega<0", "sum(omega)>1"],
)
def test_mechanism_from_blt_rejects_parameters_outside_the_preconditions(theta, omega):
    with pytest.raises(ValueError):
        mechanism_from_blt(blt.BLTParams(np.array(theta), np.array(omega)), Participation(10, 2))
