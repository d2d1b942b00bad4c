"""nn.Linear and transformers' Conv1D: ghost norms from Gram matrices, or per-example gradients.

For one example with input rows ``A_i`` (T x in) and output-gradient rows ``G_i`` (T x out)
(T = 1 for a (B, in) input), the weight gradient is ``G_i^T A_i`` and the bias gradient
``sum_t G_i[t]``. Its squared norm is

    ||G_i^T A_i||^2 = sum_{t,s} (A_i A_i^T)[t,s] * (G_i G_i^T)[t,s]

which costs T^2 (in + out) multiply-adds per example and two T x T temporaries, against
T * in * out and an in x out temporary for forming the gradient. Both passes count: the ghost
route pays the Gram matrices in the norm pass and then one matmul over all B * T rows for the
sum, ``(c * G)^T A`` (as many multiply-adds as forming the B gradients); the direct route forms
the B per-example gradients once (``torch.bmm``), and its norms and its sum (one matrix-vector
product) are two passes over them. So per example, over both passes,

    ghost  = T^2 (in + out) + T * in * out
    direct = T * in * out + KEPT_COST * in * out

where ``KEPT_COST`` (16, rules/base.py) prices each element of a kept gradient in multiply-adds:
it is written by a batched matmul whose inner dimension is only T and read twice by
memory-bound passes. The routes (``_weight_route``, ``_keeps_weight``):

- T = 1: the squared norm is ``||A_i||^2 ||G_i||^2``, nothing formed.
- kept, when T^2 (in + out) >= KEPT_COST * in * out (many positions: GPT-2's 128 to 512 wide
  projections at T = 64, 2.1M against 1.0M per example for ``c_fc``): the weight's B
  per-example gradients are offered to the book-keeping to keep for the sum pass
  (``materialized``), which grants them while its memory budget lasts.
- otherwise, and where the budget did not grant them, the norms alone take the cheaper of ghost
  (the Gram matrices, a chunk of examples at a time), when T (in + out) < in * out, and direct
  (the per-example gradients a chunk of examples at a time, for the norms only); the sum is then
  one matmul over all rows.

The bias's per-example gradients (B x out) are always offered: formed once, they serve both
passes. A weight not kept has its clipped sum as one matmul over all B * T rows, the narrower
of A and G scaled by the weights, computed directly in the parameter's layout (``G^T A`` for a
Linear, ``A^T G`` for a Conv1D: no transposed copy).

Under autocast the stored input is the low-precision copy the layer multiplied (rules/base.py).

``transformers.pytorch_utils.Conv1D`` (GPT-2's projections) computes ``x @ W + b`` with its weight
stored as (in, out): the transpose of a Linear's. Its per-example gradients are the Linear's
transposed, and their norms are the same, so it is the Linear rule with the weight's results
transposed (``Conv1DRule``), registered by its qualified name so that opake never imports
transformers.
"""

from __future__ import annotations

import torch

from opake.torch.per_example.errors import UnsupportedModuleError
from opake.torch.per_example.rules.base import (
    KEPT_COST, LayerRule, autocast_input, example_chunks, squared_frobenius,
)


def _rows(tensor: torch.Tensor, dtype) -> torch.Tensor:
    """(B, ..., f) as (B, T, f) in ``dtype``."""
    return tensor.reshape(tensor.shape[0], -1, tensor.shape[-1]).to(dtype)


def _shape(stored: torch.Tensor, grad: torch.Tensor) -> tuple[int, int, int]:
    """(T, in, out) of a call: positions per example and the weight's widths."""
    width_in, width_out = stored.shape[-1], grad.shape[-1]
    length = stored[0].numel() // width_in if stored.shape[0] else 1
    return length, width_in, width_out


def _weight_route(stored: torch.Tensor, grad: torch.Tensor) -> str:
    """"outer", "ghost" or "direct": the cheaper route to the weight's norms alone (module docstring)."""
    length, width_in, width_out = _shape(stored, grad)
    if length == 1:
        return "outer"
    return "ghost" if length * (width_in + width_out) < width_in * width_out else "direct"


def _keeps_weight(stored: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the weight's per-example gradients, kept for both passes, cost less than its
    ghost norms and ghost sum (module docstring)."""
    length, width_in, width_out = _shape(stored, grad)
    return length > 1 and length * length * (width_in + width_out) >= KEPT_COST * width_in * width_out


class LinearRule(LayerRule):
    ghost = True
    regroup_positions = True  # G^T A sums over positions: a unit's rows regroup as one example (per_example/units.py)

    def store(self, module, args, kwargs, names, output):
        if args[0].dim() < 2:
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input of shape {tuple(args[0].shape)}; per-example clipping "
                f"needs the batch on dimension 0, so pass a (batch, in_features) or (batch, ..., in_features) input"
            )
        # The input is needed only for the weight; a trainable bias alone needs nothing stored.
        return autocast_input(args[0].detach()) if "weight" in names else None

    def materialized(self, module, stored, grads, names):
        offered = [name for name in names if name == "bias"]
        if "weight" in names and _keeps_weight(stored, grads[0]):
            offered.append("weight")
        return tuple(offered)

    def squared_norms(self, module, stored, grads, names, dtype):
        rows_g = _rows(grads[0], dtype)
        result = {}
        if "bias" in names:
            result["bias"] = rows_g.sum(dim=1).pow(2).sum(dim=1)
        if "weight" in names:
            rows_a = _rows(stored, dtype)
            batch, _, width_in = rows_a.shape
            width_out = rows_g.shape[2]
            route = _weight_route(stored, grads[0])
            if route == "outer":
                result["weight"] = rows_a[:, 0].pow(2).sum(1) * rows_g[:, 0].pow(2).sum(1)
            elif route == "ghost":
                length = rows_a.shape[1]
                parts = []
                for chunk in example_chunks(batch, 2 * length * length):
                    gram_a = torch.bmm(rows_a[chunk], rows_a[chunk].transpose(1, 2))
                    gram_g = torch.bmm(rows_g[chunk], rows_g[chunk].transpose(1, 2))
                    parts.append((gram_a * gram_g).sum(dim=(1, 2)))
                result["weight"] = torch.cat(parts) if parts else rows_a.new_zeros(0)
            else:
                parts = [
                    squared_frobenius(torch.bmm(rows_g[chunk].transpose(1, 2), rows_a[chunk]))
                    for chunk in example_chunks(batch, width_in * width_out)
                ]
                result["weight"] = torch.cat(parts) if parts else rows_a.new_zeros(0)
        return result

    def clipped_sums(self, module, stored, grads, names, weights, dtype):
        rows_g = _rows(grads[0], dtype)
        result = {}
        if "bias" in names:
            result["bias"] = rows_g.sum(dim=1).t() @ weights
        if "weight" in names:
            rows_a = _rows(stored, dtype)
            # (c * G)^T A = G^T (c * A): scale the narrower one (an output head's G is 16x wider).
            if rows_a.shape[2] < rows_g.shape[2]:
                rows_a = rows_a * weights[:, None, None]
            else:
                rows_g = rows_g * weights[:, None, None]
            flat_a, flat_g = rows_a.reshape(-1, rows_a.shape[2]), rows_g.reshape(-1, rows_g.shape[2])
            result["weight"] = self._weight_sum(flat_a, flat_g)
        return result

    @staticmethod
    def _weight_sum(flat_a: torch.Tensor, flat_g: torch.Tensor) -> torch.Tensor:
        """The (out, in) weight gradient ``G^T A`` summed over all rows."""
        return flat_g.t() @ flat_a

    def per_example_grads(self, module, stored, grads, names, dtype):
        rows_g = _rows(grads[0], dtype)
        result = {}
        if "bias" in names:
            result["bias"] = rows_g.sum(dim=1)
        if "weight" in names:
            result["weight"] = self._weight_grads(_rows(stored, dtype), rows_g)
        return result

    @staticmethod
    def _weight_grads(rows_a: torch.Tensor, rows_g: torch.Tensor) -> torch.Tensor:
        """(B, out, in) per-example weight gradients ``G_i^T A_i``.

        When ``in`` is at most 16 and a quarter of ``out`` (LoRA's B matrix: in = the rank) they
        are formed as ``A_i^T G_i`` (B, in, out) and returned as its transposed view: a batched
        product with rows that narrow runs 1.5-3x slower on one CPU thread (16 examples of 64
        positions, rank 8, out 384: 169 against 71 us); from in = 32 on it is a wash or worse.
        Norms and sums read the view in storage order (``storage_order``).
        """
        if rows_a.shape[2] <= 16 and 4 * rows_a.shape[2] <= rows_g.shape[2]:
            return torch.bmm(rows_a.transpose(1, 2), rows_g).transpose(1, 2)
        return torch.bmm(rows_g.transpose(1, 2), rows_a)


class Conv1DRule(LinearRule):
    """transformers' Conv1D: ``x @ W + b`` with W of shape (in, out), the Linear rule transposed."""

    @staticmethod
    def _weight_sum(flat_a: torch.Tensor, flat_g: torch.Tensor) -> torch.Tensor:
        """The (in, out) weight gradient ``A^T G`` summed over all rows, in the weight's layout."""
        return flat_a.t() @ flat_g

    @staticmethod
    def _weight_grads(rows_a: torch.Tensor, rows_g: torch.Tensor) -> torch.Tensor:
        """(B, in, out) per-example weight gradients ``A_i^T G_i``, contiguous in the weight's layout."""
        return torch.bmm(rows_a.transpose(1, 2), rows_g)


RULE = LinearRule()
CONV1D = Conv1DRule()
