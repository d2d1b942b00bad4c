"""Buffered Linear Toeplitz (BLT) strategies: parameters and their closed forms (float64).

Convention (BLT24, UseBLT24, Inv25; docs/math.md section 1): a BLT with decays theta (B,) and
output scales omega (B,) is the lower-triangular Toeplitz C with

    c_0 = 1,    c_k = sum_i omega_i theta_i^(k-1)   (k >= 1).

The seed page's ``w`` is ``omega / theta`` (its n -> infinity formula is in this convention).
Its inverse C^{-1} is again a BLT (theta_hat, omega_hat) (Inv25). All closed forms here cost
O(B^2) (min-sep: O(B^2 log(n / b))), independent of n, and stay accurate for decays within
1e-11 of 1 because they are written in terms of 1 - theta (see ``geometric``).

The array functions (suffix ``_arrays``) are the single implementation, shared with the
optimizer: they take parameters with any leading batch dimensions and accept complex-step
input (see ``geometric``), which is how the optimizer gets exact gradients.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from opake.dpftrl.strategies.geometric import (
    complement_of_product,
    cumulative_geometric_sum,
    expm1,
    geometric_sum,
    log1p,
    product_geometric_sum,
)
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True, eq=False)
class BLTParams:
    """Decays ``theta`` and output scales ``omega`` of a BLT (read-only float64 arrays)."""

    theta: np.ndarray
    omega: np.ndarray

    def __post_init__(self):
        theta = np.array(self.theta, dtype=np.float64, copy=True).reshape(-1)
        omega = np.array(self.omega, dtype=np.float64, copy=True).reshape(-1)
        if theta.shape != omega.shape:
            raise InvalidArgumentError(
                f"theta and omega must have the same length, got {theta.shape} and {omega.shape}"
            )
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
            raise InvalidArgumentError("theta and omega must be finite")
        theta.setflags(write=False)
        omega.setflags(write=False)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)

    @property
    def num_buffers(self) -> int:
        return int(self.theta.shape[0])

    @property
    def one_minus_theta(self) -> np.ndarray:
        return 1.0 - self.theta

    def __eq__(self, other):
        return (isinstance(other, BLTParams) and np.array_equal(self.theta, other.theta)
                and np.array_equal(self.omega, other.omega))

    def __hash__(self):
        return hash((self.theta.tobytes(), self.omega.tobytes()))

    def __repr__(self):
        return f"BLTParams(theta={self.theta.tolist()}, omega={self.omega.tolist()})"


def _horizon(n, name: str = "n") -> int:
    """A horizon (number of steps) as a positive int, or a TypeError/ValueError naming it."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise InvalidTypeError(f"{name} must be an integer number of steps, got {n!r} ({type(n).__name__})")
    if n < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {n}")
    return int(n)


def _pairs(x):
    return x[..., :, None], x[..., None, :]


def _sum_pairs(x):
    return x.sum(axis=(-1, -2))


# ---------------------------------------------------------------------------------------------
# Coefficients and preconditions


def coefficients(params: BLTParams, n: int) -> np.ndarray:
    """c_0..c_{n-1} of C."""
    n = _horizon(n)
    c = np.zeros(n)
    if n == 0:
        return c
    c[0] = 1.0
    powers = np.arange(n - 1, dtype=np.float64)
    for theta, omega in zip(params.theta, params.omega):
        c[1:] += omega * np.power(theta, powers)
    return c


def check_minsep_preconditions(params: BLTParams) -> None:
    """Raise unless theta in [0, 1], omega >= 0 and sum(omega) <= 1.

    These make c non-negative and non-increasing (c_1 = sum(omega) <= c_0 = 1), the hypothesis
    of the Toeplitz min-sep theorem (BSR24 Thm 2) and of every sensitivity formula here.
    """
    theta, omega = params.theta, params.omega
    if np.any((theta < 0) | (theta > 1)):
        raise InvalidArgumentError(
            f"BLT decays theta must lie in [0, 1] for the min-sep sensitivity to hold; got {theta.tolist()}"
        )
    if np.any(omega < 0):
        raise InvalidArgumentError(
            f"BLT output scales omega must be >= 0 for the min-sep sensitivity to hold; got {omega.tolist()}"
        )
    if omega.sum() > 1.0:
        raise InvalidArgumentError(
            f"BLT output scales must satisfy sum(omega) <= 1 (non-increasing coefficients); got sum {omega.sum()!r}"
        )


def round_for_float32(params: BLTParams) -> BLTParams:
    """Parameters whose omega and 1 - theta are exactly representable in float32.

    The noise engine works from omega and 1 - theta (its per-step scalars come from
    log1p(-(1 - theta))), so a decay within 1e-9 of 1 survives float32 (theta itself would
    round to 1.0). omega is rounded toward zero, which
    keeps omega >= 0 and sum(omega) from growing; 1 - theta is rounded to nearest and then to
    the float64 grid near 1 (dropping low bits keeps it a float32). Decays that coincide after
    rounding are merged (their omegas add), which leaves C unchanged.
    """
    leak = np.float32(params.one_minus_theta).astype(np.float64)
    theta = 1.0 - leak  # 1 - theta is now leak on the float64 grid near 1: fewer bits, still a float32
    theta, where = np.unique(theta, return_inverse=True)
    omega = np.zeros(theta.shape[0])
    np.add.at(omega, where.reshape(-1), params.omega)
    omega32 = np.float32(omega)
    too_far = np.abs(omega32.astype(np.float64)) > np.abs(omega)
    omega32 = np.where(too_far, np.nextafter(omega32, np.float32(0)), omega32).astype(np.float64)
    return BLTParams(theta, omega32)


# ---------------------------------------------------------------------------------------------
# Sensitivity


def minsep_sensitivity_squared_arrays(theta, leak, omega, participation: Participation):
    """sens^2 for participations at least b apart, at most k' of them (BSR24 Thm 2 for a BLT).

    The worst pattern is {0, b, ..., (P-1) b}, P = k'. Streaming C over that input, the buffer
    state at the start of the q-th period of b steps is S_q = g * G(a, q) with a = theta^b and
    g = theta^(b-1). A period starting with a participation contributes

        (1 + omega.S_q)^2 + sum_ij omega_i omega_j G(theta_i theta_j, b-1) G(a_i, q+1) G(a_j, q+1)

    (theta_i S_qi + 1 = G(a_i, q+1)); the last participation's run of L = n - (P-1) b steps
    contributes the same with b replaced by L. Summing over the P - 1 full periods needs
    S(a_i, P-1) and T(a_i, a_j, P-1) (``geometric``), so the cost is O(B^2 log P).
    Single participation (P = 1) reduces to BLT24 Lemma 5.3:
    1 + sum_ij omega_i omega_j G(theta_i theta_j, n - 1).
    """
    n = participation.n_steps
    b = participation.min_sep
    periods = participation.effective_participations - 1
    last_len = n - periods * b
    q_pair = complement_of_product(*_pairs(leak))
    wi, wj = _pairs(omega)
    w2 = wi * wj
    if periods == 0:
        return 1.0 + _sum_pairs(w2 * geometric_sum(q_pair, last_len - 1))
    with np.errstate(divide="ignore"):  # theta = 0 gives log 0 = -inf, and 1 - a = 1 exactly
        log_theta = log1p(-leak)
        leak_b = -expm1(b * log_theta)                           # 1 - theta^b, precise near 1
    positive = leak.real < 1.0
    g = np.where(positive, np.exp((b - 1) * np.where(positive, log_theta, 0.0)),
                 1.0 if b == 1 else 0.0)                         # theta^(b-1), 0^0 = 1
    # one vectorized call per sum: G(a_i, P-1) and G(a_i, P); G(theta_i theta_j, b-1) and (L-1)
    g_n, a_last = geometric_sum(leak_b, np.array([periods, periods + 1.0]).reshape((2,) + (1,) * leak_b.ndim))
    g_period, g_last = geometric_sum(q_pair, np.array([b - 1.0, last_len - 1.0]).reshape((2,) + (1,) * q_pair.ndim))
    s_n = g * cumulative_geometric_sum(leak_b, periods)          # sum_q S_qi
    t_n = product_geometric_sum(*_pairs(leak_b), periods)        # T(a_i, a_j, P-1)
    gi, gj = _pairs(g)
    gni, gnj = _pairs(g_n)
    periods_part = (
        periods + 2.0 * (omega * s_n).sum(axis=-1) + _sum_pairs(w2 * gi * gj * t_n)
        + _sum_pairs(w2 * g_period * (t_n + gni * gnj))
    )
    state_last = g * g_n                                         # S_{P-1}
    ai, aj = _pairs(a_last)                                      # theta_i S_{P-1,i} + 1 = G(a_i, P)
    last_part = (1.0 + (omega * state_last).sum(axis=-1)) ** 2 + _sum_pairs(w2 * g_last * ai * aj)
    return periods_part + last_part


def sensitivity_squared(params: BLTParams, n_steps: int | None = None) -> float:
    """Single-participation sens^2 = max column norm^2 of C (BLT24 Lemma 5.3).

    1 + sum_ij omega_i omega_j G(theta_i theta_j, n - 1); for n -> infinity (``n_steps=None``)
    1 + sum_ij omega_i omega_j / (1 - theta_i theta_j) (infinite if some theta_i = 1).
    """
    if n_steps is None:
        q_pair = complement_of_product(*_pairs(params.one_minus_theta))
        w2 = params.omega[:, None] * params.omega[None, :]
        if np.any((q_pair <= 0) & (w2 != 0)):
            return float("inf")
        return float(1.0 + np.sum(w2 / np.where(q_pair > 0, q_pair, 1.0)))
    return minsep_sensitivity_squared(params, Participation(_horizon(n_steps, "n_steps"), 1, 1))


def minsep_sensitivity_squared(params: BLTParams, participation: Participation) -> float:
    """sens^2 for ``participation`` (min_sep b, at most k participations); see the array form."""
    check_minsep_preconditions(params)
    return float(minsep_sensitivity_squared_arrays(
        params.theta, params.one_minus_theta, params.omega, participation
    ))


# ---------------------------------------------------------------------------------------------
# Inverse


def _inverse_roots(leak: np.ndarray, omega: np.ndarray):
    """1 - theta_hat and omega_hat of C^{-1} (Inv25), precise in 1 - theta_hat.

    The decays theta_hat are the roots of 1 + sum_i omega_i / (lambda - theta_i) = 0. With
    omega > 0 and distinct decays they interlace with theta, so in delta = 1 - lambda each lies
    in its own bracket between consecutive 1 - theta_i and is found by Brent's method on
    f(delta) = 1 + sum_i omega_i / ((1 - theta_i) - delta). Then
    omega_hat_j = prod_i (theta_hat_j - theta_i) / prod_{l != j} (theta_hat_j - theta_hat_l).
    Other parameters fall back to eigenvalues of diag(theta) - omega 1^T.
    """
    order = np.argsort(-leak, kind="stable")
    q = leak[order]
    w = omega[order]
    B = q.shape[0]
    if B == 0:
        return np.zeros(0), np.zeros(0)
    if np.all(w > 0) and np.all(np.diff(q) < 0):
        def f(d):
            with np.errstate(over="ignore", divide="ignore"):  # at a bracket end next to a pole
                return 1.0 + np.sum(w / (q - d))
        delta = np.empty(B)
        for j in range(B):
            lo = np.nextafter(q[j], np.inf)
            hi = q[0] + 2.0 * w.sum() if j == 0 else np.nextafter(q[j - 1], -np.inf)  # f(hi) >= 1/2 for j = 0
            if hi <= lo or f(hi) <= 0 or f(lo) >= 0:
                delta[j] = lo  # the bracket is narrower than rounding: the root is q_j to 1 ulp
                continue
            # maxiter: a root near a tiny 1 - theta can take ~1100 bisections from a bracket of width 1
            delta[j] = brentq(f, lo, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=4000)
    else:
        theta = 1.0 - q
        eig = np.linalg.eigvals(np.diag(theta) - np.outer(w, np.ones(B)))
        if np.any(np.abs(eig.imag) > 1e-12 * np.maximum(1.0, np.abs(eig.real))):
            raise InvalidArgumentError("this BLT's inverse is not a real BLT (complex inverse decays); "
                                       "use decays in (0, 1] with positive omega")
        delta = np.sort(1.0 - eig.real)[::-1]
    diff_theta = q[None, :] - delta[:, None]            # theta_hat_j - theta_i
    diff_hat = delta[None, :] - delta[:, None]           # theta_hat_j - theta_hat_l
    np.fill_diagonal(diff_hat, 1.0)
    if np.any(diff_hat == 0):
        raise InvalidArgumentError("the inverse has repeated decays; merge equal decays of the BLT first")
    omega_hat = np.prod(diff_theta, axis=1) / np.prod(diff_hat, axis=1)
    return delta, omega_hat


def inverse(params: BLTParams) -> BLTParams:
    """The BLT (theta_hat, omega_hat) of C^{-1}: c_hat_0 = 1, c_hat_k = sum omega_hat theta_hat^(k-1)."""
    delta, omega_hat = _inverse_roots(params.one_minus_theta, params.omega)
    return BLTParams(1.0 - delta, omega_hat)


def inverse_coefficients(params: BLTParams, n: int) -> np.ndarray:
    """First column of C^{-1} by streaming C^{-1} over e_0 (the O(nB) route, UseBLT24 Alg. 2).

    x_t = y_t - sum_i omega_i S_i, then S_i <- theta_i S_i + x_t (buffers hold past outputs).
    """
    theta, omega = params.theta, params.omega
    n = _horizon(n)
    state = np.zeros(params.num_buffers)
    out = np.empty(n)
    for t in range(n):
        x = (1.0 if t == 0 else 0.0) - float(np.dot(omega, state))
        out[t] = x
        state = theta * state + x
    return out


# ---------------------------------------------------------------------------------------------
# Errors of the workload W = D_eta M_beta (prefix sums for beta = 1 and no schedule)


def workload_terms_arrays(leak, leak_hat, omega_hat, momentum: float):
    """Decays (as 1 - rho) and weights R with (M_beta C^{-1})_k = sum_a R_a rho_a^k.

    rho = (beta, theta_hat_1..B); by partial fractions of
    prod_i (x - theta_i) / prod_j (x - theta_hat_j) / (x - beta):
        R_beta = prod_i (beta - theta_i) / prod_j (beta - theta_hat_j),
        R_j    = omega_hat_j / (theta_hat_j - beta).
    For beta = 1 every R is positive (R_beta = prod(1-theta)/prod(1-theta_hat)), so the
    prefix-sum errors are sums of positive terms and nothing cancels.
    """
    q_beta = 1.0 - float(momentum)
    r_beta = np.prod(leak - q_beta, axis=-1) / np.prod(leak_hat - q_beta, axis=-1)
    r_hat = omega_hat / (q_beta - leak_hat)
    leaks = np.concatenate([np.broadcast_to(q_beta, leak_hat.shape[:-1] + (1,)), leak_hat], axis=-1)
    weights = np.concatenate([r_beta[..., None], r_hat], axis=-1)
    return leaks, weights


def error_arrays(leaks, weights, n: int, kind: str, lr_schedule=None):
    """Max or mean over t of e_t = eta_t^2 sum_{k<=t} d_k^2 with d_k = sum_a R_a rho_a^k.

    Without a schedule e_t increases, so max = E_{n-1} = sum_ab R_a R_b G(rho_a rho_b, n) and
    mean = (1/n) sum_ab R_a R_b S(rho_a rho_b, n + 1), both O(B^2). With a schedule every row
    is needed: O(nB).
    """
    if lr_schedule is None:
        q_pair = complement_of_product(*_pairs(leaks))
        ri, rj = _pairs(weights)
        if kind == "max":
            return _sum_pairs(ri * rj * geometric_sum(q_pair, n))
        return _sum_pairs(ri * rj * cumulative_geometric_sum(q_pair, n + 1)) / n
    rows = per_query_errors_arrays(leaks, weights, n, lr_schedule)
    if kind == "max":
        return np.take_along_axis(rows, np.argmax(rows.real, axis=-1)[..., None], axis=-1)[..., 0]
    return rows.mean(axis=-1)


def per_query_errors_arrays(leaks, weights, n: int, lr_schedule=None):
    steps = np.arange(n, dtype=np.float64)
    if np.iscomplexobj(leaks):  # complex step: decays lie in (0, 1) inside the optimizer
        powers = np.exp(steps[:, None] * log1p(-leaks[..., None, :]))
    else:
        powers = np.power(1.0 - leaks[..., None, :], steps[:, None])
    d = (weights[..., None, :] * powers).sum(axis=-1)
    rows = np.cumsum(d * d, axis=-1)
    if lr_schedule is not None:
        eta = np.asarray(lr_schedule, dtype=np.float64)
        rows = eta * eta * rows
    return rows


def _reduced(params: BLTParams) -> BLTParams:
    """C for the errors: equal decays merged (omegas added), negligible buffers dropped.

    A buffer with |omega| below 1e-14 of the largest changes every coefficient of C by less than
    1e-14 relative, but its inverse decay sits within rounding of its own decay, where the
    roots lose their accuracy. Errors are utility, never privacy: sensitivity always uses every
    buffer.
    """
    scale = np.max(np.abs(params.omega)) if params.num_buffers else 0.0
    keep = np.abs(params.omega) > 1e-14 * scale
    theta, where = np.unique(params.theta[keep], return_inverse=True)
    omega = np.zeros(theta.shape[0])
    np.add.at(omega, where.reshape(-1), params.omega[keep])
    return BLTParams(theta, omega)


def _workload(params: BLTParams, momentum: float):
    params = _reduced(params)  # the inverse needs distinct decays; C is unchanged
    delta, omega_hat = _inverse_roots(params.one_minus_theta, params.omega)
    return workload_terms_arrays(params.one_minus_theta, delta, omega_hat, float(momentum))


def max_error(params: BLTParams, n: int, momentum: float = 1.0) -> float:
    """max_t of the squared prefix-sum error of C^{-1} (BLT24 Lemma 5.4), weighted by M_beta."""
    return float(error_arrays(*_workload(params, momentum), _horizon(n), "max"))


def mean_error(params: BLTParams, n: int, momentum: float = 1.0) -> float:
    """mean_t of the squared prefix-sum error of C^{-1}, weighted by M_beta."""
    return float(error_arrays(*_workload(params, momentum), _horizon(n), "mean"))


def per_query_errors(params: BLTParams, n: int, momentum: float = 1.0, lr_schedule=None) -> np.ndarray:
    """e_t = ||row t of D_eta M_beta C^{-1}||^2 for t < n, O(nB)."""
    return per_query_errors_arrays(*_workload(params, momentum), _horizon(n), lr_schedule)
