"""What every rank of a private run must share, checked (or made true) before anything is released.

Under torch.distributed every rank builds the same plan and serves its part of every planned
batch (``batch[rank::world_size]``). That is the one-process run only if the ranks agree on
what they train:

* **The key**: without ``key=``, rank 0 draws one from the operating system and broadcasts it
  (``shared_key``), so every rank has the same batches and noise.
* **The weights** (replicated runs): rank 0's parameters and buffers are broadcast to the other
  ranks (``broadcast_module``), as ``DistributedDataParallel`` does at construction. Ranks that
  started from different weights would otherwise train apart. A sharded (FSDP2) model has no
  replicas: each parameter row lives on one rank.
* **The data**: every rank must hold the whole data set, the same one; the plan splits each
  batch. ``check_same_dataset`` compares the length and a digest of examples spread over the
  data set (first, last and evenly spaced ones, in full) across ranks, and refuses, on every
  rank, when they differ: ranks reading different data would train on examples the plan never
  priced (a data set of twice the size, priced as one).
"""

from __future__ import annotations

import hashlib
import numbers
import os
import secrets

import numpy as np
import optree
import torch

from opake.dpftrl.noise.distributed.agreement import RankDisagreementError, disagreements
from opake.errors import InvalidArgumentError, OpakeError
from opake.random import RngKey, key as make_key

__all__ = ["LauncherWorldError", "RankDisagreementError", "agree", "broadcast_module", "dataset_digest",
           "launched_world_size", "launcher_restarts", "rank_and_world", "require_one_run", "shared_key"]


class LauncherWorldError(OpakeError, RuntimeError):
    """A launcher started several processes, but this one would plan a private run of its own."""


def _environment_count(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def launcher_restarts() -> int:
    """How many times the launcher (torchrun, torch.distributed.elastic) restarted this worker: its
    ``TORCHELASTIC_RESTART_COUNT``, 0 when not launched that way."""
    return _environment_count("TORCHELASTIC_RESTART_COUNT", 0)


def launched_world_size() -> int:
    """How many processes the launcher started: its ``WORLD_SIZE`` (torchrun, accelerate), 1 without one."""
    return _environment_count("WORLD_SIZE", 1)


def require_one_run(process_group, world_size: int) -> None:
    """Several processes are one run or none: refuse to plan as one process (``world_size`` 1) when the
    launcher's environment says ``WORLD_SIZE`` > 1. Each process would plan a private run of its own
    over the whole data set, each printing one run's epsilon while together they spend several."""
    launched = launched_world_size()
    if world_size == 1 and launched > 1 and process_group is None:
        raise LauncherWorldError(
            f"this process was started by a launcher with WORLD_SIZE={launched}, but torch.distributed is not "
            f"initialized here (or its group has one process): each of the {launched} processes would plan and "
            f"train a private run of its own over the whole data set, spending {launched} budgets while each "
            f"reports one. Initialize the process group before planning (torch.distributed.init_process_group("
            f"'gloo' on CPU, 'nccl' on GPUs)); with transformers on CPU pass --use_cpu "
            f"(TrainingArguments(use_cpu=True)) so that Trainer initializes it; or run one process")

_SAMPLED_EXAMPLES = 16


def rank_and_world(process_group) -> tuple[int, int]:
    """(rank, world size) of ``process_group`` (the default group) when torch.distributed runs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise InvalidArgumentError("process_group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _source(process_group) -> int:
    """The global rank of the group's rank 0."""
    import torch.distributed as dist

    return dist.get_global_rank(process_group, 0) if process_group is not None else 0


def shared_key(process_group, world_size: int) -> RngKey:
    """A fresh 128-bit key from the operating system, the same on every rank (rank 0's)."""
    seed = [secrets.randbits(128)]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(seed, src=_source(process_group), group=process_group)
    return make_key(seed[0])


def broadcast_module(module: torch.nn.Module, process_group) -> None:
    """Rank 0's parameters and buffers on every rank of ``process_group`` (in place, as DDP does)."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            dist.broadcast(tensor.data, src=_source(process_group), group=process_group)


def agree(process_group, world_size: int, failure: BaseException | None = None, **shared) -> None:
    """One collective in which every rank states whether its local work failed and the value of
    every ``shared`` item; then every rank raises alike: its own error if it failed, a
    ``RankDisagreementError`` naming the ranks that failed, or one naming the item the ranks
    disagree on. A rank that fails before a collective of the run would otherwise leave the
    others waiting in it, or pair their collectives with its next ones."""
    if world_size < 2:
        if failure is not None:
            raise failure
        return
    import torch.distributed as dist

    mine = {"failure": None if failure is None else f"{type(failure).__name__}: {failure}", **shared}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=process_group)
    if failure is not None:
        raise failure
    failed = {rank: values["failure"] for rank, values in enumerate(everyone) if values["failure"] is not None}
    if failed:
        raise RankDisagreementError(
            "rank(s) " + ", ".join(f"{rank} ({message})" for rank, message in failed.items())
            + " refused the private run; this rank stops with them. Nothing was trained"
        )
    for item, groups in disagreements(everyone, shared).items():
        seen = "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
        if item == "dataset":
            raise RankDisagreementError(
                f"the ranks hold different data sets (length and digest of sampled examples: {seen}). Every "
                f"rank must hold the whole training set, the same one: the plan puts every example in its "
                f"batches once and splits each batch across the ranks. Pass the full dataset on every rank "
                f"(do not shard it yourself, e.g. with a DistributedSampler or a per-rank split). Nothing was "
                f"trained"
            )
        raise RankDisagreementError(
            f"the ranks disagree on {item} ({seen}); every rank must build the same private run (same "
            f"make_private arguments, key, model structure and sharding). Nothing was trained"
        )


def dataset_digest(dataset) -> tuple[int, str]:
    """The data set's length and a digest of examples spread over it (``agree``'s "dataset")."""
    return len(dataset), _digest(dataset)


def _digest(dataset) -> str:
    """SHA-256 of the examples at evenly spaced positions (first and last included), in full."""
    size = len(dataset)
    positions = sorted({int(round(i * (size - 1) / (_SAMPLED_EXAMPLES - 1))) for i in range(_SAMPLED_EXAMPLES)})
    digest = hashlib.sha256()
    for position in positions if size else []:
        digest.update(str(position).encode())
        for leaf in optree.tree_leaves(dataset[position], none_is_leaf=True):
            digest.update(_leaf_bytes(leaf))
    return digest.hexdigest()


def _leaf_bytes(leaf) -> bytes:
    if isinstance(leaf, torch.Tensor):
        tensor = leaf.detach().to("cpu").contiguous()
        return repr((tensor.dtype, tuple(tensor.shape))).encode() + tensor.view(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(leaf, np.ndarray):
        array = np.ascontiguousarray(leaf)
        return repr((array.dtype.str, array.shape)).encode() + array.tobytes()
    if isinstance(leaf, (str, bytes, numbers.Number, type(None), np.generic)):
        return repr(leaf).encode()
    return repr(type(leaf)).encode() + repr(leaf).encode()
