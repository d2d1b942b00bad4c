"""What an Opacus call's options and DataLoader say, read into ``make_private``'s terms.

Opacus options that would change what is run are refused before anything is planned, saying
what opake does instead; the DataLoader gives the dataset, the batch size (Opacus' expected
batch size) and the loading settings (workers, pinning, collate function), while its
``shuffle``/``sampler`` give way to the planned batches.

The loader a previous ``make_private`` of the adapter returned is read as the DataLoader it was
made from (``remember_source``): the same dataset, batch size and loading settings, so a new
engine given it plans a fresh run over the same data, as Opacus does when its ``DPDataLoader``
is privatized again (its ``examples/mnist.py --n-runs`` loop reuses the returned loader). A
planned loader made by ``opake.torch.make_private`` itself records no batch size and is refused.
"""

from __future__ import annotations

import torch

from opake.errors import InvalidArgumentError, InvalidTypeError
from opake.torch.loader import PlannedDataLoader

__all__ = ["GRAD_SAMPLE_MODES", "from_loader", "own_batch_sampler", "refuse_other_options", "remember_source"]

# Opacus' ways of computing per-example gradients: one exact per-example clipping serves them all,
# so the choice changes nothing a step computes.
GRAD_SAMPLE_MODES = ("hooks", "ghost", "functorch", "ew")

# The attribute of a planned loader returned by the adapter that holds what it was made from.
_SOURCE = "_opacus_source"

# DataLoader settings that only say how batches are loaded (not which examples): passed through.
_LOADING_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "persistent_workers", "pin_memory_device")


def refuse_other_options(*, clipping="flat", max_grad_norm=1.0, grad_sample_mode="hooks", noise_generator=None,
                         batch_first=True, wrap_model=True, rand_on_empty=False) -> None:
    """Raise ``ValueError`` for an Opacus option other than its default that opake does not offer
    (``clipping`` and ``max_grad_norm`` are read by ``opake.torch.opacus.clipping``)."""
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise InvalidArgumentError(
            f"grad_sample_mode must be one of Opacus' modes {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}: "
            f"each is accepted and means the same here (opake clips each example's gradient exactly with "
            f"its own hooks on the module, ghost norms where a layer allows)"
        )
    if noise_generator is not None:
        raise InvalidArgumentError("noise_generator is not available: the run's key seeds the batches and the noise; "
                                   "torch.manual_seed(s) before make_private reproduces a run (secure_mode=False), "
                                   "or pass key=opake.random.key(seed)")
    # wrap_model: opake never wraps the module (the returned one is yours, with hooks), which is what
    # Opacus' wrap_model=False gives; both values are accepted.
    if rand_on_empty:
        raise InvalidArgumentError(
            "rand_on_empty=True is not available: an empty planned batch is a zero-length batch; "
            "the optimizer step still adds that step's noise (skip the backward when it is empty)"
        )


def remember_source(planned_loader: PlannedDataLoader, batch_size: int, loader_options: dict) -> None:
    """Record on the adapter's planned loader the batch size and loading options it was made from."""
    setattr(planned_loader, _SOURCE, (batch_size, dict(loader_options)))


def from_loader(data_loader) -> tuple:
    """(dataset, batch size, loading options) of the caller's DataLoader (for a planned loader the
    adapter returned, of the DataLoader it was made from: module docstring)."""
    if not isinstance(data_loader, torch.utils.data.DataLoader):
        raise InvalidTypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    if isinstance(data_loader, PlannedDataLoader):
        source = getattr(data_loader, _SOURCE, None)
        if source is None:
            raise InvalidArgumentError(
                "data_loader is the planned loader of a run made by opake.torch.make_private, which "
                "does not record the batch size it was planned with: pass a "
                "DataLoader(dataset, batch_size=B) for the new run"
            )
        batch_size, options = source
        return data_loader.dataset, batch_size, dict(options)
    dataset = data_loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise InvalidArgumentError(
            "data_loader must read a map-style dataset with len() (indexable examples): opake draws "
            "every batch by example index"
        )
    if data_loader.batch_size is None:
        raise InvalidArgumentError(
            "data_loader has no fixed batch_size (it was built with a batch_sampler or "
            "batch_size=None): build it with DataLoader(dataset, batch_size=B); opake uses B as the "
            "expected batch size of its batches"
        )
    options = {name: getattr(data_loader, name) for name in _LOADING_OPTIONS if hasattr(data_loader, name)}
    if data_loader.num_workers > 0:
        options["prefetch_factor"] = data_loader.prefetch_factor
    if data_loader.collate_fn is not torch.utils.data.default_collate:
        options["collate_fn"] = data_loader.collate_fn  # the default gives way to one allowing empty batches
    return dataset, data_loader.batch_size, options


def own_batch_sampler(data_loader, batch_size: int):
    """The batches ``data_loader`` itself would serve (its batch sampler); for a planned loader the
    adapter returned, the dataset's examples in order, ``batch_size`` at a time."""
    if isinstance(data_loader, PlannedDataLoader):
        indices = torch.utils.data.SequentialSampler(range(len(data_loader.dataset)))
        return torch.utils.data.BatchSampler(indices, batch_size, drop_last=False)
    return data_loader.batch_sampler
