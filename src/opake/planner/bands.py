"""How many bands BandMF should use under cyclic Poisson sampling, and the calibrations behind it.

A run of ``num_examples`` examples, ``batch_size`` per step (expected) and ``epochs`` epochs
(``DatasetRun``) can run BandMF with b bands on b Poisson-sampled groups (Band23 Thm 4): more
bands spread the noise's correlation further but raise the sample rate b times and divide the
compositions by b. ``cyclic_poisson_bands`` finds the count with the least prefix-sum error at a
budget; ``band_candidates`` and ``refine_band_candidate`` expose the same calibrations for
the choice, which ranks the candidates on the optimizer's workload (``opake.planner.choice``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opake.accounting import calibrate_near, epsilon_budget
from opake.dpftrl.accounting.factorized_gaussian import mf_gaussian
from opake.dpftrl.accounting.poisson import banded_column_norm, noise_multiplier_guess, poisson
from opake.dpftrl.strategies.band_mf import band_mf_strategy
from opake.dpftrl.strategies.strategy import identity_strategy
from opake.errors import InvalidArgumentError
from opake.planner.constants import (CHOICE_DISCRETIZATION, CHOICE_RTOL, EPSILON_RTOL, PLD_DISCRETIZATION,
                                     POISSON_SIGMA_RANGE, RTOL)
from opake.planner.runs import DatasetRun
from opake.progress import Progress, calibration_reporter

__all__ = ["BandCandidate", "band_candidates", "coarse_band_candidate", "cyclic_poisson_bands", "falling_log_slope",
           "prefix_rmse", "refine_band_candidate"]

_ERRORS = ("max", "mean")


def cyclic_poisson_bands(
    num_examples: int,
    batch_size: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    error: str = "max",
    progress: bool | Progress | None = None,
) -> int:
    """Number of bands for BandMF under cyclic Poisson sampling (Band23 Thm 4) for this run.

    Rule. With num_bins = num_examples // batch_size and n_steps = epochs * num_bins, the
    candidates are b in {1, 2, 4, 8, ...} with b <= max(1, num_bins // 2). Candidate b runs
    ``CyclicPoissonSampler(num_examples, num_groups=b, sample_rate=q)`` with
    q = batch_size * b / num_examples (expected batch size batch_size) and strategy
    ``identity_strategy()`` for b = 1 (DP-SGD with Poisson sampling) or
    ``band_mf_strategy(bands=b, error=error)``. Its noise multiplier sigma_b is calibrated to
    (epsilon, delta) over ``poisson(mf_gaussian(sigma, strategy), q, n_steps)``, and its RMSE is
    sigma_b * sqrt(max_t e_t) (``error="max"``) or sigma_b * sqrt(mean_t e_t) (``"mean"``) of the
    noise's prefix sums. The candidates are tried in increasing b until one's RMSE exceeds the
    smallest so far; the returned b has the smallest RMSE seen; ties go to fewer bands.

    More bands spread the noise's correlation further but raise q (b times) and divide the
    compositions by b, so amplification weakens: the choice is the trade-off between the two,
    and the RMSE falls and then rises with b (stopping at the first rise skips the largest
    candidates, whose strategies take the longest to optimize).

    Speed: the ranking uses a PLD grid of ``CHOICE_DISCRETIZATION`` (1e-2, coarser than
    ``poisson``'s default 1e-4) and a relative tolerance of 1e-3 on sigma (or on epsilon); the
    chosen strategy is calibrated again on the rows' grid by ``plan_dataset``.
    """
    run = DatasetRun(num_examples, batch_size, epochs)
    progress = Progress.of(progress)
    try:
        return _best(_band_candidates(run, epsilon_budget(epsilon, delta), check_error(error), progress))[0]
    finally:
        progress.close()


@dataclass(frozen=True)
class BandCandidate:
    """One band count ``cyclic_poisson_bands``'s rule tried: ``bands`` groups (1: DP-SGD with
    Poisson sampling), the served group's ``sample_rate``, the ``noise_multiplier`` meeting the
    budget on the coarse ``CHOICE_DISCRETIZATION`` grid (a ranking value and a starting point,
    not a running one: ``refine_band_candidate`` prices it on the rows' grid), its prefix-sum
    ``rmse``, and the (sigma, epsilon) ``evaluations`` of that calibration."""

    bands: int
    strategy: object
    sample_rate: float
    noise_multiplier: float
    rmse: float
    evaluations: tuple


def band_candidates(
    num_examples: int,
    batch_size: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    error: str = "max",
    max_bands: int | None = None,
    steps: int | None = None,
    progress: bool | Progress | None = None,
) -> tuple:
    """The candidates of ``cyclic_poisson_bands`` (same rule, same order) as ``BandCandidate`` rows,
    for callers that rank them on another error (``opake.planner.choice``); ``max_bands`` stops the
    search there (a cap on the noise state, ``bands - 1`` floats per parameter); ``steps`` cuts the
    run at that horizon (``DatasetRun``)."""
    run = DatasetRun(num_examples, batch_size, epochs, steps)
    progress = Progress.of(progress)
    try:
        candidates = _band_candidates(run, epsilon_budget(epsilon, delta), check_error(error), progress, max_bands)
    finally:
        progress.close()
    return tuple(
        BandCandidate(bands, identity_strategy() if bands == 1 else band_mf_strategy(bands=bands, error=error),
                      run.batch_size * bands / run.num_examples, sigma, rmse, points)
        for bands, sigma, rmse, points in candidates
    )


def refine_band_candidate(candidate: BandCandidate, n_steps: int, epsilon: float, delta: float, *,
                          progress: bool | Progress | None = None):
    """``candidate`` calibrated on the rows' grid (``PLD_DISCRETIZATION``), as ``plan_dataset``'s
    BandMF and Poisson DP-SGD rows are: a ``CalibrationResult`` (1 to 3 evaluations)."""
    progress = Progress.of(progress)
    try:
        return _refined(epsilon_budget(epsilon, delta), candidate.strategy, candidate.sample_rate, n_steps,
                        candidate.noise_multiplier, candidate.evaluations, progress)
    finally:
        progress.close()


def _band_candidates(run: DatasetRun, budget, error: str, progress: Progress, max_bands: int | None = None) -> list:
    """(bands, noise multiplier, RMSE, coarse evaluations) of the candidates ``cyclic_poisson_bands``'s
    rule tries (the evaluations: the (sigma, epsilon) pairs its calibration evaluated).

    In increasing bands, up to the first whose RMSE exceeds the smallest so far. The noise
    multipliers are calibrated on the coarse ``CHOICE_DISCRETIZATION`` grid: good for ranking
    and as starting points, not for running (``_refined`` recalibrates the chosen one).
    """
    candidates = []
    effective = []  # the candidates' calibrated sigma / column norm (Band23 Thm 4's sigma_eff)
    bands, correction, slope = 1, 1.0, None
    while bands <= max(1, run.num_bins // 2) and (max_bands is None or bands <= max_bands):
        strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands=bands, error=error)
        sigma, evaluated, mech, norm, guess = _coarse_calibration(
            run, budget, bands, strategy, progress, slope=slope,
            start=lambda guess, norm: _start(guess * correction, effective, norm))
        # The central-limit guess errs smoothly in the bands, so the last candidate's ratio of
        # answer to guess corrects it, and the last candidate's local slope starts the search.
        correction, slope = sigma / guess, _local_slope(evaluated, budget.epsilon) or slope
        effective.append(sigma / norm)
        rmse = prefix_rmse(sigma, mech, error)
        candidates.append((bands, sigma, rmse, evaluated))
        if rmse > min(candidate[2] for candidate in candidates):
            break  # the error has turned upward: more bands only weaken the amplification further
        bands *= 2
    return candidates


def coarse_band_candidate(num_examples: int, batch_size: int, epochs: int, epsilon: float, delta: float,
                          strategy, *, steps: int | None = None,
                          progress: bool | Progress | None = None) -> BandCandidate:
    """A given banded ``strategy`` (its ``bands`` groups) calibrated on the coarse grid, as each of
    ``band_candidates``'s rows is (``rmse`` not computed: NaN); ``steps`` as for ``band_candidates``."""
    run = DatasetRun(num_examples, batch_size, epochs, steps)
    bands = int(strategy.bands)
    if batch_size * bands > num_examples:
        raise InvalidArgumentError(f"{bands} bands with batch_size={batch_size} need a sample rate "
                                   f"{batch_size * bands}/{num_examples} > 1; use at most {run.num_bins} bands")
    progress = Progress.of(progress)
    try:
        sigma, evaluated, *_ = _coarse_calibration(run, epsilon_budget(epsilon, delta), bands, strategy, progress)
    finally:
        progress.close()
    return BandCandidate(bands, strategy, batch_size * bands / num_examples, sigma, math.nan, evaluated)


def _coarse_calibration(run: DatasetRun, budget, bands: int, strategy, progress: Progress, *, slope=None,
                        start=None) -> tuple:
    """``strategy`` on ``bands`` cyclic Poisson groups calibrated on the coarse grid, from the
    central-limit guess (or ``start(guess, column norm)``): (sigma, its (sigma, epsilon)
    evaluations, the mechanism, its column norm, the guess)."""
    rate = run.batch_size * bands / run.num_examples
    compositions = -(-run.n_steps // bands)
    evaluated = []
    with progress.stage(f"choosing the bands: {bands} band(s)"):
        mech = strategy.resolve(run.n_steps, bands, compositions)
        norm = banded_column_norm(mech)
        guess = noise_multiplier_guess(rate, compositions, norm, budget)
        result = calibrate_near(
            budget, lambda sigma: poisson(mf_gaussian(sigma, strategy), rate, run.n_steps,
                                          value_discretization_interval=CHOICE_DISCRETIZATION),
            guess if start is None else start(guess, norm), *POISSON_SIGMA_RANGE, rtol=CHOICE_RTOL,
            epsilon_rtol=CHOICE_RTOL, slope=slope,
            on_evaluation=lambda sigma, epsilon: evaluated.append((sigma, epsilon)))
    return result.param, tuple(evaluated), mech, norm, guess


def _start(corrected_guess: float, effective: list, norm: float) -> float:
    """Where the next candidate's calibration starts (any start gives the same bound; a near one
    saves PLD evaluations).

    From the third candidate on, the calibrated sigma_eff of the last three extrapolated one
    doubling further in log-log (a quadratic: its growth per doubling rises steadily, 1.07 to
    1.31 in the plans measured, where this start is within about 1% and the corrected
    central-limit guess 3% to 10% off), times the new band's column norm; before, the corrected
    guess. The curvature factor is clipped to [0.8, 1.25], so an odd step cannot throw it far.
    """
    if len(effective) < 3:
        return corrected_guess
    growth, before = effective[-1] / effective[-2], effective[-2] / effective[-3]
    return norm * effective[-1] * growth * min(max(growth / before, 0.8), 1.25)


def _local_slope(evaluated: list, target: float) -> float | None:
    """d ln epsilon / d ln sigma between the two evaluations nearest the target (None if not falling)."""
    usable = [(s, e) for s, e in evaluated if 0.0 < e < math.inf]
    if len(usable) < 2:
        return None
    (s1, e1), (s2, e2) = sorted(usable, key=lambda point: abs(math.log(point[1] / target)))[:2]
    return falling_log_slope(s1, e1, s2, e2)


def falling_log_slope(sigma_a: float, epsilon_a: float, sigma_b: float, epsilon_b: float) -> float | None:
    """d ln epsilon / d ln sigma through two evaluations: the first step of a calibration near
    them. None unless both epsilons are finite and positive, the sigmas differ and it falls."""
    if sigma_a == sigma_b or not (0.0 < epsilon_a < math.inf and 0.0 < epsilon_b < math.inf):
        return None
    slope = (math.log(epsilon_a) - math.log(epsilon_b)) / (math.log(sigma_a) - math.log(sigma_b))
    return slope if math.isfinite(slope) and slope < 0.0 else None


def _best(candidates: list) -> tuple:
    """The candidate with the smallest RMSE; ties go to fewer bands (candidates are in increasing bands)."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate[2] < best[2]:
            best = candidate
    return best


def _refined(budget, strategy, sample_rate: float, n_steps: int, coarse_sigma: float, coarse_points: tuple,
             progress: Progress):
    """Calibrate on the rows' PLD grid, starting from a noise multiplier found on the coarser one.

    ``coarse_points`` are the (sigma, epsilon) pairs the candidate's coarse calibration evaluated
    (``coarse_sigma`` among them). The coarse grid's sigmas are 0.02% to 3% higher. The search
    starts there and takes its first step along the coarse curve's slope (d ln epsilon / d ln
    sigma; the PLD curves are 1.4 to 4 times steeper than epsilon ~ 1/sigma), so it needs 1 to 3
    row-grid evaluations, not ~15. The slope is the secant to the evaluated point nearest
    ``coarse_sigma`` between 0.5% and 5% away, else over the 1% below (one more cheap coarse
    evaluation): nearer points are too close for the coarse grid's steps in epsilon.
    """
    def on_grid(interval):
        return lambda sigma: poisson(mf_gaussian(sigma, strategy), sample_rate, n_steps,
                                     value_discretization_interval=interval)

    here = dict(coarse_points)[coarse_sigma]
    spaced = [(abs(math.log(sigma / coarse_sigma)), sigma, epsilon) for sigma, epsilon in coarse_points
              if 0.005 <= abs(math.log(sigma / coarse_sigma)) <= 0.05 and 0.0 < epsilon < math.inf]
    if spaced:
        _, other, other_epsilon = min(spaced)
    else:
        other = coarse_sigma * math.exp(-0.01)
        other_epsilon = on_grid(CHOICE_DISCRETIZATION)(other).epsilon_at(budget.delta)
    slope = falling_log_slope(other, other_epsilon, coarse_sigma, here)
    return calibrate_near(budget, on_grid(PLD_DISCRETIZATION), coarse_sigma, *POISSON_SIGMA_RANGE, spread=1.1,
                          rtol=RTOL, epsilon_rtol=EPSILON_RTOL, slope=slope,
                          on_evaluation=calibration_reporter(progress, budget.epsilon))


def prefix_rmse(sigma: float, mech, error: str) -> float:
    """sigma * sqrt(max_t e_t) (or the mean): the noise's prefix-sum RMSE, clip norm 1."""
    loss = mech.max_loss if error == "max" else mech.mean_loss
    return sigma * math.sqrt(loss) / mech.sensitivity


def check_error(error) -> str:
    if error not in _ERRORS:
        raise InvalidArgumentError(f"error must be one of {_ERRORS} (the prefix-sum error to minimize), got {error!r}")
    return error
