"""What a per-layer rule is, and the shapes every rule agrees on.

A rule turns what one forward/backward call of a layer left behind (its stored input and the
gradients of its outputs) into per-example quantities for some of that layer's parameters.
Every rule is linear in the output gradients, which is what lets the clipper fold the
``loss_reduction="mean"`` rescaling and the clipping factors into plain weights per example.

Shapes: ``batch`` is the leading dimension of every stored input and every output gradient.
``names`` are the layer's own parameter names (``"weight"``, ``"out_proj.bias"``), never the
model-wide ones. ``dtype`` is the dtype the rule computes and returns in (float32 for
half-precision layers, float64 when the clipper recomputes after an overflow).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

# Temporaries (Gram matrices, per-example gradients of a chunk of examples) are kept below this
# many elements (64 MiB in float32), so a rule's working memory does not grow with the batch.
CHUNK_ELEMENTS = 2**24

# What one element of a per-example gradient kept for both passes costs, in multiply-adds of a
# large matrix product: it is written once (by a batched product with a short inner dimension,
# or a scatter into zeros) and read twice by memory-bound passes (its norm, then the weighted
# sum). Measured at about 16 on one CPU thread (tiny GPT-2 and Llama at T = 64, widths 128 to
# 2048); rules weigh their ghost route's extra multiply-adds against this (rules/linear.py).
KEPT_COST = 16


class LayerRule:
    """Per-example gradients of one layer family; one stateless instance per family.

    ``ghost`` rules compute squared norms and the weighted sum without holding per-example
    gradients (``squared_norms`` and ``clipped_sums``); every rule can materialize them
    (``per_example_grads``), which the clipper uses for shared parameters and for rules whose
    per-example gradients are small anyway.
    """

    ghost = False
    regroup_positions = False  # gradient a sum over positions: unit norms may regroup rows (per_example/units.py)

    def check(self, module: nn.Module, path: str) -> None:
        """Raise UnsupportedModuleError when this module's configuration mixes examples."""

    def store(self, module: nn.Module, args: tuple, kwargs: dict, names: tuple[str, ...], output):
        """What to keep from the forward call (detached), given its arguments and its output;
        by default the first input. Keep references to tensors autograd keeps anyway where
        possible: what is stored lives until the pass is clipped."""
        return args[0].detach()

    def materialized(self, module: nn.Module, stored, grads: list, names: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``names`` whose per-example gradients this ghost rule would rather have formed
        once and kept for both passes, where memory allows (the book-keeping then treats them as
        it treats shared parameters; see its module docstring for the budget)."""
        return ()

    def squared_norms(self, module, stored, grads, names, dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no ghost norms")

    def clipped_sums(self, module, stored, grads, names, weights, dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no ghost sums")

    def per_example_grads(self, module, stored, grads, names, dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def example_chunks(batch: int, elements_per_example: int, limit: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Slices of the batch whose temporaries hold at most ``limit`` elements (>= 1 example)."""
    step = max(1, limit // max(1, elements_per_example))
    for start in range(0, batch, step):
        yield slice(start, min(batch, start + step))


def storage_order(per_example: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A (B, ..., m, n) tensor as a contiguous one of the same elements per example: itself, or
    (for the transposed view a rule may return, ``LinearRule._weight_grads``) the transpose of its
    last two dimensions, with True. Norms and sums over examples then read it without a copy."""
    if per_example.dim() >= 3 and not per_example.is_contiguous():
        swapped = per_example.transpose(-1, -2)
        if swapped.is_contiguous():
            return swapped, True
    return per_example, False


def squared_frobenius(per_example: torch.Tensor) -> torch.Tensor:
    """(B,) sums of squares of a (B, ...) tensor (one fused pass: 3x faster than pow and sum)."""
    per_example, _ = storage_order(per_example)
    return torch.linalg.vector_norm(per_example.reshape(per_example.shape[0], -1), dim=1).square()


# Mixed precision. Under ``torch.autocast`` a Linear or a convolution multiplies copies of its
# input and weight in the autocast dtype (bfloat16, float16), and autograd's weight gradient is
# formed from those copies. A rule whose forward is such an op stores its input as autocast cast
# it (``autocast_input``), so that its per-example gradients are formed from the same operands
# as autograd's (in float32: the rounding left is that of autograd's own low-precision result).
# The fallback replays its layer under the autocast state of the forward (``autocast_state``).

_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The devices on which autocast is enabled now, each with its dtype."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


def autocast_input(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as autocast casts the input of a matrix multiplication or convolution now:
    float32/float16/bfloat16 to the autocast dtype of its device when autocast is enabled there
    (float64 is left alone, as autocast leaves it); unchanged otherwise."""
    device = tensor.device.type
    if (
        device in _AUTOCAST_DEVICES
        and tensor.is_floating_point()
        and tensor.dtype != torch.float64
        and torch.is_autocast_enabled(device)
    ):
        return tensor.to(torch.get_autocast_dtype(device))
    return tensor


def lowest_precision(dtypes) -> torch.dtype | None:
    """The floating dtype with the largest machine epsilon among ``dtypes`` (None if empty)."""
    floating = [dtype for dtype in dtypes if dtype is not None and dtype.is_floating_point]
    return max(floating, key=lambda dtype: torch.finfo(dtype).eps, default=None)
