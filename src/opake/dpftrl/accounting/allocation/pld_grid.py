"""Pessimistic numerical building blocks of the random-allocation PLD (``allocation/pld.py``).

Everything here rounds in the direction that can only raise a hockey-stick divergence; the
derivation is in docs/allocation_pld.md. Notation: a per-bin likelihood-ratio term under P is
X = exp(a T - a^2/2), T ~ N(0, 1) (mean 1); under the unit's own bin it is X' = exp(a w + a^2/2),
w ~ N(0, 1).

* ``GridPmf``: masses on {0, h, ..., (N - 1) h}, an atom above the grid, and an l2 bound on the
  float error of the masses. ``term_rounded_up`` / ``term_rounded_down`` put one X on the grid
  (stochastically larger / smaller: survival / CDF values inflated by a relative 1e-12 before
  differencing); ``convolve`` and ``power`` form sums of independent terms by FFT, mass past the
  top going to the atom (every value there is >= N h).
* ``OwnTerm`` / ``own_term_expectations``: upper bounds on E[(1 - K / (X' + s))_+] for many s at
  once (cells of w, Jensen in each cell, the cell at the threshold split exactly).

FFT error: one float64 FFT of length L has relative l2 error at most log2(L) eta / (1 - log2(L) eta),
eta = mu + gamma_4 (sqrt(2) + mu) ~ 7 u for twiddle factors accurate to mu ~ u (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed. 2002, Thm 24.2, radix-2 Cooley-Tukey); ``_fft_error``
takes twice that, a margin for pocketfft's mixed radices (tested against a long-double direct
convolution). A convolution IFFT(FFT p . FFT q) then errs in l2 by at most about 3 such errors
times ||p||_1 ||q||_2 + ||q||_1 ||p||_2 + ||p||_2 ||q||_2, and Young's inequality (||e * q||_2 <=
||e||_2 ||q||_1) carries the inputs' errors through; clipping negative values to 0 only shrinks
the error (the exact masses are >= 0). A caller adds ||weights||_2 times the bound to delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.fft
from scipy.special import log_ndtr, ndtr

_INFLATION = 1e-12
_FFT_MARGIN = 2.0
_UNIT_ROUNDOFF = np.finfo(np.float64).eps / 2.0


@dataclass(frozen=True, eq=False)
class GridPmf:
    """Masses on {0, h, ..., (N - 1) h}, an atom of values >= N h, and float-error bounds.

    ``error`` bounds ||masses - exact||_2 (``exact``: the same construction in exact arithmetic);
    ``overflow`` (the atom's mass) and ``overflow_mean`` (an upper bound on E[value; atom], kept
    for the rounded-up sums only) are already raised by their share of that error.
    """

    masses: np.ndarray
    step: float
    overflow: float
    overflow_mean: float
    error: float


def _log_ratio_argument(edges: np.ndarray, signal: float) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return (np.log(edges) + 0.5 * signal * signal) / signal


def term_rounded_up(signal: float, step: float, size: int) -> GridPmf:
    """h ceil(X / h) on the grid; X > (size - 1) h goes to the atom (values >= size h).

    P(h ceil(X/h) = m h) = S((m - 1) h) - S(m h), S the survival function of X, inflated. The atom's
    mean: h ceil(X/h) <= X + h and E[X; X > x] = P(T > (ln x - a^2/2) / a) (X's size-biased law).
    """
    edges = step * np.arange(size, dtype=np.float64)
    tail = np.where(edges > 0.0, ndtr(-_log_ratio_argument(edges, signal)), 1.0)
    tail = np.minimum.accumulate(np.minimum(1.0, tail * (1.0 + _INFLATION)))
    masses = np.zeros(size)
    masses[1:] = tail[:-1] - tail[1:]
    top = edges[-1]
    above_mean = float(ndtr(-(math.log(top) - 0.5 * signal * signal) / signal)) if top > 0.0 else 1.0
    overflow_mean = (above_mean + step * float(tail[-1])) * (1.0 + _INFLATION)
    return GridPmf(masses, step, float(tail[-1]), overflow_mean, 0.0)


def term_rounded_down(signal: float, step: float, size: int) -> GridPmf:
    """h floor(X / h) on the grid; X >= size h goes to the atom.

    P(h floor(X/h) = m h) = F((m + 1) h) - F(m h), F the CDF of X, inflated (each lower tail is
    >= the true one: a stochastically smaller variable).
    """
    edges = step * np.arange(size + 1, dtype=np.float64)
    lower = np.where(edges > 0.0, ndtr(_log_ratio_argument(edges, signal)), 0.0)
    lower = np.maximum.accumulate(np.minimum(1.0, lower * (1.0 + _INFLATION)))
    return GridPmf(np.diff(lower), step, float(max(1.0 - lower[-1], 0.0)), 0.0, 0.0)


def point_mass(size: int, step: float) -> GridPmf:
    masses = np.zeros(size)
    masses[0] = 1.0
    return GridPmf(masses, step, 0.0, 0.0, 0.0)


def _fft_error(length: int) -> float:
    bound = 7.0 * _UNIT_ROUNDOFF * math.log2(max(length, 2))
    return _FFT_MARGIN * bound / (1.0 - bound)


def _l2(values: np.ndarray) -> float:
    return float(np.sqrt(np.square(values).sum()))


def convolve(p: GridPmf, q: GridPmf) -> GridPmf:
    """The distribution of the sum of independent p and q, on the same grid.

    Values at or past the top (index >= N) join the atom; so does anything involving an atom
    (sums of non-negative values only grow). The atom counts P(p in atom) (total of q) +
    P(q in atom) (grid mass of p), and its mean E[p + q; p in atom] + E[p + q; q in atom, p on the
    grid] + the grid pairs past the top: both-in-atom is counted twice, which only adds.
    """
    size = p.masses.shape[0]
    length = scipy.fft.next_fast_len(2 * size - 1, real=True)
    spectrum_p = scipy.fft.rfft(p.masses, length)
    spectrum_q = spectrum_p if q is p else scipy.fft.rfft(q.masses, length)
    full = np.maximum(scipy.fft.irfft(spectrum_p * spectrum_q, length)[: 2 * size - 1], 0.0)
    l1_p, l1_q = float(p.masses.sum()), float(q.masses.sum())
    l2_p, l2_q = _l2(p.masses), _l2(q.masses)
    error = (p.error * l1_q + q.error * l1_p + p.error * q.error
             + 3.0 * _fft_error(length) * (l1_p * l2_q + l1_q * l2_p + l2_p * l2_q))
    values = p.step * np.arange(size, dtype=np.float64)
    # grid means, each raised by its float error (Cauchy-Schwarz with the values)
    mean_p = float(values @ p.masses) + _l2(values) * p.error
    mean_q = float(values @ q.masses) + _l2(values) * q.error
    tail = full[size:]
    tail_values = p.step * np.arange(size, 2 * size - 1, dtype=np.float64)
    overflow = (p.overflow * (l1_q + q.overflow) + q.overflow * l1_p
                + float(tail.sum()) + math.sqrt(tail.shape[0]) * error)
    overflow_mean = (p.overflow_mean * (l1_q + q.overflow) + p.overflow * (mean_q + q.overflow_mean)
                     + q.overflow_mean * l1_p + q.overflow * mean_p
                     + float(tail_values @ tail) + _l2(tail_values) * error)
    return GridPmf(full[:size].copy(), p.step, overflow, overflow_mean, error)


def power(term: GridPmf, count: int) -> GridPmf:
    """The sum of ``count`` independent copies of ``term`` (binary powering)."""
    result = point_mass(term.masses.shape[0], term.step)
    base = term
    while count > 0:
        if count & 1:
            result = convolve(result, base)
        count >>= 1
        if count:
            base = convolve(base, base)
    return result


# --- the own term of the remove direction -------------------------------------------------------

# w-cells: [W_LOW, W_HIGH], log-width in x at most CELL_LOG_WIDTH, between MIN_CELLS and MAX_CELLS.
W_LOW, W_HIGH = -9.0, 9.5
CELL_LOG_WIDTH, MIN_CELLS, MAX_CELLS = 0.02, 400, 6000
# Cells with mean >= SERIES_RATIO * s use the series lower bound on 1 / (x + s) (below): its
# remainder is below (1/30)^4 of that cell's K / (x + s) term.
SERIES_RATIO = 30.0
_CHUNK = 32


def _log_interval_mass(low, high):
    """ln(Phi(high) - Phi(low)) for low <= high, accurate in both tails (-inf for an empty interval)."""
    low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    upper = (low + high) > 0.0
    first = np.where(upper, -low, high)
    second = np.where(upper, -high, low)
    log_first, log_second = log_ndtr(first), log_ndtr(second)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = log_first + np.log1p(-np.exp(np.minimum(log_second - log_first, 0.0)))
    return np.where(high > low, value, -np.inf)


@dataclass(frozen=True, eq=False)
class OwnTerm:
    """Cells (w_k, w_{k+1}] of w for one signal a, their masses and conditional means of X'.

    ``suffix[m][k]`` = sum_{k' >= k} P(cell k') / mean_k'^m for m = 0..4 (one more entry, 0, at
    the end), for the series bound. Below w_0 one more region; above w_N mass ``high_mass``
    (charged in full).
    """

    signal: float
    edges: np.ndarray
    mass: np.ndarray
    mean: np.ndarray
    suffix: np.ndarray       # (5, cells + 1)
    low_mass: float
    low_mean: float
    high_mass: float


def own_term(signal: float) -> OwnTerm:
    a = float(signal)
    cells = int(min(MAX_CELLS, max(MIN_CELLS, math.ceil((W_HIGH - W_LOW) * a / CELL_LOG_WIDTH))))
    edges = np.linspace(W_LOW, W_HIGH, cells + 1)
    log_mass = _log_interval_mass(edges[:-1], edges[1:])
    # E[X' 1{cell}] = e^{a^2/2} E[e^{a w} 1{cell}] = e^{a^2} (Phi(w_{k+1} - a) - Phi(w_k - a))
    log_mean = a * a + _log_interval_mass(edges[:-1] - a, edges[1:] - a) - log_mass
    powers = np.exp(log_mass[None, :] - np.arange(5)[:, None] * log_mean[None, :])
    suffix = np.zeros((5, cells + 1))
    suffix[:, :-1] = np.cumsum(powers[:, ::-1], axis=1)[:, ::-1]
    low_log_mass = float(log_ndtr(W_LOW))
    low_mean = math.exp(a * a + float(log_ndtr(W_LOW - a)) - low_log_mass)
    return OwnTerm(a, edges, np.exp(log_mass), np.exp(log_mean), suffix,
                   math.exp(low_log_mass), low_mean, float(ndtr(-W_HIGH)))


def _jensen(mass, mean, knot, threshold):
    """mass * (1 - K / (mean + s)) (Jensen: the concave x -> 1 - K/(x + s) at the cell's mean)."""
    with np.errstate(over="ignore", invalid="ignore"):
        value = mass * (mean + knot - threshold) / (mean + knot)
    return np.where(np.isfinite(mean), value, mass)


def own_term_expectations(own: OwnTerm, knots: np.ndarray, threshold: float) -> np.ndarray:
    """Upper bounds on E[(1 - K / (X' + s))_+] for every knot s (K = ``threshold``).

    Cells entirely above the threshold X' > K - s contribute P (1 - K / (mean + s)) each (Jensen,
    x -> 1 - K/(x + s) is concave); the cell holding the threshold is split there, its upper part
    treated the same way (mass and mean in closed form); cells below contribute 0. For cells with
    mean >= 30 s, 1/(mean + s) >= (1/mean)(1 - u + u^2 - u^3), u = s/mean (the remainder
    u^4/(1 + u) is >= 0), so their sum is bounded through suffix sums of P / mean^m in O(1) per
    knot; the other cells are summed directly.
    """
    a, K = own.signal, float(threshold)
    s = np.asarray(knots, dtype=np.float64)
    cells = own.mass.shape[0]
    gap = K - s
    with np.errstate(divide="ignore"):
        w_star = np.where(gap > 0.0, (np.log(np.where(gap > 0.0, gap, 1.0)) - 0.5 * a * a) / a, -np.inf)
    # first cell entirely above the threshold, and first cell of the series region
    first_full = np.searchsorted(own.edges[:-1], w_star, side="left")
    first_series = np.maximum(first_full, np.searchsorted(own.mean, SERIES_RATIO * s, side="left"))
    sfx = own.suffix[:, first_series]
    total = sfx[0] - K * (sfx[1] - s * sfx[2] + s * s * sfx[3] - s ** 3 * sfx[4])
    total = np.maximum(total, 0.0)
    # cells [first_full, first_series) directly, in chunks of knots with similar ranges (only
    # knots beyond about K / 31 have any)
    direct = np.flatnonzero(first_series > first_full)
    for chunk in np.array_split(direct, max(1, direct.size // _CHUNK)):
        if chunk.size == 0:
            continue
        lo, hi = int(first_full[chunk].min()), int(first_series[chunk].max())
        index = np.arange(lo, hi)
        inside = (index[None, :] >= first_full[chunk, None]) & (index[None, :] < first_series[chunk, None])
        values = _jensen(own.mass[None, lo:hi], own.mean[None, lo:hi], s[chunk, None], K)
        total[chunk] += np.where(inside, values, 0.0).sum(axis=1)
    # the split cell (w_k, w_{k+1}] holding w_star: its part above w_star
    split = first_full - 1
    has_split = (split >= 0) & (split < cells) & np.isfinite(w_star)
    if np.any(has_split):
        k = split[has_split]
        start, top = w_star[has_split], own.edges[k + 1]
        with np.errstate(invalid="ignore"):
            log_mass = _log_interval_mass(start, top)
            mean = np.exp(a * a + _log_interval_mass(start - a, top - a) - log_mass)
        part = _jensen(np.exp(log_mass), mean, s[has_split], K)
        total[has_split] += np.where(np.isfinite(log_mass), part, 0.0)
    # below w_0, when the threshold lies there: the region's part above the threshold
    below = np.isfinite(w_star) & (w_star < own.edges[0])
    if np.any(below):
        start = w_star[below]
        end = np.full_like(start, own.edges[0])
        with np.errstate(invalid="ignore"):
            log_mass = _log_interval_mass(start, end)
            mean = np.exp(a * a + _log_interval_mass(start - a, end - a) - log_mass)
        total[below] += np.where(np.isfinite(log_mass), np.maximum(_jensen(np.exp(log_mass), mean, s[below], K), 0.0), 0.0)
    # no threshold (s >= K): the region below w_0 in full
    no_threshold = ~np.isfinite(w_star)
    if np.any(no_threshold):
        total[no_threshold] += np.maximum(_jensen(own.low_mass, own.low_mean, s[no_threshold], K), 0.0)
    return np.minimum(total + own.high_mass, 1.0)
