"""Empirical privacy audits of a ``make_private`` run: a LOWER bound on its epsilon.

An accountant proves an upper bound on epsilon for the mechanism it was told about; an audit
measures what an attacker who plants canaries can actually tell apart in the run's output, and
turns it into a lower bound that holds with a stated confidence. A lower bound above the claimed
``private.epsilon`` means the run is broken (less noise, more sensitivity, a different sampler
than priced); a lower bound below it proves nothing about the claim (docs/audit.md).

==========================  =====================================================================
name                        what it is
==========================  =====================================================================
``audit_one_run``           Steinke, Nasr, Jagielski (NeurIPS 2023): m canaries, one run
``audit_many_runs``         R runs with one canary, R without; Clopper-Pearson rates
``TrainingRecipe``          the run to audit: make_private's arguments and fresh-object factories
``GradientCanaries``        white-box canaries: clipped gradient = max_grad_norm e_i
``InputCanaries``           black-box canaries: training examples (``mislabeled_canaries``)
``AuditResult``             claimed epsilon, empirical lower bound, confidence, evidence
``one_run_bound``           the one-run statistic on given scores (``opake.audit.one_run``)
``epsilon_lower_bound``     the many-run statistic on given scores (``opake.audit.many_runs``)
``clopper_pearson_upper``   one-sided Clopper-Pearson bound on a proportion
==========================  =====================================================================

Notation (papers' symbols, used inside the math functions only): m canaries, r guesses, v
correct guesses, beta = 1 - confidence; FPR, FNR the error rates of a threshold test on a score.
"""

from opake.audit.auditor import AuditResult, audit_many_runs, audit_one_run
from opake.audit.canaries import GradientCanaries, InputCanaries, inclusion_coins, mislabeled_canaries
from opake.audit.many_runs import RateBound, clopper_pearson_upper, epsilon_lower_bound
from opake.audit.one_run import OneRunBound, one_run_bound
from opake.audit.training import CanaryRun, TrainingRecipe, per_example_cross_entropy, train_with_canaries

__all__ = [
    "AuditResult",
    "CanaryRun",
    "GradientCanaries",
    "InputCanaries",
    "OneRunBound",
    "RateBound",
    "TrainingRecipe",
    "audit_many_runs",
    "audit_one_run",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "inclusion_coins",
    "mislabeled_canaries",
    "one_run_bound",
    "per_example_cross_entropy",
    "train_with_canaries",
]
