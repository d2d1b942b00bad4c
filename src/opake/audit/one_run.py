"""The statistics of the one-run audit: m canaries, one training run, an epsilon lower bound.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023
(arXiv:2305.08846; below [SNJ23]). The auditor's game:

1. m canaries are fixed in advance; each is included in the training data independently with
   probability 1/2 (S_i = +1 included, S_i = -1 not), independently of everything else.
2. One run of the mechanism M on the data with the included canaries.
3. From M's output only, the auditor computes a score per canary and guesses T_i in
   {+1 (included), -1 (not included), 0 (abstain)}: here +1 for the ``k_plus`` highest scores
   and -1 for the ``k_minus`` lowest, so at most r = k_plus + k_minus guesses, r fixed in advance.
4. W = number of correct guesses (T_i = S_i != 0).

The theorem (SNJ23's main result in its (epsilon, delta) form: Corollary 5.4 of the arXiv
version, the p-value their Appendix D computes). Conditions: (a) S uniform on {-1, +1}^m, drawn
independently of the non-canary data and of M's randomness; (b) M is (epsilon, delta)-DP with
respect to changing any one S_i (adding or removing one canary, the rest of the data fixed);
(c) the guesses are any function of M's output with at most r non-zero entries. Then for every v

    P[W >= v] <= f(v) + 2 m delta * max_{1 <= i <= m} (f(v - i) - f(v)) / i,
    f(x) = P[Binomial(r, q) >= x],   q = e^epsilon / (1 + e^epsilon).

For delta = 0 this is the tail of randomized response: each guess is right with probability at
most q (tight: the mechanism that answers each S_i by randomized response attains it). For
i >= v, f(v - i) = 1 and (1 - f(v)) / i is largest at i = v, so the maximum runs over 1..v.

From the p-value to the lower bound. Write p(epsilon, v) for the right-hand side above (capped
at 1), c = 2 m delta and W' ~ Binomial(r, q). Two monotonicities make the bound a valid test;
both need c <= 1.
(i) p is non-increasing in v: with w_i(v) = f(v - i) - f(v) = P[v - i <= W' <= v - 1] and
alpha(v) = max_i w_i(v) / i, w_i(v + 1) = P[W' = v] + w_{i-1}(v) <= P[W' = v] + (i - 1) alpha(v),
so alpha(v + 1) <= max(P[W' = v], alpha(v)) <= alpha(v) + P[W' = v], while f(v + 1) = f(v) -
P[W' = v]: p(v + 1) - p(v) <= (c - 1) P[W' = v] <= 0. Hence "p(epsilon, W) <= beta" is the event
W >= v_beta (the smallest v with p <= beta), of probability <= p(epsilon, v_beta) <= beta.
(ii) p is non-decreasing in epsilon: with pmf the Binomial(r - 1, q) mass, d/dq P[Binomial(r, q)
>= x] = r pmf(x - 1), so each f(v) + c w_i(v) / i has derivative r pmf(v - 1) (1 - c / i) +
(c r / i) pmf(v - i - 1) >= 0 for i >= 1 >= c; their maximum is non-decreasing too, and q grows
with epsilon. So {epsilon : p(epsilon, W) <= beta} is an interval [0, epsilon_lb], and
``epsilon_lower_bound`` returns its right end. If M is really (epsilon*, delta)-DP, then
epsilon_lb > epsilon* implies p(epsilon*, W) <= beta, which by (i) has probability at most beta:
with confidence 1 - beta, epsilon* >= epsilon_lb. Choosing among several (k_plus, k_minus) after
seeing the scores is paid for by Bonferroni: ``one_run_bound`` tests each of its
``len(guesses)`` choices at beta / len(guesses) and reports the largest bound. 2 m delta > 1 is
refused: neither monotonicity is then guaranteed (and the delta term swamps the bound).

Notation: m = canaries, r = guesses, v = correct guesses, beta = 1 - confidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from opake._checks import real_number
from opake.errors import ConvergenceError, InvalidArgumentError, InvalidTypeError

__all__ = ["OneRunBound", "default_guesses", "epsilon_lower_bound", "one_run_bound", "p_value"]

_BISECTION_STEPS = 80  # the bracket [0, 2^k] halves 80 times: far below any printed digit


def _counts(canaries, guesses, correct) -> tuple[int, int, int]:
    values = []
    for name, value in (("canaries", canaries), ("guesses", guesses), ("correct", correct)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidTypeError(f"{name} must be an integer count, got {value!r} ({type(value).__name__})")
        values.append(int(value))
    m, r, v = values
    if not 0 <= v <= r <= m or m < 1:
        raise InvalidArgumentError(f"need 0 <= correct <= guesses <= canaries and canaries >= 1, got correct={v}, "
                                   f"guesses={r}, canaries={m}")
    return m, r, v


def _delta(delta, canaries: int) -> float:
    delta = real_number("delta", delta)
    if not 0.0 <= delta < 1.0:
        raise InvalidArgumentError(f"delta must be in [0, 1), got {delta!r}")
    if 2.0 * canaries * delta > 1.0:
        raise InvalidArgumentError(
            f"the one-run bound needs 2 * canaries * delta <= 1, got 2 * {canaries} * {delta:g} = "
            f"{2 * canaries * delta:g}: its delta term would swamp the bound. Use at most "
            f"{int(0.5 / delta) if delta > 0 else canaries} canaries at this delta"
        )
    return delta


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """[SNJ23]'s bound on P[W >= correct] for an (epsilon, delta)-DP mechanism (module docstring).

    A small value refutes the claim "(epsilon, delta)-DP" at that level. Computed in float64 from
    scipy's binomial survival function: f(v - i) - f(v) = P[v - i <= W' <= v - 1] as a difference
    of two upper tails, which keeps the small tails (the ones that decide) accurate.
    """
    m, r, v = _counts(canaries, guesses, correct)
    delta = _delta(delta, m)
    epsilon = real_number("epsilon", epsilon)
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise InvalidArgumentError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    if v == 0:
        return 1.0
    q = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))                 # f(v) = P[W' >= v]
    if delta == 0.0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    window = np.maximum(stats.binom.sf(v - i - 1, r, q) - tail, 0.0)   # f(v - i) - f(v)
    return min(1.0, tail + 2.0 * m * delta * float(np.max(window / i)))


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, significance: float) -> float:
    """The largest epsilon whose (epsilon, delta) claim ``p_value`` refutes at ``significance``.

    0.0 when even epsilon = 0 is not refuted. Bisection keeps p(low) <= significance < p(high)
    and returns ``low``: the bound is never rounded up.
    """
    m, r, v = _counts(canaries, guesses, correct)
    delta = _delta(delta, m)
    beta = real_number("significance", significance)
    if not 0.0 < beta < 1.0:
        raise InvalidArgumentError(f"significance (1 - confidence) must be in (0, 1), got {significance!r}")
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    high = 1.0
    while p_value(m, r, v, high, delta) <= beta:  # v = r: p -> 1 as epsilon grows, so this ends
        high *= 2.0
        if high > 1e3:
            raise ConvergenceError("the one-run bound did not stop growing below epsilon = 1000")
    low = 0.0
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if p_value(m, r, v, middle, delta) <= beta:
            low = middle
        else:
            high = middle
    return low


def default_guesses(canaries: int) -> tuple[tuple[int, int], ...]:
    """The (k_plus, k_minus) choices ``one_run_bound`` tries when none are given.

    Guessing on the extreme scores only pays when they are clearly separated, guessing on many
    when the signal is weak; the grid covers 1% to 100% of the canaries, both tails or the top
    only, fixed before any score is seen. Each costs a Bonferroni share of the significance.
    """
    m = int(canaries)
    choices = []
    for fraction in (0.01, 0.03, 0.1, 0.3, 1.0):
        both = max(1, round(fraction * m / 2))
        choices.append((both, min(both, m - both)))
        choices.append((max(1, round(fraction * m / 2)), 0))
    return tuple(dict.fromkeys(c for c in choices if sum(c) <= m))


@dataclass(frozen=True)
class OneRunBound:
    """The outcome of :func:`one_run_bound`: the best of the tried guess counts.

    ``epsilon``: the lower bound (confidence ``confidence`` over the canaries' coins and the run);
    ``k_plus`` / ``k_minus``, ``guesses`` (= their sum) and ``correct``: the choice that gave it;
    ``canaries`` and ``included``: m and how many coins came up "included"; ``choices``: how many
    (k_plus, k_minus) were tried (each at significance (1 - confidence) / choices).
    """

    epsilon: float
    delta: float
    confidence: float
    canaries: int
    included: int
    k_plus: int
    k_minus: int
    guesses: int
    correct: int
    choices: int


def one_run_bound(scores, included, *, delta: float, confidence: float = 0.95, guesses=None) -> OneRunBound:
    """Guess on the extreme ``scores`` and bound epsilon from below (module docstring).

    ``scores``: one float per canary, larger = more evidence that the canary was included;
    ``included``: the coins (booleans), used only to count correct guesses; ``guesses``: the
    (k_plus, k_minus) choices, fixed before the scores (default ``default_guesses(m)``). Ties in
    the scores are broken by canary index, which does not depend on the coins.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included)
    if scores.ndim != 1 or scores.shape != included.shape or scores.size == 0:
        raise InvalidArgumentError(f"need one score and one inclusion flag per canary, got shapes {scores.shape} and "
                                   f"{included.shape}")
    if included.dtype != np.bool_:
        raise InvalidTypeError(f"included must hold booleans (the canaries' coins), got dtype {included.dtype}")
    if not np.all(np.isfinite(scores)):
        raise InvalidArgumentError("the canary scores contain NaN or infinity; a diverged run cannot be audited")
    confidence = real_number("confidence", confidence)
    if not 0.0 < confidence < 1.0:
        raise InvalidArgumentError(f"confidence must be in (0, 1), got {confidence!r}")
    m = scores.size
    choices = default_guesses(m) if guesses is None else tuple((int(a), int(b)) for a, b in guesses)
    if not choices or any(a < 0 or b < 0 or a + b < 1 or a + b > m for a, b in choices):
        raise InvalidArgumentError(f"each guess choice (k_plus, k_minus) needs k_plus, k_minus >= 0 and 1 <= k_plus + "
                                   f"k_minus <= {m} (the canaries), got {choices}")
    significance = (1.0 - confidence) / len(choices)
    order = np.lexsort((np.arange(m), -scores))   # descending score, then index
    ranked = included[order]
    best = None
    for k_plus, k_minus in choices:
        correct = int(np.count_nonzero(ranked[:k_plus]))
        correct += int(np.count_nonzero(~ranked[m - k_minus:])) if k_minus else 0
        bound = epsilon_lower_bound(m, k_plus + k_minus, correct, delta, significance)
        if best is None or bound > best.epsilon:
            best = OneRunBound(epsilon=bound, delta=float(delta), confidence=confidence, canaries=m,
                               included=int(np.count_nonzero(included)), k_plus=k_plus, k_minus=k_minus,
                               guesses=k_plus + k_minus, correct=correct, choices=len(choices))
    return best
