"""The one-run audit (opake.audit.one_run, opake.audit.auditor.audit_one_run).

Statistics, against independent references:
  * ``p_value`` equals [SNJ23]'s bound computed by brute force in 60-digit arithmetic (mpmath
    binomial sums, the maximum over the theorem's full range i = 1..m);
  * it is non-decreasing in epsilon and non-increasing in the number of correct guesses (the two
    facts the module proves and the lower bound relies on);
  * for randomized response, where the delta = 0 bound is exact, the whole procedure (guess all,
    invert at beta) exceeds the true epsilon with probability <= beta, by exact enumeration;
  * the value printed in the paper (arXiv:2305.08846v1, Appendix D: m = 1000, r = 100, v = 75,
    delta = 1e-4, 95% -> 0.673).
Real runs (make_private on a tiny model, 1000 gradient canaries, 4 bins, 3 epochs, claimed
epsilon 2 at delta 1e-7, confidence 0.999, so a correct run fails with probability <= 1e-3):
  * the correct run's canary statistics are exactly the claimed Gaussian (absent canaries
    N(0, 1), present ones shifted by ||C u_j|| / sigma at their own bin, C from the dense
    oracle), and its lower bound stays below the claim;
  * the same run with a tenth of the noise (the engine swapped, the claim unchanged) gets a lower
    bound above the claim (measured 3.45 > 2); an analytic bound on missing it (binomial tails)
    is < 1e-6;
  * black-box: mislabeled input canaries through a real model, loss scores; full-batch run.
Sizes: about 5-10 s for the file on a loaded 2-core machine.
"""

from __future__ import annotations

import functools
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from scipy import stats

from dense import blt_coefs, lower_toeplitz
from opake.audit import (
    GradientCanaries, InputCanaries, TrainingRecipe, audit_one_run, inclusion_coins, mislabeled_canaries,
    one_run_bound, train_with_canaries,
)
from opake.audit.canaries import AuditDataset
from opake.audit.one_run import default_guesses, epsilon_lower_bound, p_value
from opake.audit.training import _ReleasedScore
from opake.dpftrl.noise import blt_strategy, identity_strategy
from opake.random import key

CONFIDENCE = 0.999
DELTA = 1e-7
CLAIM = 2.0
CANARIES = 1000


# ---------------------------------------------------------------------------------------------
# The statistics


def _brute_force_p_value(m, r, v, epsilon, delta):
    """[SNJ23]'s bound with every sum written out, 60 digits, max over i = 1..m (not 1..v)."""
    with mpmath.workdps(60):
        q = mpmath.e ** epsilon / (1 + mpmath.e ** epsilon)
        pmf = [mpmath.binomial(r, k) * q ** k * (1 - q) ** (r - k) for k in range(r + 1)]

        def f(x):
            return mpmath.mpf(1) if x <= 0 else mpmath.fsum(pmf[k] for k in range(x, r + 1))

        window = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
        return float(min(mpmath.mpf(1), f(v) + 2 * m * mpmath.mpf(delta) * window))


@pytest.mark.parametrize("m, r, v, epsilon, delta", [
    (10, 10, 10, 1.0, 0.0), (10, 10, 7, 0.5, 1e-3), (20, 12, 12, 2.0, 1e-2), (20, 12, 3, 0.1, 1e-2),
    (50, 30, 28, 3.0, 1e-3), (50, 50, 0, 1.0, 1e-3), (7, 1, 1, 0.0, 0.05), (40, 40, 25, 0.7, 0.0125),
])
def test_p_value_matches_brute_force(m, r, v, epsilon, delta):
    assert p_value(m, r, v, epsilon, delta) == pytest.approx(_brute_force_p_value(m, r, v, epsilon, delta),
                                                             rel=1e-10, abs=1e-14)


@given(st.integers(1, 60), st.data(), st.floats(0.0, 6.0), st.floats(0.0, 1.0))
def test_p_value_is_monotone_in_epsilon_and_in_correct_guesses(m, data, epsilon, delta_fraction):
    r = data.draw(st.integers(1, m))
    v = data.draw(st.integers(0, r))
    delta = delta_fraction / (2 * m)                       # 2 m delta <= 1, the module's condition
    p = p_value(m, r, v, epsilon, delta)
    assert p <= p_value(m, r, v, epsilon + 0.25, delta) + 1e-12
    if v < r:
        assert p_value(m, r, v + 1, epsilon, delta) <= p + 1e-12


def test_randomized_response_is_refuted_at_most_beta_of_the_time():
    """Exact enumeration: each canary answered by randomized response at epsilon0 (the tight case).

    All m guesses are the mechanism's answers, so W ~ Binomial(m, e^eps0 / (1 + e^eps0)) exactly;
    the bound exceeds eps0 exactly when W is large enough, and that must have probability <= beta.
    """
    m, beta = 60, 0.05
    for epsilon0 in (0.0, 0.5, 1.0, 2.0):
        q = math.exp(epsilon0) / (1 + math.exp(epsilon0))
        false_alarm = sum(stats.binom.pmf(w, m, q) for w in range(m + 1)
                          if epsilon_lower_bound(m, m, w, 0.0, beta) > epsilon0)
        assert false_alarm <= beta, (epsilon0, false_alarm)
        assert false_alarm > beta / 4, (epsilon0, false_alarm)   # and it is not vacuous: the bound is tight


def test_lower_bound_inverts_the_p_value():
    for m, r, v, delta, beta in [(1000, 100, 75, 1e-4, 0.05), (1000, 150, 148, 1e-7, 1e-4), (200, 20, 20, 0.0, 0.01)]:
        bound = epsilon_lower_bound(m, r, v, delta, beta)
        assert p_value(m, r, v, bound, delta) <= beta < p_value(m, r, v, bound + 1e-9, delta)
    assert epsilon_lower_bound(1000, 100, 50, 1e-5, 0.05) == 0.0      # chance level refutes nothing


def test_the_value_printed_in_the_paper():
    """arXiv:2305.08846v1, Appendix D: 75 of 100 guesses right among 1000 canaries, delta 1e-4, 95%."""
    assert epsilon_lower_bound(1000, 100, 75, 1e-4, 0.05) == pytest.approx(0.673, abs=5e-4)


def test_one_run_bound_counts_guesses_on_the_extreme_scores():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    included = np.array([True, True, False, True, False, True, False, False])
    bound = one_run_bound(scores, included, delta=0.0, confidence=0.9, guesses=[(2, 0), (3, 3)])
    # (2, 0): top two both included -> 2 of 2; (3, 3): top three 2 right, bottom three 2 right -> 4 of 6
    by_hand = max(epsilon_lower_bound(8, 2, 2, 0.0, 0.05), epsilon_lower_bound(8, 6, 4, 0.0, 0.05))
    assert bound.epsilon == by_hand and bound.choices == 2 and bound.included == 4
    assert (bound.k_plus, bound.k_minus, bound.correct) in {(2, 0, 2), (3, 3, 4)}
    # ties are broken by index, never by the coins: "in" for index 0, "out" for index 3
    assert one_run_bound(np.zeros(4), np.array([True, False, True, False]), delta=0.0, guesses=[(1, 1)]).correct == 2
    assert one_run_bound(np.zeros(4), np.array([False, True, False, True]), delta=0.0, guesses=[(1, 1)]).correct == 0


def test_default_guesses_are_fixed_valid_and_distinct():
    for m in (1, 2, 10, 1000):
        choices = default_guesses(m)
        assert choices and len(set(choices)) == len(choices)
        assert all(1 <= a + b <= m and a >= 0 and b >= 0 for a, b in choices)
    assert (500, 500) in default_guesses(1000) and (150, 0) in default_guesses(1000)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2 \\* canaries \\* delta <= 1"):
        p_value(100000, 10, 10, 1.0, 1e-5)
    with pytest.raises(ValueError, match="correct <= guesses <= canaries"):
        p_value(10, 5, 6, 1.0, 0.0)
    with pytest.raises(TypeError, match="booleans"):
        one_run_bound([1.0, 2.0], [1, 0], delta=0.0)
    with pytest.raises(ValueError, match="NaN"):
        one_run_bound([1.0, float("nan")], [True, False], delta=0.0)
    with pytest.raises(ValueError, match="k_plus"):
        one_run_bound([1.0, 2.0], [True, False], delta=0.0, guesses=[(2, 1)])
    with pytest.raises(TypeError, match="RngKey"):
        inclusion_coins(10, 3)


def test_coins_are_fair_and_fixed_by_the_key():
    coins = inclusion_coins(20000, key(7))
    assert np.array_equal(coins, inclusion_coins(20000, key(7)))
    assert not np.array_equal(coins, inclusion_coins(20000, key(8)))
    assert abs(coins.mean() - 0.5) < 5.0 * 0.5 / math.sqrt(coins.size)   # 5 sigma


# ---------------------------------------------------------------------------------------------
# Real runs through make_private


def _tiny_recipe(strategy, amplification, batch_size, epochs=3, base=7, **changes):
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(base, 4, generator=generator),
                                          torch.randint(0, 2, (base,), generator=generator))
    arguments = dict(
        module_fn=lambda: torch.nn.Linear(4, 2), optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1),
        dataset=data, batch_size=batch_size, epochs=epochs, max_grad_norm=1.0, target_delta=DELTA,
        target_epsilon=CLAIM, options={"strategy": strategy, "amplification": amplification},
    )
    arguments.update(changes)
    return TrainingRecipe(**arguments)


CASES = {
    # name: (strategy, amplification); 7 + 1000 examples in 4 bins of about 251, 3 epochs
    "identity": (identity_strategy(), False),
    "blt_amplified": (blt_strategy(max_buffers=3), True),
}


@functools.lru_cache(maxsize=None)
def _run(name, noise_scale):
    strategy, amplification = CASES[name]
    recipe = _tiny_recipe(strategy, amplification, batch_size=(7 + CANARIES) // 4)
    coins = inclusion_coins(CANARIES, key(11).fold_in("coins"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only add contention
    try:
        run = train_with_canaries(recipe, GradientCanaries(CANARIES), coins, key(11).fold_in("run"),
                                  noise_scale=noise_scale)
    finally:
        torch.set_num_threads(threads)
    bound = one_run_bound(run.scores, run.included, delta=run.delta, confidence=CONFIDENCE)
    return run, bound


def _bin_norms(run):
    """||C u_j|| for the run's mechanism, from the dense oracle (not the library's FFT route)."""
    mechanism = run.plan.accountant.mechanism
    matrix = lower_toeplitz(blt_coefs(mechanism.theta, mechanism.omega, run.n_steps))
    patterns = np.stack([(np.arange(run.n_steps) % run.period == j).astype(float) for j in range(run.period)])
    return np.linalg.norm(patterns @ matrix.T, axis=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_correct_run_is_the_claimed_gaussian_and_stays_below_its_claim(name):
    run, bound = _run(name, 1.0)
    assert 0.99 * CLAIM <= run.epsilon <= CLAIM and run.delta == DELTA  # calibrated to the target
    assert run.engine_noise_multiplier == run.noise_multiplier
    assert (run.n_steps, run.period) == (12, 4)
    present = np.flatnonzero(run.included)
    absent = np.flatnonzero(~run.included)
    # balls in bins: every present canary was served once per epoch, in one bin; absent ones never
    assert np.all(run.participations[present] == 3) and np.all(run.participations[absent] == 0)
    assert np.all(run.first_steps[present] < run.period)
    statistics = run.bin_statistics
    # absent: N(0, 1) (bin 0; 5.3 sigma on the mean, chi2 interval at 1e-7 on the variance)
    _assert_standard_normal(statistics[absent, 0])
    # present, at its own bin: N(||C u_j|| / sigma, 1): the clipped gradient was exactly the bound
    own = run.first_steps[present]
    shift = _bin_norms(run)[own] / run.noise_multiplier
    _assert_standard_normal(statistics[present, own] - shift)
    assert bound.epsilon <= run.epsilon, f"{name}: a correct run beat its claim (probability <= 1e-3): {bound}"


def _assert_standard_normal(values):
    n = values.size
    assert abs(values.mean()) <= 5.3 / math.sqrt(n), values.mean()
    low, high = stats.chi2.ppf(5e-8, n - 1) / (n - 1), stats.chi2.isf(5e-8, n - 1) / (n - 1)
    assert low <= values.var(ddof=1) <= high, values.var(ddof=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_run_with_a_tenth_of_the_noise_is_caught(name):
    """The engine adds sigma / 10 while the claim stays epsilon = 2 (``noise_scale=0.1``).

    In the claim's units a present canary's own-bin statistic is N(a_j, 0.01), a_j = ||C u_j|| /
    sigma, and an absent canary's score is the max of 4 N(0, 0.01). For a threshold tau: at least
    Bin(present, Phi((min a_j - tau) / 0.1)) present scores and at most Bin(absent, 4 Q(tau / 0.1))
    absent scores exceed it; when >= k present and <= j absent do, the top-k guess (a top-only
    choice of the default grid) has >= k - j right, and its bound alone beats the claim. The test
    requires that missing it be less likely than 1e-6 (exact binomial tails, best k and tau) and
    then that the audit catches it (measured, both cases: 300 of 300 guesses right, a bound of 3.45,
    the most 1000 canaries can show at this confidence, against the claim of 2).
    """
    run, bound = _run(name, 0.1)
    assert run.engine_noise_multiplier == pytest.approx(0.1 * run.noise_multiplier, rel=1e-12)
    present, absent = int(run.included.sum()), int((~run.included).sum())
    a_min, s = _bin_norms(run).min() / run.noise_multiplier, 0.1
    significance = (1 - CONFIDENCE) / len(default_guesses(CANARIES))
    miss = 1.0
    for k in (k for k, k_minus in default_guesses(CANARIES) if k_minus == 0 and k <= present):
        wrong = -1  # the most wrong guesses that still beat the claim (the bound falls as they grow)
        while wrong + 1 < k and epsilon_lower_bound(CANARIES, k, k - wrong - 1, DELTA, significance) > run.epsilon:
            wrong += 1
        if wrong >= 0:
            taus = np.linspace(0.0, 2 * a_min, 400)
            misses = (stats.binom.cdf(k - 1, present, stats.norm.cdf((a_min - taus) / s))
                      + stats.binom.sf(wrong, absent, np.minimum(1.0, run.period * stats.norm.sf(taus / s))))
            miss = min(miss, float(misses.min()))
    assert miss < 1e-6, (name, miss)
    assert bound.epsilon > run.epsilon, f"{name}: the audit missed a 10x under-noised run: {bound}"


def test_released_score_columns_match_the_dense_oracle():
    mechanism = blt_strategy(max_buffers=3).resolve(12, 4, 3)
    score = _ReleasedScore(mechanism.toeplitz_coefficients(12), 12, 4, count=2, sigma=2.0, rescale=1.0)
    matrix = lower_toeplitz(blt_coefs(mechanism.theta, mechanism.omega, 12))
    patterns = np.stack([(np.arange(12) % 4 == j).astype(float) for j in range(4)])
    np.testing.assert_allclose(score.columns, matrix.T @ matrix @ patterns.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(score.norms_squared, np.sum((patterns @ matrix.T) ** 2, axis=1), rtol=1e-12)
    # a hand sequence: y = C^{-1} e_0 * 2 (canary 0 absent, noise = 2 * C^{-1} e_0) gives T_0j = (C u_j)_0 / ||C u_j||
    noise = np.linalg.solve(matrix, np.eye(12)[0]) * 2.0
    for step in range(12):
        score.record(step, torch.tensor([noise[step], 0.0], dtype=torch.float64))
    scores, statistics = score.scores()
    expected = (patterns @ matrix.T)[:, 0] / np.linalg.norm(patterns @ matrix.T, axis=1)
    np.testing.assert_allclose(statistics[0], expected, rtol=1e-9, atol=1e-12)
    assert scores[0] == pytest.approx(expected.max()) and np.all(statistics[1] == 0.0)


# ---------------------------------------------------------------------------------------------
# Black-box canaries


def _one_hot_task(canaries):
    """Inputs e_i (one weight column each), so a zero-initialized linear model can memorize."""
    width = canaries + 8
    base_x = torch.eye(width)[canaries:]
    data = torch.utils.data.TensorDataset(base_x, torch.arange(8) % 4)

    def module():
        layer = torch.nn.Linear(width, 4, bias=False)
        torch.nn.init.zeros_(layer.weight)
        return layer

    return data, module, torch.eye(width)[:canaries]


def test_mislabeled_canaries_and_the_audit_dataset():
    inputs, labels = torch.randn(500, 3), torch.randint(0, 5, (500,))
    canaries = mislabeled_canaries(inputs, labels, 5, key(2))
    assert torch.all(canaries.labels != labels) and torch.equal(canaries.inputs, inputs)
    counts = torch.bincount((canaries.labels - labels) % 5, minlength=5)
    assert counts[0] == 0 and counts[1:].min() > 80                     # the 4 wrong labels all appear
    base = torch.utils.data.TensorDataset(torch.ones(3, 3), torch.tensor([1, 2, 3]))
    included = np.zeros(500, dtype=bool)
    included[0] = True
    dataset = AuditDataset(base, canaries, included)
    assert len(dataset) == 503
    x, y, slot, weight = dataset[3]
    assert torch.equal(x, inputs[0]) and y == canaries.labels[0] and slot == -1 and weight == 1.0
    assert dataset[4][3] == 0.0                                          # absent: a zero-gradient placeholder
    gradient = AuditDataset(base, GradientCanaries(500), included)
    assert gradient[3][2] == 0 and gradient[3][3] == 0.0 and torch.all(gradient[3][0] == 0)
    assert gradient[4][2] == -1 and gradient[0][2] == -1 and gradient[0][3] == 1.0
    with pytest.raises(ValueError, match="one coin per canary"):
        AuditDataset(base, canaries, included[:3])


def test_black_box_audit_catches_a_full_batch_run_with_a_tenth_of_the_noise():
    """1000 mislabeled one-hot canaries, a zero-initialized linear model, every example at every
    step (one bin), 3 epochs, scored by minus their loss. With sigma / 10 the memorized wrong
    labels stand out (measured: 300 of 300 guesses right, bound 3.45 against the claim of 2; the
    margin is large, the seeds fixed); with the claimed noise the bound stays below the claim
    (false failure <= 1e-3; measured 0)."""
    data, module, inputs = _one_hot_task(CANARIES)
    canaries = mislabeled_canaries(inputs, torch.zeros(CANARIES, dtype=torch.long), 4, key(3))
    recipe = _tiny_recipe(identity_strategy(), False, batch_size=len(data) + CANARIES, dataset=data,
                          module_fn=module, optimizer_fn=lambda p: torch.optim.SGD(p, lr=1.0))
    correct = audit_one_run(recipe, canaries, key=key(1), confidence=CONFIDENCE, verbose=False)
    broken = audit_one_run(recipe, canaries, key=key(1), confidence=CONFIDENCE, noise_scale=0.1, verbose=False)
    assert correct.claimed_epsilon == broken.claimed_epsilon and 0.99 * CLAIM <= correct.claimed_epsilon <= CLAIM
    assert correct.empirical_epsilon <= correct.claimed_epsilon, correct
    assert broken.exceeds_claim, broken
    assert "CONTROL" in str(broken) and "EXCEEDS" in str(broken) and "CONTROL" not in str(correct)
    assert isinstance(canaries, InputCanaries) and "black-box" in correct.canaries


def test_the_audit_command_passes_its_options(monkeypatch):
    """``opake audit`` is the demo's audit (opake.audit.demo) with the command line's settings."""
    import opake.audit.demo as audit_demo
    from opake.cli import main

    seen = []
    monkeypatch.setattr(audit_demo, "main", lambda settings: seen.append(settings) or 0)
    assert main(["audit", "--epsilon", "2", "--canaries", "50", "--seed", "3", "--no-control"]) == 0
    assert seen == [audit_demo.AuditDemoSettings(epsilon=2.0, gradient_canaries=50, seed=3, control=False)]
