"""Per-layer gradient rules, one module per layer family, registered once in ``RULES``.

A rule is looked up by the layer's exact type: a subclass may override ``forward`` (a LoRA
Linear, a quantized one), and applying the parent's formula to it would give wrong per-example
gradients, so subclasses go to the torch.func fallback, which replays whatever forward they have.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from opake.torch.per_example.rules import conv, embedding, functional, linear, normalization
from opake.torch.per_example.rules.base import LayerRule
from opake.torch.per_example.rules.functional import FUSED_TYPES

__all__ = ["FUSED_TYPES", "LayerRule", "RULES", "rule_for"]

RULES: dict[type, LayerRule] = {
    nn.Linear: linear.RULE,
    NonDynamicallyQuantizableLinear: linear.RULE,  # same forward as nn.Linear
    nn.Conv1d: conv.RULE,
    nn.Conv2d: conv.RULE,
    nn.Embedding: embedding.RULE,
    nn.LayerNorm: normalization.LAYER_NORM,
    nn.GroupNorm: normalization.GROUP_NORM,
}


def rule_for(module: nn.Module) -> LayerRule:
    """The rule for this layer's exact type, or the torch.func fallback."""
    return RULES.get(type(module), functional.RULE)
