"""Lower-triangular Toeplitz strategies given by their first column (numpy float64, O(n)).

C[t, s] = c[t - s] for t >= s. These routines work for any such C (a BLT, a banded matrix)
and are the O(n) references the BLT closed forms are checked against.
"""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

from opake.errors import InvalidArgumentError


def _column(coefs) -> np.ndarray:
    c = np.asarray(coefs, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] < 1:
        raise InvalidArgumentError(f"coefs must be a non-empty 1-D array, got shape {c.shape}")
    if not np.all(np.isfinite(c)):
        raise InvalidArgumentError("coefs must be finite")
    return c


# Bands up to this width are inverted by scipy's recursive filter (``_inverse_by_filter``), wider
# columns by the substitution loop (``_inverse_by_substitution``). The filter updates a state of
# ``support`` values per term in C; the loop pays ~1 us of Python per term but its dot product
# runs in BLAS. Measured (one core): at support 8 and n = 1e6 the filter takes 6 ms, the loop
# 1.5 s; at full support and n = 2e4 the loop is 3x faster (0.12 s against 0.36 s).
_FILTER_MAX_SUPPORT = 1024


def inverse_coefficients(coefs) -> np.ndarray:
    """First column of C^{-1} (also lower-triangular Toeplitz); O(n * nonzeros of c).

    Forward substitution on C c_hat = e_0:
        c_hat_0 = 1 / c_0,   c_hat_k = -(1 / c_0) sum_{j=1..min(k, s-1)} c_j c_hat_{k-j},
    s the support of c (c_j = 0 for j >= s). This is the recursive (IIR) filter with denominator
    c_0..c_{s-1} applied to the unit impulse, which scipy runs in C for a narrow band (a BandMF
    column: milliseconds at n = 1e6); a wide column goes through the loop with BLAS dot products.
    Both are the same recurrence, summed in another order.
    """
    c = _column(coefs)
    if c[0] == 0.0:
        raise InvalidArgumentError("coefs[0] must be non-zero for C to be invertible")
    support = int(np.flatnonzero(c)[-1]) + 1  # banded C only needs its band
    if support <= _FILTER_MAX_SUPPORT:
        return _inverse_by_filter(c[:support], c.shape[0])
    return _inverse_by_substitution(c, support)


def _inverse_by_filter(band: np.ndarray, n: int) -> np.ndarray:
    """c_hat for the band c_0..c_{s-1}: the impulse response of 1 / c(z^-1), n terms.

    scipy's lfilter divides the denominator by c_0 and runs y_k = x_k / c_0 - sum_j (c_j / c_0)
    y_{k-j} (transposed direct form II): the substitution above, exact up to rounding.
    """
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], band, impulse)


def _inverse_by_substitution(c: np.ndarray, support: int) -> np.ndarray:
    """c_hat term by term (a dot product of up to ``support`` - 1 terms each)."""
    n = c.shape[0]
    inv = np.zeros(n)
    inv[0] = 1.0 / c[0]
    for k in range(1, n):
        width = min(k, support - 1)  # c_j = 0 beyond the band
        if width:
            inv[k] = -np.dot(c[1:width + 1], inv[k - 1::-1][:width]) / c[0]
    return inv


def check_minsep_coefficients(coefs) -> np.ndarray:
    """The preconditions of the Toeplitz min-sep theorem: c >= 0 and non-increasing."""
    c = _column(coefs)
    if np.any(c < 0):
        raise InvalidArgumentError("Toeplitz min-sep sensitivity needs non-negative coefficients; "
                                   f"coefficient {int(np.argmin(c))} is {c.min()!r}")
    if np.any(np.diff(c) > 0):
        k = int(np.flatnonzero(np.diff(c) > 0)[0]) + 1
        raise InvalidArgumentError("Toeplitz min-sep sensitivity needs non-increasing coefficients; "
                                   f"c[{k}] = {c[k]!r} > c[{k - 1}] = {c[k - 1]!r}")
    return c


def worst_pattern_response(coefs, min_sep: int, max_participations: int | None = None) -> np.ndarray:
    """u = C x for the worst participation pattern x of the Toeplitz min-sep theorem (BSR24 Thm 2).

    For non-negative, non-increasing c the worst pattern is {0, b, ..., (k'-1) b} with
    k' = min(k, ceil(n / b)), and u_t = sum_{m <= min(k'-1, t // b)} c_{t - m b}. Computed in
    O(n): pad c to whole rows of b, cumulative-sum down the rows (v_t = sum_{m <= t // b}
    c_{t - m b}), then drop the terms beyond k' participations by subtracting the same sums
    shifted by k' b (u_t = v_t - v_{t - k' b}).
    """
    c = check_minsep_coefficients(coefs)
    n = c.shape[0]
    b = int(min_sep)
    if not 1 <= b <= n:
        raise InvalidArgumentError(f"min_sep must be in 1..n_steps ({n}), got {min_sep}")
    rows = -(-n // b)
    k = rows if max_participations is None else min(int(max_participations), rows)
    if k < 1:
        raise InvalidArgumentError(f"max_participations must be >= 1, got {max_participations}")
    padded = np.zeros(rows * b)
    padded[:n] = c
    v = np.cumsum(padded.reshape(rows, b), axis=0).reshape(-1)[:n]
    u = v.copy()
    u[k * b:] -= v[: n - k * b] if k * b < n else 0.0
    return u


def minsep_sensitivity_squared(coefs, min_sep: int, max_participations: int | None = None) -> float:
    """sens^2 of C for at most k participations at least b steps apart (BSR24 Theorem 2).

    ||C x||^2 for the worst pattern x (``worst_pattern_response``).
    """
    u = worst_pattern_response(coefs, min_sep, max_participations)
    return float(np.dot(u, u))


def per_query_errors(inverse_coefs, momentum: float = 1.0, lr_schedule=None) -> np.ndarray:
    """e_t = ||row t of W C^{-1}||^2 for W = D_eta M_beta (prefix sums when beta = 1).

    M_beta C^{-1} is Toeplitz with coefficients d_k = beta d_{k-1} + c_hat_k, so
    E_t = sum_{k<=t} d_k^2 and e_t = eta_t^2 E_t.
    """
    inv = _column(inverse_coefs)
    beta = float(momentum)
    if beta == 1.0:
        d = np.cumsum(inv)
    else:
        # d_k = beta d_{k-1} + c_hat_k: the one-pole filter 1 / (1 - beta z^-1), run in C
        d = lfilter([1.0], [1.0, -beta], inv)
    errors = np.cumsum(d * d)
    if lr_schedule is not None:
        eta = np.asarray(lr_schedule, dtype=np.float64)
        if eta.shape != inv.shape:
            raise InvalidArgumentError(f"lr_schedule must have {inv.shape[0]} values, got shape {eta.shape}")
        errors = eta * eta * errors
    return errors
