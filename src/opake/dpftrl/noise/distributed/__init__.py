"""Correlated noise on torch.distributed: sharded noise state, the same noise on every world size.

- ``sharded_mf_gaussian_noise``: data-parallel (DDP-style) training; each rank owns whole
  tensors (or runs of noise blocks), keeps buffers only for them, and one all-gather per step
  gives every rank the full noisy gradients (``gathered``).
- ``shard_mf_gaussian_noise``: sharded gradients (FSDP-style); each rank noises its shard,
  no collective (``shards``); ``even_shards`` gives FSDP's even split (``ownership``).

Both equal ``mf_gaussian_noise`` bit for bit for the same key on the same device type, for any
world size. See docs/distributed.md.
"""

from opake.dpftrl.noise.distributed.agreement import ProcessGroupError, RankDisagreementError
from opake.dpftrl.noise.distributed.gathered import GatheredNoise, sharded_mf_gaussian_noise
from opake.dpftrl.noise.distributed.ownership import even_shards, ownership_map
from opake.dpftrl.noise.distributed.shards import ShardNoise, shard_mf_gaussian_noise
from opake.dpftrl.noise.distributed.stage import DistributedCheckpointError

__all__ = [
    "DistributedCheckpointError",
    "GatheredNoise",
    "ProcessGroupError",
    "RankDisagreementError",
    "ShardNoise",
    "even_shards",
    "ownership_map",
    "shard_mf_gaussian_noise",
    "sharded_mf_gaussian_noise",
]
