"""Per-example gradient clipping: the first stage of a DP training step.

:func:`clipped_grad` turns a loss of one example into ``grad_fn``, which computes every
example's gradient (``torch.func.vmap`` over ``torch.func.grad``), scales each one so that its L2
norm over all parameters together is at most ``clipping_norm``, sums them and divides the sum by
``normalize_by``. The result is a :class:`~opake.types.ClippedPytree` carrying the bound, which
is what the noise stage accepts::

    grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=expected_batch_size)
    for step in range(n_steps):
        grads, clip_state = grad_fn(params, batch, state=clip_state)
        noisy_grads, noise_state = noise_fn(grads, noise_state)

Per-example convention (the ``torch.func`` one). ``grad_fn(params, *args)`` splits every
argument listed in ``batch_argnums`` (positions in ``loss_fn``'s signature; ``params`` is
position 0) along dimension 0 and calls ``loss_fn(params, *example_args)`` with ONE example,
**without** the batch dimension: for ``x`` of shape ``(32, 3)``, ``loss_fn`` sees a ``(3,)``
tensor. An argument may be a tensor or a tuple/list/dict of tensors (all split along dim 0).
Arguments not listed are passed whole to every example. ``loss_fn`` returns a scalar tensor.

A model that expects a batch dimension gets one back with ``unsqueeze(0)``; an ``nn.Module``
is called functionally on plain parameter tensors::

    >>> import torch
    >>> from torch.func import functional_call
    >>> from opake.dpftrl.clipping import clipped_grad
    >>> model = torch.nn.Linear(3, 2)
    >>> params = dict(model.named_parameters())
    >>> def loss_fn(params, example):
    ...     x, y = example                                 # x: (3,), y: () -- one example
    ...     logits = functional_call(model, params, (x.unsqueeze(0),))
    ...     return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))
    >>> grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=1.0)
    >>> batch = (torch.ones(8, 3), torch.zeros(8, dtype=torch.long))  # (inputs, labels)
    >>> grads, clip_state = grad_fn(params, batch, state=clip_state)
    >>> sorted(grads.pytree), grads.l2_bound, clip_state.examples
    (['bias', 'weight'], 1.0, 8)

Parameters may require grad (``dict(model.named_parameters())``): they are detached before the
per-example transform, nothing is written to ``.grad`` and the model is never modified.

Clipping arithmetic, small enough to check by hand (3-4-5 triangles): a gradient ``(3, 4)``
has norm 5; with ``clipping_norm=5`` or more it is kept as is, with ``clipping_norm=1`` it
becomes ``(0.6, 0.8)``. The scale factor is ``min(1, clipping_norm / norm)``: exactly 1 at or
below the bound (a zero gradient is never divided by). Automatic clipping (AUTO-S, Bu et al.
2023; ``clipping="automatic"`` or ``clipping_norm=AutomaticClipping(C)``) scales every gradient
by ``C / (norm + 0.01)`` instead: ``(3, 4)`` with ``C = 1`` becomes ``(3, 4) / 5.01``, of norm
0.998 < 1, and the bound C, the noise and the accounting stay those of flat clipping at C
(``AutomaticClipping`` says why and what it means for the learning rate). Each leaf's norm is reduced
in that leaf's dtype (float32 for half-precision leaves); the norms are combined and the scale
computed in float64 (float32 on devices without float64). The clipped sum of a float32 or
float64 leaf is formed in that dtype; the sum of a bfloat16 or float16 leaf is formed and
returned in **float32**: rounding a sum of many clipped gradients to 8 or 11 mantissa bits moves
it by up to 2**-9 of its size, which for a batch of a few hundred examples exceeds one example's
whole contribution, so a half-precision sum would not have the sensitivity the noise is
calibrated for. The bound therefore holds up to float32 (or float64) rounding, as in every DP
library. ``mf_gaussian_noise`` returns the noised gradients in the parameters' dtype (rounding
after the noise is post-processing).

Non-finite gradients never leak into the sum. By default an example whose gradient holds a NaN
or an infinity raises :class:`NonFiniteGradientError` naming the example and the parameter;
with ``nonfinite="zero"`` such an example contributes zero and is counted in the state. A finite
gradient whose norm overflows its dtype is clipped correctly (its norm is recomputed in float64
with rescaling); only a float64 gradient with a norm beyond the float64 range counts as
non-finite.

Normalization: ``normalize_by`` must be a fixed number (for example the expected batch size
of the sampler), never the realized batch size. Dividing by the realized size of a
variable-size batch (balls-in-bins, Poisson) would change the sensitivity the noise is
calibrated for.

Each call returns a new :class:`ClipState` (counts of steps, examples, clipped and non-finite
examples); the input state is never modified, so ``grad_fn`` is a pure function of
``(params, batch, state)``. Reading those counts synchronizes with the device once per call.
Randomness inside ``loss_fn`` (dropout) is refused by ``vmap``; put such layers in eval mode.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import optree
import torch
from torch.func import grad, vmap

from opake._checks import positive_finite, real_number
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError
from opake.types import ClippedPytree

__all__ = ["CLIPPING_MODES", "AutomaticClipping", "ClipState", "ClippingRuleError", "FlatClipping", "LossShapeError",
           "NonFiniteGradientError", "PerLayerClipping", "automatic_factors", "clip_factors", "clipped_grad",
           "clipping_rule"]

NONFINITE_MODES = ("raise", "zero")
CLIPPING_MODES = ("flat", "automatic")
AUTOMATIC_STABILITY = 0.01  # Bu et al. 2023's gamma, the value of all their experiments
_MAX_NAMED_EXAMPLES = 5


class NonFiniteGradientError(OpakeError, RuntimeError):
    """A per-example gradient held a NaN or an infinity (with ``nonfinite="raise"``)."""


class LossShapeError(OpakeError, ValueError):
    """``loss_fn`` did not return a real scalar tensor for one example."""


class ClippingRuleError(OpakeError, ValueError):
    """A clipping rule was asked for with a bad setting (an unknown mode, a stability <= 0 or NaN)."""


@dataclass(frozen=True)
class ClipState:
    """Counts kept by ``grad_fn`` across calls (a frozen value; each call returns a new one).

    ``steps``: calls so far. ``examples``: examples seen. ``clipped_examples``: examples whose
    gradient norm exceeded ``clipping_norm`` and was scaled down. ``nonfinite_examples``:
    examples whose gradient was not finite and was zeroed (``nonfinite="zero"`` only).
    """

    steps: int = 0
    examples: int = 0
    clipped_examples: int = 0
    nonfinite_examples: int = 0

    @property
    def clipped_fraction(self) -> float:
        """Fraction of the examples seen whose gradient was clipped (0.0 before any example)."""
        return self.clipped_examples / self.examples if self.examples else 0.0


def _check_batch_argnums(batch_argnums) -> tuple[int, ...]:
    if isinstance(batch_argnums, numbers.Integral) and not isinstance(batch_argnums, bool):
        batch_argnums = (batch_argnums,)
    if not isinstance(batch_argnums, Sequence) or isinstance(batch_argnums, str):
        raise InvalidTypeError(
            f"batch_argnums must be an int or a sequence of ints (positions in loss_fn's "
            f"arguments, params is 0), got {batch_argnums!r}"
        )
    result = []
    for position in batch_argnums:
        if isinstance(position, bool) or not isinstance(position, numbers.Integral):
            raise InvalidTypeError(f"batch_argnums must hold ints, got {position!r} ({type(position).__name__})")
        if position < 1:
            raise InvalidArgumentError(
                f"batch_argnums holds positions of loss_fn(params, *batch) arguments; position 0 is "
                f"params, which is never split per example, and negative positions are not "
                f"allowed; got {position}. Use 1 for the first argument after params"
            )
        result.append(int(position))
    if not result:
        raise InvalidArgumentError("batch_argnums is empty: name at least one per-example argument, e.g. (1,)")
    if len(set(result)) != len(result):
        raise InvalidArgumentError(f"batch_argnums has repeated positions: {tuple(result)}")
    return tuple(sorted(result))


def _leaf_name(path) -> str:
    return "/".join(str(part) for part in path) or "<params>"


def _checked_params(params):
    """Params with every leaf detached (plain tensors for torch.func); leaves must be real floats."""
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    if not leaves:
        raise InvalidArgumentError("params holds no tensors; pass a tensor or a dict/list/tuple of tensors")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise InvalidTypeError(
                f"params leaves must be torch.Tensor; the leaf at {_leaf_name(path)!r} is "
                f"{type(leaf).__name__}. For an nn.Module pass dict(model.named_parameters())"
            )
        if not leaf.dtype.is_floating_point:
            raise InvalidTypeError(
                f"params leaf {_leaf_name(path)!r} has dtype {leaf.dtype}; gradients need real "
                f"floating-point parameters. Pass integer or frozen tensors as a non-batched argument"
            )
    return optree.tree_unflatten(spec, [leaf.detach() for leaf in leaves])


def _batch_size(args, batch_argnums) -> int:
    sizes = {}
    for position in batch_argnums:
        paths, leaves, _ = optree.tree_flatten_with_path(args[position - 1])
        if not leaves:
            raise InvalidArgumentError(
                f"per-example argument {position} holds no tensors; it cannot be split into examples"
            )
        for path, leaf in zip(paths, leaves):
            where = f"argument {position}" + (f" at {_leaf_name(path)!r}" if path else "")
            if not isinstance(leaf, torch.Tensor):
                raise InvalidTypeError(
                    f"per-example {where} is {type(leaf).__name__}, not a tensor; pass constants "
                    f"in an argument that is not listed in batch_argnums"
                )
            if leaf.dim() == 0:
                raise InvalidArgumentError(
                    f"per-example {where} is a 0-dim tensor; per-example arguments are split "
                    f"along dim 0, so they need a leading batch dimension"
                )
            sizes[where] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{where}: {size}" for where, size in sizes.items())
        raise InvalidArgumentError(f"per-example arguments disagree on the batch size (dim 0): {listed}")
    return next(iter(sizes.values()))


def _compute_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a leaf's clipped sum is formed and returned in: at least float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_CAST_ELEMENTS = 2**20


def _weighted_sum(flat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sum_b scale[b] * flat[b] for a (batch, n) leaf, in ``_sum_dtype`` of the leaf's dtype.

    A half-precision leaf is widened a stretch of columns at a time (at most ``_CAST_ELEMENTS``
    elements per temporary), so the float32 copy never costs the whole per-example tensor.
    """
    dtype = _sum_dtype(flat.dtype)
    weights = scale.to(device=flat.device, dtype=dtype)
    if flat.dtype == dtype:
        return torch.mv(flat.t(), weights)
    batch, columns = flat.shape
    out = torch.empty(columns, dtype=dtype, device=flat.device)
    stride = max(1, _CAST_ELEMENTS // max(batch, 1))
    for start in range(0, columns, stride):
        stop = min(columns, start + stride)
        torch.mv(flat[:, start:stop].t().to(dtype), weights, out=out[start:stop])
    return out


def _leaf_norms(flat_leaves, device, compute_dtype) -> torch.Tensor:
    """(B, L) per-example, per-leaf L2 norms, each reduced in its leaf's dtype (>= float32)."""
    columns = []
    for flat in flat_leaves:
        reduce_dtype = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
        norm = torch.linalg.vector_norm(flat, dim=1, dtype=reduce_dtype)
        columns.append(norm.to(device=device, dtype=compute_dtype))
    return torch.stack(columns, dim=1)


def _rescaled_norms(flat_leaves, rows: list[int], device, dtype) -> torch.Tensor:
    """Global norms (in ``dtype``) of the examples ``rows``, safe from overflow (max-abs rescaling).

    NaN where an element is NaN; inf where an element is infinite or the norm exceeds ``dtype``.
    """
    parts = [
        flat[torch.tensor(rows, device=flat.device)].to(device=device, dtype=dtype) for flat in flat_leaves
    ]
    largest = torch.zeros(len(rows), dtype=dtype, device=device)
    for part in parts:
        if part.shape[1]:
            largest = torch.maximum(largest, part.abs().amax(dim=1))  # NaN and inf propagate
    safe = torch.where(torch.isfinite(largest) & (largest > 0), largest, torch.ones_like(largest))
    squares = sum(torch.linalg.vector_norm(part / safe[:, None], dim=1) ** 2 for part in parts)
    return safe * torch.sqrt(squares)


def _nonfinite_message(flat_leaves, paths, bad: list[int], batch_size: int) -> str:
    first = bad[0]
    leaves_hit = [
        _leaf_name(path)
        for path, flat in zip(paths, flat_leaves)
        if not bool(torch.isfinite(flat[first]).all())
    ]
    shown = ", ".join(str(index) for index in bad[:_MAX_NAMED_EXAMPLES])
    more = f" and {len(bad) - _MAX_NAMED_EXAMPLES} more" if len(bad) > _MAX_NAMED_EXAMPLES else ""
    if leaves_hit:
        where = "in " + ", ".join(repr(name) for name in leaves_hit)
    else:
        where = "(its norm overflows float64)"
    return (
        f"the per-example gradient of example {first} (index in this batch of {batch_size}) is not "
        f"finite {where}; non-finite examples: {shown}{more}. Find the cause (learning rate, loss "
        f"on that input), or pass nonfinite='zero' to clipped_grad to drop such examples from the "
        f"sum (they are counted in ClipState.nonfinite_examples)"
    )


@dataclass(frozen=True)
class FlatClipping:
    """The clipping rule: each unit's gradient g scaled by ``min(1, max_grad_norm / ||g||)``, the
    norm taken over all parameters together.

    A clipping rule is a value with two members: ``factors(norms)``, the per-unit scale factors
    (and which units were scaled down), and ``sensitivity``, the bound on the L2 norm of one
    unit's scaled gradient that the factors guarantee, which the noise is scaled to and every
    accountant prices (``ClippedPytree.l2_bound``). Here that bound is ``max_grad_norm``.
    ``mode`` names the rule (``CLIPPING_MODES``); ``description`` says it in one line (what a
    checkpoint records).
    """

    max_grad_norm: float
    mode: ClassVar[str] = "flat"

    def __post_init__(self):
        object.__setattr__(self, "max_grad_norm", positive_finite("max_grad_norm", self.max_grad_norm))

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    @property
    def description(self) -> str:
        return "flat"

    def factors(self, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return clip_factors(norms, self.max_grad_norm)


@dataclass(frozen=True)
class AutomaticClipping:
    """Automatic clipping (AUTO-S): each unit's gradient g scaled by
    ``max_grad_norm / (||g|| + stability)``, the norm taken over all parameters together.

    Bu, Wang, Zha and Karypis, "Automatic Clipping: Differentially Private Deep Learning Made
    Easier and Stronger" (NeurIPS 2023, arXiv 2206.07136), section 4, AUTO-S (the "stable"
    normalization): every per-example gradient is normalized, R g / (||g|| + gamma), with gamma =
    0.01 in their experiments, and the sum is noised for sensitivity R. Here R is
    C = ``max_grad_norm``, so one unit's scaled gradient has norm
    C ||g|| / (||g|| + gamma) < C whatever g is (0 for a zero gradient, tending to C as ||g||
    grows): the sensitivity is C, exactly as for flat clipping, and every accountant and the
    noise scale apply unchanged (docs/math.md section 8; up to rounding, as for flat clipping: once
    gamma is below the last bit of ||g||, the factor is C / ||g|| and the scaled norm C to the last
    bit).

    Learning rate (their section 4, on R's independence): C only rescales the private gradient,
    noise included, so for SGD (with or without momentum) the pair (learning rate eta, C) trains
    as (eta C, 1), and for Adam-type optimizers, which are invariant to the gradient's scale, C
    has no effect up to Adam's own eps. Tune the learning rate only and keep C = 1. The learning
    rate that suits flat clipping does not carry over: with flat clipping small gradients keep
    their size, here every example's gradient has norm close to C.

    ``stability`` is gamma (> 0, finite): it keeps the factor finite for a zero gradient and
    gives gradients much smaller than gamma less weight than the others (AUTO-V, gamma = 0, would
    divide by zero and weigh a vanishing gradient as much as any other; Bu et al.'s convergence
    analysis is for the stable form). ``factors`` marks as scaled down the units whose factor is
    below 1 (||g|| + gamma > C); every other unit is scaled up.
    """

    max_grad_norm: float
    stability: float = AUTOMATIC_STABILITY
    mode: ClassVar[str] = "automatic"

    def __post_init__(self):
        object.__setattr__(self, "max_grad_norm", positive_finite("max_grad_norm", self.max_grad_norm))
        stability = real_number("stability", self.stability)
        if not (math.isfinite(stability) and stability > 0.0):
            raise ClippingRuleError(
                f"stability (automatic clipping's gamma) must be finite and > 0, got {self.stability!r}: it keeps "
                f"max_grad_norm / (||g|| + gamma) finite for a zero gradient. Use the paper's "
                f"{AUTOMATIC_STABILITY} (AutomaticClipping(max_grad_norm, stability={AUTOMATIC_STABILITY}))"
            )
        object.__setattr__(self, "stability", stability)

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    @property
    def description(self) -> str:
        return f"automatic(stability={self.stability!r})"

    def factors(self, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return automatic_factors(norms, self.max_grad_norm, self.stability)


@dataclass(frozen=True)
class PerLayerClipping:
    """Per-layer clipping: each unit's gradient of parameter p scaled by ``min(1, C_p / ||g_p||)``,
    every parameter on its own (Opacus' ``clipping="per_layer"``, one bound per parameter).

    ``bounds`` is ``((name, C_p), ...)``, one entry per trainable parameter, by its model-wide name
    (``named_parameters()``), each C_p > 0 and finite. One unit's scaled gradient then has, over all
    parameters together, a norm of at most ``sqrt(sum_p C_p^2)``: that is ``sensitivity``, the
    bound the noise is scaled to and every accountant prices, exactly as flat clipping at that
    bound (the factors only make each part smaller). ``factors_by_name`` takes the (B,) norms of
    every parameter and returns each parameter's (B,) factors and the mask of units scaled down in
    any parameter. Per-example clipping by hooks (``opake.torch.per_example``) applies it;
    ``clipped_grad`` clips flat over all parameters and refuses it.
    """

    bounds: tuple
    mode: ClassVar[str] = "per_layer"
    per_parameter: ClassVar[bool] = True

    def __post_init__(self):
        pairs = tuple(self.bounds.items()) if isinstance(self.bounds, dict) else tuple(self.bounds)
        if not pairs:
            raise ClippingRuleError("per-layer clipping needs one bound per trainable parameter; none was given")
        checked = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise InvalidTypeError(f"bounds must be (parameter name, bound) pairs, got {pair!r}")
            checked.append((pair[0], positive_finite(f"the bound of {pair[0]!r}", pair[1])))
        names = [name for name, _ in checked]
        if len(set(names)) != len(names):
            raise ClippingRuleError(f"per-layer bounds name a parameter twice: {sorted(names)}")
        object.__setattr__(self, "bounds", tuple(checked))

    @property
    def names(self) -> tuple:
        return tuple(name for name, _ in self.bounds)

    @property
    def sensitivity(self) -> float:
        return math.sqrt(math.fsum(bound * bound for _, bound in self.bounds))

    @property
    def description(self) -> str:
        return "per_layer(" + ", ".join(f"{name}={bound!r}" for name, bound in self.bounds) + ")"

    def factors_by_name(self, norms: dict) -> tuple[dict, torch.Tensor]:
        """Per parameter name in ``norms`` (those a pass reached), the (B,) factors ``min(1, C_p / norm)``
        for its (B,) norms; and the (B,) mask of the units scaled down in at least one parameter."""
        bounds = dict(self.bounds)
        factors, clipped = {}, None
        for name, norm in norms.items():
            factors[name], scaled = clip_factors(norm, bounds[name])
            clipped = scaled if clipped is None else clipped | scaled
        return factors, clipped

    def factors(self, norms: torch.Tensor):
        raise ClippingRuleError(
            "per-layer clipping scales each parameter's gradient by its own norm, which a norm over all "
            "parameters together cannot give: it is applied by opake.torch's per-example hooks "
            "(PrivacyEngine.make_private(clipping='per_layer')), not by clipped_grad; clip flat here"
        )


def clipping_rule(rule, name: str = "max_grad_norm", mode: str | None = None):
    """The clipping rule of a bound and a mode, or a rule value (returned as is).

    ``rule`` is the bound C (a number) or a rule value (``FlatClipping``, ``AutomaticClipping``
    or any value with ``factors`` and ``sensitivity``). ``mode`` (``CLIPPING_MODES``): None keeps
    the rule value's own mode (flat for a number); ``"flat"`` or ``"automatic"`` builds that rule
    from a number, and for a rule value must be the value's mode. Refused, with the fix: an
    unknown mode, and a mode that contradicts the rule value given.
    """
    if mode is not None and mode not in CLIPPING_MODES:
        raise ClippingRuleError(
            f"clipping must be one of {CLIPPING_MODES} (None: flat for a number), got {mode!r}; "
            f"'automatic' is AUTO-S (Bu et al. 2023): max_grad_norm / (||g|| + 0.01) per example"
        )
    if hasattr(rule, "factors") and hasattr(rule, "sensitivity"):
        own = getattr(rule, "mode", None)
        if mode is not None and own != mode:
            raise ClippingRuleError(
                f"clipping={mode!r} contradicts the clipping rule given as {name}, {rule!r} (mode {own!r}); "
                f"give the bound as a number with clipping={mode!r}, or the rule value alone"
            )
        return rule
    if mode == "automatic":
        return AutomaticClipping(positive_finite(name, rule))
    return FlatClipping(positive_finite(name, rule))


def clip_factors(norms: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example scale factors ``min(1, bound / norm)`` and the mask of clipped examples.

    The one implementation of the clipping rule, shared by ``clipped_grad`` and the PyTorch
    front end's hooks (``opake.torch.per_example``). A factor is exactly 1 at or below the
    bound (a zero norm is never divided by) and ``bound / norm`` above it, in ``norms``' dtype.
    """
    clipped = norms > bound
    return torch.where(clipped, bound / torch.where(clipped, norms, torch.ones_like(norms)), torch.ones_like(norms)), clipped


def automatic_factors(norms: torch.Tensor, bound: float, stability: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example scale factors ``bound / (norm + stability)`` (AUTO-S, ``AutomaticClipping``)
    and the mask of the examples scaled down (factor below 1), in ``norms``' dtype.

    Every scaled norm ``bound * norm / (norm + stability)`` is below ``bound`` (``stability`` > 0);
    a zero norm gets the finite factor ``bound / stability`` (its gradient stays zero).
    """
    factors = bound / (norms + stability)
    return factors, factors < 1


def clipped_grad(
    loss_fn: Callable,
    clipping_norm: float,
    batch_argnums: int | Sequence[int] = (1,),
    normalize_by: float | None = None,
    *,
    nonfinite: str = "raise",
    clipping: str | None = None,
):
    """Build ``grad_fn``: clipped, summed (and normalized) per-example gradients.

    Args:
      loss_fn: ``loss_fn(params, *args) -> scalar tensor``, the loss of ONE example. The
        arguments at ``batch_argnums`` arrive as one example without the batch dimension
        (see the module docstring); the others arrive whole.
      clipping_norm: L2 bound C (> 0, finite) on each example's gradient, over all
        parameters together, or a clipping rule value (``FlatClipping(C)``,
        ``AutomaticClipping(C, stability)``) whose ``sensitivity`` is that bound.
      batch_argnums: positions (in ``loss_fn``'s arguments; params is 0) of the per-example
        arguments, split along dim 0. Default ``(1,)``: one batch argument, which may be a
        tuple or dict of tensors such as ``(inputs, labels)``.
      normalize_by: fixed divisor of the sum (> 0, finite), e.g. the expected batch size; None
        for a plain sum.
      nonfinite: ``"raise"`` (default) raises :class:`NonFiniteGradientError` when an example's
        gradient holds NaN or inf; ``"zero"`` drops that example from the sum and counts it.
      clipping: ``"flat"`` (``min(1, C / norm)``), ``"automatic"`` (AUTO-S, ``C / (norm +
        0.01)``, ``AutomaticClipping``) or None (default: flat for a number, the rule's own mode
        for a rule value). ``ClipState.clipped_examples`` counts the examples whose factor was
        below 1.

    Returns:
      ``(grad_fn, clip_state)``. ``grad_fn(params, *args, state=clip_state)`` returns
      ``(ClippedPytree, new_state)``: the pytree has the structure, shapes and device of
      ``params`` and their dtypes, except that bfloat16/float16 leaves are summed and returned
      in float32 (see above); ``l2_bound == clipping_norm``; ``normalization == normalize_by or 1.0``.
      A batch of size 0 gives zeros (``loss_fn`` is not called).
    """
    if not callable(loss_fn):
        raise InvalidTypeError(
            f"loss_fn must be callable as loss_fn(params, *batch), got {type(loss_fn).__name__}"
        )
    rule = clipping_rule(clipping_norm, "clipping_norm", clipping)
    clipping_norm = rule.sensitivity
    normalization = 1.0 if normalize_by is None else positive_finite("normalize_by", normalize_by)
    batch_argnums = _check_batch_argnums(batch_argnums)
    if nonfinite not in NONFINITE_MODES:
        raise InvalidArgumentError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")

    def example_loss(params, *args):
        loss = loss_fn(params, *args)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossShapeError(
                f"loss_fn must return a real scalar (0-dim) tensor for one example, got {shape}; "
                f"it receives one example without the batch dimension. Reduce the loss to a "
                f"scalar (e.g. .sum() or .mean()), or add the dimension back with unsqueeze(0)"
            )
        return loss

    per_example_grad = grad(example_loss, argnums=0)

    def grad_fn(params, *args, state: ClipState):
        if not isinstance(state, ClipState):
            raise InvalidTypeError(
                f"state must be the ClipState returned by clipped_grad or by the previous call, "
                f"got {type(state).__name__}"
            )
        last = batch_argnums[-1]
        if last > len(args):
            raise InvalidArgumentError(
                f"batch_argnums {batch_argnums} refers to argument {last} of loss_fn, but grad_fn "
                f"got only {len(args)} argument(s) after params"
            )
        params = _checked_params(params)
        batch_size = _batch_size(args, batch_argnums)
        if batch_size == 0:
            zeros = optree.tree_map(lambda leaf: torch.zeros_like(leaf, dtype=_sum_dtype(leaf.dtype)), params)
            new_state = dataclasses.replace(state, steps=state.steps + 1)
            return ClippedPytree(zeros, clipping_norm, normalization), new_state

        in_dims = (None,) + tuple(
            0 if position in batch_argnums else None for position in range(1, len(args) + 1)
        )
        per_example = vmap(per_example_grad, in_dims=in_dims)(params, *args)
        paths, leaves, spec = optree.tree_flatten_with_path(per_example)
        flat_leaves = [leaf.reshape(batch_size, math.prod(leaf.shape[1:])) for leaf in leaves]
        device = flat_leaves[0].device
        compute_dtype = _compute_dtype(device)

        norms = torch.linalg.vector_norm(_leaf_norms(flat_leaves, device, compute_dtype), dim=1)
        finite = torch.isfinite(norms)
        # Squares of elements below sqrt(tiny) underflow, so a norm this small may read as 0
        # (a gradient of 1e-24 against a bound of 1e-25 would pass unclipped): recompute too.
        tiny = max(torch.finfo(f.dtype if f.dtype in (torch.float32, torch.float64) else torch.float32).tiny
                   for f in flat_leaves)
        suspect = torch.nonzero(~finite | (norms < math.sqrt(tiny) * 2.0**10)).flatten().tolist()
        if suspect:
            # A leaf norm overflowed or underflowed its dtype, or an element is NaN/inf:
            # recompute with max-abs rescaling in the compute dtype.
            rows = torch.tensor(suspect, device=device)
            norms = norms.index_put((rows,), _rescaled_norms(flat_leaves, suspect, device, compute_dtype))
            finite = torch.isfinite(norms)
            bad = torch.nonzero(~finite).flatten().tolist()
            if bad and nonfinite == "raise":
                raise NonFiniteGradientError(_nonfinite_message(flat_leaves, paths, bad, batch_size))
            if bad:
                keep = finite[:, None]
                flat_leaves = [
                    torch.where(keep.to(flat.device), flat, torch.zeros_like(flat)) for flat in flat_leaves
                ]
        else:
            bad = []

        scale, clipped = rule.factors(torch.where(finite, norms, torch.zeros_like(norms)))
        scale = torch.where(finite, scale, torch.zeros_like(scale)) / normalization  # 0: a dropped example
        sums = [_weighted_sum(flat, scale).reshape(leaf.shape[1:]) for flat, leaf in zip(flat_leaves, leaves)]
        num_clipped = int(clipped.sum())
        new_state = ClipState(
            steps=state.steps + 1,
            examples=state.examples + batch_size,
            clipped_examples=state.clipped_examples + num_clipped,
            nonfinite_examples=state.nonfinite_examples + len(bad),
        )
        return ClippedPytree(optree.tree_unflatten(spec, sums), clipping_norm, normalization), new_state

    return grad_fn, ClipState()
