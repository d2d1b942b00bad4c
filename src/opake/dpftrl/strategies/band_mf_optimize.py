"""Optimizing a banded Toeplitz strategy (BandMF, Band23) for a participation context.

Objective: log(sens^2 x error) over the coefficients c_1, ..., c_{bands-1} of C's first column
(c_0 = 1, c_k = 0 for k >= bands), in float64, with the horizon n = n_steps.

Parametrization (every iterate satisfies the min-sep preconditions of BSR24 Thm 2):

    c_0 = 1,   c_k = prod_{i=1..k} s_i,   s_i = sigmoid(v_i) in (0, 1),   v unconstrained,

so 1 > c_1 > c_2 > ... > c_{bands-1} > 0: non-negative and non-increasing by construction.
Initial point: the optimal Toeplitz strategy c_k = binom(2k, k) / 4^k truncated to the band
(its ratios are s_k = (2k - 1) / (2k)).

Error (docs/math.md section 3). With c_hat the first column of C^{-1}, d = cumsum(c_hat) and
e_t = sum_{k<=t} d_k^2, the max error is e_{n-1} = sum_k d_k^2 and the mean error is
(1/n) sum_k (n - k) d_k^2; both are E = sum_k w_k d_k^2.

Gradient of E (adjoint; derived here). C^{-1} is lower-triangular Toeplitz with column c_hat,
and C^T = J C J (J the reversal), so with g_s = sum_{t>=s} w_t d_t (g = A^T (w d)):

    dE/dc_j = -2 sum_t lambda_t c_hat_{t-j},   lambda = C^{-T} g = J (c_hat * (J g))[:n]

(* is the causal convolution truncated to n). Every step is a convolution of length n, done by
FFT, and c_hat itself comes from forward substitution over the band for its first terms and
then Newton's iteration for the inverse power series (g <- g (2 - c g) mod x^m, m doubling),
so one loss + gradient costs O(n log n) for any band.

Sensitivity (BSR24 Thm 2, stated and implemented in ``toeplitz.minsep_sensitivity_squared``):
for these c the worst pattern is {0, b, ..., (k'-1) b}, so sens^2 = ||u||^2 with
u_t = sum_{m < k', m b <= t} c_{t - m b}, linear in c; hence
dsens^2/dc_j = 2 sum_{m < k', j + m b < n} u_{j + m b}. The value is computed here by the same
block sums as ``toeplitz`` (needed next to its gradient); the final sensitivity of the resolved
mechanism is always recomputed by ``toeplitz.minsep_sensitivity_squared``.

The free variables are the non-negative steps delta_k = c_k - c_{k+1} (c_k = sum_{j>=k} delta_j),
kept >= 0 by L-BFGS-B's box bounds, so every iterate is non-negative and non-increasing. The loss
is invariant under scaling c, so c_0 floats during the search and the result is divided by c_0.
(A product-of-sigmoids parametrization with c_0 = 1 fixed was tried first: it needs 3x more
iterations, since one variable moves every later coefficient.) Minimized by L-BFGS-B (scipy)
with these analytic gradients in float64, BLAS limited to one thread, until log(loss) falls by
less than ``_STALL`` over ``_STALL_WINDOW`` iterations, keeping ``_MEMORY`` correction pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy.signal import lfilter

from opake.dpftrl.strategies import toeplitz
from opake.dpftrl.strategies.lbfgs import minimize_until_stalled
from opake.dpftrl.participation import Participation

_MAX_ITERATIONS = 2000
_STALL_WINDOW = 20
_STALL = 1e-9  # stop when log(loss) fell by less than this over the last _STALL_WINDOW iterations
# L-BFGS memory. The loss is ill-conditioned along the band's tail: measured (one core, n_steps
# 2928 and 15620, bands 2 to 256, max error) 80 pairs instead of 20 take the same evaluations up
# to 8 bands and 15% to 45% fewer from 64 on (256 bands, 15620 steps: 156 instead of 283), to an
# equal or lower loss (within 1e-10 in log(loss)); the per-iteration cost of 80 pairs is small
# next to one O(n log n) evaluation.
_MEMORY = 80


def _conv(a: np.ndarray, b: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` terms of the full convolution a * b (FFT, float64)."""
    size = sfft.next_fast_len(a.shape[0] + b.shape[0] - 1, real=True)
    out = sfft.irfft(sfft.rfft(a, size) * sfft.rfft(b, size), size)
    return out[:length]


def inverse_series(coefs: np.ndarray, n: int) -> np.ndarray:
    """First n terms of 1 / c(x), i.e. the first column of C^{-1}, for c_0 != 0 (c banded).

    The first ``_prefix_length(bands, n)`` terms by forward substitution over the band
    (c_hat_t = -(1 / c_0) sum_{1 <= k < bands} c_k c_hat_{t-k}, an IIR filter: O(bands) per
    term), then Newton's iteration for the reciprocal power series: with g correct to m terms,
    g <- g - g (c g - 1) mod x^{2m} is correct to 2m terms, O(m log m) by FFT. Since c g - 1
    vanishes below x^m, only its terms m..2m-1 are convolved, with the first 2m - m terms of g,
    and only the band of c enters c g. The substitution replaces the many small FFTs of the
    first doublings (their call overhead dominated) and is exact up to rounding.
    """
    bands = min(n, coefs.shape[0])
    c = np.asarray(coefs[:bands], dtype=np.float64)
    m = _prefix_length(bands, n)
    impulse = np.zeros(m)
    impulse[0] = 1.0
    g = lfilter([1.0], c, impulse)
    while m < n:
        m2 = min(2 * m, n)
        residual = _conv(c[: min(bands, m2)], g, m2)[m:]  # c g - 1 at x^m .. x^{m2-1}
        g = np.concatenate((g, -_conv(g[: m2 - m], residual, m2 - m)))
        m = m2
    return g


def _prefix_length(bands: int, n: int) -> int:
    """Terms of 1 / c(x) found by substitution before Newton's iteration takes over.

    Substitution costs about bands multiply-adds per term, a doubling from m about four FFTs
    of size 2m; measured (one core, n = 2928 and 15620, bands 4 to 256) the total is within
    ~20% of its minimum over powers of two with about 2^18 / bands terms, at least 512.
    """
    return min(n, max(512, 2**18 // max(1, bands)))


def _weights(n: int, error: str) -> np.ndarray:
    if error == "max":
        return np.ones(n)
    return (n - np.arange(n, dtype=np.float64)) / n


def error_and_gradient(coefs: np.ndarray, n: int, error: str) -> tuple[float, np.ndarray]:
    """E (max or mean prefix-sum error) and dE/dc_j for j < len(coefs) (see module doc)."""
    bands = coefs.shape[0]
    c_hat = inverse_series(coefs, n)
    d = np.cumsum(c_hat)
    w = _weights(n, error)
    wd = w * d
    value = float(np.dot(wd, d))
    g = np.cumsum(wd[::-1])[::-1]
    size = sfft.next_fast_len(2 * n, real=True)
    c_hat_f = sfft.rfft(c_hat, size)
    lam = sfft.irfft(c_hat_f * sfft.rfft(g[::-1], size), size)[:n][::-1]
    # sum_t lambda_t c_hat_{t-j} for j = 0..bands-1: the correlation of lambda with c_hat.
    corr = sfft.irfft(sfft.rfft(lam, size) * np.conj(c_hat_f), size)[:bands]
    return value, -2.0 * corr


def sensitivity_and_gradient(coefs: np.ndarray, participation: Participation) -> tuple[float, np.ndarray]:
    """sens^2 of the worst pattern {0, b, ..., (k'-1) b} and its gradient in c_j, j < bands."""
    n = participation.n_steps
    b = participation.min_sep
    k = participation.effective_participations
    column = np.zeros(n)
    column[: coefs.shape[0]] = coefs
    u = toeplitz.worst_pattern_response(column, b, participation.max_participations)
    value = float(np.dot(u, u))
    # grad_j = 2 sum_{m < k'} u_{j + m b}: reverse cumulative sums down the rows of width b,
    # minus the same shifted by k' rows.
    rows = -(-n // b)
    padded = np.zeros(rows * b)
    padded[:n] = u
    r = np.cumsum(padded.reshape(rows, b)[::-1], axis=0)[::-1]
    window = r.copy()
    window[: rows - k] -= r[k:] if k < rows else 0.0
    return value, 2.0 * window.reshape(-1)[: coefs.shape[0]]


def coefficients_from(steps: np.ndarray) -> np.ndarray:
    """c_k = sum_{j >= k} steps_j (non-negative steps give a non-negative, non-increasing c)."""
    return np.cumsum(steps[::-1])[::-1]


def initial_steps(bands: int) -> np.ndarray:
    """Steps of the truncated optimal Toeplitz strategy c_k = binom(2k, k) / 4^k, k < bands."""
    k = np.arange(1, bands, dtype=np.float64)
    c = np.concatenate(([1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))))
    return np.concatenate((c[:-1] - c[1:], c[-1:]))


def log_loss_and_gradient(steps: np.ndarray, participation: Participation, error: str) -> tuple[float, np.ndarray]:
    """log(sens^2 x E) of c = coefficients_from(steps) and its gradient in the steps.

    The loss does not change when c is scaled, so c_0 need not be 1 here; the result is
    normalized to c_0 = 1 at the end.
    """
    c = coefficients_from(steps)
    sens2, dsens = sensitivity_and_gradient(c, participation)
    err, derr = error_and_gradient(c, participation.n_steps, error)
    grad_c = dsens / sens2 + derr / err
    # dc_k / dsteps_j = 1 for k <= j.
    return math.log(sens2) + math.log(err), np.cumsum(grad_c)


@dataclass(frozen=True)
class OptimizeResult:
    coefs: np.ndarray
    log_loss: float
    iterations: int


def optimize(participation: Participation, bands: int, error: str) -> OptimizeResult:
    """Coefficients c (length ``bands``, c_0 = 1) minimizing sens^2 x error for the context."""
    if bands == 1:
        return OptimizeResult(np.ones(1), float("nan"), 0)
    steps, value, iterations = minimize_until_stalled(
        lambda x: log_loss_and_gradient(x, participation, error), initial_steps(bands),
        stall=_STALL, window=_STALL_WINDOW, max_iterations=_MAX_ITERATIONS,
        ftol=1e-15, gtol=1e-12, maxcor=_MEMORY, bounds=[(0.0, None)] * bands,
    )
    c = coefficients_from(steps)
    return OptimizeResult(c / c[0], value, iterations)
