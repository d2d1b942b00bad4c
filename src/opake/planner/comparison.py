"""Plan a run: resolve strategies for a participation context and calibrate them to a budget.

``plan_run`` (a participation context): for each strategy the noise multiplier is the smallest
one meeting (epsilon, delta) for the context, without amplification (``mf_gaussian``: one
Gaussian with noise multiplier sigma / S).

``plan_dataset`` (a data set, a batch size and a number of epochs): the choice ``make_private``
makes without a strategy (``opake.planner.choice``, on the prefix-sum workload or the one given),
each candidate a row with the sampler it runs with and the accountant that prices it, every
calibrated noise multiplier on the plan's own grid (what ``make_private`` would run with), and
one row for reference that is not a candidate: the BLT priced by the amplified balls-in-bins bound
of the aligned dominating pair, which is not proven for adaptively chosen gradients when bins
interact (docs/adaptivity.md; its row says so, in place of ``balls_in_bins``'s warning).

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
from opake.dpftrl.accounting import UnprovenAmplificationWarning, mf_gaussian
from opake.dpftrl.accounting.accountant import balls_in_bins_accountant
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise import blt_strategy, identity_strategy
from opake.dpftrl.participation import Participation
from opake.planner.bands import check_error, prefix_rmse
from opake.planner.calibration import calibrate_noise
from opake.planner.choice import MechanismChoice, choose_mechanism
from opake.planner.constants import SIGMA_RANGE
from opake.planner.runs import DatasetRun
from opake.progress import Progress

__all__ = ["Plan", "PlanRow", "plan_dataset", "plan_run"]

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PlanRow:
    """One strategy at the plan's (epsilon, delta).

    ``sampling`` and ``accounting`` say, in words, which batches the row assumes and how they
    were priced (``plan_dataset``; empty for ``plan_run``, whose context fixes both);
    ``process`` is the calibrated privacy process (None for ``plan_run``); ``chosen`` marks the row
    ``make_private`` takes without a strategy; ``calibrated`` is False for a row whose noise multiplier
    is a lower bound (a candidate ruled out without its slow calibration).
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
    chosen: bool = False
    calibrated: bool = True


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
    choice: MechanismChoice | None = None


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
                *SIGMA_RANGE,
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
    recipe=None,
    progress: bool | Progress | None = None,
) -> Plan:
    """The choice for a data set, every candidate a calibrated row (module docstring).

    Rows, all at (epsilon, delta) and with expected batch size ``batch_size``, in the choice's order:

    * "DP-SGD Poisson": Poisson sampling at rate batch_size / num_examples each step, PLD (as Opacus);
    * "BandMF": cyclic Poisson on g groups, PLD (Band23 Thm 4), g the choice's band count (2 or more,
      at most ``MAX_STATE_ROWS`` + 1; no row when the data set has room for one band only);
    * "BLT": balls in bins (num_examples // batch_size bins, served cyclically), unamplified;
    * "DP-SGD bins": balls in bins, random-allocation PLD, or a lower bound on its noise
      multiplier where that already rules it out (``calibrated`` False);
    * "BLT amplified": the BLT's amplified bound, for reference (not proven for adaptive gradients).

    ``recipe`` is the BLT recipe of the optimizer's workload (default: ``blt_strategy(max_buffers=,
    error=)``, the prefix sums), on which the candidates are ranked. RMSE values are of the noise's
    prefix sums alone (clip norm 1, before dividing by the batch size); the variance of Poisson batch
    sizes is not counted. ``progress``: None (report the stages on stderr when it is a terminal),
    True or False.
    """
    run = DatasetRun(num_examples, batch_size, epochs)
    budget = epsilon_budget(epsilon, delta)
    error = check_error(error)
    recipe = blt_strategy(max_buffers=max_buffers, error=error) if recipe is None else recipe
    progress = Progress.of(progress)
    summary = None
    try:
        choice = choose_mechanism(num_examples=run.num_examples, batch_size=run.batch_size, epochs=run.epochs,
                                  target_epsilon=budget.epsilon, target_delta=budget.delta, recipe=recipe,
                                  refine_all=True, progress=progress)
        rows = [_candidate_row(candidate, candidate is choice.chosen, run, budget) for candidate in choice.candidates]
        blt = next(row for row in rows if row.name == "BLT")
        rows.append(_amplified_row(blt, run, budget, progress))
        summary = f"planned {len(rows)} rows"
    finally:
        progress.close(summary)
    ctx = Participation(run.n_steps, run.num_bins, -(-run.n_steps // run.num_bins))
    return Plan(participation=ctx, epsilon=budget.epsilon, delta=budget.delta, rows=tuple(rows), dataset=run,
                choice=choice)


_ROW_NAMES = {"DP-SGD, Poisson": "DP-SGD Poisson", "BLT": "BLT", "DP-SGD, balls in bins": "DP-SGD bins"}


def _candidate_row(candidate, chosen: bool, run: DatasetRun, budget) -> PlanRow:
    name = _ROW_NAMES.get(candidate.name, "BandMF")
    sigma = candidate.noise_multiplier
    if candidate.calibrated:
        process = candidate.process
        epsilon = process.epsilon_at(budget.delta)
        mech = process.mechanism
    else:  # a lower bound, never priced: its mechanism is the strategy's for the bins
        process, epsilon = None, float("nan")
        mech = candidate.strategy.resolve(run.n_steps, run.num_bins, run.epochs)
    if candidate.sampling == "poisson":
        groups = getattr(candidate.strategy, "bands", 1)
        sampling = (f"Poisson: each example with probability {candidate.sample_rate:.4g} at every step" if groups == 1
                    else f"cyclic Poisson: {groups} group(s), rate {candidate.sample_rate:.4g} in the served group")
        accounting = "PLD (as Opacus)" if groups == 1 else f"PLD, Band23 Thm 4 ({groups} bands)"
    else:
        sampling = f"balls-in-bins: {run.num_bins} bins, bin t mod {run.num_bins} at step t"
        accounting = ("random-allocation PLD" if candidate.accounting == AccountingMethod.ALLOCATION_PLD.value
                      else f"unamplified Gaussian bound (min_sep={run.num_bins}, k={run.epochs})")
        if not candidate.calibrated:
            accounting += f"; noise multiplier a lower bound ({candidate.note})"
    return PlanRow(name=name, strategy=candidate.strategy, mechanism=mech, noise_multiplier=sigma, epsilon=epsilon,
                   delta=budget.delta, rmse_max=prefix_rmse(sigma, mech, "max"), rmse_mean=prefix_rmse(sigma, mech, "mean"),
                   state_bytes_per_parameter=_FLOAT32_BYTES * mech.state_rows, sampling=sampling,
                   accounting=accounting, process=process, chosen=chosen, calibrated=candidate.calibrated)


def _amplified_row(blt: PlanRow, run: DatasetRun, budget, progress: Progress) -> PlanRow:
    """The BLT priced by the amplified bound of the aligned pair (capped by its unamplified sigma)."""
    accountant = balls_in_bins_accountant(blt.strategy, run.num_bins, run.n_steps, AccountingMethod.AMPLIFIED)
    with progress.stage(f"BLT amplified: calibrating the noise multiplier ({run.num_bins} bins)"), \
            warnings.catch_warnings():
        # the row states that this bound is not proven for adaptive gradients (its accounting
        # text); balls_in_bins's UnprovenAmplificationWarning would repeat it once per evaluation
        warnings.simplefilter("ignore", UnprovenAmplificationWarning)
        result = calibrate_noise(accountant, budget, progress=progress)
    sigma = result.sigma
    return PlanRow(name="BLT amplified", strategy=blt.strategy, mechanism=blt.mechanism, noise_multiplier=sigma,
                   epsilon=result.epsilon, delta=budget.delta, rmse_max=prefix_rmse(sigma, blt.mechanism, "max"),
                   rmse_mean=prefix_rmse(sigma, blt.mechanism, "mean"), state_bytes_per_parameter=blt.state_bytes_per_parameter,
                   sampling=blt.sampling, accounting="amplified bound of the aligned dominating pair (Renyi, direct "
                   "hockey-stick); not proven for adaptively chosen gradients when bins interact, as a BLT's do "
                   "(docs/adaptivity.md)", process=result.process)


def _row(name, strategy, mech, result) -> PlanRow:
    sigma = result.param
    return PlanRow(
        name=name, strategy=strategy, mechanism=mech, noise_multiplier=sigma,
        epsilon=result.epsilon, delta=result.delta,
        rmse_max=prefix_rmse(sigma, mech, "max"), rmse_mean=prefix_rmse(sigma, mech, "mean"),
        state_bytes_per_parameter=_FLOAT32_BYTES * mech.state_rows,
    )
