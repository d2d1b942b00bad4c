"""Per-layer gradient rules, one module per layer family, and the one registry that maps layers to them.

A rule is looked up by the layer's exact type: a subclass may override ``forward`` (a LoRA
Linear, a quantized one), and applying the parent's formula to it would give wrong per-example
gradients, so subclasses go to the torch.func fallback, which replays whatever forward they have,
unless they are registered themselves. Layers of packages opake does not depend on
(transformers' Conv1D and RMSNorm classes) are registered by qualified class name,
``"transformers.pytorch_utils.Conv1D"``, compared with ``type(layer).__module__ + "." +
type(layer).__qualname__``: still the exact type, and nothing here imports transformers.

``register_rule`` is the public way in (``opake.torch.per_example.register_rule``). The registry
is read when a clipper is built, so a rule registered later applies to clippers built after it.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.torch.per_example.rules import conv, embedding, functional, linear, normalization
from opake.torch.per_example.rules.base import LayerRule
from opake.torch.per_example.rules.functional import FUSED_TYPES

__all__ = ["FUSED_TYPES", "LayerRule", "layer_type", "qualified_name", "register_rule", "registered_rule", "rule_for"]

_BY_TYPE: dict[type, LayerRule] = {
    nn.Linear: linear.RULE,
    NonDynamicallyQuantizableLinear: linear.RULE,  # same forward as nn.Linear
    nn.Conv1d: conv.RULE,
    nn.Conv2d: conv.RULE,
    nn.Embedding: embedding.RULE,
    nn.LayerNorm: normalization.LAYER_NORM,
    nn.GroupNorm: normalization.GROUP_NORM,
    nn.RMSNorm: normalization.RMS_NORM,
}

_BY_NAME: dict[str, LayerRule] = {
    "transformers.pytorch_utils.Conv1D": linear.CONV1D,
    **{name: normalization.LLAMA_RMS_NORM for name in normalization.LLAMA_RMS_NORM_CLASSES},
}


def qualified_name(layer_type: type) -> str:
    """``"package.module.Class"``: how a layer type is named in the registry."""
    return f"{layer_type.__module__}.{layer_type.__qualname__}"


def _checked(layer_type):
    if isinstance(layer_type, str):
        if "." not in layer_type.strip(".") or layer_type != layer_type.strip():
            raise InvalidArgumentError(
                f"a layer type given by name must be its qualified name, 'package.module.Class' (as "
                f"type(layer).__module__ + '.' + type(layer).__qualname__), got {layer_type!r}"
            )
        return layer_type
    if isinstance(layer_type, type) and issubclass(layer_type, nn.Module):
        return layer_type
    raise InvalidTypeError(
        f"layer_type must be a torch.nn.Module subclass or its qualified name as a string, got {layer_type!r}"
    )


def register_rule(layer_type, rule: LayerRule | None = None, *, replace: bool = False):
    """Use ``rule`` for every layer whose type is exactly ``layer_type``.

    ``layer_type`` is the class, or its qualified name (``"mypackage.layers.ScaledLinear"``) for a
    class you would rather not import. ``rule`` is an instance of a ``LayerRule`` subclass
    (``opake.torch.per_example.rules.base`` documents the methods and their shapes). Without
    ``rule`` this returns a decorator for the rule's class (instantiated with no arguments) or
    instance::

        @register_rule(ScaledLinear)
        class ScaledLinearRule(LayerRule):
            def per_example_grads(self, module, stored, grads, names, dtype): ...

    A type that already has a rule (opake's own included) is refused unless ``replace=True``.
    Layers without a rule are replayed per example by the torch.func fallback: one more forward
    and backward of the layer, vmapped over the batch, and B x its parameter count of memory.
    """
    layer_type = _checked(layer_type)
    if rule is None:
        def decorate(rule_or_class):
            instance = rule_or_class() if isinstance(rule_or_class, type) else rule_or_class
            register_rule(layer_type, instance, replace=replace)
            return rule_or_class

        return decorate
    if not isinstance(rule, LayerRule):
        raise InvalidTypeError(
            f"rule must be an instance of a LayerRule subclass (opake.torch.per_example.LayerRule), "
            f"got {type(rule).__name__}"
        )
    existing = registered_rule(layer_type)
    if existing is not None and not replace:
        name = layer_type if isinstance(layer_type, str) else qualified_name(layer_type)
        raise InvalidArgumentError(
            f"{name} already has a rule ({type(existing).__name__}); pass replace=True to replace it"
        )
    if isinstance(layer_type, str):
        for known in [known for known in _BY_TYPE if qualified_name(known) == layer_type]:
            del _BY_TYPE[known]
        _BY_NAME[layer_type] = rule
    else:
        _BY_NAME.pop(qualified_name(layer_type), None)
        _BY_TYPE[layer_type] = rule
    return rule


def registered_rule(layer_type) -> LayerRule | None:
    """The rule registered for exactly this type (a class or its qualified name), or None."""
    layer_type = _checked(layer_type)
    if isinstance(layer_type, str):
        by_type = [rule for known, rule in _BY_TYPE.items() if qualified_name(known) == layer_type]
        return by_type[0] if by_type else _BY_NAME.get(layer_type)
    rule = _BY_TYPE.get(layer_type)
    return _BY_NAME.get(qualified_name(layer_type)) if rule is None else rule


def rule_for(module: nn.Module) -> LayerRule:
    """The rule for this layer's exact type, or the torch.func fallback."""
    rule = registered_rule(layer_type(module))
    return functional.RULE if rule is None else rule


def layer_type(module: nn.Module) -> type:
    """The layer's own class: ``fully_shard`` (FSDP2) swaps a module's class for a generated
    ``FSDP<Class>(FSDPModule, Class)``, whose forward is the class's own."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and bases[0].__module__.startswith("torch.distributed"):
        return bases[1]
    return cls
