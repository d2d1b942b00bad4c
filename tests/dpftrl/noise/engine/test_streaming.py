"""Streaming inverses: the engine core runs any of them; each matches a dense solve."""

from __future__ import annotations

from dataclasses import dataclass, field

import mpmath
import numpy as np
import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine.streaming import (
    BandedInverse,
    BufferedInverse,
    IdentityInverse,
    inverse_from_description,
    renormalization_periods,
    streaming_inverse,
)
from opake.dpftrl.participation import Participation
from opake.random import key
from engine_support import HandRecipe, dense_blt_matrix, dense_inverse_apply, hand_blt, run_noise


@dataclass(frozen=True, eq=False)
class BandedMechanism:
    """What a resolved BandMF mechanism will offer the engine: its first column ``coefs``."""

    coefs: tuple
    participation: Participation
    theta: np.ndarray = field(default_factory=lambda: np.zeros(0))
    omega: np.ndarray = field(default_factory=lambda: np.zeros(0))
    fingerprint: str = "banded-test"

    def streaming_description(self) -> dict:
        return {"kind": "banded", "coefs": list(self.coefs)}

    def noise_row_norms_squared(self) -> np.ndarray:
        inverse = np.linalg.inv(_dense_banded(self.coefs, self.participation.n_steps))
        return (inverse ** 2).sum(axis=1)


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


def test_blt_step_scalars_keep_a_decay_within_2_to_the_minus_30_of_one():
    # theta = 1 - 2**-30 is 1.0 in float32; the scalars come from log1p(-(1 - theta)) in float64,
    # so after 999 steps the read weight omega * theta**999 still shows the decay in float32.
    inverse = BufferedInverse((0.5, 0.25), (2.0**-30, 0.75))
    read, renormalize, add = inverse.at_step(inverse.coefficients(torch.float32, torch.device("cpu")), 1000)
    mpmath.mp.dps = 50
    theta = 1 - mpmath.mpf(2) ** -30
    expected_read = float(np.float32(float(mpmath.mpf("0.5") * theta**999)))
    assert read[0].item() == expected_read and expected_read < 0.5
    # theta = 0.25: period floor(32 / 2) = 16; step 1000 = 62 * 16 + 8 is inside an epoch.
    assert renormalize == ()
    assert read[1].item() == float(np.float32(0.25 * 0.25**7))
    assert add[1, 0].item() == float(np.float32(0.25**-8))
    assert add[0, 0].item() == float(np.float32(float(theta**-1000)))


def test_renormalization_periods_hand_values_and_growth_bound():
    one_minus_theta = np.array([0.5, 0.75, 1.0, 0.0, 2.0**-6, 2.0**-30])
    periods = renormalization_periods(one_minus_theta)
    assert periods[:4].tolist() == [32, 16, 1, np.iinfo(np.int64).max]
    mpmath.mp.dps = 50
    for one_minus, period in zip(one_minus_theta[4:], periods[4:]):
        theta = 1 - mpmath.mpf(one_minus)
        # The largest K with theta**-K <= 2**32 (the stored values grow at most 2**32).
        assert theta ** -int(period) <= 2**32 < theta ** -(int(period) + 1)


def test_blt_step_scalars_at_epoch_boundaries():
    # theta = 0.5 (period 32) and theta = 0 (period 1, renormalized to zero every step).
    inverse = BufferedInverse((0.25, 0.125), (0.5, 1.0))
    coefficients = inverse.coefficients(torch.float64, torch.device("cpu"))
    read, renormalize, add = inverse.at_step(coefficients, 0)
    assert read.tolist() == [0.25, 0.125] and renormalize == () and add.flatten().tolist() == [1.0, 1.0]
    # Powers come from exp(k log theta) in float64: within a few ulps of the exact values.
    close = dict(rel=1e-14, abs=0)
    read, renormalize, add = inverse.at_step(coefficients, 31)
    assert read.tolist() == pytest.approx([0.25 * 0.5**30, 0.125], **close) and renormalize == ((1, 0.0),)
    assert add.flatten().tolist() == pytest.approx([2.0**31, 1.0], **close)
    read, renormalize, add = inverse.at_step(coefficients, 32)
    assert read.tolist() == pytest.approx([0.25 * 0.5**31, 0.125], **close)
    assert [row for row, _ in renormalize] == [0, 1]
    assert [factor for _, factor in renormalize] == pytest.approx([0.5**32, 0.0], **close)
    assert add.flatten().tolist() == [1.0, 1.0]


def test_float64_stream_matches_the_dense_solve_across_many_renormalizations():
    # Periods 32, 16, 1 and one longer than the run, over 150 steps: every kind of epoch
    # boundary, and a buffer whose stored values grow by theta**-149 unrenormalized, in float64.
    recipe = HandRecipe((0.25, 0.125, 0.0625, 0.03125), (0.5, 0.75, 1.0, 2.0**-6))
    n, template = 150, {"w": torch.zeros(6, dtype=torch.float64)}
    periods = renormalization_periods(recipe.one_minus_theta)
    assert periods[:3].tolist() == [32, 16, 1] and periods[3] > n
    noise_fn, state = mf_gaussian_noise(template, recipe, n_steps=n, noise_multiplier=1.0, key=key(4),
                                        dtype=torch.float64)
    noise, _ = run_noise(noise_fn, state, template, n)
    identity_fn, identity_state = mf_gaussian_noise(template, identity_strategy(), n_steps=n, noise_multiplier=1.0,
                                                    key=key(4), dtype=torch.float64)
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    exact = dense_inverse_apply(dense_blt_matrix(recipe.omega, recipe.one_minus_theta, n), draws)
    np.testing.assert_allclose(noise, exact, rtol=1e-12, atol=1e-12 * np.abs(exact).max())


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
