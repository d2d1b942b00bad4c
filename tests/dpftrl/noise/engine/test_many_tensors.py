"""Many small tensors: the batched step (one gather and one reduction for the NaN/inf check, one
split for the outputs, a precomputed cut into stretches, one add per leaf) gives exactly the
noise of each leaf alone, whatever the dtypes, shapes, strides and cache-blocking; a NaN or inf
is reported by the path of the tensor that has it, and the state stays usable."""

from __future__ import annotations

import zlib

import optree
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.noise.engine.segments import GATHER_CHECK_MEAN
from opake.dpftrl.noise.engine.streaming import BufferedInverse
from opake.errors import InvalidArgumentError
from opake.random import key
from opake.types import clipped
from engine_support import hand_blt

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _mixed_template(count: int = 150) -> dict:
    """Leaves of every kind the step meets: 1-D, 2-D, 3-D, 0-d and empty, four dtypes."""
    template = {}
    for i in range(count):
        dtype = _DTYPES[i % 4] if i % 3 == 0 else torch.float32
        shape = [(7 + i,), (3, 5 + i % 7), (2, 3, 1 + i % 4), (), (0, 3)][i % 5]
        template[f"block{i // 10}/p{i:03d}"] = torch.zeros(shape, dtype=dtype)
    return template


def _gradients(template: dict, step: int, *, gradient_dtype=None, transposed: bool = False) -> dict:
    """Gradients that depend on (step, leaf name) only, not on the other leaves."""
    out = {}
    for name, leaf in template.items():
        generator = torch.Generator().manual_seed(1000 * step + zlib.crc32(name.encode()))
        value = torch.randn(leaf.shape, generator=generator, dtype=torch.float64).to(gradient_dtype or leaf.dtype)
        if transposed and value.dim() == 2 and min(value.shape) > 1:
            value = value.t().contiguous().t()  # same values, not contiguous
        out[name] = value
    return out


def _run(template: dict, steps: int, *, columns="default", monkeypatch=None, dtype=torch.float32, **grad_options):
    if columns != "default":
        import opake.dpftrl.noise.engine.correlated_noise as engine_module

        monkeypatch.setattr(engine_module, "columns_per_advance", lambda device: columns)
    noise_fn, state = mf_gaussian_noise(template, hand_blt("zero_decay"), n_steps=steps, noise_multiplier=1.5,
                                        key=key(11), dtype=dtype)
    outputs = []
    for step in range(steps):
        grads = _gradients(template, step, **grad_options)
        noisy, state = noise_fn(clipped(grads, 0.5, 2.0), state)
        outputs.append({name: leaf.clone() for name, leaf in noisy.pytree.items()})
    return outputs, state


@pytest.mark.parametrize("grad_options", [{}, {"gradient_dtype": torch.float32}, {"transposed": True},
                                          {"gradient_dtype": torch.bfloat16}])
def test_each_leaf_of_many_gets_exactly_its_noise_alone(grad_options):
    # zero_decay renormalizes every step: the per-step scalars of every kind are exercised.
    template = _mixed_template()
    together, _ = _run(template, 3, **grad_options)
    for name in list(template)[::7]:  # one-leaf engines for a sample of the leaves
        alone, _ = _run({name: template[name]}, 3, **grad_options)
        for step in range(3):
            assert together[step][name].dtype == template[name].dtype
            assert together[step][name].shape == template[name].shape
            assert torch.equal(together[step][name], alone[step][name]), (name, step)


@pytest.mark.parametrize("columns", [None, 2**16, 4099, 1000])
def test_cache_blocking_does_not_change_many_mixed_leaves(monkeypatch, columns):
    # Leaves longer than a stretch (cut into parts), many shorter ones (grouped), other dtypes
    # (scratch path) and non-contiguous gradients in between.
    template = _mixed_template(60)
    template["big"] = torch.zeros(3 * 4099 + 5)
    template["big_bf16"] = torch.zeros(2 * 1000 + 3, dtype=torch.bfloat16)
    reference, reference_state = _run(template, 3, columns=None, monkeypatch=monkeypatch, transposed=True)
    blocked, blocked_state = _run(template, 3, columns=columns, monkeypatch=monkeypatch, transposed=True)
    for step in range(3):
        for name in template:
            assert torch.equal(reference[step][name], blocked[step][name]), (name, step)
    assert torch.equal(reference_state.buffers, blocked_state.buffers)


def test_float64_compute_with_many_leaves_matches_each_leaf_alone():
    template = _mixed_template(40)
    together, _ = _run(template, 2, dtype=torch.float64)
    for name in list(template)[::5]:
        alone, _ = _run({name: template[name]}, 2, dtype=torch.float64)
        assert all(torch.equal(together[step][name], alone[step][name]) for step in range(2)), name


# -- NaN and inf: one reduction, then the offending path ------------------------------------------


def _many(count=200, size=50, dtype=torch.float32):
    return {f"layer{i:03d}/w": torch.zeros(size, dtype=dtype) for i in range(count)}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("size, dtype", [(50, torch.float32), (50, torch.bfloat16),
                                         (GATHER_CHECK_MEAN + 1, torch.float32)])
def test_a_nan_in_the_137th_tensor_is_reported_by_its_path_and_the_state_stays_usable(bad, size, dtype):
    count = 200 if size <= GATHER_CHECK_MEAN else 140  # gathered check, or one reduction per leaf
    template = _many(count, size, dtype)
    noise_fn, state = mf_gaussian_noise(template, hand_blt("three_buffers"), n_steps=2, noise_multiplier=1.0,
                                        key=key(3))
    assert noise_fn._plan.gather_check == (size <= GATHER_CHECK_MEAN)
    grads = {name: torch.ones_like(leaf) for name, leaf in template.items()}
    grads["layer136/w"] = grads["layer136/w"].clone()
    grads["layer136/w"][size // 2] = bad
    with pytest.raises(InvalidArgumentError, match=r"NaN or inf \(in \['layer136/w'\]\)"):
        noise_fn(clipped(grads, 1.0), state)
    # Nothing was advanced: the same state gives the noise a fresh engine gives.
    grads["layer136/w"] = torch.ones_like(template["layer136/w"])
    noisy, after = noise_fn(clipped(grads, 1.0), state)
    reference_fn, reference_state = mf_gaussian_noise(template, hand_blt("three_buffers"), n_steps=2,
                                                      noise_multiplier=1.0, key=key(3))
    reference, _ = reference_fn(clipped(grads, 1.0), reference_state)
    assert after.step == 1
    assert all(torch.equal(noisy.pytree[name], reference.pytree[name]) for name in template)


def test_several_bad_tensors_are_all_named():
    template = _many()
    noise_fn, state = mf_gaussian_noise(template, hand_blt("one_buffer"), n_steps=1, noise_multiplier=1.0, key=key(0))
    grads = {name: torch.ones_like(leaf) for name, leaf in template.items()}
    grads["layer007/w"] = torch.full_like(grads["layer007/w"], float("nan"))
    grads["layer199/w"] = torch.full_like(grads["layer199/w"], float("inf"))
    with pytest.raises(InvalidArgumentError, match=r"\['layer007/w', 'layer199/w'\]"):
        noise_fn(clipped(grads, 1.0), state)


@pytest.mark.parametrize("template_dtype, gradient, dtype", [
    (torch.float32, 3e38, torch.float32),    # finite, but the float32 sum overflows
    (torch.float16, 1e5, torch.float32),     # finite float32, inf once gathered into float16
    (torch.float32, 1e300, torch.float64),   # finite float64, inf once gathered into float32
])
def test_large_finite_gradients_are_not_refused(template_dtype, gradient, dtype):
    template = {f"p{i:03d}": torch.zeros(20, dtype=template_dtype) for i in range(30)}
    noise_fn, state = mf_gaussian_noise(template, hand_blt("one_buffer"), n_steps=1, noise_multiplier=1.0,
                                        key=key(0))
    grads = {name: torch.full((20,), gradient, dtype=dtype) for name in template}
    noisy, state = noise_fn(clipped(grads, 1.0), state)  # no error: the exact check finds nothing
    assert state.step == 1 and noisy.pytree["p000"].dtype == template_dtype


def test_a_step_of_many_tensors_syncs_with_the_host_once():
    template = _many()
    noise_fn, state = mf_gaussian_noise(template, hand_blt("three_buffers"), n_steps=3, noise_multiplier=1.0,
                                        key=key(0))
    grads = clipped({name: torch.ones_like(leaf) for name, leaf in template.items()}, 1.0)
    _, state = noise_fn(grads, state)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        noise_fn(grads, state)
    names = [event.name for event in profiler.events()]
    assert names.count("aten::item") == 1
    assert names.count("aten::sum") <= 1  # one reduction over the gathered gradients


def test_outputs_of_many_tensors_are_views_of_one_vector_in_the_template_shapes():
    template = {name: leaf for name, leaf in _mixed_template(50).items() if leaf.dtype == torch.float32}
    noise_fn, state = mf_gaussian_noise(template, hand_blt("one_buffer"), n_steps=1, noise_multiplier=1.0, key=key(0))
    noisy, _ = noise_fn(clipped(_gradients(template, 0), 1.0), state)
    leaves = optree.tree_leaves(noisy.pytree)
    storage = leaves[0].untyped_storage().data_ptr()
    offset = 0
    for (name, leaf), out in zip(template.items(), leaves):
        assert out.shape == leaf.shape and out.dtype == leaf.dtype and out.is_contiguous(), name
        if leaf.numel():  # an empty leaf has no elements to share
            assert out.untyped_storage().data_ptr() == storage and out.storage_offset() == offset, name
        offset += leaf.numel()


# -- the per-step BLT scalars, a window at a time --------------------------------------------------


def test_blt_step_scalars_do_not_depend_on_the_window_they_come_from():
    inverse = BufferedInverse((0.25, 0.125, 0.0625), (0.5, 2.0**-6, 1.0))  # periods 32, 1418, 1
    steps = [0, 1, 2, 31, 32, 33, 63, 64, 65, 1417, 1418, 5000, 12345, 2**40 + 17]
    shared = inverse.coefficients(torch.float32, torch.device("cpu"))
    for step in steps + steps[::-1]:
        read, renormalize, add = inverse.at_step(shared, step)
        fresh = inverse.at_step(inverse.coefficients(torch.float32, torch.device("cpu")), step)
        alone = inverse.coefficients(torch.float32, torch.device("cpu"))
        inverse.at_step(alone, max(step - 40, 0))  # a window that starts earlier, when it covers step
        windowed = inverse.at_step(alone, step)
        for other in (fresh, windowed):
            assert torch.equal(read, other[0]) and renormalize == other[1] and torch.equal(add, other[2]), step
        assert add.shape == (3, 1) and read.shape == (3,)


def test_output_views_without_torchs_unflatten_helper_are_the_same(monkeypatch):
    import opake.dpftrl.noise.engine.correlated_noise as engine_module

    template = _mixed_template(30)
    reference, _ = _run(template, 2)
    monkeypatch.setattr(engine_module, "_UNFLATTEN", None)
    fallback, _ = _run(template, 2)
    for step in range(2):
        for name, leaf in template.items():
            assert fallback[step][name].shape == leaf.shape
            assert torch.equal(reference[step][name], fallback[step][name]), (name, step)
