"""Geometric sums for ratios near 1, in torch float64 (differentiable).

Every closed form of a BLT (sensitivity, errors) is a combination of three sums over a ratio
r in (-1, 1], which is passed as its complement q = 1 - r so that decays within 1e-11 of 1 keep
full relative precision (for a product of decays use ``complement_of_product``):

    geometric_sum(q, m)          G(r, m) = sum_{k<m} r^k
    cumulative_geometric_sum(q, m)  S(r, m) = sum_{k<m} G(r, k) = sum_{k<m} (m - 1 - k) r^k
    product_geometric_sum(qx, qy, m) T(x, y, m) = sum_{k<m} G(x, k) G(y, k)

The textbook forms (1 - r^m)/(1 - r) and (m - G)/(1 - r) cancel catastrophically when
m (1 - r) is small. Here G and S are written with u = -log r as

    G = m * (u/q) * phi1(m u),    S = (u/q)^2 (m^2 phi2(m u) - m phi2(u)),
    phi1(z) = (1 - e^-z)/z,       phi2(z) = (e^-z - 1 + z)/z^2,

whose parts are all positive and evaluated by series near 0. T has no such form; it is
computed by doubling the index range with combination rules that only add non-negative
terms, so it is accurate to a few ulps for any m (cost O(log m)).
"""

from __future__ import annotations

import torch

_DIRECT = 0.5  # below this ratio r (q >= 0.5) the textbook formulas do not cancel

# phi2(z) = sum_j (-z)^j / (j + 2)!  (Horner, used for z < 0.5; 16 terms reach 1e-20)
_PHI2_SERIES = [(-1.0) ** j / float(torch.arange(1, j + 3, dtype=torch.float64).prod()) for j in range(16)]


def complement_of_product(qa: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """1 - (1 - qa)(1 - qb), without forming the product of two numbers near 1."""
    return qa + qb - qa * qb


def _phi1(z: torch.Tensor) -> torch.Tensor:
    small = z < 1e-5
    safe = torch.where(small, torch.ones_like(z), z)
    direct = -torch.expm1(-safe) / safe
    series = 1.0 - z / 2.0 + z * z / 6.0
    return torch.where(small, series, direct)


def _phi2(z: torch.Tensor) -> torch.Tensor:
    small = z < 0.5
    zs = torch.where(small, z, torch.zeros_like(z))
    series = torch.full_like(z, _PHI2_SERIES[-1])
    for c in reversed(_PHI2_SERIES[:-1]):
        series = series * zs + c
    safe = torch.where(small, torch.ones_like(z), z)
    direct = (torch.expm1(-safe) + safe) / (safe * safe)
    return torch.where(small, series, direct)


def _log_ratio(q: torch.Tensor):
    """u = -log(1 - q) and u/q for q in [0, 0.5] (the near-one branch)."""
    qs = torch.clamp(q, min=0.0, max=_DIRECT)
    u = -torch.log1p(-qs)
    tiny = qs < 1e-10
    safe = torch.where(tiny, torch.ones_like(qs), qs)
    ratio = torch.where(tiny, 1.0 + qs / 2.0, u / safe)
    return u, ratio


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def geometric_sum(q, m) -> torch.Tensor:
    """G(r, m) = sum_{k<m} r^k with r = 1 - q, q in [0, 2), integer m >= 0 (elementwise)."""
    q = _as_tensor(q)
    m = _as_tensor(m).to(q.dtype)
    near = q < _DIRECT
    u, ratio = _log_ratio(q)
    g_near = m * ratio * _phi1(m * u)
    qd = torch.where(near, torch.ones_like(q), q)
    g_far = (1.0 - torch.pow(1.0 - qd, m)) / qd
    return torch.where(near, g_near, g_far)


def cumulative_geometric_sum(q, m) -> torch.Tensor:
    """S(r, m) = sum_{k<m} G(r, k) = sum_{k<m} (m - 1 - k) r^k, r = 1 - q, integer m >= 0."""
    q = _as_tensor(q)
    m = _as_tensor(m).to(q.dtype)
    near = q < _DIRECT
    u, ratio = _log_ratio(q)
    s_near = ratio * ratio * (m * m * _phi2(m * u) - m * _phi2(u))
    qd = torch.where(near, torch.ones_like(q), q)
    g_far = (1.0 - torch.pow(1.0 - qd, m)) / qd
    s_far = (m - g_far) / qd
    return torch.where(near, s_near, s_far)


def product_geometric_sum(qx, qy, m: int) -> torch.Tensor:
    """T(x, y, m) = sum_{k<m} G(x, k) G(y, k) for x = 1 - qx, y = 1 - qy (broadcast), m >= 0.

    A segment of indices [0, L) is summarized by (x^L, y^L, G(x,L), G(y,L), S(x,L), S(y,L),
    T(L)). Appending a segment of length L2 uses G(x, L + k) = G(x, L) + x^L G(x, k):

        G(x, L+L2) = G(x,L) + x^L G(x,L2)
        S(x, L+L2) = S(x,L) + L2 G(x,L) + x^L S(x,L2)
        T(L+L2)    = T(L) + L2 G(x,L) G(y,L) + G(x,L) y^L S(y,L2) + G(y,L) x^L S(x,L2)
                     + x^L y^L T(L2)

    For x, y in [0, 1] every term is non-negative, so nothing cancels.
    """
    qx, qy = torch.broadcast_tensors(_as_tensor(qx), _as_tensor(qy))
    m = int(m)
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    zero = torch.zeros_like(qx)
    if m == 0:
        return zero
    one = torch.ones_like(qx)
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
