"""Cyclic Poisson amplification (Band23 Thm 4) for BandMF and the identity strategy."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant

from dense import lower_toeplitz
from opake.dpftrl.accounting import UnsupportedAmplificationError, mf_gaussian, poisson
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy, mf_gaussian_noise
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import CyclicPoissonSampler
from opake.random import key

GRID = 1e-3  # PLD discretization for the tests (fast); the default is 1e-4
ADVICE = "use BandMF with opake.dpftrl.accounting.poisson instead"


def _reference_epsilon(sample_rate, noise_multiplier, count, delta):
    """dp_accounting's own PLD accounting of PoissonSampled(q, Gaussian) composed ``count`` times."""
    accountant = PLDAccountant(value_discretization_interval=GRID)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), count))
    return accountant.get_epsilon(delta), accountant


@pytest.mark.parametrize("sigma, q, n", [(1.0, 0.01, 1000), (0.8, 0.05, 300), (2.0, 1.0, 50), (1.2, 0.003, 1)])
def test_identity_epsilon_equals_dp_accountings_poisson_subsampled_gaussian(sigma, q, n):
    result = poisson(mf_gaussian(sigma, identity_strategy()), q, n, value_discretization_interval=GRID)
    expected, accountant = _reference_epsilon(q, sigma, n, 1e-5)
    assert result.epsilon_at(1e-5) == pytest.approx(expected, rel=1e-6)
    assert result.delta_at(1.0) == pytest.approx(accountant.get_delta(1.0), rel=1e-6)
    assert result.compositions == n and result.num_groups == 1 and result.column_norm == 1.0
    assert result.participation == Participation(n, 1, n)


@pytest.mark.parametrize("bands, sigma, q, n", [(4, 1.5, 0.02, 200), (16, 3.0, 0.1, 1000), (7, 2.0, 0.5, 50)])
def test_band_mf_epsilon_equals_dp_accounting_with_sigma_over_column_norm(bands, sigma, q, n):
    result = poisson(mf_gaussian(sigma, band_mf_strategy(bands)), q, n, value_discretization_interval=GRID)
    # The max column norm of the dense C, from the definition.
    matrix = lower_toeplitz(result.mechanism.toeplitz_coefficients())
    column_norm = float(np.sqrt(np.max(np.sum(matrix * matrix, axis=0))))
    count = math.ceil(n / bands)
    expected, _ = _reference_epsilon(q, sigma / column_norm, count, 1e-6)
    assert result.column_norm == pytest.approx(column_norm, rel=1e-14)
    assert result.effective_noise_multiplier == pytest.approx(sigma / column_norm, rel=1e-14)
    assert result.compositions == count
    assert result.epsilon_at(1e-6) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("strategy", [identity_strategy(), band_mf_strategy(5), band_mf_strategy(20, "mean")])
def test_amplification_never_hurts_against_the_unamplified_bound(strategy):
    n, sigma = 400, 1.0
    result = poisson(mf_gaussian(sigma, strategy), 0.05, n, value_discretization_interval=GRID)
    ctx = result.participation
    unamplified = mf_gaussian(sigma, strategy, ctx.n_steps, ctx.min_sep, ctx.max_participations)
    assert unamplified.mechanism == result.mechanism
    assert result.epsilon_at(1e-5) < unamplified.epsilon_at(1e-5)


def test_full_sampling_is_the_unamplified_gaussian_up_to_the_pld_grid():
    # q = 1: n compositions of Gaussian(sigma) are one Gaussian(sigma / sqrt(n)), priced exactly.
    n, sigma = 64, 4.0
    result = poisson(mf_gaussian(sigma, identity_strategy()), 1.0, n, value_discretization_interval=GRID)
    exact = mf_gaussian(sigma, identity_strategy(), n, 1, n).epsilon_at(1e-5)
    assert exact <= result.epsilon_at(1e-5) <= exact * 1.01  # pessimistic discretization: an upper bound


def test_result_is_a_guarantee_with_a_description_and_the_dominating_event():
    result = poisson(mf_gaussian(1.0, band_mf_strategy(4)), 0.1, 40, value_discretization_interval=GRID)
    assert result.is_guarantee is True
    assert "Band23 Thm 4" in result.description and "upper bound" in result.description
    event = result.dp_event
    assert isinstance(event, dp_accounting.SelfComposedDpEvent) and event.count == 10
    assert event.event.sampling_probability == 0.1
    assert event.event.event.noise_multiplier == pytest.approx(result.effective_noise_multiplier)


# -- the sampler produces exactly the participation the accounting assumes --------------------


@pytest.mark.parametrize("bands, n", [(1, 10), (4, 30), (6, 6), (5, 23)])
def test_cyclic_poisson_sampler_guarantees_the_bound_participation(bands, n):
    strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands)
    result = poisson(mf_gaussian(1.0, strategy), 0.5, n, value_discretization_interval=GRID)
    sampler = CyclicPoissonSampler(num_examples=40, num_groups=bands, sample_rate=0.5, key=key(3))
    assert sampler.participation(n) == result.participation
    assert result.participation == Participation(n, min_sep=bands, max_participations=math.ceil(n / bands))
    # Every example appears only at steps of its own group's phase, at most ceil(n / bands) times.
    steps_of = {}
    for t in range(n):
        for example in sampler.batch(t).tolist():
            steps_of.setdefault(example, []).append(t)
    assert steps_of  # q = 0.5 over 40 examples: some are drawn
    for example, steps in steps_of.items():
        assert len({t % bands for t in steps}) == 1
        assert len(steps) <= result.compositions
        assert all(b - a >= bands for a, b in zip(steps, steps[1:]))


def test_the_noise_engine_runs_the_accounted_mechanism():
    result = poisson(mf_gaussian(1.0, band_mf_strategy(4)), 0.1, 24, value_discretization_interval=GRID)
    ctx = result.participation
    noise_fn, _ = mf_gaussian_noise({"w": torch.zeros(3)}, band_mf_strategy(4), n_steps=ctx.n_steps,
                                    noise_multiplier=1.0, key=key(1), min_sep=ctx.min_sep,
                                    max_participations=ctx.max_participations)
    assert noise_fn.mechanism.fingerprint == result.mechanism.fingerprint


# -- refusals and bad input --------------------------------------------------------------------


def test_blt_is_refused_with_the_seed_advice():
    with pytest.raises(UnsupportedAmplificationError, match=ADVICE):
        poisson(mf_gaussian(1.0, blt_strategy(max_buffers=10)), 0.01, 100)
    with pytest.raises(UnsupportedAmplificationError, match=ADVICE):
        poisson(mf_gaussian(1.0, blt_strategy()), 0.01)  # refused before n_steps is even looked at


def test_a_non_banded_strategy_is_refused():
    class Other:
        def resolve(self, n_steps, min_sep=1, max_participations=None):
            return identity_strategy().resolve(n_steps, min_sep, max_participations)

    with pytest.raises(UnsupportedAmplificationError, match="needs a banded strategy"):
        poisson(mf_gaussian(1.0, Other()), 0.1, 10)


@pytest.mark.parametrize("rate, exc, pattern", [
    (0.0, ValueError, r"sample_rate must be in \(0, 1\]"), (-0.1, ValueError, r"sample_rate must be in \(0, 1\]"),
    (1.5, ValueError, r"sample_rate must be in \(0, 1\]"), (float("nan"), ValueError, r"sample_rate must be in"),
    (True, TypeError, "sample_rate must be a real number"), ("0.1", TypeError, "sample_rate must be a real number"),
])
def test_bad_sample_rate_is_refused(rate, exc, pattern):
    with pytest.raises(exc, match=pattern):
        poisson(mf_gaussian(1.0, identity_strategy()), rate, 10)


@pytest.mark.parametrize("n, exc, pattern", [
    (None, ValueError, "n_steps is required"), (0, ValueError, "n_steps must be >= 1"),
    (2.5, TypeError, "n_steps must be an integer"),
])
def test_bad_n_steps_is_refused(n, exc, pattern):
    with pytest.raises(exc, match=pattern):
        poisson(mf_gaussian(1.0, identity_strategy()), 0.1, n)


def test_more_bands_than_steps_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"bands \(8\) must be <= n_steps \(5\)"):
        poisson(mf_gaussian(1.0, band_mf_strategy(8)), 0.1, 5)


def test_an_inner_bound_to_a_pattern_the_sampler_does_not_guarantee_is_refused():
    bound = mf_gaussian(1.0, band_mf_strategy(4), 40, 2, 20)  # min_sep 2 < bands 4
    with pytest.raises(ValueError, match="cyclic Poisson sampling with 4 group"):
        poisson(bound, 0.1, 40)
    same = mf_gaussian(1.0, band_mf_strategy(4), 40, 4, 10)
    assert poisson(same, 0.1, 40, value_discretization_interval=GRID).mechanism == same.mechanism


def test_inner_must_be_an_mf_gaussian_and_grid_must_be_positive():
    with pytest.raises(TypeError, match="inner must be an unbound mf_gaussian"):
        poisson(identity_strategy(), 0.1, 10)
    with pytest.raises(ValueError, match="value_discretization_interval must be finite and > 0"):
        poisson(mf_gaussian(1.0, identity_strategy()), 0.1, 10, value_discretization_interval=0.0)


def test_bad_delta_and_epsilon_are_refused():
    result = poisson(mf_gaussian(1.0, identity_strategy()), 0.1, 10, value_discretization_interval=GRID)
    with pytest.raises(ValueError, match="delta must be in the open interval"):
        result.epsilon_at(0.0)
    with pytest.raises(ValueError, match="epsilon must be a finite number"):
        result.delta_at(-1.0)


def test_identical_runs_share_one_composed_pld_and_any_change_gets_its_own():
    """The composed PLD is kept by (sample rate, sigma_eff, compositions, grid): a plan evaluates the
    same one many times. A kept one answers exactly what a fresh dp_accounting composition does,
    and each of the four numbers changing builds another."""
    first = poisson(mf_gaussian(1.1, band_mf_strategy(bands=2)), 0.05, 40)
    again = poisson(mf_gaussian(1.1, band_mf_strategy(bands=2)), 0.05, 40)
    assert again._accountant is first._accountant and again.epsilon_at(1e-5) == first.epsilon_at(1e-5)
    fresh = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    fresh.compose(first.dp_event)
    assert first.delta_at(2.0) == float(fresh.get_delta(2.0))
    others = [poisson(mf_gaussian(1.2, band_mf_strategy(bands=2)), 0.05, 40),
              poisson(mf_gaussian(1.1, band_mf_strategy(bands=2)), 0.06, 40),
              poisson(mf_gaussian(1.1, band_mf_strategy(bands=2)), 0.05, 42),
              poisson(mf_gaussian(1.1, band_mf_strategy(bands=2)), 0.05, 40, value_discretization_interval=1e-3)]
    assert len({id(first._accountant)} | {id(other._accountant) for other in others}) == 5
    assert all(other.delta_at(2.0) != first.delta_at(2.0) for other in others)
