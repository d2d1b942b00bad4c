"""Test-only machinery for the end-to-end privacy test (tests/test_end_to_end_privacy.py).

The test runs the code a user runs: a sampler chooses each step's batch, ``clipped_grad``
clips and sums the per-example gradients, ``mf_gaussian_noise`` adds the correlated noise, and
``opake.dpftrl.accounting.mf_gaussian`` states epsilon(delta). Only the datasets, the test
statistic, the statistics around it and the negative-control sampler live here. Nothing in this
module is imported by the library.

Worlds. An experiment is R independent "worlds" for the dataset D (N examples) and R for its
add/remove neighbour D' = D + x (N + 1 examples, x the last index N). Each world has its own
sampler instance (its own key) and owns one scalar model coordinate: example i of world w has
the per-example gradient ``CANARY_SCALE * sign_i * e_w`` (clipping_norm = 1 scales it to exactly
``sign_i * e_w``; the scale 1024 is a power of two, so the factor is exact). The signs: every
example of D has ``others`` (+1, or 0 for "the others contribute nothing"), x has -1. At each
step the batch is the union over worlds of ``sampler.batch(step)`` (indices mapped to the
world's examples) and goes through the real ``clipped_grad`` and the real noise engine, built
for ``sampler.participation(n_steps)``. Coordinate w of the released gradients depends only on
world w's batches and on the noise of element w, which the engine draws independently of the
other elements, so the R + R coordinates are independent draws of the run's output on D and on
D' (each a post-processing of a full run, to which the run's DP guarantee applies). The worlds
are processed in chunks, each chunk its own engine run with its own key, so the per-example
gradients (batch x chunk) stay small.

The statistic (one fixed function of a world's released sequence y, chosen before the data).
With C the strategy's matrix (the dense oracle of tests/dense.py, not the library's), C y =
C g + sigma z (normalize_by = 1, clip = 1). The sampler serves its bins (batches) cyclically with
period p, so a participating example's pattern is u_j = 1{t = j mod p}. Projecting on C u_j:

    T = max_j  -(<C y, C u_j> - center * <C 1, C u_j>) / (sigma ||C u_j||),

center = others * N / p the expected per-step gradient under D. Large T is evidence for D'
(x pulls one bin down). For the identity strategy this is max_j -(s_j - k * center) /
(sigma sqrt(k)) over the bin sums s_j of k epochs.

The check against the claimed epsilon curve. For the test "say D' when T > tau" the rates are
FPR = P_D(T > tau) and FNR = P_D'(T <= tau). A run that is (eps(delta), delta)-DP for every
delta has 1 - delta - FNR <= exp(eps(delta)) * FPR for every tau and delta. With one-sided
Clopper-Pearson upper bounds FPR_up >= FPR and FNR_up >= FNR (each failing with probability
P_THRESHOLD = 1e-9) on a threshold grid fixed in advance (N_THRESHOLDS = 81 points), a
violation 1 - delta - FNR_up > exp(eps) * FPR_up at any tau and any point (eps, delta) of the
claimed curve (``claimed_curve``: epsilons fixed by the accountant alone, before any data)
refutes the claim; a correct claim shows one with probability at most 2 * 81 * 1e-9 = 1.62e-7
(the curve's points cost nothing: only the 162 binomial bounds are random events).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import integrate, special, stats

import opake.dpftrl.accounting as dpftrl_acc
from audit_support import CANARY_SCALE, P_THRESHOLD
from dense import blt_coefs, lower_toeplitz
from opake.audit import clopper_pearson_upper
from opake.dpftrl.clipping import clipped_grad
from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.participation import Participation
from opake.random import RngKey, key

THRESHOLDS = np.linspace(-2.0, 6.0, 81)           # fixed before any data: tau in steps of 0.1
N_THRESHOLDS = THRESHOLDS.size
SMALLEST_DELTA = 1e-6                              # the claim's points reach down to this delta
CLAIM_POINTS = 80                                 # points (epsilon, delta(epsilon)) of each claimed curve
FALSE_FAILURE = 2 * N_THRESHOLDS * P_THRESHOLD    # per check_claim: 1.62e-7


# ---------------------------------------------------------------------------------------------
# The negative control: the fixed-size sampler opake shipped until the add/remove fix


class LegacyFixedSizeSampler:
    """NEGATIVE CONTROL: the old ``opake.dpftrl.sampling.BMinSepSampler``, copied for the tests.

    Behaviour (as shipped): the examples are put in a random order (from ``key``: SHAKE-256 words
    from ``key.derive_bytes("opake.dpftrl.sampling", ("b_min_sep", num_examples, batch_size, 0),
    ...)``, sorted, exactly the draw of the old code) and cut into ``num_batches = num_examples
    // batch_size`` batches of exactly ``batch_size``; the remaining ``num_examples %
    batch_size`` examples are never used. Step t's batch is batch ``t mod num_batches``, and
    ``participation(n_steps) = Participation(n_steps, min_sep, ceil(n_steps / num_batches))``.

    Why it is wrong under add/remove adjacency: the accountant prices the sensitivity of ONE
    example's contribution, but adding an example x to the dataset changes the random order of
    all of them and, with fixed batch sizes, moves OTHER examples: when num_examples is a
    multiple of batch_size, D + x has the same number of batches, so one example y of D is
    pushed out (or examples change batches). The neighbouring run then differs by "x in, y out",
    twice the sensitivity the accountant prices (a replace-one neighbour, not an add/remove
    one). The end-to-end test must detect this.
    """

    def __init__(self, num_examples: int, batch_size: int, min_sep: int, key: RngKey):
        if not 1 <= batch_size <= num_examples:
            raise ValueError(f"need 1 <= batch_size <= num_examples, got {batch_size}, {num_examples}")
        num_batches = num_examples // batch_size
        if num_batches < min_sep:
            raise ValueError(f"min_sep ({min_sep}) needs {min_sep} batches, got {num_batches}")
        self.num_examples, self.batch_size, self.min_sep = num_examples, batch_size, min_sep
        # The old draw: SHAKE-256 words in chunks of 2**16, chunk c from parts (..., c), sorted.
        words = np.concatenate([np.zeros(0, dtype="<u8")] + [
            np.frombuffer(key.derive_bytes("opake.dpftrl.sampling", ("b_min_sep", num_examples, batch_size, c),
                                           8 * min(1 << 16, num_examples - begin)), dtype="<u8")
            for c, begin in enumerate(range(0, num_examples, 1 << 16))
        ])
        order = np.argsort(words, kind="stable").astype(np.int64)
        self._batches = np.sort(order[: num_batches * batch_size].reshape(num_batches, batch_size), axis=1)

    @property
    def num_batches(self) -> int:
        return self._batches.shape[0]

    def batch(self, step: int) -> torch.Tensor:
        return torch.from_numpy(self._batches[step % self.num_batches].copy())

    def participation(self, n_steps: int) -> Participation:
        return Participation(n_steps, self.min_sep, -(-n_steps // self.num_batches))


# ---------------------------------------------------------------------------------------------
# Running the worlds


@dataclass(frozen=True)
class WorldsRun:
    """Statistic per world for D and D', plus what the run went through."""

    statistic_d: np.ndarray
    statistic_dprime: np.ndarray
    accountant: object             # bound mf_gaussian for the sampler's participation
    participation: Participation
    sensitivity: float
    noise_multiplier: float
    examples_seen: int             # ClipState.examples summed over chunks
    examples_expected: int         # sum of the samplers' batch sizes
    clipped_examples: int          # ClipState.clipped_examples summed over chunks
    nonzero_examples: int          # examples whose gradient is not zero (all are clipped)
    gram: np.ndarray               # <C u_i, C u_j> of the bin patterns (the statistic's geometry)
    seconds: float


def _world_key(seed: int, hypothesis: int, world: int) -> RngKey:
    return key(seed).fold_in("sampler").fold_in(hypothesis).fold_in(world)


def run_worlds(strategy, make_sampler: Callable[[int, RngKey], object], *, num_examples: int,
               n_steps: int, mu: float, others: float, worlds: int = 4000, chunk: int = 200,
               seed: int = 0) -> WorldsRun:
    """Run ``worlds`` worlds on D (N = num_examples) and on D' = D + x; see the module doc.

    ``make_sampler(num_examples, key)`` builds one world's sampler. The noise multiplier is
    S / mu, S the sensitivity of the strategy for the samplers' (common) participation.
    """
    start = time.perf_counter()
    samplers = [[make_sampler(num_examples + h, _world_key(seed, h, w)) for w in range(worlds)]
                for h in (0, 1)]
    participations = {s.participation(n_steps) for group in samplers for s in group}
    assert len(participations) == 1, f"D and D' samplers disagree on the participation: {participations}"
    participation, = participations
    sensitivity = strategy.resolve(participation.n_steps, participation.min_sep,
                                   participation.max_participations).sensitivity
    sigma = sensitivity / mu
    accountant = dpftrl_acc.mf_gaussian(sigma, strategy, participation.n_steps, participation.min_sep,
                                        participation.max_participations)

    mechanism = accountant.mechanism
    matrix = lower_toeplitz(blt_coefs(mechanism.theta, mechanism.omega, n_steps))  # dense oracle
    period = _period(samplers[0][0])
    patterns = np.stack([(np.arange(n_steps) % period == j).astype(np.float64) for j in range(period)])
    directions = patterns @ matrix.T                                   # rows C u_j
    norms = np.linalg.norm(directions, axis=1)
    center = others * num_examples / period
    offsets = center * (directions @ (matrix @ np.ones(n_steps)))      # center <C 1, C u_j>

    statistics = [np.empty(worlds), np.empty(worlds)]
    totals = dict(seen=0, expected=0, clipped=0, nonzero=0)
    for number, first in enumerate(range(0, worlds, chunk)):
        members = range(first, min(first + chunk, worlds))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small ops: one thread is faster, and robust to a loaded machine
        try:
            released, noise_fn = _run_chunk(strategy, samplers, members, participation, sigma, others,
                                            num_examples, key(seed).fold_in("noise").fold_in(number), totals)
        finally:
            torch.set_num_threads(threads)
        noise_fn.check_accounted_by(accountant)   # same mechanism and noise multiplier as priced
        projected = directions @ (matrix @ released)                   # (period, 2 m)
        stat = np.max(-(projected - offsets[:, None]) / (sigma * norms[:, None]), axis=0)
        m = len(members)
        statistics[0][first:first + m] = stat[:m]
        statistics[1][first:first + m] = stat[m:]
    return WorldsRun(
        statistic_d=statistics[0], statistic_dprime=statistics[1], accountant=accountant,
        participation=participation, sensitivity=float(sensitivity), noise_multiplier=sigma,
        examples_seen=totals["seen"], examples_expected=totals["expected"],
        clipped_examples=totals["clipped"], nonzero_examples=totals["nonzero"],
        gram=directions @ directions.T, seconds=time.perf_counter() - start,
    )


def _period(sampler) -> int:
    if isinstance(sampler, LegacyFixedSizeSampler):
        return sampler.num_batches
    return getattr(sampler, "num_bins", None) or sampler.num_groups  # balls in bins, cyclic Poisson


def _run_chunk(strategy, samplers, members, participation, sigma, others, num_examples, noise_key, totals):
    """One engine run over the worlds ``members`` of D (coordinates 0..m-1) and D' (m..2m-1)."""
    m = len(members)
    params = {"w": torch.zeros(2 * m)}

    def loss(params, example):
        coordinate, sign = example
        return CANARY_SCALE * sign * params["w"].index_select(0, coordinate.reshape(1)).sum()

    grad_fn, clip_state = clipped_grad(loss, clipping_norm=1.0, normalize_by=1.0)
    noise_fn, noise_state = mf_gaussian_noise(
        params, strategy, n_steps=participation.n_steps, min_sep=participation.min_sep,
        max_participations=participation.max_participations, noise_multiplier=sigma, key=noise_key,
    )
    released = np.empty((participation.n_steps, 2 * m))
    for step in range(participation.n_steps):
        coordinates, indices = [], []
        for h in (0, 1):
            batches = [samplers[h][world].batch(step).numpy() for world in members]
            sizes = np.array([b.size for b in batches])
            coordinates.append(np.repeat(h * m + np.arange(m), sizes))
            indices.extend(batches)
        coordinates, indices = np.concatenate(coordinates), np.concatenate(indices)
        signs = np.where(indices == num_examples, -1.0, float(others))   # x (index N) exists only in D'
        expected = torch.from_numpy(np.bincount(coordinates, weights=signs, minlength=2 * m)).float()
        totals["expected"] += indices.size
        totals["nonzero"] += int(np.count_nonzero(signs))
        batch = (torch.from_numpy(coordinates), torch.from_numpy(signs).float())
        grads, clip_state = grad_fn(params, batch, state=clip_state)
        # Every world's clipped sum is exactly the signed count of its sampler's batch.
        assert torch.equal(grads.pytree["w"], expected), "clipping did not give each world its batch"
        noisy, noise_state = noise_fn(grads, noise_state)
        released[step] = noisy.pytree["w"].to(torch.float64).numpy()
    totals["seen"] += clip_state.examples
    totals["clipped"] += clip_state.clipped_examples
    return released, noise_fn


# ---------------------------------------------------------------------------------------------
# Checking the claimed epsilon curve


@dataclass(frozen=True)
class ClaimCheck:
    """Outcome of :func:`check_claim`.

    ``margin``: max over (tau, delta) of (1 - delta - FNR_up) - exp(eps(delta)) * FPR_up; a
    violation (the claim refuted) when > 0. ``mu_lower``: max over tau of
    Phi^{-1}(1 - FNR_up) - Phi^{-1}(FPR_up), the largest Gaussian mu the bounds certify (the
    claim is a Gaussian with ``mu_claimed`` = S / sigma). ``mu_point``: the same with the raw
    rates (no confidence margin) at the tau where ``mu_lower`` is reached.
    """

    margin: float
    tau: float
    delta: float
    epsilon: float
    fpr: float
    fnr: float
    fpr_up: float
    fnr_up: float
    mu_lower: float
    mu_point: float
    mu_claimed: float

    @property
    def violated(self) -> bool:
        return self.margin > 0.0

    def __str__(self) -> str:
        return (f"margin {self.margin:+.4f} at tau={self.tau:.1f}, delta={self.delta:.3g} "
                f"(eps={self.epsilon:.3f}; FPR {self.fpr:.4f} <= {self.fpr_up:.4f}, FNR {self.fnr:.4f} <= "
                f"{self.fnr_up:.4f}); mu certified >= {self.mu_lower:.3f}, point {self.mu_point:.3f}, "
                f"claimed {self.mu_claimed:.3f}")


_CLAIMED: dict[int, tuple[object, np.ndarray, np.ndarray]] = {}


def claimed_curve(accountant) -> tuple[np.ndarray, np.ndarray]:
    """(deltas, epsilons): CLAIM_POINTS points (epsilon, accountant.delta_at(epsilon)) of the
    accountant's privacy curve, epsilon evenly spaced up to epsilon_at(SMALLEST_DELTA). Each point
    is a guarantee the accountant states (delta_at is the bound its epsilon_at inverts), so the audit
    tests the same curve as at fixed deltas, with one inversion instead of one per point (the
    random-allocation PLD inverts in ~0.25 s, evaluates in ~0.01 s). Computed once per accountant
    object (held here, so its id stays its own): a positive run and its negative control are
    audited against one claim."""
    if id(accountant) not in _CLAIMED:
        top = accountant.epsilon_at(SMALLEST_DELTA)
        epsilons = np.linspace(top / CLAIM_POINTS, top, CLAIM_POINTS)
        deltas = np.array([accountant.delta_at(float(e)) for e in epsilons])
        _CLAIMED[id(accountant)] = (accountant, deltas, epsilons)
    return _CLAIMED[id(accountant)][1:]


def check_claim(run: WorldsRun) -> ClaimCheck:
    """Compare the empirical tradeoff of T with the accountant's epsilon(delta) (module doc)."""
    x_d, x_dp = run.statistic_d, run.statistic_dprime
    deltas, epsilons = claimed_curve(run.accountant)
    best = None
    mu_lower = mu_point = -math.inf
    for tau in THRESHOLDS:
        false_pos = int(np.count_nonzero(x_d > tau))
        false_neg = int(np.count_nonzero(x_dp <= tau))
        fpr, fnr = false_pos / x_d.size, false_neg / x_dp.size
        fpr_up = clopper_pearson_upper(false_pos, x_d.size, P_THRESHOLD)
        fnr_up = clopper_pearson_upper(false_neg, x_dp.size, P_THRESHOLD)
        margins = (1.0 - deltas - fnr_up) - np.exp(epsilons) * fpr_up
        i = int(np.argmax(margins))
        if best is None or margins[i] > best[0]:
            best = (float(margins[i]), float(tau), float(deltas[i]), float(epsilons[i]), fpr, fnr, fpr_up, fnr_up)
        certified = float(special.ndtri(1.0 - fnr_up) - special.ndtri(fpr_up))
        if certified > mu_lower:
            mu_lower = certified
            mu_point = float(special.ndtri(1.0 - fnr) - special.ndtri(fpr))
    return ClaimCheck(*best, mu_lower=mu_lower, mu_point=mu_point,
                      mu_claimed=run.sensitivity / run.noise_multiplier)


# ---------------------------------------------------------------------------------------------
# Analytic expectations (for the power statements and the sanity checks of the tests)


def model_rates(run: WorldsRun, *, shift: float, moved: float, thresholds=THRESHOLDS):
    """(FPR, FNR) of T at each threshold when D's gradient is deterministic (center * 1).

    Holds for the legacy sampler on a dataset of batch-size multiples (every batch sums to
    exactly batch_size) and for one bin (every example at every step). Then under D the
    components T_j are jointly N(0, R), R the correlation of the directions C u_j, and under D'
    with probability ``moved`` the gradient is center * 1 - shift * u_j for a uniform bin j
    (T has mean shift * gram[j] / (sigma * ||C u_j||) componentwise), otherwise as under D.
    Legacy: shift 2 ("x in, y out"), moved N / (N + 1) (x is the unused example with
    probability 1 / (N + 1)). One bin of balls-in-bins: shift 1, moved 1. Periods 1 and 2 only.
    """
    norms = np.sqrt(np.diag(run.gram))
    period = norms.size
    if period > 2:
        raise NotImplementedError("model_rates handles one or two bins")
    correlation = run.gram / np.outer(norms, norms)
    means = [shift * run.gram[j] / (run.noise_multiplier * norms) for j in range(period)]
    cdf = (lambda point: float(special.ndtr(point[0]))) if period == 1 else \
        (lambda point: _bivariate_cdf(point, float(correlation[0, 1])))
    fpr, fnr = [], []
    for tau in thresholds:
        below_d = cdf(np.full(period, tau))
        below_moved = np.mean([cdf(tau - mean) for mean in means])
        fpr.append(1.0 - below_d)
        fnr.append(moved * below_moved + (1.0 - moved) * below_d)
    return np.array(fpr), np.array(fnr)


def _bivariate_cdf(point, rho: float) -> float:
    """P(Z_0 <= a, Z_1 <= b) for standard normals with correlation rho (one quadrature)."""
    a, b = float(point[0]), float(point[1])
    scale = math.sqrt(1.0 - rho * rho)
    value, _ = integrate.quad(lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
                              * special.ndtr((b - rho * z) / scale), -np.inf, a, epsabs=1e-13, epsrel=1e-11)
    return value


def miss_probability(fpr: float, fnr: float, worlds: int, detects) -> float:
    """Upper bound on P(the empirical counts at one threshold do NOT satisfy ``detects``).

    ``detects(fpr_up, fnr_up)`` (vectorized, monotone: true stays true when either bound
    decreases) is the event a test relies on, evaluated on the Clopper-Pearson bounds of the
    counts. With FP ~ Bin(worlds, fpr) and FN ~ Bin(worlds, fnr): for every a, detection holds
    whenever FP <= a and FN <= b(a) (b(a) the largest count still detected), so
    P(miss) <= min_a P(FP > a) + P(FN > b(a)); exact binomial tails, no approximation.
    """
    counts = np.arange(worlds + 1)
    upper = clopper_pearson_upper(counts, worlds, P_THRESHOLD)
    best = 1.0
    for a in counts:
        ok = detects(upper[a], upper)                     # over all FN counts b
        if not ok[0]:
            continue
        b = int(np.flatnonzero(ok)[-1])
        best = min(best, float(stats.binom.sf(a, worlds, fpr) + stats.binom.sf(b, worlds, fnr)))
    return best
