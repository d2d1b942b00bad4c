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

import warnings
from dataclasses import dataclass

from opake.accounting import calibrate, epsilon_budget
from opake.accounting.calibrate import calibrate_capped
from opake.dpftrl.accounting import UnprovenAmplificationWarning, balls_in_bins, mf_gaussian
from opake.dpftrl.noise import band_mf_strategy, blt_strategy, identity_strategy
from opake.dpftrl.accounting.band_choice import (  # noqa: F401 - cyclic_poisson_bands and the rest re-exported
    CHOICE_DISCRETIZATION, PLD_DISCRETIZATION, BandCandidate, DatasetRun, _best, _band_candidates, _check_error,
    _refined, _rmse, band_candidates, cyclic_poisson_bands, refine_band_candidate,
)
from opake.dpftrl.participation import Participation
from opake.progress import Progress, calibration_reporter

_FLOAT32_BYTES = 4
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


def _row(name, strategy, mech, result, sampling: str = "", accounting: str = "") -> PlanRow:
    sigma = result.param
    return PlanRow(
        name=name, strategy=strategy, mechanism=mech, noise_multiplier=sigma,
        epsilon=result.epsilon, delta=result.delta,
        rmse_max=_rmse(sigma, mech, "max"), rmse_mean=_rmse(sigma, mech, "mean"),
        state_bytes_per_parameter=_FLOAT32_BYTES * _state_floats(mech),
        sampling=sampling, accounting=accounting, process=result.process if sampling else None,
    )


def _state_floats(mech) -> int:
    """Noise-state floats per model parameter: one per buffer (BLT) or per band but one (BandMF)."""
    return mech.state_rows
