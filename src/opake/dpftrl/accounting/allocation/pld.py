"""The privacy loss distribution of random allocation, for orthogonal bins (DP-SGD on balls-in-bins).

Derivation in docs/allocation_pld.md; the pessimistic numerics are in ``allocation/pld_grid.py``.

Balls-in-bins with b bins: bin j is served at steps t = j mod b, m_j = C x_j is its column sum
and G = M^T M. The bins are *orthogonal* when (C^T C)[s, t] = 0 for all steps s, t of different
bins; for a lower-triangular Toeplitz C >= 0 that is c_l = 0 for every lag l not divisible by b
(``orthogonal_bins``), the identity strategy (DP-SGD) being c = (1, 0, 0, ...). Then G is
diagonal, the statistics T_j = <m_j, y> / (sigma sqrt(G_jj)) are sufficient and independent, and
the dominating pair P = N(0, sigma^2 I), Q = (1/b) sum_j N(m_j, sigma^2 I) has exactly the
hockey-stick divergences of ONE random allocation with per-bin signal a_j = sqrt(G_jj) / sigma:

    R = Q/P = (1/b) sum_j X_j,   X_j = exp(a_j T_j - a_j^2 / 2),   T_j ~ N(0, 1) i.i.d. under P.

For C = I, G_jj = k_j, bin j's number of participations: the k epochs are not k independent
allocations (the bin is the same in every epoch) but one allocation with noise sigma / sqrt(k).

* remove, H_gamma(Q||P) = E_P[(R - gamma)_+] = (1/b) sum_i E[(1 - gamma b / (X'_i + B_i))_+], with
  the unit's own term X'_i = exp(a_i w + a_i^2/2), w ~ N(0, 1), and B_i = sum_{j != i} X_j under P.
  B_i: every X_j rounded UP to a grid of step h = RESOLUTION e^{eps_0}, sums by FFT, mass above
  the top charged weight 1; then rounded up again to knots. The own term: exact cells of w with
  Jensen (``pld_grid.own_term_expectations``).
* add, H_gamma(P||Q) = E_P[(1 - gamma S / b)_+], S = sum_j X_j: every X_j rounded DOWN to a grid
  of step RESOLUTION / e^{eps_0 + BAND}, sums by FFT. Built only when the closed-form weighted
  AM-GM bound (``hockey_stick.add_delta``, uniform weights) is not already below the remove side.

Each grid serves a band [eps_0, eps_0 + BAND) of epsilon: there the rounding moves the threshold
by at most about RESOLUTION relative (epsilon by about RESOLUTION); outside it the same table
is still an upper bound, only looser. Every discretization rounds toward a larger delta, FFT
convolutions carry an explicit error bound (``pld_grid``), and each delta a relative allowance
of 1e-9; the process is an upper bound (``is_guarantee``) on the dominating pair's delta(eps).
Adaptively chosen gradients: docs/adaptivity.md (covered for orthogonal bins with C >= 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from opake.accounting.process import certified_epsilon, check_delta, check_epsilon, smallest_epsilon
from opake.dpftrl.accounting.allocation import hockey_stick, pld_grid
from opake.dpftrl.accounting.allocation.bin_gram import bin_gram_matrix
from opake.dpftrl.accounting.allocation.rdp import PricesLikeTheUnamplifiedBound, rdp_delta, rdp_epsilon
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.errors import InvalidArgumentError

RESOLUTION = 1e-3
MAX_GRID = 1 << 19
WIDTH = 1.6          # remove grid top: WIDTH * gamma b at the band's upper end
BAND = 0.25
COARSE = 0.03       # resolution of the first, band-finding search
_RELATIVE_SLACK = 1e-9
_ABSOLUTE_SLACK = 1e-300


def orthogonal_bins(coefficients: np.ndarray, num_bins: int) -> bool:
    """Whether the bins of a lower-triangular Toeplitz C >= 0 (first column given) are orthogonal.

    (C^T C)[s, t] = sum_r c_{r - s} c_{r - t} is a sum of products of coefficients at lags r - s and
    r - t, whose difference is t - s. If every non-zero coefficient sits at a lag divisible by b,
    such a product vanishes unless b divides t - s, i.e. s and t are in the same bin. Conversely
    a non-zero c_l with b not dividing l and c_0 > 0 gives (C^T C)[0, l] >= c_0 c_l > 0 (C >= 0,
    nothing cancels) between steps 0 and l of different bins, when l < n.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    lags = np.arange(c.shape[0])
    return bool(np.all(c >= 0.0) and np.all(c[lags % int(num_bins) != 0] == 0.0))


@dataclass(frozen=True)
class BinTypes:
    """The distinct per-bin signals a_t = sqrt(G_tt) / sigma, and how many bins have each."""

    signals: tuple
    counts: tuple

    @property
    def num_bins(self) -> int:
        return int(sum(self.counts))


def bin_types(squared_norms, noise_multiplier: float) -> BinTypes:
    """Group the bins by G_jj (a Toeplitz C gives at most two values: k and k - 1 participations)."""
    values, counts = np.unique(np.asarray(squared_norms, dtype=np.float64), return_counts=True)
    if values.size == 0 or np.any(values <= 0.0):
        raise InvalidArgumentError("every bin must carry a contribution (G_jj > 0)")
    return BinTypes(tuple(float(math.sqrt(v) / noise_multiplier) for v in values),
                    tuple(int(c) for c in counts))


def _resolution(num_bins: int) -> float:
    """RESOLUTION, raised where the remove grid would pass MAX_GRID points (many bins)."""
    return max(RESOLUTION, WIDTH * num_bins * math.exp(BAND) / MAX_GRID)


# --- tables ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RemoveTable:
    """Per bin type t: P(B_t rounded up = knot), the mass charged weight 1, and the own term."""

    knots: np.ndarray
    points: np.ndarray   # how many grid points each knot collects
    masses: tuple
    errors: tuple        # per type: l2 bound on the float error of the grid masses
    overflows: tuple     # per type: (mass, mean) of the atom above the grid top
    top: float
    owns: tuple
    weights: tuple      # n_t / b
    num_bins: int


def _knots(low: float, high: float, top: float, resolution: float) -> np.ndarray:
    """Spacing resolution * low / 4 up to high (= K at the band's upper end), then geometric to top.

    Rounding s up by d raises R = (X' + s) / b by d / b, so the linear part moves R by at most
    resolution * gamma / 4 (gamma >= low / b in the band). Beyond K there is no threshold left,
    d/ds E[1 - K/(X' + s)] <= K / s^2 <= 1 / K, and the ratio 1 + resolution moves each delta term
    by at most resolution * s / K of its mass.
    """
    spacing = resolution * low / 4.0
    linear = spacing * np.arange(int(math.ceil(high / spacing)) + 1)
    start = linear[-1]
    ratio = 1.0 + resolution
    count = max(1, int(math.ceil(math.log(max(top / start, 1.0 + 1e-12)) / math.log(ratio))) + 1)
    return np.concatenate([linear, start * ratio ** np.arange(1, count + 1)])


def remove_table(types: BinTypes, band_start: float, resolution: float | None = None) -> RemoveTable:
    """The remove direction's table for epsilon in [band_start, band_start + BAND)."""
    b = types.num_bins
    resolution = _resolution(b) if resolution is None else max(float(resolution), _resolution(b))
    low, high = math.exp(band_start) * b, math.exp(band_start + BAND) * b     # K = gamma b
    step = resolution * math.exp(band_start)      # the b - 1 terms move B by < resolution * K
    size = int(math.ceil(WIDTH * high / step)) + 1
    terms = [pld_grid.term_rounded_up(a, step, size) for a in types.signals]
    knots = _knots(low, high, step * (size - 1), resolution)
    knot_of = np.searchsorted(knots, step * np.arange(size), side="left")   # smallest knot >= value
    masses, errors, overflows = [], [], []
    for t in range(len(types.signals)):
        rest = pld_grid.point_mass(size, step)
        for u, term in enumerate(terms):
            count = types.counts[u] - (1 if u == t else 0)
            if count:
                rest = pld_grid.convolve(rest, pld_grid.power(term, count))
        masses.append(np.bincount(knot_of, weights=rest.masses, minlength=knots.shape[0]))
        errors.append(rest.error)
        overflows.append((rest.overflow, rest.overflow_mean))
    owns = tuple(pld_grid.own_term(a) for a in types.signals)
    points = np.bincount(knot_of, minlength=knots.shape[0]).astype(np.float64)
    return RemoveTable(knots, points, tuple(masses), tuple(errors), tuple(overflows), step * size, owns,
                       tuple(c / b for c in types.counts), b)


def _overflow_charge(mass: float, mean: float, top: float, threshold: float, signal: float) -> float:
    """Upper bound on E[(1 - K / (X' + B))_+; B >= top] from the atom's mass and mean (top >= K).

    There B > K, so the positive part is inactive and, x -> 1 - K/(x + B) being concave, Jensen in
    X' gives at most g(B) = 1 - K / (B + e^{a^2}). g is concave in B, so it lies below its tangent at
    any s0: g(B) <= g(s0) + g'(s0) (B - s0). With s0 >= 2.5 K both coefficients g(s0) - s0 g'(s0)
    and g'(s0) are >= 0, so upper bounds on the atom's mass and mean give an upper bound.
    """
    if mass <= 0.0:
        return 0.0
    c = math.exp(signal * signal) if signal * signal < 700.0 else math.inf
    if not math.isfinite(c):
        return mass
    s0 = max(top, 2.5 * threshold)
    slope = threshold / (s0 + c) ** 2
    return min(mass, mass * (1.0 - threshold / (s0 + c) - s0 * slope) + slope * mean)


_BLOCK = 16
_REFINE_TOLERANCE = 1e-5


def _knot_sum(own, knots: np.ndarray, points: np.ndarray, masses: np.ndarray, threshold: float, error: float) -> float:
    """Upper bound on sum_j masses_j E[(1 - K / (X' + knot_j))_+], evaluating few knots, plus the
    float-error allowance ||w||_2 * error of the grid masses (Cauchy-Schwarz; w_m <= 1 the weight of
    grid point m, at most its block's top value).

    The expectation G(s) increases in s, so a block of knots may be rounded up to its top knot
    (another rounding up of B). Blocks of _BLOCK knots are first charged G(top); blocks whose
    slack mass * (G(top) - G(bottom)) is large are then summed knot by knot, largest slack first,
    until the slack left is at most _REFINE_TOLERANCE of the total. Every block's value is an
    upper bound either way.
    """
    count = knots.shape[0]
    tops = np.minimum(np.arange(_BLOCK - 1, count + _BLOCK - 1, _BLOCK), count - 1)
    values = pld_grid.own_term_expectations(own, knots[np.concatenate([[0], tops])], threshold)
    bottom, top = values[:-1], values[1:]
    starts = np.concatenate([[0], tops[:-1] + 1])
    block_mass = np.add.reduceat(masses, starts)
    block_value = block_mass * top
    slack = block_mass * (top - bottom)
    allowance = math.sqrt(float(np.add.reduceat(points, starts) @ (top * top))) * error
    order = np.argsort(slack)[::-1]
    total = float(block_value.sum())
    remaining = float(slack.sum())
    for block in order:
        if remaining <= _REFINE_TOLERANCE * total or slack[block] <= 0.0:
            break
        lo, hi = int(starts[block]), int(tops[block]) + 1
        inside = np.flatnonzero(masses[lo:hi] > 0.0) + lo
        exact = float(masses[inside] @ pld_grid.own_term_expectations(own, knots[inside], threshold))
        total += exact - float(block_value[block])
        remaining -= float(slack[block])
    return total + allowance


def table_remove_delta(table: RemoveTable, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(Q||P) from one table."""
    threshold = math.exp(float(epsilon)) * table.num_bins
    total = 0.0
    for masses, error, (mass, mean), own, weight in zip(table.masses, table.errors, table.overflows,
                                                        table.owns, table.weights):
        overflow = _overflow_charge(mass, mean, table.top, threshold, own.signal)
        total += weight * (_knot_sum(own, table.knots, table.points, masses, threshold, error) + overflow)
    return min(1.0, total * (1.0 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK)


@dataclass(frozen=True, eq=False)
class AddTable:
    """S = sum_j X_j rounded down (grid step ``step``), the atom above the grid and the error bound."""

    step: float
    masses: np.ndarray
    overflow: float
    error: float
    num_bins: int


def add_table(types: BinTypes, band_start: float) -> AddTable:
    """The add direction's table for epsilon in [band_start, band_start + BAND).

    The weights (1 - gamma s / b)_+ vanish for s >= b / gamma, so the grid covers [0, b e^{-band_start}]
    and everything above it is one atom; its step resolution e^{-(band_start + BAND)} keeps the
    b terms' rounding below resolution in gamma S / b.
    """
    b = types.num_bins
    step = _resolution(b) * math.exp(-(band_start + BAND))
    size = int(math.ceil(b * math.exp(-band_start) / step)) + 1
    total = pld_grid.point_mass(size, step)
    for a, count in zip(types.signals, types.counts):
        total = pld_grid.convolve(total, pld_grid.power(pld_grid.term_rounded_down(a, step, size), count))
    return AddTable(step, total.masses, total.overflow, total.error, b)


def table_add_delta(table: AddTable, epsilon: float) -> float:
    """Upper bound on H_{e^epsilon}(P||Q) from one table (weights decrease: rounding down is safe)."""
    size = table.masses.shape[0]
    values = table.step * np.arange(size + 1)                          # the last one: the atom's floor
    weights = np.maximum(1.0 - math.exp(float(epsilon)) * values / table.num_bins, 0.0)
    positive = int(np.count_nonzero(weights[:size]))
    total = float(table.masses @ weights[:size]) + table.overflow * weights[size] + math.sqrt(positive) * table.error
    return min(1.0, total * (1.0 + _RELATIVE_SLACK) + _ABSOLUTE_SLACK)


# --- the process ----------------------------------------------------------------------------


def _band(epsilon: float) -> float:
    return BAND * math.floor(float(epsilon) / BAND)


@dataclass(frozen=True, eq=False)
class BallsInBinsPLD(PricesLikeTheUnamplifiedBound):
    """Balls-in-bins with orthogonal bins (DP-SGD): the random-allocation PLD, pessimistically discretized.

    ``delta_at(eps)`` is, per direction, the smallest of this PLD's bound, the closed-form weighted
    AM-GM add bound and, when ``amplified`` (a ``BallsInBinsRDP`` of the same run) is given, its
    Renyi bounds (all bounds on the same pair), the larger of the two directions, capped by the
    unamplified bound ``rigorous``. The amplified bound's direct remove bound (a grid integral,
    seconds for 100 bins) is left out: it averages the other bins' share by Jensen where this PLD
    uses its distribution, so it can beat this PLD by at most the PLD's own discretization slack
    (about RESOLUTION in epsilon). Tables are built per band of epsilon on first use (about 0.2 to
    1 s each for 100 bins) and kept; they never change a result, only its cost.
    """

    rigorous: object                  # BallsInBins
    types: BinTypes
    amplified: object = None          # BallsInBinsRDP or None
    add_candidates: hockey_stick.AddCandidates = None
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    is_guarantee = True
    method = AccountingMethod.ALLOCATION_PLD

    @property
    def description(self) -> str:
        others = (" and the amplified bound's Renyi divergences" if self.amplified is not None else "")
        return (
            f"balls-in-bins, {self.rigorous.num_bins} bins over {self.rigorous.n_steps} steps, orthogonal "
            f"bins (signals {', '.join(f'{a:.6g} x {c}' for a, c in zip(self.types.signals, self.types.counts))}): "
            f"rigorous upper bound from the random-allocation PLD with pessimistic discretization "
            f"(resolution {_resolution(self.types.num_bins):g}){others}, capped by the unamplified bound "
            f"({self.rigorous.bound.description})"
        )

    # --- tables, one per band, built on first use ---

    def _remove_table(self, band: float, resolution: float | None = None) -> RemoveTable:
        key = ("remove", band, resolution)
        if key not in self._tables:
            self._tables[key] = remove_table(self.types, band, resolution)
        return self._tables[key]

    def _add_table(self, band: float) -> AddTable:
        key = ("add", band)
        if key not in self._tables:
            self._tables[key] = add_table(self.types, band)
        return self._tables[key]

    def _pld_curve(self, band: float, delta: float, resolution: float | None = None):
        """The PLD's delta(eps) with the tables of one band, as far as comparing it with ``delta``
        needs: the add table is consulted only where remove <= delta < the closed-form add bound,
        so the returned value is <= delta exactly where the full curve's is."""
        def curve(epsilon: float) -> float:
            remove = table_remove_delta(self._remove_table(band, resolution), epsilon)
            add = hockey_stick.add_delta(self.add_candidates, epsilon)
            if remove <= delta < add:
                add = min(add, table_add_delta(self._add_table(band), epsilon))
            return max(remove, add)
        return curve

    # --- per direction ---

    def remove_delta(self, epsilon: float) -> float:
        """Upper bound on H_{e^epsilon}(Q||P) (remove direction)."""
        epsilon = check_epsilon(epsilon)
        value = table_remove_delta(self._remove_table(_band(epsilon)), epsilon)
        if self.amplified is not None:
            value = min(value, rdp_delta(self.amplified.remove, epsilon))
        return value

    def add_delta(self, epsilon: float, *, needed_above: float = 0.0) -> float:
        """Upper bound on H_{e^epsilon}(P||Q) (add direction). The PLD table is consulted only when
        the closed-form bounds exceed ``needed_above`` (below it the caller does not need it)."""
        epsilon = check_epsilon(epsilon)
        value = hockey_stick.add_delta(self.add_candidates, epsilon)
        if self.amplified is not None:
            value = min(value, rdp_delta(self.amplified.add, epsilon),
                        hockey_stick.add_delta(self.amplified.add_candidates, epsilon))
        if value > needed_above:
            value = min(value, table_add_delta(self._add_table(_band(epsilon)), epsilon))
        return value

    def delta_at(self, epsilon: float) -> float:
        epsilon = check_epsilon(epsilon)
        try:
            remove = self.remove_delta(epsilon)
            amplified = max(remove, self.add_delta(epsilon, needed_above=remove))
        except OverflowError:  # epsilon beyond the tables' float range: the unamplified bound holds
            return self.rigorous.delta_at(epsilon)
        return min(amplified, self.rigorous.delta_at(epsilon))

    def _search(self, delta: float, best: float, resolution, rtol: float) -> float:
        """Smallest epsilon <= best the PLD certifies at ``delta`` with tables of this resolution.

        The curve of the band holding ``best`` is searched; when the answer falls in a lower band,
        that band's tables (finer there) are searched again below it. Every value found is certified
        by the curve it was found on, each an upper bound on delta(eps).
        """
        upper, band = best, _band(best)
        for _ in range(8):
            found = smallest_epsilon(self._pld_curve(band, delta, resolution), delta, upper, rtol=rtol)
            if found is None:
                break
            best = min(best, found)
            if _band(found) == band:
                break
            upper, band = found, _band(found)
        return best

    def epsilon_at(self, delta: float) -> float:
        delta = check_delta(delta)
        cap = self.rigorous.epsilon_at(delta)
        best = cap
        if self.amplified is not None:   # the Renyi epsilon, per direction (CKS20 Prop. 12)
            best = min(best, max(rdp_epsilon(self.amplified.remove, delta), rdp_epsilon(self.amplified.add, delta)))
        # Coarse tables (resolution COARSE, cheap) first find the band, then the fine ones.
        try:
            best = self._search(delta, best, COARSE, rtol=1e-4)
            best = self._search(delta, best, None, rtol=1e-6)
        except OverflowError:  # a tiny noise multiplier: the tables leave float range; keep the caps
            pass
        return certified_epsilon(self.delta_at, delta, best, upper=cap)


def allocation_pld(rigorous, amplified=None) -> BallsInBinsPLD:
    """Build the random-allocation PLD for a run with orthogonal bins (``orthogonal_bins`` true)."""
    coefficients = rigorous.mechanism.toeplitz_coefficients(rigorous.n_steps)
    b = rigorous.num_bins
    if not orthogonal_bins(coefficients, b):
        raise InvalidArgumentError(
            "method='allocation_pld' needs orthogonal bins: a strategy with c_l = 0 for every lag l not "
            f"divisible by num_bins={b} and no negative entry (the identity strategy, i.e. DP-SGD); "
            "use method='amplified' or 'rigorous' for this strategy"
        )
    sigma = rigorous.bound.noise_multiplier
    gram = bin_gram_matrix(coefficients, b)
    uniform = [np.full(b, 1.0 / b)]
    return BallsInBinsPLD(rigorous, bin_types(np.diag(gram), sigma), amplified,
                          hockey_stick.add_candidates(gram, sigma, uniform))
