"""Buffered Linear Toeplitz (BLT) strategies: parameters and their closed forms (float64).

Convention (BLT24, UseBLT24, Inv25; MATH.md section 1): a BLT with decays theta (B,) and
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


@dataclass(frozen=True, eq=False)
class BLTParams:
    """Decays ``theta`` and output scales ``omega`` of a BLT (read-only float64 arrays)."""

    theta: np.ndarray
    omega: np.ndarray

    def __post_init__(self):
        theta = np.array(self.theta, dtype=np.float64, copy=True).reshape(-1)
        omega = np.array(self.omega, dtype=np.float64, copy=True).reshape(-1)
        if theta.shape != omega.shape:
            raise ValueError(f"theta and omega must have the same length, got {theta.shape} and {omega.shape}")
        if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(omega))):
            raise ValueError("theta and omega must be finite")
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
        raise TypeError(f"{name} must be an integer number of steps, got {n!r} ({type(n).__name__})")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
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
        raise ValueError(f"BLT decays theta must lie in [0, 1] for the min-sep sensitivity to hold; got {theta.tolist()}")
    if np.any(omega < 0):
        raise ValueError(f"BLT output scales omega must be >= 0 for the min-sep sensitivity to hold; got {omega.tolist()}")
    if omega.sum() > 1.0:
        raise ValueError(f"BLT output scales must satisfy sum(omega) <= 1 (non-increasing coefficients); got sum {omega.sum()!r}")


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
            raise ValueError("this BLT's inverse is not a real BLT (complex inverse decays); "
                             "use decays in (0, 1] with positive omega")
        delta = np.sort(1.0 - eig.real)[::-1]
    diff_theta = q[None, :] - delta[:, None]            # theta_hat_j - theta_i
    diff_hat = delta[None, :] - delta[:, None]           # theta_hat_j - theta_hat_l
    np.fill_diagonal(diff_hat, 1.0)
    if np.any(diff_hat == 0):
        raise ValueError("the inverse has repeated decays; merge equal decays of the BLT first")
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


# ---------------------------------------------------------------------------------------------
# Errors of the parameter trajectory of torch.optim.SGD: W = S D_eta M


@dataclass(frozen=True)
class ParameterWorkload:
    """The noise in the *parameters* of ``torch.optim.SGD(lr=eta_t, momentum, dampening, nesterov)``.

    torch's SGD keeps m_0 = g_0 (the buffer starts as a copy of the first gradient, undamped),
    m_t = beta m_{t-1} + (1 - tau) g_t, takes the update u_t = m_t (Nesterov: g_t + beta m_t;
    no buffer at all when beta = 0, so dampening is ignored there, as in torch) and moves
    theta_{t+1} = theta_t - eta_t u_t. Noise z' = C^{-1} z added to the gradients therefore
    reaches the parameters as -S D_eta M z', S the lower-triangular ones: the workload is
    W = S D_eta M and row t is the noise in the parameters after step t.
    """

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        beta, tau = self.momentum, self.dampening
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"SGD momentum must be a number in [0, 1) (0 = plain SGD), got {beta!r}")
        if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 0.0 <= float(tau) <= 1.0:
            raise ValueError(f"SGD dampening must be a number in [0, 1], got {tau!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and (float(beta) == 0.0 or float(tau) != 0.0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
        object.__setattr__(self, "momentum", float(beta))
        object.__setattr__(self, "dampening", float(tau))

    @property
    def effective_dampening(self) -> float:
        """tau as torch applies it: without momentum there is no buffer and no dampening."""
        return self.dampening if self.momentum > 0.0 else 0.0


def _fractions_arrays(extra_leaks, leak, leak_hat, omega_hat, workload: ParameterWorkload, power: int):
    """Weights R_a of gain * prod_z (1 - z x) / prod_a (1 - rho_a x) over the decays
    rho = (extra..., theta_hat_1..B) (as 1 - rho), zeros z = theta (and, for Nesterov, the zero
    beta / (1 + beta) of its filter 1 + beta / (1 - beta x), gain 1 + beta):

        R_a = gain rho_a^power prod_z (rho_a - z) / prod_{b != a} (rho_a - rho_b).

    power = m - 1 - #zeros gives the coefficients f_k = sum_a R_a rho_a^k (k >= 0, proper
    functions); power = m - #zeros gives the BLT form f_k = sum_a R_a rho_a^(k-1) (k >= 1),
    f_0 = gain. For a theta_hat pole prod_i (rho_j - theta_i) / prod_{l != j} (rho_j - rho_l) is
    omega_hat_j (Inv25), so no product over the inverse decays is formed twice. Every
    difference is taken between complements: rho_a - rho_b = (1 - rho_b) - (1 - rho_a).
    """
    beta = workload.momentum
    def extra_factor(q):  # gain prod_{extra zeros} (rho - z) at rho = 1 - q
        return (1.0 + beta) * (1.0 - q) - beta if workload.nesterov else 1.0
    weights = []
    for a, qa in enumerate(extra_leaks):
        num = extra_factor(qa) * (1.0 - qa) ** power * np.prod(leak - qa, axis=-1)
        den = np.prod(leak_hat - qa, axis=-1)
        for b, qb in enumerate(extra_leaks):
            if b != a:
                den = den * (qb - qa)
        weights.append(num / den)
    hat = omega_hat * extra_factor(leak_hat) * (1.0 - leak_hat) ** power
    for qb in extra_leaks:
        hat = hat / (qb - leak_hat)
    leaks = np.concatenate([np.broadcast_to(np.asarray(extra_leaks, dtype=np.float64),
                                            leak_hat.shape[:-1] + (len(extra_leaks),)), leak_hat], axis=-1)
    if weights:
        hat = np.concatenate([np.stack(np.broadcast_arrays(*weights), axis=-1), hat], axis=-1)
    return leaks, hat


def _powers(leaks, n: int):
    """rho_a^k for k < n, shape (..., m, n); complex-step input through log1p (decays in (0, 1))."""
    steps = np.arange(n, dtype=np.float64)
    if np.iscomplexobj(leaks):
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.exp(steps * log1p(-leaks[..., None]))
        return np.where(steps == 0, 1.0, out)  # 0^0 = 1 for a decay of exactly 0
    return np.power(1.0 - leaks[..., None], steps)


def parameter_terms_arrays(leak, leak_hat, omega_hat, workload: ParameterWorkload):
    """Constant eta = 1: W C^{-1} = S M C^{-1} is Toeplitz apart from column 0. Returns the
    decays (as 1 - rho), the weights Q of its coefficients p_k = sum_a Q_a rho_a^k and the
    weights Q0 of column 0, P0_t = sum_a Q0_a rho_a^t.

    Generating function of the coefficients: M(x) Chat(x) / (1 - x) with
    Chat(x) = prod_i (1 - theta_i x) / prod_j (1 - theta_hat_j x) and M(x) = 1 / (1 - beta x)
    (Nesterov: (1 + beta - beta x) / (1 - beta x); beta = 0: 1). Poles {1, beta, theta_hat}
    (beta dropped when 0), degree of the numerator below the denominator's: pure exponentials,
    the decay 1 carrying the polynomial (linear-growth) part. Dampening tau changes only
    column 0 (torch starts the buffer undamped): M = (1 - tau) T_beta + tau beta^t e_0^T and
    row 0 of C^{-1} is e_0^T, so with p the undamped coefficients the Toeplitz part is
    (1 - tau) p and P0_t = (1 - tau) p_t + tau sum_{u<=t} beta^u
    = (1 - tau) p_t + tau / (1 - beta) - tau beta / (1 - beta) beta^t.
    """
    beta = workload.momentum
    extra = [0.0, 1.0 - beta] if beta > 0.0 else [0.0]
    zeros = leak.shape[-1] + (1 if workload.nesterov else 0)
    leaks, q = _fractions_arrays(extra, leak, leak_hat, omega_hat, workload, len(extra) + leak_hat.shape[-1] - 1 - zeros)
    tau = workload.effective_dampening
    if tau == 0.0:
        return leaks, q, q
    shift = np.zeros(leaks.shape[-1])
    shift[0], shift[1] = tau / (1.0 - beta), -tau * beta / (1.0 - beta)
    return leaks, (1.0 - tau) * q, (1.0 - tau) * q + shift


def _toeplitz_parameter_rows(leaks, q, q0, n: int):
    """e_t = sum_{k<t} p_k^2 + P0_t^2 (columns 1..t are lags t-1..0, column 0 is P0), O(nm)."""
    pw = _powers(leaks, n)
    p = (q[..., None] * pw).sum(axis=-2)
    p0 = (q0[..., None] * pw).sum(axis=-2)
    before = np.cumsum(p * p, axis=-1) - p * p
    return before + p0 * p0


def _scheduled_parameter_rows(leak, leak_hat, omega_hat, workload: ParameterWorkload, n: int, eta):
    """All e_t of W = S D_eta M C^{-1} for a schedule eta, O(n m) with m = B + 1 decays.

    T = M C^{-1} in BLT form: T[u, s] = d_{u-s} for s >= 1, d_0 = gain (1 - tau, or 1 + beta for
    Nesterov), d_k = sum_a R_a rho_a^(k-1) (k >= 1) over rho = {beta, theta_hat} (the
    coefficients of M(x) Chat(x), times 1 - tau); column 0 is T[u, 0] = d_u + tau beta^u
    (``parameter_terms_arrays``: M = (1 - tau) T_beta + tau beta^t e_0^T). P = S D_eta T, P[t, s] = sum_{u=s}^t eta_u T[u, s].
    Split e_t = P[t, 0]^2 + e'_t with e'_t = sum_{s=1}^t P[t, s]^2. Since
    P[t, s] = P[t-1, s] + eta_t d_{t-s} (P[t-1, t] = 0):

        e'_t   = e'_{t-1} + 2 eta_t c_t + eta_t^2 E_{t-1},      E_j = sum_{k<=j} d_k^2
        c_t    = sum_{s=1}^{t-1} P[t-1, s] d_{t-s} = sum_a R_a X_a(t-1)
        X_a(t) = sum_{s=1}^t P[t, s] rho_a^(t-s) = rho_a X_a(t-1) + eta_t Y_a(t-1),  X_a(0) = 0
        Y_a(j) = sum_{k<=j} d_k rho_a^k
        P[t,0] = sum_{u<=t} eta_u T[u, 0]

    Everything is a cumulative sum except X, a first-order recursive filter per decay
    (scipy.signal.lfilter, which keeps the complex step's imaginary part exact). No powers
    rho^-k are formed, and |rho| <= 1, so the recursion is stable.
    """
    from scipy.signal import lfilter

    beta = workload.momentum
    extra = [1.0 - beta] if beta > 0.0 else []
    zeros = leak.shape[-1] + (1 if workload.nesterov else 0)
    leaks, r = _fractions_arrays(extra, leak, leak_hat, omega_hat, workload, len(extra) + leak_hat.shape[-1] - zeros)
    tau = workload.effective_dampening
    gain = 1.0 + beta if workload.nesterov else 1.0 - tau
    if tau > 0.0:
        r = (1.0 - tau) * r
    pw = _powers(leaks, n)                                       # (..., m, n)
    d = np.concatenate([np.broadcast_to(gain, leaks.shape[:-1] + (1,)).astype(pw.dtype),
                        (r[..., None] * pw[..., : n - 1]).sum(axis=-2)], axis=-1)
    energy = np.cumsum(d * d, axis=-1)
    y = np.cumsum(d[..., None, :] * pw, axis=-1)                 # Y_a(j)
    del pw
    f = np.zeros_like(y)
    f[..., 1:] = eta[1:] * y[..., :-1]                           # eta_t Y_a(t-1)
    rows_f = f.reshape(-1, n)
    rho = (1.0 - leaks).reshape(-1)
    x = np.empty_like(rows_f)
    for i in range(rows_f.shape[0]):
        x[i] = lfilter([1.0], [1.0, -rho[i]], rows_f[i])
    x = x.reshape(f.shape)
    c = np.zeros(d.shape, dtype=x.dtype)
    c[..., 1:] = (r[..., None] * x[..., :-1]).sum(axis=-2)
    step = 2.0 * eta * c
    step[..., 1:] += eta[1:] ** 2 * energy[..., :-1]
    first = d
    if tau > 0.0:
        first = first + tau * np.power(beta, np.arange(n, dtype=np.float64))
    p0 = np.cumsum(eta * first, axis=-1)
    return np.cumsum(step, axis=-1) + p0 * p0


def parameter_error_arrays(leak, leak_hat, omega_hat, workload: ParameterWorkload, n: int, kind: str,
                           lr_schedule=None):
    """Max or mean over t of e_t for W = S D_eta M (``ParameterWorkload``).

    Without a schedule and without dampening W C^{-1} is Toeplitz, e_t = sum_{k<=t} p_k^2
    increases, and max = sum_ab Q_a Q_b G(rho_a rho_b, n), mean = (1/n) sum_ab Q_a Q_b
    S(rho_a rho_b, n + 1), O(B^2) for any n. With dampening the mean is
    (1/n) sum_ab [Q_a Q_b S(rho_a rho_b, n) + Q0_a Q0_b G(rho_a rho_b, n)] (O(B^2)) while the max
    may sit on any row (O(nB)); with a schedule every row is needed (O(nB), see
    ``_scheduled_parameter_rows``).
    """
    if lr_schedule is not None:
        rows = _scheduled_parameter_rows(leak, leak_hat, omega_hat, workload, n,
                                         np.asarray(lr_schedule, dtype=np.float64))
    else:
        leaks, q, q0 = parameter_terms_arrays(leak, leak_hat, omega_hat, workload)
        if workload.effective_dampening == 0.0:
            return error_arrays(leaks, q, n, kind)
        if kind == "mean":
            q_pair = complement_of_product(*_pairs(leaks))
            return (_sum_pairs(_outer(q) * cumulative_geometric_sum(q_pair, n))
                    + _sum_pairs(_outer(q0) * geometric_sum(q_pair, n))) / n
        rows = _toeplitz_parameter_rows(leaks, q, q0, n)
    if kind == "max":
        return np.take_along_axis(rows, np.argmax(rows.real, axis=-1)[..., None], axis=-1)[..., 0]
    return rows.mean(axis=-1)


def _outer(x):
    xi, xj = _pairs(x)
    return xi * xj


def _parameter_inputs(params: BLTParams):
    params = _reduced(params)
    delta, omega_hat = _inverse_roots(params.one_minus_theta, params.omega)
    return params.one_minus_theta, delta, omega_hat


def parameter_per_query_errors(params: BLTParams, n: int, workload: ParameterWorkload,
                               lr_schedule=None) -> np.ndarray:
    """e_t = ||row t of S D_eta M C^{-1}||^2 for t < n (noise in SGD's parameters), O(nB)."""
    n = _horizon(n)
    leak, leak_hat, omega_hat = _parameter_inputs(params)
    if lr_schedule is not None:
        eta = _schedule(lr_schedule, n)
        return _scheduled_parameter_rows(leak, leak_hat, omega_hat, workload, n, eta)
    return _toeplitz_parameter_rows(*parameter_terms_arrays(leak, leak_hat, omega_hat, workload), n)


def parameter_error(params: BLTParams, n: int, workload: ParameterWorkload, error: str = "max",
                    lr_schedule=None) -> float:
    """max_t or mean_t of ``parameter_per_query_errors`` (closed form when it exists)."""
    if error not in ("max", "mean"):
        raise ValueError(f"error must be 'max' or 'mean', got {error!r}")
    n = _horizon(n)
    eta = None if lr_schedule is None else _schedule(lr_schedule, n)
    leak, leak_hat, omega_hat = _parameter_inputs(params)
    poles = np.concatenate([[0.0, 1.0 - workload.momentum], leak_hat])
    gaps = np.abs(poles[:, None] - poles[None, :]) + np.eye(poles.shape[0])
    if eta is None and np.min(gaps) < 1e-4:
        # Close poles (theta_hat_j near beta): the O(B^2) double sums cancel to ~eps / gap^2,
        # the rows (single sums) only to ~eps / gap. Use the rows, O(nB).
        rows = parameter_per_query_errors(params, n, workload)
        return float(rows.max() if error == "max" else rows.mean())
    return float(parameter_error_arrays(leak, leak_hat, omega_hat, workload, n, error, eta))


def _schedule(lr_schedule, n: int) -> np.ndarray:
    eta = np.asarray(lr_schedule, dtype=np.float64)
    if eta.shape != (n,):
        raise ValueError(f"lr_schedule must give one value per step: expected {n} values, got shape {eta.shape}")
    if not np.all(np.isfinite(eta) & (eta > 0)):
        raise ValueError("lr_schedule values must be finite and > 0")
    return eta
