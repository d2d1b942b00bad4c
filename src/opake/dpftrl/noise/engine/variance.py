"""The variance of the noise in each release: what a DP-aware optimizer needs to know.

Step t releases ``g_t + s (C^{-1} z)_t`` with s = noise_multiplier * clip / normalization and z
standard Gaussian, so every coordinate of step t's noise has variance s^2 ||row t of C^{-1}||^2.
C^{-1} is lower-triangular Toeplitz: row t holds its first t + 1 coefficients, and the squared
row norms are their cumulative sum of squares (``Mechanism.noise_row_norms_squared``; 1 at
every step for the identity, growing towards its limit for a BLT). They are computed once per
mechanism, at its first release (a BLT in O(n B) vectorized, a banded strategy by forward
substitution in O(n bands)), and kept for the few mechanisms in use.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["step_noise_variance"]


@functools.lru_cache(maxsize=4)
def _row_norms_squared(mechanism) -> np.ndarray:
    return np.asarray(mechanism.noise_row_norms_squared(), dtype=np.float64)


def step_noise_variance(mechanism, step: int, scale: float) -> float:
    """The variance of each coordinate of step ``step``'s noise, ``scale`` times C^{-1} z."""
    return float(scale) * float(scale) * float(_row_norms_squared(mechanism)[step])
