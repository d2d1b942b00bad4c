"""The "Noise injection" example of the BLT page, run as written.

The page's loop needs ``params``, ``batch``, ``lr``, ``noise_multiplier`` and a ``grad_fn``
returning ``(ClippedPytree, clip_state)``. Until opake's clipping module exists, ``grad_fn``
here is a stand-in that clips per-example gradients of a linear least-squares model by hand and
wraps them with ``opake.types.clipped``; its state records the sum of the gradients it
returned, so the test can take the noise out of the final parameters and check it.

Check on the noise: with zero-mean noise x_t and the page's update, the parameters end at
params_0 - lr * (sum of gradients + sum_t x_t). Each parameter's sum_t x_t is an independent
N(0, s^2 E) with s = noise_multiplier * l2_bound / normalization and E the squared norm of the
last row of A C^{-1} (A = prefix sums), computed below from the mechanism's (theta, omega) by an
impulse through the recurrence, not by opake. The sample variance over d parameters divided by
s^2 E is chi2_d / d; Laurent & Massart (2000) give
P(|chi2_d / d - 1| >= 2 sqrt(t / d) + 2 t / d) <= 2 e^-t, and t = 15 makes that < 1e-6.
For identity noise E would be n = 10000, for this BLT it is about 4.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opake.types import clipped

D = 2000
BATCH = 8


def _grad_fn(params, batch, state):
    """Stand-in for opake's clipping: per-example clip to L2 norm 1, sum, divide by the batch."""
    features, targets = batch
    residual = features @ params - targets                      # (BATCH,)
    per_example = residual[:, None] * features                  # (BATCH, D)
    norms = per_example.norm(dim=1, keepdim=True)
    per_example = per_example * torch.clamp(1.0 / norms, max=1.0)
    grads = per_example.sum(dim=0) / BATCH
    return clipped(grads, l2_bound=1.0, normalization=BATCH), {"sum": state["sum"] + grads}


def _last_row_error(theta, omega, n):
    # First column of C^{-1}: the recurrence x_t = z_t - sum_i omega_i S_i, S_i <- theta_i S_i + x_t
    # driven by the impulse z = e_0. A C^{-1} has coefficients b_k = sum_{j<=k} x_j; the last
    # row's squared norm is sum_k b_k^2.
    buffers = np.zeros_like(theta)
    total, prefix = 0.0, 0.0
    for t in range(n):
        x = (1.0 if t == 0 else 0.0) - float(omega @ buffers)
        buffers = theta * buffers + x
        prefix += x
        total += prefix * prefix
    return total


def test_single_participation_example_as_written():
    generator = torch.Generator().manual_seed(0)
    params = torch.zeros(D, dtype=torch.float64)
    batch = (torch.randn(BATCH, D, generator=generator, dtype=torch.float64) / math.sqrt(D),
             torch.randn(BATCH, generator=generator, dtype=torch.float64))
    lr = 0.01
    noise_multiplier = 1.0
    grad_fn = _grad_fn
    clip_state = {"sum": torch.zeros(D, dtype=torch.float64)}
    start = params.clone()

    # ---- the page's code, verbatim ----
    from opake.dpftrl.noise import mf_gaussian_noise, blt_strategy
    from opake.random import key

    # Single participation
    strategy = blt_strategy(max_buffers=10)
    noise_fn, noise_state = mf_gaussian_noise(
        grad_template=params,
        strategy=strategy,
        n_steps=10000,
        min_sep=1,
        max_participations=1,
        noise_multiplier=noise_multiplier,
        key=key(42),
    )

    for step in range(10000):
        grads, clip_state = grad_fn(params, batch, state=clip_state)
        noisy_grads, noise_state = noise_fn(grads, noise_state)
        params = params - lr * noisy_grads.pytree
    # ---- end of the page's code ----

    assert noise_state.step == 10000 and noisy_grads.step == 9999
    with pytest.raises(RuntimeError, match="n_steps=10000"):
        noise_fn(grads, noise_state)

    noise_sum = (start - params) / lr - clip_state["sum"]
    mechanism = noise_fn.mechanism
    scale = noise_multiplier * 1.0 / BATCH
    expected = scale**2 * _last_row_error(mechanism.theta, mechanism.omega, 10000)
    ratio = noise_sum.var(correction=0).item() / expected  # the noise is zero-mean: divide by d
    t = 15.0
    assert abs(ratio - 1) < 2 * math.sqrt(t / D) + 2 * t / D, ratio
    assert expected < 10 * scale**2  # far below identity noise (10000 s^2): correlation at work


@pytest.mark.slow
def test_multi_epoch_example_as_written():
    params = torch.zeros(10)
    noise_multiplier = 1.0

    # ---- the page's code, verbatim ----
    from opake.dpftrl.noise import mf_gaussian_noise, blt_strategy
    from opake.random import key

    # Multi-epoch: each user participates up to 5 times, ≥100 steps apart
    strategy = blt_strategy(max_buffers=10)
    noise_fn, noise_state = mf_gaussian_noise(
        grad_template=params,
        strategy=strategy,
        n_steps=5000,
        min_sep=100,
        max_participations=5,
        noise_multiplier=noise_multiplier,
        key=key(42),
    )
    # ---- end of the page's code ----

    assert noise_fn.participation.min_sep == 100 and noise_fn.participation.max_participations == 5
    assert noise_state.buffers.shape == (noise_fn.mechanism.num_buffers, 10)
    noisy, noise_state = noise_fn(clipped(torch.zeros(10), 1.0), noise_state)
    assert noisy.pytree.shape == (10,) and noise_state.step == 1
