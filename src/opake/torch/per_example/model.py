"""Which layers of a model get hooks, with which rule, and which models are refused.

Built once when the clipper is constructed. Every trainable parameter is covered by exactly one
hooked layer per owner: the layer that holds it directly (``named_parameters(recurse=False)``),
or a fused layer above it (nn.MultiheadAttention). Frozen parameters are not covered; a layer
whose parameters are all frozen gets no hook. A parameter held by two layers (tied input and
output embeddings) is listed in ``shared``: its per-example gradient is the sum of both layers'
contributions, so its norm cannot come from either layer's ghost norm alone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import UninitializedParameter

from opake.torch.per_example.errors import FallbackWarning, UnsupportedModuleError
from opake.torch.per_example.rules import FUSED_TYPES, LayerRule, rule_for
from opake.torch.per_example.rules import functional


def describe(path: str) -> str:
    """A layer path as error messages name it."""
    return repr(path) if path else "the top level of the model"


@dataclass(frozen=True, eq=False)
class HookedLayer:
    """One layer the clipper hooks: its rule and the trainable parameters it covers."""

    path: str
    module: nn.Module
    rule: LayerRule
    local_names: tuple[str, ...]  # names inside the layer ("weight", "out_proj.bias")
    global_names: tuple[str, ...]  # the model's named_parameters() names, same order
    parameters: tuple = ()  # the Parameters themselves, same order (module.to() keeps the objects)


@dataclass(frozen=True, eq=False)
class ModelPlan:
    layers: tuple[HookedLayer, ...]
    trainable: dict  # model-wide name -> Parameter, in named_parameters() order
    shared: frozenset  # model-wide names of parameters held by more than one hooked layer
    inference_batch_norms: tuple  # (path, module): eval-mode, frozen; guarded at every forward


def _check_batch_norm(path: str, module: _BatchNorm) -> bool:
    """Refuse a BatchNorm that mixes examples; True for one that is a fixed affine map now."""
    trainable = any(param.requires_grad for param in module.parameters(recurse=False))
    if module.training or trainable or not module.track_running_stats:
        state = "in training mode" if module.training else "with trainable affine parameters"
        if not module.track_running_stats:
            state = "without running statistics"
        raise UnsupportedModuleError(
            f"the {type(module).__name__} at {describe(path)} ({state}) normalizes with statistics of the "
            f"whole batch, so each example's gradient depends on the other examples and cannot be clipped "
            f"per example. Replace it with nn.GroupNorm (opake.torch will offer fix_model(model) to do it)"
        )
    return True


def plan_model(model: nn.Module) -> ModelPlan:
    """The hooks to register on ``model``, after refusing layers that cannot be clipped per example."""
    for name, param in model.named_parameters():
        if isinstance(param, UninitializedParameter):
            raise UnsupportedModuleError(
                f"parameter {name!r} is not initialized yet (a lazy module); run one forward pass "
                f"before building the clipper"
            )
    canonical = {}
    trainable = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            canonical[id(param)] = name
            trainable[name] = param

    layers = []
    inference_batch_norms = []
    fused_prefixes: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix) for prefix in fused_prefixes):
            continue
        if isinstance(module, _BatchNorm):
            _check_batch_norm(path, module)
            inference_batch_norms.append((path, module))
            continue
        fused = isinstance(module, FUSED_TYPES)
        if fused:
            fused_prefixes.append(f"{path}." if path else "")
        owned = module.named_parameters(recurse=fused)
        local = [(name, param) for name, param in owned if param.requires_grad]
        if not local:
            continue
        rule = functional.RULE if fused else rule_for(module)
        rule.check(module, path)
        layers.append(
            HookedLayer(
                path=path,
                module=module,
                rule=rule,
                local_names=tuple(name for name, _ in local),
                global_names=tuple(canonical[id(param)] for _, param in local),
                parameters=tuple(param for _, param in local),
            )
        )

    owners: dict[str, int] = {}
    for layer in layers:
        for name in layer.global_names:
            owners[name] = owners.get(name, 0) + 1
    shared = frozenset(name for name, count in owners.items() if count > 1)
    _warn_about_fallbacks([layer for layer in layers if layer.rule is functional.RULE])
    return ModelPlan(tuple(layers), trainable, shared, tuple(inference_batch_norms))


def _warn_about_fallbacks(layers: list[HookedLayer]) -> None:
    """One warning naming the layers that take the torch.func fallback, and what it costs."""
    if not layers:
        return
    shown = ", ".join(f"{type(layer.module).__name__} at {describe(layer.path)}" for layer in layers[:4])
    more = f" and {len(layers) - 4} more" if len(layers) > 4 else ""
    types = sorted({f"{type(layer.module).__module__}.{type(layer.module).__qualname__}" for layer in layers})
    warnings.warn(
        f"{len(layers)} layer(s) have no closed-form per-example rule and take the torch.func fallback: "
        f"{shown}{more}. In every backward pass each is replayed per example (one more forward and "
        f"backward of the layer, vmapped over the batch) and holds batch size x its trainable parameter "
        f"count of per-example gradients, where a rule needs about the layer's activations. A subclass "
        f"of a supported layer (a PEFT or quantized wrapper) lands here too, since its forward may differ. "
        f"Register a rule for {', '.join(types)} with opake.torch.per_example.register_rule to avoid this.",
        FallbackWarning,
        stacklevel=4,
    )
