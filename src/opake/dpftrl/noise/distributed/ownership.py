"""Which rank owns which parameters: a deterministic map computed identically on every rank.

``ownership_map(layout, world_size, mode)`` returns, for each rank, the element ranges
(leaf index, start, stop) it owns. It depends only on the layout (paths, shapes, order) and the
world size, so every rank computes the same map without communication.

- ``"tensors"``: whole tensors. Greedy balance by size: leaves sorted by decreasing numel
  (ties: layout order) each go to the rank with the fewest elements so far (ties: lowest
  rank). A rank may own nothing when there are fewer tensors than ranks.
- ``"blocks"``: the parameters in layout order, cut into ``world_size`` contiguous runs at
  noise-block boundaries (2**20 elements, or the end of a leaf), each run ending at the block
  boundary closest to an equal share. Balances models dominated by one large tensor.
- ``"even"``: the parameters in layout order cut into ``world_size`` runs of ceil(d / world_size)
  elements, wherever the cut falls (FSDP's split). Every rank holds at most ceil(d / W) buffer
  columns whatever the tensor sizes; a noise block cut between two ranks is drawn whole by both
  and sliced (at most one extra block of draws per rank and step).

``even_shards(template, rank, world_size)`` gives the FSDP-style split used by the sharded
gradient stage: the flattened parameters (leaves in the template's optree order) cut into
``world_size`` equal ranges of ceil(d / world_size) elements, as ``slice`` objects per leaf.
"""

from __future__ import annotations

import hashlib

import optree

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS
from opake.dpftrl.noise.engine.layout import Layout
from opake.errors import InvalidArgumentError

__all__ = ["OWNERSHIP_MODES", "balanced_ownership", "even_shards", "map_fingerprint", "ownership_map"]

OWNERSHIP_MODES = ("tensors", "blocks", "even")


def ownership_map(layout: Layout, world_size: int, mode: str) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """For each rank, its owned ranges ``(leaf index, start, stop)`` in layout order."""
    if mode == "tensors":
        loads = [0] * world_size
        owned: list[list] = [[] for _ in range(world_size)]
        order = sorted(range(len(layout.leaves)), key=lambda i: (-layout.leaves[i].numel, i))
        for index in order:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            loads[rank] += layout.leaves[index].numel
            owned[rank].append(index)
        return tuple(
            tuple((index, 0, layout.leaves[index].numel) for index in sorted(indices))
            for indices in owned
        )
    if mode == "blocks":
        units = []  # (leaf, start, stop) of each noise block, in layout order
        for index, slot in enumerate(layout.leaves):
            for block in slot.blocks:
                begin = block * BLOCK_ELEMENTS
                units.append((index, begin, min(slot.numel, begin + BLOCK_ELEMENTS)))
        ends, total = [], 0
        for leaf, start, stop in units:
            total += stop - start
            ends.append(total)
        cuts = [0]
        for rank in range(1, world_size):
            target = layout.size * rank / world_size
            best = min(range(cuts[-1], len(units) + 1),
                       key=lambda k: (abs((ends[k - 1] if k else 0) - target), k))
            cuts.append(best)
        cuts.append(len(units))
        result = []
        for rank in range(world_size):
            merged: list[list[int]] = []
            for leaf, start, stop in units[cuts[rank]:cuts[rank + 1]]:
                if merged and merged[-1][0] == leaf and merged[-1][2] == start:
                    merged[-1][2] = stop
                else:
                    merged.append([leaf, start, stop])
            result.append(tuple(tuple(item) for item in merged))
        return tuple(result)
    if mode == "even":
        share = -(-layout.size // world_size)
        result = []
        for rank in range(world_size):
            begin, end = rank * share, min(layout.size, (rank + 1) * share)
            owned = []
            for index, slot in enumerate(layout.leaves):
                lo, hi = max(begin - slot.offset, 0), min(end - slot.offset, slot.numel)
                if lo < hi:
                    owned.append((index, lo, hi))
            result.append(tuple(owned))
        return tuple(result)
    raise InvalidArgumentError(f"ownership must be one of {OWNERSHIP_MODES}, got {mode!r}")


def balanced_ownership(layout: Layout, world_size: int, slack: float = 1.1) -> str:
    """``"tensors"`` when whole tensors balance to within ``slack`` of an equal share per rank (no
    block is drawn twice), else ``"even"`` (exactly equal shares)."""
    loads = [sum(layout.leaves[i].numel for i, _, _ in ranges) for ranges in ownership_map(layout, world_size,
                                                                                           "tensors")]
    return "tensors" if max(loads) <= slack * layout.size / world_size else "even"


def map_fingerprint(layout: Layout, ranges, mode: str, world_size: int) -> str:
    """A short hash of the whole map (every rank's ranges) and what it was computed from."""
    text = repr((layout.fingerprint, mode, world_size, ranges))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def even_shards(grad_template, rank: int, world_size: int):
    """The FSDP-style shard of ``rank``: a pytree like ``grad_template`` of ``slice`` leaves.

    The flattened parameters (leaves in optree order, each flattened) are cut into
    ``world_size`` ranges of ceil(d / world_size) elements; leaf p gets the part of rank's
    range that falls inside it (possibly ``slice(0, 0)``).
    """
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise InvalidArgumentError(
            f"need integers 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
        )
    layout = Layout.from_template(grad_template)
    share = -(-layout.size // world_size)
    begin, end = rank * share, min(layout.size, (rank + 1) * share)
    slices = []
    for slot in layout.leaves:
        lo = min(max(begin - slot.offset, 0), slot.numel)
        hi = min(max(end - slot.offset, 0), slot.numel)
        slices.append(slice(lo, max(lo, hi)))
    return optree.tree_unflatten(layout.treespec, slices)
