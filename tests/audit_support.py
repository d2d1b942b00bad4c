"""Test-only machinery for the empirical privacy audit (tests/test_empirical_audit.py).

The audit attacks the code that runs: canary gradients go through opake's real clipping
(``clipped_grad``) and the real noise engine (``mf_gaussian_noise``); the test statistic and its
separation check live here, the epsilon lower bound is the library's (``opake.audit``). Nothing
in this module is imported by the library.

Why the coordinates of one run are independent audit runs. The engine adds, to every element
j of the gradient vector, sigma * clip / norm * (C^{-1} z^{(j)}) with z^{(j)} ~ N(0, I_n)
independent over elements (the engine's contract, checked by dpftrl/noise/engine/test_statistics.py). We build
a model of d = 2N scalar parameters and 2N canaries: canary j is a training example whose
per-example gradient is 1024 * e_j (so clipping scales it to exactly e_j, norm 1 = the clip
bound over the whole vector). Canaries 0..N-1 are IN the dataset (they participate on the
worst-case steps u = {0, b, ..., (k'-1) b}); canaries N..2N-1 are OUT. Coordinate j of the
released sequence depends only on canary j and on the noise of element j, so the 2N
coordinates are N i.i.d. draws of the mechanism's output "with the canary" and N i.i.d. draws
"without it", each a post-processing of the full run (whose DP guarantee therefore applies to
it). One engine run thus gives N samples per hypothesis for the price of one d-vector per step.

The statistic (Neyman-Pearson for two Gaussians). With y the released n-step sequence of one
coordinate, C y = C g + sigma * z' (z' ~ N(0, I_n)), and g = u (IN) or 0 (OUT). Projecting on
C u: T = <C y, C u> / (||C u|| * sigma) ~ N(||C u|| / sigma, 1) or N(0, 1), so the separation
in units of the noise std is mu = ||C u|| / sigma = S / sigma = 1 / sigma_eff.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

import opake.dpftrl.accounting as dpftrl_acc
from dense import blt_coefs, lower_toeplitz
from opake.audit.many_runs import clopper_pearson_upper as _clopper_pearson_upper  # noqa: F401 (shared)
from opake.audit.many_runs import epsilon_lower_bound
from opake.dpftrl.clipping import clipped_grad
from opake.dpftrl.noise import mf_gaussian_noise
from opake.random import key

CANARY_SCALE = 1024.0  # a power of two: the clipping factor 1/1024 is exact, so clipped = e_j
DELTA = 1e-5
# False-failure budgets (each test's total stays below 1e-6, see check_separation / eps bound).
P_MEAN = 1e-7      # |mean difference - mu s| beyond z s sqrt(2/N)
P_VARIANCE = 1e-7  # pooled variance outside its chi-square interval
P_THRESHOLD = 1e-9  # each one-sided Clopper-Pearson bound, 2 per threshold
N_THRESHOLDS = 64


@dataclass(frozen=True)
class AuditRun:
    """Raw output of one audit: T for the IN and OUT coordinates, and the context."""

    statistic_in: np.ndarray
    statistic_out: np.ndarray
    sensitivity: float             # S of the resolved mechanism
    pattern_norm: float            # ||C u|| for the canary's pattern (should equal S)
    claimed_noise_multiplier: float
    engine_noise_multiplier: float
    clipped_examples: int
    canaries_in: int
    accountant_epsilon: float
    fingerprints_match: bool


def worst_case_pattern(n_steps: int, min_sep: int, kprime: int) -> np.ndarray:
    """Indicator of {0, b, 2b, ..., (k'-1) b} (the worst pattern of BSR24 Thm 2)."""
    u = np.zeros(n_steps)
    u[[m * min_sep for m in range(kprime) if m * min_sep < n_steps]] = 1.0
    return u


def run_audit(strategy, *, n_steps: int, min_sep: int, max_participations, noise_multiplier: float,
              engine_noise_multiplier: float | None = None, runs_per_hypothesis: int = 4000,
              seed: int = 0) -> AuditRun:
    """One engine run with N canaries IN and N OUT; returns the per-coordinate statistic.

    ``noise_multiplier`` is what the accountant is told (and what the auditor assumes);
    ``engine_noise_multiplier`` (default: the same) is what the noise engine really uses, so
    ``0.5 * noise_multiplier`` is the under-noised negative control.
    """
    engine_sigma = noise_multiplier if engine_noise_multiplier is None else engine_noise_multiplier
    accountant = dpftrl_acc.mf_gaussian(noise_multiplier, strategy, n_steps, min_sep, max_participations)
    mechanism = accountant.mechanism
    kprime = mechanism.participation.effective_participations
    coefs = blt_coefs(mechanism.theta, mechanism.omega, n_steps)  # dense oracle, not the library
    matrix = lower_toeplitz(coefs)
    pattern = worst_case_pattern(n_steps, min_sep, kprime)
    direction = matrix @ pattern                                  # C u
    pattern_norm = float(np.linalg.norm(direction))

    count = runs_per_hypothesis
    params = {"w": torch.zeros(2 * count)}

    def canary_loss(params, index):
        return CANARY_SCALE * params["w"].index_select(0, index.reshape(1)).sum()  # 1024 e_index

    grad_fn, clip_state = clipped_grad(canary_loss, clipping_norm=1.0)
    noise_fn, noise_state = mf_gaussian_noise(
        params, strategy, n_steps=n_steps, min_sep=min_sep, max_participations=max_participations,
        noise_multiplier=engine_sigma, key=key(seed),
    )
    canaries_in = torch.arange(count)
    nobody = torch.zeros(0, dtype=torch.long)
    released = np.empty((n_steps, 2 * count))
    for step in range(n_steps):
        batch = canaries_in if pattern[step] else nobody
        grads, clip_state = grad_fn(params, batch, state=clip_state)
        if pattern[step]:
            expected = torch.zeros(2 * count)
            expected[:count] = 1.0
            assert torch.equal(grads.pytree["w"], expected), "clipping did not give exactly e_j"
        noisy, noise_state = noise_fn(grads, noise_state)
        released[step] = noisy.pytree["w"].to(torch.float64).numpy()

    # T = <C y, C u> / (||C u|| sigma_claimed), clip = normalization = 1.
    statistic = direction @ (matrix @ released) / (pattern_norm * noise_multiplier)
    return AuditRun(
        statistic_in=statistic[:count], statistic_out=statistic[count:],
        sensitivity=float(mechanism.sensitivity), pattern_norm=pattern_norm,
        claimed_noise_multiplier=noise_multiplier, engine_noise_multiplier=engine_sigma,
        clipped_examples=clip_state.clipped_examples, canaries_in=count * kprime,
        accountant_epsilon=accountant.epsilon_at(DELTA),
        fingerprints_match=noise_fn.mechanism.fingerprint == mechanism.fingerprint,
    )


@dataclass(frozen=True)
class SeparationCheck:
    mu_expected: float
    mu_estimate: float
    low: float
    high: float

    @property
    def passed(self) -> bool:
        return self.low <= self.mu_expected <= self.high


def check_separation(run: AuditRun, mu_expected: float) -> SeparationCheck:
    """Is the separation mu_hat = (mean_in - mean_out) / pooled_std consistent with mu_expected?

    Exact confidence interval, no normal approximation of mu_hat. If the statistic is Gaussian
    with a common std s in both groups and mean difference mu s (what the claim says), then
    (a) D = mean_in - mean_out ~ N(mu s, 2 s^2 / N), so |D / s - mu| <= z sqrt(2 / N) fails with
    probability P_MEAN (z the normal quantile), and (b) (2N - 2) s_p^2 / s^2 ~ chi2(2N - 2), so
    s_p / s lies in [sqrt(q_lo / dof), sqrt(q_hi / dof)] except with probability P_VARIANCE.
    On both events, mu is in [mu_hat r_lo - z sqrt(2/N), mu_hat r_hi + z sqrt(2/N)] (ends swapped
    for a negative mu_hat). False failure <= P_MEAN + P_VARIANCE = 2e-7. The claim fails both
    when the mean shift is wrong and when the noise std is wrong (the under-noised control).
    """
    x_in, x_out = run.statistic_in, run.statistic_out
    count = x_in.shape[0]
    dof = 2 * count - 2
    pooled = math.sqrt(((count - 1) * x_in.var(ddof=1) + (count - 1) * x_out.var(ddof=1)) / dof)
    estimate = (x_in.mean() - x_out.mean()) / pooled
    z = stats.norm.isf(P_MEAN / 2)
    r_lo = math.sqrt(stats.chi2.ppf(P_VARIANCE / 2, dof) / dof)
    r_hi = math.sqrt(stats.chi2.isf(P_VARIANCE / 2, dof) / dof)
    ends = sorted((estimate * r_lo, estimate * r_hi))
    half = z * math.sqrt(2.0 / count)
    return SeparationCheck(mu_expected, float(estimate), ends[0] - half, ends[1] + half)


def empirical_epsilon_lower_bound(run: AuditRun, delta: float = DELTA) -> float:
    """max over a fixed threshold grid of log((1 - delta - FNR_up) / FPR_up) (>= 0).

    The test "reject OUT when T > tau" has FPR = P_out(T > tau) and FNR = P_in(T <= tau); the
    bound is ``opake.audit.epsilon_lower_bound`` (Clopper-Pearson, see opake/audit/many_runs.py)
    on the grid of N_THRESHOLDS points fixed before seeing data from the expected mu, at
    P_THRESHOLD per one-sided bound: the chance that the bound exceeds the true epsilon is
    <= 2 * 64 * 1e-9 < 1.3e-7.
    """
    mu = run.pattern_norm / run.claimed_noise_multiplier
    thresholds = np.linspace(-2.0, mu + 5.0, N_THRESHOLDS)
    return epsilon_lower_bound(run.statistic_in, run.statistic_out, delta=delta,
                               significance=2 * N_THRESHOLDS * P_THRESHOLD, thresholds=thresholds).epsilon
