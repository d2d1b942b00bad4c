"""Memory target: a noise step allocates at most one d-vector beyond the (B, d) buffers.

Measured with torch's profiler, which records every tensor allocation and release in order
(tracemalloc does not see torch's CPU allocator): the peak of the running total during one
step is the step's extra memory. The output the step returns is part of it.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opake.dpftrl.noise import mf_gaussian_noise
from opake.random import key
from opake.types import clipped
from engine_support import HandRecipe

D = 2**21 + 5  # two full noise blocks and a short third one
FOUR_BUFFERS = HandRecipe((0.25, 0.125, 0.0625, 0.03125), (0.5, 2.0**-6, 2.0**-12, 2.0**-30))


def _peak_allocated_bytes(function) -> int | None:
    """The peak of the running total of allocations while ``function`` runs; None when the profiler
    recorded no allocation at all (it now and then records none, in a process that has run other
    profiles: that is no measurement, not a peak of 0)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    if not events:
        return None
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _step_peak(template, grads, dtype=torch.float32, attempts: int = 3):
    """One noise step's peak, on a fresh engine for each attempt until the profiler sees allocations."""
    for _ in range(attempts):
        noise_fn, state = mf_gaussian_noise(template, FOUR_BUFFERS, n_steps=3, noise_multiplier=1.0, key=key(0),
                                            dtype=dtype)
        assert state.buffers.shape == (4, D)
        _, state = noise_fn(grads, state)  # warm-up: plans and lazy initialisation are not per step
        kept = []
        peak = _peak_allocated_bytes(lambda: kept.append(noise_fn(grads, state)))
        if peak is not None:
            return peak
    raise AssertionError(f"the profiler recorded no allocation in {attempts} attempts")


def test_the_measurement_sees_allocations():
    peaks = [_peak_allocated_bytes(lambda: torch.empty(1000)) for _ in range(3)]
    assert any(peak is not None and peak >= 4000 for peak in peaks), peaks


def test_a_float32_step_allocates_one_parameter_vector():
    template = {"a": torch.zeros(D - 1000), "b": torch.zeros(10, 100)}
    grads = clipped({"a": torch.ones(D - 1000), "b": torch.ones(10, 100)}, 1.0)
    peak = _step_peak(template, grads)
    # The output (4 D bytes) and nothing of size comparable to D: a (B, d) temporary would be
    # 16 D, a second d-vector 8 D in total.
    assert 4 * D <= peak <= 4 * D + 2**16, peak / (4 * D)


@pytest.mark.parametrize(
    "template_dtype, grad_dtype, compute_dtype, scratch",
    [
        (torch.bfloat16, torch.float32, torch.float32, True),   # clipped_grad's sums of bf16 params
        (torch.bfloat16, torch.bfloat16, torch.float32, True),
        (torch.float16, torch.float16, torch.float32, True),
        (torch.float32, torch.bfloat16, torch.float32, False),  # x lives in the float32 output
        (torch.float32, torch.float32, torch.float64, True),
    ],
)
def test_other_dtypes_add_a_fixed_scratch_only(template_dtype, grad_dtype, compute_dtype, scratch):
    template = {"a": torch.zeros(D, dtype=template_dtype)}
    grads = clipped({"a": torch.ones(D, dtype=grad_dtype)}, 1.0)
    peak = _step_peak(template, grads, dtype=compute_dtype)
    # The output in the template's dtype, a scratch of one noise block (2**20 elements) in the
    # compute dtype when the output cannot hold x, and torch's casting buffers for
    # 2**16-element pieces (two operands).
    output_bytes = template_dtype.itemsize
    item = compute_dtype.itemsize
    bound = output_bytes * D + (item * 2**20 if scratch else 0) + 2 * item * 2**16 + 2**16
    assert output_bytes * D <= peak <= bound, (peak, bound)


def test_an_output_the_caller_dropped_is_reused_and_one_it_still_holds_is_never_overwritten():
    template = {"a": torch.zeros(5000), "b": torch.zeros(3, 4)}
    grads = clipped({"a": torch.ones(5000), "b": torch.ones(3, 4)}, 1.0)
    n = 8  # three holders x two steps, then a drop and a reuse
    recycling_fn, state = mf_gaussian_noise(template, FOUR_BUFFERS, n_steps=n, noise_multiplier=1.0, key=key(3))
    reference_fn, reference_state = mf_gaussian_noise(template, FOUR_BUFFERS, n_steps=n, noise_multiplier=1.0,
                                                      key=key(3))
    reference = []
    for _ in range(n):
        noisy, reference_state = reference_fn(grads, reference_state)
        reference.append(noisy)  # all kept: this engine never reuses memory

    def step():
        nonlocal state
        noisy, state = recycling_fn(grads, state)
        assert torch.equal(noisy.pytree["a"], reference[state.step - 1].pytree["a"])
        assert torch.equal(noisy.pytree["b"], reference[state.step - 1].pytree["b"])
        return noisy

    holders = {
        "one leaf": lambda noisy: noisy.pytree["b"],
        "a detached view": lambda noisy: noisy.pytree["a"][10:20].detach(),
        "a numpy array": lambda noisy: noisy.pytree["a"].numpy(),
    }
    for name, hold in holders.items():
        noisy = step()
        address = noisy.pytree["a"].data_ptr()
        held = hold(noisy)
        before = torch.as_tensor(held).clone()
        del noisy
        again = step()  # the caller still holds part of the last output: new memory
        assert again.pytree["a"].data_ptr() != address, name
        assert torch.equal(torch.as_tensor(held), before), name
        del held, again
    noisy = step()
    address = noisy.pytree["a"].data_ptr()
    del noisy
    assert step().pytree["a"].data_ptr() == address  # dropped entirely: reused
