"""BandMF: recipe, exact sensitivity (brute force), losses (dense), optimizer, streaming noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.linalg import solve_triangular

import dense
from dense import (
    PatternTable,
    brute_force_sensitivity_squared,
    inverse_matrix,
    lower_toeplitz,
    per_query_errors,
)
from opake.dpftrl.noise import BandMFStrategy, band_mf_strategy, identity_strategy, mf_gaussian_noise
from opake.dpftrl.strategies import band_mf_optimize, toeplitz
from opake.dpftrl.strategies.band_mf import BandedMechanism, _resolve_band_mf, mechanism_from_coefs, round_for_float32
from opake.dpftrl.strategies.lbfgs import minimize_until_stalled
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


# -- the fast evaluation (recursive filters, Gram matrix) against references ----------------------


def _valid_band(draw_steps):
    """A non-negative, non-increasing band with c_0 = 1 from non-negative steps."""
    c = band_mf_optimize.coefficients_from(np.asarray(draw_steps, dtype=np.float64))
    return c / c[0]


@given(
    n=st.integers(1, 11),
    steps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=11),
    min_sep=st.integers(1, 11),
    k=st.one_of(st.none(), st.integers(1, 5)),
)
def test_sensitivity_gram_gives_the_brute_force_sensitivity(n, steps, min_sep, k):
    steps = list(steps[:n])
    steps[-1] = max(steps[-1], 1e-3)  # c_0 > 0
    c = _valid_band(steps)
    bands, min_sep = c.shape[0], min(min_sep, n)
    ctx = Participation(n, min_sep, k)
    gram = band_mf_optimize.sensitivity_gram(bands, ctx)
    column = np.zeros(n)
    column[:bands] = c
    expected = brute_force_sensitivity_squared(lower_toeplitz(column), min_sep, k)
    assert c @ gram @ c == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n, bands, min_sep, k", [
    (200, 8, 8, None), (200, 8, 3, 7), (199, 16, 5, None), (64, 64, 1, 1), (300, 12, 12, 4), (97, 30, 7, 100),
    (50, 50, 50, None), (120, 9, 1, None),
])
def test_sensitivity_gram_is_the_gram_matrix_of_the_worst_pattern_map(n, bands, min_sep, k):
    # G = A^T A with column j of A the worst pattern's response to e_j (dense.py, from the definition)
    kprime = dense.effective_participations(n, min_sep, k)
    columns = []
    for j in range(bands):
        unit = np.zeros(n)
        unit[j] = 1.0
        columns.append(dense.minsep_worst_pattern_rows(unit, min_sep, kprime))
    a = np.stack(columns, axis=1)
    gram = band_mf_optimize.sensitivity_gram(bands, Participation(n, min_sep, k))
    assert np.array_equal(gram, a.T @ a)


EVALUATIONS = {
    "filter": band_mf_optimize._filtered_error_and_gradient,
    "doubling": band_mf_optimize._doubled_error_and_gradient,
    "fft": band_mf_optimize._spectral_error_and_gradient,
}


@pytest.mark.parametrize("method", sorted(EVALUATIONS))
@pytest.mark.parametrize("error", ["max", "mean"])
@pytest.mark.parametrize("n, bands", [(1, 1), (2, 1), (2, 2), (5, 5), (7, 2), (40, 3), (40, 12), (64, 64), (33, 16)])
def test_every_evaluation_matches_the_dense_errors_and_central_differences(n, bands, error, method):
    rng = np.random.default_rng(n * bands)
    c = _valid_band(rng.uniform(0.05, 0.5, size=bands))
    column = np.zeros(n)
    column[:bands] = c

    def dense_error(coefs):
        col = np.zeros(n)
        col[:bands] = coefs
        errors = per_query_errors(lower_toeplitz(col))
        return errors.max() if error == "max" else errors.mean()

    value, grad = EVALUATIONS[method](c, n, error)
    assert value == pytest.approx(dense_error(c), rel=1e-12)
    h = 1e-6
    for j in range(bands):
        e = np.zeros(bands)
        e[j] = h
        fd = (dense_error(c + e) - dense_error(c - e)) / (2 * h)
        assert grad[j] == pytest.approx(fd, rel=1e-6, abs=1e-7 * abs(value))


@pytest.mark.parametrize("error", ["max", "mean"])
@pytest.mark.parametrize("n, bands", [(3000, 2), (3000, 8), (4096, 33), (2500, 64), (700, 700)])
def test_filtered_and_spectral_evaluations_agree_on_long_horizons(n, bands, error):
    # the two independent ways of applying C^{-1} (recursive filter, FFT with Newton's iteration)
    c = band_mf_optimize.coefficients_from(band_mf_optimize.initial_steps(bands))
    c = 0.5 * c + 0.5 * np.linspace(1.0, 0.2, bands)  # flatter than the start: a slowly decaying inverse
    v1, g1 = band_mf_optimize._filtered_error_and_gradient(c, n, error)
    v2, g2 = band_mf_optimize._spectral_error_and_gradient(c, n, error)
    assert v1 == pytest.approx(v2, rel=1e-11)
    np.testing.assert_allclose(g1, g2, rtol=1e-9, atol=1e-11 * np.max(np.abs(g2)))


@given(
    steps=st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=16),
    n=st.one_of(st.integers(16, 300), st.integers(1000, 200_000)),
    error=st.sampled_from(["max", "mean"]),
)
def test_doubling_agrees_with_the_filters_on_any_valid_band_and_horizon(steps, n, error):
    # the doubling's matrix powers against the step-by-step filters, up to 2e5 steps
    c = _valid_band(steps)
    v1, g1 = band_mf_optimize._filtered_error_and_gradient(c, n, error)
    v2, g2 = band_mf_optimize._doubled_error_and_gradient(c, n, error)
    assert v2 == pytest.approx(v1, rel=1e-11)
    np.testing.assert_allclose(g2, g1, rtol=1e-9, atol=1e-10 * np.max(np.abs(g1)))


def test_doubling_on_an_optimized_near_flat_band_at_a_million_steps():
    # the 8-band optimum at n = 1e6 (cyclic Poisson, 8 groups): C's inverse rings for ~1e5 steps
    c = np.array([1.0, 0.9833368, 0.97751416, 0.97355721, 0.97002094, 0.96612958, 0.96054281, 0.94617619])
    for error in ("max", "mean"):
        v1, g1 = band_mf_optimize._filtered_error_and_gradient(c, 1_000_000, error)
        v2, g2 = band_mf_optimize._doubled_error_and_gradient(c, 1_000_000, error)
        assert v2 == pytest.approx(v1, rel=1e-11)
        np.testing.assert_allclose(g2, g1, rtol=1e-10, atol=1e-10 * np.max(np.abs(g1)))


@pytest.mark.parametrize("bands, n, method", [
    (8, 1_000_000, "doubling"), (2, 1_000_000, "doubling"), (16, 1_000_000, "doubling"), (8, 4096, "filter"),
    (2, 500, "filter"), (48, 100_000, "filter"), (48, 1_000_000, "doubling"), (65, 1_000_000, "fft"), (200, 400, "fft"),
])
def test_error_and_gradient_takes_the_cheaper_evaluation(bands, n, method, monkeypatch):
    used = []
    for name, function in EVALUATIONS.items():
        monkeypatch.setattr(band_mf_optimize, function.__name__,
                            lambda *args, name=name, function=function: used.append(name) or function(*args))
    c = band_mf_optimize.coefficients_from(band_mf_optimize.initial_steps(bands))
    band_mf_optimize.error_and_gradient(c, n, "max")
    assert used == [method]


def _reference_log_loss(steps, ctx, error):
    """The optimizer's loss as it was computed before the fast path: sensitivity from the O(n)
    worst-pattern response (``toeplitz``, value and gradient), error by FFT."""
    c = band_mf_optimize.coefficients_from(steps)
    n, b, k = ctx.n_steps, ctx.min_sep, ctx.effective_participations
    column = np.zeros(n)
    column[: c.shape[0]] = c
    u = toeplitz.worst_pattern_response(column, b, ctx.max_participations)
    sens2 = float(np.dot(u, u))
    rows = -(-n // b)
    padded = np.zeros(rows * b)
    padded[:n] = u
    r = np.cumsum(padded.reshape(rows, b)[::-1], axis=0)[::-1]
    window = r.copy()
    window[: rows - k] -= r[k:] if k < rows else 0.0
    dsens = 2.0 * window.reshape(-1)[: c.shape[0]]
    err, derr = band_mf_optimize._spectral_error_and_gradient(c, n, error)
    return math.log(sens2) + math.log(err), np.cumsum(dsens / sens2 + derr / err)


@pytest.mark.parametrize("error", ["max", "mean"])
@pytest.mark.parametrize("context", [(30, 4, 3), (30, 2), (30, 1, 1)])
def test_loss_and_gradient_equal_the_reference_objective(context, error):
    ctx = Participation(*context)
    steps = np.random.default_rng(3).uniform(0.05, 0.5, size=6)
    value, grad = band_mf_optimize.log_loss_and_gradient(steps, ctx, error)
    ref_value, ref_grad = _reference_log_loss(steps, ctx, error)
    assert value == pytest.approx(ref_value, rel=1e-13)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bands, context, error", [
    (2, (4096, 2), "max"), (4, (4096, 4), "max"), (8, (4096, 8), "max"), (16, (4096, 16), "mean"),
    (8, (4096, 8), "mean"), (32, (4096, 1, 1), "max"), (12, (4096, 64, 20), "max"), (96, (4096, 1, 1), "mean"),
    (2, (65536, 2), "max"), (8, (65536, 8), "max"), (4, (65536, 4), "mean"),  # these evaluate by doubling
])
def test_resolved_losses_equal_the_reference_optimizer(bands, context, error):
    # The reference: the loss above minimized by the same L-BFGS-B from the same start, stopped by
    # the iteration rule alone (the optimizer before the fast evaluation and the evaluation rule).
    ctx = Participation(*context)
    steps, _, _ = minimize_until_stalled(
        lambda x: _reference_log_loss(x, ctx, error), band_mf_optimize.initial_steps(bands),
        stall=band_mf_optimize._STALL, window=band_mf_optimize._STALL_WINDOW, max_iterations=2000,
        ftol=1e-15, gtol=1e-12, maxcor=band_mf_optimize._MEMORY, bounds=[(0.0, None)] * bands)
    c = band_mf_optimize.coefficients_from(steps)
    reference = mechanism_from_coefs(round_for_float32(c / c[0]), ctx)
    got = band_mf_strategy(bands, error).resolve(ctx)
    assert got.sensitivity == pytest.approx(math.sqrt(toeplitz.minsep_sensitivity_squared(
        got.toeplitz_coefficients(), ctx.min_sep, ctx.max_participations)), rel=1e-15)
    assert got.max_loss == pytest.approx(reference.max_loss, rel=1e-6)
    assert got.mean_loss == pytest.approx(reference.mean_loss, rel=1e-6)
    target, ref_target = (got.max_loss, reference.max_loss) if error == "max" else (got.mean_loss, reference.mean_loss)
    assert target <= ref_target * (1 + 1e-8)  # and no worse on the loss it minimizes


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


def test_a_long_resolution_is_a_pure_function_of_its_request():
    # the doubling path (n = 2^17): the same request gives bit-identical coefficients whatever was
    # resolved (and cached) before it in the process
    recipe, ctx = band_mf_strategy(8), Participation(2**17, 8)
    _resolve_band_mf.cache_clear()
    first = recipe.resolve(ctx).coefs.copy()
    _resolve_band_mf.cache_clear()
    band_mf_strategy(4, "mean").resolve(2**16, 4)
    band_mf_strategy(8).resolve(2**16, 8)
    assert np.array_equal(recipe.resolve(ctx).coefs, first)


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

    # the threshold in seconds lowered to what 3 bands over 257 steps may take
    threshold = band_mf.expected_resolution_seconds(3, 257)[1]
    monkeypatch.setattr(band_mf, "SLOW_RESOLUTION_SECONDS", threshold)
    strategy = band_mf.band_mf_strategy(bands=3)
    with pytest.warns(band_mf.SlowResolutionWarning,
                      match=r"band_mf_strategy\(bands=3\) for n_steps=257 .* evaluations .*expect about \d+ to \d+ s") as record:
        strategy.resolve(257, 3)
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.resolve(257, 3)  # cached: no second warning
        strategy.resolve(249, 3)  # below the threshold
        band_mf.band_mf_strategy(bands=1).resolve(300)  # bands = 1 has nothing to optimize


@pytest.mark.parametrize("bands, n_steps, slow", [
    (2, 1_000_000, False), (8, 1_000_000, False), (16, 10_000_000, False), (64, 1_000_000, True),
    (256, 1_000_000, True), (256, 100_000, False), (48, 10_000_000, True),
])
def test_expected_resolution_seconds_follow_the_evaluation_cost(bands, n_steps, slow):
    # the default plan's 2 to 8 bands at a million steps resolve quietly; 64 and more warn there
    from opake.dpftrl.strategies import band_mf

    low, high = band_mf.expected_resolution_seconds(bands, n_steps)
    assert 0 < low < high
    assert (high >= band_mf.SLOW_RESOLUTION_SECONDS) is slow
