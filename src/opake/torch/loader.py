"""The planned batches of a private run: the loader that serves them, and the check ``step()`` makes.

The accountant prices one release per planned batch, in order: step t releases the clipped sum
of batch t of the sampler, plus noise. Two things can silently break that, and both are refused
here rather than priced wrongly:

* **Another loader.** A ``transformers.Trainer`` or a second ``DataLoader`` serves shuffled
  fixed-size batches the accountant never priced. ``PlannedDataLoader`` records the step of
  every batch it hands to the training loop (``PrivateRun.serve``); ``DPOptimizer.step()``
  then requires that the batch served last is its own step's batch.
* **Fewer or merged steps.** Gradient accumulation over two loader batches before one step
  would release two planned batches as one. ``step()`` also requires that the examples clipped
  since ``zero_grad()`` number exactly that batch's examples (this rank's part of it under
  torch.distributed), so several backward calls over parts of *one* planned batch (micro-batches)
  are fine, and anything else is refused before anything is released or modified.
* **Changed data.** The sampler put examples ``0 .. n - 1`` in their bins when the run was planned
  over ``n = len(dataset)``: examples added later would never be sampled (nothing was planned for
  them), and removing some leaves batches naming indices that no longer exist or now hold other
  examples. The loader compares ``len(dataset)`` with the plan's ``n`` (one ``len()`` call) before
  it fetches each batch and again as it serves it (workers fetch ahead), and refuses a difference
  (``DatasetChangedError``) before the batch reaches the loop. With ``privacy_unit`` the plan's
  ``n`` is the number of examples the ids were given for.

What this cannot see: a loop that takes batch t from the planned loader and then trains on a
different batch of exactly the same size (the documented loops, ``for batch in loader``, never do),
and a dataset whose examples were replaced in place, keeping its length.

``PlannedDataLoader`` is a ``torch.utils.data.DataLoader`` whose every pass (``iter``) serves the
steps from the next untaken one to the end of its epoch, as PyTorch loops expect
(``for epoch in range(E): for batch in loader``); ``whole_run=True`` serves every remaining step
in one pass. An epoch is ``steps_per_epoch`` steps (the number of bins, or of steps a cyclic
Poisson epoch takes). Which step is next, and which batch was served last, belong to the run
(``opake.torch.run.PrivateRun``); this module only reads them.
"""

from __future__ import annotations

import torch

from opake.errors import OpakeError

__all__ = ["DatasetChangedError", "PlanExhaustedError", "PlannedBatches", "PlannedDataLoader", "UnplannedBatchError"]


class PlanExhaustedError(OpakeError, RuntimeError):
    """Every step the privacy plan priced has been taken (or served): a further one is not covered."""


class UnplannedBatchError(OpakeError, RuntimeError):
    """``step()`` was asked to release gradients of something other than the plan's next batch."""


class DatasetChangedError(OpakeError, RuntimeError):
    """The dataset's length differs from the number of examples the run was planned over (it grew or
    shrank after ``make_private``); raised before the planned loader serves a batch of it."""


class PlannedBatches:
    """The plan's batches as this rank sees them: which examples (and units) each step holds, the
    steps a pass serves, and the check of a step. Holds no state of the run.

    ``sampler`` is the run's ``BallsInBinsSampler`` or ``CyclicPoissonSampler`` (or a
    ``UnitSampler`` over one); ``part`` is ``(rank, world_size)`` (this rank serves
    ``sampler.part_of_batch(step, part)``); ``placeholder``: an empty part is served as one
    placeholder row (sharded models, whose every rank must run each forward and backward).
    """

    def __init__(self, sampler, n_steps: int, steps_per_epoch: int, part: tuple[int, int] = (0, 1),
                 placeholder: bool = False):
        self.sampler = sampler
        self.n_steps = int(n_steps)
        self.steps_per_epoch = int(steps_per_epoch)
        self.part = part
        self.placeholder = placeholder

    @property
    def epochs(self) -> int:
        return -(-self.n_steps // self.steps_per_epoch)

    def indices(self, step: int) -> list[int]:
        """This rank's part of batch ``step`` (dataset indices)."""
        return self.sampler.part_of_batch(step, self.part).tolist()

    def served(self, step: int) -> list[int]:
        """The rows the loader serves for step ``step``: this rank's part, or, when it is empty and
        every rank must run a forward and backward (``placeholder``: a sharded model), example 0
        as a placeholder whose clipped weight is 0 (``PerExampleClipper.expect_placeholder``)."""
        rows = self.indices(step)
        return [0] if self.placeholder and not rows else rows

    def units(self, step: int) -> list[int] | None:
        """The privacy unit of each row of ``indices(step)``, or None when the unit is the example."""
        units_of_batch = getattr(self.sampler, "units_of_batch", None)  # only a UnitSampler has units
        if units_of_batch is None:
            return None
        index, count = self.part
        return units_of_batch(step)[index::count].tolist()

    def pass_range(self, start: int, whole_run: bool) -> range:
        """The steps a pass started at step ``start`` serves: to the end of its epoch, or of the run."""
        if start >= self.n_steps:
            raise PlanExhaustedError(
                f"all {self.epochs} planned epochs ({self.n_steps} steps) have been served and trained on; "
                f"a further pass would release batches the reported epsilon does not cover. The loop runs "
                f"more epochs than make_private(epochs=...) planned: plan the number of epochs the loop runs"
            )
        stop = self.n_steps if whole_run else min(self.n_steps, (start // self.steps_per_epoch + 1) * self.steps_per_epoch)
        return range(start, stop)

    def check_dataset(self, dataset) -> None:
        """Raise ``DatasetChangedError`` unless ``dataset`` holds the plan's number of examples."""
        planned, current = self.sampler.num_examples, len(dataset)
        if current == planned:
            return
        if current > planned:
            what = (f"it grew after make_private, and the {current - planned} new example(s) would never be "
                    f"sampled: the sampler drew bins for examples 0..{planned - 1} only")
        else:
            what = ("it shrank after make_private, and the planned batches name examples that no longer exist "
                    "or now stand at other indices")
        users = getattr(self.sampler, "units_of_batch", None) is not None  # only a UnitSampler has units
        raise DatasetChangedError(
            f"the dataset holds {current} examples now, but the run was planned over {planned}"
            f"{' (the examples privacy_unit gave ids for)' if users else ''}: {what}. Nothing was served or "
            f"released. Keep the dataset as it was for the whole run, or plan a new run over the new data "
            f"(private.detach(), then make_private with it{', and one id per example' if users else ''}): the "
            f"privacy costs of the two runs add up"
        )

    def check_step(self, step: int, examples: int, served: int | None) -> None:
        """Raise ``UnplannedBatchError`` unless batch ``step`` was ``served`` last and ``examples``
        clipped examples are its examples."""
        advice = ("train on the batches of private.data_loader, in order, with one optimizer.step() per "
                  "batch (micro-batches of one batch before its step are fine)")
        if served != step:
            if served is None:
                what = "no batch of the planned loader (private.data_loader) has been served yet"
            elif served > step:
                what = (f"the planned loader has already served batch {served}: batches were skipped or "
                        f"several loader batches were merged into one step (gradient accumulation over loader "
                        f"batches takes fewer steps than the plan priced)")
            else:
                what = f"the planned loader served batch {served} last, not this step's batch"
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
    """Batch sampler of one pass: the steps from the run's next step, as iteration starts, each
    checked against ``dataset``'s length before its indices go to the fetcher."""

    def __init__(self, run, dataset, whole_run: bool):
        super().__init__()
        self.run = run
        self.dataset = dataset
        self.whole_run = whole_run
        self.steps: range | None = None  # the pass being served

    def __iter__(self):
        self.steps = self.run.batches.pass_range(self.run.step, self.whole_run)
        return self._indices(self.steps)

    def _indices(self, steps: range):
        for step in steps:
            # Before the fetch: a shrunk dataset would otherwise fail on a missing index (or serve
            # another example at it), a grown one would serve batches that leave its new examples out.
            self.run.batches.check_dataset(self.dataset)
            yield self.run.batches.served(step)

    def __len__(self) -> int:
        try:
            return len(self.run.batches.pass_range(self.run.step, self.whole_run))
        except PlanExhaustedError:
            return 0


class PlannedDataLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` over the plan's batches: each pass one epoch (or, ``whole_run``, the rest).

    Built by ``make_private`` (``private.data_loader``, ``private.run_data_loader()``) over the
    run (``PrivateRun``). Batches vary in size and can be empty (``collate_fn`` must handle an
    empty list; the default one does). Handing a batch to the loop tells the run it was served
    (``run.serve(step)``), which ``optimizer.step()`` checks. A dataset whose length is no longer
    the plan's is refused before each batch is fetched and as it is served (``DatasetChangedError``).
    """

    def __init__(self, dataset, run, whole_run: bool = False, **loader_options):
        super().__init__(dataset, batch_sampler=_PassBatches(run, dataset, whole_run), **loader_options)
        self.run = run

    @property
    def planned(self) -> PlannedBatches:
        return self.run.batches

    def __iter__(self):
        batches = super().__iter__()
        steps = self.batch_sampler.steps
        for step, batch in zip(steps, batches):
            # Again as the batch is served: worker processes fetch batches ahead of the loop.
            self.run.batches.check_dataset(self.dataset)
            self.run.serve(step)
            yield batch
