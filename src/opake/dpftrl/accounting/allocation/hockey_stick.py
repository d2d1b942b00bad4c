"""Direct (epsilon, delta) bounds for the balls-in-bins dominating pair, without Renyi divergences.

Derivation in docs/balls_in_bins_rdp.md ("Direct hockey-stick bounds" and "Splitting the other
bins' terms"). With G the Gram matrix of C's bin columns divided by sigma^2, P = N(0, I),
Q = (1/b) sum_i Q_i, Q_i = N(m_i, I), R = Q/P = (1/b) sum_j X_j, X_j = exp(<m_j, y> - G_jj/2) and
gamma = e^epsilon:

remove, H_gamma(Q||P) = (1/b) sum_i E_{Q_i}[g(R)], g(R) = (1 - gamma/R)_+.
  Under Q_i let w = <m_i, z>/sqrt(G_ii) ~ N(0, 1) (y = m_i + z). Then X_i / b = c(w) =
  exp(G_ii/2 + sqrt(G_ii) w) / b exactly, and each other bin's share is beta_j(w) Y_j with
  beta_j(w) = exp(G_ij + s_ij w - s_ij^2/2)/b, s_ij = G_ij/sqrt(G_ii), and Y_j lognormal with mean 1
  and log-variance v_j = G_jj - s_ij^2. For split points kappa_j >= 0, R <= K + B' with
  K = c + sum_j kappa_j and B' = sum_j (beta_j Y_j - kappa_j)_+. For fixed K, B -> g(K + B) has the
  least concave majorant h_K on B >= 0: g(K + .) itself when K >= gamma, else the tangent from
  the origin, slope gamma/R0^2 up to B0 = R0 - K with R0 = gamma + sqrt(gamma^2 - gamma K), then
  g(K + .). By Jensen,
      E_{Q_i}[g(R) | w] <= h_K(E[B' | w]),
  for every split; the splits used are kappa_j = beta_j exp(sd_j t - v_j/2) at common standardized
  levels t (``SPLIT_LEVELS``; t = -inf is no split), and the smallest bound at each w is taken.
  The result F_i(w) is nondecreasing in w (G >= 0 entrywise) and in [0, 1]; its Gaussian
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
from scipy.special import erfcx, log_ndtr, ndtr

# The grid of w: [GRID_LOW, GRID_HIGH] with up to GRID_POINTS points, fewer for many bins so
# that the table costs about _MAX_GRID_WORK exponentials (b^2 per point), at least MIN_POINTS. Below GRID_LOW,
# F_i <= F_i(GRID_LOW) is charged the mass Phi(GRID_LOW); above GRID_HIGH, F_i <= 1 is charged
# Phi(-GRID_HIGH) (< 2e-33). A coarser grid only loosens the bound.
GRID_LOW, GRID_HIGH = -9.0, 12.0
GRID_POINTS, MIN_POINTS = 8001, 201
_MAX_GRID_WORK = 2e7
_MAX_PROBE_WORK = 2e6
# Standardized split levels t of the other bins' terms (docstring of ``remove_table``); -inf
# keeps every term whole (the unsplit Jensen bound). Each level gives a valid bound; the smallest
# is used at every grid point.
SPLIT_LEVELS = (-math.inf, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5)
# Above SPLIT_MAX_BINS bins the split table (b^2 N exponentials) costs seconds; it is then
# built only where the own bin's term is large enough to decide (max_i G_ii / sigma^2 >=
# HEAVY_OWN_BIN), as in few-bin, low-noise runs. Elsewhere the other bounds are used alone.
SPLIT_MAX_BINS, HEAVY_OWN_BIN = 320, 4.0
# Relative and absolute allowances for float64 rounding in the sums below.
_RELATIVE_SLACK = 1e-9
_ABSOLUTE_SLACK = 1e-300
_SQRT2 = math.sqrt(2.0)


def grid_points(num_bins: int) -> int:
    """The number of grid points of the full table for ``num_bins`` bins."""
    return int(min(GRID_POINTS, max(MIN_POINTS, _MAX_GRID_WORK / float(num_bins) ** 2)))


def split_is_affordable(num_bins: int, largest_scaled_diagonal: float) -> bool:
    """Whether to consider the split bound at all (cost only: every bound left out is still valid)."""
    return num_bins <= SPLIT_MAX_BINS or largest_scaled_diagonal >= HEAVY_OWN_BIN


def probe_points(num_bins: int) -> int:
    """Grid points of the cheap table whose ``remove_lower_sum`` decides whether the full one can help."""
    return int(min(max(5, _MAX_PROBE_WORK / float(num_bins) ** 2), (grid_points(num_bins) - 1) // _COARSE + 1))


def _cell_masses(grid: np.ndarray) -> np.ndarray:
    """mass[0] = Phi(w_0), mass[k] = Phi(w_k) - Phi(w_{k-1}): each charged to F(w_k) (F nondecreasing)."""
    lower = np.concatenate([[-np.inf], grid[:-1]])
    # differences of the lower tail left of 0, of the upper tail right of it (no cancellation)
    left = ndtr(grid) - ndtr(lower)
    right = ndtr(-lower) - ndtr(-grid)
    return np.where(grid <= 0.0, left, right)


def lognormal_excess(sd: np.ndarray, t: float) -> np.ndarray:
    """Upper bounds on E(Y - q)_+ for Y = exp(sd xi - sd^2/2), q = exp(sd t - sd^2/2), xi ~ N(0, 1).

    Black-Scholes: Phibar(t - sd) - q Phibar(t). Where t >= sd both terms are small and close, so
    it is written with erfcx (Phibar(x) = erfcx(x/sqrt2) e^(-x^2/2)/2, q e^(-t^2/2) = e^(-(t-sd)^2/2)):
    e^(-(t-sd)^2/2)/2 [erfcx((t - sd)/sqrt2) - erfcx(t/sqrt2)]. Rounded up by a relative 1e-9.
    For t = -inf (q = 0) it is E Y = 1; for sd = 0 and t > -inf it is 0.
    """
    sd = np.asarray(sd, dtype=np.float64)
    if t == -math.inf:
        return np.ones_like(sd)
    gap = t - sd
    safe = np.maximum(gap, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):  # only in the branch np.where discards
        mills = 0.5 * np.exp(-0.5 * safe * safe) * (erfcx(safe / _SQRT2) - erfcx(t / _SQRT2))
        direct = ndtr(sd - t) - np.exp(sd * t - sd * sd / 2.0) * ndtr(-t)
    value = np.where(gap >= 0.0, mills, direct)
    value = np.where(sd > 0.0, np.maximum(value, 0.0), 0.0)
    return value * (1.0 + _RELATIVE_SLACK) + np.where(sd > 0.0, 1e-300, 0.0)


@dataclass(frozen=True, eq=False)
class RemoveTable:
    """ln K and ln M for every bin i, split level and grid point, and the masses charged to each point.

    K = c(w) + sum_{j != i} kappa_j(w) (the deterministic part, c the bin's own term) and M the
    conditional mean of the remainder (docstring of ``remove_table``); level 0 is t = -inf.
    """

    log_kappa: np.ndarray  # (b, L, N)
    log_rest: np.ndarray   # (b, L, N); -inf when nothing is left
    masses: np.ndarray     # (N,)
    upper_tail: float      # Phi(-w_N), charged at F = 1
    grid: np.ndarray       # (N,) the points w_k

    @property
    def log_main(self) -> np.ndarray:
        """ln c(w) = ln(X_i / b) at the grid points (the unsplit level's deterministic part)."""
        return self.log_kappa[:, 0]


def remove_table(gram: np.ndarray, noise_multiplier: float, points: int | None = None) -> RemoveTable:
    """Everything of the remove bound that does not depend on epsilon: O(b^2 N) (module docstring).

    ``points`` grid points on [GRID_LOW, GRID_HIGH] (default ``grid_points(b)``); fewer give a
    looser bound, and, through ``remove_lower_sum``, a cheap test of what the full grid can reach.

    Given bin i's own variable w, each other term is beta_j(w) Y_j with beta_j(w) =
    exp(G_ij + s_ij w - s_ij^2/2)/b and Y_j lognormal with mean 1 and log-variance
    v_j = G_jj - s_ij^2. For any split points kappa_j >= 0,
        R <= K + B',  K = c + sum_j kappa_j,  B' = sum_j (beta_j Y_j - kappa_j)_+ >= 0,
    so E[g(R) | w] <= h_K(E[B' | w]) (Jensen on the concave majorant h_K of g(K + .)). The split
    kappa_j = beta_j exp(sd_j t - v_j/2) at a common standardized level t (the one that equalizes
    the terms' exceedance probabilities, as the optimal split does) gives
    E[B' | w] = sum_j beta_j E(Y_j - exp(sd_j t - v_j/2))_+; t = -inf is the unsplit bound.
    v_j is rounded up (E(Y - q)_+ grows with the variance), so float rounding only loosens it.
    """
    scaled = np.asarray(gram, dtype=np.float64) / float(noise_multiplier) ** 2
    b = scaled.shape[0]
    grid = np.linspace(GRID_LOW, GRID_HIGH, grid_points(b) if points is None else int(points))
    levels = len(SPLIT_LEVELS)
    diagonal = np.diag(scaled)
    root = np.sqrt(diagonal)
    log_main = (diagonal / 2.0)[:, None] + root[:, None] * grid[None, :] - math.log(b)
    log_kappa = np.repeat(log_main[:, None, :], levels, axis=1)
    log_rest = np.full((b, levels, grid.shape[0]), -np.inf)
    if b > 1:
        slopes = scaled / root[:, None]                                   # s_ij
        offsets = scaled - slopes**2 / 2.0 - math.log(b)                  # ln beta_j(0)
        # v_j = G_jj - s_ij^2 >= 0 (Cauchy-Schwarz), rounded up by more than its rounding error
        variances = np.maximum(diagonal[None, :] - slopes**2, 0.0) + 8.0 * np.finfo(np.float64).eps * diagonal[None, :]
        deviations = np.sqrt(variances)
        # per level, kappa_j / beta_j and E(Y_j - kappa_j/beta_j)_+ for every pair (i, j); the
        # diagonal (j = i is c, not part of the rest) gets weight 0
        off = 1.0 - np.eye(b)
        split = [off * (np.exp(deviations * t - variances / 2.0) if t > -math.inf else 0.0) for t in SPLIT_LEVELS]
        excess = [off * lognormal_excess(deviations, t) for t in SPLIT_LEVELS]
        for i in range(b):
            exponents = offsets[i][:, None] + slopes[i][:, None] * grid[None, :]   # ln beta_j(w), (b, N)
            exponents[i] = -np.inf
            top = exponents.max(axis=0)
            weights = np.exp(exponents - top[None, :])                    # <= 1, no overflow
            split_i = np.stack([row[i] for row in split])                 # (L, b)
            excess_i = np.stack([row[i] for row in excess])
            with np.errstate(divide="ignore"):  # a level that splits nothing off: ln 0 = -inf, used as such
                log_split = np.log(split_i @ weights) + top[None, :]
                log_excess = np.log(excess_i @ weights) + top[None, :]
            log_kappa[i] = np.logaddexp(log_main[i][None, :], log_split)
            log_rest[i] = log_excess
    # Both enter h_K(M) increasingly; a relative 1e-12 up covers the rounding of the sums above
    # (h_K is steep in K just below gamma, so the inputs, not only the result, are rounded up).
    return RemoveTable(log_kappa + 1e-12, log_rest + 1e-12, _cell_masses(grid), float(ndtr(-grid[-1])), grid)


def _concave_majorant(log_kappa: np.ndarray, log_rest: np.ndarray, eps: float) -> np.ndarray:
    """h_K(M) at K = exp(log_kappa), M = exp(log_rest), gamma = e^eps (module docstring), in [0, 1].

    g(x) = (1 - gamma/x)_+. For K >= gamma, g(K + .) is concave and h_K = g(K + .). For K < gamma
    it is zero up to gamma - K and concave after; h_K is the tangent from the origin, slope
    gamma/R0^2, up to B0 = R0 - K with R0 = gamma + sqrt(gamma^2 - gamma K), then g(K + .).
    Computed in units of gamma (k = K/gamma, m = M/gamma; exp overflows to inf and underflows to
    0 where the result is 1 or below 1e-300, which the absolute allowance covers).
    """
    with np.errstate(over="ignore"):  # k or m = inf: g = 1 there, as computed
        k = np.exp(log_kappa - eps)
        m = np.exp(log_rest - eps)
    r0 = 1.0 + np.sqrt(np.maximum(1.0 - k, 0.0))                  # R0 / gamma where k < 1
    whole = 1.0 - 1.0 / np.maximum(k + m, 1e-300)                 # g(K + M) where K + M >= gamma (1/inf = 0)
    tangent = m / (r0 * r0)
    values = np.where((k < 1.0) & (m <= r0 - k), tangent, whole)
    return np.clip(values, 0.0, 1.0)


# The coarse pass of ``remove_delta`` looks at every _COARSE-th grid point; the cells it then
# charges without evaluating them cost at most _PRUNED of its estimate at each end.
_COARSE, _PRUNED = 16, 1e-4


def _bound_at(table: RemoveTable, eps: float, columns) -> np.ndarray:
    """F_i(w_k) = min over split levels of h_K(M), for every bin i and the grid points ``columns``."""
    return _concave_majorant(table.log_kappa[:, :, columns], table.log_rest[:, :, columns], eps).min(axis=1)


def remove_delta(table: RemoveTable, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(Q||P) (module docstring), epsilon >= 0.

    The upper Riemann sum (1/b) sum_i sum_k F_i(w_k) mass_k, F_i nondecreasing. A coarse pass
    finds where the sum lives; below a point w_lo every cell is charged F_i(w_lo) (so all of them
    together F_i(w_lo) Phi(w_lo)), above a point w_hi F_i <= 1 (together Phibar(w_hi)), both
    exact upper bounds; only the cells between are evaluated.
    """
    eps = float(epsilon)
    points = table.masses.shape[0]
    coarse = np.arange(0, points, _COARSE)
    if coarse[-1] != points - 1:
        coarse = np.append(coarse, points - 1)
    grid_cdf = np.cumsum(table.masses)                            # Phi(w_k), as the masses sum
    coarse_sums = _bound_at(table, eps, coarse).sum(axis=0)       # sum_i F_i at the coarse points
    coarse_masses = np.diff(np.concatenate([[0.0], grid_cdf[coarse]]))
    estimate = float(coarse_sums @ coarse_masses) + table.upper_tail * coarse_sums.shape[0]
    b = table.log_kappa.shape[0]
    below = coarse_sums * grid_cdf[coarse]
    low_candidates = np.flatnonzero(below <= _PRUNED * estimate)
    low = int(coarse[low_candidates[-1]]) if low_candidates.size else -1
    above = b * (table.upper_tail + np.concatenate([np.cumsum(table.masses[::-1])[::-1][1:], [0.0]]))[coarse]
    high_candidates = np.flatnonzero((above <= _PRUNED * estimate) & (coarse > low))
    high = int(coarse[high_candidates[0]]) if high_candidates.size else points - 1
    total = 0.0
    if low >= 0:  # cells 0..low, each F_i <= F_i(w_low)
        total += float(coarse_sums[np.searchsorted(coarse, low)] * grid_cdf[low])
    middle = np.arange(low + 1, high + 1)
    if middle.size:
        total += float(_bound_at(table, eps, middle).sum(axis=0) @ table.masses[middle])
    # cells above ``high`` and the mass beyond the grid: F_i <= 1
    total += b * (float(table.masses[high + 1:].sum()) + table.upper_tail)
    total /= b
    return min(1.0, total * (1.0 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK)


def remove_lower_sum(table: RemoveTable, epsilon: float) -> float:
    """A LOWER bound on what ``remove_delta`` gives for this bound on any grid.

    F_i is nondecreasing, so (1/b) sum_i sum_k F_i(w_k) (Phi(w_k+1) - Phi(w_k)) (each cell charged
    at its left end, the last running to infinity) is at most (1/b) sum_i E F_i(w), which every
    grid's upper sum exceeds. Used only to skip building a table that cannot beat a bound
    already in hand (so a few points suffice).
    """
    eps = float(epsilon)
    values = _concave_majorant(table.log_kappa, table.log_rest, eps).min(axis=1)   # (b, N)
    right = np.concatenate([table.masses[1:], [table.upper_tail]])
    return float((values @ right).mean()) * (1.0 - 1e-6)


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
