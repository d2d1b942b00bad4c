"""Streaming inverses: the engine core runs any of them; each matches a dense solve."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine_streaming import (
    BandedInverse,
    BufferedInverse,
    IdentityInverse,
    inverse_from_description,
    streaming_inverse,
)
from opake.dpftrl.participation import Participation
from opake.random import key
from test_engine_support import dense_blt_matrix, dense_inverse_apply, hand_blt, run_noise


@dataclass(frozen=True, eq=False)
class BandedMechanism:
    """What a resolved BandMF mechanism will offer the engine: its first column ``coefs``."""

    coefs: tuple
    participation: Participation
    theta: np.ndarray = field(default_factory=lambda: np.zeros(0))
    omega: np.ndarray = field(default_factory=lambda: np.zeros(0))
    fingerprint: str = "banded-test"


def _dense_banded(coefs, n):
    return np.array([[coefs[t - s] if 0 <= t - s < len(coefs) else 0.0 for s in range(n)] for t in range(n)])


@pytest.mark.parametrize("coefs", [(1.0, 0.5, 0.25, 0.125), (1.0, 0.75), (2.0, -0.5, 0.25), (1.0,)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_banded_strategy_plugs_into_the_engine_and_matches_the_dense_solve(coefs, dtype, tolerance):
    n = 11
    template = {"w": torch.zeros(4, 3, dtype=dtype)}
    mechanism = BandedMechanism(coefs, Participation(n))
    noise_fn, state = mf_gaussian_noise(template, mechanism, n_steps=n, noise_multiplier=1.0, key=key(5), dtype=dtype)
    assert isinstance(noise_fn.inverse, BandedInverse) and state.buffers.shape == (len(coefs) - 1, 12)
    noise, _ = run_noise(noise_fn, state, template, n)
    identity_fn, identity_state = mf_gaussian_noise(template, identity_strategy(), n_steps=n, noise_multiplier=1.0,
                                                    key=key(5), dtype=dtype)
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    np.testing.assert_allclose(noise, dense_inverse_apply(_dense_banded(coefs, n), draws), rtol=tolerance,
                               atol=tolerance)


def test_dispatch_reads_only_plain_arrays_from_the_mechanism():
    assert isinstance(streaming_inverse(identity_strategy().resolve(5)), IdentityInverse)
    blt = streaming_inverse(hand_blt("three_buffers").resolve(5))
    assert isinstance(blt, BufferedInverse) and blt.num_buffers == 3
    assert blt.one_minus_theta == (0.5, 2.0**-6, 2.0**-12)
    assert isinstance(streaming_inverse(BandedMechanism((1.0, 0.5), Participation(5))), BandedInverse)


@pytest.mark.parametrize(
    "inverse", [IdentityInverse(), BufferedInverse((0.25, 0.125), (0.5, 2.0**-30)), BandedInverse((1.0, 0.5, 0.25))]
)
def test_descriptions_round_trip(inverse):
    assert inverse_from_description(inverse.describe()) == inverse


def test_unknown_descriptions_are_refused():
    with pytest.raises(ValueError, match="unknown streaming-inverse kind 'dense'"):
        inverse_from_description({"kind": "dense"})
    with pytest.raises(ValueError, match="not a streaming-inverse description"):
        inverse_from_description([1, 2])


def test_banded_coefficients_are_validated():
    with pytest.raises(ValueError, match="c_0 > 0"):
        BandedInverse((0.0, 0.5))
    with pytest.raises(ValueError, match="c_0 > 0"):
        BandedInverse((1.0, float("inf")))


def test_blt_coefficients_keep_one_minus_theta_exact_in_float32():
    # theta = 1 - 2**-30 is 1.0 in float32; the engine stores 1 - theta, which float32 holds exactly.
    inverse = BufferedInverse((0.5, 0.25), (2.0**-30, 0.75))
    omega, minus_one_minus_theta = inverse.coefficients(torch.float32, torch.device("cpu"))
    assert omega.tolist() == [0.5, 0.25]
    assert minus_one_minus_theta.flatten().tolist() == [-(2.0**-30), -0.75]


@pytest.mark.parametrize("name", ["near_one_decay", "three_buffers"])
def test_float32_stream_stays_accurate_over_a_long_run(name):
    # 2000 steps, decays within 2**-30 of 1 included: the float32 engine's noise stays within
    # 1e-5 (relative to the noise scale) of the exact C^{-1} z for its own float32 draws z.
    n, template = 2000, {"w": torch.zeros(32)}
    recipe = hand_blt(name)
    noise_fn, state = mf_gaussian_noise(template, recipe, n_steps=n, noise_multiplier=1.0, key=key(9))
    noise, _ = run_noise(noise_fn, state, template, n)
    identity_fn, identity_state = mf_gaussian_noise(template, identity_strategy(), n_steps=n,
                                                    noise_multiplier=1.0, key=key(9))
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    exact = dense_inverse_apply(dense_blt_matrix(recipe.omega, recipe.one_minus_theta, n), draws)
    assert np.abs(noise - exact).max() < 1e-5 * np.abs(exact).max()
