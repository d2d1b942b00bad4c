"""How the clipped sums of one step meet across processes, and where the noised gradient lands.

A private step has three parts that depend on how the model is spread over processes: forming
the global clipped sum from each process's part of the batch, adding the noise once, and writing
the noised gradient where the optimizer reads it. ``DPOptimizer`` asks its reduction for each:

* ``SingleProcess``: the sum is the process's own; ``mf_gaussian_noise`` adds the noise.
* ``Replicated`` (every rank holds the whole model, torch.distributed with more than one rank):
  the clipped sums are all-reduced (one collective per dtype; clipping is per example, so the
  sum of the parts is the clipped sum of the batch), each rank noises the parameters it owns
  with ``sharded_mf_gaussian_noise`` and one all-gather shares the noised gradient, so every
  rank applies the same update (docs/distributed.md).
* ``Sharded`` (FSDP2: the module went through ``torch.distributed.fsdp.fully_shard``, every
  parameter is a DTensor sharded along dimension 0): each rank clips its own examples, which
  live on that rank only (FSDP gathers each layer's weights for its forward and backward), so
  the per-example norms need no communication. The clipped sums (full-size, per rank) are
  reduce-scattered into the ranks' shards, one bucket of bounded size at a time (each full-size
  sum is dropped once it is in its bucket: the step's transient is a bucket, not copies of the
  model), each rank noises its own shard from the shared (key, step, path, index) draws with
  ``shard_mf_gaussian_noise`` (no collective), and the noised shard becomes the DTensor gradient
  the optimizer steps. Autograd's
  own gradients of the layers' weights go to FSDP's unsharded parameters; the guard takes them
  there (``autograd_parameters``), so FSDP has nothing unclipped to reduce-scatter.

The noise is a function of (key, step, parameter path, element index), whatever the reduction:
a run equals the one-process run with the same key up to the order of float summation.
"""

from __future__ import annotations

import math

import torch

from opake.dpftrl.noise import mf_gaussian_noise, shard_mf_gaussian_noise, sharded_mf_gaussian_noise
from opake.errors import OpakeError
from opake.torch.ranks import RankDisagreementError

__all__ = ["Replicated", "Sharded", "ShardingError", "SingleProcess"]

# Elements of one reduce-scatter's send buffer on each rank (16 MiB of float32): large enough that
# a collective's latency is small beside its transfer, small beside a model worth sharding.
BUCKET_ELEMENTS = 2**22


class ShardingError(OpakeError, ValueError):
    """A model sharded in a way the private step cannot reduce and noise shard by shard."""


class SingleProcess:
    """One process holds the model and the whole batch."""

    rank, world_size = 0, 1
    process_group = None  # read by make_private when it draws a key (opake.torch.ranks.shared_key)

    def autograd_parameters(self, module, parameters: dict) -> dict:
        """The tensors autograd accumulates each parameter's gradient into (name -> tensor)."""
        return parameters

    def agree(self, step: int, failure: BaseException | None) -> None:
        """Raise ``failure`` (this process's refusal of the step), after the other ranks know of it."""
        if failure is not None:
            raise failure

    def noise(self, template: dict, strategy, **engine_arguments):
        """The noise engine's pair ``(noise_fn, noise_state)`` for ``template`` (name -> tensor)."""
        return mf_gaussian_noise(template, strategy, **engine_arguments)

    def reduce(self, sums: dict) -> dict:
        """The clipped sums of the whole batch, from this process's part (here: all of it)."""
        return sums

    def write(self, parameters: dict, noised: dict) -> None:
        """Put the noised gradient where the optimizer reads it."""
        for name, parameter in parameters.items():
            parameter.grad = noised[name]


class _Group(SingleProcess):
    """What the multi-process reductions share: the group, and agreement on each step."""

    def agree(self, step: int, failure: BaseException | None) -> None:
        """One small all-reduce of every rank's verdict on the step, before its first large
        collective: a rank that refuses (an unplanned batch, a parameter used outside its layer,
        a NaN) would otherwise leave the others waiting in the reduction. Every rank then raises,
        the refusing ones their own error; nothing was reduced, noised or released."""
        import torch.distributed as dist

        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        flags[self.rank] = failure is not None
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.process_group)
        if failure is not None:
            raise failure
        failed = [rank for rank in range(self.world_size) if flags[rank]]
        if failed:
            raise RankDisagreementError(
                f"rank(s) {failed} refused step {step} (their errors say why); this rank stops with them. "
                f"Nothing was reduced, noised or released; fix the cause and restore every rank from its "
                f"checkpoint"
            )


class Replicated(_Group):
    """Every rank of ``process_group`` holds the whole model and clips its part of each batch."""

    def __init__(self, process_group, rank: int, world_size: int, ownership: str = "tensors", device=None):
        self.process_group = process_group
        self.rank, self.world_size = rank, world_size
        self.ownership = ownership
        self.device = torch.device("cpu") if device is None else device

    def noise(self, template: dict, strategy, **engine_arguments):
        return sharded_mf_gaussian_noise(template, strategy, process_group=self.process_group,
                                         ownership=self.ownership, **engine_arguments)

    def reduce(self, sums: dict) -> dict:
        """The sum over ranks of every rank's clipped sums: one all-reduce per dtype."""
        import torch.distributed as dist

        result = {}
        for dtype in sorted({tensor.dtype for tensor in sums.values()}, key=str):
            names = [name for name, tensor in sums.items() if tensor.dtype == dtype]
            flat = torch.cat([sums[name].reshape(-1) for name in names])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            for name, piece in zip(names, flat.split([sums[name].numel() for name in names])):
                result[name] = piece.view(sums[name].shape)
        return result


class Sharded(_Group):
    """Every rank of ``process_group`` holds the dim-0 shard of every parameter (FSDP2 DTensors)."""

    def __init__(self, parameters: dict, process_group, rank: int, world_size: int,
                 bucket_elements: int = BUCKET_ELEMENTS):
        self.process_group = process_group
        self.rank, self.world_size = rank, world_size
        self.device = next(iter(parameters.values())).device
        self.rows = {name: _shard_rows(name, p, rank, world_size) for name, p in parameters.items()}
        self.bucket_elements = bucket_elements

    def autograd_parameters(self, module, parameters: dict) -> dict:
        """FSDP's unsharded parameters, which autograd accumulates into (stable across steps; read by
        gathering every FSDP module once, then resharding)."""
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for fsdp_module in sharded:
            fsdp_module.unshard()
        try:
            current = dict(module.named_parameters())
            return {name: current[name] for name in parameters}
        finally:
            for fsdp_module in sharded:
                fsdp_module.reshard()

    def noise(self, template: dict, strategy, **engine_arguments):
        shards = {}
        for name, p in template.items():
            start, stop = self.rows[name]
            shards[name] = slice(start * _row_elements(p), stop * _row_elements(p))
        return shard_mf_gaussian_noise(template, strategy, shards=shards, process_group=self.process_group,
                                       **engine_arguments)

    def reduce(self, sums: dict) -> dict:
        """This rank's shard (flattened) of the sum over ranks of the full-size clipped sums.

        One reduce-scatter per bucket (``_buckets``): each parameter's row chunks are written,
        padded, straight into the bucket's send buffer, and its full-size sum leaves ``sums`` as
        soon as it is there (``DPOptimizer`` hands the sums over, the clipper keeps none), so the
        step holds the sums not yet sent, one bucket and the shards instead of the sums plus two
        padded copies of them. Each element is summed over the ranks on its own, so with two
        ranks the buckets change no bit (a + b); with more, the order of the ranks' terms is the
        collective's choice and may depend on the buffer's layout (gloo's does, in the last bits),
        as a model of another size would. A model smaller than one bucket is sent as before."""
        result = {}
        for names in self._buckets(sums):
            result.update(self._reduce_bucket(names, sums))
        return result

    def _buckets(self, sums: dict) -> list[list[str]]:
        """The names of ``sums`` in runs of one dtype (dtypes in name order, names in ``sums``'
        order), each run of at most ``bucket_elements`` padded elements, or one larger parameter."""
        buckets = []
        for dtype in sorted({tensor.dtype for tensor in sums.values()}, key=str):
            bucket, size = [], 0
            for name, tensor in sums.items():
                if tensor.dtype != dtype:
                    continue
                padded = self.world_size * self._columns(tensor)
                if bucket and size + padded > self.bucket_elements:
                    buckets.append(bucket)
                    bucket, size = [], 0
                bucket.append(name)
                size += padded
            buckets.append(bucket)
        return buckets

    def _reduce_bucket(self, names: list, sums: dict) -> dict:
        """Reduce-scatter the parameters ``names`` (one dtype), taking their sums out of ``sums``."""
        columns = [self._columns(sums[name]) for name in names]
        kept = [(self.rows[name][1] - self.rows[name][0]) * _row_elements(sums[name]) for name in names]
        dtype, device = sums[names[0]].dtype, sums[names[0]].device
        send = torch.empty((self.world_size, sum(columns)), dtype=dtype, device=device)
        for name, block in zip(names, send.split(columns, dim=1)):
            self._write_chunks(sums.pop(name), block)  # the last reference to the full-size sum, once copied
        mine = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
        _reduce_scatter(mine, send.reshape(-1), self.process_group)  # row r of send goes to rank r
        return {name: piece[:length] for name, piece, length in zip(names, mine.split(columns), kept)}

    def write(self, parameters: dict, noised: dict) -> None:
        from torch.distributed.tensor import DTensor

        for name, parameter in parameters.items():
            local = noised[name].view(parameter.to_local().shape)
            parameter.grad = DTensor.from_local(local, parameter.device_mesh, parameter.placements,
                                                shape=parameter.shape, stride=parameter.stride())

    def _columns(self, tensor: torch.Tensor) -> int:
        """Elements of each rank's chunk of ``tensor``: ceil(rows / world_size) rows, padded."""
        return _rows(tensor, self.world_size)[1] * _row_elements(tensor)

    def _write_chunks(self, tensor: torch.Tensor, block: torch.Tensor) -> None:
        """Rank r's rows of ``tensor`` into row r of ``block`` (world_size, chunk elements), zeros
        after its last row (the padding of the last ranks' chunks, which the result leaves out)."""
        rows, per_rank = _rows(tensor, self.world_size)
        flat = tensor.reshape(rows, _row_elements(tensor))
        for rank, chunk in enumerate(block.view(self.world_size, per_rank, flat.shape[1])):
            part = flat[rank * per_rank:(rank + 1) * per_rank]
            chunk[:len(part)].copy_(part)
            chunk[len(part):].zero_()


def _rows(tensor, world_size: int) -> tuple[int, int]:
    """(rows, rows per rank) of fully_shard's dim-0 split: ceil(rows / world_size) each, the last
    ranks' chunks short or empty (a 0-d tensor is one row)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    return rows, -(-rows // world_size)


def _row_elements(tensor) -> int:
    """Elements per row (dimension 0) of a tensor or DTensor, from its shape alone."""
    return math.prod(tensor.shape[1:])


def _shard_rows(name: str, parameter, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, stop) of ``parameter`` this rank holds, checked against its local shard."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(parameter, DTensor):
        raise ShardingError(
            f"parameter {name!r} is not sharded while others are (a partly sharded model): call fully_shard on "
            f"every block and then on the root module, as FSDP2's recipe does, before make_private"
        )
    if parameter.device_mesh.ndim != 1 or tuple(parameter.placements) != (Shard(0),):
        raise ShardingError(
            f"parameter {name!r} is placed {tuple(parameter.placements)} on a {parameter.device_mesh.ndim}-D mesh; "
            f"make_private supports fully_shard's dim-0 sharding on a 1-D mesh (FSDP2 without HSDP or tensor "
            f"parallelism)"
        )
    rows, per_rank = _rows(parameter, world_size)
    start, stop = min(rows, rank * per_rank), min(rows, (rank + 1) * per_rank)
    local_rows = parameter.to_local().shape[0] if parameter.dim() else 1
    if local_rows != stop - start:
        raise ShardingError(
            f"parameter {name!r} holds {local_rows} of its {rows} rows on rank {rank}, not the even split "
            f"fully_shard makes ({stop - start}); shard the model with fully_shard's defaults"
        )
    return start, stop


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, process_group) -> None:
    import torch.distributed as dist

    single = getattr(dist, "reduce_scatter_single", None)  # newer torch's name
    if single is not None:
        single(output, tensor, group=process_group)
    else:
        dist.reduce_scatter_tensor(output, tensor, group=process_group)
