"""nn.LayerNorm, nn.GroupNorm and RMSNorm: per-example gradients are as small as the parameters.

All normalize each example on its own, so example i's weight gradient is the sum of
``G_i * xhat_i`` over the positions that share a weight element (xhat recomputed from the stored
input by the layer's own fused kernel without its affine part, 8x faster than a mean and a
variance in separate passes) and its bias gradient the sum of ``G_i``. These are
B x (normalized_shape) or B x channels: small enough to materialize, so there is no ghost path.

LayerNorm's xhat comes cheaper still from the statistics autograd saved for the layer's own
backward (``NativeLayerNormBackward0``'s mean and 1/std, read from the output's ``grad_fn``, no
copy): ``(x - mean) * rstd``, two elementwise passes against the kernel's full recomputation
(88 us against 14 us for a 32 x 32 x 32 input on one CPU thread). It is not read where saved
tensors are packed by hooks (gradient checkpointing, offloading: reading would unpack them in the
forward), nor from an output autograd did not make with that kernel; there xhat is recomputed.

RMSNorm (Zhang and Sennrich 2019) is ``weight * xhat`` with ``xhat = x / sqrt(mean(x^2) + eps)``
over the normalized dimensions, no mean subtracted and no bias. ``xhat`` is recomputed exactly as
the layer's forward computes it, in the same dtypes, so that the per-example gradients equal
autograd's up to the final rounding: ``torch.nn.RMSNorm`` through ``F.rms_norm`` without a
weight; the Hugging Face classes of the Llama family (Llama, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE, Phi-3, whose forwards are the same lines: the input upcast to float32, normalized over
the last dimension with ``variance_epsilon``, cast back to the input dtype, then multiplied by
the weight) by those steps. Classes whose forward differs (Gemma's ``(1 + weight)``, T5's, OLMo-2's
cast after the product) are not registered and take the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opake.torch.per_example.rules.base import LayerRule


def _saved_statistics(output) -> tuple | None:
    """(mean, rstd) that autograd saved for the LayerNorm that made ``output``, where readable."""
    function = getattr(output, "grad_fn", None)
    if type(function).__name__ != "NativeLayerNormBackward0":
        return None
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_hooks is None or top_hooks(True) is not None:
        return None  # saved tensors are packed by hooks (checkpointing): unpacking would recompute
    return function._saved_result1.detach(), function._saved_result2.detach()


class LayerNormRule(LayerRule):
    def store(self, module, args, kwargs, names, output):
        statistics = _saved_statistics(output) if "weight" in names else None
        return args[0].detach(), statistics

    def per_example_grads(self, module, stored, grads, names, dtype):
        inputs, statistics = stored
        inputs = inputs.to(dtype)
        grad = grads[0].to(dtype)
        leading = tuple(range(1, inputs.dim() - len(module.normalized_shape)))
        result = {}
        if "weight" in names:
            if statistics is None:
                xhat = F.layer_norm(inputs, module.normalized_shape, None, None, module.eps)
            else:
                mean, rstd = statistics
                xhat = (inputs - mean.to(dtype)) * rstd.to(dtype)
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


class RMSNormRule(LayerRule):
    """``weight * xhat`` over trailing ``normalized_shape`` dimensions (module docstring)."""

    def normalized(self, module, inputs):
        """What the forward multiplies by the weight, from the stored input, in its dtype."""
        return F.rms_norm(inputs, module.normalized_shape, None, module.eps)

    def per_example_grads(self, module, stored, grads, names, dtype):
        xhat = self.normalized(module, stored).to(dtype)
        product = grads[0].to(dtype) * xhat
        trailing = module.get_parameter("weight").dim()
        leading = tuple(range(1, product.dim() - trailing))
        return {"weight": product.sum(dim=leading) if leading else product}


class LlamaRMSNormRule(RMSNormRule):
    """The Llama family's ``LlamaRMSNorm.forward``, step by step (module docstring)."""

    def normalized(self, module, inputs):
        upcast = inputs.to(torch.float32)
        variance = upcast.pow(2).mean(-1, keepdim=True)
        return (upcast * torch.rsqrt(variance + module.variance_epsilon)).to(inputs.dtype)


LAYER_NORM = LayerNormRule()
GROUP_NORM = GroupNormRule()
RMS_NORM = RMSNormRule()
LLAMA_RMS_NORM = LlamaRMSNormRule()

# Hugging Face classes whose forward is LlamaRMSNorm's, line for line (read in transformers 5.24;
# tests/torch/per_example/test_hf_models.py compares each installed one with the oracle).
LLAMA_RMS_NORM_CLASSES = tuple(
    f"transformers.models.{family}.modeling_{family}.{name}RMSNorm"
    for family, name in (
        ("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"),
        ("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3Moe"), ("phi3", "Phi3"),
    )
)
