"""mf_gaussian_noise: streamed noise against the dense oracle, identity, purity, layout, dtypes."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler, path_code
from opake.dpftrl.noise.engine.state import NoiseState, RetiredStateError
from opake.random import key
from opake.types import NoisedPytree, clipped
from engine_support import (
    BLT_CASES,
    HandRecipe,
    dense_blt_matrix,
    dense_inverse_apply,
    flat,
    hand_blt,
    run_noise,
    zeros_like_tree,
)

TEMPLATE = {"layer.weight": torch.zeros(3, 2), "layer.bias": torch.zeros(2), "scale": torch.zeros(())}


def _engine(strategy, n_steps, *, template=None, sigma=1.0, seed=7, dtype=torch.float32, **context):
    # Outputs come in the template's dtypes: the default template is in the compute dtype, so
    # float64 noise is read back at full precision.
    if template is None:
        template = {name: leaf.to(dtype) for name, leaf in TEMPLATE.items()}
    return mf_gaussian_noise(
        template, strategy, n_steps=n_steps, noise_multiplier=sigma, key=key(seed), dtype=dtype, **context
    )


# -- dense check: streamed noise == sigma * clip / norm * C^{-1} Z ------------------------------


@pytest.mark.parametrize("name", sorted(BLT_CASES))
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_streamed_noise_equals_dense_inverse_times_same_draws(name, dtype, tolerance):
    n, sigma, l2_bound, normalization = 9, 1.7, 0.5, 4.0
    recipe = hand_blt(name)
    noise_fn, state = _engine(recipe, n, sigma=sigma, dtype=dtype)
    noise, _ = run_noise(noise_fn, state, TEMPLATE, n, l2_bound=l2_bound, normalization=normalization)
    # Z: the same key through the identity strategy, which adds exactly 1.0 * z.
    identity_fn, identity_state = _engine(identity_strategy(), n, dtype=dtype)
    draws, _ = run_noise(identity_fn, identity_state, TEMPLATE, n)
    expected = sigma * l2_bound / normalization * dense_inverse_apply(
        dense_blt_matrix(recipe.omega, recipe.one_minus_theta, n), draws
    )
    assert noise.shape == (n, 9)
    np.testing.assert_allclose(noise, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


@given(
    n=st.integers(1, 100),
    buffers=st.lists(
        st.tuples(st.integers(1, 2**20), st.integers(0, 40)), min_size=1, max_size=4
    ),
    scale_bits=st.integers(1, 8),
)
def test_dense_check_for_random_float32_exact_blts(n, buffers, scale_bits):
    # omega_i = m_i / 2**22 / 2**scale_bits (<= 1/8) keeps sum(omega) < 1; 1 - theta_i = 2**-e_i
    # spans plain decays and decays within 1e-12 of 1. All float32-exact. Up to 100 steps, so
    # the stored buffers cross renormalizations (periods 1, 32 and 77 for e = 0, 1, 2).
    omega = tuple(m / 2**22 / 2**scale_bits for m, _ in buffers)
    one_minus_theta = tuple(2.0**-e for _, e in buffers)
    recipe = HandRecipe(omega, one_minus_theta)
    template = [torch.zeros(5, dtype=torch.float64)]
    noise_fn, state = _engine(recipe, n, template=template, dtype=torch.float64)
    noise, _ = run_noise(noise_fn, state, template, n)
    identity_fn, identity_state = _engine(identity_strategy(), n, template=template, dtype=torch.float64)
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    expected = dense_inverse_apply(dense_blt_matrix(omega, one_minus_theta, n), draws)
    np.testing.assert_allclose(noise, expected, rtol=1e-12, atol=1e-12)


def test_gradient_is_added_to_the_noise():
    n = 4
    noise_fn, state = _engine(hand_blt("three_buffers"), n, dtype=torch.float64)
    zero_noise, _ = run_noise(noise_fn, state, TEMPLATE, n)
    grads = {"layer.weight": torch.arange(6.0, dtype=torch.float64).reshape(3, 2),
             "layer.bias": torch.tensor([-1.0, 2.0], dtype=torch.float64),
             "scale": torch.tensor(0.5, dtype=torch.float64)}
    noise_fn, state = _engine(hand_blt("three_buffers"), n, dtype=torch.float64)
    with_grads, _ = run_noise(noise_fn, state, TEMPLATE, n, grads=grads)
    np.testing.assert_allclose(with_grads - zero_noise, np.tile(flat(grads).numpy(), (n, 1)), atol=1e-12)


# -- identity strategy ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_noise_is_exactly_the_scaled_draws(dtype):
    sigma, l2_bound, normalization = 2.5, 3.0, 8.0
    scale = sigma * l2_bound / normalization
    template = {"w": torch.zeros(1000, dtype=dtype)}
    noise_fn, state = _engine(identity_strategy(), 3, template=template, sigma=sigma, dtype=dtype)
    assert state.buffers.shape == (0, 1000)
    sampler = BlockSampler(key(7), torch.device("cpu"))
    for step in range(3):
        noisy, state = noise_fn(clipped(zeros_like_tree(template, dtype), l2_bound, normalization), state)
        z = torch.empty(1000, dtype=dtype)
        sampler.fill(z, step, path_code(("w",)), 0)
        assert torch.equal(noisy.pytree["w"], z * torch.tensor(scale, dtype=dtype))


def test_identity_noise_has_the_stated_mean_and_variance():
    # 10**6 i.i.d. draws of N(0, s^2), s = 0.75. The sample mean has sd s/1000; the sample
    # variance has relative sd sqrt(2/10**6) = 1.4e-3. Bounds at 8 sd: false failure < 1e-14.
    sigma, l2_bound, normalization = 1.5, 2.0, 4.0
    s = sigma * l2_bound / normalization
    template = torch.zeros(10**6)
    noise_fn, state = _engine(identity_strategy(), 1, template=template, sigma=sigma)
    noisy, _ = noise_fn(clipped(torch.zeros(10**6), l2_bound, normalization), state)
    values = noisy.pytree.to(torch.float64)
    assert abs(values.mean().item()) < 8 * s / 1000
    assert abs(values.var().item() / s**2 - 1) < 8 * math.sqrt(2 / 10**6)


# -- purity and state ownership ---------------------------------------------------------------


def test_same_state_gives_same_output_and_equal_new_state():
    noise_fn, state = _engine(hand_blt("three_buffers"), 5)
    grads = clipped(zeros_like_tree(TEMPLATE), 1.0)
    _, state = noise_fn(grads, state)
    kept = state.copy(draws="replay")
    first, first_state = noise_fn(grads, state)
    second, second_state = noise_fn(grads, kept)
    assert torch.equal(flat(first.pytree), flat(second.pytree))
    assert first_state == second_state and first_state.step == 2
    assert first.step == second.step == 1


def test_retired_state_is_refused_not_silently_reused():
    noise_fn, state = _engine(hand_blt("one_buffer"), 5)
    grads = clipped(zeros_like_tree(TEMPLATE), 1.0)
    _, new_state = noise_fn(grads, state)
    assert not state.is_current and new_state.is_current
    with pytest.raises(RetiredStateError, match=r"already advanced.*state\.copy\(draws='replay'\)"):
        noise_fn(grads, state)
    with pytest.raises(RetiredStateError, match="already advanced"):
        state.state_dict()
    noise_fn(grads, new_state)  # the returned state is the one to use


def test_input_pytree_is_not_modified_and_output_is_a_new_tensor():
    noise_fn, state = _engine(hand_blt("one_buffer"), 2)
    grads = {k: torch.ones_like(v) for k, v in TEMPLATE.items()}
    before = {k: v.clone() for k, v in grads.items()}
    noisy, _ = noise_fn(clipped(grads, 1.0), state)
    assert isinstance(noisy, NoisedPytree)
    for name in grads:
        assert torch.equal(grads[name], before[name])
        assert noisy.pytree[name].data_ptr() != grads[name].data_ptr()


def test_outputs_are_views_of_one_flat_vector():
    noise_fn, state = _engine(hand_blt("one_buffer"), 2)
    noisy, _ = noise_fn(clipped(zeros_like_tree(TEMPLATE), 1.0), state)
    storages = {t.untyped_storage().data_ptr() for t in noisy.pytree.values()}
    assert len(storages) == 1
    assert sum(t.numel() for t in noisy.pytree.values()) == 9
    assert noisy.pytree["layer.weight"].shape == (3, 2) and noisy.pytree["scale"].shape == ()


def test_buffers_are_one_flat_tensor_of_shape_buffers_by_parameters():
    _, state = _engine(hand_blt("three_buffers"), 2)
    assert state.buffers.shape == (3, 9) and state.buffers.dtype == torch.float32
    _, state = _engine(hand_blt("three_buffers"), 2, dtype=torch.float64)
    assert state.buffers.dtype == torch.float64


# -- noise depends on (key, step, path, element index) only ----------------------------------


def _leaf_noise(template, leaf, n=3, grads_dtype=None, seed=7):
    noise_fn, state = _engine(hand_blt("three_buffers"), n, template=template, seed=seed)
    rows = []
    for _ in range(n):
        noisy, state = noise_fn(clipped(zeros_like_tree(template, grads_dtype), 1.0), state)
        rows.append(leaf(noisy.pytree).to(torch.float64).clone())
    return torch.stack(rows)


def test_a_leaf_noise_does_not_depend_on_the_other_leaves_or_their_order():
    big = BLOCK_ELEMENTS + 5  # two noise blocks
    alone = _leaf_noise({"a": torch.zeros(big)}, lambda p: p["a"])
    with_others = _leaf_noise({"z": torch.zeros(7), "a": torch.zeros(big), "b": torch.zeros(3, 3)}, lambda p: p["a"])
    reordered = _leaf_noise(OrderedDict(b=torch.zeros(3, 3), a=torch.zeros(big)), lambda p: p["a"])
    assert torch.equal(alone, with_others) and torch.equal(alone, reordered)
    # The second block is not a copy of the first, and steps differ.
    assert not torch.equal(alone[:, :5], alone[:, BLOCK_ELEMENTS:])
    assert not torch.equal(alone[0], alone[1])


def test_sequence_leaves_are_named_by_index():
    first_only = _leaf_noise([torch.zeros(4)], lambda p: p[0])
    two = _leaf_noise([torch.zeros(4), torch.zeros(6)], lambda p: p[0])
    assert torch.equal(first_only, two)


def test_different_paths_keys_and_steps_give_different_noise():
    both = _leaf_noise({"a": torch.zeros(16), "b": torch.zeros(16)}, lambda p: torch.stack([p["a"], p["b"]]))
    assert not torch.equal(both[:, 0], both[:, 1])
    other_key = _leaf_noise({"a": torch.zeros(16)}, lambda p: p["a"], seed=8)
    assert not torch.equal(both[:, 0], other_key)


def test_mixed_dtypes_do_not_change_a_leaf_noise():
    # A bfloat16 parameter next to a float32 one, with gradients in either dtype: leaf "a"'s
    # noise is the same as with a uniform float32 model.
    template = {"a": torch.zeros(40), "b": torch.zeros(10)}
    plain = _leaf_noise(template, lambda p: p["a"])
    mixed_template = {"a": torch.zeros(40), "b": torch.zeros(10, dtype=torch.bfloat16)}
    for b_grad_dtype in (torch.bfloat16, torch.float32):
        noise_fn, state = _engine(hand_blt("three_buffers"), 3, template=mixed_template)
        rows = []
        for _ in range(3):
            grads = {"a": torch.zeros(40), "b": torch.zeros(10, dtype=b_grad_dtype)}
            noisy, state = noise_fn(clipped(grads, 1.0), state)
            assert noisy.pytree["b"].dtype == torch.bfloat16  # the template's dtype
            rows.append(noisy.pytree["a"].to(torch.float64))
        assert torch.equal(torch.stack(rows), plain)


# -- gradient dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("template_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.float64])
def test_any_gradient_dtype_is_noised_in_the_compute_dtype_and_returned_in_the_template_dtype(
        template_dtype, grad_dtype, compute_dtype):
    n, scale = 4, 0.5
    grads = {"w": (torch.arange(20.0).reshape(4, 5) / 7).to(grad_dtype)}
    # scale * x: the noise of the same engine on zero gradients, template in the compute dtype.
    compute_template = {"w": torch.zeros(4, 5, dtype=compute_dtype)}
    noise_fn, state = _engine(hand_blt("near_one_decay"), n, template=compute_template, dtype=compute_dtype)
    noise = []
    for _ in range(n):
        noisy, state = noise_fn(clipped({"w": torch.zeros(4, 5, dtype=compute_dtype)}, scale), state)
        noise.append(noisy.pytree["w"])
    template = {"w": torch.zeros(4, 5, dtype=template_dtype)}
    noise_fn, state = _engine(hand_blt("near_one_decay"), n, template=template, dtype=compute_dtype)
    wide = torch.promote_types(grad_dtype, compute_dtype)
    for step in range(n):
        noisy, state = noise_fn(clipped(grads, scale), state)
        assert noisy.pytree["w"].dtype == template_dtype
        assert state.buffers.dtype == compute_dtype
        # The same x whatever the dtypes; gradient + scale * x is formed in the wider of the
        # gradient's and the compute dtype and rounded once to the template's dtype.
        expected = (grads["w"].to(wide) + noise[step].to(wide)).to(template_dtype)
        assert torch.equal(noisy.pytree["w"], expected)


# -- horizon -----------------------------------------------------------------------------------


def test_step_past_n_steps_is_refused_with_the_horizon_in_the_message():
    noise_fn, state = _engine(hand_blt("one_buffer"), 3)
    grads = clipped(zeros_like_tree(TEMPLATE), 1.0)
    for _ in range(3):
        _, state = noise_fn(grads, state)
    assert state.step == 3
    with pytest.raises(RuntimeError, match=r"step 4 .*n_steps=3.*accounting assumed n_steps=3"):
        noise_fn(grads, state)
    assert state.is_current  # refused before touching anything


def test_horizon_refusal_is_its_own_error_type():
    from opake.dpftrl.noise.engine.state import NoiseHorizonError

    noise_fn, state = _engine(identity_strategy(), 1)
    _, state = noise_fn(clipped(zeros_like_tree(TEMPLATE), 1.0), state)
    with pytest.raises(NoiseHorizonError):
        noise_fn(clipped(zeros_like_tree(TEMPLATE), 1.0), state)


# -- resolved mechanisms and context ------------------------------------------------------------


def test_a_resolved_mechanism_is_accepted_for_its_own_context_only():
    mechanism = hand_blt("one_buffer").resolve(6, 2, 3)
    noise_fn, state = mf_gaussian_noise(TEMPLATE, mechanism, n_steps=6, min_sep=2, max_participations=3,
                                        noise_multiplier=1.0, key=key(0))
    assert noise_fn.mechanism is mechanism and isinstance(state, NoiseState)
    with pytest.raises(ValueError, match="same context"):
        mf_gaussian_noise(TEMPLATE, mechanism, n_steps=6, noise_multiplier=1.0, key=key(0))


def test_the_engine_passes_the_participation_context_to_the_recipe():
    calls = []

    class Recording(HandRecipe):
        def resolve(self, n_steps, min_sep=1, max_participations=None):
            calls.append((n_steps, min_sep, max_participations))
            return super().resolve(n_steps, min_sep, max_participations)

    mf_gaussian_noise(TEMPLATE, Recording((0.5,), (0.5,)), n_steps=50, min_sep=10, max_participations=5,
                      noise_multiplier=1.0, key=key(0))
    assert calls == [(50, 10, 5)]


# -- how the work is cut does not change the numbers ---------------------------------------------


def _noise_with(monkeypatch, columns, template, name="three_buffers", n=3):
    import opake.dpftrl.noise.engine.correlated_noise as engine_module

    monkeypatch.setattr(engine_module, "columns_per_advance", lambda device: columns)
    noise_fn, state = _engine(hand_blt(name), n, template=template)
    rows = []
    for step in range(n):
        # Leaf "b" is a bfloat16 parameter (scratch path) with float32 gradients.
        grads = {name: torch.full_like(leaf, 0.5 * step, dtype=torch.float32) for name, leaf in template.items()}
        noisy, state = noise_fn(clipped(grads, 1.0), state)
        rows.append(flat(noisy.pytree))
    return torch.stack(rows), state.buffers.clone()


@pytest.mark.parametrize("name", ["three_buffers", "zero_decay"])  # zero_decay renormalizes every step
@pytest.mark.parametrize("columns", [2**16, 4099, 1000])
def test_cache_blocked_and_whole_span_updates_are_bit_identical(monkeypatch, columns, name):
    # A leaf of two noise blocks, a bfloat16 leaf (scratch path) and many small leaves (grouped).
    template = {"a": torch.zeros(BLOCK_ELEMENTS + 2**17 + 13), "b": torch.zeros(3, 5, dtype=torch.bfloat16),
                **{f"small{i:02d}": torch.zeros(300 + i) for i in range(12)}}
    whole, whole_buffers = _noise_with(monkeypatch, None, template, name)
    blocked, blocked_buffers = _noise_with(monkeypatch, columns, template, name)
    assert torch.equal(whole, blocked) and torch.equal(whole_buffers, blocked_buffers)


def test_thread_count_does_not_change_the_noise():
    template = {"a": torch.zeros(2**17 + 13)}
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            noise_fn, state = _engine(hand_blt("three_buffers"), 3, template=template)
            results.append(run_noise(noise_fn, state, template, 3)[0])
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(results[0], results[1])


# -- unusual but valid gradients ---------------------------------------------------------------


def test_gradients_that_require_grad_give_plain_outputs():
    template = {"w": torch.zeros(4, requires_grad=True)}
    noise_fn, state = _engine(hand_blt("one_buffer"), 2, template=template)
    grads = {"w": torch.ones(4, requires_grad=True) * 2}
    noisy, _ = noise_fn(clipped(grads, 1.0), state)
    assert not noisy.pytree["w"].requires_grad and noisy.pytree["w"].grad_fn is None


def test_empty_and_non_contiguous_leaves():
    template = {"empty": torch.zeros(0, 3), "w": torch.zeros(2, 3)}
    noise_fn, state = _engine(hand_blt("one_buffer"), 2, template=template, dtype=torch.float64)
    reference_fn, reference_state = _engine(hand_blt("one_buffer"), 2, template=template, dtype=torch.float64)
    transposed = torch.arange(6.0, dtype=torch.float64).reshape(3, 2).t()  # shape (2, 3), not contiguous
    noisy, _ = noise_fn(clipped({"empty": torch.zeros(0, 3), "w": transposed}, 1.0), state)
    reference, _ = reference_fn(clipped({"empty": torch.zeros(0, 3), "w": transposed.contiguous()}, 1.0),
                                reference_state)
    assert noisy.pytree["empty"].shape == (0, 3)
    assert torch.equal(noisy.pytree["w"], reference.pytree["w"])
