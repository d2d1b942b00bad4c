"""PerExampleClipper: hooks that record each layer call, and the state between backward passes.

Each call of the wrapped model is one forward pass with its own examples. Its hooked layers'
calls are collected in a ``_ForwardPass``; every tensor output that needs a gradient counts as
one pending gradient. When the last one arrives (during ``backward``) the pass is clipped at
once (``bookkeeping.clip_forward_pass``) and its stored tensors are freed. A pass whose outputs
were not all used by the loss never completes by count; it is clipped at the next call of the
model, or in ``clipped_sum()``. Passes never mix: two forward passes followed by one backward
of the sum of their losses are clipped as two sets of examples.

Shared indices. A model that looks up position embeddings with indices of batch size one
(``position_ids`` of shape (1, T), broadcast against the token embeddings, as GPT-2 and BERT do)
would hand that Embedding the sum of the examples' gradients. A forward pre-hook on hooked
Embedding layers expands such an index tensor to the pass's batch (a view, no copy), so that
the layer's output, and its gradient, has one row per example. The model must combine that
output with the batch by broadcasting (adding it to the token embeddings), which is what
broadcasting a (1, T, d) tensor did; a model that instead reduced over its first dimension
would now attribute the batch's gradient to some examples. Any other layer called on a batch of
one is refused in backward (``BatchDimensionError``, with the fix).

Gradient checkpointing (``torch.utils.checkpoint``, ``model.gradient_checkpointing_enable()``)
runs the checkpointed layers again in backward. Non-reentrant checkpointing (transformers'
default) backpropagates through the graph of the original forward, whose calls the hooks
recorded: the recomputed calls are recognized (a hooked layer running inside ``backward`` outside
any call of the model) and ignored. The recorded inputs stay referenced by the clipper, so
checkpointing saves less memory than without per-example clipping. Reentrant checkpointing
(``use_reentrant=True``) runs the forward under ``no_grad`` and backpropagates through the
recomputed graph: the calls skipped in the forward are counted on their pass, the recomputed
calls are recorded into it, and the pass is clipped once all of them have their gradients.

Privacy units (user-level clipping). ``expect_units(units)`` gives the unit (user) of every row
of the logical batch about to be trained on, in row order; ``make_private(..., privacy_unit=...)``
calls it as its loader serves each batch. Each forward pass that records gradients then takes
the next B unit numbers (B its batch size), so micro-batches cut from the batch in order work,
and the pass clips each unit's summed gradient (``bookkeeping.clip_forward_pass(units=...)``).
A unit whose rows fall in two forward passes is refused when the second one starts: each pass
would clip its part on its own, up to 2C for the unit. ``reset()`` (``zero_grad``) keeps the
expected units and starts taking them from the first row again; ``clipped_sum()`` refuses unless
the passes clipped took every row's unit exactly once.

Compiled calls. ``torch.compile`` (of the model, of a function that calls it, or of a submodule;
``module.compile()``) and ``torch.export`` trace the hooks instead of running them, and the hooks
carry Python state from each layer call to the backward pass that tracing cannot keep exact (the
graph would break at every hooked layer). The root's and every hooked layer's pre-hook refuse a
traced call (``CompiledModuleError``) before it computes anything.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from functools import partial

import optree
import torch
from torch import nn

from opake.dpftrl.clipping import clipping_rule
from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.torch.per_example.bookkeeping import ClippedPass, LayerCall, clip_forward_pass, release, sum_dtype
from opake.torch.per_example.errors import (ClipperUsageError, CompiledModuleError, UnhookedUseError,
                                           UnsupportedModuleError)
from opake.torch.per_example.model import HookedLayer, describe, plan_model
from opake.torch.per_example.rules.base import autocast_state, lowest_precision
from opake.torch.per_example.rules.embedding import EmbeddingRule
from opake.torch.per_example.rules.linear import LinearRule

LOSS_REDUCTIONS = ("mean", "sum")


_COMPILED_CALL = (
    "a compiled call (torch.compile(module), module.compile(), a compiled function or submodule that calls it, "
    "or torch.export) reached the per-example clipping hooks of this module. torch.compile cannot trace them: "
    "they carry Python state from each layer call to the backward pass, so the graph would break at every "
    "hooked layer and the clipped sums would rest on how the compiler replays that state. The call was refused "
    "before it computed anything, and nothing was released. Train with the uncompiled module: call "
    "private.module itself, with no compiled submodule (a module compiled in place with .compile() stays "
    "compiled: build it again, then plan again); to compile the trained model for inference, call "
    "private.detach() first"
)


def _refuse_if_compiling() -> None:
    """Raise ``CompiledModuleError`` in a hook that torch.compile or torch.export is tracing.

    ``torch.compiler.is_compiling()`` is true only while tracing. Raising from the traced code itself
    would not do: the compiler takes an uncaught exception for a graph break and runs the hook again
    eagerly, where the check is false. A function wrapped in ``torch.compiler.disable`` is not traced
    but called when the compiled code runs, so its error reaches the caller (with ``fullgraph=True``
    the compiler refuses the call to it instead). It is wrapped here, not at import, because the
    wrapping imports the compiler (about a second), which is loaded anyway once something is compiled.
    """
    if torch.compiler.is_compiling():
        torch.compiler.disable(_raise_compiled_call, reason="opake refuses compiled calls of a private module")()


def _raise_compiled_call() -> None:
    raise CompiledModuleError(_COMPILED_CALL)


@dataclass(eq=False)
class _ForwardPass:
    batch_size: int | None  # dimension 0 of the model's first tensor input, when it has one
    grad_enabled: bool = True  # at the call of the model
    calls: list[LayerCall] = field(default_factory=list)
    pending: int = 0
    deferred: int = 0  # hooked calls run under no_grad inside the model: reentrant checkpointing
    units: torch.Tensor | None = None  # the unit of each row (expect_units), taken at the call of the model
    placeholder: bool = False  # its first row is a placeholder (expect_placeholder)

    @property
    def complete(self) -> bool:
        return self.pending == 0 and self.deferred <= 0


def coverage_tolerance(dtype: torch.dtype | None) -> float:
    """``check_coverage``'s default ``rtol`` for gradients computed in ``dtype``.

    1e-3 of the model's gradient norm for float32 and float64 (reductions in another order
    differ by far less), and 4 machine epsilons for half precision: bfloat16 (eps 2^-7, unit
    roundoff 2^-8) 3.1e-2, float16 3.9e-3. A low-precision ``.grad`` is autograd's result rounded
    once (matrix products accumulate in float32, then round) where the hooks' sums are float32,
    so each parameter's difference is about one unit roundoff of its own gradient, at most
    1/sqrt(2) roundoff of the model's; 4 eps leaves room for a ``.grad`` accumulated from several
    uses (tied weights, repeated tokens) in bfloat16. A parameter used outside its layer differs
    by that use's share of the gradient, which this still catches unless that share is a few
    percent of the whole model's gradient.
    """
    if dtype is None or dtype in (torch.float32, torch.float64):
        return 1e-3
    return max(1e-3, 4 * torch.finfo(dtype).eps)


def _batch_first(value):
    """A tensor with its dimensions 0 and 1 swapped (a view); anything else as it is."""
    return value.transpose(0, 1) if isinstance(value, torch.Tensor) and value.dim() >= 2 else value


def _leaves(tree) -> list:
    """The leaves of a layer's output (a bare tensor, the common case, without flattening)."""
    return [tree] if isinstance(tree, torch.Tensor) else optree.tree_leaves(tree)


def _any_requires_grad(args: tuple, kwargs: dict) -> bool:
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in optree.tree_leaves(value)):
            return True
    return bool(kwargs) and any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in optree.tree_leaves(kwargs)
    )


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread now."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for leaf in optree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _refuse_data_parallel_wrapper(module) -> None:
    """Refuse a call of the model through ``DistributedDataParallel`` (or ``DataParallel``): DDP
    all-reduces autograd's unclipped gradients, which per-example clipping replaces (inside
    ``ddp.no_sync()`` it does not, and the call is allowed: DPTrainer keeps Trainer's wrap there).
    The wrapper's forward is a few frames up (its ``forward`` calls ``self.module``); nothing has
    run yet."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        caller = frame.f_locals.get("self")
        synchronizing = getattr(caller, "require_backward_grad_sync", True)  # False inside DDP's no_sync()
        if (isinstance(caller, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and caller.module is module
                and synchronizing):
            raise UnsupportedModuleError(
                f"the private module is being called through {type(caller).__name__}, which would average "
                f"autograd's unclipped gradients across ranks: make_private already splits each planned batch "
                f"across ranks and reduces the clipped sums itself. Call the module make_private returned "
                f"(private.module) directly on every rank, without wrapping it. Nothing was released"
            )
        frame = frame.f_back


class PerExampleClipper:
    """Clip every example's gradient to ``max_grad_norm`` during ordinary ``loss.backward()`` calls.

    Args:
      module: the model. Its trainable parameters (``requires_grad=True`` at construction) are
        clipped together; frozen ones get no hooks and are not in the result.
      max_grad_norm: the bound C (> 0, finite) on each example's gradient norm over all
        trainable parameters together, or a clipping rule value (``FlatClipping(C)``; a rule's
        ``sensitivity`` is the bound).
      loss_reduction: ``"mean"`` when the loss is the mean of the examples' losses over the
        batch dimension (the gradients are rescaled by the batch size to get each example's own
        gradient), ``"sum"`` when it is their sum.

    After one or more ``loss.backward()`` calls, :meth:`clipped_sum` returns, per parameter
    name, the sum over all examples so far of ``min(1, C / ||g_i||) g_i``.
    """

    def __init__(self, module: nn.Module, max_grad_norm: float, loss_reduction: str = "mean"):
        if not isinstance(module, nn.Module):
            raise InvalidTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.rule = clipping_rule(max_grad_norm)  # a bound C is FlatClipping(C)
        self.max_grad_norm = self.rule.sensitivity
        if loss_reduction not in LOSS_REDUCTIONS:
            raise InvalidArgumentError(
                f"loss_reduction must be one of {LOSS_REDUCTIONS} (how the loss combines the examples' "
                f"losses over the batch dimension), got {loss_reduction!r}"
            )
        self.loss_reduction = loss_reduction
        self._plan = plan_model(module)
        if not self._plan.trainable:
            raise InvalidArgumentError("the module has no trainable parameters (requires_grad=True); nothing to clip")
        if getattr(self.rule, "per_parameter", False) and set(self.rule.names) != set(self._plan.trainable):
            raise InvalidArgumentError(
                f"per-layer clipping gives bounds for {sorted(self.rule.names)}, but the module's trainable "
                f"parameters are {sorted(self._plan.trainable)}: give one bound per trainable parameter"
            )
        self._keep_per_example = False  # keep_per_example_grads
        self._nonfinite = "raise"  # drop_nonfinite
        self._batch_second: frozenset = frozenset()  # ids of the layers that take the batch on dimension 1
        self._module = module
        self._handles = []
        self._tracking_unclipped = False
        self._current: _ForwardPass | None = None
        self._open: list[_ForwardPass] = []
        self._folding = False
        self._skip_autograd_weights = False
        self._lent: list[list[torch.Tensor]] = []  # parameters whose requires_grad a layer call turned off
        self._precisions: set[torch.dtype] = set()  # parameter and autocast dtypes of the calls seen
        self._expected_units: torch.Tensor | None = None  # expect_units: kept across reset()
        self._placeholder_pending = False  # expect_placeholder: kept across reset(), taken by a pass
        self._regroup_units = True
        self._rows_per_example = 1  # expect_units: rows of the model's input per example of the batch
        self.reset()
        self._handles.append(module.register_forward_pre_hook(self._begin_pass, with_kwargs=True))
        for layer in self._plan.layers:
            if isinstance(layer.rule, EmbeddingRule):
                self._handles.append(layer.module.register_forward_pre_hook(self._expand_shared_indices))
            self._handles.append(
                layer.module.register_forward_pre_hook(partial(self._lend_parameters, layer), with_kwargs=True)
            )
            self._handles.append(
                layer.module.register_forward_hook(partial(self._record_call, layer), with_kwargs=True)
            )
            self._handles.append(layer.module.register_forward_hook(self._return_parameters, always_call=True))
        for path, batch_norm in self._plan.inference_batch_norms:
            self._handles.append(batch_norm.register_forward_pre_hook(partial(self._guard_batch_norm, path)))
        # Registered last, so it runs after the top-level layer's own hook when the model is a layer.
        self._handles.append(module.register_forward_hook(self._end_pass, always_call=True))

    @property
    def examples(self) -> int:
        """Examples clipped and summed since the last reset (rows of the model's input, divided by
        ``rows_per_example`` of ``expect_units``)."""
        return self._examples // self._rows_per_example

    @property
    def replaying(self) -> bool:
        """Whether a layer is being replayed per example right now (the torch.func fallback runs the
        layer again, with its parameters swapped, inside the backward pass)."""
        return self._folding

    @property
    def clipped_examples(self) -> int:
        """Of the clipped quantities (examples, or units after ``expect_units``), those whose
        gradient norm exceeded max_grad_norm."""
        return self._clipped_examples

    @property
    def units(self) -> int:
        """Units clipped since the last reset (after ``expect_units``; 0 otherwise)."""
        return self._units

    @property
    def passes(self) -> int:
        """Forward passes clipped since the last reset."""
        return self._passes

    def expect_units(self, units, *, regroup: bool = True, rows_per_example: int = 1) -> None:
        """Clip per unit: ``units`` holds the unit number of every row of the coming logical batch.

        Forward passes (with gradients) take the next rows' unit numbers in order, one per row of
        their batch; each pass then clips the summed gradient of each of its units to
        max_grad_norm (the clipped quantity of user-level privacy), and a unit whose rows fall in
        two forward passes is refused (cut micro-batches at unit boundaries). Kept until replaced
        (``reset()`` starts again from the first row); ``None`` returns to per-example clipping.
        ``regroup=False`` computes every unit norm from materialized per-example gradients instead
        of regrouped ghost norms (bookkeeping; the results agree up to rounding).

        ``rows_per_example`` is how many rows of the model's input one example of the batch takes:
        2 for a preference pair, whose chosen and rejected sequences are two rows of one unit
        (``opake.transformers.DPDPOTrainer``); ``examples`` then counts pairs, as the planned batch
        does. ``units`` still holds one unit number per row.
        """
        if isinstance(rows_per_example, bool) or not isinstance(rows_per_example, int) or rows_per_example < 1:
            raise InvalidArgumentError(f"rows_per_example must be an integer >= 1, got {rows_per_example!r}")
        if units is None and rows_per_example != 1:
            raise InvalidArgumentError(
                "rows_per_example needs units: the rows of one example must be clipped together, "
                "as one unit"
            )
        if units is not None:
            if isinstance(units, torch.Tensor):
                units = units.detach().to("cpu")
            else:
                try:
                    units = torch.as_tensor(units)
                except (TypeError, ValueError, RuntimeError):
                    raise InvalidTypeError("units must be a 1-D sequence or tensor of integer unit numbers, "
                                           "one per row") from None
            if units.dim() != 1 or units.dtype.is_floating_point or units.dtype.is_complex or units.dtype == torch.bool:
                raise InvalidTypeError(f"units must be a 1-D tensor of integer unit numbers, one per row; got shape "
                                       f"{tuple(units.shape)} of {units.dtype}")
            units = units.to(torch.int64)
        self._expected_units = units
        self._regroup_units = bool(regroup)
        self._rows_per_example = rows_per_example
        self._units_taken = 0

    def expect_placeholder(self, pending: bool = True) -> None:
        """The next forward pass with gradients carries one placeholder row first: a rank whose
        part of a planned batch is empty runs one example anyway, because every rank of a sharded
        (FSDP2) model must join each forward and backward. That row's clipped weight is exactly 0
        and it is not counted among the examples; ``pending=False`` withdraws it."""
        self._placeholder_pending = bool(pending)

    def clipped_sum(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Per trainable parameter name: the sum of the clipped per-example gradients so far.

        Parameters not reached by any backward pass get zeros. Tensors have the parameter's
        shape and device and dtype, except float32 for bfloat16/float16 parameters. They are
        new tensors: the clipper keeps no reference to them. ``copy=False`` returns the clipper's
        own running sums instead (no copy), which the caller must not modify (DPOptimizer reads
        them once per step).
        """
        self._close_passes(only_received=False)
        if not self._passes:
            raise ClipperUsageError(
                "clipped_sum() was called before any backward pass since the clipper was built or reset; "
                "run the model and loss.backward() first"
            )
        expected = self._expected_units
        if expected is not None and (self._unit_rows != expected.numel() or self._examples != expected.numel()
                                     or self._examples % self._rows_per_example):
            raise ClipperUsageError(
                f"expect_units gave the units of {expected.numel()} rows, but the forward passes since the reset "
                f"took {self._units_taken} of them, {self._unit_rows} were clipped by unit and {self._examples} in "
                f"all: every row of the batch must go through exactly one forward pass with a backward (a forward "
                f"pass with gradients that was not backpropagated, e.g. an evaluation, also takes rows: run it "
                f"under torch.no_grad())"
            )
        result = {}
        for name, param in self._plan.trainable.items():
            total = self._sums.get(name)
            if total is None:
                result[name] = torch.zeros(param.shape, dtype=sum_dtype(param.dtype), device=param.device)
            else:
                result[name] = total.clone() if copy else total
        return result

    def keep_per_example_grads(self, enabled: bool = True) -> None:
        """Also form and keep every example's own gradient of every trainable parameter
        (``per_example_grads()``), besides the clipped sums, which do not change.

        Each is the gradient of that example's loss alone (for ``loss_reduction="mean"`` the batch's
        1/B is taken out), unclipped, of shape (examples, *parameter shape): batch size times the
        model's memory, which the clipping itself never needs. For inspecting clipping (Opacus'
        ``p.grad_sample``); off by default."""
        self._keep_per_example = bool(enabled)

    def batch_second(self, enabled: bool = True) -> None:
        """The model takes the batch on dimension 1 (sequence first: (T, B, ...), Opacus'
        ``batch_first=False``): its first tensor input and every hooked layer's inputs and outputs,
        except the layers inside a module whose class says ``BATCH_FIRST_INSIDE = True`` (opake's
        ``DPLSTM``, ``DPMultiheadAttention``: they move the batch first themselves). Each such call's
        stored tensors and output gradients are read with the batch moved first, which is exact for
        layers that act on each position alone (``nn.Linear`` on inputs of 3 or more dimensions,
        ``nn.Embedding`` on indices of 2 or more; a 2-D input of a Linear is (B, d) already); a model with
        other hooked layers outside such modules is refused. Set before the first forward pass."""
        if not enabled:
            self._batch_second = frozenset()
            return
        inside = [path for path, module in self._module.named_modules()
                  if getattr(type(module), "BATCH_FIRST_INSIDE", False)]
        second = [layer for layer in self._plan.layers
                  if not any(layer.path == path or layer.path.startswith(path + ".") for path in inside if path)]
        refused = [layer for layer in second if not isinstance(layer.rule, (LinearRule, EmbeddingRule))]
        if refused:
            raise UnsupportedModuleError(
                f"with the batch on dimension 1 (batch_first=False) opake clips nn.Linear and nn.Embedding layers, "
                f"which act on each position alone, but not {describe(refused[0].path)} "
                f"({type(refused[0].module).__name__}); put the batch first (batch_first=True), or use opake's "
                f"DPLSTM / DPMultiheadAttention, which move it first themselves"
            )
        self._batch_second = frozenset(id(layer) for layer in second)

    @property
    def coverage_comparable(self) -> bool:
        """Whether ``check_coverage`` can compare the passes since the last reset with autograd's ``.grad``
        (it cannot after a pass that dropped an example for a non-finite gradient, ``drop_nonfinite``)."""
        self._close_passes(only_received=False)
        return self._tracking_unclipped and self._unclipped is not None

    def drop_nonfinite(self, enabled: bool = True) -> None:
        """Give an example whose gradient is not finite (NaN or infinite, even recomputed in float64) a
        clipped weight of 0 and count it as clipped, as Opacus' clip factor does for an infinite norm,
        instead of raising ``NonFiniteGradientError`` (the default). Either way nothing non-finite reaches
        the released sum: an example's contribution stays within the bound (it is 0)."""
        self._nonfinite = "zero" if enabled else "raise"

    @property
    def keeps_per_example(self) -> bool:
        return self._keep_per_example

    def per_example_grads(self) -> dict[str, torch.Tensor]:
        """Per trainable parameter name, the per-example gradients kept since the last reset, the
        passes' examples concatenated in order (``keep_per_example_grads``); names no pass reached
        are absent."""
        self._close_passes(only_received=False)
        return {name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in self._kept.items()}

    def skip_autograd_weight_gradients(self, enabled: bool = True) -> None:
        """Whether hooked layers' calls leave their parameters out of autograd's graph.

        The clipped sums come from the layers' inputs and output gradients; autograd's own
        ``.grad`` of a hooked parameter is the *unclipped* sum, which costs one more contraction
        per layer (about a third of a Linear layer's backward) and is never released. Once
        :meth:`check_coverage` has shown that the hooks see every use of every parameter,
        ``DPOptimizer`` turns this on: each hooked call whose inputs already need a gradient
        runs with its parameters' ``requires_grad`` off (restored right after the call), so
        backward computes the input and output gradients the hooks need and no weight gradient.
        A first layer, whose input needs no gradient, keeps its weights in the graph so that
        backward reaches it. ``.grad`` then stays None until ``DPOptimizer.step`` writes the
        noised gradient.
        """
        self._skip_autograd_weights = bool(enabled)

    def track_coverage(self, enabled: bool = True) -> None:
        """From the next backward pass on, also form the unclipped sums (one more contraction
        per parameter) so that :meth:`check_coverage` can compare them with ``.grad``."""
        self._tracking_unclipped = bool(enabled)

    def check_coverage(self, rtol: float | None = None, autograd_gradients: dict | None = None) -> None:
        """Raise unless autograd's ``.grad`` equals the sum the hooks saw, for every parameter.

        A trainable parameter used outside the forward of the layer holding it (as in
        ``h @ self.embedding.weight.T``) escapes the hooks: its per-example norm would miss that
        use and the clipping bound would not hold. Autograd sees every use, so a ``.grad`` that
        differs from the hooks' unclipped sum (beyond float rounding: ``rtol`` of the norm of
        the whole model's gradient) means such a use. ``rtol`` defaults to
        ``coverage_tolerance`` of the lowest precision the hooked calls computed in (their
        parameters' dtype, or autocast's): 1e-3 in float32, 3.1e-2 in bfloat16. Needs
        ``track_coverage()`` before the backward passes and ``.grad`` zeroed at the start of the
        logical batch. ``autograd_gradients`` (name -> tensor) are autograd's gradients when they
        were taken out of ``.grad`` (``opake.torch.guard``); by default ``.grad`` is read.
        """
        self._close_passes(only_received=False)
        if not self._tracking_unclipped or self._unclipped is None:
            raise ClipperUsageError(
                "check_coverage() needs track_coverage() before the backward passes, and passes whose examples' "
                "gradients are all finite (one dropped for a non-finite gradient, drop_nonfinite, cannot be compared "
                "with autograd's .grad): the first step with examples must have finite gradients"
            )
        if rtol is None:
            rtol = coverage_tolerance(lowest_precision(self._precisions))
        pairs = {}
        for name, param in self._plan.trainable.items():
            seen = self._unclipped.get(name)
            actual = param.grad if autograd_gradients is None else autograd_gradients.get(name)
            if seen is None and actual is None:
                continue
            seen = torch.zeros(param.shape, dtype=torch.float64, device=param.device) if seen is None else (
                seen.to(torch.float64))
            actual = torch.zeros_like(seen) if actual is None else actual.detach().to(torch.float64)
            pairs[name] = (seen, actual)
        # Rounding is relative to the whole gradient, not to one parameter's: a bias that a
        # normalization layer cancels has a gradient of pure rounding noise on both sides.
        scale = max(1e-30, sum(float(s.norm()) ** 2 + float(a.norm()) ** 2 for s, a in pairs.values()) ** 0.5)
        for name, (seen, actual) in pairs.items():
            difference = float((seen - actual).norm())
            if difference > rtol * scale:
                raise UnhookedUseError(
                    f"parameter {name!r} got gradient from outside the layer that holds it (autograd's "
                    f".grad differs from what the per-example hooks saw by {difference / scale:.3g} of the "
                    f"model's gradient norm), so its per-example norm cannot be bounded. Use it only through "
                    f"its layer (for tied weights, a Linear whose weight is the shared Parameter), or make it "
                    f"a parameter of a layer opake hooks. (If .grad still held gradients from before this "
                    f"batch, call optimizer.zero_grad() before backward.)"
                )

    def reset(self) -> None:
        """Forget all stored tensors and sums: start a new logical batch."""
        self._open = []
        self._unclipped: dict[str, torch.Tensor] | None = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._kept: dict[str, list[torch.Tensor]] = {}  # keep_per_example_grads
        self._examples = 0
        self._clipped_examples = 0
        self._units = 0
        self._units_taken = 0  # rows of the expected units taken by forward passes since the reset
        self._unit_rows = 0  # of those, the rows clipped (passes that had a backward)
        self._passes = 0
        self._precisions = set()

    def remove(self) -> None:
        """Detach every hook from the model and drop all state."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.reset()

    # Hooks -------------------------------------------------------------------------------

    def _begin_pass(self, module, args, kwargs):
        _refuse_if_compiling()
        if self._current is not None:
            return  # the model calling itself recursively stays in one pass
        if torch.is_grad_enabled():
            _refuse_data_parallel_wrapper(module)
        self._close_passes(only_received=True)
        first = _first_tensor(args, kwargs)
        dim = 1 if self._batch_second else 0
        batch = first.shape[dim] if first is not None and first.dim() > dim else None
        units = self._take_units(batch) if self._expected_units is not None and torch.is_grad_enabled() else None
        placeholder = self._placeholder_pending and torch.is_grad_enabled()
        if placeholder:
            self._placeholder_pending = False
        self._current = _ForwardPass(batch_size=batch, grad_enabled=torch.is_grad_enabled(), units=units,
                                     placeholder=placeholder)
        self._open.append(self._current)

    def _take_units(self, batch: int | None) -> torch.Tensor:
        """The unit numbers of the next ``batch`` rows (module docstring: privacy units)."""
        expected, start = self._expected_units, self._units_taken
        if batch is None:
            raise ClipperUsageError(
                "with expect_units the model's first tensor input must have the batch on dimension 0, so that "
                "its rows can be matched with their units"
            )
        if start + batch > expected.numel():
            raise ClipperUsageError(
                f"this forward pass has {batch} rows but only {expected.numel() - start} of the {expected.numel()} "
                f"rows given to expect_units remain: the model ran on more rows than the batch (run evaluations "
                f"under torch.no_grad()), or the batch's units were not announced"
            )
        units = expected[start:start + batch]
        split = torch.isin(units, expected[:start])
        if bool(split.any()):
            unit = int(units[split][0])
            raise ClipperUsageError(
                f"unit {unit} has rows in two forward passes (micro-batches) of one logical batch: each pass would "
                f"clip its part of the unit's gradient on its own, up to twice max_grad_norm for the unit. Cut "
                f"micro-batches at unit boundaries (all rows of a unit in one forward pass; DPTrainer does so "
                f"with privacy_unit), or run the whole batch in one pass"
            )
        self._units_taken = start + batch
        return units

    def _end_pass(self, module, args, output):
        current, self._current = self._current, None
        if current is not None and not current.calls and not current.deferred:
            self._open.remove(current)

    def _pass_of_call(self) -> _ForwardPass | None:
        """The pass a hooked call belongs to: the model call running, or in backward (a
        recomputation by gradient checkpointing) the one pass awaiting its gradients."""
        if self._current is not None:
            return self._current
        if _in_backward() and len(self._open) == 1:
            return self._open[0]
        return None

    def _expand_shared_indices(self, module, args):
        """Indices with batch size one, in a pass of a larger batch, expanded to that batch
        (module docstring: shared position ids)."""
        if (self._folding or not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor)
                or self._batch_second):
            return None
        forward_pass = self._pass_of_call()
        indices = args[0]
        if forward_pass is None or forward_pass.batch_size is None or forward_pass.batch_size == 1:
            return None
        if indices.dim() < 2 or indices.shape[0] != 1:
            return None
        return (indices.expand(forward_pass.batch_size, *indices.shape[1:]), *args[1:])

    def _lend_parameters(self, layer: HookedLayer, module, args, kwargs):
        _refuse_if_compiling()  # a compiled submodule: the root's check ran eagerly
        lent = []
        if (
            self._skip_autograd_weights and not self._folding and torch.is_grad_enabled()
            and _any_requires_grad(args, kwargs)
        ):
            for local in layer.local_names:  # the module's parameters now (FSDP2 swaps in unsharded ones)
                param = module.get_parameter(local)
                if param.requires_grad:
                    param.requires_grad_(False)
                    lent.append(param)
        self._lent.append(lent)

    def _return_parameters(self, module, args, output):
        if self._lent:
            for param in self._lent.pop():
                param.requires_grad_(True)

    def _record_call(self, layer: HookedLayer, module, args, kwargs, output):
        if self._folding:
            return  # the fallback's per-example replay runs layers again: not a new call
        if not torch.is_grad_enabled():
            if self._current is not None and self._current.grad_enabled:
                # A no_grad region inside a model call that records gradients: reentrant
                # checkpointing, which runs this call again in backward (module docstring).
                self._current.deferred += 1
            return
        forward_pass = self._current
        if forward_pass is None:
            forward_pass = self._recomputed_pass(layer)
            if forward_pass is None:
                return  # non-reentrant checkpointing: gradients flow through the recorded forward
            forward_pass.deferred -= 1
        leaves = _leaves(output)
        needing = [
            index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        if not needing:
            return
        self._precisions.add(module.get_parameter(layer.local_names[0]).dtype)  # as computed (FSDP2 may cast)
        self._precisions.update(dtype for _, dtype in autocast_state())
        # batch_second: a Linear's (T, B, ...) input or an Embedding's (T, B) indices are read batch first;
        # a 2-D Linear input (B, d) or 1-D indices carry the batch first already.
        moved = (id(layer) in self._batch_second and bool(args) and isinstance(args[0], torch.Tensor)
                 and args[0].dim() >= (2 if isinstance(layer.rule, EmbeddingRule) else 3))
        if moved:
            args = tuple(_batch_first(value) for value in args)
            stored = layer.rule.store(module, args, kwargs, layer.local_names, optree.tree_map(_batch_first, output))
        else:
            stored = layer.rule.store(module, args, kwargs, layer.local_names, output)
        call = LayerCall(layer, stored, [None] * len(leaves), batch_moved=moved)
        forward_pass.calls.append(call)
        forward_pass.pending += len(needing)
        if len(needing) > 1:
            # One output may be computed from another inside the layer (LSTMCell's h from its c):
            # a hook on that output would see the gradient that flows back through the layer's own
            # use of it as well, and the replay, which differentiates every output, would count it
            # twice. The caller gets aliases instead, so each hook sees only the gradient from
            # outside the layer (the cotangent the replay needs).
            leaves = [leaf.view_as(leaf) if index in needing else leaf for index, leaf in enumerate(leaves)]
            output = optree.tree_unflatten(optree.tree_structure(output), leaves)
        for index in needing:
            leaves[index].register_hook(partial(self._receive_grad, forward_pass, call, index))
        return output if len(needing) > 1 else None

    def _receive_grad(self, forward_pass: _ForwardPass, call: LayerCall, index: int, grad: torch.Tensor):
        if forward_pass not in self._open:
            raise ClipperUsageError(
                f"a second backward pass reached the layer at {describe(call.layer.path)} through a forward "
                f"pass that was already clipped (or reset); run the model again for each backward pass"
            )
        call.grads[index] = _batch_first(grad.detach()) if call.batch_moved else grad.detach()
        forward_pass.pending -= 1
        if forward_pass.complete and forward_pass is not self._current:
            self._open.remove(forward_pass)
            self._fold(forward_pass)

    def _recomputed_pass(self, layer: HookedLayer) -> _ForwardPass | None:
        """For a hooked call outside any call of the model: the pass whose reentrant checkpoint
        is being recomputed, or None for a non-reentrant recomputation; raises otherwise."""
        if not _in_backward():
            raise ClipperUsageError(
                f"the layer at {describe(layer.path)} ran outside a call of the model the clipper was built on; "
                f"call that model (or build the clipper on the module you call)"
            )
        waiting = [forward_pass for forward_pass in self._open if forward_pass.deferred > 0]
        if not waiting:
            return None
        if len(waiting) > 1:
            raise ClipperUsageError(
                f"gradient checkpointing with use_reentrant=True recomputed the layer at {describe(layer.path)} "
                f"in backward while {len(waiting)} forward passes await their gradients, and the clipper cannot "
                f"tell which one the call belongs to. Run backward after each forward pass, or checkpoint "
                f"with use_reentrant=False (transformers: model.gradient_checkpointing_enable("
                f"gradient_checkpointing_kwargs={{'use_reentrant': False}}), its default)"
            )
        return waiting[0]

    def _guard_batch_norm(self, path, module, args):
        if module.training:
            raise UnsupportedModuleError(
                f"the {type(module).__name__} at {describe(path)} was put in training mode after the clipper "
                f"was built; in training mode it mixes examples. Replace it with nn.GroupNorm"
            )

    # Folding -------------------------------------------------------------------------------

    def _keep_gradients(self, calls: list[LayerCall]) -> None:
        """Form and keep the pass's per-example gradients (``keep_per_example_grads``), before the
        clipping passes release what the calls stored."""
        formed: dict[str, torch.Tensor] = {}
        for call in calls:
            if not call.received:
                continue
            layer = call.layer
            grads = layer.rule.per_example_grads(layer.module, call.stored, call.grads, list(layer.local_names),
                                                 sum_dtype(layer.parameters[0].dtype))
            scale = call.batch_size if self.loss_reduction == "mean" else 1  # the mean's 1/B taken out
            for local, name in zip(layer.local_names, layer.global_names):
                part = grads[local] * scale
                formed[name] = part if name not in formed else formed[name] + part  # a shared parameter's uses
        for name, grads in formed.items():
            self._kept.setdefault(name, []).append(grads)

    def _close_passes(self, only_received: bool) -> None:
        """Clip the open passes that got gradients; with ``only_received=False`` drop the others."""
        keep = []
        for forward_pass in self._open:
            if forward_pass is self._current:
                keep.append(forward_pass)
            elif any(call.received for call in forward_pass.calls):
                self._fold(forward_pass)
            elif only_received:
                keep.append(forward_pass)
        self._open = keep

    def _fold(self, forward_pass: _ForwardPass) -> None:
        calls, forward_pass.calls = forward_pass.calls, []
        self._folding = True
        try:
            with contextlib.ExitStack() as full_precision:
                # A backward run inside autocast must not lower the norms' and sums' precision.
                for device, _ in autocast_state():
                    full_precision.enter_context(torch.autocast(device, enabled=False))
                if self._keep_per_example:
                    self._keep_gradients(calls)
                clipped: ClippedPass = clip_forward_pass(
                    calls,
                    rule=self.rule,
                    mean=self.loss_reduction == "mean",
                    shared=self._plan.shared,
                    batch_size=forward_pass.batch_size,
                    unclipped=self._tracking_unclipped,
                    units=forward_pass.units,
                    regroup=self._regroup_units,
                    placeholder=forward_pass.placeholder,
                    nonfinite=self._nonfinite,
                )
        finally:
            self._folding = False
            # The gradient hooks on the pass's outputs hold its calls for as long as the caller
            # keeps the graph (a loop that keeps ``loss``): without this, every activation and
            # output gradient the pass stored would stay alive into the next forward.
            for call in calls:
                release(call)
        for name, part in clipped.sums.items():
            previous = self._sums.get(name)
            self._sums[name] = part if previous is None else previous + part
        if clipped.unclipped is None:
            self._unclipped = None  # a pass without them: the comparison is impossible this batch
        elif self._unclipped is not None:
            for name, part in clipped.unclipped.items():
                previous = self._unclipped.get(name)
                self._unclipped[name] = part if previous is None else previous + part
        self._examples += clipped.examples
        if forward_pass.units is not None:
            self._units += clipped.units
            self._unit_rows += clipped.examples
        self._clipped_examples += clipped.clipped_examples
        self._passes += 1
