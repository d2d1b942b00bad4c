"""Shared set-up for the examples: a tiny linear model, its data and a clipped gradient function.

``OPAKE_EXAMPLE_STEPS`` (environment) shortens the training loops; the tests use it, since the
examples' own horizons (10000 steps) take a while with per-example clipping on a CPU.
"""

import os

import torch

from opake.dpftrl.clipping import clipped_grad

BATCH = 16


def steps(n_steps: int) -> int:
    """How many of the example's n_steps to run (all, unless OPAKE_EXAMPLE_STEPS is set)."""
    return min(n_steps, int(os.environ.get("OPAKE_EXAMPLE_STEPS", n_steps)))


def tiny_problem():
    """A 20-feature least-squares problem: (params, batch, grad_fn, clip_state)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(BATCH, 20, generator=generator)
    targets = features @ torch.linspace(-1, 1, 20) + 0.1 * torch.randn(BATCH, generator=generator)
    params = torch.zeros(20)

    def loss_fn(params, example):
        x, y = example
        return 0.5 * (x @ params - y) ** 2

    grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=BATCH)
    return params, (features, targets), grad_fn, clip_state
