"""Optimizing a banded Toeplitz strategy (BandMF, Band23) for a participation context.

Objective: log(sens^2 x error) over C's first column c_0, ..., c_{bands-1} (c_k = 0 for
k >= bands), in float64, with the horizon n = n_steps.

Parametrization. The free variables are the non-negative steps delta_k = c_k - c_{k+1}
(c_k = sum_{j>=k} delta_j), kept >= 0 by L-BFGS-B's box bounds, so every iterate is non-negative
and non-increasing: the preconditions of the Toeplitz min-sep theorem (BSR24 Thm 2). The loss is
invariant under scaling c, so c_0 floats during the search and the result is divided by c_0.
(A product-of-sigmoids parametrization with c_0 = 1 fixed was tried first: it needs 3x more
iterations, since one variable moves every later coefficient.) Initial point: the optimal
Toeplitz strategy c_k = binom(2k, k) / 4^k truncated to the band.

Error (docs/math.md section 3). With c_hat the first column of C^{-1}, d = cumsum(c_hat) and
e_t = sum_{k<=t} d_k^2, the max error is e_{n-1} = sum_k d_k^2 and the mean error is
(1/n) sum_k (n - k) d_k^2; both are E = sum_k w_k d_k^2.

Gradient of E (adjoint; derived here). Lower-triangular Toeplitz matrices commute, so with A the
prefix-sum matrix d = A C^{-1} e_0 = C^{-1} 1 (1 the all-ones vector), and with S^j the shift by
j (dC / dc_j = S^j):

    dE/dc_j = -2 (w d)^T C^{-1} S^j C^{-1} 1 = -2 sum_{t>=j} mu_t d_{t-j},   mu = C^{-T} (w d).

C^T = J C J (J the reversal), so mu = J C^{-1} J (w d). Three evaluations, all exact up to
rounding (``error_and_gradient`` takes the cheapest for (bands, n), a fixed rule):

* ``_doubled_error_and_gradient`` (few bands, long horizons): d obeys a linear recurrence with a
  bands x bands transition matrix, so E is a quadratic form in sums of matrix powers, found by
  doubling the horizon (O(bands^3 log n), forward derivatives O(bands^4 log n)): about 0.5 ms for
  8 bands at any n, where the filters below take 19 ms at n = 1e6.
* ``_filtered_error_and_gradient``: C^{-1} v is the recursive filter with denominator
  c_0..c_{bands-1} (scipy's lfilter, in C), so d and mu are one filter each and the gradient is
  ``bands`` dot products: O(n bands).
* ``_spectral_error_and_gradient`` (bands > ``FILTER_MAX_BANDS``): every product is a
  convolution of length n by FFT, and c_hat comes from forward substitution for its first terms
  and then Newton's iteration for the inverse power series (``inverse_series``): O(n log n).

Sensitivity (BSR24 Thm 2, stated and implemented in ``toeplitz.minsep_sensitivity_squared``):
for these c the worst pattern is {0, b, ..., (k'-1) b}, so sens^2 = ||u||^2 with
u_t = sum_{m < k', m b <= t} c_{t - m b}, linear in c: sens^2 = c^T G c with the fixed
bands x bands Gram matrix G of that linear map (``sensitivity_gram``, counts of coinciding
terms), so its value and gradient 2 G c cost O(bands^2) per evaluation. The final sensitivity of
the resolved mechanism is always recomputed by ``toeplitz.minsep_sensitivity_squared``.

Search. L-BFGS-B (scipy) with these analytic gradients in float64, BLAS limited to one thread,
keeping ``_MEMORY`` correction pairs, until log(loss) falls by less than ``_STALL`` over
``_STALL_WINDOW`` iterations or over ``_EVALUATION_WINDOW`` evaluations. The second rule ends
the line searches a converged run spends on the last digits: at n = 1e6 the best value settles
to ~1e-12 within 10 to 25 evaluations, after which L-BFGS-B's failing line searches took another
40 to 80 evaluations that changed log(loss) by less than 1e-12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft
from scipy.signal import lfilter

from opake.dpftrl.strategies.lbfgs import minimize_until_stalled
from opake.dpftrl.participation import Participation

_MAX_ITERATIONS = 2000
_STALL_WINDOW = 20
_STALL = 1e-9  # stop when log(loss) fell by less than this over the last _STALL_WINDOW iterations
_EVALUATION_WINDOW = 10  # ... or over the last _EVALUATION_WINDOW evaluations (module docstring)
# Bands up to this width use the doubling or the recursive filters; wider ones the FFT, O(n log n).
# Measured (one core) per evaluation, filter / FFT: 64 bands 2.2 / 2.0 ms at n = 1e4, 0.28 / 0.72 s
# at 1e6; 128 bands 4.4 / 2.1 ms at 1e4, 0.58 / 0.58 s at 1e6.
FILTER_MAX_BANDS = 64
# Estimated seconds of one evaluation (one core; ``evaluation_seconds``): the doubling costs
# log2(n) levels of a few batched bands x bands products (measured 0.46 ms for 8 bands at
# n = 65536, 1.9 ms for 16 at 1e6, 16 ms for 32 at 1e6), the filters n x (1.2e-8 + 1.5e-9 bands)
# (19 ms for 8 bands at 1e6), the FFT about 2.5e-7 n (0.25 s at 1e6).
_DOUBLING_SECONDS_PER_LEVEL = (2.2e-5, 7.5e-10)  # + this x bands^4
_FILTER_SECONDS_PER_STEP = (1.2e-8, 1.5e-9)      # + this x bands
_FFT_SECONDS_PER_STEP = 2.5e-7
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
    """E (max or mean prefix-sum error) and dE/dc_j for j < len(coefs) (see module doc), by the
    evaluation ``evaluation_seconds`` expects to be the fastest (a function of bands and n only)."""
    costs = evaluation_seconds(coefs.shape[0], n)
    method = min(costs, key=costs.get)
    if method == "doubling":
        return _doubled_error_and_gradient(coefs, n, error)
    if method == "filter":
        return _filtered_error_and_gradient(coefs, n, error)
    return _spectral_error_and_gradient(coefs, n, error)


def evaluation_seconds(bands: int, n: int) -> dict:
    """Estimated seconds of one evaluation of the loss and its gradient on one core, by method:
    "doubling" and "filter" up to ``FILTER_MAX_BANDS`` bands (the doubling for bands <= n), "fft"
    beyond."""
    if bands > FILTER_MAX_BANDS:
        return {"fft": n * _FFT_SECONDS_PER_STEP}
    costs = {"filter": n * (_FILTER_SECONDS_PER_STEP[0] + _FILTER_SECONDS_PER_STEP[1] * bands)}
    if bands <= n:
        levels = math.log2(max(n, 2))
        costs["doubling"] = levels * (_DOUBLING_SECONDS_PER_LEVEL[0] + _DOUBLING_SECONDS_PER_LEVEL[1] * bands**4)
    return costs


def _doubled_error_and_gradient(coefs: np.ndarray, n: int, error: str) -> tuple[float, np.ndarray]:
    """``error_and_gradient`` by doubling the horizon, O(bands^4 log n) (bands <= n).

    d = C^{-1} 1 solves sum_{j<b} c_j d_{t-j} = 1 (d_t = 0 for t < 0), a recurrence on the state
    z_t = (d_{t-1}, ..., d_{t-b+1}, 1): d_t = a . z_t with a = (-c_1, ..., -c_{b-1}, 1) / c_0, and
    z_{t+1} = A z_t, A's first row a, then the shift, then the constant's row (``_transition``);
    z_0 = e_last. Hence d_t = a . A^t z_0 and, with Z = z_0 z_0^T and X_t = A^t Z A^tT,

        E_max = a^T S_n a,   S_L = sum_{t<L} X_t;     E_mean = a^T T_n a / n,   T_L = sum_{t<L} (L - t) X_t.

    Appending a segment of length q to one of length p (``_append``):
        A^(p+q) = A^q A^p,   S_(p+q) = S_p + A^p S_q A^pT,   T_(p+q) = T_p + q S_p + A^p T_q A^pT,
    so the binary digits of n build (A^n, S_n, T_n) from segments of lengths 2^i in O(log n)
    products. The derivatives in c ride along (forward mode: A depends on c through its first row
    only), and dE/dc_j = 2 (da/dc_j)^T M a + a^T (dM/dc_j) a for M = S_n or T_n / n.
    """
    bands = coefs.shape[0]
    a, da, transition, dtransition = _transition(coefs)
    start = np.zeros((bands, bands))
    start[-1, -1] = 1.0                                              # Z = z_0 z_0^T
    segment = (1, transition, dtransition, np.stack([start, start]), np.zeros((bands, 2, bands, bands)))
    total = None
    remaining = n
    while True:  # the binary digits of n, lowest first
        if remaining & 1:
            total = segment if total is None else _append(total, segment)
        remaining >>= 1
        if not remaining:
            break
        segment = _append(segment, segment)
    _, _, _, sums, dsums = total
    which, scale = (0, 1.0) if error == "max" else (1, 1.0 / n)
    moment, dmoment = sums[which], dsums[:, which]
    moment_a = moment @ a
    value = float(a @ moment_a) * scale
    gradient = (2.0 * (da @ moment_a) + np.einsum("i,jik,k->j", a, dmoment, a)) * scale
    return value, gradient


def _transition(coefs: np.ndarray):
    """a, da/dc (bands x bands), A and dA/dc (bands x bands x bands, derivative first) of the
    recurrence of ``_doubled_error_and_gradient``. One band (C = c_0 I): d_t = 1 / c_0, A = [1]."""
    bands = coefs.shape[0]
    c0 = coefs[0]
    transition = np.zeros((bands, bands))
    dtransition = np.zeros((bands, bands, bands))
    transition[-1, -1] = 1.0                                         # the constant 1 stays 1
    if bands == 1:
        return np.array([1.0 / c0]), np.array([[-1.0 / c0**2]]), transition, dtransition
    a = np.concatenate((-coefs[1:], [1.0])) / c0
    da = np.zeros((bands, bands))
    da[0] = -a / c0                                                  # d a / d c_0
    da[np.arange(1, bands), np.arange(bands - 1)] = -1.0 / c0        # d a_(j-1) / d c_j
    transition[0] = a
    transition[np.arange(1, bands - 1), np.arange(bands - 2)] = 1.0  # z_(t+1)[i] = z_t[i-1]
    dtransition[:, 0, :] = da
    return a, da, transition, dtransition


def _append(first, second):
    """(length, A^L, dA^L, [S_L, T_L], d[S_L, T_L]) of the first segment followed by the second
    (module doc of ``_doubled_error_and_gradient``); derivatives on the leading axis."""
    p, power1, dpower1, sums1, dsums1 = first
    q, power2, dpower2, sums2, dsums2 = second
    power = power2 @ power1
    dpower = dpower2 @ power1 + power2 @ dpower1
    moved = power1 @ sums2                                           # A^p [S_q, T_q]
    dmoved = dpower1[:, None] @ sums2 + power1 @ dsums2
    sums = moved @ power1.T
    dsums = dmoved @ power1.T + moved @ np.swapaxes(dpower1, -1, -2)[:, None]
    sums[0] += sums1[0]
    sums[1] += sums1[1] + q * sums1[0]
    dsums[:, 0] += dsums1[:, 0]
    dsums[:, 1] += dsums1[:, 1] + q * dsums1[:, 0]
    return p + q, power, dpower, sums, dsums


def _filtered_error_and_gradient(coefs: np.ndarray, n: int, error: str) -> tuple[float, np.ndarray]:
    """``error_and_gradient`` by recursive filters, O(n bands).

    d = C^{-1} 1 and mu = J C^{-1} J (w d) are each the filter 1 / c(z^-1) run over a length-n
    input (forward substitution with the band, in C); dE/dc_j = -2 sum_{t>=j} mu_t d_{t-j}.
    """
    band = coefs[: min(n, coefs.shape[0])]
    d = lfilter([1.0], band, np.ones(n))
    wd = d if error == "max" else _weights(n, error) * d
    value = float(np.dot(wd, d))
    mu = np.ascontiguousarray(lfilter([1.0], band, wd[::-1])[::-1])
    lags = np.zeros(coefs.shape[0])  # lags beyond the horizon: c_j multiplies nothing (gradient 0)
    for j in range(band.shape[0]):
        lags[j] = np.dot(mu[j:], d[: n - j])
    return value, -2.0 * lags


def _spectral_error_and_gradient(coefs: np.ndarray, n: int, error: str) -> tuple[float, np.ndarray]:
    """``error_and_gradient`` by FFT, O(n log n) for any band.

    With c_hat the first column of C^{-1} (``inverse_series``) and g = A^T (w d) (reverse
    cumulative sums), dE/dc_j = -2 sum_t lambda_t c_hat_{t-j} with lambda = C^{-T} g
    = J (c_hat * (J g))[:n] (* the causal convolution), the same sum as the module doc's.
    """
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


def sensitivity_gram(bands: int, participation: Participation) -> np.ndarray:
    """G (bands x bands) with sens^2 = c^T G c for every non-negative, non-increasing band c.

    BSR24 Thm 2: sens^2 = ||u||^2, u = A c with A[t, j] = 1 iff t - j is one of 0, b, ...,
    (k'-1) b (t < n). G = A^T A counts the rows t < n where both lags i <= j appear:
    t = j + m b = i + (m + q) b needs j - i = q b, 0 <= m < k' - q and j + m b < n, so

        G[i, j] = max(0, min(k' - q, ceil((n - j) / b)))   if j - i = q b,   else 0.
    """
    n, b, k = participation.n_steps, participation.min_sep, participation.effective_participations
    lag = np.arange(bands)
    i, j = np.minimum.outer(lag, lag), np.maximum.outer(lag, lag)
    q, aligned = np.divmod(j - i, b)
    count = np.minimum(k - q, -(-(n - j) // b))
    return np.where(aligned == 0, np.maximum(count, 0), 0).astype(np.float64)


def coefficients_from(steps: np.ndarray) -> np.ndarray:
    """c_k = sum_{j >= k} steps_j (non-negative steps give a non-negative, non-increasing c)."""
    return np.cumsum(steps[::-1])[::-1]


def initial_steps(bands: int) -> np.ndarray:
    """Steps of the truncated optimal Toeplitz strategy c_k = binom(2k, k) / 4^k, k < bands."""
    k = np.arange(1, bands, dtype=np.float64)
    c = np.concatenate(([1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))))
    return np.concatenate((c[:-1] - c[1:], c[-1:]))


def log_loss_and_gradient(steps: np.ndarray, participation: Participation, error: str,
                          gram: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """log(sens^2 x E) of c = coefficients_from(steps) and its gradient in the steps.

    The loss does not change when c is scaled, so c_0 need not be 1 here; the result is
    normalized to c_0 = 1 at the end. ``gram``: ``sensitivity_gram(len(steps), participation)``,
    built here when not given (an optimization builds it once).
    """
    c = coefficients_from(steps)
    if gram is None:
        gram = sensitivity_gram(c.shape[0], participation)
    gram_c = gram @ c
    sens2 = float(np.dot(c, gram_c))
    err, derr = error_and_gradient(c, participation.n_steps, error)
    grad_c = 2.0 * gram_c / sens2 + derr / err
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
    gram = sensitivity_gram(bands, participation)
    steps, value, iterations = minimize_until_stalled(
        lambda x: log_loss_and_gradient(x, participation, error, gram), initial_steps(bands),
        stall=_STALL, window=_STALL_WINDOW, max_iterations=_MAX_ITERATIONS,
        ftol=1e-15, gtol=1e-12, maxcor=_MEMORY, bounds=[(0.0, None)] * bands,
        evaluation_window=_EVALUATION_WINDOW,
    )
    c = coefficients_from(steps)
    return OptimizeResult(c / c[0], value, iterations)
