"""The many-run audit (opake.audit.many_runs, opake.audit.auditor.audit_many_runs).

Statistics, against independent references:
  * ``clopper_pearson_upper`` solves P[Binomial(n, p) <= x] = alpha (60-digit bisection on the
    exact binomial sum), and covers: P[bound < p] <= alpha for every p (exact enumeration);
  * the order-statistic thresholds: the true FPR above the k-th largest of n continuous OUT scores
    exceeds the Clopper-Pearson bound for k - 1 successes with probability exactly alpha
    (computed from the binomial law of uniform order statistics, not from the beta function);
  * ``epsilon_lower_bound`` equals a loop over thresholds written out by hand, on fixed grids and
    on the rank thresholds, with ties; and a hand case with perfect separation;
  * simulated Gaussian mechanisms: the bound stays below the true epsilon(delta) (exact, from the
    accountant) as often as the confidence says.
Real runs (make_private on a tiny model, one gradient canary, one bin, 2 epochs, claimed epsilon
1.5 at delta 1e-5, 200 runs per side, confidence 0.999: a correct run fails w.p. <= 1e-3):
  * the correct runs stay below the claim;
  * runs whose engine adds a tenth of the noise (the claim unchanged) are caught; an exact bound
    on missing them (order statistics and binomial tails) is < 1e-9.
Sizes: the two real audits are 800 make_private runs, about 10-25 s on a loaded 2-core machine.
"""

from __future__ import annotations

import functools
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from scipy import integrate, special, stats

import opake.dpftrl.accounting as dpftrl_acc
from dense import lower_toeplitz
from opake.audit import GradientCanaries, TrainingRecipe, audit_many_runs, clopper_pearson_upper, epsilon_lower_bound
from opake.dpftrl.noise import identity_strategy
from opake.random import key

CONFIDENCE = 0.999
RUNS = 200
CLAIM = 1.5


# ---------------------------------------------------------------------------------------------
# Clopper-Pearson


def _exact_upper(x, n, alpha):
    """p with P[Binomial(n, p) <= x] = alpha, by bisection on the exact sum (60 digits)."""
    with mpmath.workdps(60):
        def cdf(p):
            return mpmath.fsum(mpmath.binomial(n, k) * p ** k * (1 - p) ** (n - k) for k in range(x + 1))
        low, high = mpmath.mpf(0), mpmath.mpf(1)
        for _ in range(120):
            middle = (low + high) / 2
            low, high = (middle, high) if cdf(middle) > alpha else (low, middle)
        return float(low)


@pytest.mark.parametrize("x, n, alpha", [(0, 1, 0.05), (0, 20, 0.05), (3, 20, 1e-3), (19, 20, 0.05),
                                         (7, 50, 1e-9), (25, 50, 0.3)])
def test_clopper_pearson_matches_the_exact_binomial(x, n, alpha):
    assert clopper_pearson_upper(x, n, alpha) == pytest.approx(_exact_upper(x, n, alpha), rel=1e-9)
    assert clopper_pearson_upper(n, n, alpha) == 1.0
    bounds = clopper_pearson_upper(np.array([x, n]), n, alpha)
    assert bounds[0] == clopper_pearson_upper(x, n, alpha) and bounds[1] == 1.0


@pytest.mark.parametrize("n, alpha", [(10, 0.05), (40, 0.01)])
def test_clopper_pearson_covers_every_proportion(n, alpha):
    bounds = clopper_pearson_upper(np.arange(n + 1), n, alpha)
    for p in np.linspace(0.001, 0.999, 199):
        undercover = stats.binom.pmf(np.arange(n + 1), n, p)[bounds < p].sum()
        assert undercover <= alpha * (1 + 1e-9), (p, undercover)


@pytest.mark.parametrize("k, n", [(1, 10), (3, 10), (5, 200), (200, 200)])
def test_rank_threshold_has_exactly_the_clopper_pearson_law(k, n):
    """FPR(tau_k) = 1 - U_(n-k+1) for uniforms U; P[FPR > b] = P[at least n-k+1 of n uniforms < 1 - b]."""
    alpha = 1e-3
    b = clopper_pearson_upper(k - 1, n, alpha)
    assert stats.binom.sf(n - k, n, 1.0 - b) == pytest.approx(alpha, rel=1e-8)


# ---------------------------------------------------------------------------------------------
# The epsilon lower bound


def _by_hand(scores_in, scores_out, delta, significance, thresholds):
    """The bound as a plain loop; thresholds=None means the OUT scores' order statistics."""
    ranked = sorted(scores_out, reverse=True)
    taus = ranked if thresholds is None else list(thresholds)
    alpha = significance / (2 * len(taus))
    best = 0.0
    for rank, tau in enumerate(taus, start=1):
        false_pos = rank - 1 if thresholds is None else sum(s > tau for s in scores_out)
        false_neg = sum(s <= tau for s in scores_in)
        n_out, n_in = len(scores_out), len(scores_in)
        fpr_up = 1.0 if false_pos == n_out else stats.beta.isf(alpha, false_pos + 1, n_out - false_pos)
        fnr_up = 1.0 if false_neg == n_in else stats.beta.isf(alpha, false_neg + 1, n_in - false_neg)
        if 1.0 - delta - fnr_up > 0 and fpr_up > 0:
            best = max(best, math.log((1.0 - delta - fnr_up) / fpr_up))
    return best


@given(st.integers(1, 40), st.integers(1, 40), st.floats(0.0, 4.0), st.integers(0, 2**32 - 1),
       st.booleans(), st.booleans())
def test_epsilon_lower_bound_matches_a_loop(count_in, count_out, shift, seed, grid, ties):
    rng = np.random.default_rng(seed)
    scores_in, scores_out = rng.normal(shift, 1.0, count_in), rng.normal(0.0, 1.0, count_out)
    if ties:
        scores_in, scores_out = np.round(scores_in), np.round(scores_out)
    thresholds = np.linspace(-2.0, 6.0, 17) if grid else None
    bound = epsilon_lower_bound(scores_in, scores_out, delta=1e-3, significance=0.05, thresholds=thresholds)
    assert bound.epsilon == pytest.approx(_by_hand(scores_in, scores_out, 1e-3, 0.05, thresholds), rel=1e-12, abs=1e-15)
    assert bound.alpha == pytest.approx(0.05 / (2 * (17 if grid else count_out)))


def test_perfect_separation_by_hand():
    """20 runs each, every IN score above every OUT score: best at tau = the largest OUT score,
    no false positive by rank (k = 1) and no false negative, so FPR_up = FNR_up = 1 - a^(1/20)."""
    bound = epsilon_lower_bound(np.arange(20) + 100.0, np.arange(20.0), delta=1e-5, significance=0.05)
    upper = 1.0 - (0.05 / 40) ** (1 / 20)
    assert bound.epsilon == pytest.approx(math.log((1 - 1e-5 - upper) / upper), rel=1e-12)
    assert bound.threshold == 19.0 and bound.false_positives == 0 and bound.false_negatives == 0
    nothing = epsilon_lower_bound(np.zeros(5), np.zeros(5), delta=0.0, significance=0.05)
    assert nothing.epsilon == 0.0 and nothing.threshold is None


def test_gaussian_mechanisms_are_refuted_no_more_often_than_the_confidence_allows():
    """500 + 500 draws of N(mu, 1) vs N(0, 1), 100 repetitions per mu, significance 0.05: the
    bound exceeds the true epsilon (Gaussian mechanism, sensitivity 1, sigma 1/mu) in at most
    0.05 of them in expectation; 15 of 100 has probability < 1e-4 under Binomial(100, 0.05). The
    bound is far below the truth at delta = 1e-5 (medians 0.12, 0.76, 3.1 against 2.0, 4.4, 14.5):
    500 runs cannot see the tail that delta measures; it is still clearly positive for mu >= 1."""
    rng = np.random.default_rng(5)
    for mu, power in ((0.5, 0.0), (1.0, 0.4), (3.0, 2.5)):
        truth = dpftrl_acc.mf_gaussian(1.0 / mu, identity_strategy(), 1, 1, 1).epsilon_at(1e-5)
        bounds = [epsilon_lower_bound(rng.normal(mu, 1.0, 500), rng.normal(0.0, 1.0, 500), delta=1e-5,
                                      significance=0.05).epsilon for _ in range(100)]
        assert sum(b > truth for b in bounds) <= 15, (mu, truth, max(bounds))
        assert np.median(bounds) >= power, (mu, truth, np.median(bounds))   # and it has some power


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        epsilon_lower_bound([], [1.0], delta=0.0, significance=0.05)
    with pytest.raises(ValueError, match="NaN"):
        epsilon_lower_bound([np.nan], [1.0], delta=0.0, significance=0.05)
    with pytest.raises(ValueError, match="significance"):
        epsilon_lower_bound([1.0], [1.0], delta=0.0, significance=1.5)
    with pytest.raises(ValueError, match="successes <= trials"):
        clopper_pearson_upper(5, 4, 0.05)


# ---------------------------------------------------------------------------------------------
# Real runs through make_private


def _recipe():
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=generator),
                                          torch.randint(0, 2, (7,), generator=generator))
    # 7 examples + the canary's slot = 8 = one bin of 8: every example at both steps
    return TrainingRecipe(module_fn=lambda: torch.nn.Linear(4, 2), optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1),
                          dataset=data, batch_size=8, epochs=2, max_grad_norm=1.0, target_delta=1e-5,
                          target_epsilon=CLAIM, options={"strategy": identity_strategy(), "amplification": False})


@functools.lru_cache(maxsize=None)
def _audit(noise_scale):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 800 runs of a 10-parameter model: threads only add contention
    try:
        return audit_many_runs(_recipe(), GradientCanaries(1), runs=RUNS, key=key(21), confidence=CONFIDENCE,
                               noise_scale=noise_scale, verbose=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_correct_runs_stay_below_their_claim():
    result = _audit(1.0)
    assert 0.99 * CLAIM <= result.claimed_epsilon <= CLAIM and result.runs == 2 * RUNS
    assert result.empirical_epsilon <= result.claimed_epsilon, f"correct runs beat the claim (p <= 1e-3): {result}"


def _miss_probability(mu, runs, epsilon, delta, alpha):
    """P[the audit does not exceed epsilon] when OUT ~ N(0, 1), IN ~ N(mu, 1), bounded at every rank k:
    the bound at tau_k (the k-th largest OUT score) beats epsilon iff the IN scores below tau_k
    number at most b_k, so P[miss] <= min_k E[P(Binomial(runs, Phi(tau_k - mu)) > b_k)], the mean
    over tau_k's exact density runs!/((k-1)!(runs-k)!) phi(t) Q(t)^(k-1) Phi(t)^(runs-k)."""
    best = 1.0
    for k in range(1, 40):
        fpr_upper = clopper_pearson_upper(k - 1, runs, alpha)
        beats = (1 - delta - clopper_pearson_upper(np.arange(runs + 1), runs, alpha)) > math.exp(epsilon) * fpr_upper
        if not beats[0]:
            continue
        allowed = int(np.flatnonzero(beats)[-1])
        log_c = special.gammaln(runs + 1) - special.gammaln(k) - special.gammaln(runs - k + 1)

        def integrand(t):
            log_density = (log_c + stats.norm.logpdf(t) + (k - 1) * stats.norm.logsf(t)
                           + (runs - k) * stats.norm.logcdf(t))
            return math.exp(log_density) * stats.binom.sf(allowed, runs, stats.norm.cdf(t - mu))

        best = min(best, integrate.quad(integrand, -3.0, 10.0, limit=400, epsabs=1e-16)[0])
    return best


@pytest.mark.slow
def test_runs_with_a_tenth_of_the_noise_are_caught():
    """The engine adds sigma / 10, the claim stays 1.5. One bin: the canary's score is its statistic
    <C y, C u> / (sigma ||C u||), N(0, 0.01) without it and N(||C u|| / sigma, 0.01) with it, so in
    units of 0.1 the two sides are N(0, 1) and N(mu, 1), mu = 10 ||C u|| / sigma (||C u|| = sqrt(2)
    from the dense oracle, C = I). The exact bound on a miss must be < 1e-9 (measured: 2.68, with
    no false positive and 2 false negatives at the best threshold; the correct runs: 0)."""
    result = _audit(0.1)
    correct = _audit(1.0)
    assert result.claimed_epsilon == correct.claimed_epsilon
    assert result.noise_multiplier == correct.noise_multiplier
    # the claim is the unamplified one-bin balls-in-bins bound at the plan's sigma
    claim = dpftrl_acc.balls_in_bins(dpftrl_acc.mf_gaussian(result.noise_multiplier, identity_strategy()), num_bins=1,
                                     n_steps=2, method="rigorous")
    assert claim.epsilon_at(1e-5) == pytest.approx(result.claimed_epsilon, rel=1e-9)
    sensitivity = np.linalg.norm(lower_toeplitz(np.array([1.0, 0.0])) @ np.ones(2))     # ||C u||, C = I
    mu = 10.0 * sensitivity / result.noise_multiplier
    alpha = (1 - CONFIDENCE) / (2 * RUNS)
    assert result.details.alpha == pytest.approx(alpha)
    assert _miss_probability(mu, RUNS, result.claimed_epsilon, 1e-5, alpha) < 1e-9, mu
    assert result.exceeds_claim, f"the audit missed runs with a tenth of the noise: {result}"
    assert "CONTROL" in str(result) and "EXCEEDS" in str(result)


def test_many_run_audit_refuses_more_than_one_canary():
    with pytest.raises(ValueError, match="ONE canary"):
        audit_many_runs(_recipe(), GradientCanaries(2), runs=1, key=key(0), verbose=False)
    with pytest.raises(TypeError, match="RngKey"):
        audit_many_runs(_recipe(), GradientCanaries(1), runs=1, key=0, verbose=False)
