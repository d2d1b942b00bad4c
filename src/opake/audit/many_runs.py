"""The statistics of the many-run audit: scores of runs with and without one canary.

R independent runs on D + canary ("in") and R' on D alone ("out") each give one scalar score,
larger meaning more evidence for the canary. For a test "say in when score > tau" write
FPR = P_out(score > tau) and FNR = P_in(score <= tau). If the mechanism is (epsilon, delta)-DP
for the add/remove pair (D, D + canary), the event {score > tau} (a post-processing) satisfies
P_in(score > tau) <= e^epsilon P_out(score > tau) + delta, that is

    1 - delta - FNR <= e^epsilon FPR,   so   epsilon >= log((1 - delta - FNR) / FPR).

With one-sided Clopper-Pearson upper bounds FPR_up >= FPR and FNR_up >= FNR (Clopper and Pearson
1934: the (1 - a) upper bound for x successes in n trials is the (1 - a) quantile of
Beta(x + 1, n - x), 1 when x = n), ``epsilon_lower_bound`` returns the largest
log((1 - delta - FNR_up) / FPR_up) over the thresholds (0 if none is positive). Every one of the
2 K bounds (K thresholds) holds except with probability a = significance / (2 K), so the result
exceeds the true epsilon with probability at most ``significance`` (union bound).

Which thresholds. A threshold chosen after looking at the scores breaks the union bound, so
either the caller fixes a grid in advance (``thresholds=``), or the thresholds are the OUT
scores' own order statistics at every rank k = 1..R' (the default). The second is still exact:
for tau = the k-th largest OUT score, the true FPR P_out(score > tau) is distributed as
Beta(k, R' - k + 1) when the scores have a continuous distribution (order statistics of
uniforms), and is stochastically smaller with ties, so its (1 - a) quantile, which is the
Clopper-Pearson bound for k - 1 false positives, bounds it except with probability a; the IN
scores are independent of the OUT ones, so FNR_up is a Clopper-Pearson bound given tau.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from opake._checks import real_number
from opake.errors import InvalidArgumentError

__all__ = ["RateBound", "clopper_pearson_upper", "epsilon_lower_bound"]


def clopper_pearson_upper(successes, trials: int, alpha: float):
    """One-sided (1 - alpha) Clopper-Pearson upper bound on a binomial proportion.

    ``successes`` may be an array (of counts <= ``trials``); the bound is 1 at ``successes ==
    trials``. P[p > bound] <= alpha for every true proportion p.
    """
    alpha = real_number("alpha", alpha)
    if not 0.0 < alpha < 1.0:
        raise InvalidArgumentError(f"alpha must be in (0, 1), got {alpha!r}")
    counts = np.asarray(successes)
    if np.any(counts < 0) or np.any(counts > trials) or trials < 1:
        raise InvalidArgumentError(f"need 0 <= successes <= trials and trials >= 1, got {successes!r} of {trials!r}")
    below = np.minimum(counts, trials - 1)  # a placeholder where successes == trials (bound 1)
    bound = np.where(counts >= trials, 1.0, stats.beta.isf(alpha, below + 1, trials - below))
    return float(bound) if bound.ndim == 0 else bound


@dataclass(frozen=True)
class RateBound:
    """The outcome of :func:`epsilon_lower_bound` at its best threshold.

    ``epsilon``: the lower bound (0.0 when no threshold gives a positive one; ``threshold`` is
    then None). ``false_positives`` / ``false_negatives``: the counts at that threshold (OUT
    scores above it, IN scores at or below it) of ``count_out`` / ``count_in``; ``fpr_upper`` /
    ``fnr_upper``: their Clopper-Pearson bounds, each at ``alpha`` = significance / (2 K).
    """

    epsilon: float
    delta: float
    significance: float
    threshold: float | None
    false_positives: int
    false_negatives: int
    count_in: int
    count_out: int
    fpr_upper: float
    fnr_upper: float
    thresholds: int
    alpha: float


def epsilon_lower_bound(scores_in, scores_out, *, delta: float, significance: float,
                        thresholds=None) -> RateBound:
    """max over thresholds of log((1 - delta - FNR_up) / FPR_up), or 0 (module docstring).

    ``scores_in`` / ``scores_out``: one score per independent run with / without the canary.
    ``thresholds``: a grid fixed before the scores were seen, or None for the OUT scores' order
    statistics (every rank). With confidence 1 - ``significance`` the true epsilon at ``delta``
    is at least the result.
    """
    x_in = _scores("scores_in", scores_in)
    x_out = _scores("scores_out", scores_out)
    delta = real_number("delta", delta)
    if not 0.0 <= delta < 1.0:
        raise InvalidArgumentError(f"delta must be in [0, 1), got {delta!r}")
    significance = real_number("significance", significance)
    if not 0.0 < significance < 1.0:
        raise InvalidArgumentError(f"significance (1 - confidence) must be in (0, 1), got {significance!r}")
    sorted_in = np.sort(x_in)
    if thresholds is None:
        taus = np.sort(x_out)[::-1]                      # tau_k = the k-th largest OUT score
        false_positives = np.arange(x_out.size)          # the rank's k - 1, whatever the ties
    else:
        taus = np.asarray(thresholds, dtype=np.float64).ravel()
        if taus.size == 0 or not np.all(np.isfinite(taus)):
            raise InvalidArgumentError("thresholds must be a non-empty grid of finite values (fixed before the scores)")
        false_positives = x_out.size - np.searchsorted(np.sort(x_out), taus, side="right")
    alpha = significance / (2 * taus.size)
    false_negatives = np.searchsorted(sorted_in, taus, side="right")   # IN scores <= tau
    fpr_upper = np.asarray(clopper_pearson_upper(false_positives, x_out.size, alpha), dtype=np.float64)
    fnr_upper = np.asarray(clopper_pearson_upper(false_negatives, x_in.size, alpha), dtype=np.float64)
    numerator = 1.0 - delta - fnr_upper
    with np.errstate(divide="ignore", invalid="ignore"):
        candidates = np.where((numerator > 0.0) & (fpr_upper > 0.0), np.log(numerator / fpr_upper), -np.inf)
    best = int(np.argmax(candidates))
    if not candidates[best] > 0.0:
        return RateBound(0.0, delta, significance, None, 0, 0, x_in.size, x_out.size, 1.0, 1.0, taus.size, alpha)
    return RateBound(
        epsilon=float(candidates[best]), delta=delta, significance=significance, threshold=float(taus[best]),
        false_positives=int(false_positives[best]), false_negatives=int(false_negatives[best]),
        count_in=x_in.size, count_out=x_out.size, fpr_upper=float(fpr_upper[best]),
        fnr_upper=float(fnr_upper[best]), thresholds=taus.size, alpha=alpha,
    )


def _scores(name: str, values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise InvalidArgumentError(f"{name} is empty: the many-run audit needs at least one run on each side")
    if not np.all(np.isfinite(array)):
        raise InvalidArgumentError(f"{name} contains NaN or infinity; a diverged run cannot be audited")
    return array

