"""Errors of SGD's parameter trajectory (workload W = S D_eta M) against torch.optim.SGD itself.

The oracle (dense.torch_sgd_trajectory_matrix) runs torch's SGD on unit gradients to read off
W column by column, so the first-step rule of the momentum buffer, dampening, Nesterov and the
per-step learning rate are torch's, not a transcription of opake's formulas. Dense solves with
n <= 300 are accurate to ~1e-13; RTOL = 1e-10 (relative to the largest row, since single rows
can be tiny) catches any slip in a weight or an exponent.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dense
from opake.dpftrl.strategies import blt, blt_strategy, blt_workload
from opake.dpftrl.strategies.blt_optimize import optimize
from opake.dpftrl.participation import Participation

RTOL = 1e-10


def _random_blt(rng, max_buffers=4):
    b = int(rng.integers(1, max_buffers + 1))
    theta = np.sort(1.0 - 10.0 ** (-rng.uniform(0.1, 4.0, b)))
    omega = rng.uniform(0.1, 1.0, b)
    omega *= rng.uniform(0.1, 0.95) / omega.sum()
    return blt.BLTParams(theta, omega)


def _oracle(params, n, workload, schedule):
    c = dense.lower_toeplitz(dense.blt_coefs(params.theta, params.omega, n))
    w = dense.torch_sgd_trajectory_matrix(n, workload.momentum, workload.dampening, workload.nesterov, schedule)
    return dense.per_query_errors_of(w, c)


def _check(params, n, workload, schedule, rtol=RTOL):
    want = _oracle(params, n, workload, schedule)
    got = blt_workload.parameter_per_query_errors(params, n, workload, schedule)
    scale = want.max()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)
    for error, value in (("max", want.max()), ("mean", want.mean())):
        assert blt_workload.parameter_error(params, n, workload, error, schedule) == pytest.approx(value, rel=rtol)


SGD_SETTINGS = [
    (0.0, 0.0, False), (0.0, 0.5, False),  # torch ignores dampening without momentum
    (0.5, 0.0, False), (0.9, 0.0, False), (0.99, 0.0, False),
    (0.9, 0.3, False), (0.5, 1.0, False), (0.99, 0.7, False),
    (0.5, 0.0, True), (0.9, 0.0, True), (0.99, 0.0, True),
]


@pytest.mark.parametrize("momentum, dampening, nesterov", SGD_SETTINGS)
@pytest.mark.parametrize("schedule_kind", ["constant", "unit", "cosine", "step-decay"])
def test_per_query_errors_match_torch_sgd(momentum, dampening, nesterov, schedule_kind):
    # (a seed of the case's text: hash() of a str changes with every interpreter, PYTHONHASHSEED)
    rng = np.random.default_rng(zlib.crc32(repr((momentum, dampening, nesterov, schedule_kind)).encode()))
    workload = blt_workload.ParameterWorkload(momentum, dampening, nesterov)
    for n in (1, 2, 7, 60, 300):
        params = _random_blt(rng)
        t = np.arange(n)
        schedule = {
            "constant": None,
            "unit": np.ones(n),  # the scheduled recurrence with eta = 1 == the closed form
            "cosine": 0.05 + 0.5 * (1 + np.cos(np.pi * t / n)),
            "step-decay": 0.3 * 0.5 ** (t // max(1, n // 3)),
        }[schedule_kind]
        _check(params, n, workload, schedule)


@given(st.integers(0, 2**32 - 1), st.integers(1, 25), st.sampled_from(SGD_SETTINGS), st.booleans())
def test_per_query_errors_match_torch_sgd_hypothesis(seed, n, setting, scheduled):
    rng = np.random.default_rng(seed)
    schedule = rng.uniform(0.01, 3.0, n) if scheduled else None
    _check(_random_blt(rng), n, blt_workload.ParameterWorkload(*setting), schedule)


@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_inverse_decay_near_the_momentum(momentum):
    # theta_hat = beta is a double pole of the partial fractions; 1e-6 apart, the rows keep
    # ~eps / gap = 1e-10 and the public max/mean fall back to them (the double sums would lose
    # ~eps / gap^2 = 1e-5), hence rtol 1e-9 here.
    params = blt.BLTParams([0.99], [0.99 - momentum - 1e-6])
    _check(params, 80, blt_workload.ParameterWorkload(momentum), None, rtol=1e-9)


def test_plain_sgd_with_constant_lr_is_the_prefix_sum_workload():
    params = _random_blt(np.random.default_rng(3))
    n = 500
    want = blt.per_query_errors(params, n)  # updates workload with beta = 1: prefix sums
    got = blt_workload.parameter_per_query_errors(params, n, blt_workload.ParameterWorkload(0.0))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_long_horizon_closed_form_matches_rows():
    params = blt.BLTParams(1.0 - np.array([1e-2, 1e-4, 1e-7]), np.array([0.3, 0.1, 0.01]))
    n = 100_000
    for workload in (blt_workload.ParameterWorkload(0.9), blt_workload.ParameterWorkload(0.9, nesterov=True),
                     blt_workload.ParameterWorkload(0.99, 0.5)):
        rows = blt_workload.parameter_per_query_errors(params, n, workload)
        scheduled = blt_workload.parameter_per_query_errors(params, n, workload, np.ones(n))
        np.testing.assert_allclose(scheduled, rows, rtol=1e-9)
        assert blt_workload.parameter_error(params, n, workload, "max") == pytest.approx(rows.max(), rel=1e-10)
        assert blt_workload.parameter_error(params, n, workload, "mean") == pytest.approx(rows.mean(), rel=1e-10)


# ---------------------------------------------------------------------------------------------
# The recipe


def test_default_recipe_unchanged():
    recipe = blt_strategy()
    assert recipe.workload == "updates" and recipe.momentum == 1.0 and recipe.parameter_workload is None
    assert repr(recipe) == "BLTStrategy(max_buffers=10, error='max', momentum=1.0, lr_schedule=None)"
    mech = recipe.resolve(1000, 1, 1)
    direct = optimize(Participation(1000, 1, 1), error="max", max_buffers=10, momentum=1.0)
    assert np.array_equal(mech.theta, direct.params.theta) and np.array_equal(mech.omega, direct.params.omega)


def test_schedule_repr_is_full_when_short_and_a_digest_when_long():
    short = blt_strategy(workload="parameters", momentum=0.9, lr_schedule=[0.5, 0.25, 0.125])
    assert "lr_schedule=(0.5, 0.25, 0.125)" in repr(short)   # as before: earlier fingerprints stay
    eta = np.linspace(1.0, 0.01, 1000)
    long = blt_strategy(workload="parameters", momentum=0.9, lr_schedule=eta)
    assert isinstance(long.lr_schedule, tuple) and all(type(v) is float for v in long.lr_schedule[:3])
    assert long.lr_schedule == tuple(float(v) for v in eta)
    text = repr(long)
    assert "<1000 values sha256:" in text and len(text) < 300
    # the summary still depends on every value: one changed value changes the repr
    changed = eta.copy()
    changed[517] = np.nextafter(changed[517], 2.0)
    assert repr(blt_strategy(workload="parameters", momentum=0.9, lr_schedule=changed)) != text
    assert repr(blt_strategy(workload="parameters", momentum=0.9, lr_schedule=eta.copy())) == text


def test_workload_fields_take_part_in_equality_and_fingerprint():
    base = blt_strategy(max_buffers=2, workload="parameters", momentum=0.9)
    others = [blt_strategy(max_buffers=2, momentum=0.9),
              blt_strategy(max_buffers=2, workload="parameters", momentum=0.9, dampening=0.1),
              blt_strategy(max_buffers=2, workload="parameters", momentum=0.9, nesterov=True)]
    assert base == blt_strategy(max_buffers=2, workload="parameters", momentum=0.9)
    mech = base.resolve(50, 1, 1)
    for other in others:
        assert other != base and hash(other) != hash(base)
        assert other.resolve(50, 1, 1).fingerprint != mech.fingerprint


def test_resolved_parameters_workload_matches_torch_oracle():
    n = 40
    schedule = tuple(0.1 * 0.97 ** np.arange(n))
    mech = blt_strategy(max_buffers=3, workload="parameters", momentum=0.9, dampening=0.2,
                        lr_schedule=schedule).resolve(n, 1, 1)
    params = blt.BLTParams(mech.theta, mech.omega)
    rows = _oracle(params, n, blt_workload.ParameterWorkload(0.9, 0.2), np.asarray(schedule))
    sens2 = mech.sensitivity ** 2
    assert mech.max_loss == pytest.approx(sens2 * rows.max(), rel=1e-10)
    assert mech.mean_loss == pytest.approx(sens2 * rows.mean(), rel=1e-10)


@pytest.mark.parametrize("schedule", [None, "decay"])
def test_optimizing_the_parameter_workload_beats_the_updates_workload_on_it(schedule):
    n = 2000
    eta = None if schedule is None else tuple(np.linspace(1.0, 0.1, n))
    workload = blt_workload.ParameterWorkload(0.9)
    for_params = blt_strategy(workload="parameters", momentum=0.9, lr_schedule=eta).resolve(n, 1, 1)
    for_updates = blt_strategy(momentum=0.9, lr_schedule=eta).resolve(n, 1, 1)

    def loss(mech):
        params = blt.BLTParams(mech.theta, mech.omega)
        return mech.sensitivity ** 2 * blt_workload.parameter_error(params, n, workload, "max", eta)

    assert loss(for_params) == pytest.approx(for_params.max_loss, rel=1e-10)
    assert loss(for_params) < 0.9 * loss(for_updates)


@pytest.mark.parametrize("kwargs, message", [
    (dict(workload="parameters"), r"momentum=1.0.*momentum=0.0 for plain SGD"),
    (dict(workload="parameters", momentum=-0.1), r"momentum must be a number in \[0, 1\)"),
    (dict(workload="parameters", momentum=1.5), r"momentum must be a number in \[0, 1\)"),
    (dict(workload="parameters", momentum=float("nan")), r"momentum must be a number in \[0, 1\)"),
    (dict(workload="parameters", momentum=0.9, dampening=-0.1), r"dampening must be a number in \[0, 1\]"),
    (dict(workload="parameters", momentum=0.9, dampening=1.1), r"dampening must be a number in \[0, 1\]"),
    (dict(workload="parameters", momentum=0.0, nesterov=True), r"Nesterov.*momentum > 0"),
    (dict(workload="parameters", momentum=0.9, dampening=0.1, nesterov=True), r"Nesterov.*dampening = 0"),
    (dict(momentum=0.9, dampening=0.1), r"workload='parameters' only"),
    (dict(momentum=0.9, nesterov=True), r"workload='parameters' only"),
    (dict(workload="params"), r"workload must be one of"),
])
def test_bad_recipes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        blt_strategy(**kwargs)


@pytest.mark.parametrize("schedule, message", [
    ((1.0, 0.5), r"expected 5 values"),
    ((1.0, 0.5, 0.0, 0.1, 0.1), r"finite and > 0"),
    ((1.0, 0.5, -1.0, 0.1, 0.1), r"finite and > 0"),
])
def test_bad_schedules_are_refused(schedule, message):
    with pytest.raises(ValueError, match=rf"lr_schedule.*{message}|{message}"):
        blt_strategy(workload="parameters", momentum=0.9, lr_schedule=schedule).resolve(5, 1, 1)
    with pytest.raises(ValueError, match=rf"lr_schedule.*{message}|{message}"):
        blt_workload.parameter_per_query_errors(blt.BLTParams([0.5], [0.3]), 5, blt_workload.ParameterWorkload(0.9),
                                       np.asarray(schedule))
