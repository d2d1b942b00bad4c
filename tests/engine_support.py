"""Helpers shared by the noise-engine tests (checked themselves in test_engine_support.py).

The dense oracle here is written from the definition of a BLT (docs/math.md section 1: c_0 = 1,
c_k = sum_i omega_i theta_i^(k-1)) and a dense triangular solve; it never calls opake's math.
Mechanisms are built by hand (``HandRecipe``) so the engine tests do not depend on the BLT
optimizer; parameter values are chosen exactly representable in float32 (omega and 1 - theta
are float32 numbers), as the optimizer's output is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.linalg import solve_triangular

from opake.dpftrl.strategies.strategy import Mechanism
from opake.dpftrl.participation import Participation
from opake.types import clipped

# Parameter sets (omega, 1 - theta), float32-exact. The last decay is within 2**-30 (~1e-9) of 1:
# as theta it would round to 1.0 in float32, so it checks the engine uses the 1 - theta form.
BLT_CASES = {
    "one_buffer": ([0.5], [0.25]),
    "three_buffers": ([0.25, 0.125, 0.0625], [0.5, 2.0**-6, 2.0**-12]),
    "near_one_decay": ([0.3125, 0.1875], [0.75, 2.0**-30]),
    "zero_decay": ([0.375, 0.125], [1.0, 0.125]),
}


def float32_exact(values) -> np.ndarray:
    """float64 copies of float32 values (so they survive a float32 round trip)."""
    return np.asarray(values, dtype=np.float32).astype(np.float64)


@dataclass(frozen=True)
class HandRecipe:
    """A test-only strategy recipe: resolves to a Mechanism with the given BLT parameters."""

    omega: tuple
    one_minus_theta: tuple

    def __post_init__(self):
        for values in (self.omega, self.one_minus_theta):
            if not np.array_equal(float32_exact(values), np.asarray(values, dtype=np.float64)):
                raise ValueError(f"test parameters must be float32-exact, got {values}")

    def resolve(self, n_steps, min_sep=1, max_participations=None) -> Mechanism:
        omega = np.asarray(self.omega, dtype=np.float64)
        theta = 1.0 - np.asarray(self.one_minus_theta, dtype=np.float64)
        return Mechanism(
            recipe=self, participation=Participation(n_steps, min_sep, max_participations),
            theta=theta, omega=omega, sensitivity=1.0, max_loss=0.0, mean_loss=0.0,
        )


def hand_blt(name: str) -> HandRecipe:
    omega, one_minus_theta = BLT_CASES[name]
    return HandRecipe(tuple(omega), tuple(one_minus_theta))


def dense_blt_matrix(omega, one_minus_theta, n: int) -> np.ndarray:
    """C (n x n, float64) from the definition: C[t, s] = c_{t-s}."""
    omega = np.asarray(omega, dtype=np.float64)
    theta = 1.0 - np.asarray(one_minus_theta, dtype=np.float64)
    c = np.zeros(n)
    c[0] = 1.0
    for k in range(1, n):
        c[k] = float(np.sum(omega * theta ** (k - 1)))
    return np.array([[c[t - s] if t >= s else 0.0 for s in range(n)] for t in range(n)])


def dense_inverse_apply(matrix: np.ndarray, values: np.ndarray) -> np.ndarray:
    """C^{-1} values for lower-triangular C (values: n x d)."""
    return solve_triangular(matrix, values, lower=True)


def flat(pytree) -> torch.Tensor:
    """All leaves of a dict/list/tensor pytree in a fixed order, as one float64 vector."""
    if isinstance(pytree, torch.Tensor):
        return pytree.detach().cpu().reshape(-1).to(torch.float64)
    if isinstance(pytree, dict):
        return torch.cat([flat(pytree[k]) for k in sorted(pytree)])
    return torch.cat([flat(v) for v in pytree])


def zeros_like_tree(template, dtype=None):
    if isinstance(template, torch.Tensor):
        return torch.zeros_like(template, dtype=dtype or template.dtype)
    if isinstance(template, dict):
        return type(template)((k, zeros_like_tree(v, dtype)) for k, v in template.items())
    return type(template)(zeros_like_tree(v, dtype) for v in template)


def run_noise(noise_fn, state, template, steps: int, *, l2_bound=1.0, normalization=1.0, grads=None):
    """Run ``steps`` steps on zero (or given) gradients; returns (rows of flat noise, state).

    Zero gradients are made in the engine's compute dtype; the output comes in the template's
    dtypes, so a template in the compute dtype reads the noise back at full precision.
    """
    rows = []
    for _ in range(steps):
        pytree = zeros_like_tree(template, noise_fn.dtype) if grads is None else grads
        noisy, state = noise_fn(clipped(pytree, l2_bound, normalization), state)
        rows.append(flat(noisy.pytree))
    return torch.stack(rows).numpy(), state
