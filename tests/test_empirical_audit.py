"""Empirical privacy audit of the code that runs: clipping -> noise engine -> released gradients.

An attacker who knows the strategy inserts a canary whose clipped gradient has norm exactly the
clip bound on the worst-case participation pattern u = {0, b, ..., (k'-1) b} of the context
(n_steps, min_sep, max_participations), and tests "canary in" against "canary out" with the
Neyman-Pearson statistic T = <C y, C u> / (||C u|| sigma) on the released sequence y. The claim
under audit is that the run is exactly a Gaussian mechanism with mu = S / sigma = 1 / sigma_eff
(docs/math.md section 6), which is what the accountant prices. See tests/audit_support.py for why one
engine run gives N independent samples per hypothesis (one canary per model coordinate), the
exact confidence interval for mu and the Clopper-Pearson epsilon lower bound.

Checked for the identity strategy (DP-SGD, k' = 3 participations), a single-participation BLT
and a multi-participation BLT (k' = 4), each at mu = 1 (sigma_eff = 1, accountant epsilon
4.377178 at delta = 1e-5):
  * the canary's pattern is the worst case: ||C u|| = Mechanism.sensitivity = brute force;
  * every canary was clipped by the real clipping (ClipState) to exactly e_j;
  * the accountant and the engine resolved the same mechanism (fingerprints);
  * mu_hat's confidence interval contains S / sigma (false failure <= 2e-7);
  * the empirical epsilon lower bound <= the accountant's epsilon (false failure < 1.3e-7).
Negative controls (the audit can fail): the engine runs with half the noise while the
accountant and the auditor are told the full noise multiplier; the separation check must fail.
With a tenth of the noise the epsilon check fails too.

Sizes: N = 4000 canaries per hypothesis, n_steps <= 16: about 1 s per audit on one core.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from audit_support import DELTA, check_separation, empirical_epsilon_lower_bound, run_audit
from dense import blt_coefs, brute_force_sensitivity_squared, lower_toeplitz
from opake.dpftrl.noise import blt_strategy, identity_strategy

MU = 1.0  # sigma_eff = 1
EPSILON_AT_MU_1 = 4.377178  # docs/math.md section 6 check value, delta = 1e-5

CASES = {
    # name: (strategy, n_steps, min_sep, max_participations, seed)
    "identity_k3": (identity_strategy(), 12, 4, None, 101),
    "blt_single": (blt_strategy(max_buffers=3), 16, 1, 1, 202),
    "blt_multi_k4": (blt_strategy(max_buffers=3), 16, 4, None, 303),
}


def _audit(name: str, engine_factor: float = 1.0):
    strategy, n_steps, min_sep, max_participations, seed = CASES[name]
    sensitivity = strategy.resolve(n_steps, min_sep, max_participations).sensitivity
    sigma = sensitivity / MU
    return run_audit(
        strategy, n_steps=n_steps, min_sep=min_sep, max_participations=max_participations,
        noise_multiplier=sigma, engine_noise_multiplier=engine_factor * sigma, seed=seed,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_audit_matches_the_claimed_gaussian(name):
    strategy, n_steps, min_sep, max_participations, _ = CASES[name]
    run = _audit(name)

    # The canary is the worst case: its ||C u|| is the sensitivity, which brute force confirms.
    mechanism = strategy.resolve(n_steps, min_sep, max_participations)
    matrix = lower_toeplitz(blt_coefs(mechanism.theta, mechanism.omega, n_steps))
    brute = math.sqrt(brute_force_sensitivity_squared(matrix, min_sep, max_participations))
    assert run.pattern_norm == pytest.approx(run.sensitivity, rel=1e-12)
    assert brute == pytest.approx(run.sensitivity, rel=1e-12)
    # Every canary went through the real clipping and was scaled down to the bound.
    assert run.clipped_examples == run.canaries_in
    assert run.fingerprints_match
    assert run.accountant_epsilon == pytest.approx(EPSILON_AT_MU_1, abs=1e-6)

    check = check_separation(run, MU)
    assert check.passed, f"{name}: mu = S/sigma = {MU} outside [{check.low:.4f}, {check.high:.4f}] ({check})"

    epsilon_lb = empirical_epsilon_lower_bound(run)
    assert epsilon_lb <= run.accountant_epsilon, (
        f"{name}: empirical epsilon lower bound {epsilon_lb:.4f} exceeds the accountant's "
        f"{run.accountant_epsilon:.4f} at delta={DELTA}"
    )
    # Power: the attack does detect the canary. At the grid threshold tau ~ 1.30 the true
    # FPR = 0.097, FNR = 0.618; with the Clopper-Pearson margins the expected bound is ~0.98, and
    # it drops below 0.5 only if an empirical rate is off by more than 0.07 (Hoeffding:
    # 2 exp(-2 N 0.07^2) < 1e-16 at N = 4000).
    assert epsilon_lb > 0.5


@pytest.mark.parametrize("name", sorted(CASES))
def test_audit_fails_when_the_engine_adds_half_the_noise(name):
    """Negative control: the accountant is told sigma, the engine uses sigma / 2.

    From the accountant's side this is "the noise scaled by 0.5": T then has std 1/2, so the
    separation in noise std units is 2 mu. The interval for mu = 1 spans about [0.82, 1.15] and
    mu_hat is 2 +- 0.03 (std), so a false pass would need a 25-std deviation.
    """
    run = _audit(name, engine_factor=0.5)
    check = check_separation(run, MU)
    assert not check.passed, f"{name}: the audit missed a 2x under-noised engine ({check})"
    assert check.mu_estimate == pytest.approx(2 * MU, rel=0.1)


def test_epsilon_check_fails_when_the_engine_adds_a_tenth_of_the_noise():
    """The epsilon side of the audit can fail too (its power is lower: about log(N) at most).

    With sigma / 10 the OUT statistic is N(0, 0.01) and IN is N(1, 0.01). At the grid threshold
    tau ~ 0.667 an OUT sample exceeds tau with probability 1.3e-11 (all 4000 stay below it
    except with probability 5e-8) and about 2 IN samples fall below it, so the bound is
    log((1 - 0.01) / 0.0052) ~ 5.2 > 4.377.
    """
    run = _audit("blt_multi_k4", engine_factor=0.1)
    epsilon_lb = empirical_epsilon_lower_bound(run)
    assert epsilon_lb > run.accountant_epsilon, (epsilon_lb, run.accountant_epsilon)


def test_statistic_is_the_canary_projection_by_hand():
    """The identity case by hand: C = I, u = e_0 + e_4 + e_8, T = (y_0 + y_4 + y_8) / (sqrt(3) sigma)."""
    run = _audit("identity_k3")
    # Identity with b = 4, k' = 3: C u = u = e_0 + e_4 + e_8, ||C u|| = sqrt(3) = S.
    assert run.pattern_norm == pytest.approx(math.sqrt(3.0), rel=1e-15)
    # Under H0 the statistic is standard normal: its sample std is 1 within 6 / sqrt(2 N).
    assert np.std(run.statistic_out) == pytest.approx(1.0, abs=6 / math.sqrt(2 * 4000))
