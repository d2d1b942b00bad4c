"""Bad input to mf_gaussian_noise / noise_fn: a clear error, and the state left usable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.strategies.strategy import Mechanism
from opake.dpftrl.participation import Participation
from opake.random import key
from opake.types import clipped
from engine_support import flat, hand_blt

TEMPLATE = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def _engine(strategy=None, n_steps=4, **overrides):
    arguments = dict(n_steps=n_steps, noise_multiplier=1.0, key=key(3))
    arguments.update(overrides)
    return mf_gaussian_noise(TEMPLATE, strategy or hand_blt("three_buffers"), **arguments)


def _good():
    return clipped({"w": torch.ones(2, 3), "b": torch.ones(3)}, 1.0)


# -- construction -----------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), float("inf")])
def test_noise_multiplier_must_be_positive_and_finite(sigma):
    with pytest.raises(ValueError, match=r"noise_multiplier must be finite and > 0"):
        _engine(noise_multiplier=sigma)


@pytest.mark.parametrize("sigma", [True, "1.0", None])
def test_noise_multiplier_must_be_a_number(sigma):
    with pytest.raises(TypeError, match="noise_multiplier must be a real number"):
        _engine(noise_multiplier=sigma)


def test_key_is_required_and_must_be_an_rng_key():
    with pytest.raises(TypeError, match="key"):
        mf_gaussian_noise(TEMPLATE, identity_strategy(), n_steps=3, noise_multiplier=1.0)
    with pytest.raises(TypeError, match=r"opake\.random\.key\(42\)"):
        _engine(key=42)


def test_compute_dtype_is_float32_or_float64():
    with pytest.raises(ValueError, match="float32 or torch.float64"):
        _engine(dtype=torch.bfloat16)


def test_strategy_must_be_a_recipe():
    with pytest.raises(TypeError, match=r"blt_strategy\(\.\.\.\) or identity_strategy\(\)"):
        mf_gaussian_noise(TEMPLATE, "blt", n_steps=3, noise_multiplier=1.0, key=key(0))


def test_participation_context_is_validated():
    with pytest.raises(ValueError, match="min_sep"):
        _engine(n_steps=3, min_sep=5)
    with pytest.raises(TypeError, match="n_steps"):
        _engine(n_steps=2.5)


def _mechanism(theta, omega, n=4):
    class Fixed:
        def resolve(self, n_steps, min_sep=1, max_participations=None):
            return Mechanism(recipe=None, participation=Participation(n_steps, min_sep, max_participations),
                             theta=np.asarray(theta), omega=np.asarray(omega), sensitivity=1.0,
                             max_loss=0.0, mean_loss=0.0)
    return Fixed()


@pytest.mark.parametrize(
    "theta, omega, message",
    [
        ([1.5, 0.5], [0.25, 0.25], r"theta must lie in \[0, 1\]"),
        ([-0.25, 0.5], [0.25, 0.25], r"theta must lie in \[0, 1\]"),
        ([0.5, 0.5], [-0.25, 0.25], r"omega must be >= 0"),
        ([0.5, 0.75], [0.75, 0.5], r"sum to at most 1"),
        ([0.5, float("nan")], [0.25, 0.25], r"finite"),
    ],
)
def test_mechanisms_outside_the_sensitivity_preconditions_are_refused(theta, omega, message):
    with pytest.raises(ValueError, match=message):
        _engine(_mechanism(theta, omega))


def test_parameters_that_float32_would_round_are_refused_unless_computing_in_float64():
    recipe = _mechanism([0.9], [0.1])  # 0.1 and 1 - 0.9 are not float32 numbers
    with pytest.raises(ValueError, match=r"not exactly representable in torch\.float32.*dtype=torch\.float64"):
        _engine(recipe)
    _engine(recipe, dtype=torch.float64)


def test_template_must_hold_floating_tensors_on_one_device():
    with pytest.raises(ValueError, match="no tensors"):
        mf_gaussian_noise({}, identity_strategy(), n_steps=2, noise_multiplier=1.0, key=key(0))
    with pytest.raises(TypeError, match=r"leaf at 'w' is ndarray"):
        mf_gaussian_noise({"w": np.zeros(3)}, identity_strategy(), n_steps=2, noise_multiplier=1.0, key=key(0))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        mf_gaussian_noise({"w": torch.zeros(3, dtype=torch.long)}, identity_strategy(), n_steps=2,
                          noise_multiplier=1.0, key=key(0))
    with pytest.raises(ValueError, match="several devices"):
        mf_gaussian_noise({"a": torch.zeros(3), "b": torch.zeros(3, device="meta")}, identity_strategy(),
                          n_steps=2, noise_multiplier=1.0, key=key(0))


# -- per-step input: each error leaves the state as it was ------------------------------------


def _bad_calls():
    good = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    nan = {"w": torch.ones(2, 3), "b": torch.tensor([0.0, float("nan"), 1.0])}
    inf = {"w": torch.full((2, 3), float("-inf")), "b": torch.ones(3)}
    return [
        (good["w"], TypeError, r"needs an opake\.types\.ClippedPytree.*opake\.types\.clipped\("),
        (good, TypeError, r"got dict\. Wrap gradients you clipped yourself with opake\.types\.clipped"),
        (clipped({"w": torch.ones(2, 3)}, 1.0), ValueError, r"structure of grad_template \(missing \['b'\]"),
        (clipped({**good, "extra": torch.ones(1)}, 1.0), ValueError, r"unexpected \['extra'\]"),
        (clipped({"w": torch.ones(3, 2), "b": torch.ones(3)}, 1.0), ValueError, r"'w' has shape \(3, 2\)"),
        (clipped({"w": torch.ones(2, 3, dtype=torch.int32), "b": torch.ones(3)}, 1.0), TypeError,
         r"'w' has dtype torch\.int32"),
        (clipped({"w": torch.ones(2, 3, device="meta"), "b": torch.ones(3)}, 1.0), ValueError,
         r"'w' is on meta"),
        (clipped(nan, 1.0), ValueError, r"NaN or inf \(in \['b'\]\)"),
        (clipped(inf, 1.0), ValueError, r"NaN or inf \(in \['w'\]\)"),
    ]


@pytest.mark.parametrize("argument, error, message", _bad_calls())
def test_bad_gradients_raise_and_leave_the_state_unchanged(argument, error, message):
    noise_fn, state = _engine()
    _, state = noise_fn(_good(), state)
    before = state.copy(draws="replay")
    with pytest.raises(error, match=message):
        noise_fn(argument, state)
    assert state.is_current and state == before
    # The state still produces exactly the noise it would have produced.
    after_error, _ = noise_fn(_good(), state)
    reference, _ = noise_fn(_good(), before)
    assert torch.equal(flat(after_error.pytree), flat(reference.pytree))


def test_a_state_from_another_engine_is_refused():
    noise_fn, _ = _engine()
    _, other_state = _engine(key=key(4))
    with pytest.raises(ValueError, match=r"different noise engine \(differs in: key\)"):
        noise_fn(_good(), other_state)
    _, other_state = _engine(noise_multiplier=2.0)
    with pytest.raises(ValueError, match=r"differs in: noise_multiplier"):
        noise_fn(_good(), other_state)
    _, other_state = _engine(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"buffer dtype"):
        noise_fn(_good(), other_state)


def test_second_argument_must_be_a_noise_state():
    noise_fn, state = _engine()
    with pytest.raises(TypeError, match="second argument must be the NoiseState"):
        noise_fn(_good(), state.state_dict())



# -- gradients the step cannot noise element by element ----------------------------------------


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("leaf, layout", [("w", "coo"), ("w", "csr"), ("b", "coo")])
def test_sparse_gradients_are_refused_before_touching_the_state(leaf, layout):
    # A sparse leaf used to pass every check and fail inside the step, leaving the buffers
    # corrupted (CorruptedStateError on the next call).
    noise_fn, state = _engine()
    _, state = noise_fn(_good(), state)
    before = state.copy(draws="replay")
    gradients = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    gradients[leaf] = gradients[leaf].to_sparse() if layout == "coo" else gradients[leaf].to_sparse_csr()
    with pytest.raises(TypeError, match=rf"'{leaf}' has layout torch\.sparse_{layout}.*needs a dense tensor.*"
                                        r"\.to_dense\(\)"):
        noise_fn(clipped(gradients, 1.0), state)
    assert state.is_current and state == before
    after_error, _ = noise_fn(_good(), state)
    reference, _ = noise_fn(_good(), before)
    assert torch.equal(flat(after_error.pytree), flat(reference.pytree))


def test_unsupported_floating_dtypes_are_refused_before_touching_the_state():
    # float8 passes is_floating_point() but torch's kernels fail on it inside the step.
    noise_fn, state = _engine()
    grads = clipped({"w": torch.ones(2, 3).to(torch.float8_e4m3fn), "b": torch.ones(3)}, 1.0)
    with pytest.raises(TypeError, match=r"'w' has dtype torch\.float8_e4m3fn; .* float16, bfloat16, float32 and "
                                        r"float64 gradients"):
        noise_fn(grads, state)
    _, state = noise_fn(_good(), state)
    assert state.step == 1
    with pytest.raises(TypeError, match=r"grad_template leaf 'w' has dtype torch\.float8_e4m3fn"):
        mf_gaussian_noise({"w": torch.zeros(3).to(torch.float8_e4m3fn)}, identity_strategy(), n_steps=2,
                          noise_multiplier=1.0, key=key(0))
