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
coordinate is lr |m_hat| / sqrt(gamma'). A number is the paper's constant floor, a tuned setting
like the learning rate it interacts with (the authors' published runs used 1e-9 to 7e-9 with
learning rates far below DP-Adam's). The default, ``"noise"``, floors at the noise's own share
of the second moment, phi_hat_t:

    theta_t = theta_{t-1} - eta m_hat_t / (sqrt(max(v_hat_t - phi_hat_t, phi_hat_t)) + eps)

A coordinate whose estimate is mostly noise (v_hat <= 2 phi_hat) then steps as AdamW would with
v_hat = phi_hat, and one with signal above the noise as AdamW without the noise in its
denominator; no step is more than sqrt(2) times AdamW's at the same v_hat. So AdamW's learning
rate suits it, and nothing needs tuning (benchmarks/quality.py: at AdamW's best rate it lowers
the test loss at epsilon 8 and ties at epsilons 1 and 3; docs/torch.md).

``corrected_adam_step`` is the same step for a plain ``torch.optim.AdamW`` or ``Adam``: the
private optimizer takes it on their own state when the correction is on (``make_private(...,
noise_correction=)``; ``noise_correction_for`` decides).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from opake.errors import InvalidTypeError, OpakeError

__all__ = ["DPAdamW", "MissingNoiseVarianceError", "NOISE_FLOOR", "NoiseCorrection", "NoiseCorrectionError",
           "corrected_adam_step", "corrected_second_moment", "noise_correction_for", "noise_variance_average"]

NOISE_FLOOR = "noise"
DEFAULT_VARIANCE_FLOOR = NOISE_FLOOR
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
                            floor) -> torch.Tensor:
    """max(v_hat - phi_hat, floor), v_hat = v / (1 - beta2^t), phi_hat = phi / (1 - beta2^t) (a new tensor);
    ``floor="noise"`` is phi_hat itself."""
    noise = average / bias_correction2
    return (exp_avg_sq / bias_correction2).sub_(noise).clamp_(min=noise if floor == NOISE_FLOOR else floor)


def _denominator(exp_avg_sq: torch.Tensor, average: float, bias_correction2: float, floor, eps: float):
    """sqrt(max(v_hat - phi_hat, floor)): the paper's form for a constant floor; plus AdamW's eps for the
    noise floor (a floor that tends to 0 with the noise, where the step tends to AdamW's)."""
    denominator = corrected_second_moment(exp_avg_sq, average, bias_correction2, floor).sqrt_()
    return denominator.add_(eps) if floor == NOISE_FLOOR else denominator


def _checked_floor(variance_floor):
    if variance_floor == NOISE_FLOOR and isinstance(variance_floor, str):
        return NOISE_FLOOR
    if isinstance(variance_floor, bool) or not isinstance(variance_floor, numbers.Real) or not (
            math.isfinite(variance_floor) and variance_floor > 0):
        raise NoiseCorrectionError(
            f"variance_floor must be \"noise\" (the default: floored at the noise's own variance) or a finite number "
            f"> 0, got {variance_floor!r}: it bounds each coordinate's step by lr |m_hat| / sqrt(variance_floor)"
        )
    return float(variance_floor)


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
    variance_floor="noise")``; give it to ``make_private`` as the optimizer. ``eps`` is AdamW's,
    used by steps without noise and added to the noise floor's denominator; a constant floor
    replaces it (the paper's form).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, variance_floor: float | str = DEFAULT_VARIANCE_FLOOR, **options):
        for name in _REFUSED_OPTIONS:
            if options.get(name):
                raise NoiseCorrectionError(
                    f"DPAdamW does not take {name}={options[name]!r}: DP-AdamBC's correction is defined for "
                    f"Adam's plain update only; leave {name} unset, or use torch.optim.AdamW without the correction"
                )
        unknown = sorted(set(options) - set(_REFUSED_OPTIONS) - {"foreach"})
        if unknown:
            raise InvalidTypeError(f"DPAdamW got unexpected keyword arguments {unknown}")
        floor = _checked_floor(variance_floor)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=options.get("foreach"))
        self.variance_floor = floor
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
        corrected_adam_step(self, variance, self.variance_floor)
        return loss


def corrected_adam_step(optimizer: torch.optim.Optimizer, variance: float, floor=NOISE_FLOOR) -> None:
    """One step of ``optimizer`` (a ``torch.optim.AdamW``, ``Adam`` or ``DPAdamW``) on its own groups and
    state, with DP-AdamBC's corrected denominator for noise of variance ``variance`` in ``.grad``.

    Single-tensor Adam otherwise, the same operations in the same order (weight decay decoupled for
    AdamW, added to the gradient for Adam); the state is Adam's plus ``noise_variance_average``.
    ``noise_correction_for`` says which optimizers it is for.
    """
    variance = _checked_variance(variance)
    if any(p.grad is not None and p.grad.is_sparse for group in optimizer.param_groups for p in group["params"]):
        raise NoiseCorrectionError("the noise correction does not support sparse gradients (nothing was stepped)")
    with torch.no_grad():
        for group in optimizer.param_groups:
            _corrected_group_step(optimizer.state, group, variance, floor)


def _corrected_group_step(states, group: dict, variance: float, floor) -> None:
    lr = float(group["lr"])
    beta1, beta2 = (float(beta) for beta in group["betas"])
    weight_decay = group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", True)
    params = [param for param in group["params"] if param.grad is not None]
    for param in params:
        state = states[param]
        if len(state) == 0:  # Adam's own initial state, so that either step continues it
            if group.get("fused"):  # a fused Adam keeps its step count on the parameter's device
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                             else torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
    for param, step in zip(params, _step_counts([states[param]["step"] for param in params])):
        state = states[param]
        average = noise_variance_average(state.get(_AVERAGE, 0.0), variance, beta2)
        state[_AVERAGE] = average
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denominator = _denominator(exp_avg_sq, average, bias_correction2, floor, float(group["eps"]))
        param.addcdiv_(exp_avg, denominator, value=-lr / bias_correction1)


def _step_counts(steps: list) -> list[int]:
    """Each step-count tensor's value, read with one transfer per device: a fused Adam keeps its counts
    on the accelerator, where reading them one by one would wait for the device once per parameter."""
    counts = [0] * len(steps)
    by_device: dict = {}
    for index, step in enumerate(steps):
        by_device.setdefault(step.device, []).append(index)
    for indices in by_device.values():
        values = torch.stack([steps[index].detach().reshape(()).double() for index in indices]).tolist()
        for index, value in zip(indices, values):
            counts[index] = int(value)
    return counts


# -- the correction by default -------------------------------------------------------------------

_CORRECTABLE = (torch.optim.AdamW, torch.optim.Adam)  # exactly these classes: a subclass may step otherwise


@dataclass(frozen=True)
class NoiseCorrection:
    """Whether a private run corrects its optimizer's second moment for the noise, and why.

    ``enabled``: the private optimizer steps the wrapped Adam with ``corrected_adam_step``
    (``floor`` ``"noise"``), or the optimizer is a ``DPAdamW``, which corrects itself with its own
    floor. ``reason`` says which, or why not.
    """

    enabled: bool
    reason: str
    floor: object = NOISE_FLOOR
    by_optimizer: bool = False

    def __str__(self) -> str:
        return f"noise correction {'on' if self.enabled else 'off'}: {self.reason}"


def noise_correction_for(optimizer: torch.optim.Optimizer, requested: bool | None = None) -> NoiseCorrection:
    """Whether ``make_private``'s optimizer corrects ``optimizer``'s second moment for the noise.

    ``requested=None`` (the default): on for a plain ``torch.optim.AdamW`` or ``Adam`` (the class
    itself; ``fused`` and ``foreach`` are set aside: the corrected step is opake's own), off for
    every other optimizer. ``False``: off. ``True``: on, or ``NoiseCorrectionError`` with the
    reason it cannot be. A ``DPAdamW`` corrects itself whatever is requested, except ``False``,
    which is refused (give a ``torch.optim.AdamW`` to train without the correction).
    """
    if requested is not None and not isinstance(requested, bool):
        raise InvalidTypeError(
            f"noise_correction must be None (on for Adam and AdamW), True or False, got {requested!r}"
        )
    if isinstance(optimizer, DPAdamW):
        if requested is False:
            raise NoiseCorrectionError(
                "noise_correction=False with a DPAdamW, whose every step is corrected: give a torch.optim.AdamW "
                "to train without the correction, or drop noise_correction=False")
        return NoiseCorrection(True, f"DPAdamW corrects itself (variance_floor={optimizer.variance_floor!r})",
                               optimizer.variance_floor, by_optimizer=True)
    if requested is False:
        return NoiseCorrection(False, "noise_correction=False: the optimizer steps as it is")
    problem = _why_not_correctable(optimizer)
    if problem is None:
        return NoiseCorrection(True, f"{type(optimizer).__name__}'s second moment without the noise's variance "
                                     f"(DP-AdamBC, floored at the noise's own variance; noise_correction=False "
                                     f"steps the optimizer as it is)")
    if requested:
        raise NoiseCorrectionError(f"noise_correction=True cannot be honoured: {problem}; drop noise_correction=True")
    return NoiseCorrection(False, problem)


def _why_not_correctable(optimizer) -> str | None:
    if type(optimizer) not in _CORRECTABLE:
        return (f"{type(optimizer).__name__} is not torch.optim.AdamW or Adam, the optimizers whose second moment "
                f"the correction is defined for")
    for group in optimizer.param_groups:
        for name in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(name):
                return f"{type(optimizer).__name__}({name}=True): DP-AdamBC's correction is defined for Adam's plain update"
        if torch.is_tensor(group.get("lr")) or any(torch.is_tensor(beta) for beta in group.get("betas", ())):
            return "a tensor learning rate or beta: the corrected step reads them as numbers"
        if any(p.is_complex() for p in group["params"]):
            return "complex parameters"
    return None
