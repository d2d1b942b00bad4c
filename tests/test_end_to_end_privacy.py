"""End-to-end empirical privacy: sampler -> clipping -> correlated noise vs the accountant's claim.

Each case runs the REAL path many times on a small configuration: a sampler
(``BallsInBinsSampler``, or the negative control ``LegacyFixedSizeSampler``, a copy of the
fixed-size ``BMinSepSampler`` opake shipped before) chooses every step's batch, the real
``clipped_grad`` (clipping_norm = 1, normalize_by = 1) clips and sums, the real
``mf_gaussian_noise`` built for ``sampler.participation(n_steps)`` adds the noise, and
``dpftrl_acc.mf_gaussian(sigma, strategy, **context)`` claims epsilon(delta), a Gaussian with
mu = S / sigma = MU. Add/remove adjacency: D has N examples with gradient +1, D' = D + x (x has
gradient -1). 4000 independent worlds per dataset, one model coordinate each; statistic T =
the largest standardized drop of one bin (see tests/end_to_end_support.py for the set-up and
why the coordinates are independent runs).

Claim check: for every threshold tau of a fixed grid (81 points) and every point (eps, delta)
of the claimed curve (80 epsilons evenly spaced up to eps(1e-6), delta from
``accountant.delta_at``), Clopper-Pearson bounds (1e-9 each) must satisfy
1 - delta - FNR_up <= exp(eps) FPR_up. A correct
claim is refuted with probability <= 1.62e-7 per case (5 positive checks: < 1e-6 in all).

Cases (MU = 1.25 everywhere):
  * identity, 2 bins, N = 6, 6 steps (k = 3), balls-in-bins: passes (the bin sizes are random,
    so the test is weak: mu certified ~0.4 of the claimed 1.25);
  * the same with the legacy sampler (2 batches of 3; D' = 7 examples, one left out): FAILS. With
    probability 6/7, x replaced an example of D in one batch, whose sum drops by 2 at each of its
    steps: a shift of 2 mu on one bin. Analytically, at tau = 2.2 FPR = 0.028 and TPR = 0.54,
    where the claimed curve allows TPR <= 0.25; at delta = 0.16 (eps = 1.32) the margin is 0.27,
    0.16 after the Clopper-Pearson widths at the expected counts, and a false pass has
    probability < 4e-14 (exact binomial tails, ``miss_probability``); measured: margin +0.15,
    mu certified >= 1.66 > 1.25;
  * BLT (max_buffers=3), 2 bins, 8 steps (k = 4), balls-in-bins: passes (mu certified ~0.9);
    with the legacy sampler: FAILS (analytic false pass < 1e-19; measured margin +0.19);
  * tight: 1 bin (every example at every step). Balls-in-bins is then EXACTLY the claimed
    Gaussian: T ~ N(0, 1) under D, N(MU, 1) under D'. It passes, the empirical rates match the
    model at every threshold, and the attack certifies mu >= 0.7 (false failure < 3e-13): no
    hidden slack. The legacy sampler with batch_size = N pushes one example out of D' (prob.
    N/(N+1)): 2 mu; it FAILS (analytic false pass < 1e-21; measured margin +0.21).
The same worlds are also checked against balls_in_bins' default (amplified) claim: the
2-bin runs pass it and the legacy runs fail it. Poisson DP-SGD (``CyclicPoissonSampler`` with one
group, rate 0.5, N = 6, 4 steps, the other examples' gradients zero so that T sees only x)
passes its PLD claim (``poisson``, Band23 Thm 4; measured margin -0.03), and the same run priced
as if the rate were 0.125 FAILS (measured margin +0.09).
The legacy runs also match their model ("x in, y out" with probability N/(N+1)) at every
threshold (exact binomial intervals, 1e-10 per count), so the failure is the one described.

Sizes: about 2-4 s per case (one thread), ~25 s for the file on a loaded 2-core machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from audit_support import P_THRESHOLD, _clopper_pearson_upper
from end_to_end_support import (
    FALSE_FAILURE, THRESHOLDS, LegacyFixedSizeSampler, check_claim, claimed_curve, miss_probability,
    model_rates, run_worlds,
)
import opake.dpftrl.accounting as dpftrl_acc
from opake.dpftrl.noise import blt_strategy, identity_strategy
from opake.dpftrl.sampling import CyclicPoissonSampler
from opake.dpftrl.participation import Participation
from opake.dpftrl.sampling import BallsInBinsSampler
from opake.random import key

MU = 1.25
WORLDS = 4000
P_MODEL = 1e-10       # each count outside its exact two-sided binomial interval (model checks)
MAX_MISS = 1e-9       # analytic false-pass bound required of each negative control


def _balls_in_bins(num_bins):
    return lambda num_examples, sampler_key: BallsInBinsSampler(num_examples, num_bins, sampler_key)


def _legacy(batch_size, min_sep):
    return lambda num_examples, sampler_key: LegacyFixedSizeSampler(num_examples, batch_size, min_sep, sampler_key)


CASES = {
    # name: (strategy, sampler factory, N, n_steps, expected participation, seed)
    "identity_2bins": (identity_strategy(), _balls_in_bins(2), 6, 6, Participation(6, 2, 3), 11),
    "identity_2bins_legacy": (identity_strategy(), _legacy(3, 2), 6, 6, Participation(6, 2, 3), 12),
    "blt_2bins": (blt_strategy(max_buffers=3), _balls_in_bins(2), 6, 8, Participation(8, 2, 4), 21),
    "blt_2bins_legacy": (blt_strategy(max_buffers=3), _legacy(3, 2), 6, 8, Participation(8, 2, 4), 22),
    "identity_1bin": (identity_strategy(), _balls_in_bins(1), 4, 4, Participation(4, 1, 4), 31),
    "identity_1bin_legacy": (identity_strategy(), _legacy(4, 1), 4, 4, Participation(4, 1, 4), 32),
}
POSITIVE = ["identity_2bins", "blt_2bins", "identity_1bin"]
NEGATIVE = ["identity_2bins_legacy", "blt_2bins_legacy", "identity_1bin_legacy"]


@functools.lru_cache(maxsize=None)
def _run(name):
    strategy, make_sampler, num_examples, n_steps, participation, seed = CASES[name]
    run = run_worlds(strategy, make_sampler, num_examples=num_examples, n_steps=n_steps, mu=MU,
                     others=1.0, worlds=WORLDS, chunk=200, seed=seed)
    # The run went through the real pieces: every example the samplers chose was clipped (its
    # gradient 1024 e_w has norm 1024 > 1), the clipped sums were each world's signed batch count
    # (checked per step in _run_chunk), and the engine passed noise_fn.check_accounted_by.
    assert run.participation == participation
    assert run.examples_seen == run.examples_expected == run.clipped_examples == run.nonzero_examples
    assert run.accountant.sensitivity == pytest.approx(run.sensitivity, rel=0)
    assert run.sensitivity / run.noise_multiplier == pytest.approx(MU, rel=1e-12)
    if isinstance(strategy, type(identity_strategy())):
        assert run.sensitivity == pytest.approx(math.sqrt(participation.effective_participations), rel=1e-12)
    return run


def _assert_matches_model(run, *, shift, moved):
    """Every threshold's counts lie in their exact binomial interval under the analytic model."""
    fpr, fnr = model_rates(run, shift=shift, moved=moved)
    false_pos = np.array([np.count_nonzero(run.statistic_d > tau) for tau in THRESHOLDS])
    false_neg = np.array([np.count_nonzero(run.statistic_dprime <= tau) for tau in THRESHOLDS])
    for what, counts, rates in (("FP", false_pos, fpr), ("FN", false_neg, fnr)):
        low = stats.binom.ppf(P_MODEL / 2, WORLDS, rates)
        high = stats.binom.isf(P_MODEL / 2, WORLDS, rates)
        bad = np.flatnonzero((counts < low) | (counts > high))
        assert bad.size == 0, [(f"{what} tau={THRESHOLDS[i]:.1f}", int(counts[i]), low[i], high[i]) for i in bad]
    return fpr, fnr


@pytest.mark.parametrize("name", POSITIVE)
def test_balls_in_bins_run_respects_the_claimed_epsilon_curve(name):
    check = check_claim(_run(name))
    assert not check.violated, (
        f"{name}: the real sampler + clipping + noise run beats the accountant's epsilon curve "
        f"(false failure <= {FALSE_FAILURE:.2g}): {check}"
    )


def _amplified_claim(name):
    """The amplified claim: balls_in_bins' default for the identity (its bins do not interact: the
    random-allocation PLD, proven for adaptive gradients), method="amplified" for the BLT (the
    aligned pair, not proven for adaptive gradients: audited here all the same). A case and its
    legacy control share strategy, noise multiplier, bins and steps, hence one claim object (and
    one epsilon curve, ``claimed_curve``)."""
    run = _run(name)
    strategy, _, _, n_steps, participation, _ = CASES[name]
    return run, _amplified_accountant(strategy, run.noise_multiplier, participation.min_sep, n_steps)


@functools.lru_cache(maxsize=None)
def _amplified_accountant(strategy, noise_multiplier, num_bins, n_steps):
    inner = dpftrl_acc.mf_gaussian(noise_multiplier, strategy)
    if isinstance(strategy, type(identity_strategy())):
        return dpftrl_acc.balls_in_bins(inner, num_bins=num_bins, n_steps=n_steps)
    with pytest.warns(dpftrl_acc.UnprovenAmplificationWarning):
        return dpftrl_acc.balls_in_bins(inner, num_bins=num_bins, n_steps=n_steps, method="amplified")


@pytest.mark.parametrize("name", ["identity_2bins", "blt_2bins"])
def test_balls_in_bins_run_respects_the_amplified_claim(name):
    """The same worlds against the amplified (tighter) epsilon curve."""
    run, amplified = _amplified_claim(name)
    assert isinstance(amplified, (dpftrl_acc.BallsInBinsRDP, dpftrl_acc.BallsInBinsPLD))
    assert amplified.mechanism.fingerprint == run.accountant.mechanism.fingerprint
    assert amplified.epsilon_at(1e-3) <= run.accountant.epsilon_at(1e-3)
    if name == "identity_2bins":  # a real amplification (two BLT bins gain nothing at this delta)
        assert amplified.epsilon_at(1e-3) < run.accountant.epsilon_at(1e-3)
    check = check_claim(dataclasses.replace(run, accountant=amplified))
    assert not check.violated, f"{name}: the run beats the amplified claim: {check}"


@pytest.mark.parametrize("name", ["identity_2bins_legacy", "blt_2bins_legacy"])
def test_the_legacy_sampler_violates_the_amplified_claim_too(name):
    """Negative control for the amplified accountant: the same claim, a sampler that moves x's batch."""
    run, amplified = _amplified_claim(name)
    assert isinstance(amplified, (dpftrl_acc.BallsInBinsRDP, dpftrl_acc.BallsInBinsPLD))
    check = check_claim(dataclasses.replace(run, accountant=amplified))
    assert check.violated, f"{name}: the audit missed the legacy sampler against the amplified claim: {check}"


def test_one_bin_run_is_exactly_the_claimed_gaussian():
    """Tight case: no hidden slack between the run and the accountant.

    One bin: every example at every step, so g = N (D) or N - 1 (D') at each of the 4 steps and
    T = (4 N - sum y) / (2 sigma) is N(0, 1) vs N(S / sigma = MU, 1): the claimed Gaussian, not
    better. The rates match it at every threshold (exact binomial intervals), and the attack
    certifies mu >= 0.7 (false failure < 3e-13: ``miss_probability`` at tau = 0.6).
    """
    run = _run("identity_1bin")
    fpr, fnr = _assert_matches_model(run, shift=1.0, moved=1.0)
    certifies = lambda fpr_up, fnr_up: special.ndtri(1.0 - fnr_up) - special.ndtri(fpr_up) >= 0.7  # noqa: E731
    at = int(np.argmin(np.abs(THRESHOLDS - 0.6)))  # the best threshold for this bound
    assert miss_probability(fpr[at], fnr[at], WORLDS, certifies) < 3e-13
    check = check_claim(run)
    assert check.mu_lower >= 0.7, check
    assert not check.violated, check


@pytest.mark.parametrize("name", NEGATIVE)
def test_legacy_fixed_size_sampler_violates_the_claimed_epsilon_curve(name):
    """Negative control: "x in, y out" is twice the sensitivity the accountant prices.

    The run must match the analytic model of the legacy sampler (shift 2 on x's batch with
    probability N / (N + 1)), the model must make a false pass at its best (tau, delta) less
    likely than MAX_MISS (exact binomial tails), and the claim check must find the violation.
    """
    run = _run(name)
    num_examples = CASES[name][2]
    fpr, fnr = _assert_matches_model(run, shift=2.0, moved=num_examples / (num_examples + 1))

    deltas, epsilons = claimed_curve(run.accountant)
    # The (tau, claimed point) with the largest margin when the counts take their expected values.
    expected_margin = [
        (1.0 - deltas - _clopper_pearson_upper(round(WORLDS * fnr[i]), WORLDS, P_THRESHOLD))
        - np.exp(epsilons) * _clopper_pearson_upper(round(WORLDS * fpr[i]), WORLDS, P_THRESHOLD)
        for i in range(THRESHOLDS.size)
    ]
    i, j = np.unravel_index(np.argmax(expected_margin), (THRESHOLDS.size, deltas.size))
    fnr_star, fpr_star = fnr[i], fpr[i]

    def detects(fpr_up, fnr_up):
        return (1.0 - deltas[j] - fnr_up) - math.exp(epsilons[j]) * fpr_up > 0.0

    assert miss_probability(fpr_star, fnr_star, WORLDS, detects) < MAX_MISS

    check = check_claim(run)
    assert check.violated, f"{name}: the audit missed the legacy sampler's doubled sensitivity: {check}"
    assert check.mu_lower > MU, check


def test_legacy_sampler_pushes_an_example_out_when_one_is_added():
    """The mechanism of the negative control, on the sampler alone.

    N = 6 in batches of 3: D uses all six; D' (7 examples) still makes 2 batches of 3, so exactly
    one of the 7 is never used. Whenever x (index 6) is used, an example of D was pushed out.
    Batches are disjoint, exactly batch_size, cycled, and the participation is as shipped.
    """
    pushed_out = 0
    for seed in range(200):
        d = LegacyFixedSizeSampler(6, 3, 2, key(seed))
        d_prime = LegacyFixedSizeSampler(7, 3, 2, key(seed).fold_in(1))
        used_d = torch.cat([d.batch(t) for t in range(2)])
        used_dp = torch.cat([d_prime.batch(t) for t in range(2)])
        assert sorted(used_d.tolist()) == list(range(6))
        assert used_dp.numel() == 6 and len(set(used_dp.tolist())) == 6
        assert torch.equal(d.batch(5), d.batch(1)) and d.participation(6) == Participation(6, 2, 3)
        pushed_out += int(6 in used_dp.tolist())
    # x is used with probability 6/7 (171 of 200 expected; 140..195 holds except w.p. < 1e-9).
    assert 140 <= pushed_out <= 195, pushed_out


@functools.lru_cache(maxsize=None)
def _poisson_run():
    """Poisson DP-SGD (one group, rate 0.5) through the real sampler, clipping and engine.

    The other examples carry zero gradient, so T sees only x: the worst case of Band23 Thm 4's
    dominating pair, PoissonSampled(0.5, Gaussian) composed 4 times.
    """
    sampler = lambda num_examples, sampler_key: CyclicPoissonSampler(num_examples, 1, 0.5, sampler_key)  # noqa: E731
    return run_worlds(identity_strategy(), sampler, num_examples=6, n_steps=4, mu=MU, others=0.0,
                      worlds=WORLDS, chunk=200, seed=41)


def _poisson_claim(run, sample_rate):
    return dpftrl_acc.poisson(dpftrl_acc.mf_gaussian(run.noise_multiplier, identity_strategy()), sample_rate, 4)


def test_poisson_dp_sgd_run_respects_its_pld_claim():
    run = _poisson_run()
    assert run.participation == Participation(4, 1, 4)
    assert run.examples_seen == run.examples_expected  # every drawn example went through clipping
    assert run.clipped_examples == run.nonzero_examples > 0  # x, each time it was drawn (norm 1024 > 1)
    check = check_claim(dataclasses.replace(run, accountant=_poisson_claim(run, 0.5)))
    assert not check.violated, f"the Poisson run beats its PLD claim: {check}"


def test_a_poisson_claim_at_a_quarter_of_the_real_rate_is_refuted():
    """Negative control: pricing the run as if each example were drawn at rate 0.125, not 0.5."""
    run = _poisson_run()
    check = check_claim(dataclasses.replace(run, accountant=_poisson_claim(run, 0.125)))
    assert check.violated and check.margin > 0.05, check
