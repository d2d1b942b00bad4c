"""Strategy recipes and the mechanism they resolve to for one participation context.

A *recipe* (``blt_strategy(...)``, ``identity_strategy()``) is a small frozen value that says
how to build a strategy matrix C. ``recipe.resolve(n_steps, min_sep, max_participations)``
turns it into a :class:`Mechanism`: the concrete parameters, their sensitivity for that
participation, and their utility. Resolution is a pure, cached function of (recipe, context),
so the accountant and the noise engine see bit-identical parameters.

Notation (paper symbol -> name here): C = strategy matrix, C^{-1} = noising matrix,
b = ``min_sep``, k = ``max_participations``, theta = buffer decays, omega = output scales.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from opake.dpftrl.strategies import blt, blt_workload
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError

_ERRORS = ("max", "mean")
_WORKLOADS = ("updates", "parameters")


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.array(array, dtype=np.float64, copy=True)
    array.setflags(write=False)
    return array


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(np.ascontiguousarray(part, dtype=np.float64).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.hexdigest()[:32]


@dataclass(frozen=True, eq=False)
class Mechanism:
    """A resolved strategy: C for one participation context, with its sensitivity and utility.

    For a BLT, ``theta`` and ``omega`` are float64 arrays whose values are exactly
    representable in float32 in the form the noise engine uses (``omega`` and
    ``one_minus_theta = 1 - theta``), so the float32 and float64 engines run exactly the
    mechanism that was accounted for. The identity strategy has zero buffers.

    ``sensitivity`` is S (not squared) for ``participation``: the L2 sensitivity of C G for
    gradients clipped to norm 1, add/remove adjacency. ``max_loss`` and ``mean_loss`` are
    S^2 times the max / mean per-step error of the (weighted) prefix-sum workload.
    """

    recipe: object
    participation: Participation
    theta: np.ndarray
    omega: np.ndarray
    sensitivity: float
    max_loss: float
    mean_loss: float
    schedule_fingerprint: str | None = None
    fingerprint: str = field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "theta", _readonly(self.theta))
        object.__setattr__(self, "omega", _readonly(self.omega))
        if not self.fingerprint:
            # the canonical context: max_participations=None and its explicit equivalent
            # resolve identically, so they must not give two fingerprints
            fp = _digest(
                type(self.recipe).__name__, self.recipe, self.participation.canonical,
                self.theta, self.omega, self.schedule_fingerprint,
            )
            object.__setattr__(self, "fingerprint", fp)

    @property
    def num_buffers(self) -> int:
        return int(self.theta.shape[0])

    @property
    def bands(self) -> int | None:
        """Width of C's band: 1 for the identity (no buffers), None for a BLT (not banded)."""
        return 1 if self.num_buffers == 0 else None

    @property
    def state_rows(self) -> int:
        """Rows of d floats the noise engine keeps: one per buffer."""
        return self.num_buffers

    def inverse_coefficients(self, n: int | None = None) -> np.ndarray:
        """First column of C^{-1} for ``n`` steps (default the context's n_steps): the identity's
        e_0, or the coefficients of the BLT of C^{-1} (Inv25; ``blt.inverse``)."""
        n = self.participation.n_steps if n is None else int(n)
        if self.num_buffers == 0:
            column = np.zeros(n)
            column[:1] = 1.0
            return column
        return blt.coefficients(blt.inverse(self.params), n)

    def noise_row_norms_squared(self, n: int | None = None) -> np.ndarray:
        """||row t of C^{-1}||^2 for t < n: the variance of each coordinate of step t's noise
        C^{-1} z, per unit of (noise_multiplier * clip / normalization)^2; C^{-1} is Toeplitz, so
        row t holds the first t + 1 inverse coefficients and this is their cumulative sum of squares."""
        return np.cumsum(np.square(self.inverse_coefficients(n)))

    def leading(self, participation: Participation, recipe) -> "Mechanism":
        """The leading ``participation.n_steps`` rows of C as a mechanism of ``recipe`` for that
        context (``PrefixStrategy``): the same coefficients, the sensitivity recomputed."""
        if self.num_buffers == 0:
            identity = identity_strategy().resolve(participation)
            return Mechanism(recipe=recipe, participation=participation, theta=identity.theta, omega=identity.omega,
                             sensitivity=identity.sensitivity, max_loss=identity.max_loss,
                             mean_loss=identity.mean_loss)
        return mechanism_from_blt(self.params, participation, recipe=recipe)

    def streaming_description(self) -> dict:
        """The plain arrays the noise engine streams C^{-1} from (``inverse_from_description``)."""
        if self.num_buffers == 0:
            return {"kind": "identity"}
        return {"kind": "blt", "omega": [float(v) for v in self.omega],
                "one_minus_theta": [float(v) for v in self.one_minus_theta]}

    @property
    def one_minus_theta(self) -> np.ndarray:
        """1 - theta, exact in float64 (and exactly representable in float32)."""
        out = 1.0 - self.theta
        out.setflags(write=False)
        return out

    @property
    def params(self) -> blt.BLTParams:
        return blt.BLTParams(self.theta, self.omega)

    def toeplitz_coefficients(self, n: int | None = None) -> np.ndarray:
        """First column c_0..c_{n-1} of C (default n = the context's n_steps)."""
        n = self.participation.n_steps if n is None else n
        return blt.coefficients(self.params, n)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mechanism) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return (
            f"Mechanism({type(self.recipe).__name__}, {self.participation}, "
            f"num_buffers={self.num_buffers}, sensitivity={self.sensitivity:.6g}, "
            f"max_loss={self.max_loss:.6g}, mean_loss={self.mean_loss:.6g})"
        )


def _context(n_steps, min_sep, max_participations) -> Participation:
    if isinstance(n_steps, Participation):
        return n_steps
    return Participation(n_steps, min_sep, max_participations)


# ---------------------------------------------------------------------------------------------
# Identity strategy (DP-SGD: C = I, no correlation)


@dataclass(frozen=True)
class IdentityStrategy:
    """C = I: independent Gaussian noise at every step (DP-SGD), zero buffers."""

    bands = 1  # C = I is banded with one band (Band23 Thm 4 applies)

    def resolve(self, n_steps, min_sep: int = 1, max_participations: int | None = None) -> Mechanism:
        ctx = _context(n_steps, min_sep, max_participations)
        k = ctx.effective_participations
        n = ctx.n_steps
        # Prefix sums of independent noise: e_t = t + 1, so max = n and mean = (n + 1) / 2.
        return Mechanism(
            recipe=self, participation=ctx, theta=np.zeros(0), omega=np.zeros(0),
            sensitivity=math.sqrt(k), max_loss=float(k * n), mean_loss=float(k * (n + 1) / 2),
        )


def identity_strategy() -> IdentityStrategy:
    """The identity strategy C = I (plain DP-SGD noise)."""
    return IdentityStrategy()


# ---------------------------------------------------------------------------------------------
# BLT recipe


def _check_schedule_values(values: np.ndarray, n_steps: int) -> np.ndarray:
    if values.ndim != 1 or values.shape[0] != n_steps:
        raise InvalidArgumentError(
            f"lr_schedule must give one value per step: expected {n_steps} values, got shape {values.shape}"
        )
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        bad = int(np.flatnonzero(~(np.isfinite(values) & (values > 0)))[0])
        raise InvalidArgumentError(
            f"lr_schedule values must be finite and > 0; step {bad} has {values[bad]!r}"
        )
    return values


# Schedules up to this many values are repr'd in full (the fingerprints of recipes resolved
# before long schedules were summarized stay the same); longer ones by length and digest.
_SCHEDULE_REPR_VALUES = 16


def _schedule_repr(schedule, values=None) -> str:
    """The repr of a stored schedule; long tuples as ``<n values sha256:...>``.

    Mechanism fingerprints digest the recipe's repr, and repr-ing a 1e6-float tuple costs about
    a second. The summary still depends on every value (a sha256 of the float64 bytes), and the
    fingerprint digests the values once more through ``schedule_fingerprint``.
    """
    if isinstance(schedule, tuple) and len(schedule) > _SCHEDULE_REPR_VALUES:
        values = np.asarray(schedule, dtype=np.float64) if values is None else values
        digest = hashlib.sha256(np.ascontiguousarray(values, dtype=np.float64).tobytes()).hexdigest()[:16]
        return f"<{len(schedule)} values sha256:{digest}>"
    return repr(schedule)


@dataclass(frozen=True, repr=False)
class BLTStrategy:
    """Recipe for a Buffered Linear Toeplitz strategy (BLT24, UseBLT24).

    Fields:
      max_buffers: upper bound on the number of buffers B (1..20). The optimizer grows B from 1
        and stops when one more buffer improves the loss by less than ``BUFFER_GAIN`` (relative),
        or at ``max_buffers``; the smallest B reaching the best loss is kept, since every buffer
        costs d floats of training memory.
      error: "max" or "mean" prefix-sum error (of the workload weighted by the schedule).
      momentum: beta. With ``workload="updates"``: beta in (0, 1] of the workload
        W[t, s] = eta_t * beta^(t - s) (the seed's meaning; beta = 1 is prefix sums). With
        ``workload="parameters"``: torch.optim.SGD's momentum, in [0, 1) (0 = plain SGD).
      workload: "updates" (default, W = D_eta M_beta: each step's update) or "parameters"
        (W = S D_eta M: the noise in the parameters of torch.optim.SGD with this momentum,
        dampening, nesterov and lr schedule; see ``blt_workload.ParameterWorkload``).
      dampening, nesterov: torch.optim.SGD's, for ``workload="parameters"`` only.
      lr_schedule: None, a sequence of n_steps positive values eta_t, or a deterministic
        callable step -> eta_t. A sequence is stored as a tuple and takes part in equality; a
        callable takes part by identity, and the resolved mechanism carries a fingerprint of the
        values it produced, so accounting and noise can check they used the same schedule.
    """

    max_buffers: int = 10
    error: str = "max"
    momentum: float = 1.0
    lr_schedule: tuple | Callable[[int], float] | None = None
    workload: str = "updates"
    dampening: float = 0.0
    nesterov: bool = False

    def __repr__(self) -> str:
        # Mechanism fingerprints digest this repr: the fields added with ``workload`` appear
        # only when they differ from their defaults, so earlier recipes keep their fingerprints.
        parts = [f"max_buffers={self.max_buffers!r}", f"error={self.error!r}",
                 f"momentum={self.momentum!r}",
                 f"lr_schedule={_schedule_repr(self.lr_schedule, self.__dict__.get('_schedule_array'))}"]
        if self.workload != "updates" or self.dampening != 0.0 or self.nesterov:
            parts += [f"workload={self.workload!r}", f"dampening={self.dampening!r}",
                      f"nesterov={self.nesterov!r}"]
        return f"BLTStrategy({', '.join(parts)})"

    def __post_init__(self):
        mb = self.max_buffers
        if isinstance(mb, bool) or not isinstance(mb, numbers.Integral) or not 1 <= mb <= 20:
            raise InvalidArgumentError(f"max_buffers must be an integer in 1..20, got {mb!r}")
        object.__setattr__(self, "max_buffers", int(mb))
        if self.error not in _ERRORS:
            raise InvalidArgumentError(f"error must be one of {_ERRORS}, got {self.error!r}")
        if self.workload not in _WORKLOADS:
            raise InvalidArgumentError(f"workload must be one of {_WORKLOADS}, got {self.workload!r}")
        beta = self.momentum
        if self.workload == "parameters":
            if isinstance(beta, numbers.Real) and not isinstance(beta, bool) and float(beta) == 1.0:
                raise InvalidArgumentError(
                    "workload='parameters' models torch.optim.SGD, whose momentum must be in [0, 1); "
                    "got momentum=1.0 (the default of workload='updates'): pass momentum=0.0 for plain SGD"
                )
            sgd = self.parameter_workload  # validates momentum, dampening and nesterov
            object.__setattr__(self, "momentum", sgd.momentum)
            object.__setattr__(self, "dampening", sgd.dampening)
        else:
            if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not (0.0 < float(beta) <= 1.0):
                raise InvalidArgumentError(f"momentum must be a number in (0, 1], got {beta!r}")
            object.__setattr__(self, "momentum", float(beta))
            if self.dampening != 0.0 or self.nesterov is not False:
                raise InvalidArgumentError("dampening and nesterov describe torch.optim.SGD and apply to "
                                           "workload='parameters' only; the 'updates' workload has neither")
        schedule = self.lr_schedule
        if schedule is not None and not callable(schedule):
            try:
                values = np.asarray(schedule, dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"lr_schedule must be a sequence of numbers or a callable: {exc}") from None
            if values.ndim != 1 or values.shape[0] < 1:
                raise InvalidArgumentError(f"lr_schedule must be a 1-D sequence, got shape {values.shape}")
            _check_schedule_values(values, values.shape[0])
            object.__setattr__(self, "lr_schedule", tuple(values.tolist()))  # Python floats
            # the float64 values, kept so that resolve and repr need not convert the tuple again
            # (not a field: equality and hashing see the tuple only)
            object.__setattr__(self, "_schedule_array", _readonly(values))

    @property
    def parameter_workload(self) -> blt_workload.ParameterWorkload | None:
        """The SGD parameter workload of ``workload="parameters"``, else None."""
        if self.workload != "parameters":
            return None
        return blt_workload.ParameterWorkload(self.momentum, self.dampening, self.nesterov)

    def schedule_values(self, n_steps: int) -> np.ndarray | None:
        """The schedule eta_0..eta_{n-1} as float64, validated; None without a schedule."""
        schedule = self.lr_schedule
        if schedule is None:
            return None
        if callable(schedule):
            try:
                values = np.array([float(schedule(t)) for t in range(n_steps)], dtype=np.float64)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"lr_schedule callable must return a number for every step: {exc}") from None
        else:
            values = self.__dict__.get("_schedule_array")
            if values is None:
                values = np.asarray(schedule, dtype=np.float64)
        return _check_schedule_values(values, n_steps)

    def resolve(self, n_steps, min_sep: int = 1, max_participations: int | None = None) -> Mechanism:
        """The optimized BLT for this participation context (deterministic, cached)."""
        ctx = _context(n_steps, min_sep, max_participations)
        values = self.schedule_values(ctx.n_steps)
        fingerprint = None if values is None else _digest(values)
        # The cache key holds the schedule's values through their fingerprint, so a callable
        # that changed what it returns can never hit a stale entry.
        key = dataclasses.replace(self, lr_schedule=None)
        return _resolve_blt(key, ctx, fingerprint, None if values is None else values.tobytes(), self)


@functools.lru_cache(maxsize=256)
def _resolve_blt(key: BLTStrategy, ctx: Participation, fingerprint, schedule_bytes, recipe) -> Mechanism:
    from opake.dpftrl.strategies import blt_optimize

    schedule = None if schedule_bytes is None else np.frombuffer(schedule_bytes, dtype=np.float64)
    result = blt_optimize.optimize(
        ctx, error=key.error, max_buffers=key.max_buffers, momentum=key.momentum, lr_schedule=schedule,
        workload=key.parameter_workload,
    )
    return Mechanism(
        recipe=recipe, participation=ctx, theta=result.params.theta, omega=result.params.omega,
        sensitivity=result.sensitivity, max_loss=result.max_loss, mean_loss=result.mean_loss,
        schedule_fingerprint=fingerprint,
    )


def blt_strategy(
    max_buffers: int = 10,
    error: str = "max",
    momentum: float = 1.0,
    lr_schedule: Sequence[float] | Callable[[int], float] | None = None,
    *,
    workload: str = "updates",
    dampening: float = 0.0,
    nesterov: bool = False,
) -> BLTStrategy:
    """A BLT strategy recipe; resolve it for a participation context to get the mechanism.

    >>> strategy = blt_strategy(max_buffers=10)
    >>> mech = strategy.resolve(n_steps=5000, min_sep=100, max_participations=5)

    For training with ``torch.optim.SGD(lr=eta_t, momentum=0.9)``, optimize the noise in the
    parameters: ``blt_strategy(workload="parameters", momentum=0.9, lr_schedule=eta)``.
    """
    return BLTStrategy(max_buffers=max_buffers, error=error, momentum=momentum, lr_schedule=lr_schedule,
                       workload=workload, dampening=dampening, nesterov=nesterov)


def mechanism_from_blt(params: blt.BLTParams, participation: Participation, recipe=None) -> Mechanism:
    """A Mechanism for hand-chosen BLT parameters (tests, experiments); checks the preconditions.

    The parameters are used exactly as given (no float32 rounding): pass values from
    ``blt.round_for_float32`` to make the float32 engine run exactly this mechanism.
    """
    blt.check_minsep_preconditions(params)
    sens2 = blt.minsep_sensitivity_squared(params, participation)
    n = participation.n_steps
    return Mechanism(
        recipe=recipe, participation=participation, theta=params.theta, omega=params.omega,
        sensitivity=math.sqrt(sens2), max_loss=sens2 * blt.max_error(params, n),
        mean_loss=sens2 * blt.mean_error(params, n),
    )
