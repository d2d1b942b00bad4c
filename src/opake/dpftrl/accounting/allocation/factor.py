"""Remove-direction bound through a one-factor Gram matrix (Kahane's comparison), for many bins.

Derivation: docs/balls_in_bins_rdp.md, "A one-factor comparison for the remove direction". With
G the Gram matrix of the bins divided by sigma^2, U = (<m_j, y>)_j ~ N(0, G) under P and
R = (1/b) sum_j exp(U_j - G_jj/2), the remove divergence is H_gamma(Q||P) = E_P[(R - gamma)_+].

1. Comparison (Kahane 1985, the convexity inequality; its interpolation proof gives it for a
   copositive difference too). If G' is positive semidefinite and G' - G is copositive
   (v^T (G' - G) v >= 0 for every v >= 0), then E[f(R_G)] <= E[f(R_G')] for every convex f,
   where R_G' uses U' ~ N(0, G') and its own diagonal. A certificate here is
   G' = kappa^2 1 1^T + diag(d); with A = G - kappa^2 1 1^T and A+ its entrywise positive part it
   is copositive-above G when d_j >= (A+ x)_j / x_j for some x > 0 (Schur's test:
   v^T A v <= v^T A+ v <= sum_j d_j v_j^2 for v >= 0).
2. Under G', U'_j = kappa lambda + sqrt(d_j) xi_j with lambda, xi_j independent N(0, 1), so
   R' = exp(kappa lambda - kappa^2/2) S, S = (1/b) sum_j Y_j, Y_j = exp(sqrt(d_j) xi_j - d_j/2), and
   E[(R' - gamma)_+] = E[psi(S)], psi(s) = s Phi(z + kappa/2) - gamma Phi(z - kappa/2),
   z = ln(s/gamma)/kappa (the Gaussian hockey-stick, in closed form).
3. psi is log-concave (Prekopa: (s e^W - gamma)_+ is jointly log-concave in (s, W), W Gaussian),
   nondecreasing and 1-Lipschitz (psi'(s) = E[e^W; s e^W > gamma] <= E e^W = 1). Hence for any
   s0 > 0 with theta0 = psi'(s0)/psi(s0) and any truncation levels T_j,
       E psi(S) <= psi(s0) e^(-theta0 s0) prod_j E exp((theta/b) min(Y_j, T_j)) + (1/b) sum_j E(Y_j - T_j)_+
   for any theta >= theta0 (the tangent of ln psi, the independence of the Y_j, and
   psi(S) <= psi(S_T) + (S - S_T)).
4. Each factor is 1 + u E min(Y, T) + E[rho(min(Y, T))] with rho(y) = e^(u y) - 1 - u y, u = theta/b;
   rho(min(Y(z), T)) is convex and nondecreasing in the Gaussian z up to the truncation point and
   constant after, so its expectation is at most the chord rule on a grid of z (a convex function
   lies below its chords), which is what is computed.

Everything that does not depend on sigma (the certificates) is computed once per Gram matrix;
per sigma a table of ln E exp(theta S_T) on a grid of theta and T costs a few milliseconds, and
each epsilon a vectorized bisection for the tangent points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import log_ndtr, ndtr

from opake.dpftrl.accounting.allocation.hockey_stick import lognormal_excess

# kappa^2 candidates: 0.95 times the mean entry of G (1^T G 1 / b^2), then a geometric ladder of
# LADDER steps from the mean to the largest off-diagonal entry (where A+ is diagonal: the
# entrywise majorization). A larger kappa^2 needs a smaller d; which pair is best depends on sigma.
LADDER = 8
# Power iterations for the Perron vector of A+ (any x > 0 gives a valid certificate).
_POWER_ITERATIONS = 30
# Standardized truncation points t (T = exp(sqrt(d) t - d/2)) and the theta grid (ratio).
TRUNCATIONS = (4.0, 5.0, 6.0, 7.0, 8.5, 10.0)
_THETA_RATIO = 1.06
# z grid for the moment generating function: [_Z_LOW, t] with spacing about _Z_STEP (below
# _Z_LOW the integrand is charged its value at _Z_LOW).
_Z_LOW, _Z_STEP = -7.0, 0.03
# Relative error allowed for float64 evaluations of theta0, ln psi and the sums (generous).
_ETA = 1e-9
_EPS = np.finfo(np.float64).eps


@dataclass(frozen=True, eq=False)
class FactorCertificate:
    """G' = common 1 1^T + diag(d) with G' - G copositive, for the UNSCALED Gram matrix.

    ``levels`` are the distinct values of d (ascending) and ``counts`` how many bins have each
    (raising some d_j to a common level only adds a diagonal, so it stays a certificate).
    """

    common: float
    levels: np.ndarray
    counts: np.ndarray


def _perron_vector(nonnegative: np.ndarray) -> np.ndarray:
    """A positive vector near the Perron vector of a symmetric nonnegative matrix (power iteration)."""
    x = np.ones(nonnegative.shape[0])
    for _ in range(_POWER_ITERATIONS):
        y = nonnegative @ x
        top = float(y.max())
        if not top > 0.0:
            return np.ones_like(x)
        x = y / top + 1e-12  # stays positive, so every iterate is a valid Schur-test vector
    return x


def certify(gram: np.ndarray, common: float) -> FactorCertificate:
    """The diagonal d for kappa^2 = ``common`` by Schur's test on A+ (module docstring, step 1).

    With A = G - common 1 1^T and x > 0, v^T A v <= v^T A+ v <= sum_j ((A+ x)_j / x_j) v_j^2 for
    every v >= 0 (A <= A+ entrywise; then 2 a_jk v_j v_k <= a_jk (x_k/x_j v_j^2 + x_j/x_k v_k^2)),
    so common 1 1^T + diag(d) - G is copositive for d_j >= (A+ x)_j / x_j; the largest ratio is
    used for every bin. It is rounded up by a relative allowance of 4 (b + 2) ulp (the products
    and sums of b nonnegative terms).
    """
    g = np.asarray(gram, dtype=np.float64)
    b = g.shape[0]
    common = float(common)
    positive = np.maximum(g - common, 0.0)
    x = _perron_vector(positive)
    ratios = (positive @ x) / x
    value = float(ratios.max()) * (1.0 + 4.0 * (b + 2) * _EPS) + 1e-300
    return FactorCertificate(common, np.array([value]), np.array([b]))


def factor_certificates(gram: np.ndarray) -> tuple:
    """Certificates for kappa^2 on the ladder of ``LADDER`` (each one valid; the best is chosen later)."""
    g = np.asarray(gram, dtype=np.float64)
    b = g.shape[0]
    mean = float(g.mean())
    commons = [0.95 * mean]
    if b > 1:
        largest = float(g[~np.eye(b, dtype=bool)].max())
        if largest > mean > 0.0:
            commons += [mean * (largest / mean) ** (step / LADDER) for step in range(LADDER + 1)]
        else:
            commons += [mean, largest]
    else:
        commons.append(mean)
    return tuple(certify(g, common) for common in commons if common > 0.0)


# Certificates depend on G only (not on sigma): the last few Gram matrices' are kept, keyed by
# their bytes (a calibration evaluates one Gram matrix at many sigmas).
_CACHE: dict = {}
_CACHE_SIZE = 8
# Which certificates get a table at a given sigma (cost only: each one is a valid bound). Those
# with d / sigma^2 above _USEFUL_LEVEL lose to the heavy lognormal tail of S; of the others the
# _KEEP with the smallest kappa^2 + ln E S^2 (the variance of a lognormal with S's second moment
# on top of the common factor's: a proxy that ranked the best certificate among its first three
# in every configuration measured) are kept.
_USEFUL_LEVEL, _KEEP = 2.5, 3


def cached_certificates(gram: np.ndarray) -> tuple:
    """``factor_certificates(gram)``, computed once per Gram matrix."""
    g = np.ascontiguousarray(gram, dtype=np.float64)
    key = (g.shape, hash(g.tobytes()))
    found = _CACHE.get(key)
    if found is not None and np.array_equal(found[0], g):
        return found[1]
    certificates = factor_certificates(g)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (g.copy(), certificates)
    return certificates


def useful_certificates(gram: np.ndarray, noise_multiplier: float) -> tuple:
    """The cached certificates worth a table at this sigma (see _USEFUL_LEVEL), best proxy first."""
    variance = float(noise_multiplier) ** 2
    b = float(np.asarray(gram).shape[0])
    ranked = []
    for certificate in cached_certificates(gram):
        levels = certificate.levels / variance
        if float(levels.max()) > _USEFUL_LEVEL:
            continue
        second_moment = 1.0 + float(certificate.counts @ np.expm1(levels)) / b**2  # E S^2
        ranked.append((certificate.common / variance + math.log(second_moment), certificate))
    ranked.sort(key=lambda pair: pair[0])
    return tuple(certificate for _, certificate in ranked[:_KEEP])


@dataclass(frozen=True, eq=False)
class FactorTable:
    """ln E exp(theta_m S_T) for the truncations T_r (rows) and thetas (columns), and the tails.

    ``kappa`` is sqrt(common / sigma^2); ``tails[r]`` = (1/b) sum_j E(Y_j - T_rj)_+.
    """

    kappa: float
    thetas: np.ndarray
    log_mgf: np.ndarray   # (len(TRUNCATIONS), len(thetas))
    tails: np.ndarray     # (len(TRUNCATIONS),)


def _chord_weights(grid: np.ndarray) -> tuple:
    """Weights (left, right) with int_{z_k}^{z_k+1} f phi <= f(z_k) left_k + f(z_k+1) right_k for convex f.

    A convex f lies below its chord on each cell, and the chord's Gaussian integral is, with
    h = c - a: right = int (z - a)/h phi = (phi(a) - phi(c) - a (Phi(c) - Phi(a)))/h, left = mass - right.
    Masses are differences of the lower tail left of 0 and of the upper tail right of it.
    """
    a, c = grid[:-1], grid[1:]
    mass = np.where(c <= 0.0, ndtr(c) - ndtr(a), ndtr(-a) - ndtr(-c))
    density = np.exp(-0.5 * grid * grid) / math.sqrt(2.0 * math.pi)
    right = (density[:-1] - density[1:] - a * mass) / (c - a)
    right = np.clip(right, 0.0, mass)
    return mass - right, right


def _log_mgf_one_level(variance: float, t: float, u: np.ndarray) -> tuple:
    """Upper bounds on ln E exp(u min(Y, T)) for one level (module docstring, step 4), and E(Y - T)_+.

    E exp(u min(Y, T)) = 1 + u E min(Y, T) + E rho(min(Y, T)) with E min(Y, T) <= 1 and
    rho(y) = e^(u y) - 1 - u y. As a function of the Gaussian z (Y = exp(sd z - sd^2/2)),
    rho(min(Y, T)) is convex and nondecreasing up to z = t and constant rho(T) after, so its
    expectation is at most the chord rule on [_Z_LOW, t], plus rho(Y(_Z_LOW)) Phi(_Z_LOW) below
    and rho(T) Phibar(t) above.
    """
    if variance <= 0.0:  # Y = 1 exactly, below every T (t >= 0)
        return u * (1.0 + _ETA) + 1e-300, 0.0
    sd = math.sqrt(variance)
    excess = float(lognormal_excess(np.array([sd]), t)[0])
    points = max(64, int(math.ceil((t - _Z_LOW) / _Z_STEP)))
    grid = np.linspace(_Z_LOW, t, points + 1)
    left, right = _chord_weights(grid)
    x = u[:, None] * np.exp(sd * grid - variance / 2.0)[None, :]   # u Y at the grid points
    # e^x - 1 - x, rounded up; where e^x would overflow the bound is useless: +inf, not a warning
    rho = np.where(x < 700.0, np.expm1(np.minimum(x, 700.0)) - x + 4.0 * _EPS * x, np.inf)
    expected_rho = (rho[:, :-1] @ left + rho[:, 1:] @ right
                    + rho[:, 0] * float(ndtr(_Z_LOW)) + rho[:, -1] * float(ndtr(-t)))
    expected_rho = expected_rho * (1.0 + _ETA) + 1e-300
    return np.log1p(u + expected_rho) * (1.0 + _ETA) + 1e-300, excess


def factor_table(certificate: FactorCertificate, noise_multiplier: float) -> FactorTable:
    """Everything of the bound that does not depend on epsilon, for one certificate and sigma."""
    variance = float(noise_multiplier) ** 2
    kappa_squared = certificate.common / variance
    levels = certificate.levels / variance
    counts = certificate.counts.astype(np.float64)
    b = float(counts.sum())
    top = 16.0 + 64.0 * (1.0 + 1.0 / kappa_squared)  # theta0 is about (epsilon / kappa^2 + 1/2) / s0
    thetas = np.exp(np.arange(math.log(0.25), math.log(top) + math.log(_THETA_RATIO), math.log(_THETA_RATIO)))
    log_mgf = np.zeros((len(TRUNCATIONS), thetas.shape[0]))
    tails = np.zeros(len(TRUNCATIONS))
    u = thetas / b
    for r, t in enumerate(TRUNCATIONS):
        for level, count in zip(levels, counts):
            values, excess = _log_mgf_one_level(float(level), t, u)
            log_mgf[r] += count * values
            tails[r] += count * excess / b
    tails = tails * (1.0 + _ETA) + 1e-300
    return FactorTable(math.sqrt(kappa_squared), thetas, log_mgf, tails)


def _log_psi_and_slope(log_s: np.ndarray, kappa, epsilon: float):
    """ln psi(s), theta0 = psi'(s)/psi(s) at s = exp(log_s), and where both are accurate.

    psi(s) = s Phi(d1) - gamma Phi(d2), d1 = d2 + kappa = ln(s/gamma)/kappa + kappa/2. Out of the
    money the two terms nearly cancel: their ratio is about |d1| / (|d1| + kappa) < 1. Where it
    is above 1 - 1e-6 the relative rounding error could exceed 1e-10, and the point is not used.
    """
    z = (log_s - epsilon) / kappa
    log_phi_1 = log_ndtr(z + kappa / 2.0)
    log_first = log_s + log_phi_1                            # ln(s Phi(d1))
    log_second = epsilon + log_ndtr(z - kappa / 2.0)         # ln(gamma Phi(d2))
    gap = log_second - log_first
    accurate = gap < -1e-6
    log_psi = log_first + np.log(-np.expm1(np.minimum(gap, -1e-6)))
    slope = np.exp(log_phi_1 - log_psi)                      # Phi(d1) / psi
    return log_psi, slope, accurate


def factor_remove_deltas(tables, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(Q||P): the smallest over the certificates' tables (module docstring).

    For each table and theta_m, a tangent point s0 with theta0(s0) (1 + eta) <= theta_m: theta0
    falls with s (ln psi is concave), so ln s0 is bisected for all of them at once and the right
    end of each bracket kept; the bound is then checked at that very point.
    """
    tables = tuple(tables)
    if not tables:
        return 1.0
    eps = float(epsilon)
    thetas = np.concatenate([table.thetas for table in tables])
    kappas = np.concatenate([np.full(table.thetas.shape, table.kappa) for table in tables])
    spread = 40.0 * (1.0 + kappas) + 40.0
    low, high = eps - spread, eps + spread
    for _ in range(32):
        middle = 0.5 * (low + high)
        _, slope, _ = _log_psi_and_slope(middle, kappas, eps)
        fits = slope * (1.0 + _ETA) <= thetas
        high = np.where(fits, middle, high)
        low = np.where(fits, low, middle)
    log_psi, slope, accurate = _log_psi_and_slope(high, kappas, eps)
    valid = accurate & np.isfinite(log_psi) & (slope > 0.0) & (slope * (1.0 + _ETA) <= thetas)
    # ln psi(s0) - theta0 s0, with the rounding allowances of ln psi and theta0 (module docstring)
    base = np.where(valid, log_psi + _ETA * np.abs(log_psi) + 1e-12 - slope * np.exp(high) * (1.0 - 2.0 * _ETA), np.inf)
    best, start = 1.0, 0
    for table in tables:
        stop = start + table.thetas.shape[0]
        exponent = base[None, start:stop] + table.log_mgf
        values = np.exp(np.minimum(exponent, 0.0)) + table.tails[:, None]
        best = min(best, float(values.min()))
        start = stop
    return best
