"""A rigorous amplified bound for balls-in-bins through Renyi divergences (``method="amplified"``).

Derivation in docs/balls_in_bins_rdp.md (after SK26; formulas re-derived in docs/math.md section 6).
With G the Gram matrix of C's bin columns and sigma the noise multiplier (clip 1), for integer
orders alpha >= 2:

remove direction, exact (sum over the b^alpha tuples of bins):
    E_P[(Q/P)^alpha] = b^-alpha sum_{j_1..j_alpha} exp(sum_{r<s} G[j_r, j_s] / sigma^2).
  Orders 2 and 3 (and 4 for small b) are summed exactly with matrix products
  (``exact_remove_rdp``): alpha = 2 is sum(E), alpha = 3 is sum(E * (E @ E)), E = exp(G / sigma^2)
  entrywise. For every order, every coefficient is non-negative, so an entrywise upper bound on
  G bounds it (``majorized_remove_rdp``). We use G <= diag(G_ii - tau) + tau 11^T, tau the
  largest off-diagonal entry; then the sum factorizes:
    E_P[(Q/P)^alpha] <= b^-alpha alpha! [x^alpha] prod_i f_i(x) * exp(tau alpha (alpha - 1) / (2 sigma^2)),
    f_i(x) = sum_c x^c exp((G_ii - tau) c (c - 1) / (2 sigma^2)) / c!,
  and D_alpha(Q||P) = ln E_P[(Q/P)^alpha] / (alpha - 1). The product polynomial, truncated at
  the largest order, is built once in log space: O(b alpha_max^2). The remove bound is the
  smaller of the exact value (where computed) and the majorized one.
add direction (weighted AM-GM on the mixture's likelihood ratio, ``weighted_add_rdp``): for any
weights pi in the simplex
    D_alpha(P||Q) <= sum_j pi_j G_jj / (2 sigma^2) + KL(pi || uniform) + (alpha - 1) pi^T G pi / (2 sigma^2);
  pi uniform gives tr(G) / (2 b sigma^2) + (alpha - 1) 1^T G 1 / (2 b^2 sigma^2) (Jensen), and pi
  optimized at a few orders (convex in pi) gives lower values where the bins differ.
conversion (Canonne, Kamath and Steinke 2020, Prop. 12), one ordered pair of distributions at a
time: (alpha, rho)-RDP from P to Q gives H_{e^eps}(P||Q) <= delta with
    eps = rho + ln(1 - 1/alpha) - (ln delta + ln alpha) / (alpha - 1),
minimized over alpha separately for each direction; the run's epsilon is the larger of the two
directions' (both hockey-stick divergences must be <= delta), and the result is the smaller of
this and the unamplified epsilon (both are upper bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from scipy.special import gammaln

from opake.accounting.process import certified_epsilon, check_delta, check_epsilon, smallest_epsilon
from opake.dpftrl.accounting.allocation import factor, hockey_stick
from opake.dpftrl.accounting.allocation.bin_gram import bin_gram_of_run
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise.priced import PricedNoise

MAX_ORDER = 256


def _log_polynomial_product(log_a: np.ndarray, log_b: np.ndarray) -> np.ndarray:
    """Log coefficients of the product of two polynomials given by log coefficients, truncated."""
    degree = log_a.shape[0] - 1
    # shifted[i, k] = log_b[k - i], -inf for k < i: column k then holds every pair with i + j = k
    padded = np.concatenate([np.full(degree, -np.inf), log_b])
    shifted = sliding_window_view(padded, degree + 1)[::-1]
    terms = log_a[:, None] + shifted
    top = terms.max(axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    return top + np.log(np.exp(terms - top).sum(axis=0))


_DIAGONAL_GROUPS = 8


def _diagonal_groups(diagonal: np.ndarray) -> list:
    """(value, count) pairs: the distinct values if few, else groups of consecutive sorted values at their maximum."""
    values, counts = np.unique(diagonal, return_counts=True)
    if values.shape[0] <= _DIAGONAL_GROUPS:
        return list(zip(values.tolist(), counts.tolist()))
    ordered = np.sort(diagonal)
    return [(float(chunk.max()), int(chunk.shape[0])) for chunk in np.array_split(ordered, _DIAGONAL_GROUPS)]


def _log_polynomial_power(log_a: np.ndarray, exponent: int) -> np.ndarray:
    """Log coefficients of a^exponent, truncated, by repeated squaring (exponent >= 1)."""
    result, square = None, log_a
    while True:
        if exponent & 1:
            result = square if result is None else _log_polynomial_product(result, square)
        exponent >>= 1
        if not exponent:
            return result
        square = _log_polynomial_product(square, square)


def majorized_remove_rdp(gram: np.ndarray, noise_multiplier: float, max_order: int = MAX_ORDER) -> np.ndarray:
    """Upper bounds on D_alpha(Q||P) for alpha = 2..max_order from the majorized Gram (module docstring)."""
    b = gram.shape[0]
    variance = float(noise_multiplier) ** 2
    off_diagonal = gram[~np.eye(b, dtype=bool)]
    tau = float(max(off_diagonal.max(), 0.0)) if b > 1 else 0.0
    counts = np.arange(max_order + 1, dtype=np.float64)
    log_factorials = gammaln(counts + 1.0)
    pair_counts = counts * (counts - 1.0) / 2.0
    product = np.full(max_order + 1, -np.inf)
    product[0] = 0.0
    # f_i's coefficients grow with G_ii, so raising each diagonal entry to the largest of its
    # group (at most _DIAGONAL_GROUPS groups of consecutive sorted values) bounds the product
    # coefficientwise; each group's power f^count is formed by repeated squaring.
    for diagonal, count in _diagonal_groups(np.diag(gram)):
        log_factor = (diagonal - tau) * pair_counts / variance - log_factorials
        product = _log_polynomial_product(product, _log_polynomial_power(log_factor, count))
    orders = counts[2:]
    log_moment = log_factorials[2:] - orders * math.log(b) + product[2:] + tau * pair_counts[2:] / variance
    return log_moment / (orders - 1.0)


# The largest b for which order 3 (b^3 work, one matrix product) and order 4 (b^4) are summed exactly.
EXACT_ORDER_3_MAX_BINS = 512
EXACT_ORDER_4_MAX_BINS = 160
# Relative rounding allowance per summed term: float64 exp and products are within a few ulps,
# and pairwise summation of N non-negative terms errs by far less than N ulps of the sum.
_ROUNDING = 8.0 * np.finfo(np.float64).eps


def exact_remove_rdp(gram: np.ndarray, noise_multiplier: float) -> dict:
    """D_alpha(Q||P) exactly (up to a rounding allowance) for the orders cheap at this b.

    Returns {alpha: value} for alpha = 2 always, 3 when b <= EXACT_ORDER_3_MAX_BINS and 4 when
    b <= EXACT_ORDER_4_MAX_BINS. With E = exp(G / sigma^2 - g) entrywise (g the largest entry of
    G / sigma^2, so no entry overflows; every tuple's term carries g once per pair):
      alpha = 2: sum_{i,j} E_ij
      alpha = 3: sum_{i,j,k} E_ij E_ik E_jk = sum(E * (E @ E))
      alpha = 4: sum_{i,j} E_ij w_ij^T E w_ij,  w_ij = E_i * E_j (entrywise rows)
    Underflowed terms are below 1e-308 of the largest (= 1, the tuple of the largest diagonal
    entry; G is a Gram matrix, so its largest entry is on the diagonal) and are covered, with
    rounding, by the allowance added to the logarithm.
    """
    b = gram.shape[0]
    scaled = np.asarray(gram, dtype=np.float64) / float(noise_multiplier) ** 2
    top = float(scaled.max())
    weights = np.exp(scaled - top)
    sums = {2: float(weights.sum())}
    if b <= EXACT_ORDER_3_MAX_BINS:
        sums[3] = float((weights * (weights @ weights)).sum())
    if b <= EXACT_ORDER_4_MAX_BINS:
        total = 0.0
        for i in range(b):
            rows = weights[i][None, :] * weights  # row j is w_ij
            total += float(weights[i] @ ((rows @ weights) * rows).sum(axis=1))
        sums[4] = total
    divergences = {}
    for order, value in sums.items():
        pairs = order * (order - 1) / 2
        allowance = math.log1p(_ROUNDING * float(b) ** order + 1e-300 * float(b) ** order)
        log_moment = math.log(value) + pairs * top - order * math.log(b) + allowance
        divergences[order] = log_moment / (order - 1)
    return divergences


# Above MANY_BINS bins the majorized bound (whose cost is quadratic in the largest order) is
# formed up to MANY_BINS_MAX_ORDER only; higher orders are left at +inf (no bound claimed).
# There its tau is close to the diagonal (neighbouring bins correlate strongly), and the direct
# hockey-stick bounds decide the remove direction anyway.
MANY_BINS, MANY_BINS_MAX_ORDER = 256, 128


def remove_rdp_upper_bound(gram: np.ndarray, noise_multiplier: float, max_order: int = MAX_ORDER) -> np.ndarray:
    """Upper bounds on D_alpha(Q||P) for alpha = 2..max_order: the exact low orders, else majorized."""
    if gram.shape[0] > MANY_BINS and max_order > MANY_BINS_MAX_ORDER:
        bound = np.full(max_order - 1, np.inf)
        bound[:MANY_BINS_MAX_ORDER - 1] = majorized_remove_rdp(gram, noise_multiplier, MANY_BINS_MAX_ORDER)
    else:
        bound = majorized_remove_rdp(gram, noise_multiplier, max_order)
    for order, value in exact_remove_rdp(gram, noise_multiplier).items():
        if order <= max_order:
            bound[order - 2] = min(bound[order - 2], value)
    return bound


def weighted_add_rdp(gram: np.ndarray, noise_multiplier: float, weights: np.ndarray,
                     max_order: int = MAX_ORDER) -> np.ndarray:
    """Weighted AM-GM bounds on D_alpha(P||Q), alpha = 2..max_order, for one weight vector pi.

    (1/b) sum_j X_j = sum_j pi_j X_j / (b pi_j) >= prod_j (X_j / (b pi_j))^pi_j (weighted AM-GM,
    X_j = exp(<m_j, y>/sigma^2 - G_jj/(2 sigma^2)), pi in the simplex), so with
    sum_j pi_j ln X_j ~ N(-pi^T diag(G) / (2 sigma^2), pi^T G pi / sigma^2) under P:

        D_alpha(P||Q) <= sum_j pi_j G_jj / (2 sigma^2) + KL(pi || uniform) + (alpha - 1) pi^T G pi / (2 sigma^2).

    Any pi gives a valid bound; pi uniform is the Jensen bound of the module docstring.
    """
    b = gram.shape[0]
    variance = float(noise_multiplier) ** 2
    pi = np.asarray(weights, dtype=np.float64)
    positive = pi > 0.0
    divergence = float(np.sum(pi[positive] * np.log(b * pi[positive])))
    orders = np.arange(2, max_order + 1, dtype=np.float64)
    return (float(pi @ np.diag(gram)) / (2.0 * variance) + divergence
            + (orders - 1.0) * float(pi @ gram @ pi) / (2.0 * variance))


# Orders at which the add-direction weights are optimized; every weight vector found bounds all
# orders, and each order takes the smallest bound among them and the uniform weights.
_WEIGHT_ORDERS = (2, 5)


_WEIGHT_BASIS_DEGREE = 8


def _optimized_weights(gram: np.ndarray, variance: float, order: int) -> np.ndarray:
    """pi near-minimizing the weighted bound at ``order``: log pi_j a degree-8 polynomial in j/b.

    The bound is convex in pi; the bins' rows of G change smoothly with their position (the
    first bins reach furthest, BLT columns are shifts of one another), so a smooth log-weight
    profile, fitted by L-BFGS over 9 coefficients (O(b^2) per evaluation), gets most of the gain
    at a small fraction of the cost of b free weights. Any pi is valid; this only picks a good one.
    """
    import scipy.optimize

    b = gram.shape[0]
    positions = np.linspace(-1.0, 1.0, b)
    basis = np.polynomial.legendre.legvander(positions, _WEIGHT_BASIS_DEGREE)  # (b, degree + 1)
    half_diagonal = np.diag(gram) / (2.0 * variance)
    curvature = (order - 1.0) / variance

    def log_weights(coefficients):
        # log-softmax: ln pi_j stays finite however large the logits get (pi_j may underflow
        # to 0, ln pi_j does not), so pi ln(b pi) never meets 0 * ln 0
        logits = basis @ coefficients
        top = float(logits.max())
        return logits - (top + math.log(float(np.exp(logits - top).sum())))

    def objective(coefficients):
        log_pi = log_weights(coefficients)
        pi = np.exp(log_pi)
        g_pi = gram @ pi
        value = pi @ half_diagonal + pi @ (log_pi + math.log(b)) + 0.5 * curvature * (pi @ g_pi)
        gradient_pi = half_diagonal + log_pi + math.log(b) + 1.0 + curvature * g_pi
        return value, basis.T @ (pi * (gradient_pi - pi @ gradient_pi))  # chain rule through the softmax

    start = np.zeros(_WEIGHT_BASIS_DEGREE + 1)
    result = scipy.optimize.minimize(objective, start, jac=True, method="L-BFGS-B", options={"maxiter": 30})
    return np.exp(log_weights(result.x))


def add_weight_candidates(gram: np.ndarray, noise_multiplier: float, max_order: int = MAX_ORDER) -> list:
    """Uniform weights and those fitted at ``_WEIGHT_ORDERS`` (each valid for every order)."""
    b = gram.shape[0]
    weights = [np.full(b, 1.0 / b)]
    if b > 1:
        variance = float(noise_multiplier) ** 2
        weights += [_optimized_weights(gram, variance, order) for order in _WEIGHT_ORDERS if order <= max_order]
    return weights


def add_rdp_upper_bound(gram: np.ndarray, noise_multiplier: float, max_order: int = MAX_ORDER,
                        weights=None) -> np.ndarray:
    """Upper bounds on D_alpha(P||Q) for alpha = 2..max_order: the best weighted AM-GM bound found."""
    if weights is None:
        weights = add_weight_candidates(gram, noise_multiplier, max_order)
    return np.min([weighted_add_rdp(gram, noise_multiplier, pi, max_order) for pi in weights], axis=0)


def rdp_epsilon(rdp: np.ndarray, delta: float) -> float:
    """min over alpha of the CKS20 Prop. 12 conversion; ``rdp[i]`` is for alpha = i + 2."""
    orders = np.arange(2, rdp.shape[0] + 2, dtype=np.float64)
    eps = rdp + np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)
    return float(max(eps.min(), 0.0))


def rdp_delta(rdp: np.ndarray, epsilon: float) -> float:
    """min over alpha of the CKS20 Prop. 12 delta: the same conversion solved for delta."""
    orders = np.arange(2, rdp.shape[0] + 2, dtype=np.float64)
    log_delta = (orders - 1.0) * (rdp + np.log1p(-1.0 / orders) - epsilon) - np.log(orders)
    return float(math.exp(min(log_delta.min(), 0.0)))


class PricesLikeTheUnamplifiedBound:
    """What a tighter balls-in-bins bound shares with the unamplified one it tightens
    (``self.rigorous``): the same noise, mechanism and participation, and its ``dp_event``."""

    @property
    def priced_noise(self) -> PricedNoise:
        """The same noise as the unamplified bound: the bound inner mechanism and sigma."""
        return self.rigorous.priced_noise

    @property
    def mechanism(self):
        """The resolved mechanism the noise engine must run (the unamplified bound's)."""
        return self.rigorous.mechanism

    @property
    def participation(self):
        """The participation the sampler guarantees: (n_steps, min_sep=num_bins, ceil(n_steps/num_bins))."""
        return self.rigorous.participation

    @property
    def dp_event(self):
        """The UNAMPLIFIED bound's ``GaussianDpEvent``: a valid dominating event, looser than the
        tighter bound, because dp_accounting has no event for random allocation."""
        return self.rigorous.dp_event


@dataclass(frozen=True, eq=False)
class BallsInBinsRDP(PricesLikeTheUnamplifiedBound):
    """Rigorous amplified balls-in-bins bound of the dominating pair; never worse than ``rigorous``.

    ``remove[i]`` bounds D_alpha(Q||P) and ``add[i]`` bounds D_alpha(P||Q), alpha = i + 2, each
    converted on its own by CKS20 Prop. 12; ``add_candidates`` gives the add direction's direct
    hockey-stick bound, and the remove direction has two more (``allocation/hockey_stick.py``:
    ``remove_table``, built on first use, O(b^2 N), and only when a cheap probe shows it can beat
    the others; ``allocation/factor.py``: ``factor_tables``, the one-factor comparison). Per
    direction the smallest delta (the smallest epsilon) of its bounds is taken, the run's epsilon
    is the larger of the two directions', and the unamplified bound caps it.
    """

    rigorous: object  # BallsInBins
    remove: np.ndarray
    add: np.ndarray
    gram: np.ndarray
    add_candidates: hockey_stick.AddCandidates
    factor_tables: tuple = ()

    is_guarantee = True
    method = AccountingMethod.AMPLIFIED

    def _cached(self, name: str, build):
        value = self.__dict__.get(name)
        if value is None:
            value = build()
            object.__setattr__(self, name, value)
        return value

    @property
    def remove_table(self) -> hockey_stick.RemoveTable:
        return self._cached("_remove_table", lambda: hockey_stick.remove_table(
            self.gram, self.rigorous.bound.noise_multiplier))

    @property
    def remove_probe(self) -> hockey_stick.RemoveTable:
        """The same bound on a few grid points: its lower sum says whether ``remove_table`` can help."""
        points = hockey_stick.probe_points(self.gram.shape[0])
        return self._cached("_remove_probe", lambda: hockey_stick.remove_table(
            self.gram, self.rigorous.bound.noise_multiplier, points))

    def _split_may_reach(self, epsilon: float, delta: float) -> bool:
        """Whether to use the split bound at ``epsilon``: not when it is too costly for this run,
        nor when its probe proves it stays above ``delta`` there (then it cannot lower a minimum)."""
        if "_remove_table" in self.__dict__:
            return True
        largest = float(np.diag(self.gram).max()) / self.rigorous.bound.noise_multiplier ** 2
        if not hockey_stick.split_is_affordable(self.gram.shape[0], largest):
            return False
        return hockey_stick.remove_lower_sum(self.remove_probe, epsilon) < delta

    @property
    def rdp(self) -> np.ndarray:
        """The bound on max(D_alpha(Q||P), D_alpha(P||Q)) for alpha = i + 2 (the mechanism's RDP)."""
        return np.maximum(self.remove, self.add)


    @property
    def orders(self) -> np.ndarray:
        return np.arange(2, self.remove.shape[0] + 2)

    @property
    def description(self) -> str:
        return (
            f"balls-in-bins, {self.rigorous.num_bins} bins over {self.rigorous.n_steps} steps: rigorous "
            "amplified upper bound of the dominating pair (per direction the better of Renyi divergences, "
            f"orders 2..{self.remove.shape[0] + 1} converted by CKS20 Prop. 12, and direct hockey-stick "
            f"bounds), capped by the unamplified bound ({self.rigorous.bound.description})"
        )

    def _cheap_remove_delta(self, epsilon: float) -> float:
        return min(rdp_delta(self.remove, epsilon), factor.factor_remove_deltas(self.factor_tables, epsilon))

    def remove_delta(self, epsilon: float) -> float:
        """Upper bound on H_{e^epsilon}(Q||P) (the remove direction): the smallest of its bounds.

        The split bound's table is built only when its probe's lower sum does not already exceed
        the others (then it could not lower the minimum), so the value is the same either way.
        """
        value = self._cheap_remove_delta(epsilon)
        if self._split_may_reach(epsilon, value):
            value = min(value, hockey_stick.remove_delta(self.remove_table, epsilon))
        return value

    def add_delta(self, epsilon: float) -> float:
        """Upper bound on H_{e^epsilon}(P||Q) (the add direction)."""
        return min(rdp_delta(self.add, epsilon), hockey_stick.add_delta(self.add_candidates, epsilon))

    def epsilon_at(self, delta: float) -> float:
        delta = check_delta(delta)
        cap = self.rigorous.epsilon_at(delta)
        # Each direction: its Renyi epsilon, lowered by the direct bound where that is smaller
        # (searched below the Renyi value only); the run's epsilon is the larger direction's.
        add = min(rdp_epsilon(self.add, delta), cap)
        add = _lowered(lambda eps: hockey_stick.add_delta(self.add_candidates, eps), delta, add)
        remove = min(rdp_epsilon(self.remove, delta), cap)
        # The remove direction decides only above the add direction's epsilon: each further bound
        # is searched in [add, remove], the costly split bound only if its probe allows it.
        if remove > add:
            remove = _lowered(lambda eps: factor.factor_remove_deltas(self.factor_tables, eps), delta, remove, add)
        if remove > add and self._split_may_reach(remove, delta):
            remove = _lowered(lambda eps: hockey_stick.remove_delta(self.remove_table, eps), delta, remove, add)
        return certified_epsilon(self.delta_at, delta, min(max(remove, add), cap), upper=cap)

    def delta_at(self, epsilon: float) -> float:
        epsilon = check_epsilon(epsilon)
        return min(max(self.remove_delta(epsilon), self.add_delta(epsilon)), self.rigorous.delta_at(epsilon))


def _lowered(delta_of_epsilon, delta: float, epsilon: float, floor: float = 0.0) -> float:
    """``epsilon`` (already certified), lowered to where the direct bound certifies delta if that is smaller.

    Searched in [floor, epsilon] only (below ``floor`` another direction decides): ``floor`` itself
    when the bound certifies delta there.
    """
    if floor > 0.0:
        found = smallest_epsilon(lambda x: delta_of_epsilon(floor + x), delta, epsilon - floor, rtol=1e-5)
        found = None if found is None else floor + found
    else:
        found = smallest_epsilon(delta_of_epsilon, delta, epsilon, rtol=1e-5)
    return epsilon if found is None else min(found, epsilon)


def rdp_allocation(rigorous) -> BallsInBinsRDP:
    """Build the amplified bound for the run priced (unamplified) by ``rigorous``."""
    gram = bin_gram_of_run(rigorous, "amplified")
    sigma = rigorous.bound.noise_multiplier
    remove = remove_rdp_upper_bound(gram, sigma)
    weights = add_weight_candidates(gram, sigma)
    add = add_rdp_upper_bound(gram, sigma, weights=weights)
    remove.setflags(write=False)
    add.setflags(write=False)
    gram.setflags(write=False)
    tables = tuple(factor.factor_table(certificate, sigma) for certificate in factor.useful_certificates(gram, sigma))
    return BallsInBinsRDP(rigorous, remove, add, gram, hockey_stick.add_candidates(gram, sigma, weights), tables)
