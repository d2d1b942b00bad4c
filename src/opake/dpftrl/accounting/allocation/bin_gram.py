"""Gram matrix of a Toeplitz strategy's bin columns, G = (C X)^T (C X).

Balls-in-bins with num_bins = b processes bin j at the steps t = j, j + b, j + 2b, ... < n;
X is the n x b matrix of those indicators and m_j = C x_j is what one unit in bin j adds to
C G. The amplified dominating pair of docs/math.md section 6 depends on C only through G (b x b),
never on n, which is what makes its Monte Carlo and Renyi computations cheap.

For lower-triangular Toeplitz C with first column c, every m_j is a shift of one vector:
m_j[t] = v[t - j] for t >= j (zero before), with v_s = sum_{r >= 0, s - r b >= 0} c_{s - r b}
(the block cumulative sum of BSR24 Thm 2). Hence, for i <= j,

    G[i, j] = sum_{s = 0}^{n - 1 - j} v[s] v[s + (j - i)],

a truncated autocorrelation of v: O(n b) in total.
"""

from __future__ import annotations

import numpy as np

from opake.errors import InvalidArgumentError


def bin_gram_matrix(coefficients: np.ndarray, num_bins: int) -> np.ndarray:
    """G (num_bins x num_bins, float64, symmetric) for C with first column ``coefficients``."""
    c = np.asarray(coefficients, dtype=np.float64)
    n = c.shape[0]
    b = int(num_bins)
    rows = -(-n // b)
    # v_s = sum_r c_{s - r b}: pad c to rows * b, cumulative sum down the (rows, b) blocks.
    padded = np.zeros(rows * b)
    padded[:n] = c
    v = np.cumsum(padded.reshape(rows, b), axis=0).reshape(-1)[:n]
    gram = np.empty((b, b))
    for lag in range(b):
        # prefix[L - 1] = sum_{s < L} v[s] v[s + lag]
        prefix = np.cumsum(v[: n - lag] * v[lag:])
        j = np.arange(lag, b)
        values = prefix[n - 1 - j]
        gram[j - lag, j] = values
        gram[j, j - lag] = values
    return gram


def has_non_negative_entries(rigorous) -> bool:
    """Whether the run's strategy matrix is >= 0 entrywise (the amplified dominating pair applies)."""
    return bool(np.all(rigorous.mechanism.toeplitz_coefficients(rigorous.n_steps) >= 0))


# The last few Gram matrices, keyed by the strategy's coefficients and the number of bins: a
# calibration prices one run at many noise multipliers, and G does not depend on sigma.
_CACHE: dict = {}
_CACHE_SIZE = 8


def _cached_gram(coefficients: np.ndarray, num_bins: int) -> np.ndarray:
    key = (int(num_bins), coefficients.shape[0], hash(coefficients.tobytes()))
    found = _CACHE.get(key)
    if found is not None and np.array_equal(found[0], coefficients):
        return found[1]
    gram = bin_gram_matrix(coefficients, num_bins)
    gram.setflags(write=False)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (coefficients.copy(), gram)
    return gram


def bin_gram_of_run(rigorous, method: str) -> np.ndarray:
    """G for a balls-in-bins run (its resolved mechanism), refusing C with negative entries.

    The amplified dominating pair (docs/math.md section 6) puts every step's gradient in the same
    direction, which is the worst case only when C >= 0 entrywise; for a Toeplitz C that means
    every coefficient c_k >= 0 (true for a BLT inside the min-sep preconditions). The result is
    read-only and shared between runs with the same strategy coefficients and bins (cached).
    """
    coefficients = rigorous.mechanism.toeplitz_coefficients(rigorous.n_steps)
    negative = np.flatnonzero(coefficients < 0)
    if negative.size:
        k = int(negative[0])
        raise InvalidArgumentError(
            f"method={method!r} needs a strategy matrix with non-negative entries (the balls-in-bins "
            f"dominating pair); this strategy has c_{k} = {float(coefficients[k])!r} < 0; use method='rigorous'"
        )
    return _cached_gram(np.ascontiguousarray(coefficients, dtype=np.float64), rigorous.num_bins)
