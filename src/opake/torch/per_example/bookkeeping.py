"""The two passes that clip one forward pass's examples, once all its gradients are in.

Pass 1 (norms): every hooked call contributes, per parameter, the (B,) squared norms of its
per-example gradients: a ghost norm from the stored input and output gradient, or the squares of
a materialized per-example gradient for small layers, the torch.func fallback and shared
parameters (whose gradient is a sum over the layers holding them). A ghost rule may also ask
for some of its parameters to be materialized and kept (``LayerRule.materialized``: a
convolution's, whose sum is then a matrix-vector product instead of a second convolution
backward); that is granted in call order while the kept gradients total at most the elements
of the output gradients the hooks hold for the pass, so the pass's memory at most doubles (the
2-conv CNN of issue 13 keeps both layers: B x 13.2k against B x 18.8k). A layer all of whose
parameters are kept needs neither its stored input nor its output gradients after pass 1; they
are dropped as soon as its gradients are formed, and what that frees returns to the budget
(``_grant_kept``: tiny GPT-2 at T = 64 then keeps every projection and its tied table). A kept
gradient of one call is squared as soon as it is formed, while it may still be in cache. Norms are reduced in
float32 (float64 for float64 layers); a parameter whose squares overflow is recomputed in float64 from
the same stored tensors, and one that is still not finite raises.

Between the passes: ``norm_i = sqrt(sum over parameters) * s`` with ``s`` the batch size for
``loss_reduction="mean"`` (the backward of a mean hands every layer ``G_i / B``) and 1 for
``"sum"``; ``c_i = min(1, C / norm_i)`` in float64, exactly 1 at or below the bound (a zero
gradient is never divided by).

Pass 2 (sum): every rule is linear in the output gradient, so the clipped sum of a parameter is
its rule's contraction with weights ``c_i * s`` (for Linear, ``(c * G)^T A``); a materialized
per-example gradient is reduced with one matrix-vector product.

Per-layer clipping (a rule with ``per_parameter``, ``opake.dpftrl.clipping.PerLayerClipping``):
pass 1 is the same, and each parameter's (B,) norms get their own factors ``min(1, C_p / norm)``;
pass 2 contracts each parameter with its own weights. An example whose gradient is not finite is
refused, or with ``nonfinite="zero"`` given a weight of 0, its stored rows zeroed first.

Privacy units (``units=``, one unit number per row): the clipped quantity is each unit's summed
gradient. Pass 1 then gives, per parameter, the (U,) squared norms of the unit sums
(``units.py``: regrouped ghost norms, or materialized per-example gradients added per unit), the
factors are per unit (``s`` is still the pass's row count), each row's weight is its unit's
``c_u * s``, and pass 2 is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optree
import torch
from torch import nn

from opake.torch.per_example import units as unit_norms
from opake.torch.per_example.errors import BatchDimensionError, ClipperUsageError, NonFiniteGradientError
from opake.torch.per_example.model import HookedLayer, describe
from opake.torch.per_example.rules import tied
from opake.torch.per_example.rules.base import squared_frobenius, storage_order
from opake.torch.per_example.rules.embedding import EmbeddingRule


@dataclass(eq=False)
class LayerCall:
    """One forward call of a hooked layer: what its rule stored and its output gradients."""

    layer: HookedLayer
    stored: object
    grads: list = field(default_factory=list)  # per tensor leaf of the output; None until it arrives
    batch_moved: bool = False  # stored with the batch moved first (PerExampleClipper.batch_second)

    @property
    def received(self) -> bool:
        return any(grad is not None for grad in self.grads)

    @property
    def batch_size(self) -> int:
        return next(grad.shape[0] for grad in self.grads if grad is not None)


@dataclass(frozen=True)
class ClippedPass:
    sums: dict  # model-wide parameter name -> clipped sum over this pass's examples
    examples: int  # rows of the pass
    clipped_examples: int  # of the clipped quantities (rows, or units with ``units=``), those above the bound
    unclipped: dict | None = None  # the same contractions with factor 1: autograd's gradient
    units: int | None = None  # with ``units=``: the units of the pass


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and sums of half-precision layers are formed in float32 (see the package docstring)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _layer_dtype(layer: HookedLayer) -> torch.dtype:
    return sum_dtype(layer.parameters[0].dtype)


def _factor_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _common_batch_size(calls: list[LayerCall], expected: int | None) -> int:
    reference_path, batch = (None, expected) if expected is not None else (calls[0].layer.path, calls[0].batch_size)
    for call in calls:
        if call.batch_size != batch:
            source = "the model's input" if reference_path is None else f"the layer at {describe(reference_path)}"
            if call.batch_size == 1:
                raise BatchDimensionError(
                    f"the layer at {describe(call.layer.path)} was called on a batch of one that the model then "
                    f"broadcasts against the batch of {batch} of {source} (a tensor shared by all examples, such as "
                    f"positions of shape (1, T)); in backward its gradient is the sum over the examples, so no "
                    f"example has a gradient of its own. Expand that input to the batch before the layer "
                    f"(x.expand({batch}, *x.shape[1:])); an nn.Embedding's indices of batch size one are "
                    f"expanded automatically"
                )
            hint = ""
            if isinstance(call.layer.module, nn.Embedding):
                hint = (
                    "; indices shared by all examples (positions) should have a batch dimension of one, "
                    "shape (1, T), which the clipper expands to the batch"
                )
            raise BatchDimensionError(
                f"the layer at {describe(call.layer.path)} saw a leading dimension of {call.batch_size}, but "
                f"{source} has batch size {batch}; per-example clipping needs the batch on dimension 0 of "
                f"every layer's input and output (use batch_first=True layers, and do not fold the batch "
                f"into another dimension, e.g. (B, T, d) into (B*T, d), before a layer with parameters){hint}"
            )
    return batch


def _nonfinite(name: str, layer: HookedLayer, squares: torch.Tensor, batch: int,
               what: str = "example") -> NonFiniteGradientError:
    bad = torch.nonzero(~torch.isfinite(squares)).flatten().tolist()
    return NonFiniteGradientError(
        f"the per-{what} gradient of parameter {name!r} (layer at {describe(layer.path)}) is not finite "
        f"for {what} {bad[0]} of this backward pass's {batch} ({len(bad)} such {what}s). Find the cause "
        f"(learning rate, the loss on that input); this pass was dropped, call reset() to restart the batch"
    )


def _total(squared: dict[str, torch.Tensor], device, dtype) -> torch.Tensor:
    """(B,) sum over parameters of the squared norms, in ``dtype`` (one stack per input dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for squares in squared.values():
        groups.setdefault((squares.device, squares.dtype), []).append(squares)
    parts = [torch.stack(group).to(device=device, dtype=dtype).sum(dim=0) for group in groups.values()]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)


def _tied_squares(held: list[tuple[LayerCall, str]], dtype, own: torch.Tensor | None) -> torch.Tensor:
    """(B,) squared norms of a tied embedding's gradient: ``own`` (the two layers' own squared
    norms added, recomputed in ``dtype`` when None) plus twice the cross term (rules/tied.py),
    clamped at 0 against rounding where the two parts nearly cancel."""
    if own is None:
        own = sum(
            call.layer.rule.squared_norms(call.layer.module, call.stored, call.grads, [local], dtype)[local]
            for call, local in held
        )
    embedding, head = _tied_holders(held)
    cross = tied.cross_term(embedding.layer.module, embedding.stored, embedding.grads, head.stored, head.grads, dtype)
    return (own + 2 * cross).clamp_(min=0)


def clip_forward_pass(
    calls: list[LayerCall], *, rule, mean: bool, shared: frozenset, batch_size: int | None,
    unclipped: bool = False, units: torch.Tensor | None = None, regroup: bool = True, placeholder: bool = False,
    nonfinite: str = "raise",
) -> ClippedPass:
    """Clip each example of one forward pass by the clipping ``rule`` and sum, per parameter.

    ``rule`` is the clipping rule value (``opake.dpftrl.clipping.FlatClipping``,
    ``AutomaticClipping``), normalised once where the run was planned; its ``factors`` scale each
    example (or unit) by its norm.

    With ``unclipped=True`` the sums are also formed with every factor 1: what autograd put in
    ``.grad`` for this pass if every use of every parameter went through the hooked layers
    (``PerExampleClipper.check_coverage`` compares the two). With ``units`` ((B,) unit numbers,
    one per row) each unit's summed gradient is clipped instead (module docstring); ``regroup``
    uses regrouped ghost norms where a rule allows (``units.py``), otherwise every unit norm comes
    from materialized per-example gradients. With ``placeholder`` the pass's first row is a
    placeholder (a rank's empty part of a batch, run only so that every rank of a sharded model
    takes part in the collectives): its clipped weight is exactly 0 and it is not counted.
    ``nonfinite="zero"`` (per example, without units) gives an example whose gradient is not finite
    (even recomputed in float64) a weight of exactly 0, its stored rows zeroed so that no NaN reaches
    the sums, and counts it as clipped; ``"raise"`` (default) raises ``NonFiniteGradientError``.
    """
    calls = [call for call in calls if call.received]
    if not calls:
        return ClippedPass({}, 0, 0, {} if unclipped else None, None if units is None else 0)
    batch = _common_batch_size(calls, batch_size)
    if batch == 0:
        return ClippedPass({}, 0, 0, {} if unclipped else None, None if units is None else 0)
    device = next(grad for grad in calls[0].grads if grad is not None).device
    grouping = None
    if units is not None:
        if units.dim() != 1 or units.numel() != batch:
            raise ClipperUsageError(
                f"this forward pass has {batch} rows but {tuple(units.shape)} unit numbers were given for it; "
                f"give one unit number per row of the batch (expect_units)"
            )
        grouping = unit_norms.UnitGrouping(units, device)
    holders: dict[str, list[tuple[LayerCall, str]]] = {}
    for call in calls:
        for local, name in zip(call.layer.local_names, call.layer.global_names):
            holders.setdefault(name, []).append((call, local))
    # Tied input and output embeddings: ghost norms with a cross term (rules/tied.py).
    tied_names = {
        name for name, held in holders.items()
        if len(held) == 2 and held[0][0].layer is not held[1][0].layer
        and tied.is_tied_pair(held[0][0].layer.rule, held[0][1], held[1][0].layer.rule, held[1][1])
    }
    # Other shared parameters, and a layer called twice in one pass (a reused block), need the
    # sum of their calls' per-example gradients.
    dense_names = ({name for name, held in holders.items() if len(held) > 1} | set(shared)) - tied_names
    for call in calls:
        if not call.layer.rule.ghost:
            dense_names.update(call.layer.global_names)
    tied_kept, released = {}, set()
    if units is None:
        tied_kept, released = _grant_kept(calls, batch, dense_names, tied_names, holders)
        tied_names = tied_names - set(tied_kept)
    else:
        _grant_kept_by_name(calls, batch, dense_names, tied_names, _held_elements(calls))

    factor_dtype = _factor_dtype(device)
    if grouping is None:
        squared, per_example, ghost_owner = _example_squares(calls, dense_names, tied_names, holders, tied_kept,
                                                             released)
    else:
        squared, per_example = _unit_squares(calls, dense_names, tied_names, holders, grouping, regroup)
    total = _total(squared, device, factor_dtype)
    dropped = None  # nonfinite="zero": the examples whose gradient is not finite
    if not bool(torch.isfinite(total).all()):
        # One check for the whole pass; only here, parameter by parameter: squares that overflowed
        # float32 are recomputed in float64 from the same stored tensors, and what is still not
        # finite raises, naming the parameter.
        for name in list(squared):
            if bool(torch.isfinite(squared[name]).all()):
                continue
            owner = holders[name][0][0].layer
            if name in per_example:
                squares = squared_frobenius(per_example[name].to(torch.float64))
            elif grouping is not None:
                squares = _unit_squares(calls, dense_names, tied_names, holders, grouping, regroup,
                                        dtype=torch.float64, only=name)[0][name]
            elif name in tied_names:
                squares = _tied_squares(holders[name], torch.float64, None)
            else:
                call, local = ghost_owner[name]
                owner = call.layer
                squares = owner.rule.squared_norms(
                    owner.module, call.stored, call.grads, [local], torch.float64
                )[local]
            if not bool(torch.isfinite(squares).all()):
                if grouping is None and nonfinite == "zero":
                    bad = ~torch.isfinite(squares).to(device)
                    dropped = bad if dropped is None else dropped | bad
                    squares = torch.where(torch.isfinite(squares), squares, torch.zeros_like(squares))
                elif grouping is None:
                    raise _nonfinite(name, owner, squares, batch)
                else:
                    raise _nonfinite(name, owner, squares, grouping.count, what="unit")
            squared[name] = squares
        if dropped is not None:
            _zero_rows(calls, per_example, dropped, batch)
            squared = {name: torch.where(dropped.to(squares.device), torch.zeros_like(squares), squares)
                       for name, squares in squared.items()}
        total = _total(squared, device, factor_dtype)

    # For a mean, every stored output gradient carries the pass's 1/B (B its rows, units or not).
    scale = float(batch) if mean else 1.0
    if getattr(rule, "per_parameter", False):  # per-layer clipping: each parameter by its own norm
        if grouping is not None or placeholder:
            raise ClipperUsageError("per-layer clipping clips each example's parameters one by one; it is not "
                                    "combined with privacy units or placeholder rows: clip flat")
        factors, clipped = rule.factors_by_name({name: torch.sqrt(squares.to(device=device, dtype=factor_dtype))
                                                 * scale for name, squares in squared.items()})
        if dropped is not None:
            factors = {name: torch.where(dropped, torch.zeros_like(f), f) for name, f in factors.items()}
            clipped = clipped | dropped
        by_name = {name: (factor * scale,) * 2 for name, factor in factors.items()}
        weights = row_weights = next(iter(by_name.values()))[0]
        weight_of = by_name.__getitem__
    else:
        norms = torch.sqrt(total) * scale
        factors, clipped = rule.factors(norms)
        if dropped is not None:
            factors, clipped = torch.where(dropped, torch.zeros_like(factors), factors), clipped | dropped
        weights = factors * scale  # per clipped quantity: an example, or a unit
        if placeholder:
            if grouping is not None:
                raise ClipperUsageError("a placeholder row cannot be combined with privacy units")
            weights = torch.cat([torch.zeros_like(weights[:1]), weights[1:]])
            clipped = clipped[1:]
        row_weights = weights if grouping is None else grouping.row_weights(weights)
        pair = (weights, row_weights)
        weight_of = lambda name: pair  # noqa: E731 (one pair for every parameter)

    def weighted_sums(weight_of) -> dict[str, torch.Tensor]:
        """The contractions with ``weight_of(name)``: (weights per clipped quantity, weights per row)."""
        sums: dict[str, torch.Tensor] = {}
        converted: dict[tuple, torch.Tensor] = {}

        def rows_as(row_weights, dtype):
            key = (id(row_weights), dtype)
            if key not in converted:
                converted[key] = row_weights.to(device=row_weights.device, dtype=dtype)
            return converted[key]

        for call in calls:
            layer, dtype = call.layer, _layer_dtype(call.layer)
            groups: dict[int, tuple] = {}  # the call's ghost parameters, by the weights they take
            for local, name in zip(layer.local_names, layer.global_names):
                if name not in dense_names:
                    row_weights = weight_of(name)[1]
                    groups.setdefault(id(row_weights), (row_weights, []))[1].append(local)
            for row_weights, ghost in groups.values():
                parts = layer.rule.clipped_sums(
                    layer.module, call.stored, call.grads, ghost, rows_as(row_weights, dtype), dtype
                )
                for local, name in zip(layer.local_names, layer.global_names):
                    if local in ghost:
                        sums[name] = parts[local] + sums[name] if name in sums else parts[local]
        # Kept per-example gradients (per-unit sums with units): one (1, B) x (B, P) product each
        # (10% faster than the matrix-vector product over the transposed view on one CPU thread).
        for name, grads in per_example.items():
            stored, swapped = storage_order(grads)
            flat = stored.reshape(stored.shape[0], -1)
            row = weight_of(name)[0].to(device=flat.device, dtype=flat.dtype).view(1, -1)
            total = torch.mm(row, flat).view(stored.shape[1:])
            sums[name] = total.transpose(-1, -2).contiguous() if swapped else total
        return sums

    # The stored output gradients already carry the loss's 1/B for a mean, so factor 1 gives .grad.
    ones = (torch.ones_like(weights), torch.ones_like(row_weights))
    # A dropped example's NaN is in autograd's .grad but not in these sums: no comparison this pass.
    plain = weighted_sums(lambda name: ones) if unclipped and dropped is None else None
    return ClippedPass(weighted_sums(weight_of), batch - int(placeholder), int(clipped.sum()), plain,
                       None if grouping is None else grouping.count)


def _zero_rows(calls: list[LayerCall], per_example: dict, rows: torch.Tensor, batch: int) -> None:
    """Zero the rows ``rows`` (a (B,) mask) of every call's stored floating tensors and output gradients
    with the batch on dimension 0, and of the kept per-example gradients: a weight of 0 times a NaN
    would still be NaN in the sums (``nonfinite="zero"``). New tensors; autograd's are not touched."""
    def zeroed(value):
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 1
                and value.shape[0] == batch):
            mask = rows.to(value.device).view(-1, *([1] * (value.dim() - 1)))
            return torch.where(mask, torch.zeros((), dtype=value.dtype, device=value.device), value)
        return value

    for call in calls:
        call.stored = optree.tree_map(zeroed, call.stored, none_is_leaf=True)
        call.grads = [None if grad is None else zeroed(grad) for grad in call.grads]
    for name in per_example:
        per_example[name] = zeroed(per_example[name])


def _held_elements(calls: list[LayerCall]) -> int:
    """Elements of the output gradients the hooks hold for the pass: the budget for kept gradients."""
    return sum(grad.numel() for call in calls for grad in call.grads if grad is not None)


def _grant_kept_by_name(calls, batch: int, dense_names: set, tied_names: set, budget: int) -> int:
    """Grant what ghost rules would rather keep (``materialized``), name by name in call order,
    while it fits in ``budget`` elements; ``dense_names`` grows in place. Returns what is left."""
    for call in calls:
        layer = call.layer
        if not layer.rule.ghost:
            continue
        for local in layer.rule.materialized(layer.module, call.stored, call.grads, layer.local_names):
            index = layer.local_names.index(local)
            name = layer.global_names[index]
            size = batch * layer.parameters[index].numel()
            if name not in dense_names and name not in tied_names and size <= budget:
                budget -= size
                dense_names.add(name)
    return budget


def _releasable(calls: list[LayerCall]) -> dict[int, int]:
    """Per call (by id): the elements its stored input and output gradients free when dropped,
    counting only tensors whose storage no other call holds (q, k and v projections share an input)."""
    def tensors(call):
        stored = [call.stored] if isinstance(call.stored, torch.Tensor) else []
        return stored + [grad for grad in call.grads if grad is not None]

    holders: dict[tuple, int] = {}
    for call in calls:
        for tensor in tensors(call):
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            holders[key] = holders.get(key, 0) + 1
    return {
        id(call): sum(tensor.numel() for tensor in tensors(call)
                      if holders[(tensor.device, tensor.untyped_storage().data_ptr())] == 1)
        for call in calls
    }


def _grant_kept(calls, batch: int, dense_names: set, tied_names: set, holders) -> tuple[dict, set]:
    """Which per-example gradients to form once and keep for both passes, within the memory budget.

    The budget is the elements of the output gradients the hooks hold (pass memory at most
    doubles). A call whose every parameter is then kept needs neither its stored input nor its
    output gradients after pass 1: they are dropped as soon as its gradients are formed
    (``released``, by call id), and what that frees returns to the budget. Grants go in the order
    pass 1 forms them, each only if its gradients fit before its own tensors are dropped, so the
    pass's live elements never exceed the held ones plus the budget. First a tied table, when the
    head's cost model prefers it kept (rules/tied.py; formed once for both layers), then each
    layer's offered parameters, together where that releases the call, otherwise name by name.
    Returns the tied tables kept (name -> their Embedding and head calls) and ``released``;
    ``dense_names`` grows in place.
    """
    budget = _held_elements(calls)
    frees = _releasable(calls)
    tied_kept: dict[str, tuple[LayerCall, LayerCall]] = {}
    released: set[int] = set()

    def whole(call, extra=()):
        names = set(call.layer.global_names)
        return names <= (dense_names | set(extra))

    for name in sorted(tied_names):
        embedding, head = _tied_holders(holders[name])
        size = batch * embedding.layer.module.weight.numel()
        if not tied.keeps_per_example(head.stored, head.grads) or size > budget:
            continue
        tied_kept[name] = (embedding, head)
        dense_names.add(name)
        budget -= size
        for call in (embedding, head):
            if whole(call):
                released.add(id(call))
                budget += frees[id(call)]
    for call in calls:
        layer = call.layer
        if not layer.rule.ghost or id(call) in released:
            continue
        offered = [
            (layer.global_names[layer.local_names.index(local)], layer.parameters[layer.local_names.index(local)])
            for local in layer.rule.materialized(layer.module, call.stored, call.grads, layer.local_names)
        ]
        offered = [(name, param) for name, param in offered if name not in dense_names and name not in tied_names]
        size = sum(batch * param.numel() for _, param in offered)
        if offered and size <= budget and whole(call, [name for name, _ in offered]):
            dense_names.update(name for name, _ in offered)
            released.add(id(call))
            budget += frees[id(call)] - size
        else:
            budget = _grant_kept_by_name([call], batch, dense_names, tied_names, budget)
    return tied_kept, released


def _tied_holders(held: list[tuple[LayerCall, str]]) -> tuple[LayerCall, LayerCall]:
    """The (Embedding, Linear head) calls of a tied pair."""
    embedding, head = sorted(held, key=lambda holder: not isinstance(holder[0].layer.rule, EmbeddingRule))
    return embedding[0], head[0]


def _example_squares(calls, dense_names, tied_names, holders, tied_kept=None, released=frozenset()):
    """Pass 1 per example: (B,) squared norms by parameter name, the kept per-example gradients
    (B, ...) of ``dense_names``, and which call's ghost norms gave each other name. ``tied_kept``
    (name -> its Embedding and head calls, both in ``dense_names``) are formed once for the pair.
    The calls in ``released`` (ids) drop their stored tensors once their gradients are formed."""
    squared: dict[str, torch.Tensor] = {}
    ghost_owner: dict[str, tuple[LayerCall, str]] = {}
    per_example: dict[str, torch.Tensor] = {}
    tied_kept = tied_kept or {}
    formed_per_call = dense_names - set(tied_kept)  # a kept tied table is formed once, just below
    for name, (embedding, head) in tied_kept.items():
        per_example[name] = tied.per_example_grads(
            embedding.layer.module, embedding.stored, embedding.grads, head.stored, head.grads,
            _layer_dtype(head.layer),
        )
        squared[name] = squared_frobenius(per_example[name])
        for call in (embedding, head):
            if id(call) in released:
                release(call)
    for call in calls:
        layer, dtype = call.layer, _layer_dtype(call.layer)
        pairs = list(zip(layer.local_names, layer.global_names))
        ghost = [local for local, name in pairs if name not in dense_names]
        if ghost:
            squares = layer.rule.squared_norms(layer.module, call.stored, call.grads, ghost, dtype)
            for local, name in pairs:
                if local in ghost:
                    if name in tied_names:
                        squared[name] = squares[local] + squared[name] if name in squared else squares[local]
                    else:
                        squared[name] = squares[local]
                        ghost_owner[name] = (call, local)
        for name in _add_per_example(call, formed_per_call, per_example, dtype):
            if len(holders[name]) == 1:
                # Its only call: squared now, while the gradient just written may still be in
                # cache (tiny GPT-2, old and new order alternating in one process: the median
                # DP step 10-15 ms shorter, the best one 0-11 ms, than one pass over all after).
                squared[name] = squared_frobenius(per_example[name])
        if id(call) in released:
            release(call)
    for name, grads in per_example.items():
        if name not in squared:  # summed over several calls: complete only now
            squared[name] = squared_frobenius(grads)
    for name in tied_names:
        squared[name] = _tied_squares(holders[name], _layer_dtype(holders[name][0][0].layer), squared[name])
    return squared, per_example, ghost_owner


def release(call: LayerCall) -> None:
    """Drop a call's stored input and output gradients (all its parameters are kept per example, or
    its pass is folded: the hooks on the pass's outputs still hold the call while the graph lives)."""
    call.stored = None
    call.grads = [None] * len(call.grads)


def _add_per_example(call: LayerCall, dense_names, per_example: dict, dtype) -> list[str]:
    """Add ``call``'s per-example gradients of ``dense_names`` into ``per_example`` (summed over
    calls); returns the names it added to."""
    layer = call.layer
    dense = [local for local, name in zip(layer.local_names, layer.global_names) if name in dense_names]
    if not dense:
        return []
    grads = layer.rule.per_example_grads(layer.module, call.stored, call.grads, dense, dtype)
    added = []
    for local, name in zip(layer.local_names, layer.global_names):
        if local in dense:
            part = grads[local]
            per_example[name] = part if name not in per_example else per_example[name] + part
            added.append(name)
    return added


def _unit_squares(calls, dense_names, tied_names, holders, grouping, regroup: bool, dtype=None, only=None):
    """Pass 1 per unit (units.py): (U,) squared norms of the unit sums by parameter name, and the
    per-unit sums (U, ...) of ``dense_names``. ``dtype`` overrides the layers' (the float64
    recomputation), ``only`` restricts it to one name."""
    squared: dict[str, torch.Tensor] = {}
    per_example: dict[str, torch.Tensor] = {}
    for call in calls:
        layer = call.layer
        layer_dtype = dtype or _layer_dtype(layer)
        pairs = [(local, name) for local, name in zip(layer.local_names, layer.global_names)
                 if only is None or name == only]
        ghost = [local for local, name in pairs if name not in dense_names]
        if regroup and unit_norms.regroups(layer.rule):
            # The unit's rows as one example of the rule (tied names: each holder's own part).
            parts = unit_norms.regrouped_squares(grouping, lambda regrouped: layer.rule.squared_norms(
                layer.module, regrouped[0].stored, regrouped[0].grads, ghost, layer_dtype), [call]) if ghost else {}
        else:
            parts = {local: unit_norms.materialized_squares(grouping, [(call, local)], layer_dtype)
                     for local, name in pairs if local in ghost and name not in tied_names}
        for local, name in pairs:
            if local in parts:
                squared[name] = parts[local] + squared[name] if name in squared else parts[local]
        if only is None:
            _add_per_example(call, dense_names, per_example, layer_dtype)
    for name, grads in per_example.items():
        per_example[name] = grouping.unit_sums(grads)
        squared[name] = squared_frobenius(per_example[name])
    for name in tied_names:
        if only is not None and name != only:
            continue
        held = holders[name]
        tied_dtype = dtype or _layer_dtype(held[0][0].layer)
        if regroup:
            pair = [call for call, _ in sorted(held, key=lambda h: not isinstance(h[0].layer.rule, EmbeddingRule))]
            cross = unit_norms.regrouped_tied_cross(grouping, pair, tied_dtype)
            squared[name] = (squared[name] + 2 * cross).clamp_(min=0)
        else:
            squared[name] = unit_norms.materialized_squares(grouping, held, tied_dtype)
    return squared, per_example
