"""Plan a run: resolve strategies for a participation context and calibrate them to a budget.

``plan_run`` (a participation context): for each strategy the noise multiplier is the smallest
one meeting (epsilon, delta) for the context, without amplification (``mf_gaussian``: one
Gaussian with noise multiplier sigma / S).

``plan_dataset`` (a data set, a batch size and a number of epochs): each strategy with the
sampler it is run with and the accountant that prices that sampler, amplified where an
amplified bound exists (balls-in-bins RDP for BLT, Band23 Thm 4 PLD for BandMF and Poisson
DP-SGD), with the unamplified rows kept for reference. The BLT's amplified bound prices the
aligned dominating pair, which is not proven for adaptively chosen gradients when bins interact
(docs/adaptivity.md): its row says so, in place of ``balls_in_bins``'s warning (not emitted here).

Time: planning a million examples takes seconds, not minutes: the amplified bound (0.05 to
0.3 s per evaluation at these sizes) is calibrated from the unamplified noise multiplier
(``calibrate_capped``, 1 to 5 evaluations), the bands are ranked on a coarse PLD grid and the
search over them stops once the error rises, the chosen band and Poisson DP-SGD start their
row-grid calibration from the ranking's noise multiplier and epsilon, and the PLD rows are
priced on a 1e-3 grid. What remains is mostly the BandMF candidates' resolutions (L-BFGS, about
half of a plan at 50,000 examples and 20 epochs) and their coarse PLDs
(``benchmarks/accounting.py --only plan`` prints the times). Every returned noise multiplier
is an exact evaluation of its row's bound, with epsilon within 0.1% of the target (or the
noise multiplier within 0.01% of the smallest one that meets it). ``progress`` (None: on when
stderr is a terminal) reports each stage on stderr (``opake.progress``).

Error: with clipping norm 1, the error of step t's prefix sum of the noise has standard
deviation sigma * sqrt(e_t), e_t the squared norm of row t of A C^{-1} (A the prefix sums), so
the tables' RMSE values are sigma * sqrt(max_t e_t) and sigma * sqrt(mean_t e_t); strategies
are compared at equal privacy. This is the noise alone, before dividing by the batch size;
the extra variance of a Poisson batch size is not counted.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

from opake.accounting import calibrate, calibrate_near, epsilon_budget
from opake.accounting.calibrate import calibrate_capped
from opake.dpftrl.accounting import UnprovenAmplificationWarning, balls_in_bins, mf_gaussian, poisson
from opake.dpftrl.accounting.poisson import banded_column_norm, noise_multiplier_guess
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.participation import Participation
from opake.progress import Progress, calibration_reporter

_FLOAT32_BYTES = 4
_ERRORS = ("max", "mean")

# PLD grids. The pessimistic discretization rounds privacy losses up, so every grid gives an
# upper bound; a coarser one is looser and faster. The rows are priced on PLD_DISCRETIZATION:
# its epsilons exceed those of poisson()'s default grid (1e-4) by about 2e-4 relative at epsilon
# 3 (sigma about 1e-4 higher), and each evaluation is about 8x faster (a million examples: 0.2 s
# instead of 1.6 s for Poisson DP-SGD). The bands are *chosen* on CHOICE_DISCRETIZATION, another
# 6x faster: its sigmas are 0.02% (many bands) to 3% (DP-SGD over 15,000 steps) higher, well
# below the gaps between the candidates that compete (the chosen one is then priced on the row grid).
PLD_DISCRETIZATION = 1e-3
CHOICE_DISCRETIZATION = 1e-2
_CHOICE_RTOL = 1e-3
# Rows: a parameter within 0.01% of the smallest meeting the budget, or epsilon within 0.1% of the
# target (calibrate_capped's defaults, with which make_private calibrates the amplified bound).
_RTOL = 1e-4
_EPSILON_RTOL = 1e-3
_SIGMA_RANGE = (1e-2, 1e4)
# make_private's range for balls in bins (its unamplified calibration is the amplified one's cap):
# the same range, so that plan_dataset's "BLT amplified" row is make_private's noise multiplier.
_BINS_SIGMA_RANGE = (1e-3, 1e4)


@dataclass(frozen=True)
class PlanRow:
    """One strategy at the plan's (epsilon, delta).

    ``sampling`` and ``accounting`` say, in words, which batches the row assumes and how they
    were priced (``plan_dataset``; empty for ``plan_run``, whose context fixes both);
    ``process`` is the calibrated privacy process (None for ``plan_run``).
    """

    name: str
    strategy: object
    mechanism: object
    noise_multiplier: float
    epsilon: float
    delta: float
    rmse_max: float
    rmse_mean: float
    state_bytes_per_parameter: int
    sampling: str = ""
    accounting: str = ""
    process: object = None


@dataclass(frozen=True)
class DatasetRun:
    """Training on ``num_examples`` examples, ``batch_size`` per step (expected), for ``epochs``.

    Derived: ``num_bins = num_examples // batch_size`` steps per epoch (the balls-in-bins bins),
    ``n_steps = epochs * num_bins``, ``sample_rate = batch_size / num_examples`` (Poisson DP-SGD).
    """

    num_examples: int
    batch_size: int
    epochs: int

    def __post_init__(self):
        for name in ("num_examples", "batch_size", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be <= num_examples ({self.num_examples}): a step "
                f"cannot use more examples than the data set holds; lower the batch size"
            )

    @property
    def num_bins(self) -> int:
        return self.num_examples // self.batch_size

    @property
    def n_steps(self) -> int:
        return self.epochs * self.num_bins

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.num_examples


@dataclass(frozen=True)
class Plan:
    """Rows calibrated to (epsilon, delta). ``participation`` is the planned context (for
    ``plan_dataset``, the balls-in-bins one: min_sep = steps per epoch, max_participations =
    epochs; each row's own is ``row.mechanism.participation``); ``dataset`` is None for
    ``plan_run``."""

    participation: Participation
    epsilon: float
    delta: float
    rows: tuple
    dataset: DatasetRun | None = None


def plan_run(
    n_steps: int,
    min_sep: int,
    max_participations: int | None,
    epsilon: float,
    delta: float,
    *,
    max_buffers: int = 10,
    error: str = "max",
    extra_strategies: tuple = (),
    progress: bool | Progress | None = None,
) -> Plan:
    """Calibrated comparison of BLT, DP-SGD (identity) and any ``extra_strategies`` (name, recipe).

    ``progress``: None (report the stages on stderr when it is a terminal), True or False.
    """
    ctx = Participation(n_steps, min_sep, max_participations)
    budget = epsilon_budget(epsilon, delta)
    strategies = (("BLT", blt_strategy(max_buffers=max_buffers, error=error)),) + tuple(extra_strategies) + (
        ("DP-SGD", identity_strategy()),
    )
    progress = Progress.of(progress)
    summary = None
    try:
        rows = []
        for name, strategy in strategies:
            with progress.stage(f"{name}: resolving the strategy for {ctx}"):
                mech = strategy.resolve(ctx)
            result = calibrate(
                budget,
                lambda sigma, s=strategy: mf_gaussian(sigma, s, ctx.n_steps, ctx.min_sep, ctx.max_participations),
                param_min=1e-3, param_max=1e4,
            )
            rows.append(_row(name, strategy, mech, result))
        summary = f"planned {len(rows)} strategies"
    finally:
        progress.close(summary)
    return Plan(participation=ctx, epsilon=float(epsilon), delta=float(delta), rows=tuple(rows))


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
        return _best(_band_candidates(run, epsilon_budget(epsilon, delta), _check_error(error), progress))[0]
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
    progress: bool | Progress | None = None,
) -> tuple:
    """The candidates of ``cyclic_poisson_bands`` (same rule, same order) as ``BandCandidate`` rows,
    for callers that rank them on another error (``opake.torch.choice``); ``max_bands`` stops the
    search there (a cap on the noise state, ``bands - 1`` floats per parameter)."""
    run = DatasetRun(num_examples, batch_size, epochs)
    progress = Progress.of(progress)
    try:
        candidates = _band_candidates(run, epsilon_budget(epsilon, delta), _check_error(error), progress, max_bands)
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


def plan_dataset(
    num_examples: int,
    batch_size: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    max_buffers: int = 10,
    error: str = "max",
    progress: bool | Progress | None = None,
) -> Plan:
    """Calibrated comparison for a data set: each strategy with its sampler and accountant.

    Rows, all at (epsilon, delta) and with expected batch size ``batch_size``:

    * "BLT", balls-in-bins sampler (num_bins = num_examples // batch_size bins, min_sep =
      num_bins, max_participations = epochs), unamplified (``balls_in_bins``, rigorous);
    * "BLT amplified", same sampler, the amplified bound of the aligned pair (``method="amplified"``:
      Renyi and direct hockey-stick; not proven for adaptive gradients, docs/adaptivity.md);
    * "BandMF", cyclic Poisson with ``cyclic_poisson_bands`` groups, PLD (Band23 Thm 4);
    * "DP-SGD Poisson", Poisson sampling at rate batch_size / num_examples each step, PLD: the
      DP-SGD Opacus users run;
    * "DP-SGD unampl.", balls-in-bins without amplification, for reference.

    RMSE values are of the noise alone (clip norm 1, before dividing by the batch size); the
    variance of Poisson batch sizes is not counted. The PLD rows are priced on a grid of
    ``PLD_DISCRETIZATION`` (module comment). ``progress``: None (report the stages on stderr when
    it is a terminal), True or False.
    """
    run = DatasetRun(num_examples, batch_size, epochs)
    budget = epsilon_budget(epsilon, delta)
    error = _check_error(error)
    progress = Progress.of(progress)
    summary = None
    try:
        plan = _plan_dataset(run, budget, max_buffers, error, progress)
        summary = f"planned {len(plan.rows)} rows"
        return plan
    finally:
        progress.close(summary)


def _plan_dataset(run: DatasetRun, budget, max_buffers: int, error: str, progress: Progress) -> Plan:
    num_bins, n = run.num_bins, run.n_steps
    ctx = Participation(n, num_bins, -(-n // num_bins))
    bins = f"balls-in-bins: {num_bins} bins, bin t mod {num_bins} at step t"
    unamplified = f"unamplified Gaussian bound (min_sep={num_bins}, k={ctx.max_participations})"
    rows = []
    caps = []
    for name, strategy in (("BLT", blt_strategy(max_buffers=max_buffers, error=error)),
                           ("DP-SGD unampl.", identity_strategy())):
        with progress.stage(f"{name}: resolving the strategy for {ctx}"):
            mech = strategy.resolve(ctx)
        result = calibrate(
            budget,
            lambda sigma, s=strategy: balls_in_bins(mf_gaussian(sigma, s), num_bins, n, method="rigorous"),
            *_BINS_SIGMA_RANGE,
        )
        caps.append(result)
        rows.append(_row(name, strategy, mech, result, bins, unamplified))
    blt_row = rows[0]
    # the amplified bound is capped by the unamplified one, so the unamplified sigma meets the budget
    stage = progress.stage(f"BLT amplified: calibrating the noise multiplier ({num_bins} bins)")
    with stage, warnings.catch_warnings():
        # the row states that this bound is not proven for adaptive gradients (its accounting
        # text); balls_in_bins's UnprovenAmplificationWarning would repeat it once per evaluation
        warnings.simplefilter("ignore", UnprovenAmplificationWarning)
        amplified = calibrate_capped(
            budget, lambda sigma: balls_in_bins(mf_gaussian(sigma, blt_row.strategy), num_bins, n, method="amplified"),
            lambda sigma: balls_in_bins(mf_gaussian(sigma, blt_row.strategy), num_bins, n, method="rigorous"),
            *_BINS_SIGMA_RANGE, cap=caps[0], on_evaluation=calibration_reporter(progress, budget.epsilon),
        )
    rows.insert(1, _row("BLT amplified", blt_row.strategy, blt_row.mechanism, amplified, bins,
                        "amplified bound of the aligned dominating pair (Renyi, direct hockey-stick); not proven "
                        "for adaptively chosen gradients when bins interact, as a BLT's do (docs/adaptivity.md)"))

    candidates = _band_candidates(run, budget, error, progress)
    bands, band_sigma, _, band_points = _best(candidates)
    q_bands = run.batch_size * bands / run.num_examples
    band_strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands=bands, error=error)
    with progress.stage(f"BandMF: calibrating {bands} band(s) on the PLD grid {PLD_DISCRETIZATION:g}"):
        result = _refined(budget, band_strategy, q_bands, n, band_sigma, band_points, progress)
    rows.insert(2, _row(
        "BandMF", band_strategy, result.process.mechanism, result,
        f"cyclic Poisson: {bands} group(s), rate {q_bands:.4g} in the served group",
        f"PLD, Band23 Thm 4 ({bands} band(s){', i.e. DP-SGD' if bands == 1 else ''})",
    ))
    q = run.sample_rate
    identity = identity_strategy()
    if bands != 1:  # one band is Poisson DP-SGD itself (the same rate): its row is the one just calibrated
        with progress.stage(f"DP-SGD Poisson: calibrating on the PLD grid {PLD_DISCRETIZATION:g}"):
            result = _refined(budget, identity, q, n, candidates[0][1], candidates[0][3], progress)
    rows.insert(3, _row("DP-SGD Poisson", identity, result.process.mechanism, result,
                        f"Poisson: each example with probability {q:.4g} at every step", "PLD (as Opacus)"))
    return Plan(participation=ctx, epsilon=budget.epsilon, delta=budget.delta, rows=tuple(rows), dataset=run)


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
        q = run.batch_size * bands / run.num_examples
        strategy = identity_strategy() if bands == 1 else band_mf_strategy(bands=bands, error=error)
        compositions = -(-run.n_steps // bands)
        evaluated = []
        with progress.stage(f"choosing the bands: {bands} band(s)"):
            mech = strategy.resolve(run.n_steps, bands, compositions)
            norm = banded_column_norm(mech)
            guess = noise_multiplier_guess(q, compositions, norm, budget)
            result = calibrate_near(
                budget,
                lambda sigma, s=strategy, q=q: poisson(mf_gaussian(sigma, s), q, run.n_steps,
                                                       value_discretization_interval=CHOICE_DISCRETIZATION),
                _start(guess * correction, effective, norm), *_SIGMA_RANGE, rtol=_CHOICE_RTOL,
                epsilon_rtol=_CHOICE_RTOL, slope=slope,
                on_evaluation=lambda sigma, epsilon: evaluated.append((sigma, epsilon)),
            )
        # The central-limit guess errs smoothly in the bands, so the last candidate's ratio of
        # answer to guess corrects it, and the last candidate's local slope starts the search.
        correction, slope = result.param / guess, _local_slope(evaluated, budget.epsilon) or slope
        effective.append(result.param / norm)
        rmse = _rmse(result.param, mech, error)
        candidates.append((bands, result.param, rmse, tuple(evaluated)))
        if rmse > min(candidate[2] for candidate in candidates):
            break  # the error has turned upward: more bands only weaken the amplification further
        bands *= 2
    return candidates


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
    if s1 == s2:
        return None
    slope = (math.log(e1) - math.log(e2)) / (math.log(s1) - math.log(s2))
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
    slope = None
    if 0.0 < here < math.inf and 0.0 < other_epsilon < math.inf:
        slope = (math.log(other_epsilon) - math.log(here)) / math.log(other / coarse_sigma)
        slope = slope if math.isfinite(slope) and slope < 0.0 else None
    return calibrate_near(budget, on_grid(PLD_DISCRETIZATION), coarse_sigma, *_SIGMA_RANGE, spread=1.1, rtol=_RTOL,
                          epsilon_rtol=_EPSILON_RTOL, slope=slope,
                          on_evaluation=calibration_reporter(progress, budget.epsilon))


def _rmse(sigma: float, mech, error: str) -> float:
    """sigma * sqrt(max_t e_t) (or the mean): the noise's prefix-sum RMSE, clip norm 1."""
    loss = mech.max_loss if error == "max" else mech.mean_loss
    return sigma * math.sqrt(loss) / mech.sensitivity


def _row(name, strategy, mech, result, sampling: str = "", accounting: str = "") -> PlanRow:
    sigma = result.param
    return PlanRow(
        name=name, strategy=strategy, mechanism=mech, noise_multiplier=sigma,
        epsilon=result.epsilon, delta=result.delta,
        rmse_max=_rmse(sigma, mech, "max"), rmse_mean=_rmse(sigma, mech, "mean"),
        state_bytes_per_parameter=_FLOAT32_BYTES * _state_floats(mech),
        sampling=sampling, accounting=accounting, process=result.process if sampling else None,
    )


def _check_error(error) -> str:
    if error not in _ERRORS:
        raise ValueError(f"error must be one of {_ERRORS} (the prefix-sum error to minimize), got {error!r}")
    return error


def _state_floats(mech) -> int:
    """Noise-state floats per model parameter: one per buffer (BLT) or per band but one (BandMF)."""
    return mech.state_rows
