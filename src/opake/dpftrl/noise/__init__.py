"""Correlated noise: the streaming noise engine, and the strategy recipes at the seed's import paths.

The recipes live in ``opake.dpftrl.strategies`` and are re-exported here once.
"""

from opake.dpftrl.strategies import (
    BandMFStrategy,
    band_mf_strategy,
    BLTStrategy,
    IdentityStrategy,
    Mechanism,
    blt_strategy,
    identity_strategy,
)
from opake.dpftrl.noise.engine import mf_gaussian_noise
from opake.dpftrl.noise.distributed import shard_mf_gaussian_noise, sharded_mf_gaussian_noise

__all__ = [
    "BandMFStrategy",
    "BLTStrategy",
    "IdentityStrategy",
    "Mechanism",
    "band_mf_strategy",
    "blt_strategy",
    "identity_strategy",
    "mf_gaussian_noise",
    "shard_mf_gaussian_noise",
    "sharded_mf_gaussian_noise",
]
