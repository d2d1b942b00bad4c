"""BandMF: recipe, exact sensitivity (brute force), losses (dense), optimizer, streaming noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.linalg import solve_triangular

from dense import (
    PatternTable,
    brute_force_sensitivity_squared,
    inverse_matrix,
    lower_toeplitz,
    per_query_errors,
)
from opake.dpftrl.noise import BandMFStrategy, band_mf_strategy, identity_strategy, mf_gaussian_noise
from opake.dpftrl.strategies import band_mf_optimize, toeplitz
from opake.dpftrl.strategies.band_mf import BandedMechanism, _resolve_band_mf, mechanism_from_coefs
from opake.dpftrl.participation import Participation
from opake.random import key
from engine_support import run_noise


def _column(mech) -> np.ndarray:
    return mech.toeplitz_coefficients()


# -- bands = 1 is the identity strategy --------------------------------------------------------


@pytest.mark.parametrize("context", [(1,), (10,), (50, 5, 3), (37, 4), (100, 1, 1), (20, 20)])
def test_one_band_is_the_identity_strategy(context):
    banded = band_mf_strategy(1).resolve(*context)
    identity = identity_strategy().resolve(*context)
    assert banded.coefs.tolist() == [1.0]
    assert banded.sensitivity == pytest.approx(identity.sensitivity, rel=1e-15)
    assert banded.max_loss == pytest.approx(identity.max_loss, rel=1e-13)
    assert banded.mean_loss == pytest.approx(identity.mean_loss, rel=1e-13)
    assert banded.state_rows == 0


# -- coefficients ------------------------------------------------------------------------------


@pytest.mark.parametrize("bands, context, error", [
    (2, (10,), "max"), (5, (30, 5), "mean"), (16, (64, 1, 1), "max"), (8, (40, 3, 4), "mean"), (12, (12, 1, 1), "max"),
])
def test_coefficients_are_unit_first_non_negative_non_increasing_and_float32_exact(bands, context, error):
    c = band_mf_strategy(bands, error).resolve(*context).coefs
    assert c.dtype == np.float64 and c.shape == (bands,)
    assert c[0] == 1.0
    assert np.all(c >= 0.0) and np.all(np.diff(c) <= 0.0)
    assert np.array_equal(c.astype(np.float32).astype(np.float64), c)
    assert not c.flags.writeable


# -- sensitivity: exact, against brute-force enumeration ---------------------------------------


@pytest.mark.parametrize("n, bands", [(6, 2), (9, 3), (11, 5), (12, 4), (12, 12), (10, 7)])
def test_sensitivity_matches_brute_force_for_every_separation_and_count(n, bands):
    recipe = band_mf_strategy(bands)
    for min_sep in (1, 2, 3, bands, n):
        if min_sep > n:
            continue
        for k in (1, 2, 3, None):
            mech = recipe.resolve(n, min_sep, k)
            matrix = lower_toeplitz(_column(mech))
            expected = brute_force_sensitivity_squared(matrix, min_sep, k)
            assert mech.sensitivity**2 == pytest.approx(expected, rel=1e-12), (min_sep, k)


@given(
    n=st.integers(1, 10),
    steps=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=9),
    min_sep=st.integers(1, 10),
    k=st.one_of(st.none(), st.integers(1, 4)),
)
def test_sensitivity_of_any_valid_band_matches_brute_force(n, steps, min_sep, k):
    # Non-negative steps give a non-increasing, non-negative band with c_0 = 1.
    steps = np.asarray(steps[: n - 1], dtype=np.float64)
    tail = np.cumsum(steps[::-1])[::-1] if steps.size else np.zeros(0)
    c = np.concatenate(([1.0], tail / (1.0 + tail[0]) if steps.size else tail))
    min_sep = min(min_sep, n)
    mech = mechanism_from_coefs(c, Participation(n, min_sep, k))
    table = PatternTable(lower_toeplitz(mech.toeplitz_coefficients()))
    assert mech.sensitivity**2 == pytest.approx(table.sensitivity_squared(min_sep, k), rel=1e-12)


def test_increasing_coefficients_are_refused_since_the_theorem_does_not_hold():
    with pytest.raises(ValueError, match="non-increasing"):
        mechanism_from_coefs([1.0, 0.5, 0.6], Participation(6, 2))
    with pytest.raises(ValueError, match="non-negative"):
        mechanism_from_coefs([1.0, -0.1], Participation(6, 2))
    with pytest.raises(ValueError, match=r"coefs\[0\] must be 1"):
        mechanism_from_coefs([2.0, 0.1], Participation(6, 2))


# -- losses against the dense matrices ---------------------------------------------------------


@pytest.mark.parametrize("bands, context, error", [
    (3, (20,), "max"), (4, (25, 4, 2), "mean"), (6, (40, 1, 1), "max"), (10, (60, 10), "mean"),
])
def test_losses_match_dense_errors_times_sensitivity(bands, context, error):
    mech = band_mf_strategy(bands, error).resolve(*context)
    matrix = lower_toeplitz(_column(mech))
    errors = per_query_errors(matrix)
    sens2 = mech.sensitivity**2
    assert mech.max_loss == pytest.approx(sens2 * errors.max(), rel=1e-10)
    assert mech.mean_loss == pytest.approx(sens2 * errors.mean(), rel=1e-10)


def test_optimized_band_beats_the_truncated_optimal_toeplitz_start_and_the_identity():
    ctx = Participation(400, 1, 1)
    for error, attr in (("max", "max_loss"), ("mean", "mean_loss")):
        mech = band_mf_strategy(20, error).resolve(ctx)
        start = band_mf_optimize.coefficients_from(band_mf_optimize.initial_steps(20))
        start_mech = mechanism_from_coefs(start, ctx)
        assert getattr(mech, attr) < getattr(start_mech, attr)
        assert getattr(mech, attr) < getattr(identity_strategy().resolve(ctx), attr)


def test_more_bands_never_hurt_and_full_band_single_participation_nears_optimal_toeplitz():
    ctx = Participation(200, 1, 1)
    losses = [band_mf_strategy(b).resolve(ctx).max_loss for b in (1, 4, 16, 64, 200)]
    assert all(a >= b * (1 - 1e-7) for a, b in zip(losses, losses[1:]))
    # The optimal Toeplitz strategy (binom(2k,k)/4^k) is a lower bound for any Toeplitz C.
    k = np.arange(1, 200, dtype=np.float64)
    s = np.concatenate(([1.0], np.cumprod((2 * k - 1) / (2 * k))))
    floor = float(np.sum(s * s)) ** 2
    assert floor * (1 - 1e-9) <= losses[-1] < floor * 1.001


def test_a_local_perturbation_does_not_improve_the_loss():
    ctx = Participation(120, 6, 3)
    mech = band_mf_strategy(8).resolve(ctx)
    rng = np.random.default_rng(0)
    for _ in range(20):
        steps = -np.diff(np.concatenate((mech.coefs, [0.0])))
        steps = np.maximum(steps * (1 + 1e-3 * rng.standard_normal(steps.shape)), 0.0)
        c = np.cumsum(steps[::-1])[::-1]
        other = mechanism_from_coefs(c / c[0], ctx)
        assert other.max_loss >= mech.max_loss * (1 - 1e-7)


# -- optimizer internals against dense references ---------------------------------------------


@pytest.mark.parametrize("n, bands", [(1, 1), (7, 3), (33, 33), (64, 5)])
def test_inverse_series_is_the_first_column_of_the_dense_inverse(n, bands):
    c = band_mf_optimize.coefficients_from(band_mf_optimize.initial_steps(bands)) * 1.5
    column = np.zeros(n)
    column[:bands] = c
    expected = inverse_matrix(lower_toeplitz(column))[:, 0]
    np.testing.assert_allclose(band_mf_optimize.inverse_series(c, n), expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("n, bands", [(2500, 3), (2500, 600), (2500, 2000), (1500, 1500)])
def test_long_inverse_series_past_the_substituted_prefix_is_the_dense_solution(n, bands):
    # past inverse_series's substituted prefix (512 terms for wide bands) Newton's doublings take
    # over, and wide bands reach beyond the prefix: checked against a dense triangular solve
    c = band_mf_optimize.coefficients_from(band_mf_optimize.initial_steps(bands)) * 1.5
    column = np.zeros(n)
    column[:bands] = c
    unit = np.zeros(n)
    unit[0] = 1.0
    expected = solve_triangular(lower_toeplitz(column), unit, lower=True)
    np.testing.assert_allclose(band_mf_optimize.inverse_series(c, n), expected, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("error", ["max", "mean"])
@pytest.mark.parametrize("context", [(30, 1, 1), (30, 4, 3), (30, 2)])
def test_loss_gradient_matches_central_differences_and_value_matches_dense(error, context):
    ctx = Participation(*context)
    rng = np.random.default_rng(1)
    steps = rng.uniform(0.05, 0.5, size=6)
    value, grad = band_mf_optimize.log_loss_and_gradient(steps, ctx, error)
    c = band_mf_optimize.coefficients_from(steps)
    column = np.zeros(ctx.n_steps)
    column[:6] = c
    matrix = lower_toeplitz(column)
    errors = per_query_errors(matrix)
    # The O(n) theorem, itself checked against brute force above (n = 30 is too long to enumerate).
    sens2 = toeplitz.minsep_sensitivity_squared(column, ctx.min_sep, ctx.max_participations)
    dense_error = errors.max() if error == "max" else errors.mean()
    assert value == pytest.approx(math.log(sens2 * dense_error), rel=1e-12)
    h = 1e-6
    for j in range(6):
        e = np.zeros(6)
        e[j] = h
        fd = (band_mf_optimize.log_loss_and_gradient(steps + e, ctx, error)[0]
              - band_mf_optimize.log_loss_and_gradient(steps - e, ctx, error)[0]) / (2 * h)
        assert grad[j] == pytest.approx(fd, rel=1e-6, abs=1e-8)


# -- recipe: caching, determinism, validation --------------------------------------------------


def test_resolve_is_cached_and_deterministic():
    recipe = band_mf_strategy(6, "mean")
    first = recipe.resolve(50, 5, 2)
    assert recipe.resolve(Participation(50, 5, 2)) is first
    assert band_mf_strategy(6, "mean").resolve(50, 5, 2) is first
    _resolve_band_mf.cache_clear()
    again = recipe.resolve(50, 5, 2)
    assert again is not first and again == first and np.array_equal(again.coefs, first.coefs)
    assert again.fingerprint == first.fingerprint


def test_recipes_are_frozen_hashable_values_and_mechanisms_differ_by_coefficients():
    assert band_mf_strategy(4) == BandMFStrategy(4, "max") and hash(band_mf_strategy(4)) == hash(BandMFStrategy(4))
    assert band_mf_strategy(4) != band_mf_strategy(4, "mean")
    a = band_mf_strategy(4).resolve(30, 3)
    b = band_mf_strategy(5).resolve(30, 3)
    assert isinstance(a, BandedMechanism) and a != b and a.fingerprint != b.fingerprint
    assert a.num_buffers == 0 and a.theta.size == 0 and a.omega.size == 0
    with pytest.raises(AttributeError):
        a.coefs = np.ones(4)


@pytest.mark.parametrize("bands, exc, pattern", [
    (0, ValueError, r"bands must be >= 1"), (-2, ValueError, r"bands must be >= 1"),
    (1.5, TypeError, r"bands must be an integer"), (True, TypeError, r"bands must be an integer"),
    ("4", TypeError, r"bands must be an integer"),
])
def test_bad_bands_are_refused(bands, exc, pattern):
    with pytest.raises(exc, match=pattern):
        band_mf_strategy(bands)


def test_bad_error_and_bands_beyond_the_horizon_are_refused():
    with pytest.raises(ValueError, match=r"error must be one of \('max', 'mean'\)"):
        band_mf_strategy(3, error="median")
    with pytest.raises(ValueError, match=r"bands \(9\) must be <= n_steps \(8\)"):
        band_mf_strategy(9).resolve(8)


# -- streaming through the noise engine --------------------------------------------------------

TEMPLATE = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}


@pytest.mark.parametrize("bands, context", [(1, (7,)), (3, (9, 3)), (5, (11, 1, 1)), (9, (9,))])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_streamed_noise_equals_dense_inverse_times_the_same_draws(bands, context, dtype, tolerance):
    n = context[0]
    sigma, l2_bound, normalization = 1.3, 0.5, 2.0
    rest = dict(zip(("min_sep", "max_participations"), context[1:]))
    recipe = band_mf_strategy(bands)
    template = {name: leaf.to(dtype) for name, leaf in TEMPLATE.items()}  # outputs at full precision
    noise_fn, state = mf_gaussian_noise(template, recipe, n_steps=n, noise_multiplier=sigma, key=key(11),
                                        dtype=dtype, **rest)
    assert tuple(state.buffers.shape) == (bands - 1, 8)
    assert noise_fn.mechanism is recipe.resolve(*context)
    noise, _ = run_noise(noise_fn, state, template, n, l2_bound=l2_bound, normalization=normalization)
    # Z: the same key through the identity strategy, which adds exactly 1.0 * z.
    identity_fn, identity_state = mf_gaussian_noise(template, identity_strategy(), n_steps=n, noise_multiplier=1.0,
                                                    key=key(11), dtype=dtype)
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    matrix = lower_toeplitz(noise_fn.mechanism.toeplitz_coefficients())
    expected = sigma * l2_bound / normalization * (inverse_matrix(matrix) @ draws)
    np.testing.assert_allclose(noise, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


# ---------------------------------------------------------------------------------------------
# Long resolutions announce themselves (the threshold is lowered here to keep the test fast)


def test_a_long_resolution_warns_with_its_expected_cost(monkeypatch):
    import warnings

    from opake.dpftrl.strategies import band_mf

    monkeypatch.setattr(band_mf, "SLOW_RESOLUTION_STEPS", 250)
    strategy = band_mf.band_mf_strategy(bands=3)
    with pytest.warns(band_mf.SlowResolutionWarning,
                      match=r"band_mf_strategy\(bands=3\) for n_steps=257 .* evaluation .*expect about \d+ to \d+ s") as record:
        strategy.resolve(257, 3)
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.resolve(257, 3)  # cached: no second warning
        strategy.resolve(249, 3)  # below the threshold
        band_mf.band_mf_strategy(bands=1).resolve(300)  # bands = 1 has nothing to optimize

