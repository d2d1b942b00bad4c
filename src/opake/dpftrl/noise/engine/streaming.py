"""Streaming inverses: how one step of x = C^{-1} z is computed from a small state.

The noise engine does not know which strategy it runs. It holds a (B, d) buffer tensor and, at
every step, hands one contiguous stretch of z (overwritten in place by x) and the matching
columns of the buffers to a *streaming inverse*: a small frozen value that says how many buffer
rows it needs and how to advance them. Each strategy family resolves to one:

- :class:`IdentityInverse` (C = I, DP-SGD): no buffers, x_t = z_t.
- :class:`BufferedInverse` (BLT, BLT24 / UseBLT24 Alg. 2): B decaying buffers of past outputs,
  using C's own parameters (theta, omega); docs/math.md section 2.
- :class:`BandedInverse` (BandMF, Band23): a ring of the last ``bands - 1`` outputs.

Every one is elementwise across the d columns: column j of the buffers only ever meets element
j of z, so the engine may process the columns in any grouping and get the same numbers.

Protocol: ``coefficients(dtype, device)`` once per engine (whatever does not change), then per
step ``at_step(coefficients, step)`` (the step's small coefficient tensors, computed once and
shared by every stretch of columns) and ``advance(x, buffers, step_coefficients)`` on each
stretch. A new strategy family plugs in by adding a class with these members plus
``num_buffers``, ``check_dtype`` and ``describe``, one kind in :func:`inverse_from_description`,
and a mechanism whose ``streaming_description()`` names it; the engine core stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from opake.errors import InvalidArgumentError

__all__ = ["BandedInverse", "BufferedInverse", "IdentityInverse", "streaming_inverse"]


def _exact_in(values: np.ndarray, dtype: torch.dtype) -> bool:
    if dtype == torch.float64:
        return True
    numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype)
    if numpy_dtype is None:
        return False
    return bool(np.all(values.astype(numpy_dtype).astype(np.float64) == values))


@dataclass(frozen=True)
class IdentityInverse:
    """C = I: the noise is z itself, no buffers."""

    num_buffers: int = 0

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Every dtype represents the identity exactly."""

    def coefficients(self, dtype: torch.dtype, device: torch.device) -> tuple:
        return ()

    def at_step(self, coefficients: tuple, step: int) -> tuple:
        return ()

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, step_coefficients: tuple) -> None:
        """x_t = z_t: nothing to do."""

    def describe(self) -> dict:
        return {"kind": "identity"}


@dataclass(frozen=True)
class BufferedInverse:
    """x = C^{-1} z for a BLT C with decays theta and output scales omega (docs/math.md section 2).

    Recurrence (docs/math.md section 2, C^{-1} with C's own parameters), per column:
        x_t = z_t - sum_i omega_i S_i ;   then S_i <- theta_i S_i + x_t.

    Stored form. Applied literally that is three passes over the (B, n) buffers per step (sum,
    decay, add). The buffers instead hold R_i = theta_i^-(t - e_i) S_i, with e_i the start of
    buffer i's current *epoch* (a multiple of its period K_i, see :func:`renormalization_periods`),
    so the decay moves into per-step scalars:
        x_t = z_t - sum_i (omega_i theta_i^(t-1-e_i)) R_i      (one matrix-vector product)
        R_i <- R_i + theta_i^-(t-e_i) x_t                     (one broadcast multiply-add)
    two passes, the second read-modify-write like the floor's. When step t opens a new epoch of
    buffer i, R_i is first multiplied by theta_i^K_i (its S_i(t-1), times theta_i, in the new
    epoch's scale): one more pass over that row once every K_i steps. K_i keeps the factors
    theta_i^-(t-e_i) below 2**32, far inside float32's range.

    The scalars are computed in float64 from log(theta_i) = log1p(-(1 - theta_i)), so decays within
    1e-12 of 1 keep their decay (as theta in float32 they would be 1.0), and each is rounded once
    to the compute dtype: the rounding is of the same size as that of the literal recurrence,
    and, like it, identical for every column, so any grouping of the columns gives the same bits.

    Stored as ``omega`` and ``one_minus_theta`` (tuples of float64) because 1 - theta is the exact
    form of a decay near 1.
    """

    omega: tuple[float, ...]
    one_minus_theta: tuple[float, ...]

    def __post_init__(self):
        omega = np.asarray(self.omega, dtype=np.float64).reshape(-1)
        one_minus_theta = np.asarray(self.one_minus_theta, dtype=np.float64).reshape(-1)
        if omega.shape != one_minus_theta.shape or omega.size == 0:
            raise InvalidArgumentError(
                f"a BLT needs as many output scales as decays (at least one); got "
                f"{omega.size} omega and {one_minus_theta.size} theta values"
            )
        theta = 1.0 - one_minus_theta
        if not (np.all(np.isfinite(omega)) and np.all(np.isfinite(one_minus_theta))):
            raise InvalidArgumentError("BLT parameters must be finite; got theta={theta}, omega={omega}".format(
                theta=theta.tolist(), omega=omega.tolist()))
        # The preconditions under which the resolved sensitivity is valid (docs/math.md section 4):
        # outside them the accounting does not describe the noise this engine would add.
        if np.any(one_minus_theta < 0.0) or np.any(one_minus_theta > 1.0):
            raise InvalidArgumentError(
                f"BLT decays theta must lie in [0, 1], got {theta.tolist()}; resolve the strategy "
                f"with blt_strategy(...) or check the hand-made parameters"
            )
        if np.any(omega < 0.0):
            raise InvalidArgumentError(f"BLT output scales omega must be >= 0, got {omega.tolist()}")
        if math.fsum(omega.tolist()) > 1.0:
            raise InvalidArgumentError(
                f"BLT output scales must sum to at most 1 (got sum(omega) = {math.fsum(omega.tolist())!r}); "
                f"outside this range the min-sep sensitivity theorem does not hold"
            )
        object.__setattr__(self, "omega", tuple(float(v) for v in omega))
        object.__setattr__(self, "one_minus_theta", tuple(float(v) for v in one_minus_theta))

    @property
    def num_buffers(self) -> int:
        return len(self.omega)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse a compute dtype that would round the parameters (a different mechanism)."""
        omega = np.asarray(self.omega)
        one_minus_theta = np.asarray(self.one_minus_theta)
        if not (_exact_in(omega, dtype) and _exact_in(one_minus_theta, dtype)):
            raise InvalidArgumentError(
                f"the BLT parameters are not exactly representable in {dtype}, so the noise would "
                f"come from a slightly different mechanism than the one accounted for; resolve "
                f"the strategy with blt_strategy(...) (its parameters are float32-exact), round "
                f"hand-made ones with opake.dpftrl.strategies.blt.round_for_float32, or pass "
                f"dtype=torch.float64"
            )

    def coefficients(self, dtype: torch.dtype, device: torch.device) -> _BLTScalars:
        """The float64 data every step's scalars come from, and a table of the scalars of
        ``_WINDOW`` consecutive steps, filled on demand by :meth:`at_step`."""
        one_minus_theta = np.asarray(self.one_minus_theta)
        with np.errstate(divide="ignore"):
            log_theta = np.log1p(-one_minus_theta)  # -inf for theta = 0
        return _BLTScalars(dtype, device, np.asarray(self.omega), log_theta, renormalization_periods(one_minus_theta))

    def at_step(self, coefficients: _BLTScalars, step: int) -> tuple:
        """(read, renormalize, add) for step ``step`` (see the class docstring):

        - ``read``: (B,) tensor, omega_i theta_i^(t-1-e_i(t-1)), the weights of the stored R(t-1);
        - ``renormalize``: ((row, theta_row^K_row), ...) for the buffers whose epoch starts at t;
        - ``add``: (B, 1) tensor, theta_i^-(t-e_i(t)), the weight of x_t in the new R_i(t).

        Computed for ``_WINDOW`` steps at once (one set of numpy and host-to-device operations
        instead of one per step); every value is elementwise the same computation as for a
        single step, so the window changes no bit.
        """
        return coefficients.at(step)

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, step_coefficients: tuple) -> None:
        """One step on a stretch of columns: x holds z_t on entry and x_t on exit; ``buffers``
        is the matching (B, n) column slice of the state (rows strided by d)."""
        read, renormalize, add = step_coefficients
        x.addmv_(buffers.t(), read, alpha=-1)
        for row, factor in renormalize:
            buffers[row].mul_(factor)
        buffers.addcmul_(add, x)

    def describe(self) -> dict:
        return {"kind": "blt", "omega": list(self.omega), "one_minus_theta": list(self.one_minus_theta)}


@dataclass(frozen=True)
class BandedInverse:
    """x = C^{-1} z for a banded lower-triangular Toeplitz C (BandMF, Band23).

    ``coefs`` is C's first column c_0, ..., c_{bands-1} (c_0 > 0). Forward substitution keeps
    the last m = bands - 1 outputs in a ring of m buffer rows; row r holds x_s for the latest
    s < t with s = r (mod m):
        x_t = (z_t - sum_{k=1}^{m} c_k x_{t-k}) / c_0 ;   then row (t mod m) <- x_t
    (row t mod m held x_{t-m}, the oldest output, which step t is the last to need).
    """

    coefs: tuple[float, ...]

    def __post_init__(self):
        coefs = np.asarray(self.coefs, dtype=np.float64).reshape(-1)
        if coefs.size < 1 or not np.all(np.isfinite(coefs)) or coefs[0] <= 0.0:
            raise InvalidArgumentError(
                f"a banded strategy needs finite coefficients c_0 > 0, c_1, ..., got {coefs.tolist()}"
            )
        object.__setattr__(self, "coefs", tuple(float(v) for v in coefs))

    @property
    def num_buffers(self) -> int:
        return len(self.coefs) - 1

    def check_dtype(self, dtype: torch.dtype) -> None:
        if not _exact_in(np.asarray(self.coefs), dtype):
            raise InvalidArgumentError(
                f"the banded coefficients are not exactly representable in {dtype}; round them "
                f"before resolving the mechanism or pass dtype=torch.float64"
            )

    def coefficients(self, dtype: torch.dtype, device: torch.device) -> tuple:
        m = self.num_buffers
        c = np.asarray(self.coefs)
        # weights[t mod m][r] = c_k with k = (t - r) mod m, and k = 0 meaning lag m: row r holds
        # x_{t-k}. Precomputed for the m phases so that a step allocates nothing.
        weights = np.zeros((max(m, 1), m))
        for phase in range(m):
            for row in range(m):
                lag = (phase - row) % m or m
                weights[phase, row] = c[lag]
        return torch.tensor(weights, dtype=dtype, device=device), float(c[0])

    def at_step(self, coefficients: tuple, step: int) -> tuple:
        weights, c0 = coefficients
        m = self.num_buffers
        phase = step % m if m else 0
        return weights[phase], c0, phase

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, step_coefficients: tuple) -> None:
        weights, c0, phase = step_coefficients
        if self.num_buffers:
            x.addmv_(buffers.t(), weights, alpha=-1)
        if c0 != 1.0:
            x.div_(c0)
        if self.num_buffers:
            buffers[phase].copy_(x)

    def describe(self) -> dict:
        return {"kind": "banded", "coefs": list(self.coefs)}


GROWTH_BITS = 32
"""A stored BLT buffer is rescaled before its values outgrow the true ones by 2**GROWTH_BITS."""


def renormalization_periods(one_minus_theta) -> np.ndarray:
    """K_i = max(1, floor(GROWTH_BITS / log2(1 / theta_i))) as int64; theta_i = 1 never needs one
    (its K_i is the largest int64, so its epoch is always 0 for any feasible step)."""
    one_minus_theta = np.asarray(one_minus_theta, dtype=np.float64)
    with np.errstate(divide="ignore"):
        bits_per_step = -np.log1p(-one_minus_theta) / math.log(2.0)  # log2(1 / theta), inf for 0
    periods = np.full(one_minus_theta.shape, np.iinfo(np.int64).max, dtype=np.int64)
    decaying = bits_per_step > 0
    # Periods beyond 2**62 steps are never reached; capping them keeps the int64 exact.
    capped = np.minimum(np.floor(GROWTH_BITS / bits_per_step[decaying]), 2.0**62)
    periods[decaying] = np.maximum(1, capped).astype(np.int64)
    return periods


def _powers(log_theta: np.ndarray, exponents) -> np.ndarray:
    """theta_i ** k_i in float64 from log(theta_i), with theta ** 0 = 1 also for theta = 0
    (``exponents`` broadcast against ``log_theta``: one row of k_i per step, or several)."""
    exponents = np.asarray(exponents, dtype=np.float64)
    exponents = np.broadcast_to(exponents, np.broadcast_shapes(exponents.shape, log_theta.shape))
    with np.errstate(invalid="ignore"):
        values = np.exp(exponents * log_theta)
    return np.where(exponents == 0, 1.0, values)


_WINDOW = 64
"""Steps whose BLT scalars are computed together."""


class _BLTScalars:
    """A BLT's per-step scalars (``BufferedInverse.at_step``), ``_WINDOW`` steps at a time.

    Holds the float64 data they come from (omega, log theta, the renormalization periods and
    theta_i^K_i) and the table of the current window: ``read`` (W, B) and ``add`` (W, B, 1) in
    the compute dtype on the device, and the renormalizations due at each step. Step t's
    scalars are rows of the table: the numpy work, the rounding to the compute dtype and the
    copy to the device happen once per window instead of once per step. The window is one
    tuple, replaced whole, so concurrent steps of one engine never see half of one.
    """

    __slots__ = ("dtype", "device", "omega", "log_theta", "periods", "factors", "window")

    def __init__(self, dtype, device, omega, log_theta, periods):
        self.dtype, self.device = dtype, device
        self.omega, self.log_theta, self.periods = omega, log_theta, periods
        self.factors = _powers(log_theta, periods)  # theta_i^K_i: a renormalization's factor
        self.window = None  # (first step, read, renormalize, add)

    def at(self, step: int) -> tuple:
        window = self.window
        if window is None or not 0 <= step - window[0] < _WINDOW:
            window = self.window = self._table(step)
        offset = step - window[0]
        return window[1][offset], window[2][offset], window[3][offset]

    def _table(self, start: int) -> tuple:
        periods, log_theta = self.periods, self.log_theta
        steps = np.arange(start, start + _WINDOW, dtype=np.int64)[:, None]
        previous = np.maximum(steps - 1, 0)
        read_power = previous - previous // periods * periods          # (t-1) - e_i(t-1)
        add_power = steps - steps // periods * periods                 # t - e_i(t)
        due_steps, due_rows = np.nonzero((steps % periods == 0) & (steps > 0))
        renormalize = [[] for _ in range(_WINDOW)]
        # Python floats: torch rounds a scalar once to the buffers' dtype, on every device.
        for offset, row, factor in zip(due_steps.tolist(), due_rows.tolist(), self.factors[due_rows].tolist()):
            renormalize[offset].append((row, factor))
        read = torch.tensor(self.omega * _powers(log_theta, read_power), dtype=self.dtype, device=self.device)
        add = torch.tensor(_powers(log_theta, -add_power), dtype=self.dtype, device=self.device).unsqueeze(-1)
        return start, read, [tuple(rows) for rows in renormalize], add


def streaming_inverse(mechanism):
    """The streaming inverse for a resolved :class:`~opake.dpftrl.strategies.strategy.Mechanism`.

    Reads only the plain arrays the mechanism states (``mechanism.streaming_description()``: the
    identity, a BLT's ``omega`` and ``one_minus_theta``, or a banded C's first column). Raises
    ValueError when the parameters violate the preconditions the sensitivity was computed under.
    """
    return inverse_from_description(mechanism.streaming_description())


def inverse_from_description(description: dict):
    """Rebuild a streaming inverse from :meth:`describe` output (used when loading a state)."""
    if not isinstance(description, dict) or "kind" not in description:
        raise InvalidArgumentError(f"not a streaming-inverse description: {description!r}")
    kind = description["kind"]
    if kind == "identity":
        return IdentityInverse()
    if kind == "blt":
        return BufferedInverse(tuple(description["omega"]), tuple(description["one_minus_theta"]))
    if kind == "banded":
        return BandedInverse(tuple(description["coefs"]))
    raise InvalidArgumentError(f"unknown streaming-inverse kind {kind!r} (expected identity, blt or banded)")
