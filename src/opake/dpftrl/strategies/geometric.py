"""Geometric sums for ratios near 1, in numpy float64.

Every closed form of a BLT (sensitivity, errors) is a combination of three sums over a ratio
r in (-1, 1], which is passed as its complement q = 1 - r so that decays within 1e-11 of 1 keep
full relative precision (for a product of decays use ``complement_of_product``):

    geometric_sum(q, m)             G(r, m) = sum_{k<m} r^k
    cumulative_geometric_sum(q, m)  S(r, m) = sum_{k<m} G(r, k) = sum_{k<m} (m - 1 - k) r^k
    product_geometric_sum(qx, qy, m) T(x, y, m) = sum_{k<m} G(x, k) G(y, k)

The textbook forms (1 - r^m)/(1 - r) and (m - G)/(1 - r) cancel catastrophically when
m (1 - r) is small. Here G and S are written with u = -log r as

    G = m * (u/q) * phi1(m u),    S = (u/q)^2 (m^2 phi2(m u) - m phi2(u)),
    phi1(z) = (1 - e^-z)/z,       phi2(z) = (e^-z - 1 + z)/z^2,

whose parts are positive and evaluated by series near 0. T has no such form; it is computed
by doubling the index range with combination rules that only add non-negative terms, so it
is accurate to a few ulps for any m (cost O(log m)).

Complex step. Every function also accepts complex input x + i h with h ~ 1e-20 and then
returns f(x) + i h f'(x) to first order (branches are chosen on the real part, and log1p and
expm1 are extended to first order here, since numpy's complex log1p loses the real part's
precision near 0). The optimizer uses this for exact gradients without an autodiff framework.
"""

from __future__ import annotations

import math

import numpy as np

from opake.errors import InvalidArgumentError

_DIRECT = 0.5  # below this ratio r (q >= 0.5) the textbook formulas do not cancel

# phi2(z) = sum_j (-z)^j / (j + 2)!  (Horner, used for z < 0.5; 16 terms reach 1e-20)
_PHI2_SERIES = [(-1.0) ** j / math.factorial(j + 2) for j in range(16)]


def log1p(x):
    """log(1 + x), also for x + i h (first order in h)."""
    if np.iscomplexobj(x):
        return np.log1p(x.real) + 1j * (x.imag / (1.0 + x.real))
    return np.log1p(x)


def expm1(x):
    """exp(x) - 1, also for x + i h (first order in h)."""
    if np.iscomplexobj(x):
        return np.expm1(x.real) + 1j * (np.exp(x.real) * x.imag)
    return np.expm1(x)


def complement_of_product(qa, qb):
    """1 - (1 - qa)(1 - qb), without forming the product of two numbers near 1."""
    return qa + qb - qa * qb


def _phi1(z):
    small = z.real < 1e-5
    safe = np.where(small, 1.0, z)
    return np.where(small, 1.0 - z / 2.0 + z * z / 6.0, -expm1(-safe) / safe)


def _phi2(z):
    small = z.real < 0.5
    zs = np.where(small, z, 0.0)
    series = np.full_like(z, _PHI2_SERIES[-1])
    for c in reversed(_PHI2_SERIES[:-1]):
        series = series * zs + c
    safe = np.where(small, 1.0, z)
    return np.where(small, series, (expm1(-safe) + safe) / (safe * safe))


def _log_ratio(q):
    """u = -log(1 - q) and u/q on the near-one branch (q below 0.5)."""
    qs = np.where(q.real < _DIRECT, q, _DIRECT)
    qs = np.where(qs.real > 0, qs, 0.0)
    u = -log1p(-qs)
    tiny = qs.real < 1e-10
    safe = np.where(tiny, 1.0, qs)
    return u, np.where(tiny, 1.0 + qs / 2.0, u / safe)


def _array(x):
    x = np.asarray(x)
    return x if np.iscomplexobj(x) else x.astype(np.float64)


def geometric_sum(q, m):
    """G(r, m) = sum_{k<m} r^k with r = 1 - q, q in [0, 2), integer m >= 0 (elementwise)."""
    q = _array(q)
    m = np.asarray(m, dtype=np.float64)
    near = q.real < _DIRECT
    u, ratio = _log_ratio(q)
    qd = np.where(near, 1.0, q)
    return np.where(near, m * ratio * _phi1(m * u), (1.0 - np.power(1.0 - qd, m)) / qd)


def cumulative_geometric_sum(q, m):
    """S(r, m) = sum_{k<m} G(r, k) = sum_{k<m} (m - 1 - k) r^k, r = 1 - q, integer m >= 0."""
    q = _array(q)
    m = np.asarray(m, dtype=np.float64)
    near = q.real < _DIRECT
    u, ratio = _log_ratio(q)
    s_near = ratio * ratio * (m * m * _phi2(m * u) - m * _phi2(u))
    qd = np.where(near, 1.0, q)
    s_far = (m - (1.0 - np.power(1.0 - qd, m)) / qd) / qd
    return np.where(near, s_near, s_far)


def product_geometric_sum(qx, qy, m: int):
    """T(x, y, m) = sum_{k<m} G(x, k) G(y, k) for x = 1 - qx, y = 1 - qy (broadcast), m >= 0.

    A segment of indices [0, L) is summarized by (x^L, y^L, G(x,L), G(y,L), S(x,L), S(y,L),
    T(L)). Appending a segment of length L2 uses G(x, L + k) = G(x, L) + x^L G(x, k):

        G(x, L+L2) = G(x,L) + x^L G(x,L2)
        S(x, L+L2) = S(x,L) + L2 G(x,L) + x^L S(x,L2)
        T(L+L2)    = T(L) + L2 G(x,L) G(y,L) + G(x,L) y^L S(y,L2) + G(y,L) x^L S(x,L2)
                     + x^L y^L T(L2)

    For x, y in [0, 1] every term is non-negative, so nothing cancels.
    """
    qx, qy = np.broadcast_arrays(_array(qx), _array(qy))
    m = int(m)
    if m < 0:
        raise InvalidArgumentError(f"m must be >= 0, got {m}")
    zero = np.zeros(qx.shape, dtype=np.result_type(qx, qy))
    if m == 0:
        return zero
    one = zero + 1.0
    base = (1.0 - qx, 1.0 - qy, one, one, zero, zero, zero, 1)

    def append(a, b):
        xa, ya, gxa, gya, sxa, sya, ta, la = a
        xb, yb, gxb, gyb, sxb, syb, tb, lb = b
        return (
            xa * xb,
            ya * yb,
            gxa + xa * gxb,
            gya + ya * gyb,
            sxa + lb * gxa + xa * sxb,
            sya + lb * gya + ya * syb,
            ta + lb * gxa * gya + gxa * ya * syb + gya * xa * sxb + xa * ya * tb,
            la + lb,
        )

    acc = base
    for bit in bin(m)[3:]:
        acc = append(acc, acc)
        if bit == "1":
            acc = append(acc, base)
    return acc[6]
