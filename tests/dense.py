"""Dense and brute-force float64 oracles for the Toeplitz / BLT mathematics (and the written-out
Adam that the noise correction is checked against).

Everything here is written from the definitions (docs/math.md sections 1, 3 and 4), never from
opake's implementation, and never calls opake. The routines are deliberately naive: they build
n x n matrices, solve triangular systems and enumerate participation patterns, so they are only
usable for small n (dense: n <= ~100, brute-force sensitivity: n <= ~14). The few O(n) helpers at
the end are direct transcriptions of a definition (a sum over lags, a recurrence) for the tests
at large n where no matrix fits.

Conventions (0-based): C[t, s] = c[t - s] for t >= s, lower-triangular Toeplitz. A BLT with decays
theta and output scales omega has c_0 = 1, c_k = sum_i omega_i * theta_i**(k - 1) for k >= 1.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import solve_triangular
from scipy.linalg import toeplitz as _scipy_toeplitz


# ---------------------------------------------------------------------------------------------
# Matrices


def blt_coefs(theta, omega, n: int) -> np.ndarray:
    """First column of a BLT's C, straight from the definition (papers' convention).

    c_0 = 1 and c_k = sum_i omega_i * theta_i**(k-1) for k >= 1; ``0.0**0 == 1`` so a decay of
    exactly 0 gives c_1 = omega and c_k = 0 beyond. One buffer at a time, so a long horizon costs
    O(n) memory, not O(n B).
    """
    theta = np.asarray(theta, dtype=np.float64).reshape(-1)
    omega = np.asarray(omega, dtype=np.float64).reshape(-1)
    c = np.zeros(n, dtype=np.float64)
    if n == 0:
        return c
    c[0] = 1.0
    if n > 1:
        for th, om in zip(theta, omega):
            c[1:] += om * powers(th, n - 1)  # theta^(k-1) for lags k = 1 .. n-1
    return c


def noise_row_norms(mechanism, n: int) -> np.ndarray:
    """||row t of C^-1||^2 for t < n, from the dense inverse of a streaming mechanism's C (its Toeplitz
    coefficients, BLT parameters, or the identity): each step's noise variance over (sigma C / B)^2."""
    if getattr(mechanism, "coefs", None) is not None:
        coefs = np.concatenate([mechanism.coefs, np.zeros(n - len(mechanism.coefs))])
    elif mechanism.num_buffers == 0:
        coefs = np.eye(1, n)[0]
    else:
        coefs = blt_coefs(mechanism.theta, mechanism.omega, n)
    return (inverse_matrix(lower_toeplitz(coefs)) ** 2).sum(axis=1)


def powers(base: float, count: int) -> np.ndarray:
    """base**j for j = 0 .. count-1, each within ~3 ulp of the correctly rounded value.

    j = q L + r with L = ceil(sqrt(count)): base**j = base**(q L) * base**r, two short
    np.power tables and one product (np.power on the whole range is ~30x slower). 0**0 = 1.
    """
    block = max(1, math.isqrt(count - 1) + 1) if count > 0 else 1
    low = np.power(float(base), np.arange(block, dtype=np.float64))
    high = np.power(float(base), block * np.arange(-(-count // block), dtype=np.float64))
    return (high[:, None] * low[None, :]).reshape(-1)[:count]


def lower_toeplitz(coefs) -> np.ndarray:
    """The n x n lower-triangular Toeplitz matrix with first column ``coefs``."""
    c = np.asarray(coefs, dtype=np.float64)
    return _scipy_toeplitz(c, np.zeros_like(c))


def inverse_matrix(matrix: np.ndarray) -> np.ndarray:
    """C^{-1} of a lower-triangular C by forward substitution (scipy)."""
    n = matrix.shape[0]
    return solve_triangular(matrix, np.eye(n), lower=True)


def workload(n: int, momentum: float = 1.0, lr_schedule=None) -> np.ndarray:
    """W[t, s] = eta_t * beta**(t - s) for t >= s, 0 above the diagonal (A = ones when beta = 1)."""
    t = np.arange(n)
    lag = t[:, None] - t[None, :]
    w = np.where(lag >= 0, np.power(float(momentum), np.maximum(lag, 0).astype(np.float64)), 0.0)
    if lr_schedule is not None:
        eta = np.asarray(lr_schedule, dtype=np.float64)
        assert eta.shape == (n,)
        w = eta[:, None] * w
    return w


def per_query_errors(matrix: np.ndarray, momentum: float = 1.0, lr_schedule=None) -> np.ndarray:
    """e_t = ||row_t(W C^{-1})||^2 for the strategy matrix ``matrix`` = C."""
    n = matrix.shape[0]
    w = workload(n, momentum, lr_schedule)
    # X = W C^{-1}  <=>  C^T X^T = W^T (upper-triangular solve).
    x = solve_triangular(matrix.T, w.T, lower=False).T
    return np.sum(x * x, axis=1)


# ---------------------------------------------------------------------------------------------
# Sensitivity by enumeration


def effective_participations(n: int, min_sep: int, max_participations=None) -> int:
    """k' = min(k, ceil(n / b)), k = None meaning ceil(n / b)."""
    cap = -(-n // min_sep)
    return cap if max_participations is None else min(max_participations, cap)


def participation_patterns(n: int, min_sep: int, max_participations=None):
    """Every set {t_1 < ... < t_m}, 1 <= m <= k', of steps in 0..n-1 with gaps >= min_sep."""
    kprime = effective_participations(n, min_sep, max_participations)
    out = []

    def extend(prefix, first_free):
        if prefix:
            out.append(tuple(prefix))
        if len(prefix) == kprime:
            return
        for t in range(first_free, n):
            prefix.append(t)
            extend(prefix, t + min_sep)
            prefix.pop()

    extend([], 0)
    return out


def _check_nonnegative_gram(matrix: np.ndarray) -> None:
    # With C^T C >= 0 entrywise, the worst gradients for a pattern all point the same way, so
    # max over 0/1 indicators of ||C x||^2 is the true squared L2 sensitivity.
    gram = matrix.T @ matrix
    assert np.all(gram >= 0.0), "oracle precondition violated: C^T C has a negative entry"


def brute_force_sensitivity_squared(matrix: np.ndarray, min_sep: int, max_participations=None) -> float:
    """max over participation patterns of ||C x||^2, x the pattern's 0/1 indicator."""
    _check_nonnegative_gram(matrix)
    n = matrix.shape[0]
    patterns = participation_patterns(n, min_sep, max_participations)
    x = np.zeros((n, len(patterns)))
    for j, pattern in enumerate(patterns):
        x[list(pattern), j] = 1.0
    y = matrix @ x
    return float(np.max(np.sum(y * y, axis=0)))


class PatternTable:
    """All non-empty subsets of 0..n-1 with their ||C x||^2, size and smallest gap.

    Answers brute-force sensitivity for every (min_sep, max_participations) of one C from a
    single enumeration (2^n - 1 subsets; keep n <= ~14).
    """

    def __init__(self, matrix: np.ndarray):
        _check_nonnegative_gram(matrix)
        n = matrix.shape[0]
        self.n = n
        masks = np.arange(1, 2**n, dtype=np.int64)
        x = ((masks[:, None] >> np.arange(n)[None, :]) & 1).astype(np.float64)  # (subsets, n)
        y = x @ matrix.T
        self.norms = np.sum(y * y, axis=1)
        self.sizes = x.sum(axis=1).astype(np.int64)
        min_gap = np.full(masks.shape[0], n + 1, dtype=np.int64)  # a single step: no gap
        for row, mask in enumerate(masks):
            steps = [t for t in range(n) if (mask >> t) & 1]
            if len(steps) > 1:
                min_gap[row] = min(b - a for a, b in zip(steps, steps[1:]))
        self.min_gap = min_gap

    def sensitivity_squared(self, min_sep: int, max_participations=None) -> float:
        kprime = effective_participations(self.n, min_sep, max_participations)
        ok = (self.min_gap >= min_sep) & (self.sizes <= kprime)
        return float(np.max(self.norms[ok]))


def single_participation_sensitivity_squared(matrix: np.ndarray) -> float:
    """Largest squared column norm of C."""
    return float(np.max(np.sum(matrix * matrix, axis=0)))


# ---------------------------------------------------------------------------------------------
# O(n) references for long horizons (direct transcriptions of a definition)


def minsep_worst_pattern_rows(coefs, min_sep: int, kprime: int) -> np.ndarray:
    """u = C x for x the indicator of {0, b, 2b, ..., (k'-1) b}: u_t = sum_m c_{t - m b}.

    Built by adding shifted copies of c (O(n k')); for a non-negative non-increasing c this is
    the worst pattern (BSR24 Thm 2), so sum(u**2) is the min-sep sensitivity squared.
    """
    c = np.asarray(coefs, dtype=np.float64)
    n = c.shape[0]
    u = np.zeros(n, dtype=np.float64)
    for m in range(kprime):
        start = m * min_sep
        if start >= n:
            break
        u[start:] += c[: n - start]
    return u


def blt_inverse_coefs_streaming(theta, omega, n: int) -> np.ndarray:
    """First column of C^{-1}: solve C x = e_0 by the buffered recurrence, in Python floats.

    y_t = x_t + sum_{k>=1} c_k x_{t-k} = x_t + sum_i omega_i S_i(t), with
    S_i(t) = sum_{k>=1} theta_i**(k-1) x_{t-k}, so S_i(t+1) = theta_i S_i(t) + x_t. Hence
    x_t = y_t - sum_i omega_i S_i(t). O(n B) and backward stable (no inverse parameters).
    """
    theta = [float(v) for v in np.asarray(theta, dtype=np.float64).reshape(-1)]
    omega = [float(v) for v in np.asarray(omega, dtype=np.float64).reshape(-1)]
    state = [0.0] * len(theta)
    out = np.empty(n, dtype=np.float64)
    for t in range(n):
        x = (1.0 if t == 0 else 0.0) - sum(om * s for om, s in zip(omega, state))
        out[t] = x
        state = [th * s + x for th, s in zip(theta, state)]
    return out


def toeplitz_per_query_errors_long(inverse_coefs, momentum: float = 1.0, lr_schedule=None) -> np.ndarray:
    """e_t for W = D_eta M_beta and Toeplitz C, O(n): W C^{-1} is D_eta times a Toeplitz matrix.

    M_beta C^{-1} is lower-triangular Toeplitz with first column d_k = sum_{j<=k} beta^(k-j) chat_j
    (d_k = beta d_{k-1} + chat_k), so row t has squared norm eta_t^2 sum_{k<=t} d_k^2.
    """
    chat = np.asarray(inverse_coefs, dtype=np.float64)
    d = np.empty_like(chat)
    acc = 0.0
    beta = float(momentum)
    for k, v in enumerate(chat.tolist()):
        acc = beta * acc + v
        d[k] = acc
    e = np.cumsum(d * d)
    if lr_schedule is not None:
        e = np.asarray(lr_schedule, dtype=np.float64) ** 2 * e
    return e


def optimal_toeplitz_sqrt_max_loss(n: int) -> float:
    """sum_{k<n} s_k^2 for the square-root factorization s_k = binom(2k, k) / 4^k.

    The recurrence s_k = s_{k-1} (2k - 1) / (2k) in float64 (cumulative product).
    """
    k = np.arange(1, n, dtype=np.float64)
    s = np.concatenate(([1.0], np.cumprod((2.0 * k - 1.0) / (2.0 * k))))
    return math.fsum((s * s).tolist()) if n <= 2_000_000 else float(np.sum(s * s))


# ---------------------------------------------------------------------------------------------
# The parameter trajectory of torch.optim.SGD, read off the real optimizer


def torch_sgd_trajectory_matrix(n: int, momentum: float = 0.0, dampening: float = 0.0,
                                nesterov: bool = False, lr_schedule=None) -> np.ndarray:
    """W[t, s] = -(change of the parameters after step t) for a unit gradient at step s only.

    Runs torch.optim.SGD itself (float64) on a parameter vector of n coordinates; at step u the
    gradient is e_u, so coordinate s sees the impulse "gradient 1 at step s, 0 elsewhere" and its
    trajectory is column s of the linear map from gradient noise to parameter noise. SGD is
    coordinate-wise, including its momentum buffer (created on the first step from that step's
    gradient), so the coordinates do not interact. The learning rate of step u is set in the
    param group before the step, as LR schedulers do. No formula of opake is used.
    """
    import torch

    param = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0, momentum=momentum, dampening=dampening, nesterov=nesterov)
    eta = np.ones(n) if lr_schedule is None else np.asarray(lr_schedule, dtype=np.float64)
    out = np.empty((n, n))
    for u in range(n):
        opt.param_groups[0]["lr"] = float(eta[u])
        grad = torch.zeros(n, dtype=torch.float64)
        grad[u] = 1.0
        param.grad = grad
        opt.step()
        out[u] = -param.detach().numpy()
    return out


def per_query_errors_of(workload_matrix: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """e_t = ||row_t(W C^{-1})||^2 for any dense workload W and strategy matrix C."""
    x = solve_triangular(matrix.T, workload_matrix.T, lower=False).T
    return np.sum(x * x, axis=1)


def written_out_adam(theta, gradients, variances, *, lrs, betas, eps=0.0, weight_decay=0.0, decoupled=True,
                     floor="noise") -> list:
    """Adam in float64, step by step (the parameters after each step), from the update's definition.

    ``lrs``: one learning rate per step (or one for all). ``decoupled``: AdamW's weight decay,
    else Adam's (added to the gradient). The denominator: ``floor=None``, Adam's sqrt(v_hat) + eps;
    a number gamma', DP-AdamBC's sqrt(max(v_hat - phi_hat, gamma')) (the paper's form, no eps);
    ``"noise"``, sqrt(max(v_hat - phi_hat, phi_hat)) + eps. phi_t = beta2 phi_{t-1} + (1 - beta2) Var_t.
    """
    beta1, beta2 = betas
    lrs = [lrs] * len(gradients) if np.isscalar(lrs) else list(lrs)
    theta = np.array(theta, dtype=np.float64)
    m, v, phi = np.zeros_like(theta), np.zeros_like(theta), 0.0
    path = []
    for t, (g, variance, lr) in enumerate(zip(gradients, variances, lrs), start=1):
        g = np.array(g, dtype=np.float64)
        if weight_decay:
            if decoupled:
                theta = theta * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * theta
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        phi = beta2 * phi + (1 - beta2) * variance
        m_hat, v_hat, phi_hat = m / (1 - beta1**t), v / (1 - beta2**t), phi / (1 - beta2**t)
        if floor is None:
            denominator = np.sqrt(v_hat) + eps
        elif floor == "noise":
            denominator = np.sqrt(np.maximum(v_hat - phi_hat, phi_hat)) + eps
        else:
            denominator = np.sqrt(np.maximum(v_hat - phi_hat, floor))
        theta = theta - lr * m_hat / denominator
        path.append(theta.copy())
    return path
