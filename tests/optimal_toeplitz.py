"""The best general lower-triangular Toeplitz strategy for a weighted workload, by brute force.

Test and benchmark code (never imported by opake): it judges the BLT optimizer's buffer count
against the strategy class BLTs approximate. For a single participation the sensitivity of a
lower-triangular Toeplitz C with first column c is its largest column norm, ||c||_2 (the other
columns are truncations of the first), and the loss is

    ||c||^2 * max_t ||row_t(W C^{-1})||^2,

invariant under c -> s c, so c_0 = 1. The n - 1 free coefficients are optimized in float64 with
torch's L-BFGS on the smooth p-mean ((1/n) sum_t r_t^p)^(1/p) of the rows r_t (a lower bound of
the max that tends to it), p = 8 .. 2048, starting from a given strategy (a BLT's coefficients).
The value returned is the exact max of the best iterate seen, so it is the loss of an actual
Toeplitz strategy: an upper bound on the optimum, and below the start whenever the start can be
improved.
"""

from __future__ import annotations

import numpy as np
import torch

POWERS = (8.0, 32.0, 128.0, 512.0, 2048.0)


def toeplitz_loss(workload: np.ndarray, coefs: np.ndarray) -> float:
    """||c||^2 max_t ||row_t(W C^{-1})||^2 for the lower-triangular Toeplitz C with first column c."""
    sens2, rows = _terms(torch.as_tensor(workload, dtype=torch.float64),
                         torch.as_tensor(coefs, dtype=torch.float64))
    return float(sens2 * rows.max())


def _terms(w: torch.Tensor, col: torch.Tensor):
    n = w.shape[0]
    idx = torch.arange(n)
    lag = idx[:, None] - idx[None, :]
    c = torch.where(lag >= 0, col[lag.clamp(min=0)], torch.zeros((), dtype=col.dtype))
    x = torch.linalg.solve_triangular(c.T, w.T, upper=True).T           # W C^{-1}
    return (col * col).sum(), (x * x).sum(dim=1)


def optimal_toeplitz(workload: np.ndarray, start: np.ndarray, *, iterations: int = 300) -> tuple[float, np.ndarray]:
    """(loss, coefficients) of the best Toeplitz strategy found from ``start`` (first column)."""
    w = torch.as_tensor(workload, dtype=torch.float64)
    start = np.asarray(start, dtype=np.float64) / float(start[0])
    free = torch.tensor(start[1:], dtype=torch.float64, requires_grad=True)
    one = torch.ones(1, dtype=torch.float64)
    best_loss, best = toeplitz_loss(workload, start), start.copy()
    for power in POWERS:
        optimizer = torch.optim.LBFGS([free], lr=1.0, max_iter=iterations, history_size=50,
                                      line_search_fn="strong_wolfe", tolerance_grad=1e-14, tolerance_change=1e-16)

        def closure():
            optimizer.zero_grad()
            sens2, rows = _terms(w, torch.cat([one, free]))
            top = rows.max().detach()
            value = torch.log(sens2) + torch.log(top) + torch.log(torch.mean((rows / top) ** power)) / power
            value.backward()
            return value

        optimizer.step(closure)
        coefs = torch.cat([one, free]).detach().numpy()
        loss = toeplitz_loss(workload, coefs)
        if loss < best_loss:
            best_loss, best = loss, coefs.copy()
    return best_loss, best
