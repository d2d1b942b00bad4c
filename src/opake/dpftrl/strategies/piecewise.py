"""A learning-rate schedule as a piecewise polynomial, and the discrete sums of its pieces (float64).

The fast scheduled errors (``blt_schedule``) need sums like sum_k eta_{s+k} r^k over stretches of
steps. They are cheap in closed form when eta is a polynomial on each stretch, so the schedule is
compressed once into pieces [start, start + length) of the steps 1..n-1 on which

    eta_{start + k} = phi(k) = sum_q coef_q (k / length)^q        (k = 0 .. length - 1),

a polynomial of degree <= ``degree`` in the scaled step z = k / length in [0, 1). Compression
(``compress``) bisects [1, n) until a least-squares fit on each piece is within ``tolerance``
(relative) of every value of the piece (checked on all of them, so the bound is certified up to
the rounding of the check), splitting at a jump or kink of the schedule when the second
differences show one; a piece of at most degree + 1 steps is interpolated exactly. Smooth and
piecewise smooth schedules (cosine, linear warmup and decay, steps, exponential decay) take a
few dozen pieces at tolerance 1e-12; a schedule without structure degrades to one piece per
degree + 1 steps (exact, but no faster than the step-by-step recursion).

Discrete sums of a piece are written with binomial moments: k^q = sum_j S(q, j) j! C(k, j)
(Stirling numbers of the second kind, all terms non-negative) and sum_{k<m} C(k, j) = C(m, j + 1)
(hockey stick), so the power sums PS_q(m) = sum_{k<m} (k / h)^q are positive combinations,
accurate for any m; they are polynomials in m, also evaluated at non-integer m when a
polynomial in m is interpolated (``autocorrelation``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from opake.errors import InvalidArgumentError

MAX_DEGREE = 8


def _stirling_table(size: int) -> np.ndarray:
    """ST[q, j] = S(q, j) j! (number of surjections), exact in float64 for q < 17."""
    s = np.zeros((size, size))
    s[0, 0] = 1.0
    for q in range(1, size):
        for j in range(1, q + 1):
            s[q, j] = j * s[q - 1, j] + s[q - 1, j - 1]
    return s * np.array([math.factorial(j) for j in range(size)], dtype=np.float64)


STIRLING = _stirling_table(2 * MAX_DEGREE + 4)
_BINOM = np.array([[math.comb(a, b) for b in range(2 * MAX_DEGREE + 4)] for a in range(2 * MAX_DEGREE + 4)],
                  dtype=np.float64)


def binomials_of(m, count: int) -> np.ndarray:
    """C(m, j) for j = 0..count-1 as polynomials in m (real m allowed), shape m.shape + (count,)."""
    m = np.asarray(m, dtype=np.float64)[..., None]
    j = np.arange(count - 1, dtype=np.float64)
    factors = (m - j) / (j + 1.0)
    return np.concatenate([np.ones(m.shape), np.cumprod(factors, axis=-1)], axis=-1)


def power_sums(m, h, degree: int) -> np.ndarray:
    """PS_q(m) = sum_{k<m} (k / h)^q for q = 0..degree (shape broadcast(m, h) + (degree + 1,)).

    PS_q = h^-q sum_j S(q, j) j! C(m, j + 1): the hockey-stick identity on the binomial moments.
    """
    m, h = np.broadcast_arrays(np.asarray(m, dtype=np.float64), np.asarray(h, dtype=np.float64))
    upper = binomials_of(m, degree + 2)[..., 1:]                   # C(m, j + 1), j = 0..degree
    sums = upper @ STIRLING[: degree + 1, : degree + 1].T
    return sums * np.power(h[..., None], -np.arange(degree + 1, dtype=np.float64))


def evaluate(coef: np.ndarray, z) -> np.ndarray:
    """sum_q coef[..., q] z^q (Horner), coef[..., q] broadcast against z."""
    z = np.asarray(z)
    out = np.zeros(np.broadcast_shapes(coef.shape[:-1], z.shape), dtype=np.result_type(coef, z))
    for q in range(coef.shape[-1] - 1, -1, -1):
        out = out * z + coef[..., q]
    return out


def substitute(coef: np.ndarray, offset, scale) -> np.ndarray:
    """Coefficients of p(offset + scale * z) from those of p(z) (binomial expansion, any batch)."""
    deg = coef.shape[-1]
    offset = np.asarray(offset, dtype=np.float64)[..., None, None]
    scale = np.asarray(scale, dtype=np.float64)[..., None]
    q = np.arange(deg)
    binom = _BINOM[:deg, :deg]                                     # C(q, w) at [q, w]
    power = np.where(q[:, None] >= q[None, :], q[:, None] - q[None, :], 0).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(q[:, None] >= q[None, :], binom * np.power(offset, power), 0.0)
    out = np.einsum("...q,...qw->...w", coef, shift)
    return out * np.power(scale, q.astype(np.float64))


def product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Coefficients of p_a * p_b (batched convolution)."""
    out = np.zeros(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]) + (a.shape[-1] + b.shape[-1] - 1,))
    for i in range(a.shape[-1]):
        out[..., i: i + b.shape[-1]] += a[..., i: i + 1] * b
    return out


def _vandermonde_solve(z: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Monomial coefficients of the polynomial through (z_i, values_i), batched over leading axes."""
    deg = z.shape[-1]
    v = np.power(z[..., :, None], np.arange(deg, dtype=np.float64))
    return np.linalg.solve(v, values[..., None])[..., 0]


def autocorrelation(coef: np.ndarray, h, length) -> np.ndarray:
    """Coefficients (in z = d' / h) of alpha(d' + 1), d' = 0..length-2, where

        alpha(d) = sum_{i=0}^{length-1-d} phi(i) phi(i + d),    phi(i) = sum_q coef_q (i / h)^q.

    alpha is a polynomial of degree 2 deg + 1 in d: phi(z) phi(z + delta) = sum_uv c_uv z^u delta^v
    (delta = d / h) and the sum over i is PS_u(length - d), so alpha(d) = sum_uv c_uv delta^v
    PS_u(length - d). It is evaluated exactly at 2 deg + 2 Chebyshev points of d' and
    interpolated. Batched over the leading axes of coef, h and length.
    """
    coef = np.asarray(coef, dtype=np.float64)
    h = np.asarray(h, dtype=np.float64)
    length = np.asarray(length, dtype=np.float64)
    deg = coef.shape[-1] - 1
    out_deg = 2 * deg + 1
    # phi(z + delta) = sum_q coef_q sum_v C(q, v) z^(q-v) delta^v -> s[..., i, v] (z^i delta^v)
    s = np.zeros(coef.shape[:-1] + (deg + 1, deg + 1))
    for q in range(deg + 1):
        for v in range(q + 1):
            s[..., q - v, v] += coef[..., q] * _BINOM[q, v]
    c = np.zeros(coef.shape[:-1] + (2 * deg + 1, deg + 1))        # c[..., u, v]
    for i in range(deg + 1):
        c[..., i: i + deg + 1, :] += coef[..., i, None, None] * s
    count = out_deg + 1
    cheb = 0.5 * (1.0 - np.cos(np.pi * (np.arange(count) + 0.5) / count))
    points = length[..., None] - 1.0                                # d = 1..length-1 exist
    short = points < count
    # long pieces: Chebyshev points of d in [1, length - 1]; short ones: the integers 1..length-1
    # and, for the rest of the system, "coefficient w = 0" for w >= length - 1
    d = np.where(short, 1.0 + np.arange(count), 1.0 + np.maximum(length[..., None] - 2.0, 0.0) * cheb)
    delta = d / h[..., None]
    ps = power_sums(length[..., None] - d, h[..., None], 2 * deg)   # (..., nodes, u)
    dv = np.power(delta[..., None], np.arange(deg + 1, dtype=np.float64))
    values = np.einsum("...uv,...nu,...nv->...n", c, ps, dv)
    span = np.where(short[..., 0], 1.0, np.maximum(length - 2.0, 1.0) / h)
    x = (d - 1.0) / h[..., None] / span[..., None]                 # normalized to [0, 1]
    w = np.arange(count, dtype=np.float64)
    vand = np.power(x[..., :, None], w)
    keep = np.arange(count) < points                                # rows that are real nodes
    zero_rows = (w[None, :] == np.arange(count)[:, None]).astype(np.float64)
    vand = np.where(keep[..., :, None], vand, zero_rows)
    values = np.where(keep, values, 0.0)
    coef_norm = np.linalg.solve(vand, values[..., None])[..., 0]
    return coef_norm * np.power(span[..., None], -w)


@dataclass(frozen=True, eq=False)
class PiecewiseSchedule:
    """eta_0 and a piecewise polynomial eta on the steps 1..n-1 (see the module docstring)."""

    n_steps: int
    first: float
    start: np.ndarray        # (K,) first step of each piece
    length: np.ndarray       # (K,) number of steps
    coef: np.ndarray         # (K, degree + 1), in z = k / length
    max_relative_error: float
    breaks: np.ndarray       # step 1 and the steps where a jump or kink of eta was found
    compressed: np.ndarray = field(repr=False)   # (n,) the pieces' values, read-only (``values``)

    @property
    def num_pieces(self) -> int:
        return int(self.start.shape[0])

    def values(self) -> np.ndarray:
        """The compressed schedule eta_0..eta_{n-1} (read-only; the error bound is measured on it)."""
        return self.compressed


def _values(n_steps: int, first: float, start: np.ndarray, length: np.ndarray, coef: np.ndarray) -> np.ndarray:
    # a piece at a time (schedules compress to a few hundred long pieces: faster than gathering
    # every step's coefficients at once)
    out = np.empty(n_steps)
    out[0] = first
    for s, ln, c in zip(start, length, coef):
        out[s: s + ln] = evaluate(c, np.arange(ln) / ln)
    return out


def _fit(values: np.ndarray, degree: int) -> np.ndarray:
    length = values.shape[0]
    z = np.arange(length) / length
    if length <= degree + 1:
        coef = np.zeros(degree + 1)
        coef[:length] = _vandermonde_solve(z, values)
        return coef
    count = 8 * (degree + 1)
    if length <= count:
        pick = np.arange(length)
    else:
        pick = np.unique(np.round(0.5 * (length - 1) * (1.0 - np.cos(np.pi * np.arange(count) / (count - 1))))).astype(int)
    x = 2.0 * z[pick] - 1.0
    cheb = np.polynomial.chebyshev.chebfit(x, values[pick], degree)
    # Chebyshev in x = 2z - 1 -> monomials in z
    mono_x = np.polynomial.chebyshev.cheb2poly(cheb)
    return substitute(mono_x, -1.0, 2.0)


def _split_point(values: np.ndarray) -> tuple[int, bool]:
    """Where to split a piece that failed, and whether it is a jump or kink of the schedule (a
    spike in the second differences) rather than the midpoint."""
    length = values.shape[0]
    if length >= 8:
        d2 = np.abs(np.diff(values, 2))
        i = int(np.argmax(d2))
        if d2[i] > 1e3 * (float(np.mean(d2)) + 1e-300) and 1 <= i + 1 < length - 1:
            return i + 1, True
    return length // 2, False


def compress(eta: np.ndarray, *, degree: int = 5, tolerance: float = 1e-12, max_length: int | None = None,
             max_pieces: int = 4096, grade: bool = False) -> PiecewiseSchedule:
    """Piecewise polynomial schedule within ``tolerance`` (relative) of ``eta`` on every step.

    ``max_length`` caps the length of a piece (pieces are cut into equal parts afterwards,
    re-expanded exactly), so that the piece ends form a grid of rows. With ``grade``, the piece
    after step 1 and after every jump or kink found (``breaks``) is also cut at 1, 2, 4, ...
    steps past it, so that the ends resolve what starts there on every time scale. When more than
    ``max_pieces`` pieces would be needed, the tolerance is relaxed (x10 until it fits) and the
    bound actually met is reported in ``max_relative_error``.
    """
    eta = np.asarray(eta, dtype=np.float64)
    if eta.ndim != 1 or eta.shape[0] < 1:
        raise InvalidArgumentError(f"eta must be a non-empty 1-D array, got shape {eta.shape}")
    if not 0 <= degree <= MAX_DEGREE:
        raise InvalidArgumentError(f"degree must be in 0..{MAX_DEGREE}, got {degree}")
    n = eta.shape[0]
    tol = float(tolerance)
    while True:
        pieces, breaks = _bisect(eta, degree, tol, max_pieces)
        if pieces is not None:
            break
        tol *= 10.0
    breaks = sorted(set(breaks) | ({1} if n > 1 else set()))
    if grade and pieces:
        pieces = _grade(pieces, breaks)
    if max_length is not None:
        pieces = _cut(pieces, int(max_length))
    if pieces:
        start = np.array([p[0] for p in pieces], dtype=np.int64)
        length = np.array([p[1] for p in pieces], dtype=np.int64)
        coef = np.array([p[2] for p in pieces])
    else:
        start = np.zeros(0, dtype=np.int64)
        length = np.zeros(0, dtype=np.int64)
        coef = np.zeros((0, degree + 1))
    for arr in (start, length, coef):
        arr.setflags(write=False)
    breaks = np.array(breaks, dtype=np.int64)
    breaks.setflags(write=False)
    # The bound reported is measured on the final pieces: grading and cutting re-expand the fitted
    # polynomials, which moves their values by rounding (seen: 6.30e-13 -> 6.34e-13).
    values = _values(n, float(eta[0]), start, length, coef)
    values.setflags(write=False)
    worst = float(np.max(np.abs(values[1:] / eta[1:] - 1.0))) if n > 1 else 0.0
    return PiecewiseSchedule(n, float(eta[0]), start, length, coef, worst, breaks, values)


def _bisect(eta, degree, tol, max_pieces):
    n = eta.shape[0]
    stack = [(1, n)] if n > 1 else []
    pieces, breaks = [], []
    while stack:
        a, b = stack.pop()
        values = eta[a:b]
        coef = _fit(values, degree)
        length = b - a
        if length > 4096:  # most failures show on a sample; only a passing fit is checked everywhere
            probe = np.unique(np.linspace(0, length - 1, 512).round().astype(np.int64))
            sample = float(np.max(np.abs(evaluate(coef, probe / length) - values[probe]) / values[probe]))
            if sample > tol:
                offset, spike = _split_point(values)
                stack.append((a + offset, b))
                stack.append((a, a + offset))
                if spike:
                    breaks.append(a + offset)
                continue
        fitted = evaluate(coef, np.arange(length) / length)
        err = float(np.max(np.abs(fitted - values) / values))
        if err <= tol or b - a <= degree + 1:
            pieces.append((a, b - a, coef))
            if len(pieces) > max_pieces:
                return None, breaks
            continue
        offset, spike = _split_point(values)
        cut = a + offset
        if spike:
            breaks.append(cut)
        stack.append((cut, b))
        stack.append((a, cut))
    pieces.sort(key=lambda p: p[0])
    return pieces, breaks


def _grade(pieces, breaks):
    """Pieces starting at a break cut at 1, 2, 4, ... steps past it (up to half the piece)."""
    starts = {p[0] for p in pieces}
    cuts = []
    for b in breaks:
        if b not in starts:
            continue
        length = next(p[1] for p in pieces if p[0] == b)
        step = 1
        while 2 * step <= length // 2:
            cuts.append(b + step)
            step *= 2
        if step < length and length > 1:
            cuts.append(b + step)
    return _split(pieces, sorted(set(cuts)))


def _split(pieces, cuts):
    """Pieces split at the absolute steps ``cuts`` (each part re-expanded exactly)."""
    out, i = [], 0
    for start, length, coef in pieces:
        inner = []
        while i < len(cuts) and cuts[i] < start + length:
            if cuts[i] > start:
                inner.append(cuts[i] - start)
            i += 1
        edges = np.array([0] + inner + [length])
        for lo, hi in zip(edges[:-1], edges[1:]):
            out.append((start + int(lo), int(hi - lo), substitute(coef, lo / length, (hi - lo) / length)))
    return out


def _cut(pieces, max_length):
    if not pieces:
        return pieces
    start, length, coef, _ = cut(np.array([p[0] for p in pieces]), np.array([p[1] for p in pieces]),
                                 np.array([p[2] for p in pieces]), max_length)
    return list(zip(start.tolist(), length.tolist(), coef))


def cut(start: np.ndarray, length: np.ndarray, coef: np.ndarray, max_length: int):
    """Pieces cut into near-equal parts of at most ``max_length`` steps, each re-expanded exactly
    (phi(lo + k) in z' = k / (hi - lo)); returns (start, length, coef, parent index)."""
    out_start, out_length, out_coef, parent = [], [], [], []
    for j, (s0, ln, c) in enumerate(zip(start, length, coef)):
        parts = max(1, -(-int(ln) // int(max_length)))
        edges = np.linspace(0, int(ln), parts + 1).round().astype(np.int64)
        lo, hi = edges[:-1], edges[1:]
        out_start.append(int(s0) + lo)
        out_length.append(hi - lo)
        out_coef.append(substitute(np.broadcast_to(c, (parts, c.shape[-1])), lo / ln, (hi - lo) / ln))
        parent.append(np.full(parts, j, dtype=np.int64))
    return (np.concatenate(out_start), np.concatenate(out_length), np.concatenate(out_coef),
            np.concatenate(parent))
