"""nn.Linear: ghost norms from Gram matrices, or per-example gradients a chunk at a time.

For one example with input rows ``A_i`` (T x in) and output-gradient rows ``G_i`` (T x out)
(T = 1 for a (B, in) input), the weight gradient is ``G_i^T A_i`` and the bias gradient
``sum_t G_i[t]``. Its squared norm is

    ||G_i^T A_i||^2 = sum_{t,s} (A_i A_i^T)[t,s] * (G_i G_i^T)[t,s]

which costs T^2 (in + out) per example instead of T * in * out, and needs only two T x T
temporaries. When T^2 >= in * out the gradient itself is smaller than the Gram matrices, so it is
formed for a chunk of examples at a time and reduced at once. The clipped sum is one matmul,
``(c * G)^T A`` over all B * T rows (or ``G^T (c * A)`` when A is the narrower).
"""

from __future__ import annotations

import torch

from opake.torch.per_example.errors import UnsupportedModuleError
from opake.torch.per_example.rules.base import LayerRule, example_chunks, squared_frobenius


def _rows(tensor: torch.Tensor, dtype) -> torch.Tensor:
    """(B, ..., f) as (B, T, f) in ``dtype``."""
    return tensor.reshape(tensor.shape[0], -1, tensor.shape[-1]).to(dtype)


class LinearRule(LayerRule):
    ghost = True

    def store(self, module, args, kwargs, names):
        if args[0].dim() < 2:
            raise UnsupportedModuleError(
                f"nn.Linear got an input of shape {tuple(args[0].shape)}; per-example clipping needs "
                f"the batch on dimension 0, so pass a (batch, in_features) or (batch, ..., in_features) input"
            )
        # The input is needed only for the weight; a trainable bias alone needs nothing stored.
        return args[0].detach() if "weight" in names else None

    def squared_norms(self, module, stored, grads, names, dtype):
        rows_g = _rows(grads[0], dtype)
        result = {}
        if "bias" in names:
            result["bias"] = rows_g.sum(dim=1).pow(2).sum(dim=1)
        if "weight" in names:
            rows_a = _rows(stored, dtype)
            batch, length, width_in = rows_a.shape
            width_out = rows_g.shape[2]
            if length == 1:
                result["weight"] = rows_a[:, 0].pow(2).sum(1) * rows_g[:, 0].pow(2).sum(1)
            elif length * length < width_in * width_out:
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
            result["weight"] = torch.bmm(rows_g.transpose(1, 2), _rows(stored, dtype))
        return result


RULE = LinearRule()
