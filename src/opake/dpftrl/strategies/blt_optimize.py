"""Optimizing a BLT for a participation context: minimize sens^2 x error (BLT24 section 5).

Parametrization (barrier-free, docs/math.md section 5). For B buffers take 2B strictly increasing
values x_1 < ... < x_2B in (0, 1) and read them alternately as

    theta_hat_1 < theta_1 < theta_hat_2 < theta_2 < ... < theta_hat_B < theta_B,

the decays of C^{-1} and of C. Then (Inv25)

    omega_i     =  prod_j (theta_i - theta_hat_j) / prod_{l != i} (theta_i - theta_l)      > 0
    omega_hat_j =  prod_i (theta_hat_j - theta_i) / prod_{l != j} (theta_hat_j - theta_hat_l) < 0

and sum(omega) = sum(theta) - sum(theta_hat) < 1, theta_hat > 0: every iterate satisfies the
min-sep preconditions (theta in (0, 1), omega > 0, sum(omega) < 1) by construction. The x
are stored as y = -log(1 - x) = cumsum(exp(v)) with v unconstrained, so that 1 - x = e^-y
keeps full precision for decays within 1e-11 of 1, and every difference x_a - x_b is formed
from the gaps exp(v) (never by subtracting two numbers near 1).

The loss sens^2 x error is evaluated in closed form (``blt``), O(B^2 log(n/b)) for any n, and
minimized in float64 by L-BFGS. Gradients are exact by the complex step: the loss is evaluated
once for the 2B + 1 inputs v + i h e_j together (one vectorized pass), and Im(loss) / h is the
gradient; every function on the path is analytic and extended to complex input.

Starts. Each B starts from decays spread evenly in log(1 - x) between 1 and about 1/n (the
shape of the optimal Toeplitz strategy, c_k ~ k^-1/2, written as a sum of exponentials). With
several participations the loss has several basins, so up to two more starts join: decays
spread up to about b/n, and for B >= 3 and min_sep b >= 64 the "separated" start
(``_separated_start``): a near-constant buffer (time scale >> n, inverse decay ~ 1.8 n), one
buffer at the participation gap (time scale ~ 0.64 b, inverse ~ b/13) and the other B - 2
spread over short time scales up to ~ b/40. That is the shape of the optimum found offline
from many random starts at (n, b, k) = (20000, 1000, 20) (loss 912.43 with 5 buffers, where
the evenly spread starts stop at 920.04 with 3: their 4-buffer optimum is the 3-buffer one
with a wasted buffer, so growth stopped). The starts race for a few L-BFGS iterations and
only the leader continues. All starts are fixed functions of (B, context): deterministic.

Buffer-count policy: B grows from 1. Growth stops when one more buffer lowers the loss by less than
``BUFFER_GAIN`` (relative) or at ``max_buffers``; the last count that did improve is returned.
Each buffer costs d floats of training memory, so one that buys less than 0.01% of loss is not
worth it. Counts are compared after a coarse optimization (stall tolerance 100x finer than
BUFFER_GAIN); the chosen count is then polished to about the 8th digit of the loss.

Under a learning-rate schedule (SGD's parameter workload, max error; also dampening without a
schedule) the loss is steered by ``blt_schedule.ScheduledParameterErrors``, built once per
optimize call, and the reported errors come from the exact O(nB) rows (``_finish``). The count
search then differs in four ways (docs/blt.md, "Buffer count"): from B = 3 on a second start
spread only up to n / e races the usual one (6 iterations each), because the optimum's slowest
buffer is shorter than the horizon and the usual start can end in a basin that wastes one; a
count that ends above the previous count restarts from the previous optimum grown by one buffer
(``_grown_start``), so the losses by count do not go backwards; counts are compared at a
stall tolerance 10x finer than BUFFER_GAIN; and a run also stops once 15 evaluations gained less
than its tolerance, or 5 less than 1/1000 of it (a converged max-of-rows objective spends many
line-search evaluations per iteration). The polish, too, differs (``_polish``): the optimum lies
in a curved, ill-conditioned valley, so after a few plain L-BFGS evaluations it continues in
coordinates preconditioned by a difference-quotient Hessian. Without a schedule nothing changes
(same iterates).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from opake.dpftrl.strategies import blt, blt_workload
from opake.dpftrl.strategies.blt_schedule import ScheduledParameterErrors
from opake.dpftrl.strategies.geometric import expm1
from opake.dpftrl.strategies.lbfgs import minimize_until_stalled
from opake.dpftrl.participation import Participation

BUFFER_GAIN = 1e-4
_STALL_WINDOW = 10
_STEP = 1e-20  # complex-step size: exact to O(h^2), no subtraction
_EXPLORE_STALL, _EXPLORE_ITERATIONS = 1e-6, 150
_RACE_ITERATIONS = 25
# Under a schedule an evaluation costs more (blt_schedule): races of 6 iterations, counts
# compared at a stall tolerance 10x (not 100x) finer than BUFFER_GAIN, and every run also stops
# once 15 evaluations lowered the loss by less than its stall tolerance (``_minimize``).
_SCHEDULED_RACE_ITERATIONS, _SCHEDULED_EXPLORE_STALL = 6, 1e-5
_SCHEDULED_EVAL_WINDOW = 15
# ... and once _QUIET_WINDOW evaluations gained less than _QUIET x the stall tolerance: converged
# (at the six benchmark settings such a run's best value moved by at most 1.4e-10 afterwards).
_QUIET_WINDOW, _QUIET = 5, 1e-3
_POLISH_STALL, _POLISH_ITERATIONS = 1e-8, 150
# Under a schedule the polish runs plain L-BFGS for _POLISH_PROBE evaluations, then continues
# preconditioned by a difference-quotient Hessian (``_polish``, ``_preconditioner``).
_POLISH_PROBE = 8
# ... for at most _POLISH_BUDGET evaluations more. With Nesterov the preconditioned run crept on
# for 128 (n = 1e4) and 137 (n = 1e5) evaluations at a steady rate; stopped at 64 the loss is
# 8.4e-6 and 1.0e-6 (relative) above where they ended, the noise scale half that, for a 25%
# shorter resolve at 1e5. The six benchmark runs of momentum and dampening end within it.
_POLISH_BUDGET = 64
_HESSIAN_STEP, _HESSIAN_FLOOR = 1e-3, 1e-4


@dataclass(frozen=True)
class OptimizeResult:
    params: blt.BLTParams
    sensitivity: float
    max_loss: float
    mean_loss: float
    loss_by_buffers: tuple


@dataclass(frozen=True)
class _Decays:
    """Both decay sets with their complements and output scales, shape (..., B)."""

    theta: np.ndarray
    leak: np.ndarray
    omega: np.ndarray
    leak_hat: np.ndarray
    omega_hat: np.ndarray


def max_log_complement(n_steps: int) -> float:
    """Largest y = -log(1 - theta) the optimizer may use.

    A buffer with n (1 - theta) < e^-16 is constant over the horizon to 1e-7, so nothing is
    lost by stopping there, and 1 - theta >= 1e-14 keeps theta < 1 in float64 (the open
    interval (0, 1) of the preconditions) with 1 - theta still resolved to ~1%.
    """
    return min(math.log(n_steps) + 16.0, 32.0)


@functools.lru_cache(maxsize=None)
def _pair_tables(size: int):
    """The pairs a > b of 2B decays and the off-diagonal mask of B x B (built once per size)."""
    ia, ib = np.tril_indices(size, -1)
    return ia, ib, 1.0 - np.eye(size // 2)


def decays_from_free(v, y_max: float) -> _Decays:
    """Map unconstrained v (..., 2B + 1) to an interlaced valid BLT and its inverse.

    shares = softmax(v); y_c = y_max * (shares_0 + ... + shares_c) for c < 2B, so
    0 < y_1 < ... < y_2B < y_max and x = 1 - e^-y is strictly inside (0, 1).
    """
    v = np.asarray(v)
    e = np.exp(v - v.real.max(axis=-1, keepdims=True))
    cums = np.cumsum(e, axis=-1) / e.sum(axis=-1, keepdims=True)
    size = v.shape[-1] - 1
    y = y_max * cums[..., :size]
    ia, ib, off = _pair_tables(size)
    # log|x_a - x_b| = -y_b + log(1 - e^-(y_a - y_b)) for a > b (formed only there); symmetric
    span = y_max * (cums[..., ia] - cums[..., ib])                   # y_a - y_b
    below = -y[..., ib] + np.log(-expm1(-span))
    log_gap = np.zeros(v.shape[:-1] + (size, size), dtype=below.dtype)
    log_gap[..., ia, ib] = below
    log_gap[..., ib, ia] = below
    hat_rows, own_rows = log_gap[..., 0::2, :], log_gap[..., 1::2, :]
    log_omega = own_rows[..., 0::2].sum(-1) - (off * own_rows[..., 1::2]).sum(-1)
    log_omega_hat = hat_rows[..., 1::2].sum(-1) - (off * hat_rows[..., 0::2]).sum(-1)
    return _Decays(
        theta=-expm1(-y[..., 1::2]),
        leak=np.exp(-y[..., 1::2]),
        omega=np.exp(log_omega),
        leak_hat=np.exp(-y[..., 0::2]),
        omega_hat=-np.exp(log_omega_hat),
    )


def _loss(v, ctx: Participation, error: str, target, schedule):
    # A line-search probe far out can underflow a gap to 0; the objective then reports a
    # non-finite loss and L-BFGS backs off, so the floating-point warnings are expected.
    with np.errstate(all="ignore"):
        d = decays_from_free(v, max_log_complement(ctx.n_steps))
        sens2 = blt.minsep_sensitivity_squared_arrays(d.theta, d.leak, d.omega, ctx)
        if isinstance(target, ScheduledParameterErrors):
            err = target.error(d.leak, d.leak_hat, d.omega_hat, error)
        elif isinstance(target, blt_workload.ParameterWorkload):
            err = blt_workload.parameter_error_arrays(d.leak, d.leak_hat, d.omega_hat, target, ctx.n_steps,
                                                      error, schedule)
        else:
            leaks, weights = blt.workload_terms_arrays(d.leak, d.leak_hat, d.omega_hat, target)
            err = blt.error_arrays(leaks, weights, ctx.n_steps, error, schedule)
        return np.log(sens2) + np.log(err)


def _free_from_log_complements(y: np.ndarray, n_steps: int) -> np.ndarray:
    # v for the increasing values y = -log(1 - x) in (0, y_max): the log shares of the gaps
    y_max = max_log_complement(n_steps)
    return np.log(np.diff(np.concatenate([[0.0], y, [y_max]])) / y_max)


def _initial_free(num_buffers: int, n_steps: int, top: float) -> np.ndarray:
    # 2B points evenly spaced in y = -log(1 - x) over (0, top]: decays from ~0 to ~1 - e^-top
    y_max = max_log_complement(n_steps)
    y = min(top, 0.9 * y_max) * np.arange(1, 2 * num_buffers + 1) / (2 * num_buffers)
    return _free_from_log_complements(y, n_steps)


def _separated_start(num_buffers: int, ctx: Participation):
    """The multi-participation start (time scales tau = 1 / (1 - x), y = log tau roughly).

    The optimum at (n, b, k) = (20000, 1000, 20) (found from many random starts, loss 912.43
    with 5 buffers) has three parts, and this start places them directly:
      - a near-constant buffer: tau_hat ~ 1.8 n, tau >> n (theta ~ 1, omega ~ 1e-3);
      - one pair at the participation gap: tau_hat ~ b / 13, tau ~ 0.64 b;
      - the other B - 2 pairs spread evenly in y over short time scales, up to about b / 40.
    None when B < 3 or b is too short for the three parts to separate (b < 64).
    """
    log_sep = math.log(ctx.min_sep)
    short_top = log_sep - 3.75
    if num_buffers < 3 or short_top < math.log(1.5):
        return None
    y_max = max_log_complement(ctx.n_steps)
    count = 2 * (num_buffers - 2)
    y_short = short_top * np.arange(1, count + 1) / count
    log_n = math.log(ctx.n_steps)
    tail = [log_sep - 2.6, log_sep - 0.45, log_n + 0.5, min(log_n + 10.0, 0.9 * y_max)]
    y = np.concatenate([y_short, tail])
    if not np.all(np.diff(y) > 0) or y[-1] >= y_max:
        return None
    return _free_from_log_complements(y, ctx.n_steps)


def _grown_start(v: np.ndarray, n_steps: int) -> np.ndarray:
    """The optimum for B buffers with one more pair of decays, as a start for B + 1.

    The new pair (theta_hat, theta) goes into the widest of the B + 1 gaps in y = -log(1 - x)
    that keep the decays interlaced (before theta_hat_1, between theta_i and theta_hat_(i+1),
    after theta_B), at its middle and 1% of it apart: its omega is then ~1% of a buffer's and C
    hardly changes, so the loss starts where B buffers ended and can only improve from there.
    """
    y_max = max_log_complement(n_steps)
    shares = np.exp(v - v.max())
    y = y_max * np.cumsum(shares)[:-1] / shares.sum()               # the 2B values
    edges = np.concatenate([[0.0], y[1::2]])                       # 0, theta_1, ..., theta_B
    ends = np.concatenate([y[0::2], [y_max]])                      # theta_hat_1, ..., theta_hat_B, y_max
    gap = int(np.argmax(ends - edges))
    middle, width = 0.5 * (edges[gap] + ends[gap]), 0.01 * (ends[gap] - edges[gap])
    grown = np.sort(np.concatenate([y, [middle - 0.5 * width, middle + 0.5 * width]]))
    return _free_from_log_complements(grown, n_steps)


def _initial_tops(ctx: Participation) -> tuple:
    """Longest initial decay time scales: the horizon, and for several participations also the
    number of participation periods n / b (the loss is multimodal there; both are tried)."""
    tops = (math.log(ctx.n_steps) + 1.0,)
    if ctx.effective_participations > 1 and ctx.min_sep > 1:
        tops += (math.log(ctx.n_steps / ctx.min_sep) + 2.0,)
    return tops


class _Stalled(Exception):
    """Raised by the objective once ``eval_window`` evaluations lowered the best value by less
    than the stall tolerance; ``_minimize`` returns the best point seen."""


class _Exhausted(_Stalled):
    """Raised by the objective before evaluation ``max_evaluations`` + 1."""


def _minimize(v0: np.ndarray, ctx, error, target, schedule, *, stall: float, max_iterations: int,
              eval_window: int | None = None, max_evaluations: int | None = None, basis=None,
              report: dict | None = None):
    """L-BFGS from v0 until stalled: _STALL_WINDOW iterations (``minimize_until_stalled``) or, given
    ``eval_window``, that many evaluations that lowered the best value by less than ``stall`` (or
    _QUIET_WINDOW that lowered it by less than _QUIET x ``stall``), or after ``max_evaluations``
    evaluations (then ``report["exhausted"]`` is set, given a ``report`` dict).

    The second rule is for the max-of-rows objective under a schedule: once converged, its line
    searches can spend many evaluations per iteration on changes in the 12th digit, so counting
    iterations alone lets a converged run go on for dozens of evaluations.

    ``basis`` (a (2B + 1, 2B + 1) matrix M, optional): L-BFGS runs in the coordinates z of
    v = v0 + M z (a preconditioner, ``_polish``); the complex-step probes are then v + i h M e_j,
    whose imaginary parts give M^T grad directly. The point returned is in v.
    """
    v0 = np.array(v0, dtype=np.float64)
    seen = {"f": math.inf, "x": v0, "history": [], "count": 0}
    directions = np.eye(v0.shape[0]) if basis is None else np.asarray(basis).T   # row j: probe direction j

    def objective(z):
        v = z if basis is None else v0 + basis @ z
        if max_evaluations is not None:
            if seen["count"] >= max_evaluations:
                raise _Exhausted
            seen["count"] += 1
        value, gradient = _value_and_gradient(v, directions, ctx, error, target, schedule)
        if eval_window is not None or max_evaluations is not None:
            if value < seen["f"]:
                seen["f"], seen["x"] = value, np.array(v)
        if eval_window is not None:
            history = seen["history"]
            history.append(seen["f"])
            if len(history) > eval_window and history[-eval_window - 1] - history[-1] < stall:
                raise _Stalled
            if len(history) > _QUIET_WINDOW and history[-_QUIET_WINDOW - 1] - history[-1] < _QUIET * stall:
                raise _Stalled  # converged: the line search only probes the last digits
        return value, gradient

    start = v0 if basis is None else np.zeros(v0.shape[0])
    try:
        x, value, _ = minimize_until_stalled(
            objective, start, stall=stall, window=_STALL_WINDOW, max_iterations=max_iterations,
            ftol=1e-13, gtol=1e-10, maxcor=30,
        )
    except _Exhausted:
        if report is not None:
            report["exhausted"] = True
        return seen["x"], seen["f"]
    except _Stalled:
        return seen["x"], seen["f"]
    return (x if basis is None else v0 + basis @ x), value


def _value_and_gradient(v: np.ndarray, directions: np.ndarray, ctx, error, target, schedule):
    """The loss at v and its derivatives along the rows of ``directions``: one complex-step
    probe per direction, all sharing the real part v."""
    loss = _loss(v[None, :] + (1j * _STEP) * directions, ctx, error, target, schedule)
    return float(loss[0].real), loss.imag / _STEP


def _preconditioner(v: np.ndarray, ctx, error, target, schedule) -> np.ndarray | None:
    """M with M^T H M ~ I for the Hessian H of the loss at v (forward differences of the exact
    complex-step gradients, step _HESSIAN_STEP, 2B + 2 evaluations).

    H is symmetrized and its eigenvalues replaced by max(|lambda|, _HESSIAN_FLOOR max|lambda|):
    the max over integer rows has small kinks (the arg max moves a row at a time), so the
    difference quotient is only an estimate, and the direction v + c (1, ..., 1), along which
    the softmax parametrization is constant, has lambda ~ 0. None if a quotient is not finite.
    """
    size = v.shape[0]
    axes = np.eye(size)
    _, g0 = _value_and_gradient(v, axes, ctx, error, target, schedule)
    hessian = np.empty((size, size))
    for j in range(size):
        step = np.zeros(size)
        step[j] = _HESSIAN_STEP
        hessian[:, j] = (_value_and_gradient(v + step, axes, ctx, error, target, schedule)[1] - g0) / _HESSIAN_STEP
    hessian = 0.5 * (hessian + hessian.T)
    if not np.all(np.isfinite(hessian)):
        return None
    lam, vectors = np.linalg.eigh(hessian)
    lam = np.abs(lam)
    lam = np.maximum(lam, _HESSIAN_FLOOR * lam.max())
    if not lam.max() > 0.0:
        return None
    return vectors / np.sqrt(lam)


def _polish(v: np.ndarray, ctx, error, target, schedule, scheduled: bool) -> np.ndarray:
    """The chosen count's optimum to about the 8th digit of the loss (``_POLISH_STALL``).

    Without a schedule: L-BFGS from v (unchanged). Under a schedule the optimum lies in a curved,
    ill-conditioned valley (at n = 1e5, Nesterov, 5 buffers the polish moves the fastest buffer's
    1 - theta from 0.10 to 0.28 for 2.7e-5 of log-loss, and the straight line between the two
    points rises by 4e-3), where L-BFGS from scratch creeps: 150 iterations, 175 evaluations. So
    L-BFGS first runs as before for up to _POLISH_PROBE evaluations (a converged or stalled
    run ends there, with the same iterates as before); a run still going is continued from its
    best point in coordinates preconditioned by the estimated Hessian (``_preconditioner``),
    where the same stall rules apply, for at most _POLISH_BUDGET evaluations. At n = 1e6 the
    polish takes 41-55 evaluations (8 plain, 12 for the Hessian, the rest preconditioned) instead
    of 73-109, at the same or a lower loss; with Nesterov at n = 1e4 and 1e5 the budget ends it
    8.4e-6 and 1.0e-6 (relative loss) above where 64 and 73 more evaluations would have crept.
    """
    if not scheduled:
        v, _ = _minimize(v, ctx, error, target, schedule, stall=_POLISH_STALL, max_iterations=_POLISH_ITERATIONS)
        return v
    rules = dict(stall=_POLISH_STALL, max_iterations=_POLISH_ITERATIONS, eval_window=_SCHEDULED_EVAL_WINDOW)
    report = {}
    v, loss = _minimize(v, ctx, error, target, schedule, max_evaluations=_POLISH_PROBE, report=report, **rules)
    if not report.get("exhausted"):
        return v  # converged or stalled within _POLISH_PROBE evaluations: as before
    # (tiny linear algebra: BLAS threads only add latency, as in ``minimize_until_stalled``)
    with np.errstate(all="ignore"), threadpool_limits(limits=1, user_api="blas"):
        basis = _preconditioner(v, ctx, error, target, schedule)
    # (a non-finite difference quotient, basis None: continue without the preconditioner)
    v2, loss2 = _minimize(v, ctx, error, target, schedule, basis=basis, max_evaluations=_POLISH_BUDGET, **rules)
    return v2 if loss2 <= loss else v


def optimize(
    ctx: Participation,
    *,
    error: str = "max",
    max_buffers: int = 10,
    momentum: float = 1.0,
    lr_schedule: np.ndarray | None = None,
    workload: blt_workload.ParameterWorkload | None = None,
    min_gain: float = BUFFER_GAIN,
) -> OptimizeResult:
    """The BLT minimizing sens^2 x error for ``ctx``, rounded for float32 and re-checked.

    The error is that of the workload W = D_eta M_beta (``momentum``, the seed's meaning) or,
    given ``workload``, of SGD's parameter trajectory W = S D_eta M (``blt_workload.ParameterWorkload``;
    ``momentum`` is then ignored). Sensitivity depends on C only. ``min_gain`` is the relative
    gain a buffer must bring (``BUFFER_GAIN``; ``-inf`` forces ``max_buffers``, for comparisons).
    """
    target = momentum if workload is None else workload  # _loss and _finish dispatch on its type
    if ctx.n_steps == 1:
        # One step: C = [1] whatever the buffers; the identity-like 1-buffer BLT with omega = 0.
        params = blt.BLTParams(np.array([0.5]), np.array([0.0]))
        return _finish(params, ctx, target, lr_schedule, ())
    steer = target
    if workload is not None and error == "max" and (lr_schedule is not None or workload.effective_dampening > 0.0):
        steer = ScheduledParameterErrors(np.ones(ctx.n_steps) if lr_schedule is None else lr_schedule, workload)
    best_v, best_loss, losses = None, math.inf, []
    # Explore buffer counts with a stall tolerance 100x finer than BUFFER_GAIN, then polish
    # the chosen count to the 9th digit of the loss.
    scheduled = isinstance(steer, ScheduledParameterErrors)
    explore_stall = _SCHEDULED_EXPLORE_STALL if scheduled else _EXPLORE_STALL
    eval_window = _SCHEDULED_EVAL_WINDOW if scheduled else None
    for num_buffers in range(1, max_buffers + 1):
        # Under a schedule the optimum's slowest buffer is shorter than the horizon (late noise
        # is multiplied by small learning rates); from 3 buffers on, a start spread up to the
        # horizon can end in a basin that wastes one, so a start spread to n / e races it.
        extra_top = scheduled and num_buffers >= 3
        tops = _initial_tops(ctx) + ((math.log(ctx.n_steps) - 1.0,) if extra_top else ())
        starts = [_initial_free(num_buffers, ctx.n_steps, top) for top in tops]
        if ctx.effective_participations > 1:
            separated = _separated_start(num_buffers, ctx)
            if separated is not None:
                starts.append(separated)
        if len(starts) > 1:  # a short race between the starts, then only the leader continues
            race = _SCHEDULED_RACE_ITERATIONS if scheduled else _RACE_ITERATIONS
            raced = [_minimize(v0, ctx, error, steer, lr_schedule, stall=explore_stall,
                               eval_window=eval_window, max_iterations=race) for v0 in starts]
            starts = [min(raced, key=lambda start: start[1])[0]]
        v, loss = _minimize(starts[0], ctx, error, steer, lr_schedule, stall=explore_stall,
                            eval_window=eval_window, max_iterations=_EXPLORE_ITERATIONS)
        if scheduled and best_v is not None and loss > best_loss:
            # The spread starts ended above B - 1 buffers: their basin, not the count. The
            # B - 1 optimum with one more buffer starts where B - 1 ended.
            grown, grown_loss = _minimize(_grown_start(best_v, ctx.n_steps), ctx, error, steer, lr_schedule,
                                          stall=explore_stall, eval_window=eval_window,
                                          max_iterations=_EXPLORE_ITERATIONS)
            if grown_loss < loss:
                v, loss = grown, grown_loss
        losses.append(math.exp(loss))
        if loss >= best_loss + math.log1p(-min_gain):
            break  # this buffer is not worth its memory: keep the smaller count
        best_v, best_loss = v, loss
    best_v = _polish(best_v, ctx, error, steer, lr_schedule, scheduled)
    d = decays_from_free(best_v, max_log_complement(ctx.n_steps))
    params = blt.BLTParams(d.theta, d.omega)
    return _finish(params, ctx, target, lr_schedule, tuple(losses))


def _finish(params, ctx, target, lr_schedule, losses) -> OptimizeResult:
    rounded = blt.round_for_float32(params)
    blt.check_minsep_preconditions(rounded)
    sens2 = blt.minsep_sensitivity_squared(rounded, ctx)
    if isinstance(target, blt_workload.ParameterWorkload):
        rows = blt_workload.parameter_per_query_errors(rounded, ctx.n_steps, target, lr_schedule)
        max_err, mean_err = float(rows.max()), float(rows.mean())
    elif lr_schedule is None:
        max_err = blt.max_error(rounded, ctx.n_steps, target)
        mean_err = blt.mean_error(rounded, ctx.n_steps, target)
    else:
        rows = blt.per_query_errors(rounded, ctx.n_steps, target, lr_schedule)
        max_err, mean_err = float(rows.max()), float(rows.mean())
    return OptimizeResult(
        params=rounded, sensitivity=math.sqrt(sens2), max_loss=sens2 * max_err,
        mean_loss=sens2 * mean_err, loss_by_buffers=losses,
    )
