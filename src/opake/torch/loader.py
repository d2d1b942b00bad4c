"""The planned batches of a private run: the loader that serves them, and the check ``step()`` makes.

The accountant prices one release per planned batch, in order: step t releases the clipped sum
of batch t of the sampler, plus noise. Two things can silently break that, and both are refused
here rather than priced wrongly:

* **Another loader.** A ``transformers.Trainer`` or a second ``DataLoader`` serves shuffled
  fixed-size batches the accountant never priced. ``PlannedDataLoader`` records the step of
  every batch it hands to the training loop (``PlannedBatches.served``); ``DPOptimizer.step()``
  then requires that the batch served last is its own step's batch.
* **Fewer or merged steps.** Gradient accumulation over two loader batches before one step
  would release two planned batches as one. ``step()`` also requires that the examples clipped
  since ``zero_grad()`` number exactly that batch's examples (this rank's part of it under
  torch.distributed), so several backward calls over parts of *one* planned batch (micro-batches)
  are fine, and anything else is refused before anything is released or modified.

What this cannot see: a loop that takes batch t from the planned loader and then trains on a
different batch of exactly the same size. The documented loops (``for batch in loader``) never do.

Privacy units (``make_private(..., privacy_unit=...)``): the sampler is a ``UnitSampler`` and
``units(step)`` gives the unit of every row of a batch. Serving a batch (``serve``) calls
``on_serve(step)``, which hands those units to the clipper before the loop sees the batch, so
that each unit's rows are clipped together.

``PlannedDataLoader`` is a ``torch.utils.data.DataLoader`` whose every pass (``iter``) serves the
steps from the next untaken one to the end of its epoch, as PyTorch loops expect
(``for epoch in range(E): for batch in loader``); ``whole_run=True`` serves every remaining step
in one pass. An epoch is ``steps_per_epoch`` steps (the number of bins, or of steps a cyclic
Poisson epoch takes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opake.errors import OpakeError

__all__ = ["PlanExhaustedError", "PlannedBatches", "PlannedDataLoader", "UnplannedBatchError"]


class PlanExhaustedError(OpakeError, RuntimeError):
    """Every step the privacy plan priced has been taken (or served): a further one is not covered."""


class UnplannedBatchError(OpakeError, RuntimeError):
    """``step()`` was asked to release gradients of something other than the plan's next batch."""


class PlannedBatches:
    """The plan's batches, which of them the loader served last, and the check of a step.

    ``sampler`` is the run's ``BallsInBinsSampler`` or ``CyclicPoissonSampler``; ``part`` is
    ``(rank, world_size)`` (this rank serves ``batch[rank::world_size]``); ``next_step`` returns
    the next untaken step (the optimizer's noise-state step).
    """

    def __init__(self, sampler, n_steps: int, steps_per_epoch: int, part: tuple[int, int] = (0, 1)):
        self.sampler = sampler
        self.n_steps = int(n_steps)
        self.steps_per_epoch = int(steps_per_epoch)
        self.part = part
        self.next_step: Callable[[], int] = lambda: 0
        self.served: int | None = None  # the step whose batch a planned loader handed out last
        self.on_serve: Callable[[int], None] | None = None  # called with the step as its batch is served

    @property
    def epochs(self) -> int:
        return -(-self.n_steps // self.steps_per_epoch)

    def indices(self, step: int) -> list[int]:
        """This rank's part of batch ``step`` (dataset indices)."""
        index, count = self.part
        return self.sampler.batch(step)[index::count].tolist()

    def units(self, step: int) -> list[int] | None:
        """The privacy unit of each row of ``indices(step)``, or None when the unit is the example."""
        units_of_batch = getattr(self.sampler, "units_of_batch", None)
        if units_of_batch is None:
            return None
        index, count = self.part
        return units_of_batch(step)[index::count].tolist()

    def serve(self, step: int) -> None:
        """Record that batch ``step`` is handed to the training loop now (``on_serve`` first)."""
        if self.on_serve is not None:
            self.on_serve(step)
        self.served = step

    def pass_range(self, whole_run: bool) -> range:
        """The steps a pass started now serves: to the end of the next step's epoch, or of the run."""
        start = self.next_step()
        if start >= self.n_steps:
            raise PlanExhaustedError(
                f"all {self.epochs} planned epochs ({self.n_steps} steps) have been served and trained on; "
                f"a further pass would release batches the reported epsilon does not cover. The loop runs "
                f"more epochs than make_private(epochs=...) planned: plan the number of epochs the loop runs"
            )
        stop = self.n_steps if whole_run else min(self.n_steps, (start // self.steps_per_epoch + 1) * self.steps_per_epoch)
        return range(start, stop)

    def check_step(self, step: int, examples: int) -> None:
        """Raise ``UnplannedBatchError`` unless ``examples`` clipped examples are batch ``step``'s."""
        advice = ("train on the batches of private.data_loader, in order, with one optimizer.step() per "
                  "batch (micro-batches of one batch before its step are fine)")
        if self.served != step:
            if self.served is None:
                what = "no batch of the planned loader (private.data_loader) has been served yet"
            elif self.served > step:
                what = (f"the planned loader has already served batch {self.served}: batches were skipped or "
                        f"several loader batches were merged into one step (gradient accumulation over loader "
                        f"batches takes fewer steps than the plan priced)")
            else:
                what = f"the planned loader served batch {self.served} last, not this step's batch"
            raise UnplannedBatchError(
                f"optimizer.step() would release planned step {step}, but {what}; the gradients come from "
                f"batches the accountant did not price (another DataLoader, e.g. transformers.Trainer's "
                f"own). Nothing was released or changed: {advice}"
            )
        expected = len(self.indices(step))
        if examples != expected:
            raise UnplannedBatchError(
                f"the gradients since zero_grad() come from {examples} example(s), but planned batch {step} "
                f"has {expected}{' on this rank' if self.part[1] > 1 else ''}: the step would release "
                f"something other than the planned batch (a different or resized batch, a batch used twice, "
                f"or a missing zero_grad()). Nothing was released or changed: {advice}"
            )


class _PassBatches(torch.utils.data.Sampler):
    """Batch sampler of one pass: the steps ``PlannedBatches.pass_range`` gives when iteration starts."""

    def __init__(self, batches: PlannedBatches, whole_run: bool):
        super().__init__()
        self.batches = batches
        self.whole_run = whole_run
        self.steps: range | None = None  # the pass being served

    def __iter__(self):
        self.steps = self.batches.pass_range(self.whole_run)
        return (self.batches.indices(step) for step in self.steps)

    def __len__(self) -> int:
        try:
            return len(self.batches.pass_range(self.whole_run))
        except PlanExhaustedError:
            return 0


class PlannedDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` over the plan's batches: each pass one epoch (or, ``whole_run``, the rest).

    Built by ``make_private`` (``private.data_loader``, ``private.run_data_loader()``). Batches
    vary in size and can be empty (``collate_fn`` must handle an empty list; the default one
    does). Handing a batch to the loop marks it as served, which ``optimizer.step()`` checks.
    """

    def __init__(self, dataset, batches: PlannedBatches, whole_run: bool = False, **loader_options):
        super().__init__(dataset, batch_sampler=_PassBatches(batches, whole_run), **loader_options)
        self.planned = batches

    def __iter__(self):
        batches = super().__iter__()
        steps = self.batch_sampler.steps
        for step, batch in zip(steps, batches):
            self.planned.serve(step)
            yield batch
