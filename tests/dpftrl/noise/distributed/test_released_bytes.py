"""What a released noised gradient carries when saved: only released values of its own step.

``torch.save(leaf)`` writes the leaf's whole storage, so a leaf that is a view of a larger
buffer would leak whatever else that buffer holds (headers, padding, uninitialized memory,
other steps' values). These tests look at the storage behind every leaf opake returns.
"""

from __future__ import annotations

import struct

import optree
import pytest
import torch
import torch.distributed as dist

import distributed_workers as workers
from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.noise.distributed import shard_mf_gaussian_noise
from opake.dpftrl.noise.distributed.ownership import OWNERSHIP_MODES
from opake.random import key
from opake.types import clipped


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy().tobytes()


def _leaf_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _engine_step(noise_fn, state):
    return noise_fn(clipped(workers.sentinel_gradients(), workers.LOUD_L2), state)


def assert_storages_hold_only_released_values(pytree) -> None:
    """Per dtype: the leaves share one storage that they tile exactly, and no sentinel is in it."""
    by_dtype: dict = {}
    for leaf in optree.tree_leaves(pytree):
        by_dtype.setdefault(leaf.dtype, []).append(leaf)
    sentinel = struct.pack("<f", workers.SENTINEL)
    for dtype, leaves in by_dtype.items():
        storage = leaves[0].untyped_storage()
        assert all(leaf.untyped_storage().data_ptr() == storage.data_ptr() for leaf in leaves), dtype
        assert storage.nbytes() == sum(leaf.numel() for leaf in leaves) * dtype.itemsize, dtype
        in_storage_order = sorted(leaves, key=lambda leaf: leaf.storage_offset())
        assert _storage_bytes(leaves[0]) == b"".join(_leaf_bytes(leaf) for leaf in in_storage_order), dtype
        assert sentinel not in _storage_bytes(leaves[0]), dtype
        assert not any((leaf == torch.tensor(workers.SENTINEL).to(dtype)).any() for leaf in leaves), dtype


def test_engine_leaf_storages_hold_exactly_this_steps_released_values():
    """The single-process engine returns zero-copy views of one output vector per dtype: that
    vector has exactly the elements of that dtype's leaves and equals their concatenation, both
    when it is new (the caller kept the last one) and when recycled (the caller dropped it),
    so torch.save of a leaf can carry only other noised values of the same step."""
    noise_fn, state = mf_gaussian_noise(workers.template(), workers.strategy(), n_steps=workers.STEPS,
                                        noise_multiplier=workers.SIGMA, key=key(0))
    kept, state = _engine_step(noise_fn, state)
    assert_storages_hold_only_released_values(kept.pytree)
    fresh, state = _engine_step(noise_fn, state)  # `kept` still referenced: a new vector
    assert_storages_hold_only_released_values(fresh.pytree)
    assert_storages_hold_only_released_values(kept.pytree)  # the caller's values are untouched
    address = fresh.pytree["big"].untyped_storage().data_ptr()
    del kept, fresh
    workers.plant_freed_sentinels(8 * 2**20)
    recycled, state = _engine_step(noise_fn, state)
    assert_storages_hold_only_released_values(recycled.pytree)
    if hasattr(torch._C, "_storage_Use_Count"):  # the engine recycles only with torch's use count
        assert recycled.pytree["big"].untyped_storage().data_ptr() == address


@pytest.mark.parametrize("ownership", OWNERSHIP_MODES)
def test_gathered_leaves_own_exactly_their_bytes_on_one_rank(tmp_path, ownership):
    """sharded_mf_gaussian_noise on a world of one (the gathered buffer is the rank's own slot,
    with its header and alignment padding): each float32 and bfloat16 leaf still owns exactly
    its values, and torch.save of it writes no header, padding or un-noised sentinel."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        noise_fn, state = workers.build(ownership)
        workers.assert_leaves_own_their_bytes(workers.released_steps(noise_fn, state))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ownership", OWNERSHIP_MODES)
def test_gathered_leaves_recycled_after_the_caller_drops_them_hold_this_steps_noise(tmp_path, ownership):
    """A caller that drops each step's noisy gradients gets the same tensors back next step
    (no page faults), overwritten in full: the values still equal mf_gaussian_noise's bit for
    bit, and a leaf the caller still holds is never reused."""
    expected_fn, expected_state = mf_gaussian_noise(workers.template(), workers.strategy(), n_steps=workers.STEPS,
                                                    noise_multiplier=workers.SIGMA, key=key(0))
    expected, _ = workers.run_steps(expected_fn, expected_state, range(workers.STEPS))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        noise_fn, state = workers.build(ownership)
        held, state = noise_fn(clipped(workers.gradients(0), workers.L2), state)
        addresses = set()
        for step in range(1, workers.STEPS):
            noisy, state = noise_fn(clipped(workers.gradients(step), workers.L2), state)
            assert noisy.pytree["big"].data_ptr() != held.pytree["big"].data_ptr()  # held: not reused
            for got, want in zip(optree.tree_leaves(noisy.pytree), optree.tree_leaves(expected[step])):
                assert got.dtype == want.dtype and torch.equal(got, want)
            addresses.add(noisy.pytree["big"].data_ptr())
            del noisy
        for got, want in zip(optree.tree_leaves(held.pytree), optree.tree_leaves(expected[0])):
            assert torch.equal(got, want)  # the held step-0 values were never overwritten
    finally:
        dist.destroy_process_group()
    if hasattr(torch._C, "_storage_Use_Count"):  # recycling needs torch's storage use count
        assert len(addresses) == 1


def test_shard_leaves_own_exactly_their_bytes_without_a_process_group():
    """shard_mf_gaussian_noise, with shards cutting noise blocks: each released shard owns
    exactly its values (no scratch block, no other shard)."""
    tmpl = workers.template()
    shards = optree.tree_map(lambda leaf: slice(leaf.numel() // 3, leaf.numel() - 5), tmpl)
    shards["big"] = slice(2**20 - 7, 2**20 + 11)
    noise_fn, state = shard_mf_gaussian_noise(tmpl, workers.strategy(), shards=shards, n_steps=workers.STEPS,
                                              noise_multiplier=workers.SIGMA, key=key(0))
    stage = workers.ShardOfFullGradients(noise_fn, shards)
    workers.assert_leaves_own_their_bytes(workers.released_steps(stage, state))
