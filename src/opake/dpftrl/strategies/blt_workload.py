"""Errors of SGD's parameter trajectory, W = S D_eta M, for a BLT (float64): the exact routes.

``ParameterWorkload`` describes torch.optim.SGD (momentum, dampening, Nesterov); the noise
C^{-1} z added to the gradients reaches the parameters as -S D_eta M C^{-1} z. Without a
schedule W C^{-1} is Toeplitz (apart from column 0 under dampening) and the errors have closed
forms in O(B^2); with a schedule, ``scheduled_parameter_rows`` computes every row in O(nB). These
are the exact references; the optimizer's fast path under a schedule is ``blt_schedule``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from opake.dpftrl.strategies.blt import (
    BLTParams,
    _horizon,
    _inverse_roots,
    _pairs,
    _reduced,
    _sum_pairs,
    error_arrays,
)
from opake.dpftrl.strategies.geometric import complement_of_product, cumulative_geometric_sum, geometric_sum, log1p
from opake.errors import InvalidArgumentError

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
            raise InvalidArgumentError(f"SGD momentum must be a number in [0, 1) (0 = plain SGD), got {beta!r}")
        if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 0.0 <= float(tau) <= 1.0:
            raise InvalidArgumentError(f"SGD dampening must be a number in [0, 1], got {tau!r}")
        if not isinstance(self.nesterov, bool):
            raise InvalidArgumentError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and (float(beta) == 0.0 or float(tau) != 0.0):
            raise InvalidArgumentError("Nesterov momentum needs momentum > 0 and dampening = 0 (as torch.optim.SGD)")
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


_BLOCK = 32  # block length of ``_powers`` and ``first_order_recurrence``


def _powers(leaks, n: int):
    """rho_a^k for k < n, shape (..., m, n); complex-step input through log1p (decays in (0, 1)).

    Blocked: rho^(b L + j) = (rho^L)^b rho^j with both factors from pow / exp (one rounding
    each), so the product is within a few ulps of the direct power at a fraction of its cost.
    """
    blocks = -(-n // _BLOCK)
    inner = np.arange(min(n, _BLOCK), dtype=np.float64)
    outer = inner.shape[0] * np.arange(blocks, dtype=np.float64)
    if np.iscomplexobj(leaks):
        log_r = log1p(-leaks[..., None])
        with np.errstate(divide="ignore", invalid="ignore"):
            small = np.where(inner == 0, 1.0, np.exp(inner * log_r))  # 0^0 = 1 for a decay of exactly 0
            big = np.where(outer == 0, 1.0, np.exp(outer * log_r))
    else:
        r = 1.0 - leaks[..., None]
        small, big = np.power(r, inner), np.power(r, outer)
    out = big[..., :, None] * small[..., None, :]
    return out.reshape(out.shape[:-2] + (-1,))[..., :n]


def first_order_recurrence(rho, f):
    """x_t = rho x_(t-1) + f_t along the last axis, x_(-1) = 0 (rho broadcast over the rest).

    For |rho| <= 1, real or complex (the complex step: the imaginary part is formed by the same
    sums of products as the real part, so it stays exact to first order). Blocks of length L:
    inside a block a product with the L x L lower-triangular matrix of rho^(k-j); the values
    at the block ends then follow the same recurrence in rho^L over n / L blocks (recursively),
    and x = (in-block value) + rho^(k+1) (value at the end of the previous block). Only powers
    rho^0..rho^L are formed, never rho^-k, so nothing grows.
    """
    f = np.asarray(f)
    dtype = np.result_type(rho, f, np.float64)
    n = f.shape[-1]
    if f.size == 0:
        return np.zeros(f.shape, dtype=dtype)
    rho = np.broadcast_to(np.asarray(rho, dtype=dtype), f.shape[:-1]).reshape(-1)
    rows = np.asarray(f, dtype=dtype).reshape(-1, n)
    return _recurrence(rho, rows).reshape(f.shape)


def _recurrence(rho, f):
    rows, n = f.shape
    size = min(n, _BLOCK)
    blocks = -(-n // size)
    steps, lag, lower = _block_tables(size)
    power = np.power(rho[:, None], steps)                            # rho^0..rho^L, 0^0 = 1
    tri = power[:, lag] * lower                                      # rho^(k-j) for j <= k, (rows, L, L)
    padded = f
    if blocks * size != n:
        padded = np.zeros((rows, blocks * size), dtype=f.dtype)
        padded[:, :n] = f
    local = padded.reshape(rows, blocks, size) @ np.swapaxes(tri, -1, -2)   # within each block
    if blocks > 1:
        ends = _recurrence(power[:, size], local[:, :, -1])          # x at each block's end
        carry = ends[:, :-1]
        if local.size <= 1 << 16:  # + rho^(k+1) x(previous end)
            local[:, 1:] += carry[:, :, None] * power[:, None, 1:]
        else:                      # (a column at a time: no (rows, n) temporary)
            for k in range(size):
                local[:, 1:, k] += carry * power[:, k + 1, None]
    return local.reshape(rows, -1)[:, :n]


_TABLES = {}


def _block_tables(size: int):
    """0..L as floats, the lags max(k - j, 0) and the mask j <= k of an L x L block."""
    if size not in _TABLES:
        lag = np.arange(size)[:, None] - np.arange(size)[None, :]
        _TABLES[size] = (np.arange(size + 1, dtype=np.float64), np.maximum(lag, 0), (lag >= 0).astype(np.float64))
    return _TABLES[size]


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


def bl_form_terms_arrays(leak, leak_hat, omega_hat, workload: ParameterWorkload):
    """T = M C^{-1} in BLT form: decays (as 1 - rho), weights R, gain g, dampening tau, and the
    position of the decay beta (used by column 0 under dampening; None without momentum).

    T[u, s] = d_{u-s} for s >= 1 with d_0 = g (1 - tau, or 1 + beta for Nesterov) and
    d_k = sum_a R_a rho_a^(k-1) (k >= 1) over rho = {beta, theta_hat}: the coefficients of
    M(x) Chat(x), times 1 - tau; column 0 is T[u, 0] = d_u + tau beta^u (M = (1 - tau) T_beta +
    tau beta^t e_0^T, ``parameter_terms_arrays``).
    """
    beta = workload.momentum
    extra = [1.0 - beta] if beta > 0.0 else []
    zeros = leak.shape[-1] + (1 if workload.nesterov else 0)
    leaks, r = _fractions_arrays(extra, leak, leak_hat, omega_hat, workload, len(extra) + leak_hat.shape[-1] - zeros)
    tau = workload.effective_dampening
    gain = 1.0 + beta if workload.nesterov else 1.0 - tau
    if tau > 0.0:
        r = (1.0 - tau) * r
    return leaks, r, gain, tau, (0 if beta > 0.0 else None)


def scheduled_parameter_rows(leak, leak_hat, omega_hat, workload: ParameterWorkload, n: int, eta):
    """All e_t of W = S D_eta M C^{-1} for a schedule eta, O(n m) with m = B + 1 decays.

    With T = M C^{-1} in BLT form (``bl_form_terms_arrays``), P = S D_eta T,
    P[t, s] = sum_{u=s}^t eta_u T[u, s].
    Split e_t = P[t, 0]^2 + e'_t with e'_t = sum_{s=1}^t P[t, s]^2. Since
    P[t, s] = P[t-1, s] + eta_t d_{t-s} (P[t-1, t] = 0):

        e'_t   = e'_{t-1} + 2 eta_t c_t + eta_t^2 E_{t-1},      E_j = sum_{k<=j} d_k^2
        c_t    = sum_{s=1}^{t-1} P[t-1, s] d_{t-s} = sum_a R_a X_a(t-1)
        X_a(t) = sum_{s=1}^t P[t, s] rho_a^(t-s) = rho_a X_a(t-1) + eta_t Y_a(t-1),  X_a(0) = 0
        Y_a(j) = sum_{k<=j} d_k rho_a^k
        P[t,0] = sum_{u<=t} eta_u T[u, 0]

    Everything is a cumulative sum except X, a first-order recursive filter per decay
    (``first_order_recurrence``, which keeps the complex step's imaginary part exact). No powers
    rho^-k are formed, and |rho| <= 1, so the recursion is stable.
    """
    if n < 65536:  # (setting the limit costs ~1 ms)
        return _scheduled_rows(leak, leak_hat, omega_hat, workload, n, eta)
    # long horizons: the block products are many small ones, and BLAS threads only contend
    # with each other on them (2-3x slower on 2 cores)
    with threadpool_limits(limits=1, user_api="blas"):
        return _scheduled_rows(leak, leak_hat, omega_hat, workload, n, eta)


def _scheduled_rows(leak, leak_hat, omega_hat, workload: ParameterWorkload, n: int, eta):
    # One decay at a time: the (m, n) arrays are never held, so a long horizon needs a few
    # length-n buffers (reused) instead of fresh (m, n) ones (their page faults cost as much as
    # the arithmetic at n = 1e6).
    leaks, r, gain, tau, _ = bl_form_terms_arrays(leak, leak_hat, omega_hat, workload)
    beta = workload.momentum
    m = leaks.shape[-1]
    dtype = np.result_type(leaks, r, np.float64)
    d = np.zeros(leaks.shape[:-1] + (n,), dtype=dtype)
    d[..., 0] = gain
    for a in range(m):                                           # d_k = sum_a R_a rho_a^(k-1), k >= 1
        term = _powers(leaks[..., a: a + 1], n - 1)[..., 0, :]
        term *= r[..., a: a + 1]
        d[..., 1:] += term
    energy = np.cumsum(d * d, axis=-1)
    c = np.zeros(d.shape, dtype=dtype)
    for a in range(m):
        y = _powers(leaks[..., a: a + 1], n)[..., 0, :]
        y *= d
        np.cumsum(y, axis=-1, out=y)                             # Y_a(j)
        # g_j = eta_(j+1) Y_a(j), in place; then X_a(t) = sum_(s<t) rho_a^(t-1-s) g_s is the
        # recurrence on g (X_a(0) = 0), and c_t = sum_a R_a X_a(t-1)
        g = y[..., :-1]
        g *= eta[1:]
        x = first_order_recurrence(1.0 - leaks[..., a], g)      # X_a(1..n-1)
        x = x[..., :-1]
        x *= r[..., a: a + 1]
        c[..., 2:] += x
    step = 2.0 * eta * c
    step[..., 1:] += eta[1:] ** 2 * energy[..., :-1]
    first = d
    if tau > 0.0:
        first = first + tau * _powers(np.array([1.0 - beta]), n)[0]
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
    ``scheduled_parameter_rows``).
    """
    if lr_schedule is not None:
        rows = scheduled_parameter_rows(leak, leak_hat, omega_hat, workload, n,
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
        return scheduled_parameter_rows(leak, leak_hat, omega_hat, workload, n, eta)
    return _toeplitz_parameter_rows(*parameter_terms_arrays(leak, leak_hat, omega_hat, workload), n)


# Poles closer than this use the rows: eps / gap^2 <= 1e-11. (At 1e-4 a random BLT with
# 1 - theta_hat 1.3e-4 from 1 - beta = 0.1 gave a max 2.3e-10 off the dense oracle.)
_CLOSE_POLES = 5e-3


def parameter_error(params: BLTParams, n: int, workload: ParameterWorkload, error: str = "max",
                    lr_schedule=None) -> float:
    """max_t or mean_t of ``parameter_per_query_errors`` (closed form when it exists)."""
    if error not in ("max", "mean"):
        raise InvalidArgumentError(f"error must be 'max' or 'mean', got {error!r}")
    n = _horizon(n)
    eta = None if lr_schedule is None else _schedule(lr_schedule, n)
    leak, leak_hat, omega_hat = _parameter_inputs(params)
    poles = np.concatenate([[0.0, 1.0 - workload.momentum], leak_hat])
    gaps = np.abs(poles[:, None] - poles[None, :]) + np.eye(poles.shape[0])
    if eta is None and np.min(gaps) < _CLOSE_POLES:
        # Close poles (theta_hat_j near beta): the O(B^2) double sums cancel to ~eps / gap^2,
        # the rows (single sums) only to ~eps / gap. Use the rows, O(nB).
        rows = parameter_per_query_errors(params, n, workload)
        return float(rows.max() if error == "max" else rows.mean())
    return float(parameter_error_arrays(leak, leak_hat, omega_hat, workload, n, error, eta))


def _schedule(lr_schedule, n: int) -> np.ndarray:
    eta = np.asarray(lr_schedule, dtype=np.float64)
    if eta.shape != (n,):
        raise InvalidArgumentError(
            f"lr_schedule must give one value per step: expected {n} values, got shape {eta.shape}"
        )
    if not np.all(np.isfinite(eta) & (eta > 0)):
        raise InvalidArgumentError("lr_schedule values must be finite and > 0")
    return eta
