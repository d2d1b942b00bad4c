"""Squared norms of each privacy unit's summed gradient (user-level clipping), for one forward pass.

With privacy units (``PerExampleClipper.expect_units``) the clipped quantity is a unit's gradient
``g_u = sum_{i in u} g_i``, the sum over its rows, and its squared norm has cross terms:
``||g_u||^2 = sum_{i,j in u} <g_i, g_j>``, not the sum of the rows' squared norms. It decomposes
over parameters as for examples (``||g_u||^2 = sum_p ||g_u^(p)||^2``), so pass 1 of the
book-keeping needs, per parameter, the (U,) squared norms of the unit sums. Pass 2 is unchanged:
every rule is linear in the output gradients, so the clipped sum is the rule's contraction with
the row weights ``c_{u(i)} * s`` (each row weighted by its unit's factor).

Two routes to the (U,) squared norms:

* **Regrouped ghost norms**, for rules whose per-example gradient is a sum over positions of a
  term of one position's stored input and output gradient (``regroup_positions = True``: Linear,
  transformers' Conv1D, Embedding). A unit's rows, laid side by side along the position axis, are
  one example of that rule whose gradient is exactly ``g_u``: ``G_u^T A_u = sum_{i in u} G_i^T
  A_i`` for a Linear, the scatter of all its rows' tokens for an Embedding. The rule's own
  ``squared_norms`` on that regrouped example is the unit's squared norm, cross terms included
  (for a Linear the T k x T k Gram matrices hold them). Units are regrouped by size, all units of
  k rows into one (n, k, ...) tensor (``UnitGrouping.buckets``): no padding, and the regrouped
  copies of one bucket hold at most the pass's stored rows. Tied embeddings use the cross term
  (``rules/tied.py``) on the regrouped pair in the same way.
* **Materialized**, for every other rule (convolutions, whose positions overlap; user rules) and
  for parameters the book-keeping forms per example anyway (shared ones, small layers): the
  rows' per-example gradients (``rule.per_example_grads``), added per unit with ``index_add_``.
  For a ghost rule whose stored input is one tensor, this is done a chunk of whole units at a
  time (``CHUNK_ELEMENTS``), keeping only the norms; the parameters the book-keeping keeps for
  the sum pass are reduced to (U, ...) unit sums, never more than the B rows it held before.

Both routes are tested against a dense reference (autograd's gradient of each unit's summed loss)
in tests/torch/test_privacy_units.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from opake.torch.per_example.rules import tied
from opake.torch.per_example.rules.base import CHUNK_ELEMENTS, squared_frobenius


class UnitGrouping:
    """The rows of one forward pass grouped by unit: ``units`` (B,) holds any unit numbers.

    ``inverse[i]`` is row i's local unit (0 .. count - 1, in ascending order of unit number);
    ``order`` lists the rows unit by unit (rows of one unit in row order), unit u's rows being
    ``order[offsets[u]:offsets[u + 1]]``; ``buckets`` are ``(local units (n,), rows (n, k))`` for
    each unit size k present.
    """

    def __init__(self, units: torch.Tensor, device):
        units = units.to(device=device, dtype=torch.int64)
        _, self.inverse = torch.unique(units, sorted=True, return_inverse=True)
        self.rows = int(units.numel())
        sizes = torch.bincount(self.inverse) if self.rows else torch.zeros(0, dtype=torch.int64, device=device)
        self.count = int(sizes.numel())
        self.order = torch.argsort(self.inverse, stable=True)
        self.offsets = torch.zeros(self.count + 1, dtype=torch.int64, device=device)
        torch.cumsum(sizes, 0, out=self.offsets[1:])
        self.buckets = []
        for size in sorted(set(sizes.tolist())):
            members = torch.nonzero(sizes == size).flatten()
            rows = self.order[self.offsets[members][:, None] + torch.arange(size, device=device)]
            self.buckets.append((members, rows))

    def unit_sums(self, per_example: torch.Tensor) -> torch.Tensor:
        """(U, ...) sums over each unit's rows of a (B, ...) tensor."""
        total = per_example.new_zeros(self.count, *per_example.shape[1:])
        return total.index_add_(0, self.inverse.to(per_example.device), per_example)

    def row_weights(self, unit_weights: torch.Tensor) -> torch.Tensor:
        """(B,) each row's unit's weight."""
        return unit_weights[self.inverse.to(unit_weights.device)]

    def unit_chunks(self, elements_per_row: int, limit: int | None = None):
        """(first unit, last unit + 1) ranges of whole units with at most ``limit`` (default
        ``CHUNK_ELEMENTS``) elements of per-row temporaries (at least one unit each)."""
        limit = CHUNK_ELEMENTS if limit is None else limit
        rows_allowed = max(1, limit // max(1, elements_per_row))
        offsets = self.offsets.tolist()
        start = 0
        while start < self.count:
            stop = start + 1
            while stop < self.count and offsets[stop + 1] - offsets[start] <= rows_allowed:
                stop += 1
            yield start, stop
            start = stop


def regroups(rule) -> bool:
    """Whether a rule's per-example gradient is a sum over positions (module docstring)."""
    return bool(getattr(rule, "regroup_positions", False))


def _regrouped_tensor(tensor, rows: torch.Tensor):
    """(B, p, ...) rows ``rows`` (n, k) as (n, k * p, ...): the unit's rows along the position axis;
    a (B,) or (B, f) tensor becomes (n, k) or (n, k, f) (its one position per row)."""
    if tensor is None:
        return None
    count, size = rows.shape
    flat = rows.reshape(-1)
    first = int(flat[0]) if flat.numel() else 0
    if bool((flat == torch.arange(first, first + flat.numel(), device=flat.device)).all()):
        picked = tensor[first:first + flat.numel()]  # rows already in unit order: a view, no copy
    else:
        picked = tensor.index_select(0, flat.to(tensor.device))
    picked = picked.reshape(count, size, *tensor.shape[1:])
    if tensor.dim() >= 3:
        picked = picked.reshape(picked.shape[0], picked.shape[1] * picked.shape[2], *picked.shape[3:])
    return picked


def regrouped_call(call, rows: torch.Tensor):
    """``call`` (a ``LayerCall``) with each unit of a bucket as one example (its rows
    concatenated along the position axis)."""
    return replace(call, stored=_regrouped_tensor(call.stored, rows),
                   grads=[_regrouped_tensor(grad, rows) for grad in call.grads])


def _rows_of(call, rows: torch.Tensor):
    stored = call.stored if call.stored is None else call.stored[rows.to(call.stored.device)]
    return replace(call, stored=stored, grads=[None if grad is None else grad[rows.to(grad.device)]
                                               for grad in call.grads])


def regrouped_squares(grouping: UnitGrouping, compute, calls: list) -> dict:
    """Per key, the (U,) results of ``compute(regrouped calls) -> {key: (n,)}`` over the buckets."""
    result: dict = {}
    for members, rows in grouping.buckets:
        parts = compute([regrouped_call(call, rows) for call in calls])
        for key, part in parts.items():
            if key not in result:
                result[key] = part.new_zeros(grouping.count)
            result[key][members.to(part.device)] = part
    return result


def regrouped_tied_cross(grouping: UnitGrouping, held, dtype) -> torch.Tensor:
    """(U,) cross terms ``<g_E, g_L>`` of a tied embedding's two holders, per unit."""
    embedding, linear = held
    return regrouped_squares(grouping, lambda pair: {"cross": tied.cross_term(
        embedding.layer.module, pair[0].stored, pair[0].grads, pair[1].stored, pair[1].grads, dtype)},
        [embedding, linear])["cross"]


def materialized_squares(grouping: UnitGrouping, holders: list, dtype) -> torch.Tensor:
    """(U,) squared norms of the unit sums of one parameter's per-example gradient, summed over its
    ``holders`` (call, local name); whole units a chunk at a time where every holder stored one
    tensor (or nothing), else all rows at once."""
    numel = max(call.layer.parameters[call.layer.local_names.index(local)].numel() for call, local in holders)
    sliceable = all(call.stored is None or isinstance(call.stored, torch.Tensor) for call, _ in holders)
    chunks = grouping.unit_chunks(len(holders) * numel) if sliceable else [(0, grouping.count)]
    parts = []
    for start, stop in chunks:
        rows = grouping.order[grouping.offsets[start]:grouping.offsets[stop]]
        local_units = grouping.inverse[rows] - start
        total = None
        for call, local in holders:
            part_call = _rows_of(call, rows) if sliceable else call
            grads = call.layer.rule.per_example_grads(call.layer.module, part_call.stored, part_call.grads,
                                                      [local], dtype)[local]
            if not sliceable:
                grads = grads[rows.to(grads.device)]
            total = grads if total is None else total + grads
        sums = total.new_zeros(stop - start, *total.shape[1:]).index_add_(0, local_units.to(total.device), total)
        parts.append(squared_frobenius(sums))
    return torch.cat(parts)
