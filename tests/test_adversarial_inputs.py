"""Adversarial and edge inputs for the privacy path: clipping, the noise engine, the mechanism.

Each test feeds one hostile or degenerate input (huge, tiny, NaN, inf and denormal gradients,
zero-size and oddly laid out tensors, a mismatching device, half precision, degenerate
participation contexts, decays that round to 1.0 in float32, a learning-rate schedule that
changes between accounting and noise) and checks that opake either handles it exactly or
refuses it with the documented error, before any state is touched.

Each test here once exposed or guards against a library bug (all fixed; see the git log).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import opake.dpftrl.accounting as dpftrl_acc
from dense import brute_force_sensitivity_squared, lower_toeplitz, blt_coefs
from opake.accounting import gaussian
from opake.dpftrl.clipping import ClipState, NonFiniteGradientError, clipped_grad
from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.strategies import blt, blt_strategy, identity_strategy
from opake.dpftrl.noise.engine.state import NoiseHorizonError
from opake.dpftrl.strategies.strategy import mechanism_from_blt
from opake.dpftrl.participation import Participation
from opake.random import key
from opake.types import clipped
from engine_support import dense_blt_matrix, dense_inverse_apply

F32_MAX = torch.finfo(torch.float32).max
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _linear_loss(params, x):
    """loss = <w, x>: the per-example gradient is exactly the example x."""
    return (params["w"] * x).sum()


def _clip(examples, clipping_norm=1.0, dtype=torch.float32, **kwargs):
    grad_fn, state = clipped_grad(_linear_loss, clipping_norm, **kwargs)
    params = {"w": torch.zeros(examples.shape[1], dtype=dtype)}
    grads, state = grad_fn(params, examples.to(dtype), state=state)
    return grads.pytree["w"], state


def _engine(template, strategy=None, n_steps=3, **kwargs):
    strategy = identity_strategy() if strategy is None else strategy
    return mf_gaussian_noise(template, strategy, n_steps=n_steps, noise_multiplier=1.0, key=key(7), **kwargs)


# ---------------------------------------------------------------------------------------------
# Clipping: huge, tiny, denormal, NaN, inf


def test_clipping_huge_gradient_whose_norm_overflows_float32():
    grads, state = _clip(torch.tensor([[F32_MAX, F32_MAX, 0.0]]))
    assert torch.all(torch.isfinite(grads))
    assert grads.double().norm().item() == pytest.approx(1.0, rel=1e-6)
    assert state.clipped_examples == 1 and state.nonfinite_examples == 0


def test_clipping_float64_norm_beyond_float64_range_is_nonfinite():
    examples = torch.full((1, 4), 1.7e308, dtype=torch.float64)
    with pytest.raises(NonFiniteGradientError, match=r"norm overflows float64"):
        _clip(examples, dtype=torch.float64)


@pytest.mark.parametrize("value", [1e-30, 1e-40, 1e-45], ids=["tiny", "denormal", "smallest_denormal"])
def test_clipping_keeps_tiny_and_denormal_gradients_exactly(value):
    examples = torch.tensor([[value, -value, 0.0]])
    grads, state = _clip(examples)
    assert torch.equal(grads, examples[0])
    assert state.clipped_examples == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_clipping_refuses_nonfinite_examples(bad):
    examples = torch.tensor([[bad, 1.0, 0.0], [3.0, 4.0, 0.0]])
    with pytest.raises(NonFiniteGradientError, match=r"example 0 .* not finite in 'w'"):
        _clip(examples)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_clipping_zero_mode_drops_exactly_the_nonfinite_example(bad):
    examples = torch.tensor([[bad, 1.0, 0.0], [3.0, 4.0, 0.0]])
    grads, state = _clip(examples, nonfinite="zero")
    assert torch.equal(grads, torch.tensor([0.6, 0.8, 0.0]))  # only (3, 4) / 5 remains
    assert (state.nonfinite_examples, state.clipped_examples, state.examples) == (1, 1, 2)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_clipping_half_precision_parameters_are_clipped_to_float32_rounding(dtype):
    # Half-precision per-example gradients are summed in float32: (3, 4) clipped to norm 1 is
    # (0.6, 0.8) to float32 rounding, not bfloat16's (0.6016, 0.8008) of norm 1.0016.
    examples = torch.tensor([[3.0, 4.0, 0.0], [600.0, -800.0, 1.0], [1e4, 1e4, 1e4]])
    for row in examples:
        grads, state = _clip(row[None], dtype=dtype)
        assert grads.dtype == torch.float32
        assert grads.double().norm().item() <= 1.0 + 4 * torch.finfo(torch.float32).eps
        assert state.clipped_examples == 1


@pytest.mark.parametrize(
    "dtype, clipping_norm",
    [(torch.float32, 1e-25), (torch.float64, 1e-170)],
    ids=["float32", "float64"],
)
def test_clipping_tiny_clipping_norm_still_bounds_the_gradient(dtype, clipping_norm):
    examples = torch.tensor([[10 * clipping_norm, 0.0, 0.0]], dtype=dtype)
    grads, state = _clip(examples, clipping_norm=clipping_norm, dtype=dtype)
    assert state.clipped_examples == 1
    assert abs(grads[0].item()) <= clipping_norm * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------
# Clipping: layouts


def test_clipping_zero_size_parameter_leaf():
    def loss(params, x):
        return (params["w"] * x).sum() + params["empty"].sum()

    grad_fn, state = clipped_grad(loss, 1.0)
    grads, state = grad_fn({"w": torch.zeros(2), "empty": torch.zeros(0, 3)}, torch.tensor([[3.0, 4.0]]), state=state)
    assert grads.pytree["empty"].shape == (0, 3)
    assert torch.equal(grads.pytree["w"], torch.tensor([0.6, 0.8]))


def test_clipping_non_contiguous_parameter_gives_the_contiguous_result():
    def loss(params, x):
        return (params["w"] @ x).sum()

    grad_fn, state = clipped_grad(loss, 1.0)
    x = torch.tensor([[30.0, 40.0, 0.0], [1.0, 2.0, 2.0]])
    transposed = torch.zeros(3, 2).t()  # shape (2, 3), not contiguous
    assert not transposed.is_contiguous()
    a, _ = grad_fn({"w": transposed}, x, state=state)
    b, _ = grad_fn({"w": torch.zeros(2, 3)}, x, state=state)
    assert torch.equal(a.pytree["w"], b.pytree["w"])


def test_clipping_channels_last_conv_gives_the_contiguous_result():
    from torch.func import functional_call

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 2)
    params = {name: p.detach().clone() for name, p in conv.named_parameters()}
    last = {name: (p.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p)
            for name, p in params.items()}
    assert last["weight"].is_contiguous(memory_format=torch.channels_last)

    def loss(p, x):
        return 100 * functional_call(conv, p, (x.unsqueeze(0),)).sum()

    grad_fn, state = clipped_grad(loss, 1.0)
    x = torch.randn(4, 2, 5, 5)
    a, sa = grad_fn(params, x, state=state)
    b, sb = grad_fn(last, x, state=state)
    for name in params:
        torch.testing.assert_close(a.pytree[name], b.pytree[name], rtol=1e-6, atol=1e-7)
    assert sa.clipped_examples == sb.clipped_examples == 4


# ---------------------------------------------------------------------------------------------
# Noise engine: hostile gradient values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF_DTYPES])
@pytest.mark.parametrize("values", [
    [float("nan"), 0.0], [float("inf"), 0.0], [float("-inf"), 0.0], [float("inf"), float("-inf")],
], ids=["nan", "inf", "-inf", "inf_and_-inf"])
def test_engine_refuses_nonfinite_gradients_and_keeps_its_state(dtype, values):
    template = {"a": torch.zeros(3, dtype=dtype), "b": torch.zeros(2, dtype=dtype)}
    noise_fn, state = _engine(template, blt_strategy(max_buffers=2))
    bad = {"a": torch.zeros(3, dtype=dtype), "b": torch.tensor(values, dtype=dtype)}
    with pytest.raises(ValueError, match=r"NaN or inf \(in \['b'\]\)"):
        noise_fn(clipped(bad, 1.0), state)
    assert state.is_current and state.step == 0
    noisy, state = noise_fn(clipped({k: torch.zeros_like(v) for k, v in template.items()}, 1.0), state)
    assert state.step == 1


def test_engine_accepts_huge_finite_gradients_whose_sum_overflows():
    # The finiteness check sums each leaf: 4 x 3e38 overflows to inf in float32 although every
    # element is finite. It must fall back to the exact check, not refuse the step.
    noise_fn, state = _engine({"w": torch.zeros(4)})
    grads = torch.full((4,), 3e38)
    noisy, _ = noise_fn(clipped({"w": grads}, 1.0), state)
    assert torch.all(torch.isfinite(noisy.pytree["w"]))
    torch.testing.assert_close(noisy.pytree["w"], grads, rtol=1e-6, atol=0)


@pytest.mark.parametrize("value", [1e-30, 1e-40, 1e-45], ids=["tiny", "denormal", "smallest_denormal"])
def test_engine_tiny_and_denormal_gradients_get_the_same_noise(value):
    noise_fn, state = _engine({"w": torch.zeros(5)}, blt_strategy(max_buffers=2))
    zero, _ = noise_fn(clipped({"w": torch.zeros(5)}, 1.0), state.copy(draws="replay"))
    tiny, _ = noise_fn(clipped({"w": torch.full((5,), value)}, 1.0), state)
    # The noise does not depend on the gradient; g + x rounds to x for |g| << |x|.
    torch.testing.assert_close(tiny.pytree["w"], zero.pytree["w"] + value, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Noise engine: layouts, devices, dtypes


def test_engine_zero_size_leaves():
    template = {"empty": torch.zeros(0), "matrix_0": torch.zeros(2, 0), "w": torch.zeros(3)}
    noise_fn, state = _engine(template, blt_strategy(max_buffers=2), n_steps=2)
    for _ in range(2):
        noisy, state = noise_fn(clipped({k: torch.zeros_like(v) for k, v in template.items()}, 1.0), state)
        assert {k: tuple(v.shape) for k, v in noisy.pytree.items()} == {"empty": (0,), "matrix_0": (2, 0), "w": (3,)}
        assert torch.all(noisy.pytree["w"] != 0)


def test_engine_template_of_only_zero_size_leaves():
    noise_fn, state = _engine({"empty": torch.zeros(0)}, n_steps=1)
    noisy, state = noise_fn(clipped({"empty": torch.zeros(0)}, 1.0), state)
    assert noisy.pytree["empty"].shape == (0,)
    with pytest.raises(NoiseHorizonError, match=r"step 2 \(1-based\) .* n_steps=1"):
        noise_fn(clipped({"empty": torch.zeros(0)}, 1.0), state)


def test_engine_non_contiguous_and_channels_last_gradients_get_the_same_noise():
    template = {"w": torch.zeros(3, 4), "conv": torch.zeros(2, 3, 4, 5)}
    noise_fn, state = _engine(template, blt_strategy(max_buffers=2))
    torch.manual_seed(1)
    w, conv = torch.randn(4, 3).t(), torch.randn(2, 3, 4, 5)
    assert not w.is_contiguous()
    odd = {"w": w, "conv": conv.contiguous(memory_format=torch.channels_last)}
    plain = {"w": w.contiguous(), "conv": conv.contiguous()}
    a, _ = noise_fn(clipped(odd, 1.0), state.copy(draws="replay"))
    b, _ = noise_fn(clipped(plain, 1.0), state)
    for name in template:
        assert torch.equal(a.pytree[name], b.pytree[name])
        assert a.pytree[name].shape == template[name].shape


def test_engine_gradients_on_another_device_are_refused_before_touching_state():
    # CPU-only machine: the "meta" device stands in for a mismatching accelerator.
    noise_fn, state = _engine({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"gradient 'w' is on meta but the noise engine is on cpu"):
        noise_fn(clipped({"w": torch.zeros(3, device="meta")}, 1.0), state)
    assert state.is_current
    noise_fn(clipped({"w": torch.zeros(3)}, 1.0), state)


def test_engine_refuses_meta_and_mixed_device_templates():
    with pytest.raises(ValueError, match=r"cannot draw noise on device meta"):
        _engine({"w": torch.zeros(3, device="meta")})
    with pytest.raises(ValueError, match=r"several devices"):
        _engine({"a": torch.zeros(3), "b": torch.zeros(3, device="meta")})


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_engine_half_precision_parameters_get_the_float32_noised_value_rounded_once(dtype):
    # A half-precision template: the noised gradients come back in its dtype, whether the
    # gradients are half precision or float32 (clipped_grad's sums); the value is the float32
    # engine's output rounded once.
    strategy = blt_strategy(max_buffers=2)
    noise_fn, state = _engine({"w": torch.zeros(64, dtype=dtype)}, strategy, n_steps=3)
    wide_fn, wide_state = _engine({"w": torch.zeros(64, dtype=dtype)}, strategy, n_steps=3)
    full_fn, full_state = _engine({"w": torch.zeros(64)}, strategy, n_steps=3)
    grads = torch.linspace(-1, 1, 64).to(dtype).float()  # values exact in both dtypes
    for _ in range(3):
        half, state = noise_fn(clipped({"w": grads.to(dtype)}, 1.0), state)
        wide, wide_state = wide_fn(clipped({"w": grads}, 1.0), wide_state)
        full, full_state = full_fn(clipped({"w": grads}, 1.0), full_state)
        assert half.pytree["w"].dtype == wide.pytree["w"].dtype == dtype
        assert full.pytree["w"].dtype == torch.float32
        assert torch.equal(half.pytree["w"], full.pytree["w"].to(dtype))
        assert torch.equal(wide.pytree["w"], full.pytree["w"].to(dtype))


# ---------------------------------------------------------------------------------------------
# Degenerate participation contexts and strategies


@pytest.mark.parametrize("strategy", [identity_strategy(), blt_strategy(max_buffers=3)], ids=["identity", "blt"])
def test_single_step_run(strategy):
    mechanism = strategy.resolve(1)
    assert mechanism.sensitivity == pytest.approx(1.0, rel=1e-12)
    accountant = dpftrl_acc.mf_gaussian(2.0, strategy, n_steps=1)
    assert accountant.epsilon_at(1e-5) == pytest.approx(gaussian(2.0).epsilon_at(1e-5), rel=1e-9)
    noise_fn, state = _engine({"w": torch.zeros(4)}, strategy, n_steps=1)
    noise_fn.check_accounted_by(dpftrl_acc.mf_gaussian(1.0, strategy, n_steps=1))
    noisy, state = noise_fn(clipped({"w": torch.zeros(4)}, 1.0), state)
    with pytest.raises(NoiseHorizonError, match=r"n_steps=1"):
        noise_fn(clipped({"w": torch.zeros(4)}, 1.0), state)


def test_min_sep_equal_to_n_steps_is_single_participation():
    n = 12
    strategy = blt_strategy(max_buffers=3)
    separated = strategy.resolve(n, n)
    single = strategy.resolve(n, 1, 1)
    assert separated.participation.effective_participations == 1
    assert separated.sensitivity == pytest.approx(single.sensitivity, rel=1e-12)
    matrix = lower_toeplitz(blt_coefs(separated.theta, separated.omega, n))
    assert separated.sensitivity ** 2 == pytest.approx(brute_force_sensitivity_squared(matrix, n), rel=1e-12)
    assert identity_strategy().resolve(n, n).sensitivity == 1.0


def test_one_buffer_strategy_is_valid_and_runs():
    n, b = 12, 3
    mechanism = blt_strategy(max_buffers=1).resolve(n, b)
    assert mechanism.num_buffers == 1
    blt.check_minsep_preconditions(mechanism.params)
    matrix = lower_toeplitz(blt_coefs(mechanism.theta, mechanism.omega, n))
    assert mechanism.sensitivity ** 2 == pytest.approx(brute_force_sensitivity_squared(matrix, b), rel=1e-10)
    noise_fn, state = _engine({"w": torch.zeros(2)}, blt_strategy(max_buffers=1), n_steps=n, min_sep=b)
    for _ in range(n):
        _, state = noise_fn(clipped({"w": torch.zeros(2)}, 1.0), state)


# ---------------------------------------------------------------------------------------------
# Decays that round to 1.0 in float32


def _is_float32_exact(values) -> bool:
    values = np.asarray(values, dtype=np.float64)
    return bool(np.array_equal(values.astype(np.float32).astype(np.float64), values))


def test_decay_rounding_to_one_in_float32_runs_the_accounted_mechanism():
    n = 10
    raw = blt.BLTParams(np.array([1.0 - 5.7e-11, 0.5]), np.array([0.1, 0.3]))
    assert np.float32(raw.theta[0]) == 1.0  # as theta, the decay would be lost in float32
    params = blt.round_for_float32(raw)
    mechanism = mechanism_from_blt(params, Participation(n, 1, 1))
    assert _is_float32_exact(mechanism.one_minus_theta) and _is_float32_exact(mechanism.omega)
    assert np.all(mechanism.one_minus_theta > 0)
    matrix = dense_blt_matrix(mechanism.omega, mechanism.one_minus_theta, n)
    assert mechanism.sensitivity ** 2 == pytest.approx(brute_force_sensitivity_squared(matrix, 1, 1), rel=1e-12)

    # The float32 engine accepts it and streams exactly C^{-1} z of these parameters: the
    # identity engine with the same key, template and path gives z itself.
    template = {"w": torch.zeros(256)}
    noise_fn, state = _engine(template, mechanism, n_steps=n, min_sep=1, max_participations=1)
    ident_fn, ident_state = _engine(template, identity_strategy(), n_steps=n, min_sep=1, max_participations=1)
    rows, draws = [], []
    for _ in range(n):
        out, state = noise_fn(clipped({"w": torch.zeros(256)}, 1.0), state)
        z, ident_state = ident_fn(clipped({"w": torch.zeros(256)}, 1.0), ident_state)
        rows.append(out.pytree["w"].double().numpy())
        draws.append(z.pytree["w"].double().numpy())
    expected = dense_inverse_apply(matrix, np.stack(draws))
    np.testing.assert_allclose(np.stack(rows), expected, rtol=0, atol=1e-5)


def test_decay_not_float32_exact_is_refused_by_the_float32_engine():
    raw = blt.BLTParams(np.array([1.0 - 5.7e-11, 0.5]), np.array([0.1, 0.3]))
    mechanism = mechanism_from_blt(raw, Participation(4, 1, 1))
    with pytest.raises(ValueError, match=r"not exactly representable in torch.float32"):
        _engine({"w": torch.zeros(2)}, mechanism, n_steps=4, min_sep=1, max_participations=1)
    _engine({"w": torch.zeros(2)}, mechanism, n_steps=4, min_sep=1, max_participations=1, dtype=torch.float64)


def test_resolved_near_one_decays_are_float32_exact():
    mechanism = blt_strategy(max_buffers=3).resolve(16, 4)
    assert 1.0 - mechanism.theta.max() < 1e-6  # this context does push a decay next to 1
    assert _is_float32_exact(mechanism.one_minus_theta) and _is_float32_exact(mechanism.omega)
    noise_fn, _ = _engine({"w": torch.zeros(2)}, blt_strategy(max_buffers=3), n_steps=16, min_sep=4)
    assert noise_fn.mechanism.fingerprint == mechanism.fingerprint


# ---------------------------------------------------------------------------------------------
# A learning-rate schedule that changes between accounting and noise


def test_schedule_changed_between_accounting_and_noise_is_detected():
    n = 8
    values = [1.0] * n

    def schedule(step):  # a callable whose values the user mutates (e.g. a config edited later)
        return values[step]

    strategy = blt_strategy(max_buffers=2, lr_schedule=schedule)
    accountant = dpftrl_acc.mf_gaussian(1.0, strategy, n_steps=n)
    values[:] = [1.0] * (n // 2) + [0.1] * (n // 2)          # the schedule changes in between
    noise_fn, _ = _engine({"w": torch.zeros(2)}, strategy, n_steps=n)

    # How a user detects it: the two resolutions have different fingerprints ...
    assert accountant.mechanism.schedule_fingerprint != noise_fn.mechanism.schedule_fingerprint
    assert accountant.mechanism.fingerprint != noise_fn.mechanism.fingerprint
    # ... and the engine's explicit check raises.
    with pytest.raises(ValueError, match=r"accounting and noise disagree \(mechanism:"):
        noise_fn.check_accounted_by(accountant)

    # The safe pattern: build the noise from the mechanism the accountant priced.
    safe_fn, _ = _engine({"w": torch.zeros(2)}, accountant.mechanism, n_steps=n)
    safe_fn.check_accounted_by(accountant)
    assert safe_fn.mechanism.fingerprint == accountant.mechanism.fingerprint


def test_accounting_with_another_noise_multiplier_is_detected():
    noise_fn, _ = _engine({"w": torch.zeros(2)}, identity_strategy(), n_steps=4)  # sigma = 1
    with pytest.raises(ValueError, match=r"noise_multiplier: accountant 2.0, noise 1.0"):
        noise_fn.check_accounted_by(dpftrl_acc.mf_gaussian(2.0, identity_strategy(), n_steps=4))
