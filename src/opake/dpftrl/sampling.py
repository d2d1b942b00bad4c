"""Samplers that guarantee the participation pattern the accounting assumes.

A sampler decides which examples (indices ``0 .. num_examples - 1``) form the batch of each
step. ``sampler.batch(step)`` returns a sorted int64 tensor of indices; ``sampler.steps(n)``
iterates over the batches of steps ``0 .. n - 1``; ``sampler.participation(n)`` is the
:class:`~opake.dpftrl.participation.Participation` ``(n_steps, min_sep, max_participations)``
that holds for EVERY example whatever the random draws, ready for the noise engine and the
accountant::

    sampler = BallsInBinsSampler(num_examples=len(data), num_bins=100, key=opake.random.key(1))
    context = sampler.participation(n_steps)   # give the same values to mf_gaussian_noise
    grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=sampler.expected_batch_size)
    for step, indices in enumerate(sampler.steps(n_steps)):
        grads, clip_state = grad_fn(params, data[indices], state=clip_state)

=======================  =================  ==========================  =====================
sampler                  batch of step t    min_sep                     max_participations
=======================  =================  ==========================  =====================
BallsInBinsSampler       bin t mod b        num_bins                    ceil(n / num_bins)
CyclicPoissonSampler     Poisson(q) subset  num_groups                  ceil(n / num_groups)
                         of group t mod b
=======================  =================  ==========================  =====================

Adjacency: add/remove of one example (SECURITY.md). Every example's bin or group is drawn
independently of every other example's, as a function of the key and the example's own index
only, and the sampler's structure (``num_bins``, ``num_groups``, ``sample_rate``) is given by
the caller, never derived from the number of examples. So adding or removing one example leaves
the distribution of every other example's participation unchanged (and appending one at the
end leaves every other example's bins, groups and Poisson draws exactly as they were). The
price is that batch sizes vary (a bin holds Binomial(num_examples, 1 / num_bins) examples):
normalize the clipped sum by a constant, ``expected_batch_size``, never by the realized size.
A sampler with batches of exactly ``batch_size`` is not offered: cutting a random order into
fixed-size batches makes one added example push another one out or move others between
batches, which is "x in, y out", twice the sensitivity the add/remove accountant prices
(opake's earlier ``BMinSepSampler`` did that; ``tests/test_end_to_end_privacy.py`` keeps it
as the negative control that the end-to-end audit must reject). If you derive ``num_bins`` from
your dataset's size (``len(data) // batch_size``, as Opacus derives its sampling rate), the
size is treated as public: the guarantee is for the plan you fixed, as for every DP library.

Randomness. Every draw is a function of the sampler's :class:`~opake.random.RngKey` (a
required argument; no sampler picks a seed) through ``key.derive_bytes``: SHAKE-256 output read
as little-endian 64-bit words. Batches are therefore identical in every process, on every
machine and with every numpy/torch version, which matters for a run resumed from a checkpoint:
a bin assignment that changed on resume would break the separation the accounting relies on.
Uniform integers use rejection sampling (exactly uniform); a Bernoulli(q) draw includes an
example when its word is below ``floor(q * 2**64)``, so the inclusion probability is ``q``
exactly for ``q >= 2**-12`` and otherwise below ``q`` by less than ``2**-64`` (never above).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import optree
import torch
import torch.utils.data

from opake._checks import integer_at_least
from opake.dpftrl.participation import Participation
from opake.errors import InvalidArgumentError, InvalidTypeError, OpakeError
from opake.dpftrl.unit_ids import LookAlikeIdsWarning, NaNIdError, UncomparableIdError, unit_numbers
from opake.random import RngKey

__all__ = ["BallsInBinsSampler", "CyclicPoissonSampler", "DatasetNotIndexableError", "DatasetTooSmallError",
           "LookAlikeIdsWarning", "NaNIdError", "PrivacyUnits", "StepBatches", "UncomparableIdError", "UnitSampler",
           "collate_allowing_empty"]

_DOMAIN = "opake.dpftrl.sampling"
_WORDS_PER_CHUNK = 1 << 16  # 512 KiB of hash output per derivation
_REMOVED = {
    "BMinSepSampler": (
        "BMinSepSampler was removed: it cut a random order into batches of exactly batch_size, so "
        "adding one example pushed another out of the run or moved examples between batches, twice "
        "the sensitivity the add/remove accountant prices (its printed epsilon was wrong). Use "
        "BallsInBinsSampler(num_examples, num_bins=B, key=...) with B >= the min_sep you want: "
        "every example is in one random bin, bins are served cyclically (min_sep = num_bins), batch "
        "sizes vary around num_examples / B; normalize by sampler.expected_batch_size"
    ),
}


class RemovedSamplerError(OpakeError, ImportError):
    """A sampler that opake no longer has was imported; the message says why and what to use instead."""


def __getattr__(name: str):
    if name in _REMOVED:
        raise RemovedSamplerError(_REMOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Validation


def _check_key(value) -> RngKey:
    if not isinstance(value, RngKey):
        raise InvalidTypeError(
            f"key must be an opake.random.RngKey, got {value!r} ({type(value).__name__}); make "
            f"one with opake.random.key(seed) from an explicit integer seed (samplers never "
            f"choose a seed themselves)"
        )
    return value


def _check_at_most(name: str, value: int, bound_name: str, bound: int, advice: str) -> None:
    if value > bound:
        raise InvalidArgumentError(f"{name} ({value}) must be <= {bound_name} ({bound}); {advice}")


# ---------------------------------------------------------------------------------------------
# Key-derived draws (pure functions of the key and the parts named; never of a count)


def _random_words(key: RngKey, parts: tuple, count: int) -> np.ndarray:
    """Words ``0 .. count - 1`` of the stream determined by ``(key, parts)`` (uint64).

    Word i depends on ``(key, parts, i)`` only: chunk c is SHAKE-256 output derived from
    ``(*parts, c)``, and an XOF's shorter output is a prefix of its longer one, so asking for
    more words never changes the first ones. This is what makes an appended example leave every
    other example's draws unchanged.
    """
    derive = key.deriver(_DOMAIN)
    chunks = [
        np.frombuffer(derive((*parts, index), 8 * min(_WORDS_PER_CHUNK, count - start)), dtype="<u8")
        for index, start in enumerate(range(0, count, _WORDS_PER_CHUNK))
    ]
    if not chunks:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate(chunks).astype(np.uint64)


def _uniform_below(key: RngKey, parts: tuple, count: int, bound: int) -> np.ndarray:
    """``count`` independent integers, each exactly uniform on ``0 .. bound - 1`` (int64).

    Rejection sampling: a word is accepted when it is below the largest multiple of ``bound``
    that fits in 64 bits, and then reduced modulo ``bound``. Integer i is redrawn from words
    derived from ``(*parts, "redraw", i, attempt)`` until accepted, so it too depends on
    ``(key, parts, i)`` only (rejections have probability below bound / 2**64).
    """
    limit = (1 << 64) - (1 << 64) % bound  # words < limit are accepted; 2**64 when bound is a power of 2
    words = _random_words(key, parts, count)
    result = (words % np.uint64(bound)).astype(np.int64)
    if limit == (1 << 64):
        return result
    derive = key.deriver(_DOMAIN)
    for index in np.flatnonzero(words >= np.uint64(limit)).tolist():
        attempt, word = 0, limit
        while word >= limit:
            attempt += 1
            word = int.from_bytes(derive((*parts, "redraw", index, attempt), 8), "little")
        result[index] = word % bound
    return result


def _bernoulli(key: RngKey, parts: tuple, count: int, probability: float) -> np.ndarray:
    """``count`` independent booleans, True with probability floor(probability * 2**64) / 2**64."""
    if probability >= 1.0:
        return np.ones(count, dtype=bool)
    threshold = int(probability * 2.0**64)  # exact: scaling by a power of two, then truncation
    return _random_words(key, parts, count) < np.uint64(threshold)


def _as_index_tensor(indices: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(indices, dtype=np.int64, copy=True))


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _grouped(assignment: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices sorted by group (ascending within a group) and the groups' start offsets."""
    order = np.argsort(assignment, kind="stable").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(assignment, minlength=num_groups))])
    return _frozen(order), _frozen(offsets.astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Shared behaviour


class _CyclicSampler:
    """Common API of samplers whose step t is served from block ``t mod period`` of a fixed split."""

    def _period(self) -> int:  # number of steps before the blocks repeat
        raise NotImplementedError

    def _min_sep(self) -> int:
        raise NotImplementedError

    def batch(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def steps(self, n_steps: int) -> Iterator[torch.Tensor]:
        """Iterate over the batches of steps ``0 .. n_steps - 1`` (each ``batch(step)``)."""
        n_steps = integer_at_least("n_steps", n_steps, 1)
        return (self.batch(step) for step in range(n_steps))

    def participation(self, n_steps: int) -> Participation:
        """The participation every example is guaranteed to respect over ``n_steps`` steps.

        ``max_participations = ceil(n_steps / period)``: block ``t mod period`` is served at
        most that many times. Raises ValueError unless 1 <= min_sep <= n_steps.
        """
        n_steps = integer_at_least("n_steps", n_steps, 1)
        min_sep = self._min_sep()
        if min_sep > n_steps:
            raise InvalidArgumentError(
                f"n_steps ({n_steps}) must be >= min_sep ({min_sep}) of this {type(self).__name__}: "
                f"with fewer steps some bins/groups are never processed. Train for at least "
                f"{min_sep} steps or use fewer bins/groups"
            )
        return Participation(n_steps, min_sep=min_sep, max_participations=-(-n_steps // self._period()))

    def batch_sampler(self, n_steps: int, start_step: int = 0, part: tuple[int, int] | None = None) -> StepBatches:
        """The batches of steps ``start_step .. n_steps - 1`` as a torch batch sampler.

        ``DataLoader(dataset, batch_sampler=sampler.batch_sampler(n_steps))`` yields exactly
        ``batch(step)`` for every step in order, so the loader keeps this sampler's guarantee.
        Batches can be empty (a bin with no example): torch's default collate cannot collate an
        empty list, so pass ``collate_fn=collate_allowing_empty(dataset[0])`` or use
        :meth:`data_loader`. ``start_step`` resumes a run mid-way. ``part=(index, count)``
        serves only ``batch(step)[index::count]``, the index-th of count disjoint parts of every
        batch (data-parallel ranks, each clipping its part; the parts add up to the batch).
        """
        return StepBatches(self, n_steps, start_step, part)

    def data_loader(self, dataset, n_steps: int, start_step: int = 0, part: tuple[int, int] | None = None,
                    **loader_options) -> torch.utils.data.DataLoader:
        """A ``torch.utils.data.DataLoader`` over ``dataset`` serving this sampler's batches.

        ``len(dataset)`` must equal ``num_examples`` (index i is example i); empty batches are
        collated into zero-length tensors (``collate_allowing_empty``) unless ``collate_fn`` is
        given. Other keyword arguments go to the DataLoader (``num_workers``, ``pin_memory``, ...);
        ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last`` are refused: they would replace
        the batches whose participation the accountant priced.
        """
        options = sampled_loader_options(self, dataset, loader_options, "data_loader()",
                                         "size them with the sampler (num_bins, num_groups)")
        return torch.utils.data.DataLoader(dataset, batch_sampler=self.batch_sampler(n_steps, start_step, part),
                                           **options)

    def part_of_batch(self, step: int, part: tuple[int, int]) -> torch.Tensor:
        """Rank ``index``'s part of batch ``step`` among ``count`` ranks (``part = (index, count)``):
        rows ``index, index + count, ...``; the parts of all ranks add up to the batch."""
        index, count = part
        return self.batch(step)[index::count]

    @staticmethod
    def _step(step) -> int:
        return integer_at_least("step", step, 0)


class StepBatches(torch.utils.data.Sampler):
    """A sampler's batches of steps ``start_step .. n_steps - 1``, as lists of indices: a torch
    batch sampler (``DataLoader(dataset, batch_sampler=...)``); build it with
    ``sampler.batch_sampler(n_steps)``. Iterating it again yields the same batches."""

    def __init__(self, sampler: _CyclicSampler, n_steps: int, start_step: int = 0, part: tuple[int, int] | None = None):
        super().__init__()
        self.sampler = sampler
        self.n_steps = integer_at_least("n_steps", n_steps, 1)
        self.start_step = integer_at_least("start_step", start_step, 0)
        _check_at_most("start_step", self.start_step, "n_steps", self.n_steps, "start at a step of the run")
        index, count = (0, 1) if part is None else part
        count = integer_at_least("part count", count, 1)
        index = integer_at_least("part index", index, 0)
        _check_at_most("part index", index, "part count - 1", count - 1, "parts are numbered from 0")
        self.part = (index, count)

    def __iter__(self) -> Iterator[list[int]]:
        return (self.sampler.part_of_batch(step, self.part).tolist() for step in range(self.start_step, self.n_steps))

    def __len__(self) -> int:
        return self.n_steps - self.start_step


class DatasetNotIndexableError(OpakeError, TypeError):
    """The dataset is not map-style (``len(dataset)`` and ``dataset[i]``): a sampler puts example i in
    its bin or group by index, so it cannot serve an ``IterableDataset``."""


class DatasetTooSmallError(OpakeError, ValueError):
    """The dataset is empty, or holds fewer examples (or users) than one batch of an epoch."""


def require_map_style(dataset, caller: str) -> None:
    """Refuse a dataset the samplers cannot index: an ``IterableDataset``, or anything without
    ``__len__`` and ``__getitem__``. ``caller`` names the call, for the refusal."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    kind = type(dataset)
    if iterable or not (hasattr(kind, "__len__") and hasattr(kind, "__getitem__")):
        what = "an IterableDataset" if iterable else f"{kind.__name__}, which lacks __len__ or __getitem__"
        raise DatasetNotIndexableError(
            f"{caller} needs a map-style dataset of known length, got {what}: a private run samples by index "
            f"(example i goes in a random bin drawn from the key and i, and step t serves the examples of its "
            f"bin as dataset[i]), and the number of examples fixes the plan. Materialize the examples first: "
            f"dataset = list(iterable_dataset) when it fits in memory, datasets.Dataset.from_list(list("
            f"streaming.take(n))) for a Hugging Face streaming dataset, or a torch Dataset with __len__ and "
            f"__getitem__ over your storage"
        )


def steps_per_epoch_of(num_drawn: int, batch_size: int, *, users: bool = False) -> int:
    """Steps of one epoch: ``num_drawn // batch_size`` (units drawn: examples, or users); refuses 0
    (``DatasetTooSmallError``: an empty dataset, or fewer units than one batch)."""
    steps = num_drawn // batch_size
    if num_drawn == 0:
        units = "privacy units (users)" if users else "examples"
        raise DatasetTooSmallError(
            f"the dataset is empty (len(dataset) == 0): there is nothing to sample a batch from. Pass the "
            f"training data: a map-style dataset with at least batch_size={batch_size} {units}"
        )
    if steps < 1:
        drawn = f"{num_drawn} privacy units (users)" if users else f"{num_drawn} examples"
        raise DatasetTooSmallError(
            f"the dataset is too small: it has {drawn}, fewer than batch_size={batch_size}, so an epoch would "
            f"not hold one batch; use batch_size <= {num_drawn} or more data"
            + (" (with privacy_unit, batch_size counts users per batch)" if users else "")
        )
    return steps


def sampled_loader_options(sampler, dataset, loader_options: dict, caller: str, advice: str) -> dict:
    """The DataLoader options for ``sampler``'s batches over ``dataset``: the caller's, refusing the
    ones that would replace the batches whose participation the accountant priced, with a
    ``collate_fn`` that collates empty batches unless one is given. ``caller`` and ``advice``
    name the call and how its batches are sized, for the refusal; a dataset that is not map-style
    is refused first (``require_map_style``)."""
    require_map_style(dataset, caller)
    if len(dataset) != sampler.num_examples:
        raise InvalidArgumentError(
            f"the dataset has {len(dataset)} examples but the {type(sampler).__name__} was built for "
            f"num_examples={sampler.num_examples}; build it with num_examples=len(dataset)"
        )
    conflicting = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_options))
    if conflicting:
        raise InvalidTypeError(
            f"{caller} does not take {conflicting}: the batches come from the plan's sampler, whose "
            f"participation the accountant priced; {advice}"
        )
    options = dict(loader_options)
    if options.get("collate_fn") is None:
        options["collate_fn"] = collate_allowing_empty(dataset[0])
    return options


def collate_allowing_empty(example):
    """A ``collate_fn`` like torch's default that also collates an EMPTY batch.

    Variable-size batches (balls in bins, Poisson) can be empty; torch's ``default_collate``
    fails on an empty list. This one collates a non-empty batch with ``default_collate`` and an
    empty one into the structure ``default_collate([example])`` has, with every tensor cut to
    length 0 along the batch dimension (so ``x.shape == (0, *example_shape)``). ``example`` is
    any one item of the dataset (e.g. ``dataset[0]``); its collated leaves must be tensors
    (numbers and numpy arrays become tensors; strings are not supported: pass your own
    ``collate_fn``).
    """
    template = torch.utils.data.default_collate([example])
    leaves = optree.tree_leaves(template, none_is_leaf=True)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise InvalidTypeError(
            "collate_allowing_empty needs examples whose collated leaves are all tensors (tensors, "
            "numbers, numpy arrays, in tuples/lists/dicts); write a collate_fn that handles an "
            "empty batch for this dataset"
        )
    empty = optree.tree_map(lambda leaf: leaf[:0], template, none_is_leaf=True)

    def collate(items):
        return torch.utils.data.default_collate(items) if items else empty

    return collate


# ---------------------------------------------------------------------------------------------
# Samplers


@dataclass(frozen=True)
class BallsInBinsSampler(_CyclicSampler):
    """Each example in one uniformly random bin for the whole run; bins served cyclically.

    Once, at construction, every example is put in one of ``num_bins`` bins, independently and
    uniformly at random: example i's bin is a function of ``key`` and ``i`` only. Step t's batch
    is bin ``t mod num_bins``. This is the scheme ``opake.dpftrl.accounting.allocation.balls_in_bins(inner,
    num_bins, n_steps)`` prices, and under add/remove adjacency one added or removed example
    changes no other example's bin distribution (module docstring).

    Guarantee (for every example and every draw): it appears only at steps ``t = j mod
    num_bins`` for its bin j, so any two appearances are exactly ``num_bins`` steps apart (a
    multiple of it) and there are at most ``ceil(n_steps / num_bins)`` of them:
    ``participation(n_steps) == Participation(n_steps, num_bins, ceil(n_steps / num_bins))``.

    Batch sizes vary: a bin holds Binomial(num_examples, 1 / num_bins) examples and may be
    empty (``batch`` then returns an empty tensor; ``clipped_grad`` handles it). Normalize the
    gradient sum by the expected size ``num_examples / num_bins``, not by the realized size.
    ``num_bins`` must be at most ``num_examples``: with more bins than examples some bins are
    certainly empty, which is almost always a mistake (swapped arguments).
    """

    num_examples: int
    num_bins: int
    key: RngKey
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        num_examples = integer_at_least("num_examples", self.num_examples, 1)
        num_bins = integer_at_least("num_bins", self.num_bins, 1)
        _check_at_most("num_bins", num_bins, "num_examples", num_examples, "use at most one bin per example")
        key = _check_key(self.key)
        order, offsets = _grouped(_uniform_below(key, ("balls_in_bins", num_bins), num_examples, num_bins), num_bins)
        for name, value in (("num_examples", num_examples), ("num_bins", num_bins),
                            ("_order", order), ("_offsets", offsets)):
            object.__setattr__(self, name, value)

    def _period(self) -> int:
        return self.num_bins

    def _min_sep(self) -> int:
        return self.num_bins

    @property
    def expected_batch_size(self) -> float:
        """num_examples / num_bins: the constant ``normalize_by`` for ``clipped_grad``."""
        return self.num_examples / self.num_bins

    def accountant(self, strategy, n_steps: int, method=None):
        """noise multiplier -> the privacy process of ``strategy`` on these bins for ``n_steps``
        steps (``opake.dpftrl.accounting.balls_in_bins``); ``method`` None is the tightest bound
        proven for adaptively chosen gradients, else "rigorous", "amplified" or "allocation_pld"."""
        from opake.dpftrl.accounting.accountant import balls_in_bins_accountant

        return balls_in_bins_accountant(strategy, self.num_bins, n_steps, method)

    def batch(self, step: int) -> torch.Tensor:
        """Indices (int64, ascending) of the examples in bin ``step mod num_bins``."""
        bin_index = self._step(step) % self.num_bins
        return _as_index_tensor(self._order[self._offsets[bin_index]:self._offsets[bin_index + 1]])


@dataclass(frozen=True)
class CyclicPoissonSampler(_CyclicSampler):
    """Random groups served cyclically, each Poisson-sampled when served (Band23 Thm 4).

    Once, at construction, every example is put in one of ``num_groups`` groups, independently
    and uniformly at random (example i's group is a function of ``key`` and ``i`` only). At step
    t, each member of group ``t mod num_groups`` is included independently with probability
    ``sample_rate``, with fresh randomness derived from ``(key, t)``: ``batch(step)`` is a pure
    function of the key and the step. Batch sizes vary (expected ``num_examples * sample_rate /
    num_groups``); normalize by ``expected_batch_size``.

    Guarantee (for every example and every draw): an example can appear only at steps
    ``t = g mod num_groups`` for its group g, so any two appearances are a positive multiple of
    ``num_groups`` apart, at most ``ceil(n_steps / num_groups)`` of them:
    ``participation(n_steps) == Participation(n_steps, num_groups, ceil(n_steps / num_groups))``.
    The Poisson amplification of Band23 Thm 4 (``opake.dpftrl.accounting.poisson``) applies to
    banded strategies (BandMF, identity) only, not to a BLT. Band23 analyses a fixed partition;
    here the partition is random but drawn independently of the data and per example, and the
    theorem holds for every partition, so it holds for the mixture.
    """

    num_examples: int
    num_groups: int
    sample_rate: float
    key: RngKey
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        num_examples = integer_at_least("num_examples", self.num_examples, 1)
        num_groups = integer_at_least("num_groups", self.num_groups, 1)
        _check_at_most("num_groups", num_groups, "num_examples", num_examples, "every group needs an example")
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise InvalidTypeError(f"sample_rate must be a real number, got {rate!r} ({type(rate).__name__})")
        rate = float(rate)
        if not (0.0 < rate <= 1.0):
            raise InvalidArgumentError(f"sample_rate must be in (0, 1], got {rate!r}")
        key = _check_key(self.key)
        groups = _uniform_below(key, ("cyclic_poisson.groups", num_groups), num_examples, num_groups)
        order, offsets = _grouped(groups, num_groups)
        for name, value in (("num_examples", num_examples), ("num_groups", num_groups),
                            ("sample_rate", rate), ("_order", order), ("_offsets", offsets)):
            object.__setattr__(self, name, value)

    def accountant(self, strategy, n_steps: int, method=None):
        """noise multiplier -> the privacy process of ``strategy`` on this sampling for ``n_steps``
        steps: Band23 Thm 4 by PLD (``opake.dpftrl.accounting.poisson``; ``method`` None or "pld").
        The strategy's bands must fit in the groups (a band wider than ``num_groups`` would let
        one example's participations interact, which the theorem does not cover)."""
        from opake.dpftrl.accounting.accountant import poisson_accountant
        from opake.dpftrl.accounting.methods import AccountingMethod
        from opake.dpftrl.accounting.poisson import UnsupportedAmplificationError, strategy_bands

        if method is not None and AccountingMethod(method) is not AccountingMethod.POISSON_PLD:
            raise InvalidArgumentError(
                f"cyclic Poisson sampling is priced by method='pld' (Band23 Thm 4), got {method!r}"
            )
        bands = strategy_bands(strategy)
        if bands > self.num_groups:
            raise UnsupportedAmplificationError(
                f"a strategy of {bands} bands on cyclic Poisson sampling with {self.num_groups} groups: Band23 Thm 4 "
                f"needs at least as many groups as bands; build the sampler with num_groups={bands}"
            )
        return poisson_accountant(strategy, self.sample_rate, n_steps)

    @property
    def expected_batch_size(self) -> float:
        """num_examples * sample_rate / num_groups: the constant ``normalize_by`` for ``clipped_grad``."""
        return self.num_examples * self.sample_rate / self.num_groups

    def _period(self) -> int:
        return self.num_groups

    def _min_sep(self) -> int:
        return self.num_groups

    def _members(self, step: int) -> np.ndarray:
        group = step % self.num_groups
        return self._order[self._offsets[group]:self._offsets[group + 1]]

    def group(self, step: int) -> torch.Tensor:
        """All members (int64, ascending) of group ``step mod num_groups``, sampled or not."""
        return _as_index_tensor(self._members(self._step(step)))

    def batch(self, step: int) -> torch.Tensor:
        """Indices (int64, ascending) of the members of group ``step mod num_groups`` drawn at ``step``.

        Member j (in ascending index order) is included when word j of the stream for
        ``(num_groups, step)`` is below the threshold: an example appended to the dataset comes
        last in its group, so it never changes the other members' draws.
        """
        step = self._step(step)
        members = self._members(step)
        parts = ("cyclic_poisson.step", self.num_groups, step)
        return _as_index_tensor(members[_bernoulli(self.key, parts, members.size, self.sample_rate)])


# ---------------------------------------------------------------------------------------------
# Privacy units other than examples (user-level privacy)


@dataclass(frozen=True)
class PrivacyUnits:
    """Which protected unit (user, document, session) each example belongs to.

    ``unit_of_example[i]`` is the unit number of example i; units are numbered ``0 .. num_units
    - 1`` in order of first appearance (``from_ids``), so appending a new unit's examples at the
    end of the data set leaves every other unit's number, and hence its bins and draws, unchanged.
    ``examples(u)`` are unit u's example indices, ascending.
    """

    unit_of_example: np.ndarray
    _order: np.ndarray = field(init=False, repr=False, compare=False)
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        units = np.asarray(self.unit_of_example)
        if units.ndim == 1 and units.size == 0:
            raise DatasetTooSmallError(
                "the dataset is empty: privacy_unit gives no ids (one per example), so there is no user to "
                "sample. Pass the training data and one id per example"
            )
        if units.ndim != 1 or units.size == 0 or not np.issubdtype(units.dtype, np.integer) or units.min() < 0:
            raise InvalidArgumentError("unit_of_example must be a non-empty 1-D array of non-negative unit numbers")
        order, offsets = _grouped(units.astype(np.int64), int(units.max()) + 1)
        if np.any(offsets[1:] == offsets[:-1]):
            raise InvalidArgumentError(
                "unit numbers must be 0 .. num_units - 1 with no gap (use PrivacyUnits.from_ids)"
            )
        for name, value in (("unit_of_example", _frozen(units.astype(np.int64))), ("_order", order),
                            ("_offsets", offsets)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_ids(cls, ids) -> "PrivacyUnits":
        """Units from one id per example (a sequence, or a tensor or array whose first dimension is the
        examples), numbered by first appearance; ids equal by value are one unit.

        Ids are read by value at any depth (``opake.dpftrl.unit_ids``): tuples and lists, tensors and numpy arrays
        (one element: its value; more: the tuple of their values) and numpy scalars, nested in each
        other, become one key of plain Python values, so ``(torch.tensor(3), "a")``, ``(3, "a")`` and
        ``[np.int64(3), "a"]`` are one user. A tensor hashes by identity: grouped as they come, equal
        tensor ids would each make a unit of their own and turn user-level privacy into example-level
        privacy silently. What cannot be compared by value is refused: ids equal by identity only
        (``UncomparableIdError``) and NaN anywhere in an id (``NaNIdError``). Ids that look alike
        (``3`` and ``"3"``, one name in its NFC and NFD forms) or that Python merges across types
        (``1``, ``1.0``, ``True``) are grouped by value and reported in one ``LookAlikeIdsWarning``.
        """
        return cls(np.asarray(unit_numbers(ids), dtype=np.int64))

    @property
    def num_examples(self) -> int:
        return int(self.unit_of_example.size)

    @property
    def num_units(self) -> int:
        return int(self._offsets.size - 1)

    def examples(self, unit: int) -> np.ndarray:
        return self._order[self._offsets[unit]:self._offsets[unit + 1]]


class UnitSampler(_CyclicSampler):
    """A sampler over protected units that serves all the examples of the units it draws.

    ``unit_sampler`` (a ``BallsInBinsSampler`` or ``CyclicPoissonSampler`` built with
    ``num_examples = units.num_units``) decides which units form each step's batch, exactly as it
    would for examples; ``batch(step)`` is the concatenation of those units' examples (unit by
    unit, ascending), ``units_of_batch(step)`` the unit of each row.

    Guarantee: the unit sampler's, for units: ``participation(n_steps)`` holds for every unit
    (all its examples appear together, at the unit's steps only). Adjacency: add/remove one
    unit with all its examples; every unit's draws depend on the key and its own number only,
    so one more unit moves no other. The clipped quantity must be each unit's summed gradient
    (``opake.torch.make_private(..., privacy_unit=...)`` does that) and ``expected_batch_size``
    counts units.
    """

    def __init__(self, unit_sampler, units: PrivacyUnits):
        if not isinstance(unit_sampler, (BallsInBinsSampler, CyclicPoissonSampler)):
            raise InvalidTypeError(f"unit_sampler must be a BallsInBinsSampler or CyclicPoissonSampler, "
                                   f"got {type(unit_sampler).__name__}")
        if unit_sampler.num_examples != units.num_units:
            raise InvalidArgumentError(
                f"the unit sampler was built for {unit_sampler.num_examples} units, the data have "
                f"{units.num_units}; build it with num_examples=units.num_units"
            )
        self.unit_sampler = unit_sampler
        self.units = units

    @property
    def num_examples(self) -> int:
        return self.units.num_examples

    @property
    def num_units(self) -> int:
        return self.units.num_units

    @property
    def expected_batch_size(self) -> float:
        """Expected units per batch: the constant normalization of the sum of clipped unit gradients."""
        return self.unit_sampler.expected_batch_size

    def __getattr__(self, name):  # num_bins, num_groups, sample_rate, key: the unit sampler's
        if name in ("num_bins", "num_groups", "sample_rate", "key"):
            return getattr(self.unit_sampler, name)
        raise AttributeError(name)

    def accountant(self, strategy, n_steps: int, method=None):
        """The unit sampler's accountant: units are priced as it prices examples."""
        return self.unit_sampler.accountant(strategy, n_steps, method)

    def _period(self) -> int:
        return self.unit_sampler._period()

    def _min_sep(self) -> int:
        return self.unit_sampler._min_sep()

    def _rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        drawn = self.unit_sampler.batch(step).numpy()
        pieces = [self.units.examples(int(unit)) for unit in drawn]
        rows = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        owners = np.repeat(drawn, [piece.size for piece in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        return rows, owners

    def batch(self, step: int) -> torch.Tensor:
        """Indices of every example of the units drawn at ``step``, unit by unit."""
        return _as_index_tensor(self._rows(self._step(step))[0])

    def units_of_batch(self, step: int) -> torch.Tensor:
        """The unit number of each row of ``batch(step)``."""
        return _as_index_tensor(self._rows(self._step(step))[1])
