"""Planned batches in Trainer's shape: micro-batches of one planned batch, empty batches collated.

A planned batch's size varies (balls in bins draws Binomial bin sizes; a bin can be empty), so
``DPTrainer`` cuts each planned batch into micro-batches of at most
``per_device_train_batch_size`` examples, the memory bound that setting means in Trainer, and
runs forward and backward on each before the batch's one optimizer step. Per-example clipping
makes this exact: every example is clipped on its own whichever micro-batch it is in, and with
``loss_reduction="mean"`` the clipper undoes each micro-batch's own 1/size.

With privacy units (``DPTrainer(privacy_unit=...)``) the clipped quantity is a user's summed
gradient, so all rows of one user must be in one forward pass (the clipper refuses a user split
across two). ``unit_micro_batches`` cuts at user boundaries instead: users, in the planned
batch's order, are packed into micro-batches of at most ``per_device_train_batch_size`` rows,
and a user with more rows than that forms a micro-batch of its own, larger than the setting.

A preference pair (``DPDPOTrainer``) is one example that runs as two rows, its chosen and its
rejected sequence, laid out by TRL's collator as all chosen rows then all rejected rows.
``pair_micro_batches`` cuts whole pairs, keeping that layout in each part, and numbers the rows
by pair so that the clipper clips each pair's two rows together.
"""

from __future__ import annotations

from collections.abc import Mapping

import optree
import torch

from opake.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["EmptyBatchCollator", "batch_size_of", "micro_batches", "pair_micro_batches", "unit_micro_batches"]


def batch_size_of(batch) -> int:
    """The number of examples in a collated batch: dimension 0 of its first tensor."""
    leaves = batch.values() if isinstance(batch, Mapping) else optree.tree_leaves(batch, none_is_leaf=True)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise InvalidTypeError("the collated batch holds no tensor with a batch dimension; DPTrainer needs one to count "
                           "its examples")


def micro_batches(batch, size: int, largest: int) -> list:
    """``batch`` (``size`` examples) cut along dimension 0 into ceil(size / largest) balanced parts.

    Every tensor whose dimension 0 is ``size`` is cut; a batch holding anything else with a
    batch dimension (a list of strings, a tensor with another leading size) is refused, since
    its rows could not be matched to the examples. An empty batch has no parts.
    """
    if size == 0:
        return []
    parts = -(-size // largest)
    return _cut(batch, size, [len(part) for part in torch.arange(size).tensor_split(parts)])


def lockstep_micro_batches(batch, size: int, passes: int, placeholder_only: bool = False) -> list:
    """``batch`` cut into exactly ``passes`` parts, for a sharded model whose ranks must all run
    the same number of forward and backward passes: as many balanced parts as there are rows;
    the passes beyond them (and every pass, with ``placeholder_only``: the batch is the rank's one
    placeholder row) repeat row 0 as a placeholder. Returns ``(part, is_placeholder)`` pairs; the
    caller has the clipper weigh each placeholder 0 (``expect_placeholder``)."""
    if placeholder_only:
        return [(_cut(batch, size, [1])[0], True) for _ in range(passes)]
    real = min(size, passes)
    parts = [(part, False) for part in _cut(batch, size, [len(p) for p in torch.arange(size).tensor_split(real)])]
    filler = _cut(batch, size, [1, size - 1])[0] if size > 1 else batch
    return parts + [(filler, True) for _ in range(passes - real)]


def unit_micro_batches(batch, size: int, largest: int, units) -> list:
    """``batch`` cut along dimension 0 at unit boundaries: whole units packed in order into parts
    of at most ``largest`` rows (a unit with more rows is a part of its own). ``units`` is the
    unit of each row; every unit's rows must be contiguous (as planned batches serve them)."""
    units = list(units)
    if len(units) != size:
        raise InvalidArgumentError(f"the planned batch has {size} rows but {len(units)} unit numbers")
    runs: list[int] = []  # rows per unit, in order
    seen = set()
    for index, unit in enumerate(units):
        if index and unit == units[index - 1]:
            runs[-1] += 1
            continue
        if unit in seen:
            raise InvalidArgumentError(
                f"the rows of unit {unit} are not contiguous in the batch; micro-batches cut at unit "
                f"boundaries need each unit's rows together (as the planned loader serves them)"
            )
        seen.add(unit)
        runs.append(1)
    sizes: list[int] = []
    for run in runs:
        if sizes and sizes[-1] + run <= largest:
            sizes[-1] += run
        else:
            sizes.append(run)
    return _cut(batch, size, sizes)


def pair_micro_batches(batch, pairs: int, largest: int) -> list[tuple[dict, torch.Tensor]]:
    """A collated batch of ``pairs`` preference pairs (TRL's layout: every per-row tensor holds the
    chosen rows, then the rejected rows in the same order, on dimension 0; a per-pair tensor, such
    as precomputed reference log-probabilities, one row per pair) cut into ceil(pairs / largest)
    balanced parts of whole pairs, each in the same layout. Returns ``(part, pair numbers of its
    rows)`` for each part: the two rows of a pair carry its number, so that the clipper clips them
    together (``PerExampleClipper.expect_units``). An empty batch has no parts."""
    if pairs == 0:
        return []
    if not isinstance(batch, Mapping):
        raise InvalidTypeError(f"a preference batch must be a dict of tensors, got a {type(batch).__name__}")
    bounds = torch.arange(pairs).tensor_split(-(-pairs // largest))
    parts = []
    for members in bounds:
        first, stop = int(members[0]), int(members[-1]) + 1
        part = {}
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2 * pairs:
                part[name] = torch.cat([value[first:stop], value[pairs + first:pairs + stop]])
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == pairs:
                part[name] = value[first:stop]
            else:
                raise InvalidTypeError(
                    f"cannot cut the preference batch's {name!r} into micro-batches of whole pairs: it is not a "
                    f"tensor with the batch's {2 * pairs} rows (chosen, then rejected) or {pairs} pairs on "
                    f"dimension 0")
        parts.append((part, members.repeat(2)))
    return parts


def _cut(batch, size: int, sizes: list[int]) -> list:
    """``batch`` cut along dimension 0 into parts of ``sizes`` rows (summing to ``size``)."""
    if not sizes:
        return []
    if len(sizes) == 1:
        return [batch]
    if not isinstance(batch, Mapping):
        raise InvalidTypeError(f"DPTrainer cuts planned batches into micro-batches as dicts of tensors; got a "
                               f"{type(batch).__name__}")
    pieces = {}
    for name, value in batch.items():
        if not (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size):
            raise InvalidTypeError(
                f"cannot cut the batch's {name!r} into micro-batches: it is not a tensor with the batch's "
                f"{size} examples on dimension 0. Collate every input as such a tensor, or set "
                f"per_device_train_batch_size to at least the largest planned batch"
            )
        pieces[name] = torch.split(value, sizes)
    return [{name: chunks[i] for name, chunks in pieces.items()} for i in range(len(sizes))]


class EmptyBatchCollator:
    """Trainer's collator, except that an empty planned batch becomes one example's collated
    structure with every tensor cut to zero rows (Hugging Face's collators fail on an empty list).
    Nothing of that example is trained on: an empty batch has no micro-batches."""

    def __init__(self, collate, dataset):
        self.collate = collate
        self.dataset = dataset
        self._empty = None

    def __call__(self, features):
        if len(features) > 0:
            return self.collate(features)
        if self._empty is None:
            self._empty = _zero_rows(self.collate([self.dataset[0]]))
        return self._empty


def _zero_rows(template):
    if isinstance(template, Mapping):  # a dict, or transformers' BatchEncoding
        return {name: _zero_rows(value) for name, value in template.items()}
    if isinstance(template, torch.Tensor) and template.dim() > 0:
        return template[:0]
    raise InvalidTypeError(f"an empty planned batch cannot be collated: the collator's output holds a "
                           f"{type(template).__name__}, not a batched tensor; give DPTrainer a collator that returns "
                           f"(dicts of) tensors, or one that handles an empty list itself")
