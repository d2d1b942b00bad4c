"""clipped_grad: per-example gradients against a loop of batch-size-1 autograd gradients,
clipping arithmetic (3-4-5 triangles), non-finite handling, sensitivity, state purity."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import functional_call

from opake.dpftrl.clipping import (
    ClipState,
    LossShapeError,
    NonFiniteGradientError,
    clipped_grad,
)
from opake.types import ClippedPytree


def _data(shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(loss_fn, params, per_example, shared=(), clipping_norm=1.0, normalize_by=1.0):
    """Loop over examples: torch.autograd.grad of each one, global-norm clip in float64, sum."""
    names = list(params)
    total = {name: torch.zeros_like(params[name], dtype=torch.float64) for name in names}
    batch_size = per_example[0].shape[0]
    for index in range(batch_size):
        leaves = {name: params[name].detach().clone().requires_grad_(True) for name in names}
        loss = loss_fn(leaves, *(arg[index] for arg in per_example), *shared)
        grads = torch.autograd.grad(loss, [leaves[name] for name in names], allow_unused=True)
        grads = [torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        factor = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
        for name, g in zip(names, grads):
            total[name] += g.double() * factor
    return {name: value / normalize_by for name, value in total.items()}


def _assert_close(actual: dict, expected: dict, rtol, atol=1e-12):
    assert set(actual) == set(expected)
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        torch.testing.assert_close(actual[name].double(), expected[name], rtol=rtol, atol=atol)


def _regression_loss(params, x, y):
    prediction = torch.tanh(x @ params["w"] + params["b"])  # x: (3,), one example
    return torch.nn.functional.mse_loss(prediction, y)  # mean over the 2 outputs


def _regression_setup(batch_size, dtype=torch.float64, seed=0):
    params = {"w": _data((3, 2), seed, dtype) * 2, "b": _data((2,), seed + 1, dtype)}
    x = _data((batch_size, 3), seed + 2, dtype) * 3
    y = _data((batch_size, 2), seed + 3, dtype)
    return params, x, y


# --- agreement with the loop --------------------------------------------------------------------


@pytest.mark.parametrize("clipping_norm", [0.05, 0.5, 100.0])
@pytest.mark.parametrize("batch_size", [1, 7])
def test_matches_loop_of_single_example_gradients(clipping_norm, batch_size):
    params, x, y = _regression_setup(batch_size)
    grad_fn, state = clipped_grad(lambda p, xy: _regression_loss(p, *xy), clipping_norm)
    grads, state = grad_fn(params, (x, y), state=state)
    assert isinstance(grads, ClippedPytree)
    assert grads.l2_bound == clipping_norm and grads.normalization == 1.0
    expected = _reference(_regression_loss, params, (x, y), clipping_norm=clipping_norm)
    _assert_close(grads.pytree, expected, rtol=1e-10)
    assert (state.steps, state.examples) == (1, batch_size)


def test_float32_params_match_float64_loop():
    params64, x64, y64 = _regression_setup(5)
    params = {name: value.float() for name, value in params64.items()}
    grad_fn, state = clipped_grad(lambda p, x, y: _regression_loss(p, x, y), 0.3, batch_argnums=(1, 2))
    grads, _ = grad_fn(params, x64.float(), y64.float(), state=state)
    assert all(value.dtype == torch.float32 for value in grads.pytree.values())
    expected = _reference(_regression_loss, params, (x64.float(), y64.float()), clipping_norm=0.3)
    _assert_close(grads.pytree, expected, rtol=1e-5, atol=1e-6)


def test_float64_params_keep_float64():
    params, x, y = _regression_setup(4)
    grad_fn, state = clipped_grad(lambda p, x, y: _regression_loss(p, x, y), 0.2, batch_argnums=(1, 2))
    grads, _ = grad_fn(params, x, y, state=state)
    assert all(value.dtype == torch.float64 for value in grads.pytree.values())
    _assert_close(grads.pytree, _reference(_regression_loss, params, (x, y), clipping_norm=0.2), rtol=1e-12)


def test_single_tensor_params():
    weights = _data((4,), 5)
    inputs = _data((6, 4), 6)

    def loss_fn(w, x):
        return torch.log1p(torch.exp(x @ w))

    grad_fn, state = clipped_grad(loss_fn, 0.7)
    grads, _ = grad_fn(weights, inputs, state=state)
    assert isinstance(grads.pytree, torch.Tensor) and grads.pytree.shape == (4,)
    expected = _reference(lambda p, x: loss_fn(p["w"], x), {"w": weights}, (inputs,), clipping_norm=0.7)
    torch.testing.assert_close(grads.pytree, expected["w"], rtol=1e-12, atol=1e-12)


def test_module_parameters_through_functional_call():
    torch_generator = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch_generator))
    params = dict(model.named_parameters())  # leaves require grad
    before = {name: value.detach().clone() for name, value in params.items()}
    inputs = torch.randn(6, 3, generator=torch_generator)
    labels = torch.tensor([0, 3, 1, 2, 2, 0])

    def loss_fn(params, example):
        x, label = example  # x: (3,), label: ()
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, label.unsqueeze(0))  # mean over 1

    grad_fn, state = clipped_grad(loss_fn, clipping_norm=0.8)
    grads, state = grad_fn(params, (inputs, labels), state=state)

    # Independent reference: the model itself on batches of one, autograd over .parameters().
    expected = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in params.items()}
    clipped = 0
    for index in range(6):
        loss = torch.nn.functional.cross_entropy(model(inputs[index : index + 1]), labels[index : index + 1])
        per_example = torch.autograd.grad(loss, list(model.parameters()))
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in per_example))
        clipped += norm > 0.8
        for name, g in zip(params, per_example):
            expected[name] += g.double() * min(1.0, 0.8 / norm)
    _assert_close(grads.pytree, expected, rtol=1e-5, atol=1e-6)
    assert state.clipped_examples == clipped
    assert all(not value.requires_grad for value in grads.pytree.values())
    for name, value in model.named_parameters():
        assert value.grad is None and torch.equal(value.detach(), before[name])


def test_batch_argnums_with_a_broadcast_argument():
    params, x, y = _regression_setup(5)
    temperature = torch.tensor(1.7, dtype=torch.float64)

    def loss_fn(p, x, temperature, y):
        return _regression_loss(p, x / temperature, y)

    grad_fn, state = clipped_grad(loss_fn, 0.4, batch_argnums=(1, 3))
    grads, _ = grad_fn(params, x, temperature, y, state=state)
    expected = _reference(lambda p, x, y, t: loss_fn(p, x, t, y), params, (x, y), shared=(temperature,), clipping_norm=0.4)
    _assert_close(grads.pytree, expected, rtol=1e-12)

    # A non-batched argument may also have a leading dimension of another size.
    table = _data((9, 3), 8)
    grad_fn, state = clipped_grad(lambda p, x, t: _regression_loss(p, x + t.sum(0), x[:2]), 0.4, batch_argnums=1)
    grads, _ = grad_fn(params, x, table, state=state)
    expected = _reference(lambda p, x, t: _regression_loss(p, x + t.sum(0), x[:2]), params, (x,), shared=(table,), clipping_norm=0.4)
    _assert_close(grads.pytree, expected, rtol=1e-12)


def test_normalize_by_divides_the_sum():
    params, x, y = _regression_setup(6)
    loss_fn = lambda p, xy: _regression_loss(p, *xy)  # noqa: E731
    plain, _ = clipped_grad(loss_fn, 0.5)[0](params, (x, y), state=ClipState())
    normalized, _ = clipped_grad(loss_fn, 0.5, normalize_by=8)[0](params, (x, y), state=ClipState())
    assert normalized.normalization == 8.0 and normalized.sensitivity == 0.5 / 8
    _assert_close(normalized.pytree, {k: v / 8 for k, v in plain.pytree.items()}, rtol=1e-14)


# --- clipping arithmetic ------------------------------------------------------------------------


def _dot_loss(w, g):
    return (w * g).sum()  # gradient with respect to w is g


@pytest.mark.parametrize(
    "clipping_norm, expected, clipped",
    [
        (10.0, [3.0, 4.0], 0),  # below the bound: unchanged
        (5.0, [3.0, 4.0], 0),  # exactly at the bound: unchanged, not counted as clipped
        (2.5, [1.5, 2.0], 1),  # above: scaled by 2.5 / 5
        (1.0, [0.6, 0.8], 1),
    ],
)
def test_three_four_five(clipping_norm, expected, clipped):
    grad_fn, state = clipped_grad(_dot_loss, clipping_norm)
    grads, state = grad_fn(torch.zeros(2, dtype=torch.float64), torch.tensor([[3.0, 4.0]], dtype=torch.float64), state=state)
    torch.testing.assert_close(grads.pytree, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)
    assert state.clipped_examples == clipped


def test_clipping_uses_the_norm_over_all_leaves():
    # Leaf a gets gradient 3, leaf b gets 4: global norm 5, so C = 1 gives 0.6 and 0.8 (a
    # per-leaf clip would give 1 and 1). A second example (0, 0) contributes nothing, no NaN.
    def loss_fn(p, g):
        return p["a"] * g[0] + p["b"] * g[1]

    params = {"a": torch.tensor(0.0, dtype=torch.float64), "b": torch.tensor(0.0, dtype=torch.float64)}
    grad_fn, state = clipped_grad(loss_fn, 1.0)
    grads, state = grad_fn(params, torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64), state=state)
    assert grads.pytree["a"].shape == () and float(grads.pytree["a"]) == pytest.approx(0.6, abs=1e-15)
    assert float(grads.pytree["b"]) == pytest.approx(0.8, abs=1e-15)
    assert (state.examples, state.clipped_examples) == (2, 1)


def test_sum_of_several_examples():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    per_example = torch.tensor([[3.0, 4.0], [0.0, 5.0], [0.3, 0.4]], dtype=torch.float64)
    grads, state = grad_fn(torch.zeros(2, dtype=torch.float64), per_example, state=state)
    torch.testing.assert_close(grads.pytree, torch.tensor([0.6 + 0.0 + 0.3, 0.8 + 1.0 + 0.4], dtype=torch.float64))
    assert state.clipped_examples == 2 and state.clipped_fraction == pytest.approx(2 / 3)


def test_finite_gradient_whose_norm_overflows_float32_is_clipped_not_dropped():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    per_example = torch.tensor([[3e30, 4e30], [3e38, 3e38]], dtype=torch.float32)
    grads, state = grad_fn(torch.zeros(2), per_example, state=state)
    torch.testing.assert_close(grads.pytree, torch.tensor([0.6 + 2**-0.5, 0.8 + 2**-0.5]), rtol=1e-6, atol=0)
    assert (state.clipped_examples, state.nonfinite_examples) == (2, 0)


def test_half_precision_parameters_are_summed_in_float32():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    per_example = torch.tensor([[300.0, 400.0], [0.03, 0.04]], dtype=torch.float16)
    grads, state = grad_fn(torch.zeros(2, dtype=torch.float16), per_example, state=state)
    assert grads.pytree.dtype == torch.float32
    # (0.6, 0.8) + the float16 values of (0.03, 0.04), to float32 rounding.
    expected = torch.tensor([0.6, 0.8], dtype=torch.float64) + per_example[1].double()
    torch.testing.assert_close(grads.pytree.double(), expected, rtol=1e-7, atol=0)


def test_a_zero_size_batch_of_half_precision_parameters_gives_float32_zeros():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    grads, _ = grad_fn(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.bfloat16), state=state)
    assert grads.pytree.dtype == torch.float32 and torch.equal(grads.pytree, torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sum_has_the_sensitivity_of_one_clipped_example(dtype):
    # Neighbouring batches (one example removed) must give sums at most C / normalize_by apart;
    # brute force over every removable example. The sum of 512 examples in one direction is
    # about C: rounding that to 8 (bf16) or 11 (fp16) bits moves it by more than one example's
    # C / 512, which the negative control shows, so the float32 sum is what keeps the bound.
    batch, width, bound = 512, 64, 1.0
    generator = torch.Generator().manual_seed(3)
    per_example = (0.05 + 0.1 * torch.randn(batch, width, generator=generator)).to(dtype)
    grad_fn, state = clipped_grad(_dot_loss, bound, normalize_by=batch)
    params = torch.zeros(width, dtype=dtype)
    full, _ = grad_fn(params, per_example, state=state)
    worst = worst_rounded = 0.0
    for removed in range(batch):
        rest = torch.cat([per_example[:removed], per_example[removed + 1:]])
        neighbour, _ = grad_fn(params, rest, state=state)
        worst = max(worst, (full.pytree.double() - neighbour.pytree.double()).norm().item())
        rounded = full.pytree.to(dtype).double() - neighbour.pytree.to(dtype).double()
        worst_rounded = max(worst_rounded, rounded.norm().item())
    assert worst <= bound / batch * (1 + 1e-5)
    # Negative control: a half-precision sum breaks the bound (bf16 by ~10%, fp16 by ~1%).
    assert worst_rounded > bound / batch * (1 + 1e-3)


# --- sensitivity (property) --------------------------------------------------------------------

_vectors = st.lists(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=3, max_size=3),
    min_size=1,
    max_size=6,
)


@given(per_example=_vectors, clipping_norm=st.floats(1e-3, 1e3), removed=st.integers(0, 5))
def test_one_example_moves_the_sum_by_at_most_the_clipping_norm(per_example, clipping_norm, removed):
    removed %= len(per_example)
    grad_fn, state = clipped_grad(_dot_loss, clipping_norm)
    params = torch.zeros(3, dtype=torch.float64)
    batch = torch.tensor(per_example, dtype=torch.float64)
    full, _ = grad_fn(params, batch, state=state)
    without, _ = grad_fn(params, torch.cat([batch[:removed], batch[removed + 1 :]]), state=state)
    alone, _ = grad_fn(params, batch[removed : removed + 1], state=state)
    bound = clipping_norm * (1 + 1e-12)
    assert float(torch.linalg.vector_norm(full.pytree - without.pytree)) <= bound + 1e-9
    assert float(torch.linalg.vector_norm(alone.pytree)) <= bound
    # And the contribution is the example itself when it is within the bound.
    norm = float(torch.linalg.vector_norm(batch[removed]))
    if norm <= clipping_norm:
        torch.testing.assert_close(alone.pytree, batch[removed], rtol=0, atol=0)


@given(scale=st.floats(1e-6, 1e6), clipping_norm=st.floats(1e-3, 1e3))
def test_float32_clipped_norm_is_within_rounding_of_the_bound(scale, clipping_norm):
    per_example = (_data((4, 50), 11, torch.float32) * scale)
    grad_fn, state = clipped_grad(_dot_loss, clipping_norm)
    for index in range(4):
        alone, _ = grad_fn(torch.zeros(50), per_example[index : index + 1], state=state)
        assert float(torch.linalg.vector_norm(alone.pytree.double())) <= clipping_norm * (1 + 1e-6)


# --- empty batches, non-finite gradients -----------------------------------------------------


def test_empty_batch_gives_zeros_with_the_right_structure():
    def loss_fn(params, x):
        raise AssertionError("loss_fn must not be called for an empty batch")

    params = {"w": torch.ones(3, 2, dtype=torch.float64), "nested": [torch.ones(4, dtype=torch.float32)]}
    grad_fn, state = clipped_grad(loss_fn, 1.0, normalize_by=4)
    grads, new_state = grad_fn(params, torch.zeros(0, 5), state=state)
    assert grads.pytree["w"].shape == (3, 2) and grads.pytree["w"].dtype == torch.float64
    assert grads.pytree["nested"][0].dtype == torch.float32 and not grads.pytree["nested"][0].any()
    assert not grads.pytree["w"].any() and grads.normalization == 4.0
    assert new_state == ClipState(steps=1, examples=0, clipped_examples=0, nonfinite_examples=0)


def _poisoned(value):
    return torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, value], [0.1, 0.1]], dtype=torch.float64)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises_naming_the_example(value):
    def loss_fn(params, g):
        return (params["layer.weight"] * g).sum()

    grad_fn, state = clipped_grad(loss_fn, 1.0)
    with pytest.raises(NonFiniteGradientError, match=r"example 2 .*not finite in 'layer\.weight'.*nonfinite='zero'"):
        grad_fn({"layer.weight": torch.zeros(2, dtype=torch.float64)}, _poisoned(value), state=state)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_zero_mode_drops_and_counts_the_example(value):
    grad_fn, state = clipped_grad(_dot_loss, 1.0, nonfinite="zero")
    grads, state = grad_fn(torch.zeros(2, dtype=torch.float64), _poisoned(value), state=state)
    torch.testing.assert_close(grads.pytree, torch.tensor([0.6 + 1.0 + 0.1, 0.8 + 0.0 + 0.1], dtype=torch.float64))
    assert torch.isfinite(grads.pytree).all()
    assert (state.examples, state.clipped_examples, state.nonfinite_examples) == (4, 1, 1)


def test_nonfinite_message_lists_several_examples():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    batch = torch.full((8, 2), float("nan"))
    batch[0] = 1.0
    with pytest.raises(NonFiniteGradientError, match=r"example 1 .*examples: 1, 2, 3, 4, 5 and 2 more"):
        grad_fn(torch.zeros(2), batch, state=state)


# --- state --------------------------------------------------------------------------------------


def test_grad_fn_is_pure_in_its_state():
    params, x, y = _regression_setup(5)
    grad_fn, state0 = clipped_grad(lambda p, xy: _regression_loss(p, *xy), 0.1)
    first, state1 = grad_fn(params, (x, y), state=state0)
    second, state1_again = grad_fn(params, (x, y), state=state0)
    assert state0 == ClipState()
    assert state1 == state1_again == ClipState(steps=1, examples=5, clipped_examples=state1.clipped_examples)
    for name in first.pytree:
        assert torch.equal(first.pytree[name], second.pytree[name])
    _, state2 = grad_fn(params, (x[:2], y[:2]), state=state1)
    assert (state2.steps, state2.examples) == (2, 7)
    with pytest.raises(AttributeError):
        state2.steps = 0


# --- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"clipping_norm": 0.0}, ValueError, "clipping_norm must be finite and > 0"),
        ({"clipping_norm": -1.0}, ValueError, "clipping_norm must be finite and > 0"),
        ({"clipping_norm": float("inf")}, ValueError, "clipping_norm must be finite"),
        ({"clipping_norm": float("nan")}, ValueError, "clipping_norm must be finite"),
        ({"clipping_norm": "1"}, TypeError, "clipping_norm must be a real number"),
        ({"clipping_norm": True}, TypeError, "clipping_norm must be a real number"),
        ({"normalize_by": 0}, ValueError, "normalize_by must be finite and > 0"),
        ({"normalize_by": float("inf")}, ValueError, "normalize_by must be finite"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of"),
        ({"batch_argnums": 0}, ValueError, "position 0 is params"),
        ({"batch_argnums": (1, -1)}, ValueError, "negative positions"),
        ({"batch_argnums": ()}, ValueError, "batch_argnums is empty"),
        ({"batch_argnums": (1, 1)}, ValueError, "repeated positions"),
        ({"batch_argnums": "1"}, TypeError, "batch_argnums must be an int or a sequence"),
        ({"batch_argnums": (1.0,)}, TypeError, "batch_argnums must hold ints"),
    ],
)
def test_factory_argument_errors(kwargs, error, pattern):
    arguments = {"clipping_norm": 1.0, **kwargs}
    with pytest.raises(error, match=pattern):
        clipped_grad(_dot_loss, **arguments)


def test_loss_fn_must_be_callable():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        clipped_grad("loss", 1.0)


def test_call_errors():
    grad_fn, state = clipped_grad(_dot_loss, 1.0)
    with pytest.raises(TypeError, match="state must be the ClipState"):
        grad_fn(torch.zeros(2), torch.zeros(3, 2), state=None)
    with pytest.raises(TypeError, match="state"):
        grad_fn(torch.zeros(2), torch.zeros(3, 2))  # state is required
    with pytest.raises(ValueError, match=r"refers to argument 1 of loss_fn, but grad_fn got only 0"):
        grad_fn(torch.zeros(2), state=state)
    with pytest.raises(ValueError, match="0-dim tensor; per-example arguments are split along dim 0"):
        grad_fn(torch.zeros(2), torch.tensor(1.0), state=state)
    with pytest.raises(TypeError, match="per-example argument 1 at '1' is int, not a tensor"):
        grad_fn(torch.zeros(2), (torch.zeros(3, 2), 5), state=state)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        grad_fn(torch.zeros(2), (torch.zeros(3, 2), torch.zeros(4)), state=state)
    with pytest.raises(TypeError, match="gradients need real floating-point parameters"):
        grad_fn(torch.zeros(2, dtype=torch.int64), torch.zeros(3, 2), state=state)
    with pytest.raises(TypeError, match=r"params leaves must be torch.Tensor.*named_parameters"):
        grad_fn({"w": [1.0, 2.0]}, torch.zeros(3, 2), state=state)


def test_loss_must_be_a_scalar_for_one_example():
    grad_fn, state = clipped_grad(lambda w, g: w * g, 1.0)  # forgot the reduction
    with pytest.raises(LossShapeError, match=r"real scalar \(0-dim\) tensor for one example, got \(2,\)"):
        grad_fn(torch.zeros(2), torch.zeros(3, 2), state=state)
