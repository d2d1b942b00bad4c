"""Streaming inverses: how one step of x = C^{-1} z is computed from a small state.

The noise engine does not know which strategy it runs. It holds a (B, d) buffer tensor and, at
every step, hands one contiguous stretch of z (overwritten in place by x) and the matching
columns of the buffers to a *streaming inverse*: a small frozen value that says how many buffer
rows it needs and how to advance them. Each strategy family resolves to one:

- :class:`IdentityInverse` (C = I, DP-SGD): no buffers, x_t = z_t.
- :class:`BufferedInverse` (BLT, BLT24 / UseBLT24 Alg. 2): B decaying buffers of past outputs,
  using C's own parameters (theta, omega); MATH.md section 2.
- :class:`BandedInverse` (BandMF, Band23): a ring of the last ``bands - 1`` outputs.

Every one is elementwise across the d columns: column j of the buffers only ever meets element
j of z, so the engine may process the columns in any grouping and get the same numbers.

A new strategy family plugs in by adding a class with the same three members
(``num_buffers``, ``coefficients``, ``advance``) plus ``describe``, and one branch in
:func:`streaming_inverse`; the engine core stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

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

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, coefficients: tuple, step: int) -> None:
        """x_t = z_t: nothing to do."""

    def describe(self) -> dict:
        return {"kind": "identity"}


@dataclass(frozen=True)
class BufferedInverse:
    """x = C^{-1} z for a BLT C with decays theta and output scales omega (MATH.md section 2).

    Stored as ``omega`` and ``one_minus_theta`` (tuples of float64) because that is the form the
    recurrence uses: decays within 1e-9 of 1 are exact as 1 - theta but round to 1.0 as theta.
    """

    omega: tuple[float, ...]
    one_minus_theta: tuple[float, ...]

    def __post_init__(self):
        omega = np.asarray(self.omega, dtype=np.float64).reshape(-1)
        one_minus_theta = np.asarray(self.one_minus_theta, dtype=np.float64).reshape(-1)
        if omega.shape != one_minus_theta.shape or omega.size == 0:
            raise ValueError(
                f"a BLT needs as many output scales as decays (at least one); got "
                f"{omega.size} omega and {one_minus_theta.size} theta values"
            )
        theta = 1.0 - one_minus_theta
        if not (np.all(np.isfinite(omega)) and np.all(np.isfinite(one_minus_theta))):
            raise ValueError("BLT parameters must be finite; got theta={theta}, omega={omega}".format(
                theta=theta.tolist(), omega=omega.tolist()))
        # The preconditions under which the resolved sensitivity is valid (MATH.md section 4):
        # outside them the accounting does not describe the noise this engine would add.
        if np.any(one_minus_theta < 0.0) or np.any(one_minus_theta > 1.0):
            raise ValueError(
                f"BLT decays theta must lie in [0, 1], got {theta.tolist()}; resolve the strategy "
                f"with blt_strategy(...) or check the hand-made parameters"
            )
        if np.any(omega < 0.0):
            raise ValueError(f"BLT output scales omega must be >= 0, got {omega.tolist()}")
        if math.fsum(omega.tolist()) > 1.0:
            raise ValueError(
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
            raise ValueError(
                f"the BLT parameters are not exactly representable in {dtype}, so the noise would "
                f"come from a slightly different mechanism than the one accounted for; resolve "
                f"the strategy with blt_strategy(...) (its parameters are float32-exact), round "
                f"hand-made ones with opake.dpftrl.noise.blt.round_for_float32, or pass "
                f"dtype=torch.float64"
            )

    def coefficients(self, dtype: torch.dtype, device: torch.device) -> tuple:
        omega = torch.tensor(self.omega, dtype=dtype, device=device)
        minus_one_minus_theta = torch.tensor(self.one_minus_theta, dtype=dtype, device=device).neg_()
        return omega, minus_one_minus_theta.reshape(-1, 1)

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, coefficients: tuple, step: int) -> None:
        """One step on a stretch of columns: x holds z_t on entry and x_t on exit.

        Recurrence (MATH.md section 2, C^{-1} with C's own parameters), per column:
            x_t = z_t - sum_i omega_i * S_i
            S_i <- S_i - (1 - theta_i) * S_i + x_t
        The decay is applied as S - (1 - theta) S rather than theta S so that 1 - theta of order
        1e-9 is not lost in float32. Three fused in-place torch ops; the sum over buffers is one
        matrix-vector product over the (B, n) block (``buffers`` may be a column slice of the
        state, i.e. rows strided by d).
        """
        omega, minus_one_minus_theta = coefficients
        x.addmv_(buffers.t(), omega, alpha=-1)
        buffers.addcmul_(buffers, minus_one_minus_theta)
        buffers.add_(x)

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
            raise ValueError(
                f"a banded strategy needs finite coefficients c_0 > 0, c_1, ..., got {coefs.tolist()}"
            )
        object.__setattr__(self, "coefs", tuple(float(v) for v in coefs))

    @property
    def num_buffers(self) -> int:
        return len(self.coefs) - 1

    def check_dtype(self, dtype: torch.dtype) -> None:
        if not _exact_in(np.asarray(self.coefs), dtype):
            raise ValueError(
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

    def advance(self, x: torch.Tensor, buffers: torch.Tensor, coefficients: tuple, step: int) -> None:
        m = self.num_buffers
        if m == 0:
            if coefficients[1] != 1.0:
                x.div_(coefficients[1])
            return
        weights, c0 = coefficients
        phase = step % m
        x.addmv_(buffers.t(), weights[phase], alpha=-1)
        if c0 != 1.0:
            x.div_(c0)
        buffers[phase].copy_(x)

    def describe(self) -> dict:
        return {"kind": "banded", "coefs": list(self.coefs)}


def streaming_inverse(mechanism):
    """The streaming inverse for a resolved :class:`~opake.dpftrl.noise.strategy.Mechanism`.

    Reads only plain arrays from the mechanism: a banded one (a ``coefs`` attribute that is not
    None, the first column of C) streams with :class:`BandedInverse`; zero buffers is the
    identity; otherwise a BLT from ``omega`` and ``one_minus_theta``. Raises ValueError when the
    parameters violate the preconditions the sensitivity was computed under.
    """
    coefs = getattr(mechanism, "coefs", None)
    if coefs is not None:
        return BandedInverse(tuple(np.asarray(coefs, dtype=np.float64).reshape(-1)))
    omega = np.asarray(mechanism.omega, dtype=np.float64).reshape(-1)
    theta = np.asarray(mechanism.theta, dtype=np.float64).reshape(-1)
    if omega.size == 0 and theta.size == 0:
        return IdentityInverse()
    one_minus_theta = getattr(mechanism, "one_minus_theta", None)
    one_minus_theta = 1.0 - theta if one_minus_theta is None else np.asarray(one_minus_theta, dtype=np.float64)
    return BufferedInverse(tuple(omega), tuple(one_minus_theta))


def inverse_from_description(description: dict):
    """Rebuild a streaming inverse from :meth:`describe` output (used when loading a state)."""
    if not isinstance(description, dict) or "kind" not in description:
        raise ValueError(f"not a streaming-inverse description: {description!r}")
    kind = description["kind"]
    if kind == "identity":
        return IdentityInverse()
    if kind == "blt":
        return BufferedInverse(tuple(description["omega"]), tuple(description["one_minus_theta"]))
    if kind == "banded":
        return BandedInverse(tuple(description["coefs"]))
    raise ValueError(f"unknown streaming-inverse kind {kind!r} (expected identity, blt or banded)")
