"""nn.Linear and transformers' Conv1D: ghost norms from Gram matrices, or per-example gradients.

For one example with input rows ``A_i`` (T x in) and output-gradient rows ``G_i`` (T x out)
(T = 1 for a (B, in) input), the weight gradient is ``G_i^T A_i`` and the bias gradient
``sum_t G_i[t]``. Its squared norm is

    ||G_i^T A_i||^2 = sum_{t,s} (A_i A_i^T)[t,s] * (G_i G_i^T)[t,s]

which costs T^2 (in + out) multiply-adds per example and two T x T temporaries, against
T * in * out and an in x out temporary for forming the gradient. The route is chosen per call
from those counts (``_weight_route``):

- T = 1: the squared norm is ``||A_i||^2 ||G_i||^2``, nothing formed.
- ghost, when T (in + out) < in * out (long rows, few positions: wide layers, short sequences):
  the Gram matrices, a chunk of examples at a time.
- direct, otherwise (GPT-2's 32-wide projections at T = 32: 4096 against 3072 multiply-adds per
  position): the B per-example gradients, offered to the book-keeping to keep for the sum pass
  (``materialized``), where the sum is then one matrix-vector product over them instead of a
  second matmul over all B * T rows; where the book-keeping's budget does not grant them, they
  are formed a chunk of examples at a time for the norms only.

The bias's per-example gradients (B x out) are always offered: formed once, they serve both
passes. A weight not kept has its clipped sum as one matmul, ``(c * G)^T A`` over all B * T
rows (or ``G^T (c * A)`` when A is the narrower).

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
from opake.torch.per_example.rules.base import LayerRule, autocast_input, example_chunks, squared_frobenius


def _rows(tensor: torch.Tensor, dtype) -> torch.Tensor:
    """(B, ..., f) as (B, T, f) in ``dtype``."""
    return tensor.reshape(tensor.shape[0], -1, tensor.shape[-1]).to(dtype)


def _weight_route(stored: torch.Tensor, grad: torch.Tensor) -> str:
    """"outer", "ghost" or "direct": the cheaper route to the weight's norms (module docstring)."""
    width_in, width_out = stored.shape[-1], grad.shape[-1]
    length = stored[0].numel() // width_in if stored.shape[0] else 1
    if length == 1:
        return "outer"
    return "ghost" if length * (width_in + width_out) < width_in * width_out else "direct"


class LinearRule(LayerRule):
    ghost = True

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
        if "weight" in names and _weight_route(stored, grads[0]) == "direct":
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
            # (c * G)^T A = G^T (c * A): scale the narrower one (an output head's G is 8x wider).
            if rows_a.shape[2] < rows_g.shape[2]:
                rows_a = rows_a * weights[:, None, None]
            else:
                rows_g = rows_g * weights[:, None, None]
            result["weight"] = rows_g.reshape(-1, rows_g.shape[2]).t() @ rows_a.reshape(-1, rows_a.shape[2])
        return result

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
        """(B, out, in) per-example weight gradients ``G_i^T A_i``."""
        return torch.bmm(rows_g.transpose(1, 2), rows_a)


class Conv1DRule(LinearRule):
    """transformers' Conv1D: ``x @ W + b`` with W of shape (in, out), the Linear rule transposed."""

    def clipped_sums(self, module, stored, grads, names, weights, dtype):
        result = super().clipped_sums(module, stored, grads, names, weights, dtype)
        if "weight" in result:
            result["weight"] = result["weight"].t().contiguous()
        return result

    @staticmethod
    def _weight_grads(rows_a: torch.Tensor, rows_g: torch.Tensor) -> torch.Tensor:
        """(B, in, out) per-example weight gradients ``A_i^T G_i``, contiguous in the weight's layout."""
        return torch.bmm(rows_a.transpose(1, 2), rows_g)


RULE = LinearRule()
CONV1D = Conv1DRule()
