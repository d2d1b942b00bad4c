"""Which mechanism a run with a privacy budget should use: the least noise among the proven ones.

``choose_mechanism(num_examples=, batch_size=, epochs=, target_epsilon=, target_delta=,
recipe=None, strategy=None, sampling=None)`` compares, at the budget
(add/remove adjacency, one unit = one example) and expected batch size ``batch_size``, the
mechanisms whose accounting is proven for adaptively chosen gradients (docs/adaptivity.md):

* **BLT** on balls-in-bins batches, priced without amplification (``"rigorous"``), the BLT
  being ``recipe`` (the BLT optimized for what the optimizer does with the noise:
  ``opake.torch.strategy_for_optimizer`` reads it from a torch optimizer; None: prefix sums);
* **BandMF** with cyclic Poisson sampling (Band23 Thm 4, PLD), its band count from the rule of
  ``opake.planner.bands`` (2 or more bands);
* **DP-SGD, Poisson**: Poisson sampling at rate batch_size / num_examples, PLD (as Opacus runs it);
* **DP-SGD, balls in bins**: the random-allocation PLD (``"allocation_pld"``).

The BLT's amplified bound is never a candidate (not proven for adaptive gradients).

Ranking. Each candidate's noise multiplier meets the budget on its own accountant; its error is
sigma * sqrt(max_t e_t), e_t the squared norm of row t of W C^{-1} for the optimizer's workload
W (``opake.planner.workload``: the noise in SGD's parameters for torch.optim.SGD with momentum or a
schedule, the prefix sums of the noise otherwise), the standard deviation of the worst step's
noise, before the division by the batch size that every candidate shares. The least error wins;
ties go to the earlier candidate in the order above read from DP-SGD up (fewer noise buffers).
This is the noise alone: the variance of Poisson batch sizes and the effect of noise on
accuracy are not counted. The candidates the rule ranks, and the chosen one, are what
``MechanismChoice.table()`` prints.

Speed (a few seconds at 60,000 examples): the BLT's unamplified bound calibrates in
milliseconds; the Poisson candidates are calibrated as ``opake plan`` does (``opake.planner.bands``) (the bands on a
coarse PLD grid, 1e-2; the winner refined on 1e-3, then on the plan's own grid, 1e-4, from
there); DP-SGD on balls in bins is first bounded from below in microseconds
(``allocation.lower_bound``: a test on the bins' sums shows the budget is missed below some
noise multiplier), and its PLD (seconds per evaluation) is calibrated only when that bound does
not already put it behind the best other candidate. The chosen noise multiplier is calibrated on
exactly the accountant the run's plan builds, so ``make_private(..., noise_multiplier=
choice.noise_multiplier)`` prices it at ``choice.epsilon`` <= target_epsilon.

``strategy=`` and ``sampling=`` restrict the candidates (a BLT runs on balls in bins only; a
BandMF on cyclic Poisson; the identity on either). The function plans nothing and touches
nothing: ``make_private`` (and the Opacus adapter, ``opake.torch.PrivacyEngine``) carry the
choice out.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

import opake.accounting as acc
from opake._checks import integer_at_least
from opake.dpftrl.accounting import mf_gaussian, poisson
from opake.dpftrl.accounting.accountant import Accountant, balls_in_bins_accountant, poisson_accountant
from opake.dpftrl.accounting.allocation.lower_bound import noise_multiplier_lower_bound
from opake.dpftrl.accounting.methods import AccountingMethod
from opake.dpftrl.noise import blt_strategy, identity_strategy
from opake.errors import PlanError
from opake.planner.bands import (BandCandidate, band_candidates, coarse_band_candidate, falling_log_slope,
                                 refine_band_candidate)
from opake.planner.calibration import PoissonStart, calibrate_noise
from opake.planner.constants import CHOICES_LIMIT, MAX_STATE_ROWS, PLD_DISCRETIZATION
from opake.planner.runs import DatasetRun
from opake.planner.workload import Workload, workload_of
from opake.progress import Progress

__all__ = ["MAX_STATE_ROWS", "Candidate", "MechanismChoice", "choose_mechanism"]

_SAMPLINGS = ("balls_in_bins", "poisson")
# Choices by request (the run's size, the budget, the workload recipe and the restrictions): a
# choice is a pure function of these, and a second identical request (another learning rate or
# seed of the same run) is answered at once. Bounded and process-wide, like the calibrated noise
# multipliers of opake.planner.calibration.
_CHOICES: dict = {}


@dataclass(frozen=True)
class Candidate:
    """One mechanism at the budget: how it samples and is priced, its noise and its error.

    ``noise_multiplier`` meets the budget on the candidate's accountant, or, where ``calibrated``
    is False, is a lower bound on the one that would (the candidate was ruled out without its
    slow calibration); ``error`` is sigma * sqrt(max_t e_t) on the workload (module docstring);
    ``note`` says how the number was obtained. ``band_candidate`` keeps a Poisson candidate's
    coarse calibration, from which the chosen one is refined; ``accountant`` is the one the plan
    builds for the candidate (the same strategy, horizon, sampling and method), on which the chosen
    one's noise multiplier is calibrated; ``process`` prices ``noise_multiplier`` on it (None for a
    coarse Poisson candidate, whose grid is not the plan's, and for a lower bound).
    """

    name: str
    strategy: object
    sampling: str
    accounting: str
    noise_multiplier: float
    error: float
    note: str
    calibrated: bool = True
    sample_rate: float | None = None
    band_candidate: BandCandidate | None = field(default=None, repr=False, compare=False)
    accountant: Accountant | None = field(default=None, repr=False, compare=False)
    process: object = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def step_noise(self) -> float:
        """The standard deviation of one step's noise, sigma * max_t ||row t of C^{-1}|| (clip norm 1,
        before the division by the batch size): what an Adam-type optimizer's denominator follows
        when the noise dominates the gradient, so the scale its learning rate is tuned to."""
        n = self.accountant.n_steps
        min_sep = int(getattr(self.strategy, "bands", 1)) if self.sampling == "poisson" else self.accountant.num_bins
        mechanism = self.strategy.resolve(n, min_sep, -(-n // min_sep))
        inverse = np.asarray(mechanism.inverse_coefficients(n), dtype=np.float64)
        return float(self.noise_multiplier * math.sqrt(float(np.dot(inverse, inverse))))

    @property
    def description(self) -> str:
        if self.sampling == "poisson":
            return f"Poisson, rate {self.sample_rate:.4g}, PLD"
        pld = self.accounting == AccountingMethod.ALLOCATION_PLD.value
        return f"balls in bins, {'random-allocation PLD' if pld else 'unamplified'}"


@dataclass(frozen=True)
class MechanismChoice:
    """The chosen candidate, every candidate ranked, the workload they were ranked on, and why.

    ``epsilon`` is the chosen mechanism's at ``target_delta`` on the plan's own accountant (<=
    ``target_epsilon``), ``process`` the privacy process that prices it there (the plan takes both
    as they are); ``seconds`` the time the choice took.
    """

    chosen: Candidate
    candidates: tuple
    workload: Workload
    target_epsilon: float
    target_delta: float
    epsilon: float
    seconds: float
    process: object = field(default=None, repr=False, compare=False)

    @property
    def accountant(self) -> Accountant:
        return self.chosen.accountant

    @property
    def strategy(self):
        return self.chosen.strategy

    @property
    def sampling(self) -> str:
        return self.chosen.sampling

    @property
    def accounting(self) -> str:
        return self.chosen.accounting

    @property
    def noise_multiplier(self) -> float:
        return self.chosen.noise_multiplier

    @property
    def adam_rate_scale(self) -> float | None:
        """How much larger a learning rate of Adam-type optimizers is here than with DP-SGD (Poisson)
        at the same budget: the ratio of one step's noise standard deviation (``Candidate.step_noise``).
        With the noise dominating the gradient, Adam's update is about lr * m / sqrt(v) with sqrt(v)
        near that standard deviation, so a rate tuned with DP-SGD goes times this to the chosen
        mechanism (and divided by it back). None without a DP-SGD Poisson candidate. Plain SGD's
        update does not divide by the noise: its rate carries over as it is."""
        reference = next((c for c in self.candidates if c.name == "DP-SGD, Poisson"), None)
        if reference is None:
            return None
        return self.chosen.step_noise / reference.step_noise

    @property
    def reason(self) -> str:
        """One sentence: what won, on which error, against what."""
        others = [c for c in self.candidates if c is not self.chosen]
        against = "; ".join(f"{c.name} {'at least ' if not c.calibrated else ''}{c.error:.4g}" for c in others)
        return (f"{self.chosen.name} ({self.chosen.description}) has the least noise at epsilon "
                f"{self.target_epsilon:g}, delta {self.target_delta:g} on the {self.workload.description}: "
                f"worst-step noise {self.chosen.error:.4g}" + (f", against {against}" if against else ""))

    def batch_advice(self, num_examples: int):
        """The chosen mechanism at other batch sizes and epochs, ranked by noise per example
        processed (``opake.planner.batch_advice``; seconds: one calibration per setting)."""
        from opake.planner.batch_advice import batch_advice  # it calibrates with this module's pieces

        return batch_advice(self, num_examples)

    def table(self) -> str:
        """The comparison, one candidate a line, the chosen one marked."""
        lines = [f"{'mechanism':<22} {'sampling / accounting':<34} {'noise mult.':>11} {'error':>10}  note"]
        for c in self.candidates:
            bound = "" if c.calibrated else ">= "
            lines.append(f"{c.name:<22} {c.description:<34} {bound + format(c.noise_multiplier, '.4g'):>11} "
                         f"{bound + format(c.error, '.4g'):>10}  {c.note}{'  <- chosen' if c is self.chosen else ''}")
        lines.append(f"error: the worst step's noise standard deviation on the {self.workload.description} "
                     f"(clip norm 1, before dividing by the batch size); chosen: epsilon {self.epsilon:.6g} <= "
                     f"{self.target_epsilon:g} at delta {self.target_delta:g}, in {self.seconds:.2f} s")
        if self.learning_rate_note:
            lines.append(self.learning_rate_note)
        return "\n".join(lines)

    @property
    def learning_rate_note(self) -> str:
        """One sentence on the learning rate's scale (``adam_rate_scale``), or "" when the chosen
        mechanism is Poisson DP-SGD itself or there is none to compare with."""
        scale = self.adam_rate_scale
        if scale is None or self.chosen.name == "DP-SGD, Poisson":
            return ""
        return (f"learning rate: one step's noise has standard deviation {self.chosen.step_noise:.4g} with "
                f"{self.chosen.name}, against {self.chosen.step_noise / scale:.4g} with Poisson DP-SGD; Adam-type "
                f"optimizers divide their step by it, so a rate tuned with DP-SGD goes x{scale:.3g} here (plain "
                f"SGD's rate carries over as it is)")

    def __str__(self) -> str:
        return self.table()


def choose_mechanism(
    *,
    num_examples: int,
    batch_size: int,
    epochs: int,
    target_epsilon: float,
    target_delta: float,
    recipe=None,
    strategy=None,
    sampling: str | None = None,
    max_state_rows: int | None = MAX_STATE_ROWS,
    refine_all: bool = False,
    steps: int | None = None,
    progress: bool | None = None,
) -> MechanismChoice:
    """The mechanism with the least noise error at (target_epsilon, target_delta) (module docstring).

    ``max_state_rows`` caps the noise state: floats kept per model parameter (a BLT keeps one
    per buffer, at most 10; BandMF with g bands keeps g - 1), so BandMF candidates above it are
    not tried; None lifts the cap.

    ``recipe`` is the BLT recipe of the optimizer's workload (``opake.torch.strategy_for_optimizer``;
    None: the default recipe, whose workload is the prefix sums of the noise). ``strategy``
    (a recipe) and ``sampling`` ("balls_in_bins" or "poisson") restrict the candidates; a
    combination opake cannot price (Poisson with a BLT) raises ``ValueError`` saying what to use.
    ``refine_all`` also prices the other Poisson candidates, calibrated on the comparison's PLD grid
    (1e-3; the chosen one is on the plan's, 1e-4): what a table of every candidate shows (the choice
    is the same). ``steps`` cuts the run at that horizon, inside the last of ``epochs`` (``DatasetRun``).
    """
    started = time.perf_counter()
    run = DatasetRun(num_examples, batch_size, epochs, steps)
    budget = acc.epsilon_budget(target_epsilon, target_delta)
    if sampling is not None and sampling not in _SAMPLINGS:
        raise PlanError(f"sampling must be None (any), or one of {_SAMPLINGS}, got {sampling!r}")
    kinds = _kinds(strategy, sampling)
    if max_state_rows is not None:
        max_state_rows = integer_at_least("max_state_rows", max_state_rows, minimum=0)
    recipe = blt_strategy() if recipe is None else recipe
    request = (run, budget, recipe, strategy, sampling, max_state_rows, bool(refine_all))
    try:
        known = _CHOICES.get(request)
    except TypeError:  # an unhashable recipe or strategy: choose every time
        request, known = None, None
    if known is not None:
        return known
    workload = workload_of(recipe)
    progress = Progress.of(progress)
    try:
        candidates = _poisson_candidates(run, budget, workload, kinds, strategy, max_state_rows, progress)
        if "blt" in kinds:
            candidates.append(_blt_candidate(run, budget, workload, strategy or recipe, progress))
        if "bins" in kinds:
            best = min((c.error for c in candidates), default=math.inf)
            candidates.append(_bins_candidate(run, budget, workload, best, progress))
        chosen = min(candidates, key=lambda c: c.error)  # the first of equal errors: fewer buffers
        if chosen.sampling == "poisson":
            refined = _on_the_plans_grid(chosen, run, budget, workload, progress)
            candidates = [refined if c is chosen else c for c in candidates]
            chosen = refined
        if refine_all:
            candidates = [_on_the_rows_grid(c, run, budget, workload, progress)
                          if c.sampling == "poisson" and c is not chosen else c for c in candidates]
        process = chosen.process
        epsilon = process.epsilon_at(budget.delta)
    finally:
        progress.close()
    choice = MechanismChoice(chosen, tuple(candidates), workload, budget.epsilon, budget.delta, epsilon,
                             time.perf_counter() - started, process)
    if request is not None and len(_CHOICES) < CHOICES_LIMIT:
        _CHOICES[request] = choice
    return choice


# -- which candidates ------------------------------------------------------------------------------

def _kinds(strategy, sampling) -> set:
    """The candidate kinds ``strategy`` and ``sampling`` allow: "poisson", "bandmf", "blt", "bins"."""
    if strategy is None:
        kinds = {"poisson", "bandmf", "blt", "bins"}
    else:
        bands = getattr(strategy, "bands", None)  # recipes state their bands; None: a BLT
        kinds = {"blt"} if bands is None else ({"poisson", "bins"} if bands == 1 else {"bandmf"})
    allowed = {None: kinds, "poisson": {"poisson", "bandmf"}, "balls_in_bins": {"blt", "bins"}}[sampling]
    if not kinds & allowed:
        raise PlanError(
            f"strategy={strategy!r} with sampling={sampling!r} has no accounting proven for adaptive gradients: "
            f"Poisson amplification is proven for banded strategies only (identity_strategy, band_mf_strategy), "
            f"and BandMF with several bands runs with cyclic Poisson sampling; run a BLT on balls in bins "
            f"(sampling='balls_in_bins'), or pass a banded strategy for Poisson sampling"
        )
    return kinds & allowed


# -- the candidates --------------------------------------------------------------------------------

def _blt_candidate(run: DatasetRun, budget, workload, strategy, progress) -> Candidate:
    accountant = balls_in_bins_accountant(strategy, run.num_bins, run.n_steps, AccountingMethod.RIGOROUS)
    with progress.stage("BLT on balls in bins: resolving and calibrating (unamplified)"):
        result = calibrate_noise(accountant, budget)
    mechanism = result.process.mechanism
    return Candidate("BLT", strategy, "balls_in_bins", AccountingMethod.RIGOROUS.value, result.sigma,
                     workload.rmse(result.sigma, mechanism.inverse_coefficients(run.n_steps)),
                     f"{mechanism.num_buffers} buffer(s), unamplified bound", accountant=accountant,
                     process=result.process)


def _poisson_candidates(run: DatasetRun, budget, workload, kinds, strategy, max_state_rows, progress) -> list:
    """DP-SGD with Poisson sampling and the BandMF (2+ bands) with the least workload error, at the
    coarse grid's noise multipliers (the chosen one is calibrated again on the plan's grid)."""
    if not kinds & {"poisson", "bandmf"}:
        return []
    if strategy is None:
        rows = band_candidates(run.num_examples, run.batch_size, run.epochs, budget.epsilon, budget.delta,
                               max_bands=None if max_state_rows is None else max_state_rows + 1, steps=run.steps,
                               progress=progress)
    else:
        rows = (coarse_band_candidate(run.num_examples, run.batch_size, run.epochs, budget.epsilon, budget.delta,
                                      strategy, steps=run.steps, progress=progress),)
    ranked = [(row, workload.rmse(row.noise_multiplier, _mechanism(row, run).inverse_coefficients(run.n_steps)))
              for row in rows]
    candidates = []
    if "poisson" in kinds:
        row, error = ranked[0]
        candidates.append(_poisson_candidate("DP-SGD, Poisson", row, error, "coarse PLD grid (1e-2)", run))
    banded = [(row, error) for row, error in ranked if row.bands > 1]
    if "bandmf" in kinds and banded:
        row, error = min(banded, key=lambda pair: pair[1])
        tried = ", ".join(str(r.bands) for r, _ in banded)
        candidates.append(_poisson_candidate(f"BandMF, {row.bands} bands", row, error,
                                             f"bands tried: {tried}; coarse PLD grid (1e-2)", run))
    return candidates


def _mechanism(row: BandCandidate, run: DatasetRun):
    return row.strategy.resolve(run.n_steps, row.bands, -(-run.n_steps // row.bands))


def _poisson_candidate(name: str, row: BandCandidate, error: float, note: str, run: DatasetRun) -> Candidate:
    return Candidate(name, row.strategy, "poisson", AccountingMethod.POISSON_PLD.value, row.noise_multiplier,
                     error, note, sample_rate=row.sample_rate, band_candidate=row,
                     accountant=poisson_accountant(row.strategy, row.sample_rate, run.n_steps))


def _bins_candidate(run: DatasetRun, budget, workload, best_error: float, progress) -> Candidate:
    """DP-SGD on balls in bins: a lower bound on its noise multiplier first, its PLD only if it could win."""
    strategy = identity_strategy()
    name, method = "DP-SGD, balls in bins", AccountingMethod.ALLOCATION_PLD.value
    inverse = strategy.resolve(run.n_steps, run.num_bins, run.epochs).inverse_coefficients(run.n_steps)
    accountant = balls_in_bins_accountant(strategy, run.num_bins, run.n_steps)
    low = noise_multiplier_lower_bound(run.num_bins, run.epochs, budget.epsilon, budget.delta)
    if workload.rmse(low, inverse) >= best_error:
        return Candidate(name, strategy, "balls_in_bins", method, low, workload.rmse(low, inverse),
                         "PLD not calibrated: a test on the bins' sums misses the budget below this noise "
                         "multiplier, so it cannot beat the least error above", calibrated=False,
                         accountant=accountant)
    with progress.stage("DP-SGD on balls in bins: calibrating the random-allocation PLD"):
        result = calibrate_noise(accountant, budget)
    return Candidate(name, strategy, "balls_in_bins", method, result.sigma, workload.rmse(result.sigma, inverse),
                     f"random-allocation PLD ({result.evaluations} evaluation(s))", accountant=accountant,
                     process=result.process)


# -- the chosen one on the plan's own accountant -----------------------------------------------

def _on_the_plans_grid(candidate: Candidate, run: DatasetRun, budget, workload, progress) -> Candidate:
    """A Poisson candidate's noise multiplier on the rows' grid (1e-3, as the comparison's rows),
    then on the plan's own (``poisson``'s default, 1e-4) from there, along the 1e-3 grid's slope:
    one to three evaluations where a calibration from scratch takes about ten."""
    refined = refine_band_candidate(candidate.band_candidate, run.n_steps, budget.epsilon, budget.delta,
                                    progress=progress)
    with progress.stage(f"{candidate.name}: calibrating on the plan's PLD grid"):
        result = calibrate_noise(candidate.accountant, budget,
                                 start=PoissonStart(refined.param, _slope(candidate, refined, run, budget)))
    mechanism = result.process.mechanism
    return Candidate(candidate.name, candidate.strategy, "poisson", candidate.accounting, result.sigma,
                     workload.rmse(result.sigma, mechanism.inverse_coefficients(run.n_steps)),
                     _tried(candidate) + f"PLD on the plan's grid (1e-4), {result.evaluations} evaluation(s) from the "
                     f"1e-3 grid's {refined.param:.5g}", sample_rate=candidate.sample_rate,
                     band_candidate=candidate.band_candidate, accountant=candidate.accountant,
                     process=result.process)


def _on_the_rows_grid(candidate: Candidate, run: DatasetRun, budget, workload, progress) -> Candidate:
    """A Poisson candidate calibrated on the comparison's grid (1e-3): 1 to 3 evaluations from its
    coarse calibration, an exact upper bound at its noise multiplier, with its process."""
    result = refine_band_candidate(candidate.band_candidate, run.n_steps, budget.epsilon, budget.delta,
                                   progress=progress)
    mechanism = result.process.mechanism
    return Candidate(candidate.name, candidate.strategy, "poisson", candidate.accounting, result.param,
                     workload.rmse(result.param, mechanism.inverse_coefficients(run.n_steps)),
                     _tried(candidate) + "PLD on the comparison's grid (1e-3)", sample_rate=candidate.sample_rate,
                     band_candidate=candidate.band_candidate, accountant=candidate.accountant,
                     process=result.process)


def _tried(candidate: Candidate) -> str:
    """The coarse note's "bands tried: ...; " (a BandMF candidate's), kept when it is refined."""
    return candidate.note[: candidate.note.index("coarse PLD grid")] if "bands tried" in candidate.note else ""


def _slope(candidate: Candidate, refined, run: DatasetRun, budget) -> float | None:
    """d ln epsilon / d ln sigma on the 1e-3 grid over the 1% below its answer (one cheap evaluation)."""
    lower = 0.99 * refined.param
    other = poisson(mf_gaussian(lower, candidate.strategy), candidate.sample_rate, run.n_steps,
                    value_discretization_interval=PLD_DISCRETIZATION).epsilon_at(budget.delta)
    return falling_log_slope(lower, other, refined.param, refined.epsilon)
