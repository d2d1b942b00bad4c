"""Errors of SGD's parameter noise under a learning-rate schedule, at a cost independent of n.

The workload is W = S D_eta M (``blt_workload.ParameterWorkload``): row t of W C^{-1} is the
noise in the parameters after step t of torch.optim.SGD. With T = M C^{-1} in BLT form (decays
rho_a = beta, theta_hat_1..B, weights R_a, gain g, dampening tau; ``blt_workload``), the row is

    P[t, 0] = eta_0 (g + tau) + sum_a R_a F_t(a) + tau beta F_t(beta),
    P[t, s] = g eta_s + sum_a R_a V_a(s, t),   V_a(s, t) = sum_{u=s+1}^t eta_u rho_a^(u-s-1)   (s >= 1),

and e_t = P[t, 0]^2 + sum_{s=1}^t P[t, s]^2. Expanding the square,

    sum_s P[t, s]^2 = g^2 Q_t + 2 g sum_a R_a A_t(a) + sum_ab R_a R_b Z_t(a, b),
    Q_t = sum_{u=1}^t eta_u^2,   F_t(r) = sum_{u=1}^t eta_u r^(u-1),
    A_t(r) = sum_{1<=s<u<=t} eta_s eta_u r^(u-s-1),   Z_t(a, b) = sum_{s=1}^t V_a(s, t) V_b(s, t).

Z couples two decays, but V_a(s - 1, t) = eta_s + rho_a V_a(s, t) and V_a(t, t) = 0, so summing
V_a(s-1) V_b(s-1) over s = 1..t telescopes to

    (1 - rho_a rho_b) Z_t(a, b) = Q_t + rho_a A_t(a) + rho_b A_t(b) - F_t(a) F_t(b).       (*)

Every row is therefore made of transforms of the schedule in ONE decay at a time: F_t(r), A_t(r)
for the m = B + 1 decays, with O(m^2) algebra on top. When both decays are slow on the row's
scale the right side of (*) cancels: its terms are ~3 / ((1 - rho_a rho_b) t) times the result.
Where (1 - rho_a rho_b) t < SLOW it is rewritten with the complements dF_t(r) = F_t(1) - F_t(r)
= sum_u eta_u (1 - r^(u-1)) and dA_t(r) = A_t(1) - A_t(r), each computed directly (never by the
subtraction), using F_t(1)^2 = Q_t + 2 A_t(1):

    (1 - rho_a rho_b) Z = F_t(1) (dF_a + dF_b) - dF_a dF_b - rho_a dA_a - rho_b dA_b - (q_a + q_b) A_t(1),

q = 1 - rho, whose terms are all of the size of the result.

The transforms are sums over the pieces of a compressed schedule (``piecewise``: eta = phi_j(k)
on [s_j, s_j + L_j), polynomials of degree p). For a piece, with r^(s_j - 1) factored out,

    F:  sum_k phi(k) r^k = M[phi],            A:  Phi_j M[phi] + sum_{d>=1} r^(d-1) alpha(d) = Phi_j M + W,
    Phi_{j+1} = r^(L_j) Phi_j + M[phi^R],     Phi_j = sum_{u<s_j} eta_u r^(s_j-1-u),

(phi^R(k) = phi(L - 1 - k), alpha the piece's autocorrelation, a polynomial of degree 2p + 1), and
the complements follow from 1 - r^(a+b) = (1 - r^a) + r^a (1 - r^b). Each M is a dot product of
the piece's coefficients with moments nu_q(r) = sum_{k<L} (k / L)^q r^k, written through the
binomial moments mu_j = sum_{k<L} C(k, j) r^k = r^j (1 - r)^-(j+1) P(Bin(L, 1 - r) >= j + 1)
(``binomial_moments``) and Stirling numbers (non-negative weights): the binomial tail is summed
on its small side, so no regime of r, fast or within 1e-14 of 1, cancels. Moments depend only on
(decay, length), and the pieces share few lengths. Inside a window of rows the same transforms
advance one step at a time (F += eta_u r^(u-1), A += eta_u Phi(u), Phi(u+1) = r Phi(u) + eta_u).

The max over rows (``ScheduledParameterErrors._max_group``) is exact under one assumption: that
e_t is smooth between neighbouring piece ends, so that the curvature estimated from the ends
bounds how far it rises between them. Coarse pieces (>= COARSE, graded 1, 2, 4, ... steps after
step 1 and after every jump or kink of the schedule, where transients start) give rows at their
ends; each piece that might beat the best row so far is opened into FINE fine pieces, and each
fine piece that might into its rows (neighbouring such pieces together, as one run: ``_runs``;
the fine level of a run is built when first opened). Breaks of the assumption are schedules
without structure.

Gradients. The optimizer evaluates 2B + 1 complex-step probes that share their real part. The
search runs on the real parts (real arithmetic, one probe); the moments' exact derivatives
d nu_q / d(1 - r) = -(L / r) nu_(q+1) are carried forward along the path that found the row, and
only that row is evaluated on every probe. Per evaluation: a few hundred small numpy operations,
against O(n m) for the step recursion of ``blt_workload.scheduled_parameter_rows``.
"""

from __future__ import annotations

import math

import numpy as np

from opake.dpftrl.strategies import piecewise
from opake.dpftrl.strategies.blt_workload import bl_form_terms_arrays, first_order_recurrence
from opake.dpftrl.strategies.geometric import complement_of_product
from opake.errors import InvalidArgumentError

SLOW = 0.05           # (1 - rho_a rho_b) t below this: the complementary form of (*)
COARSE = 128          # at least this many coarse pieces over the horizon
FINE = 32             # fine pieces per coarse piece
# (128 x 32 keeps the fine pieces of 64 x 64 and halves an opened run's fine level: 4-7% fewer
# instructions per evaluation at n = 1e5 and 1e6; 64 x 32 is cheaper at 1e5 but 20% dearer at 1e6)
SHORT = 256           # coarse pieces this short are stepped through without a fine level
ALL_ROWS = 1024       # horizons this short: every row is computed (the step recursion)
SAFETY = 1.0          # factor on the curvature bound that decides which pieces are opened
MARGIN = 1e-9         # pieces that cannot beat the best row by this (relative) are not opened
_TAIL_TERMS = 40      # binomial terms beyond the highest moment


def binomial_moments(x: np.ndarray, length: np.ndarray, count: int):
    """mu_j = sum_{k<L} C(k, j) r^k and dmu_j = sum_{k<L} C(k, j) (1 - r^k), j < count.

    x = 1 - r in (0, 1] (real), L >= 0 integer-valued, broadcast together. mu_j = r^j x^-(j+1)
    U_j with U_j = P(Bin(L, x) >= j + 1), from the binomial terms b_i = C(L, i) x^i r^(L-i)
    (i <= count + 40): U_j = 1 - sum_{i<=j} b_i while that lower sum is at most 1/2, else the
    upper sum sum_{i>j} b_i (the median is then at most j, so the terms beyond count + 40 are
    below 1e-17 of it). The complement dmu_j = C(L, j+1) - mu_j is formed directly when
    mu_j <= C/2, else (slow decays) as C(L, j+1) (1 - r^(L-1)) - r^j x^-(j+1) sum_{i>j+1} b_i
    (the i = j + 1 term of mu_j cancelled exactly).
    """
    x, length = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(length, dtype=np.float64))
    shape = x.shape
    table = _LengthTable(length.reshape(-1), count)
    mu, dmu = table.moments(x.reshape(-1), pairwise=False)
    return mu.T.reshape(shape + (count,)), dmu.T.reshape(shape + (count,))


class _LengthTable:
    """The x-independent parts of ``binomial_moments`` for fixed lengths L (log C(L, i), C(L, j+1)),
    computed once; ``moments`` evaluates them for decays x."""

    def __init__(self, length: np.ndarray, count: int):
        self.count = count
        self.length = np.asarray(length, dtype=np.float64)
        terms = count + _TAIL_TERMS
        self.terms = terms
        idx = _INDEX[: terms + 1, None]
        with np.errstate(divide="ignore"):
            steps = np.log(np.maximum(self.length - idx[:-1], 0.0))     # -inf once i >= L: C(L, i) = 0
        steps -= _LOG_NEXT[:terms, None]
        log_c = np.zeros((terms + 1, self.length.shape[0]))
        np.cumsum(steps, axis=0, out=log_c[1:])                          # log C(L, i), (terms + 1, U)
        self.log_c = log_c
        self.c_next = piecewise.binomials_of(self.length, count + 1)[:, 1:].T   # C(L, j + 1), (count, U)
        self.last = np.maximum(self.length - 1.0, 0.0)

    def moments(self, x: np.ndarray, pairwise: bool = True):
        """(mu, dmu) of shape (count, m, U) for decays x (m,) against every length (``pairwise``),
        or of shape (count, U) for one x per length (x of shape (U,))."""
        count = self.count
        x = np.clip(x, _X_MIN, _X_MAX)  # see _X_MIN
        log_r, log_x = np.log1p(-x), np.log(x)
        idx = _INDEX[: self.terms + 1, None]
        if pairwise:  # axes (term, decay, length)
            idx = idx[:, :, None]
            log_r, log_x = log_r[:, None], log_x[:, None]
            log_b = self.log_c[:, None, :] + idx * (log_x - log_r) + self.length * log_r
        else:
            log_b = self.log_c + idx * (log_x - log_r) + self.length * log_r
        b = np.exp(log_b)
        lower = np.cumsum(b[:count], axis=0)
        upper = np.cumsum(b[:0:-1], axis=0)[::-1]                              # sum_{i' > i} b_i', i < terms
        # (np.where is slow on this numpy; both branches are finite, so blend arithmetically)
        use_lower = lower <= 0.5
        u = upper[:count] + use_lower * (1.0 - lower - upper[:count])
        scale = np.exp(idx[:count] * log_r - idx[1: count + 1] * log_x)       # r^j x^-(j+1)
        mu = scale * u
        c_next = self.c_next[:, None, :] if pairwise else self.c_next
        first = -np.expm1(self.last * log_r)
        slow = c_next * first - scale * upper[1: count + 1]
        direct = c_next - mu
        dmu = slow + (mu <= 0.5 * c_next) * (direct - slow)
        np.maximum(dmu, 0.0, out=dmu)
        return mu, dmu                                   # axes (j, [decay,] length)

    def stacked(self, x: np.ndarray) -> np.ndarray:
        """mu and dmu for decays x (m,), as one array (U, count, 2m): [..., :m] mu, [..., m:] dmu."""
        mu, dmu = self.moments(x)
        return np.concatenate([mu, dmu], axis=1).transpose(2, 0, 1)


# 1 - r is clipped to [1e-15, 1 - 2^-53]: below 1e-15 the moments equal the power sums to
# L * 1e-15 (the optimizer's decays stay above e^-32 = 1.3e-14 anyway), and r = 0 becomes 1e-16
_X_MIN, _X_MAX = 1e-15, 1.0 - 2.0 ** -53
_INDEX = np.arange(200, dtype=np.float64)
_LOG_NEXT = np.log(_INDEX + 1.0)


class _Level:
    """Pieces [start, start + length) of the compressed schedule with their polynomial data, and
    the closed-form transforms at their ends (real decays, with derivatives in x = 1 - rho)."""

    def __init__(self, start, length, coef, degree: int):
        self.start = np.asarray(start, dtype=np.int64)
        self.length = np.asarray(length, dtype=np.int64)
        self.row_end = self.start + self.length - 1
        lengthf = self.length.astype(np.float64)
        self.startf, self.lengthf = self.start.astype(np.float64), lengthf
        rev = piecewise.substitute(coef, (lengthf - 1.0) / lengthf, -1.0)
        alpha = piecewise.autocorrelation(coef, lengthf, lengthf)
        square = piecewise.product(coef, coef)
        ps = piecewise.power_sums(lengthf, lengthf, 2 * degree)
        self.s1 = np.einsum("kq,kq->k", coef, ps[:, : degree + 1])
        self.s2 = np.einsum("kq,kq->k", square, ps)
        self.s_alpha = 0.5 * (self.s1 * self.s1 - self.s2)
        self.count = 2 * degree + 3
        # sum_q c_q nu_q = sum_j w_j mu_j with w_j = sum_q c_q h^-q S(q, j) j!, and the derivative
        # -(h / r) sum_q c_q nu_(q+1) = -(1 / r) sum_j w'_j mu_j with w'_j = sum_q c_q h^-q S(q+1, j) j!
        st = piecewise.STIRLING[: self.count, : self.count]
        w = {}
        for name, poly in (("phi", coef), ("rev", rev), ("alpha", alpha)):
            deg = poly.shape[-1]
            scaled = poly * np.power(lengthf[:, None], -np.arange(deg, dtype=np.float64))
            w[name] = (scaled @ st[:deg], scaled @ st[1: deg + 1])
        # stacked for one contraction each: [phi, phi', rev, rev'] on the length-L moments,
        # [alpha, alpha'] on the length-(L-1) ones
        # stacked for one contraction each: [phi, rev, alpha] and their derivative weights, (k, 3, count)
        self.w_val = np.stack([w["phi"][0], w["rev"][0], w["alpha"][0]], axis=1)
        self.w_der = np.stack([w["phi"][1], w["rev"][1], w["alpha"][1]], axis=1)
        # The moments of length L are those of length L - 1 plus their last term C(L-1, j) r^(L-1)
        # (non-negative: no cancellation), so only the lengths L - 1 go to ``binomial_moments``;
        # phi and rev (over length L) add sum_j w_j C(L-1, j) r^(L-1), alpha (length L - 1) not.
        binom = piecewise.binomials_of(lengthf - 1.0, self.count)                 # (k, count)
        self.wb_val = np.einsum("kcj,kj->kc", self.w_val[:, :2], binom)          # (k, 2)
        self.wb_der = np.einsum("kcj,kj->kc", self.w_der[:, :2], binom)
        self._ranges = {}

    def _schedule_sums(self, lo: int, hi: int):
        """The decay-free parts of pieces lo..hi-1 (cached per range): the offsets of phi1 at the
        k + 1 starts from the range's start, and at the ends the cumulative Q, F1 and the part of
        A1 that does not depend on the starting phi1 (A1 = A1_0 + phi1_0 F1' + A1')."""
        key = ("sums", lo, hi)
        if key not in self._ranges:
            s1 = self.s1[lo:hi]
            offsets = _exclusive_cumsum(s1, extra=True)
            sums = np.cumsum(np.stack([self.s2[lo:hi], s1, offsets[:-1] * s1 + self.s_alpha[lo:hi]]), axis=-1)
            self._ranges[key] = (offsets, sums)
        return self._ranges[key]

    def _lengths(self, lo: int, hi: int):
        """The moment table of the distinct L - 1 of pieces lo..hi-1 and where each piece's is
        (cached per range)."""
        key = (lo, hi)
        if key not in self._ranges:
            lengths, which = np.unique(self.lengthf[lo:hi] - 1.0, return_inverse=True)
            self._ranges[key] = (_LengthTable(lengths, self.count), which.reshape(-1))
        return self._ranges[key]

    @property
    def size(self) -> int:
        return int(self.start.shape[0])

    def transforms(self, x, lo: int, hi: int, state):
        """Transforms at the ends of pieces lo..hi-1 from ``state`` (at the row before piece lo).

        Returns arrays (m, k) for F, dF, A, dA, phi / dphi at the k + 1 piece starts (the last
        one after piece hi - 1), the schedule sums Q, F1, A1 at the ends and phi1 at the starts,
        and what ``derivatives`` needs.
        """
        ln = self.lengthf[lo:hi]
        k = hi - lo
        table, which = self._lengths(lo, hi)
        both = table.stacked(x)[which]                               # (k, count, 2m), length L - 1
        m = x.shape[0]
        log_r = np.log1p(-np.clip(x, _X_MIN, _X_MAX))
        last = np.multiply.outer(ln - 1.0, log_r)                    # log r^(L-1), (k, m)
        lp, nlp = np.exp(last), -np.expm1(last)
        res = self.w_val[lo:hi] @ both                               # (k, 3, 2m): phi, rev, alpha
        wb = self.wb_val[lo:hi]
        M, MR = (res[:, 0, :m] + wb[:, :1] * lp).T, (res[:, 1, :m] + wb[:, 1:] * lp).T      # (m, k)
        dM, dMR = (res[:, 0, m:] + wb[:, :1] * nlp).T, (res[:, 1, m:] + wb[:, 1:] * nlp).T
        W, dW = res[:, 2, :m].T, res[:, 2, m:].T
        log_r = log_r[:, None]
        before = self.startf[lo:hi] - 1.0
        rho_s = np.exp(before * log_r)                              # r^(s_j - 1)
        not_s = -np.expm1(before * log_r)
        r_len = np.exp(ln * log_r)
        not_len = -np.expm1(ln * log_r)
        phi = _affine_scan(r_len, MR, state["phi"])
        dphi = state["dphi"][:, None] + _exclusive_cumsum(not_len * phi[:, :-1] + dMR, extra=True)
        s1 = self.s1[lo:hi]
        offsets, sums = self._schedule_sums(lo, hi)
        phi1 = state["phi1"] + offsets
        p, dp = phi[:, :-1], dphi[:, :-1]
        # the four per-decay transforms, one cumulative sum
        ends = np.cumsum(np.stack([rho_s * M, not_s * s1 + rho_s * dM, p * M + W, dp * s1 + p * dM + dW]), axis=-1)
        return dict(
            phi=phi, dphi=dphi, phi1=phi1,
            F=state["F"][:, None] + ends[0], dF=state["dF"][:, None] + ends[1],
            A=state["A"][:, None] + ends[2], dA=state["dA"][:, None] + ends[3],
            Q=state["Q"] + sums[0], F1=state["F1"] + sums[1], A1=state["A1"] + state["phi1"] * sums[1] + sums[2],
            parts=dict(level=self, lo=lo, state=state, short=both[:, :, :m], lp=lp, log_r=log_r, M=M, dM=dM,
                       r_len=r_len, not_len=not_len, rho_s=rho_s, before=before),
        )

    def derivatives(self, trans, i: int, state: dict) -> dict:
        """d/dx (x = 1 - rho) of the transforms at the end of the i-th piece of ``trans`` (i = -1:
        its starting row) and of phi, dphi at the next start, from ``state``: the starting state
        of ``trans`` with its derivatives."""
        if i < 0:
            return {key: state[key] for key in _DERIVATIVES}
        part = trans["parts"]
        lo, k = part["lo"], i + 1
        inv_r = np.exp(-part["log_r"])
        ln = self.lengthf[lo: lo + k]
        # d/dx sum_q c_q nu_q = -(1 / r) sum_j w'_j mu_j (length L: plus the last term, as above)
        res = self.w_der[lo: lo + k] @ part["short"][:k]             # (k, 3, m)
        wb, lp = self.wb_der[lo: lo + k], part["lp"][:k]
        M_x = -inv_r * (res[:, 0] + wb[:, :1] * lp).T
        MR_x = -inv_r * (res[:, 1] + wb[:, 1:] * lp).T
        W_x = -inv_r * res[:, 2].T
        M, dM = part["M"][:, :k], part["dM"][:, :k]
        rho_s = part["rho_s"][:, :k]
        rho_s_x = -part["before"][:k] * rho_s * inv_r
        r_len = part["r_len"][:, :k]
        r_len_x = -ln * r_len * inv_r
        phi = trans["phi"][:, :k]
        phi_x = _affine_scan(r_len, MR_x + r_len_x * phi, state["phi_x"])          # k + 1 starts
        dphi_x = state["dphi_x"][:, None] + _exclusive_cumsum(
            -r_len_x * phi + part["not_len"][:, :k] * phi_x[:, :-1] - MR_x, extra=True)
        s1 = self.s1[lo: lo + k]
        px, dpx = phi_x[:, :-1], dphi_x[:, :-1]
        return dict(
            F_x=state["F_x"] + np.sum(rho_s_x * M + rho_s * M_x, axis=-1),
            dF_x=state["dF_x"] + np.sum(rho_s_x * (dM - s1) - rho_s * M_x, axis=-1),
            A_x=state["A_x"] + np.sum(px * M + phi * M_x + W_x, axis=-1),
            dA_x=state["dA_x"] + np.sum(dpx * s1 + px * dM - phi * M_x - W_x, axis=-1),
            phi_x=phi_x[:, -1], dphi_x=dphi_x[:, -1],
        )


_ENDS = ("F", "dF", "A", "dA")
_STARTS = ("phi", "dphi")
_DERIVATIVES = ("F_x", "dF_x", "A_x", "dA_x", "phi_x", "dphi_x")


def _zero_state(m: int) -> dict:
    zero = np.zeros(m)
    state = {key: zero for key in _ENDS + _STARTS + _DERIVATIVES}
    state.update(Q=0.0, F1=0.0, A1=0.0, phi1=0.0)
    return state


def _state_after(trans, i: int) -> dict:
    """The state (values) at the end of the i-th piece of a ``transforms`` result (i = -1: its
    starting state)."""
    if i < 0:
        return trans["parts"]["state"]
    state = {key: trans[key][:, i] for key in _ENDS}
    state.update({key: trans[key][:, i + 1] for key in _STARTS})
    state.update(Q=trans["Q"][i], F1=trans["F1"][i], A1=trans["A1"][i], phi1=trans["phi1"][i + 1])
    return state


class ScheduledParameterErrors:
    """max_t e_t for one schedule and workload, prepared once (module docstring).

    ``schedule``: eta_0..eta_{n-1} (positive). It is compressed once (``piecewise``), cut into at
    least COARSE coarse pieces and each of those into FINE fine ones; ``max_relative_error`` is
    the certified bound of the compression, and the errors computed here are the exact errors of
    the compressed schedule ``compressed`` (to rounding).
    """

    def __init__(self, schedule: np.ndarray, workload, *, degree: int = 5, tolerance: float = 1e-12,
                 max_pieces: int = 4096):
        eta = np.asarray(schedule, dtype=np.float64)
        self.n = int(eta.shape[0])
        self.workload = workload
        self.degree = degree
        coarse_length = max(1, -(-(self.n - 1) // COARSE))
        pw = piecewise.compress(eta, degree=degree, tolerance=tolerance, max_length=coarse_length,
                                max_pieces=max_pieces, grade=True)
        self.pieces = pw
        self.compressed = pw.values()
        self.coarse = _Level(pw.start, pw.length, pw.coef, degree)
        self.fine = None
        if pw.num_pieces and int(pw.length.max()) > SHORT:
            fine_length = max(1, -(-int(pw.length.max()) // FINE))
            f_start, f_length, f_coef, parent = piecewise.cut(pw.start, pw.length, pw.coef, fine_length)
            # the fine level is built per run of coarse pieces, when first opened (``_fine_level``):
            # an optimization opens a few of them, and building all costs more than it does
            self.fine = (f_start, f_length, f_coef)
            self._fine_range = np.searchsorted(parent, np.arange(pw.num_pieces + 1))  # fine pieces of coarse j
            self._fine_levels = {}
        self.first = pw.first
        self._window_sums = {}

    @property
    def max_relative_error(self) -> float:
        return self.pieces.max_relative_error

    @property
    def row_indices(self) -> np.ndarray:
        """Row 0 and the coarse piece ends: the rows ``rows`` returns."""
        return np.concatenate([[0], self.coarse.row_end])

    # -----------------------------------------------------------------------------------------
    # public entry points

    def error(self, leak, leak_hat, omega_hat, kind: str = "max"):
        """max_t e_t for parameters of any leading batch shape (complex step allowed)."""
        if kind != "max":
            raise InvalidArgumentError(f"the scheduled fast path computes the max error only, got {kind!r}")
        leaks, weights, gain, tau, beta_index = bl_form_terms_arrays(leak, leak_hat, omega_hat, self.workload)
        batch = leaks.shape[:-1]
        leaks = leaks.reshape((-1, leaks.shape[-1]))
        weights = np.broadcast_to(weights, batch + weights.shape[-1:]).reshape(leaks.shape)
        if np.any(leaks.real <= 0.0) or np.any(leaks.real > 1.0):
            raise InvalidArgumentError("the scheduled fast path needs decays in [0, 1) (1 - rho in (0, 1])")
        if np.all(leaks.real == leaks.real[0]):  # the optimizer's probes share their real part
            out = self._max_group(leaks.real[0], leaks, weights, gain, tau, beta_index)
            return out.reshape(batch) if batch else out[0]
        out = np.empty(leaks.shape[0], dtype=np.result_type(leaks, weights))
        # probes that share real parts share the moments and the row search
        keys, groups = np.unique(leaks.real, axis=0, return_inverse=True)
        groups = groups.reshape(-1)
        for g in range(keys.shape[0]):
            members = np.flatnonzero(groups == g)
            out[members] = self._max_group(keys[g], leaks[members], weights[members], gain, tau, beta_index)
        return out.reshape(batch) if batch else out[0]

    def rows(self, leak, leak_hat, omega_hat) -> np.ndarray:
        """e_t at ``row_indices`` (real parameters, unbatched): the coarse closed forms."""
        leaks, weights, gain, tau, beta_index = bl_form_terms_arrays(leak, leak_hat, omega_hat, self.workload)
        pairs = _pair_terms(leaks[None], weights[None], gain, tau, beta_index)
        trans = self.coarse.transforms(leaks, 0, self.coarse.size, _zero_state(leaks.shape[0]))
        ends = _rows_of(pairs, trans, self.coarse.row_end, self.first)
        return np.concatenate([[_row_zero(self.first, gain, tau)], ends])

    def all_rows(self, leak, leak_hat, omega_hat) -> np.ndarray:
        """Every e_t (O(n), for tests): the step recursion from row 0."""
        leaks, weights, gain, tau, beta_index = bl_form_terms_arrays(leak, leak_hat, omega_hat, self.workload)
        pairs = _pair_terms(leaks[None], weights[None], gain, tau, beta_index)
        window = self._window(leaks, _zero_state(leaks.shape[0]), 0, self.n - 1)
        rows = _rows_of(pairs, window, np.arange(1, self.n), self.first)
        return np.concatenate([[_row_zero(self.first, gain, tau)], rows])

    # -----------------------------------------------------------------------------------------
    # exact rows in a window, by the step recursion

    def _window(self, x, state, first_row: int, count: int):
        """Transforms at rows first_row + 1 .. first_row + count from the state at first_row:
        F += eta_u r^(u-1), A += eta_u Phi(u), Phi(u+1) = r Phi(u) + eta_u, and the complements
        dF += eta_u (1 - r^(u-1)), dPhi(u+1) = dPhi(u) + (1 - r) Phi(u)."""
        u = first_row + 1 + np.arange(count, dtype=np.float64)
        eta = self.compressed[first_row + 1: first_row + 1 + count]
        log_r = np.log1p(-np.clip(x, _X_MIN, _X_MAX))[:, None]
        r = np.exp(log_r)
        m = x.shape[0]
        # Phi(u) over the window: the scan x_{k+1} = r x_k + eta_k from Phi(first_row + 1)
        phi = _constant_scan(r[:, 0], np.broadcast_to(eta[:-1], (m, count - 1)), state["phi"])
        dphi = state["dphi"][:, None] + _exclusive_cumsum((1.0 - r) * phi)
        power = (u - 1.0) * log_r
        ends = np.cumsum(np.stack([eta * np.exp(power), eta * -np.expm1(power), eta * phi, eta * dphi]), axis=-1)
        key = (first_row, count)                 # the decay-free sums, as in ``_Level._schedule_sums``
        sums = self._window_sums.get(key)
        if sums is None:
            sums = np.cumsum(np.stack([eta * eta, eta, eta * _exclusive_cumsum(eta)]), axis=-1)
            if len(self._window_sums) >= 512:  # bounded memory (the values do not depend on it)
                self._window_sums.clear()
            self._window_sums[key] = sums
        return dict(
            F=state["F"][:, None] + ends[0], dF=state["dF"][:, None] + ends[1],
            A=state["A"][:, None] + ends[2], dA=state["dA"][:, None] + ends[3],
            Q=state["Q"] + sums[0], F1=state["F1"] + sums[1], A1=state["A1"] + state["phi1"] * sums[1] + sums[2],
            phi=phi, first_row=first_row, state=state, r=r,
        )

    def _window_derivatives(self, window, i: int, state: dict) -> dict:
        """d/dx of F, dF, A, dA at the i-th row of a ``_window`` from its starting ``state`` with
        derivatives: Phi_x(u+1) = r Phi_x(u) - Phi(u), dPhi_x(u+1) = dPhi_x(u) + Phi(u) + (1 - r) Phi_x(u)."""
        r = window["r"]
        k = i + 1
        u = window["first_row"] + 1 + np.arange(k, dtype=np.float64)
        eta = self.compressed[window["first_row"] + 1: window["first_row"] + 1 + k]
        power_x = -(u - 1.0) * np.power(r, np.maximum(u - 2.0, 0.0))     # d r^(u-1) / dx
        phi = window["phi"][:, :k]
        phi_x = _constant_scan(r[:, 0], -phi[:, :-1], state["phi_x"])
        dphi_x = state["dphi_x"][:, None] + _exclusive_cumsum(phi + (1.0 - r) * phi_x)
        f_x = np.sum(eta * power_x, axis=-1)
        return dict(F_x=state["F_x"] + f_x, dF_x=state["dF_x"] - f_x,
                    A_x=state["A_x"] + np.sum(eta * phi_x, axis=-1),
                    dA_x=state["dA_x"] + np.sum(eta * dphi_x, axis=-1))

    # -----------------------------------------------------------------------------------------
    # the max of one group of probes

    def _max_group(self, x, leaks, weights, gain, tau, beta_index):
        """The exact max over the integers, on the real parts (one probe, real arithmetic), then
        that row on every probe.

        Rows at the coarse piece ends; every coarse piece whose ends, plus a bound on how far a
        smooth e_t can rise between them (``_candidates``), reach the best value so far is opened:
        its fine piece ends, then every row of each fine piece that passes the same test (the
        step recursion). The derivatives of the transforms are carried along the winning path only.
        """
        zero = _row_zero(self.first, gain, tau)
        dtype = np.result_type(leaks, weights)
        m = x.shape[0]
        real = _pair_terms(leaks.real[:1], weights.real[:1], gain, tau, beta_index)
        best = dict(value=zero, row=0, path=None)
        if self.pieces.num_pieces == 0:
            return np.full(leaks.shape[0], zero, dtype=dtype)
        start = _zero_state(m)
        if self.n <= ALL_ROWS:  # short horizons: every row, whatever the schedule
            self._open_window(x, real, start, 0, self.n - 1, best, ())
        else:
            coarse = self.coarse.transforms(x, 0, self.coarse.size, start)
            ends = _rows_of(real, coarse, self.coarse.row_end, self.first)
            self._offer(best, ends, self.coarse.row_end, (("coarse", coarse),))
            cands = _candidates(ends, self.coarse.row_end, 0, zero, best["value"])
            for lo, hi, kind in _runs(cands, best, self._coarse_kind):
                state = _state_after(coarse, lo - 1)
                before = 0 if lo == 0 else int(self.coarse.row_end[lo - 1])
                if kind == "window":
                    self._open_window(x, real, state, before, int(self.coarse.row_end[hi]) - before, best,
                                      (("coarse", coarse, lo - 1),))
                    continue
                level = self._fine_level(lo, hi)
                fine = level.transforms(x, 0, level.size, state)
                f_rows = level.row_end
                f_ends = _rows_of(real, fine, f_rows, self.first)
                path = (("coarse", coarse, lo - 1),)
                self._offer(best, f_ends, f_rows, path + (("fine", fine),))
                start_value = zero if lo == 0 else ends[lo - 1]
                f_cands = _candidates(f_ends, f_rows, before, start_value, best["value"])
                lengths = level.length
                for i0, i1, _ in _runs(f_cands, best, lambda i: "skip" if lengths[i] <= 1 else "window"):
                    f_state = _state_after(fine, i0 - 1)
                    f_before = before if i0 == 0 else int(f_rows[i0 - 1])
                    self._open_window(x, real, f_state, f_before, int(f_rows[i1]) - f_before,
                                      best, path + (("fine", fine, i0 - 1),))
        if best["value"] <= zero or best["path"] is None:
            return np.full(leaks.shape[0], zero, dtype=dtype)
        return self._on_probes(best, x, leaks, weights, gain, tau, beta_index, dtype)

    def _fine_level(self, lo: int, hi: int) -> "_Level":
        """The fine pieces of coarse pieces lo..hi as a level of their own (cached)."""
        key = (lo, hi)
        if key not in self._fine_levels:
            f_lo, f_hi = int(self._fine_range[lo]), int(self._fine_range[hi + 1])
            f_start, f_length, f_coef = self.fine
            self._fine_levels[key] = _Level(f_start[f_lo:f_hi], f_length[f_lo:f_hi], f_coef[f_lo:f_hi], self.degree)
        return self._fine_levels[key]

    def _coarse_kind(self, j: int) -> str:
        """How coarse piece j is opened: not at all (one row: its end), by the step recursion
        (short pieces, or no fine level), or through its fine pieces."""
        length = int(self.coarse.length[j])
        if length <= 1:
            return "skip"
        return "window" if self.fine is None or length <= 2 * FINE else "fine"

    def _offer(self, best, values, rows, path):
        """Piece ends as candidates for the best row (their transforms come from ``path``)."""
        i = int(np.argmax(values))
        if values[i] > best["value"]:
            best.update(value=float(values[i]), row=int(rows[i]), path=path[:-1] + ((path[-1][0], path[-1][1], i),))

    def _open_window(self, x, real, state, before: int, count: int, best, path):
        """Every row before + 1 .. before + count, by the step recursion from ``state``."""
        if count <= 0:
            return
        window = self._window(x, state, before, count)
        values = _rows_of(real, window, np.arange(before + 1, before + count + 1), self.first)
        i = int(np.argmax(values))
        if values[i] > best["value"]:
            best.update(value=float(values[i]), row=before + 1 + i, path=path + (("window", window, i),))

    def _on_probes(self, best, x, leaks, weights, gain, tau, beta_index, dtype):
        """The chosen row on every probe: value + i Im(x) d/dx (first order: the complex step),
        the derivatives carried from row 0 along the path that found the row."""
        state = _zero_state(x.shape[0])
        final = None
        for stage in best["path"]:
            kind, trans, i = stage
            level = trans["parts"]["level"] if kind != "window" else None
            if kind == "window":
                slope = self._window_derivatives(trans, i, state)
                final = {key: trans[key][:, i] for key in ("F", "A", "dF", "dA")}
                final.update(Q=trans["Q"][i], F1=trans["F1"][i], A1=trans["A1"][i])
            else:
                slope = level.derivatives(trans, i, state)
                if stage is best["path"][-1]:
                    final = {key: trans[key][:, i] for key in ("F", "A", "dF", "dA")}
                    final.update(Q=trans["Q"][i], F1=trans["F1"][i], A1=trans["A1"][i])
                else:
                    nxt = _state_after(trans, i)
                    nxt.update(slope)
                    state = nxt
        pairs = _pair_terms(leaks, weights, gain, tau, beta_index)
        if np.iscomplexobj(leaks):
            at = {key: final[key][None, :] + 1j * leaks.imag * slope[key + "_x"][None, :]
                  for key in ("F", "A", "dF", "dA")}
        else:
            at = {key: np.broadcast_to(final[key], leaks.shape) for key in ("F", "A", "dF", "dA")}
        out = _rows(pairs, *(at[key][..., None] for key in ("F", "A", "dF", "dA")),
                    np.atleast_1d(final["Q"]), np.atleast_1d(final["F1"]), np.atleast_1d(final["A1"]),
                    np.array([float(best["row"])]), self.first)[:, 0]
        return out if np.iscomplexobj(dtype.type(0)) else out.real


def _candidates(ends, rows, start_row, start_value, best):
    """(piece, bound) for the pieces whose maximum may reach ``best``, the most promising first:
    the bound is the larger of their end values plus how far a smooth e_t can rise above the
    ends of an interval of length L, L^2 / 8 max|e''|, with |e''| estimated (times 4) from the
    second divided differences of neighbouring ends of similar spacing (the row before the first
    piece is ``start_row``, of value ``start_value``)."""
    values = np.concatenate([[start_value], ends])
    positions = np.concatenate([[start_row], rows]).astype(np.float64)
    length = np.diff(positions)                                     # piece j spans length[j]
    slopes = np.diff(values) / length
    curvature = np.zeros(values.shape[0])
    if slopes.shape[0] > 1:
        # only from neighbours of a similar length: across a break, where the graded pieces are
        # short, the divided difference measures the kink, not the curvature of the long piece
        similar = np.maximum(length[1:], length[:-1]) <= 4.0 * np.minimum(length[1:], length[:-1])
        curvature[1:-1] = similar * np.abs(np.diff(slopes)) / (0.5 * (length[1:] + length[:-1]))
    bend = np.maximum(curvature[:-1], curvature[1:])                # at either end of piece j
    upper = np.maximum(values[:-1], values[1:]) + SAFETY * bend * length * length / 8.0
    live = np.flatnonzero(upper > best * (1.0 + MARGIN))
    order = live[np.argsort(-upper[live], kind="stable")]
    return list(zip(order.tolist(), upper[order].tolist()))


def _runs(cands, best, kind):
    """Pieces to open, as runs (lo, hi, kind) of neighbouring pieces of one kind, from the
    candidates of ``_candidates`` (most promising first) and the best row so far.

    A candidate is opened while its bound beats ``best`` (which the caller raises between runs);
    its neighbours whose bounds beat ``best`` too, of the same kind, are opened with it in one
    run, so a maximum near a piece end costs one transforms / window call, not two (per
    evaluation those calls cost their numpy overhead, not their length). Opening a piece that
    a later, higher best would have skipped changes nothing but the work: every piece whose
    bound beats the final best is still opened.
    """
    bound_of = dict(cands)
    done = set()
    for j, bound in cands:
        limit = best["value"] * (1.0 + MARGIN)
        if j in done or bound <= limit:
            continue
        what = kind(j)
        if what == "skip":
            continue
        lo = hi = j
        while bound_of.get(lo - 1, -math.inf) > limit and lo - 1 not in done and kind(lo - 1) == what:
            lo -= 1
        while bound_of.get(hi + 1, -math.inf) > limit and hi + 1 not in done and kind(hi + 1) == what:
            hi += 1
        done.update(range(lo, hi + 1))
        yield lo, hi, what


def _rows_of(pairs, trans, rows, eta0):
    """Real rows of one probe from a ``transforms`` / ``_window`` result."""
    return _rows(pairs, *(trans[key][None] for key in ("F", "A", "dF", "dA")), trans["Q"], trans["F1"],
                 trans["A1"], np.asarray(rows, dtype=np.float64), eta0)[0]


def _row_zero(eta0, gain, tau):
    lead = eta0 * (gain + tau)
    return lead * lead


def _pair_terms(leaks, weights, gain, tau, beta_index):
    """The row-independent parts of the pair sum for probes (P, m)."""
    rho = 1.0 - leaks
    qab = complement_of_product(leaks[:, :, None], leaks[:, None, :])
    kab = weights[:, :, None] * weights[:, None, :] / qab
    # pairs of decays slow on the scale of some row: (1 - rho_a rho_b) t < SLOW for t < SLOW / q_ab
    limit = SLOW / qab[0].real
    ia, ib = np.nonzero(limit > 1.0)
    return dict(rho=rho, kab=kab, krow=kab.sum(axis=-1), ksum=kab.sum(axis=(-1, -2)),
                slow_pairs=(ia, ib, limit[ia, ib]), leaks=leaks, weights=weights, gain=gain, tau=tau,
                beta_index=beta_index)


def _exclusive_cumsum(values, extra: bool = False):
    """0, v_0, v_0 + v_1, ... (K values; K + 1 with ``extra``) along the last axis."""
    values = np.asarray(values)
    out = np.zeros(values.shape[:-1] + (values.shape[-1] + 1,), dtype=values.dtype)
    np.cumsum(values, axis=-1, out=out[..., 1:])
    return out if extra else out[..., :-1]


def _constant_scan(decay, add, initial):
    """x_0 = initial, x_{j+1} = decay x_j + add_j along the last axis with one decay per row
    (shape (m,)); returns x_0..x_K. The initial value enters the first step, and the rest is
    ``blt_workload.first_order_recurrence`` (blocked, stable for decays in [0, 1])."""
    initial = np.asarray(initial)
    if add.shape[-1] <= 128:  # short: the log2 K steps of the scan cost fewer numpy calls
        return _affine_scan(np.broadcast_to(decay[:, None], add.shape), add, initial)
    f = np.array(add, dtype=np.result_type(add, initial, decay))
    f[:, 0] += decay * initial
    out = np.empty(f.shape[:-1] + (f.shape[-1] + 1,), dtype=f.dtype)
    out[:, 0] = initial
    out[:, 1:] = first_order_recurrence(decay, f)
    return out


def _affine_scan(decay, add, initial):
    """x_0 = initial, x_{j+1} = decay_j x_j + add_j along the last axis; returns x_0..x_K.

    Hillis-Steele scan of the maps x -> a x + b (log2 K vectorized steps, products of factors in
    [0, 1], so nothing overflows); the initial value enters as x_j = b_j + (prod a) initial.
    """
    a = np.array(decay, dtype=np.result_type(decay, add))
    b = np.array(add, dtype=a.dtype)
    shift = 1
    k = a.shape[-1]
    while shift < k:
        tb = a[..., shift:] * b[..., :-shift]        # from the values before this step
        ta = a[..., shift:] * a[..., :-shift]
        b[..., shift:] += tb
        a[..., shift:] = ta
        shift *= 2
    initial = np.asarray(initial)[..., None]
    return np.concatenate([initial, b + a * initial], axis=-1)


def _rows(ctx, F, A, dF, dA, Q, F1, A1, rows, eta0):
    """e_t from the transforms at the rows (module docstring); F, A, dF, dA: (P, m, T).

    The pair sum uses (*) for every pair, then replaces it by the complementary form on the
    (pair, row) combinations where both decays are slow, (1 - rho_a rho_b) t < SLOW: few pairs,
    chosen from the real parts, which all probes share. (*) loses a factor ~3 / ((1 - rho_a
    rho_b) t) to cancellation, at most 60 where it is used.
    """
    weights, gain, tau, beta_index = ctx["weights"], ctx["gain"], ctx["tau"], ctx["beta_index"]
    rho, kab = ctx["rho"], ctx["kab"]
    k_rho = ctx["krow"] * rho
    pairs = (Q * ctx["ksum"][:, None] + 2.0 * np.einsum("pa,pat->pt", k_rho, A)
             - np.einsum("pat,pat->pt", F, np.einsum("pab,pbt->pat", kab, F)))
    ia, ib, limit = ctx["slow_pairs"]
    if ia.size:
        keep = limit > rows.min()
        ia, ib, limit = ia[keep], ib[keep], limit[keep]
        live = rows[None, :] < limit[:, None]                          # (S, T)
        if ia.size:
            ra, rb = rho[:, ia, None], rho[:, ib, None]
            Fa, Fb, Aa, Ab = F[:, ia], F[:, ib], A[:, ia], A[:, ib]
            dFa, dFb, dAa, dAb = dF[:, ia], dF[:, ib], dA[:, ia], dA[:, ib]
            direct = Q + ra * Aa + rb * Ab - Fa * Fb
            comp = (F1 * (dFa + dFb) - dFa * dFb - ra * dAa - rb * dAb
                    - (ctx["leaks"][:, ia] + ctx["leaks"][:, ib])[..., None] * A1)
            pairs = pairs + np.einsum("ps,pst->pt", kab[:, ia, ib], live * (comp - direct))
    inner = gain * gain * Q + 2.0 * gain * np.einsum("pa,pat->pt", weights, A) + pairs
    p0 = eta0 * (gain + tau) + np.einsum("pa,pat->pt", weights, F)
    if tau > 0.0:
        p0 = p0 + tau * rho[:, beta_index, None] * F[:, beta_index, :]
    return inner + p0 * p0
