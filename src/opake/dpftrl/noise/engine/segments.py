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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opake.dpftrl.noise.engine.draws import BLOCK_ELEMENTS
from opake.dpftrl.noise.engine.layout import Layout

__all__ = ["Segment", "StepPlan", "plan_step"]


@dataclass(frozen=True)
class Segment:
    """Columns [column, column + length) advanced together.

    ``direct``: x is the output of dtype ``output_dtype`` at ``output_offset`` (else x is the
    scratch). ``draws``: (leaf index, block index) of the noise blocks that fill x, in order,
    with their lengths in ``draw_lengths`` (so ``x.split(draw_lengths)`` gives them). ``adds``:
    (leaf index, start in the leaf, length, output offset) of the stretches where
    output = gradient + scale * x is written, in order along x.
    """

    column: int
    length: int
    direct: bool
    output_dtype: torch.dtype
    output_offset: int
    draws: tuple
    draw_lengths: tuple
    adds: tuple


@dataclass(frozen=True)
class StepPlan:
    totals: tuple            # (dtype, number of elements) for each output vector
    output_groups: tuple     # (dtype, leaf indices, leaf sizes): how each output vector splits
    scratch_length: int      # 0 when every gradient is in the compute dtype
    segments: tuple


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
                run = {"column": slot.offset, "length": 0, "output_offset": output_offset,
                       "draws": [], "draw_lengths": [], "adds": []}
                segments.append(run)
            for block, _, length in _blocks(slot.numel):
                run["draws"].append((index, block))
                run["draw_lengths"].append(length)
            run["adds"].append((index, 0, slot.numel, output_offset))
            run["length"] += slot.numel
        else:
            run = None
            for block, begin, length in _blocks(slot.numel):
                scratch_length = max(scratch_length, length)
                segments.append(Segment(
                    column=slot.offset + begin, length=length, direct=False, output_dtype=dtype,
                    output_offset=output_offset + begin, draws=((index, block),), draw_lengths=(length,),
                    adds=((index, begin, length, output_offset + begin),),
                ))
    frozen = tuple(
        segment if isinstance(segment, Segment) else Segment(
            column=segment["column"], length=segment["length"], direct=True, output_dtype=compute_dtype,
            output_offset=segment["output_offset"], draws=tuple(segment["draws"]),
            draw_lengths=tuple(segment["draw_lengths"]), adds=tuple(segment["adds"]),
        )
        for segment in segments
    )
    output_groups = tuple((dtype, tuple(members), tuple(sizes)) for dtype, (members, sizes) in groups.items())
    return StepPlan(tuple(totals.items()), output_groups, scratch_length, frozen)
