"""``BatchMemoryManager``: Opacus' way to run a planned batch in physical parts that fit in memory.

    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=64,
                            optimizer=optimizer) as loader:
        for x, y in loader:                 # parts of at most 64 examples
            optimizer.zero_grad(); loss(model(x), y).backward(); optimizer.step()

The loader it gives serves, in order, the planned batches of one epoch (the pass ``data_loader``
would serve, from the run's next step), each cut into consecutive parts of at most
``max_physical_batch_size`` examples (an empty planned batch is one empty part). Before handing
out a part it tells the optimizer whether that part ends its planned batch
(``OpacusDPOptimizer.signal_skip_step``): the steps after the other parts release nothing and
their ``zero_grad()`` keeps the clipped sums, so each planned batch gets one real step over all
its examples, clipped one by one. The trained model is the one the loop without the manager
gives, up to the order of floating-point additions (tests/torch/opacus/test_compat.py). The
noise, the accounting and the check of each step are unchanged.
"""

from __future__ import annotations

import torch

from opake._checks import integer_at_least
from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.torch.loader import PlannedDataLoader
from opake.torch.opacus.optimizer import OpacusDPOptimizer

__all__ = ["BatchMemoryManager"]


class BatchMemoryManager:
    """Context manager giving a loader of physical parts of the planned batches (module docstring)."""

    def __init__(self, *, data_loader, max_physical_batch_size: int, optimizer):
        if not isinstance(data_loader, PlannedDataLoader):
            raise InvalidTypeError(f"data_loader must be the loader make_private returned (the planned batches), got "
                                   f"{type(data_loader).__name__}")
        if not isinstance(optimizer, OpacusDPOptimizer):
            raise InvalidTypeError(f"optimizer must be the optimizer opake.torch.PrivacyEngine returned, got "
                                   f"{type(optimizer).__name__}")
        if optimizer.run is not data_loader.run:
            raise InvalidArgumentError(
                "data_loader and optimizer belong to different runs; pass the pair make_private returned"
            )
        self.data_loader = data_loader
        self.optimizer = optimizer
        self.max_physical_batch_size = integer_at_least("max_physical_batch_size", max_physical_batch_size)

    def __enter__(self) -> "PhysicalBatchLoader":
        return PhysicalBatchLoader(self.data_loader, self.optimizer, self.max_physical_batch_size)

    def __exit__(self, *exception) -> None:
        return None


class _Parts(torch.utils.data.Sampler):
    """Batch sampler: the parts of one pass's planned batches, and which planned batch each belongs to."""

    def __init__(self, run, max_size: int):
        super().__init__()
        self.run = run
        self.max_size = max_size
        self._cached: tuple | None = None  # (start step, parts, labels) of the pass last laid out

    def layout(self) -> tuple[list, list]:
        """(index lists, (step, first part, last part)) of the pass starting at the run's next step."""
        start = self.run.step
        if self._cached is None or self._cached[0] != start:
            parts, labels = [], []
            for step in self.run.batches.pass_range(start, False):
                rows = self.run.batches.served(step)
                pieces = [rows[i:i + self.max_size] for i in range(0, len(rows), self.max_size)] or [[]]
                parts += pieces
                labels += [(step, index == 0, index == len(pieces) - 1) for index in range(len(pieces))]
            self._cached = (start, parts, labels)
        return self._cached[1], self._cached[2]

    def __iter__(self):
        return iter(self.layout()[0])

    def __len__(self) -> int:
        return len(self.layout()[0])


class PhysicalBatchLoader(torch.utils.data.DataLoader):
    """A DataLoader over the physical parts of one epoch's planned batches (module docstring)."""

    def __init__(self, planned: PlannedDataLoader, optimizer: OpacusDPOptimizer, max_size: int):
        options = dict(num_workers=planned.num_workers, collate_fn=planned.collate_fn, pin_memory=planned.pin_memory,
                       timeout=planned.timeout, worker_init_fn=planned.worker_init_fn,
                       multiprocessing_context=planned.multiprocessing_context,
                       persistent_workers=planned.persistent_workers)
        if planned.num_workers > 0:
            options["prefetch_factor"] = planned.prefetch_factor
        super().__init__(planned.dataset, batch_sampler=_Parts(planned.run, max_size), **options)
        self.run = planned.run
        self.optimizer = optimizer

    def __iter__(self):
        _, labels = self.batch_sampler.layout()
        self.optimizer.clear_skipped_steps()
        batches = super().__iter__()
        for (step, first, last), batch in zip(labels, batches):
            if first:
                self.run.batches.check_dataset(self.dataset)  # the data set is still the plan's
                self.run.serve(step)  # the planned batch is being handed to the loop
            self.optimizer.signal_skip_step(not last)
            yield batch
