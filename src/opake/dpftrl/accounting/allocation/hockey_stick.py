"""Direct (epsilon, delta) bounds for the balls-in-bins dominating pair, without Renyi divergences.

Derivation in docs/balls_in_bins_rdp.md ("Direct hockey-stick bounds"). With G the Gram matrix
of C's bin columns divided by sigma^2, P = N(0, I), Q = (1/b) sum_i Q_i, Q_i = N(m_i, I),
R = Q/P = (1/b) sum_j X_j, X_j = exp(<m_j, y> - G_jj/2) and gamma = e^epsilon:

remove, H_gamma(Q||P) = (1/b) sum_i E_{Q_i}[g(R)], g(R) = (1 - gamma/R)_+.
  Under Q_i let w = <m_i, z>/sqrt(G_ii) ~ N(0, 1) (y = m_i + z). Then X_i / b = c(w) =
  exp(G_ii/2 + sqrt(G_ii) w) / b exactly, and the other bins' share B = (1/b) sum_{j != i} X_j has
  conditional mean m(w) = (1/b) sum_{j != i} exp(G_ij + s_ij w - s_ij^2/2), s_ij = G_ij/sqrt(G_ii).
  For fixed c, B -> g(c + B) has the least concave majorant h_c on B >= 0: g(c + .) itself when
  c >= gamma, else the tangent from the origin, slope gamma/R0^2 up to B0 = R0 - c with
  R0 = gamma + sqrt(gamma^2 - gamma c), then g(c + .). By Jensen,
      E_{Q_i}[g(R) | w] <= h_c(w)(m(w)),
  a function F_i(w) that is nondecreasing in w (G >= 0 entrywise) and in [0, 1]. Its Gaussian
  expectation is bounded above by an upper Riemann sum on a grid plus the tail masses.

add, H_gamma(P||Q) = E_P[(1 - gamma R)_+]. For weights pi in the simplex, weighted AM-GM gives
  R >= exp(S_pi), S_pi = sum_j pi_j (ln X_j - ln(b pi_j)) ~ N(mu, v) under P with
  mu = -pi^T diag(G)/2 - KL(pi || uniform) and v = pi^T G pi; (1 - gamma x)_+ decreases, so
      H_gamma(P||Q) <= E[(1 - e^(epsilon + S))_+] = Phi(t) - e^(epsilon + mu + v/2) Phi(t - sqrt(v)),
  t = -(epsilon + mu)/sqrt(v), in closed form.

For b = 1 both are the exact Gaussian hockey-stick divergences. Both bound the same pair as the
Renyi bound; a caller may use, per direction and epsilon, whichever is smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import log_ndtr, ndtr

# The grid of w: [GRID_LOW, GRID_HIGH] with up to GRID_POINTS points, fewer for many bins so
# that the table costs about _MAX_GRID_WORK exponentials (b^2 per point), at least MIN_POINTS. Below GRID_LOW,
# F_i <= F_i(GRID_LOW) is charged the mass Phi(GRID_LOW); above GRID_HIGH, F_i <= 1 is charged
# Phi(-GRID_HIGH) (< 1e-197). A coarser grid only loosens the bound.
GRID_LOW, GRID_HIGH = -10.0, 30.0
GRID_POINTS, MIN_POINTS = 8001, 201
_MAX_GRID_WORK = 2e7
# Relative and absolute allowances for float64 rounding in the sums below.
_RELATIVE_SLACK = 1e-9
_ABSOLUTE_SLACK = 1e-300


def _grid(num_bins: int) -> np.ndarray:
    points = int(min(GRID_POINTS, max(MIN_POINTS, _MAX_GRID_WORK / float(num_bins) ** 2)))
    return np.linspace(GRID_LOW, GRID_HIGH, points)


def _cell_masses(grid: np.ndarray) -> np.ndarray:
    """mass[0] = Phi(w_0), mass[k] = Phi(w_k) - Phi(w_{k-1}): each charged to F(w_k) (F nondecreasing)."""
    lower = np.concatenate([[-np.inf], grid[:-1]])
    # differences of the lower tail left of 0, of the upper tail right of it (no cancellation)
    left = ndtr(grid) - ndtr(lower)
    right = ndtr(-lower) - ndtr(-grid)
    return np.where(grid <= 0.0, left, right)


@dataclass(frozen=True, eq=False)
class RemoveTable:
    """ln c(w) and ln m(w) for every bin i and grid point, and the masses charged to each point."""

    log_main: np.ndarray   # (b, N): ln(X_i / b) at w_k
    log_rest: np.ndarray   # (b, N): ln E[B | w_k]; -inf when b = 1
    masses: np.ndarray     # (N,)
    upper_tail: float      # Phi(-w_N), charged at F = 1


def remove_table(gram: np.ndarray, noise_multiplier: float) -> RemoveTable:
    """Everything of the remove bound that does not depend on epsilon: O(b^2 N)."""
    scaled = np.asarray(gram, dtype=np.float64) / float(noise_multiplier) ** 2
    b = scaled.shape[0]
    grid = _grid(b)
    diagonal = np.diag(scaled)
    root = np.sqrt(diagonal)
    log_main = (diagonal / 2.0)[:, None] + root[:, None] * grid[None, :] - math.log(b)
    log_rest = np.full((b, grid.shape[0]), -np.inf)
    if b > 1:
        slopes = scaled / root[:, None]                          # s_ij
        offsets = scaled - slopes**2 / 2.0
        np.fill_diagonal(offsets, -np.inf)                       # j = i is c(w), not part of B
        rows = max(1, int(4e6 // (b * grid.shape[0])))           # bins per chunk (32 MB of float64)
        for start in range(0, b, rows):
            stop = min(b, start + rows)
            exponents = offsets[start:stop, :, None] + slopes[start:stop, :, None] * grid[None, None, :]
            top = exponents.max(axis=1)
            log_rest[start:stop] = top + np.log(np.exp(exponents - top[:, None, :]).sum(axis=1)) - math.log(b)
    return RemoveTable(log_main, log_rest, _cell_masses(grid), float(ndtr(-grid[-1])))


def remove_delta(table: RemoveTable, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(Q||P) (module docstring), epsilon >= 0."""
    eps = float(epsilon)
    lc, lm = table.log_main, table.log_rest
    log_total = np.logaddexp(lc, lm)
    above = -np.expm1(np.minimum(eps - log_total, 0.0))            # g(c + m) where c + m >= gamma
    ratio = np.exp(np.minimum(lc - eps, 0.0))                      # c / gamma, capped at 1
    root = np.sqrt(1.0 - ratio)
    log_r0 = eps + np.log1p(root)
    with np.errstate(divide="ignore"):  # ratio = 1 only where c >= gamma, where it is not used
        log_b0 = eps + np.log(1.0 + root - ratio)                  # ln(R0 - c)
    tangent = np.exp(np.minimum(eps + lm - 2.0 * log_r0, 0.0))    # gamma m / R0^2 (<= 1 where used)
    values = np.where(lc >= eps, above, np.where(lm <= log_b0, tangent, above))
    values = np.clip(values, 0.0, 1.0)
    per_bin = values @ table.masses + table.upper_tail
    total = float(per_bin.mean())
    return min(1.0, total * (1.0 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK)


@dataclass(frozen=True, eq=False)
class AddCandidates:
    """(mu, v) of S_pi for each weight vector tried (module docstring)."""

    means: np.ndarray
    variances: np.ndarray


def add_candidates(gram: np.ndarray, noise_multiplier: float, weights) -> AddCandidates:
    scaled = np.asarray(gram, dtype=np.float64) / float(noise_multiplier) ** 2
    b = scaled.shape[0]
    means, variances = [], []
    for pi in weights:
        pi = np.asarray(pi, dtype=np.float64)
        positive = pi > 0.0
        divergence = float(np.sum(pi[positive] * np.log(b * pi[positive])))
        means.append(-float(pi @ np.diag(scaled)) / 2.0 - divergence)
        variances.append(float(pi @ scaled @ pi))
    return AddCandidates(np.array(means), np.array(variances))


def add_delta(candidates: AddCandidates, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(P||Q): the smallest over the weight vectors tried."""
    eps = float(epsilon)
    best = 1.0
    for mu, v in zip(candidates.means, candidates.variances):
        if v <= 0.0:
            value = 1.0 - math.exp(eps + mu) if eps + mu < 0.0 else 0.0
        else:
            sd = math.sqrt(v)
            t = -(eps + mu) / sd
            log_first = float(log_ndtr(t))
            log_second = eps + mu + v / 2.0 + float(log_ndtr(t - sd))
            value = math.exp(log_first) * -math.expm1(min(log_second - log_first, 0.0))
        best = min(best, max(value, 0.0))
    return min(1.0, best * (1.0 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK)
