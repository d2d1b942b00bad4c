"""The two audits of a ``make_private`` run: one run with many canaries, or many runs with one.

``audit_one_run(recipe, canaries, key=...)``: m canaries, each included with probability 1/2
(``inclusion_coins``), ONE training run, a score per canary, guesses on the extreme scores and
[SNJ23]'s epsilon lower bound (``opake.audit.one_run``). Cheap (one run) and weak: with m
canaries it cannot show much more than log(m) even for a run with no privacy at all.

``audit_many_runs(recipe, canary, runs=R, key=...)``: R runs with the canary and R without,
one score per run, Clopper-Pearson bounds on the test's error rates and the lower bound at the
run's delta (``opake.audit.many_runs``). R times the cost of a run: for small models.

Both report ``AuditResult``: the empirical LOWER bound beside the claimed epsilon
(``private.epsilon`` of the audited run). An audit cannot certify a claim, only catch a broken
one: a lower bound above the claim means that the run (or the audit's assumptions, listed in
docs/audit.md) is broken, with probability of a false alarm at most 1 - confidence.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from opake._checks import real_number
from opake.audit.canaries import GradientCanaries, InputCanaries, inclusion_coins
from opake.audit.many_runs import RateBound, epsilon_lower_bound
from opake.audit.one_run import OneRunBound, one_run_bound
from opake.audit.training import TrainingRecipe, train_with_canaries
from opake.errors import InvalidArgumentError, InvalidStateError, InvalidTypeError
from opake.random import RngKey

__all__ = ["AuditResult", "audit_many_runs", "audit_one_run"]


@dataclass(frozen=True)
class AuditResult:
    """An audit's outcome: ``empirical_epsilon`` (a lower bound) beside ``claimed_epsilon``.

    Both at ``delta``; the lower bound holds with probability ``confidence`` over the canaries'
    coins (one-run) or the runs (many-run). ``noise_multiplier`` is the plan's sigma;
    ``noise_scale`` is 1 for an audit of the recipe and < 1 for a control with deliberately too
    little noise. ``details`` is the statistic's own record (``OneRunBound`` or ``RateBound``).
    """

    method: str
    canaries: str
    claimed_epsilon: float
    empirical_epsilon: float
    delta: float
    confidence: float
    noise_multiplier: float
    noise_scale: float
    runs: int
    details: OneRunBound | RateBound
    seconds: float

    @property
    def exceeds_claim(self) -> bool:
        """True when the lower bound is above the claim: the run leaks more than it reports."""
        return self.empirical_epsilon > self.claimed_epsilon

    def __str__(self) -> str:
        control = (f" CONTROL: the engine added {self.noise_scale:g} x the planned noise, the claim was left "
                   f"unchanged." if self.noise_scale != 1.0 else "")
        if self.exceeds_claim:
            verdict = ("the lower bound EXCEEDS the claim: the run leaks more than it reports (or an assumption "
                       "of the audit fails, docs/audit.md)")
        else:
            verdict = "consistent with the claim (an audit can catch a broken claim, never certify one)"
        return (f"{self.method} audit, {self.canaries}:{control}\n"
                f"  claimed epsilon {self.claimed_epsilon:.4f} (delta {self.delta:g}); empirical lower bound "
                f"{self.empirical_epsilon:.4f} at {100 * self.confidence:g}% confidence [{self._evidence()}]; "
                f"{verdict}. {self.runs} run(s), {self.seconds:.1f} s.")

    def _evidence(self) -> str:
        d = self.details
        if isinstance(d, OneRunBound):
            return (f"{d.canaries} canaries, {d.included} included; {d.guesses} guesses ({d.k_plus} in, "
                    f"{d.k_minus} out), {d.correct} correct; best of {d.choices} guess counts")
        if d.threshold is None:
            return f"{d.count_in} + {d.count_out} runs; no threshold gives a positive bound"
        return (f"{d.count_in} + {d.count_out} runs; at the best of {d.thresholds} thresholds FPR <= "
                f"{d.fpr_upper:.4f} ({d.false_positives} false positives), FNR <= {d.fnr_upper:.4f} "
                f"({d.false_negatives} false negatives)")


def audit_one_run(recipe: TrainingRecipe, canaries, *, key: RngKey, confidence: float = 0.95, guesses=None,
                  noise_scale: float = 1.0, verbose: bool = True) -> AuditResult:
    """[SNJ23]'s one-run audit of ``recipe`` with ``canaries`` (GradientCanaries or InputCanaries).

    ``key`` draws the coins, the run's bins and noise (``key.fold_in("coins")``, ``"run"``).
    ``guesses``: the (k_plus, k_minus) choices (default ``opake.audit.one_run.default_guesses``).
    ``noise_scale < 1`` runs the control (``opake.audit.training``). Prints the result unless
    ``verbose=False``.
    """
    _check_key(key)
    confidence = _confidence(confidence)
    start = time.perf_counter()
    coins = inclusion_coins(canaries.count, key.fold_in("coins"))
    run = train_with_canaries(recipe, canaries, coins, key.fold_in("run"), noise_scale=noise_scale)
    bound = one_run_bound(run.scores, run.included, delta=run.delta, confidence=confidence, guesses=guesses)
    result = AuditResult(
        method="one-run (Steinke, Nasr, Jagielski 2023)", canaries=canaries.describe(),
        claimed_epsilon=run.epsilon, empirical_epsilon=bound.epsilon, delta=run.delta, confidence=confidence,
        noise_multiplier=run.noise_multiplier, noise_scale=float(noise_scale), runs=1, details=bound,
        seconds=time.perf_counter() - start,
    )
    if verbose:
        print(result)
    return result


def audit_many_runs(recipe: TrainingRecipe, canary, *, runs: int, key: RngKey, confidence: float = 0.95,
                    thresholds=None, noise_scale: float = 1.0, verbose: bool = True) -> AuditResult:
    """``runs`` runs with the one ``canary`` and ``runs`` without; Clopper-Pearson lower bound.

    ``canary``: ``GradientCanaries(1)`` or ``InputCanaries`` of one example. Every run has its own
    key (bins and noise); the run without the canary keeps its slot as a zero-gradient
    placeholder, so both sides have the same plan (``opake.audit.canaries``). ``thresholds``: a
    grid fixed in advance, or None for the OUT scores' order statistics (``many_runs``).
    """
    _check_key(key)
    confidence = _confidence(confidence)
    if not isinstance(canary, (GradientCanaries, InputCanaries)) or canary.count != 1:
        raise InvalidArgumentError(
            "audit_many_runs takes ONE canary: GradientCanaries(1) or InputCanaries of one example"
        )
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 1:
        raise InvalidArgumentError(f"runs must be a positive integer (runs per side), got {runs!r}")
    start = time.perf_counter()
    scores = {True: [], False: []}
    claims = set()  # (epsilon, delta, sigma) of every run: one plan for all
    for number in range(int(runs)):
        for present in (True, False):
            run_key = key.fold_in("in" if present else "out").fold_in(number)
            run = train_with_canaries(recipe, canary, np.array([present]), run_key, noise_scale=noise_scale)
            scores[present].append(float(run.scores[0]))
            claims.add((run.epsilon, run.delta, run.noise_multiplier))
    if len(claims) != 1:
        raise InvalidStateError(f"the runs were planned with different claims {sorted(claims)}; a many-run audit "
                                f"needs one plan for all of them")
    (epsilon, delta, sigma), = claims
    bound = epsilon_lower_bound(scores[True], scores[False], delta=delta, significance=1.0 - confidence,
                                thresholds=thresholds)
    result = AuditResult(
        method="many-run (Clopper-Pearson)", canaries=canary.describe(),
        claimed_epsilon=epsilon, empirical_epsilon=bound.epsilon, delta=delta, confidence=confidence,
        noise_multiplier=sigma, noise_scale=float(noise_scale), runs=2 * int(runs), details=bound,
        seconds=time.perf_counter() - start,
    )
    if verbose:
        print(result)
    return result


def _check_key(key) -> None:
    if not isinstance(key, RngKey):
        raise InvalidTypeError(
            f"key must be an opake.random.RngKey (opake.random.key(seed)), got {type(key).__name__}; "
            f"an audit never picks a seed itself"
        )


def _confidence(confidence) -> float:
    confidence = real_number("confidence", confidence)
    if not (0.0 < confidence < 1.0 and math.isfinite(confidence)):
        raise InvalidArgumentError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}")
    return confidence
