"""Plan a run: resolve strategies for a participation context and calibrate them to a budget.

For each strategy the noise multiplier is the smallest one meeting (epsilon, delta) for the
context, without amplification (``mf_gaussian``: one Gaussian with noise multiplier
sigma / S). With clipping norm 1, the error of step t's prefix sum of noisy gradients has
standard deviation sigma * sqrt(e_t), so the table's RMSE values are sigma * sqrt(max_t e_t)
and sigma * sqrt(mean_t e_t); strategies are compared at equal privacy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opake.accounting import calibrate, epsilon_budget
from opake.dpftrl.accounting import mf_gaussian
from opake.dpftrl.noise import blt_strategy, identity_strategy
from opake.dpftrl.participation import Participation

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PlanRow:
    name: str
    strategy: object
    mechanism: object
    noise_multiplier: float
    epsilon: float
    delta: float
    rmse_max: float
    rmse_mean: float
    state_bytes_per_parameter: int


@dataclass(frozen=True)
class Plan:
    participation: Participation
    epsilon: float
    delta: float
    rows: tuple


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
) -> Plan:
    """Calibrated comparison of BLT, DP-SGD (identity) and any ``extra_strategies`` (name, recipe)."""
    ctx = Participation(n_steps, min_sep, max_participations)
    budget = epsilon_budget(epsilon, delta)
    strategies = (("BLT", blt_strategy(max_buffers=max_buffers, error=error)),) + tuple(extra_strategies) + (
        ("DP-SGD", identity_strategy()),
    )
    rows = []
    for name, strategy in strategies:
        mech = strategy.resolve(ctx)
        result = calibrate(
            budget,
            lambda sigma, s=strategy: mf_gaussian(sigma, s, ctx.n_steps, ctx.min_sep, ctx.max_participations),
            param_min=1e-3, param_max=1e4,
        )
        sigma = result.param
        error_max = mech.max_loss / mech.sensitivity**2
        error_mean = mech.mean_loss / mech.sensitivity**2
        rows.append(PlanRow(
            name=name, strategy=strategy, mechanism=mech, noise_multiplier=sigma,
            epsilon=result.epsilon, delta=result.delta,
            rmse_max=sigma * math.sqrt(error_max), rmse_mean=sigma * math.sqrt(error_mean),
            state_bytes_per_parameter=_FLOAT32_BYTES * _state_floats(mech),
        ))
    return Plan(participation=ctx, epsilon=float(epsilon), delta=float(delta), rows=tuple(rows))


def _state_floats(mech) -> int:
    """Noise-state floats per model parameter: one per buffer (BLT) or per band (BandMF)."""
    coefs = getattr(mech, "coefs", None)
    if coefs is not None:
        return max(0, len(coefs) - 1)
    return mech.num_buffers
