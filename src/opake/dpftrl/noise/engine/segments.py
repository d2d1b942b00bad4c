"""How one noise step walks the parameters: output layout, segments, draws and adds.

A plan depends only on the parameter layout (the template's dtypes) and the compute dtype, so
the engine computes it once and reuses it every step; it holds integers only (no tensors), and
the step turns it into views of that step's output.

Output: one flat vector per template dtype, leaves in layout order within it (one d-vector
in all): the noised gradients always have grad_template's dtypes, whatever dtype the
gradients come in (float32 clipped sums of bfloat16 parameters come back in bfloat16; the
rounding of the noised value is post-processing). Segments: a *segment* is a stretch of buffer
columns advanced by one call of the streaming inverse, on a 1-D ``x`` in the compute dtype that
first receives z. A run of consecutive leaves whose template dtype is the compute dtype is one
segment whose ``x`` is their (contiguous) output: with uniform dtypes the whole model is a
single segment, so the buffer math costs a few torch ops per step whatever the number of
tensors. A leaf in another dtype cannot hold x in its output; it is advanced one noise block at
a time through a scratch of at most one block.

Stretches: the engine advances a segment's columns in *stretches* (see ``stretches``): the
whole segment when ops are large (several threads, GPUs), else cache-sized runs of columns
(single-threaded CPU). A stretch lists the adds (output = gradient + scale * x) whose columns
it completes, so the final add of a stretch runs while its x is still in cache. Since every
op is elementwise over the columns, any cut gives the same values; the cut is precomputed
once per chunk size, so a step of a model of many small tensors does no planning, only one
inverse call per stretch and one add per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS
from opake.dpftrl.noise.engine.layout import Layout

__all__ = ["Segment", "StepPlan", "Stretches", "plan_step", "stretches"]


GATHER_CHECK_MEAN = 2**13
"""Leaves of at most this many elements on average are checked for NaN/inf by gathering them
into the output first (one copy op, then one reduction), larger ones by one reduction each:
per-leaf reductions cost about as much as copying 2**13 elements each in op overhead."""


@dataclass(frozen=True)
class Segment:
    """Columns [column, column + length) advanced together.

    ``direct``: x is the output of dtype ``output_dtype`` at ``output_offset`` (else x is the
    scratch). ``draws``: (leaf index, block index, leaf code, start in the leaf, length, whole)
    of the noise blocks that fill x, in order along x (``whole``: the block is the entire
    leaf). ``adds``: (leaf index, start in the leaf, length, output offset) of the stretches
    where output = gradient + scale * x is written, in order along x.
    """

    column: int
    length: int
    direct: bool
    output_dtype: torch.dtype
    output_offset: int
    draws: tuple
    adds: tuple


@dataclass(frozen=True)
class Stretches:
    """How a segment's x is cut for the inverse: consecutive stretches of ``lengths`` elements
    (``x.split(lengths)``), each advanced by one inverse call and followed by the adds it
    completes: the whole leaves ``range(*wholes[k])`` (consecutive leaf indices), or, when
    ``partial[k]`` is (leaf index, start in the leaf, length), that part of one leaf, which
    then fills the entire stretch."""

    lengths: tuple
    wholes: tuple
    partial: tuple


@dataclass(frozen=True)
class StepPlan:
    totals: tuple            # (dtype, number of elements) for each output vector
    output_groups: tuple     # (dtype, leaf indices, leaf sizes): how each output vector splits
    scratch_length: int      # 0 when every gradient is in the compute dtype
    segments: tuple
    gather_check: bool       # finiteness: gather the gradients into the output (many small leaves)


def _blocks(numel: int):
    for block in range(-(-numel // BLOCK_ELEMENTS)):
        begin = block * BLOCK_ELEMENTS
        yield block, begin, min(BLOCK_ELEMENTS, numel - begin)


def plan_step(layout: Layout, compute_dtype: torch.dtype) -> StepPlan:
    totals: dict[torch.dtype, int] = {}
    groups: dict[torch.dtype, tuple[list, list]] = {}
    output_offsets = []
    for index, slot in enumerate(layout.leaves):
        dtype = slot.dtype
        output_offsets.append(totals.get(dtype, 0))
        totals[dtype] = totals.get(dtype, 0) + slot.numel
        members, sizes = groups.setdefault(dtype, ([], []))
        members.append(index)
        sizes.append(slot.numel)

    segments: list = []
    run = None  # the open direct segment, as a dict, while consecutive leaves can join it
    scratch_length = 0
    for index, slot in enumerate(layout.leaves):
        dtype = slot.dtype
        if slot.numel == 0:
            continue
        output_offset = output_offsets[index]
        if dtype == compute_dtype:
            joins = (
                run is not None
                and run["column"] + run["length"] == slot.offset
                and run["output_offset"] + run["length"] == output_offset
            )
            if not joins:
                run = {"column": slot.offset, "length": 0, "output_offset": output_offset, "draws": [], "adds": []}
                segments.append(run)
            for block, begin, length in _blocks(slot.numel):
                run["draws"].append((index, block, slot.code, begin, length, length == slot.numel))
            run["adds"].append((index, 0, slot.numel, output_offset))
            run["length"] += slot.numel
        else:
            run = None
            for block, begin, length in _blocks(slot.numel):
                scratch_length = max(scratch_length, length)
                segments.append(Segment(
                    column=slot.offset + begin, length=length, direct=False, output_dtype=dtype,
                    output_offset=output_offset + begin,
                    draws=((index, block, slot.code, begin, length, length == slot.numel),),
                    adds=((index, begin, length, output_offset + begin),),
                ))
    frozen = tuple(
        segment if isinstance(segment, Segment) else Segment(
            column=segment["column"], length=segment["length"], direct=True, output_dtype=compute_dtype,
            output_offset=segment["output_offset"], draws=tuple(segment["draws"]), adds=tuple(segment["adds"]),
        )
        for segment in segments
    )
    output_groups = tuple((dtype, tuple(members), tuple(sizes)) for dtype, (members, sizes) in groups.items())
    sizes = [slot.numel for slot in layout.leaves if slot.numel]
    gather_check = len(sizes) > 1 and sum(sizes) <= GATHER_CHECK_MEAN * len(sizes)
    return StepPlan(tuple(totals.items()), output_groups, scratch_length, frozen, gather_check)


def stretches(segment: Segment, layout: Layout, chunk: int | None) -> Stretches:
    """How ``segment`` is cut for one inverse call each (``chunk``: columns per call, None: all).

    An add longer than ``chunk`` is cut into ``chunk``-sized parts, one stretch each; shorter
    ones (small leaves) are grouped until they fill at least ``chunk`` columns, so a model of
    many small tensors still makes one inverse call per chunk. A segment's adds are whole
    leaves in consecutive order (direct segments) or one part of one leaf (the others).
    """
    lengths, wholes, partial = [], [], []
    first = stop = None  # the pending whole leaves: range(first, stop)
    pending_start = position = 0

    def close(end: int) -> None:
        nonlocal first, stop, pending_start
        if first is not None:
            lengths.append(end - pending_start)
            wholes.append((first, stop))
            partial.append(None)
        first = stop = None
        pending_start = end

    def close_part(index: int, leaf_begin: int, length: int) -> None:
        nonlocal pending_start
        lengths.append(length)
        wholes.append((index, index))
        partial.append((index, leaf_begin, length))
        pending_start += length

    for index, leaf_begin, length, _ in segment.adds:
        whole = leaf_begin == 0 and length == layout.leaves[index].numel
        if whole and (chunk is None or length <= chunk):
            if first is None:
                first = index
            stop = index + 1
            if chunk is not None and position + length - pending_start >= chunk:
                close(position + length)
        else:
            close(position)
            step = length if chunk is None else chunk
            for begin in range(0, length, step):
                close_part(index, leaf_begin + begin, min(step, length - begin))
        position += length
    close(position)
    return Stretches(tuple(lengths), tuple(wholes), tuple(partial))
