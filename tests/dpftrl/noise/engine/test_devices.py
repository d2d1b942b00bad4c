"""The engine's properties on every device this machine has: CPU always, CUDA where present.

The same assertions run on each device, so on a CPU-only machine they check the tests
themselves and the CPU path, and on a GPU machine the CUDA path (Philox draws, whole-span
updates, no huge-page hints). Values differ between device types (different generators), so
each device is compared with its own dense oracle and its own draws, never with the CPU.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from opake.dpftrl.noise import identity_strategy, mf_gaussian_noise
from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS, BlockSampler, path_code
from opake.dpftrl.noise.engine.state import RetiredStateError
from opake.random import key
from opake.types import clipped
from engine_support import dense_blt_matrix, dense_inverse_apply, flat, hand_blt, run_noise

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _template(device, dtype=torch.float32):
    return {"layer.weight": torch.zeros(3, 4, dtype=dtype, device=device),
            "layer.bias": torch.zeros(4, dtype=dtype, device=device)}


def _engine(device, strategy, n_steps, *, template=None, dtype=torch.float32, seed=7, sigma=1.0):
    template = _template(device, dtype) if template is None else template
    return mf_gaussian_noise(template, strategy, n_steps=n_steps, noise_multiplier=sigma, key=key(seed), dtype=dtype)


def _grads(device, step, dtype=torch.float32):
    generator = torch.Generator().manual_seed(500 + step)
    return {name: torch.randn(leaf.shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
            for name, leaf in _template("cpu").items()}


@pytest.mark.parametrize("device", DEVICES)
def test_dense_check_in_float64(device):
    n = 7
    recipe = hand_blt("near_one_decay")
    template = _template(device, torch.float64)
    noise_fn, state = _engine(device, recipe, n, template=template, dtype=torch.float64)
    assert state.buffers.device.type == device
    noise, _ = run_noise(noise_fn, state, template, n)
    identity_fn, identity_state = _engine(device, identity_strategy(), n, template=template, dtype=torch.float64)
    draws, _ = run_noise(identity_fn, identity_state, template, n)
    expected = dense_inverse_apply(dense_blt_matrix(recipe.omega, recipe.one_minus_theta, n), draws)
    np.testing.assert_allclose(noise, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_identity_noise_is_the_keyed_block_draws_of_the_device(device):
    template = {"w": torch.zeros(BLOCK_ELEMENTS + 10, device=device)}
    noise_fn, state = _engine(device, identity_strategy(), 2, template=template)
    sampler = BlockSampler(key(7), torch.device(device))
    for step in range(2):
        noisy, state = noise_fn(clipped({"w": torch.zeros_like(template["w"])}, 1.0), state)
        assert noisy.pytree["w"].device.type == device
        for block, length in ((0, BLOCK_ELEMENTS), (1, 10)):
            z = torch.empty(length, device=device)
            sampler.fill(z, step, path_code(("w",)), block)
            assert torch.equal(noisy.pytree["w"][block * BLOCK_ELEMENTS:][:length], z)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_does_not_depend_on_how_the_parameters_are_grouped(device):
    # Leaf "w" alone or next to other leaves (before and after it in the layout): same noise.
    alone = {"w": torch.zeros(1000, device=device)}
    crowded = {"a": torch.zeros(77, device=device), "w": torch.zeros(1000, device=device),
               "z": torch.zeros(5, device=device)}
    rows = []
    for template in (alone, crowded):
        noise_fn, state = _engine(device, hand_blt("three_buffers"), 3, template=template)
        leaf = []
        for _ in range(3):
            noisy, state = noise_fn(clipped({k: torch.zeros_like(v) for k, v in template.items()}, 1.0), state)
            leaf.append(noisy.pytree["w"])
        rows.append(torch.stack(leaf))
    assert torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("device", DEVICES)
def test_resume_from_a_saved_state_is_bit_identical(device):
    n, stop = 6, 2
    noise_fn, state = _engine(device, hand_blt("three_buffers"), n)
    uninterrupted = []
    for step in range(n):
        noisy, state = noise_fn(clipped(_grads(device, step), 0.5, 2.0), state)
        uninterrupted.append(flat(noisy.pytree))
    noise_fn, state = _engine(device, hand_blt("three_buffers"), n)
    resumed = []
    for step in range(stop):
        noisy, state = noise_fn(clipped(_grads(device, step), 0.5, 2.0), state)
        resumed.append(flat(noisy.pytree))
    saved = io.BytesIO()
    torch.save(state.state_dict(), saved)
    saved.seek(0)
    fresh_fn, fresh_state = _engine(device, hand_blt("three_buffers"), n)
    state = fresh_state.load_state_dict(torch.load(saved, weights_only=True), draws="replay")
    assert state.buffers.device.type == device
    for step in range(stop, n):
        noisy, state = fresh_fn(clipped(_grads(device, step), 0.5, 2.0), state)
        resumed.append(flat(noisy.pytree))
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))


@pytest.mark.parametrize("device", DEVICES)
def test_purity_a_copied_state_gives_the_same_step_and_a_retired_one_is_refused(device):
    noise_fn, state = _engine(device, hand_blt("three_buffers"), 3)
    grads = clipped(_grads(device, 0), 1.0)
    spare = state.copy(draws="replay")
    first, after = noise_fn(grads, state)
    again, after_again = noise_fn(grads, spare)
    assert torch.equal(flat(first.pytree), flat(again.pytree)) and torch.equal(after.buffers, after_again.buffers)
    with pytest.raises(RetiredStateError):
        noise_fn(grads, state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_with_float32_gradients(device, half):
    # What clipped_grad hands over for half-precision parameters: float32 sums. The output has
    # the template's dtype and is the float32 engine's value rounded once.
    template = _template(device, half)
    noise_fn, state = _engine(device, hand_blt("three_buffers"), 3, template=template)
    full_fn, full_state = _engine(device, hand_blt("three_buffers"), 3)
    for step in range(3):
        grads = clipped(_grads(device, step), 1.0)
        noisy, state = noise_fn(grads, state)
        full, full_state = full_fn(grads, full_state)
        for name in template:
            assert noisy.pytree[name].dtype == half and noisy.pytree[name].device.type == device
            assert torch.equal(noisy.pytree[name], full.pytree[name].to(half))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_gradients_are_refused_and_leave_the_state_usable(device):
    noise_fn, state = _engine(device, hand_blt("three_buffers"), 3)
    grads = _grads(device, 0)
    grads["layer.bias"][1] = math.nan
    before = state.buffers.clone()
    with pytest.raises(ValueError, match="NaN or inf"):
        noise_fn(clipped(grads, 1.0), state)
    other = "cpu" if device != "cpu" else ("meta")
    misplaced = {name: leaf.to(other) for name, leaf in _grads(device, 0).items()}
    with pytest.raises(ValueError, match="on"):
        noise_fn(clipped(misplaced, 1.0), state)
    assert torch.equal(state.buffers, before)
    noisy, state = noise_fn(clipped(_grads(device, 0), 1.0), state)
    assert state.step == 1


@pytest.mark.parametrize("device", DEVICES)
def test_identity_draws_have_the_stated_mean_and_variance(device):
    # 2**21 draws of N(0, 1) over two blocks: the sample mean has sd 2**-10.5, the sample
    # variance relative sd sqrt(2 / 2**21) ~ 9.8e-4. Bounds at 7 sd: false failure < 1e-11.
    size = 2**21
    noise_fn, state = _engine(device, identity_strategy(), 1, template={"w": torch.zeros(size, device=device)})
    noisy, _ = noise_fn(clipped({"w": torch.zeros(size, device=device)}, 1.0), state)
    draws = noisy.pytree["w"].double()
    assert abs(draws.mean().item()) < 7 * 2**-10.5
    assert abs(draws.var().item() - 1.0) < 7 * math.sqrt(2 / size)
    first, second = draws[:BLOCK_ELEMENTS], draws[BLOCK_ELEMENTS:]
    # Distinct blocks are independent: their correlation is within 7 sd (2**-10) of zero.
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 7 * 2**-10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_allocates_one_parameter_vector():
    d = 2**22 + 7
    template = {"a": torch.zeros(d - 100, device="cuda"), "b": torch.zeros(100, device="cuda")}
    noise_fn, state = _engine("cuda", hand_blt("three_buffers"), 3, template=template)
    grads = clipped({name: torch.ones_like(leaf) for name, leaf in template.items()}, 1.0)
    _, state = noise_fn(grads, state)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    kept = noise_fn(grads, state)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - baseline
    # The output (4 d bytes) plus allocator rounding; a (B, d) temporary would be 12 d bytes.
    assert 4 * d <= extra <= 4 * d + 2**21, extra / (4 * d)
    del kept
