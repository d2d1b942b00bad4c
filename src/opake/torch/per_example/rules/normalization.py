"""nn.LayerNorm and nn.GroupNorm: per-example gradients are as small as the parameters.

Both normalize each example on its own, so example i's weight gradient is the sum of
``G_i * xhat_i`` over the positions that share a weight element (xhat recomputed from the stored
input, as the layer's forward computes it) and its bias gradient the sum of ``G_i``. These are
B x (normalized_shape) or B x channels: small enough to materialize, so there is no ghost path.
"""

from __future__ import annotations

import torch

from opake.torch.per_example.rules.base import LayerRule


class LayerNormRule(LayerRule):
    def per_example_grads(self, module, stored, grads, names, dtype):
        inputs = stored.to(dtype)
        grad = grads[0].to(dtype)
        normalized = tuple(range(inputs.dim() - len(module.normalized_shape), inputs.dim()))
        leading = tuple(range(1, inputs.dim() - len(module.normalized_shape)))
        result = {}
        if "weight" in names:
            mean = inputs.mean(dim=normalized, keepdim=True)
            variance = inputs.var(dim=normalized, unbiased=False, keepdim=True)
            xhat = (inputs - mean) * torch.rsqrt(variance + module.eps)
            product = grad * xhat
            result["weight"] = product.sum(dim=leading) if leading else product
        if "bias" in names:
            result["bias"] = grad.sum(dim=leading) if leading else grad
        return result


class GroupNormRule(LayerRule):
    def per_example_grads(self, module, stored, grads, names, dtype):
        inputs = stored.to(dtype)
        grad = grads[0].to(dtype)
        batch, channels = inputs.shape[:2]
        result = {}
        if "weight" in names:
            grouped = inputs.reshape(batch, module.num_groups, -1)
            mean = grouped.mean(dim=2, keepdim=True)
            variance = grouped.var(dim=2, unbiased=False, keepdim=True)
            xhat = ((grouped - mean) * torch.rsqrt(variance + module.eps)).reshape(inputs.shape)
            result["weight"] = (grad * xhat).reshape(batch, channels, -1).sum(dim=2)
        if "bias" in names:
            result["bias"] = grad.reshape(batch, channels, -1).sum(dim=2)
        return result


LAYER_NORM = LayerNormRule()
GROUP_NORM = GroupNormRule()
