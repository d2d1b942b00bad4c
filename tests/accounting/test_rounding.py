"""delta_at(epsilon_at(d)) <= d exactly in floats, for every privacy process opake offers.

An inversion that lands a few ulps below the root certifies less than it claims: the Renyi
branch of the amplified balls-in-bins bound did (up to 9.3e-15 relative) before epsilon_at
rounded up through ``opake.accounting.process.certified_epsilon``. Each process is checked over
many deltas (hypothesis, the suite's fixed profile) and over a fixed sweep, including the
deltas at which the old Renyi branch failed.
"""

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opake.accounting as acc
import opake.dpftrl.accounting as dpftrl_acc
from opake.accounting.process import certified_epsilon
from opake.dpftrl.noise import blt_strategy, identity_strategy

BLT = blt_strategy(max_buffers=2)


@functools.lru_cache(maxsize=None)
def process(name):
    inner = dpftrl_acc.mf_gaussian
    if name == "gaussian":
        return acc.gaussian(1.3)
    if name == "mf_gaussian":
        return inner(1.0, identity_strategy(), n_steps=50, min_sep=10, max_participations=5)
    if name == "balls_in_bins_rigorous":
        return dpftrl_acc.balls_in_bins(inner(1.0, identity_strategy()), 10, 50, method="rigorous")
    if name == "balls_in_bins_amplified_identity":
        return dpftrl_acc.balls_in_bins(inner(1.0, identity_strategy()), 20, 40, method="amplified")
    if name == "balls_in_bins_amplified_blt":
        return dpftrl_acc.balls_in_bins(inner(1.5, BLT), 4, 16, method="amplified")
    if name == "balls_in_bins_allocation_pld":
        return dpftrl_acc.balls_in_bins(inner(1.0, identity_strategy()), 10, 50, method="allocation_pld")
    if name == "balls_in_bins_default_identity":
        return dpftrl_acc.balls_in_bins(inner(1.0, identity_strategy()), 10, 50)
    if name == "poisson":
        return dpftrl_acc.poisson(inner(1.0, identity_strategy()), 0.1, 50)
    if name == "monte_carlo":
        return dpftrl_acc.balls_in_bins(inner(1.0, identity_strategy()), 10, 50, method="monte_carlo",
                                        num_samples=20_000, seed=0)
    raise KeyError(name)


FAST = ["gaussian", "mf_gaussian", "balls_in_bins_rigorous", "monte_carlo"]
AMPLIFIED = ["balls_in_bins_amplified_identity", "balls_in_bins_amplified_blt"]
# slower per call (a PLD table per band, dp_accounting's PLD): a fixed list of deltas
SLOW = ["balls_in_bins_allocation_pld", "balls_in_bins_default_identity", "poisson"]


def _check(name, log_delta):
    p = process(name)
    delta = 10.0 ** log_delta
    if name == "monte_carlo" and delta < 5e-4:   # below what 20,000 samples can bound
        delta = 5e-4 + delta
    epsilon = p.epsilon_at(delta)
    assert p.delta_at(epsilon) <= delta


@pytest.mark.parametrize("name", FAST)
@given(log_delta=st.floats(min_value=-12.0, max_value=-1.5))
def test_inversion_is_certified_in_floats(name, log_delta):
    _check(name, log_delta)


@pytest.mark.parametrize("name", AMPLIFIED)
@settings(max_examples=15)
@given(log_delta=st.floats(min_value=-12.0, max_value=-1.5))
def test_inversion_is_certified_in_floats_amplified(name, log_delta):
    _check(name, log_delta)


@pytest.mark.parametrize("name", SLOW)
def test_inversion_is_certified_in_floats_slow_processes(name):
    p = process(name)
    for delta in [3e-2, 1.7e-4, 1e-5, 2.3e-7, 1e-9]:
        epsilon = p.epsilon_at(delta)
        assert p.delta_at(epsilon) <= delta


def test_the_renyi_branch_sweep():
    """The amplified bound's closed-form Renyi inversion, over a dense fixed sweep of deltas: before
    the fix 13 of these 30 had delta_at(epsilon_at(d)) > d by float rounding."""
    p = process("balls_in_bins_amplified_identity")
    for delta in np.geomspace(1e-12, 1e-2, 30):
        assert p.delta_at(p.epsilon_at(float(delta))) <= delta


def test_certified_epsilon_rounds_up_only_as_far_as_needed():
    # a curve that is <= delta exactly from x0 on, x0 not representable with the closed form
    x0 = 0.1 + 0.2
    curve = lambda eps: 1.0 if eps < x0 else 0.5  # noqa: E731
    below = math.nextafter(x0, 0.0)
    result = certified_epsilon(curve, 0.5, below - 1e-15)
    assert curve(result) <= 0.5 and result >= x0 and result - x0 < 1e-14
    assert certified_epsilon(curve, 0.5, 1.0) == 1.0              # already certified: unchanged
    assert certified_epsilon(curve, 0.5, math.inf) == math.inf
    with pytest.raises(RuntimeError, match="could not certify"):
        certified_epsilon(lambda eps: 1.0, 0.5, 0.0, upper=2.0)
