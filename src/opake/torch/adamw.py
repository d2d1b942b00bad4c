"""``DPAdamW``: AdamW whose second moment does not count the privacy noise (DP-AdamBC).

Adam's second moment v_t is an average of squared gradients, an estimate of E[g^2]. A private
step releases g_t + n_t with noise n_t independent of the step's clipped gradient, so the
average of the released squares estimates E[g^2] + Var(n): the noise inflates the denominator,
and where the noise dominates, every coordinate gets about the same step, which is (noisy)
SGD rather than Adam. Tang, Shpilevskiy and Lecuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD
(Unless You Apply Bias Correction)", AAAI 2024 (arXiv 2312.14334), Algorithm 1, remove the noise
variance Phi from the bias-corrected second moment, with a floor gamma' for stability:

    theta_t = theta_{t-1} - eta m_hat_t / sqrt(max(v_hat_t - Phi, gamma'))

where Phi = (sigma C / B)^2 for DP-SGD, the same at every step. Under correlated noise (a BLT,
BandMF) the variance of step t's noise is (sigma C / B)^2 ||row t of C^{-1}||^2, which changes
with t (a BLT's grows towards its limit; ``opake.dpftrl.noise.engine.variance``), and the noise
part of v_t is (1 - beta2) sum_s beta2^(t-s) Var(n_s). So DPAdamW keeps that average of the
variances beside v, phi_t = beta2 phi_{t-1} + (1 - beta2) Var(n_t), corrects it for its start at
zero as v is, phi_hat_t = phi_t / (1 - beta2^t), and subtracts phi_hat_t: for a constant
variance phi_hat_t = Phi at every t, the paper's form exactly. The variances are the noise
engine's own (``NoisedPytree.noise_variance``), never estimated from sigma alone (docs/math.md
section 9).

``DPOptimizer`` (``make_private``) passes each step's variance before stepping, by calling
``set_noise_variance`` on the optimizer it wraps when that optimizer has one. The correction is
post-processing of the released gradients and the public noise variance: privacy is unchanged.
What it assumes: the noise of step t is independent of the gradient of step t (true for DP-SGD;
under correlated noise the parameters at step t depend on earlier noise, which is correlated
with n_t, so E[g_t n_t] need not be exactly zero; the paper's analysis is for DP-SGD).

With no noise (every variance 0, or ``set_noise_variance`` never called) a step is exactly
``torch.optim.AdamW``'s (its own ``step``). Weight decay is AdamW's, decoupled. ``amsgrad``,
``maximize``, ``capturable``, ``differentiable`` and ``fused`` are refused (the paper defines none
of them with the correction). The state of each parameter is AdamW's (``step``, ``exp_avg``,
``exp_avg_sq``) plus ``noise_variance_average`` (phi, a Python float), so checkpoints carry it.

``variance_floor`` is gamma': the smallest corrected second moment, so the largest step of a
coordinate is lr |m_hat| / sqrt(gamma'). It is a tuned setting, like the learning rate it
interacts with (the authors' published runs used 1e-9 to 7e-9 with learning rates far below
DP-Adam's); the default is 1e-9.
"""

from __future__ import annotations

import math
import numbers

import torch

from opake.errors import OpakeError

__all__ = ["DPAdamW", "MissingNoiseVarianceError", "NoiseCorrectionError", "corrected_second_moment",
           "noise_variance_average"]

DEFAULT_VARIANCE_FLOOR = 1e-9
_REFUSED_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable", "fused")
_AVERAGE = "noise_variance_average"


class NoiseCorrectionError(OpakeError, ValueError):
    """A bad setting of ``DPAdamW`` or a bad noise variance (negative, NaN, infinite, missing)."""


class MissingNoiseVarianceError(OpakeError, RuntimeError):
    """A ``DPAdamW`` step that has corrected for noise before was taken without this step's variance."""


def noise_variance_average(previous: float, variance: float, beta2: float) -> float:
    """phi_t = beta2 phi_{t-1} + (1 - beta2) Var(n_t): the noise's share of Adam's v_t, in expectation."""
    return beta2 * previous + (1.0 - beta2) * variance


def corrected_second_moment(exp_avg_sq: torch.Tensor, average: float, bias_correction2: float,
                            floor: float) -> torch.Tensor:
    """max(v_hat - phi_hat, floor), v_hat = v / (1 - beta2^t), phi_hat = phi / (1 - beta2^t) (a new tensor)."""
    return (exp_avg_sq / bias_correction2).sub_(average / bias_correction2).clamp_(min=floor)


def _checked_variance(variance) -> float:
    if variance is None:
        raise NoiseCorrectionError(
            "the noise stage did not state this step's noise variance (NoisedPytree.noise_variance is None), "
            "which DPAdamW subtracts from its second moment; release through opake's noise engine "
            "(mf_gaussian_noise states it), or use torch.optim.AdamW"
        )
    if isinstance(variance, bool) or not isinstance(variance, numbers.Real):
        raise NoiseCorrectionError(f"the noise variance must be a real number, got {variance!r}")
    value = float(variance)
    if not (math.isfinite(value) and value >= 0.0):
        raise NoiseCorrectionError(
            f"the noise variance must be finite and >= 0, got {variance!r}: it is the variance of every "
            f"coordinate of this step's noise, (noise_multiplier * clip / normalization)^2 ||row t of C^-1||^2"
        )
    return value


class DPAdamW(torch.optim.AdamW):
    """AdamW with DP-AdamBC's correction of the second moment for the noise (module docstring).

    ``DPAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    variance_floor=1e-9)``; give it to ``make_private`` as the optimizer. ``eps`` is AdamW's and
    is used by steps without noise; steps with noise use the floor instead (the paper's form).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, variance_floor: float = DEFAULT_VARIANCE_FLOOR, **options):
        for name in _REFUSED_OPTIONS:
            if options.get(name):
                raise NoiseCorrectionError(
                    f"DPAdamW does not take {name}={options[name]!r}: DP-AdamBC's correction is defined for "
                    f"Adam's plain update only; leave {name} unset, or use torch.optim.AdamW without the correction"
                )
        unknown = sorted(set(options) - set(_REFUSED_OPTIONS) - {"foreach"})
        if unknown:
            raise TypeError(f"DPAdamW got unexpected keyword arguments {unknown}")
        if isinstance(variance_floor, bool) or not isinstance(variance_floor, numbers.Real) or not (
                math.isfinite(variance_floor) and variance_floor > 0):
            raise NoiseCorrectionError(
                f"variance_floor must be finite and > 0, got {variance_floor!r}: it bounds each coordinate's step "
                f"by lr |m_hat| / sqrt(variance_floor); the default is {DEFAULT_VARIANCE_FLOOR}"
            )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=options.get("foreach"))
        self.variance_floor = float(variance_floor)
        self._noise_variance: float | None = None

    def set_noise_variance(self, variance: float) -> None:
        """The variance of every coordinate of the noise in the gradients of the next step
        (``NoisedPytree.noise_variance``); ``DPOptimizer`` calls this before each step."""
        self._noise_variance = _checked_variance(variance)

    @property
    def corrects(self) -> bool:
        """Whether some parameter has a nonzero noise-variance average (the correction is on)."""
        return any(state.get(_AVERAGE, 0.0) > 0.0 for state in self.state.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        variance, self._noise_variance = self._noise_variance, None
        if variance is None:
            if self.corrects:
                raise MissingNoiseVarianceError(
                    "this DPAdamW step has no noise variance, but earlier steps had noise: call "
                    "set_noise_variance(noised.noise_variance) before every step (make_private's optimizer does)"
                )
            variance = 0.0
        if variance == 0.0 and not self.corrects:
            super().step()  # no noise so far: AdamW itself, to the last bit
            return loss
        if any(p.grad is not None and p.grad.is_sparse for group in self.param_groups for p in group["params"]):
            raise NoiseCorrectionError("DPAdamW does not support sparse gradients (nothing was stepped)")
        for group in self.param_groups:
            self._corrected_group_step(group, variance)
        return loss

    def _corrected_group_step(self, group: dict, variance: float) -> None:
        """One step of the parameters of ``group`` with the corrected denominator (single-tensor AdamW
        otherwise: the same operations in the same order)."""
        lr = float(group["lr"])
        beta1, beta2 = (float(beta) for beta in group["betas"])
        weight_decay = group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if len(state) == 0:  # AdamW's own initial state, so that either step continues it
                state["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                             else torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            step = int(state["step"].item())
            average = noise_variance_average(state.get(_AVERAGE, 0.0), variance, beta2)
            state[_AVERAGE] = average
            grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            denominator = corrected_second_moment(exp_avg_sq, average, bias_correction2, self.variance_floor).sqrt_()
            param.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)
