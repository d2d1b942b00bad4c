"""Distributed noise (gloo, 2 and 3 processes on this 2-core machine): equal to one process, bit for bit.

One spawn per world size runs every scenario (tests/distributed_workers.py); the tests below
compare each rank's results with ``mf_gaussian_noise`` run here with the same key.
"""

from __future__ import annotations

import re

import optree
import pytest
import torch
import torch.distributed as dist

import distributed_workers as workers
from spawn_support import spawn_ranks
from opake.dpftrl.noise.distributed import (
    DistributedCheckpointError,
    ProcessGroupError,
    even_shards,
    ownership_map,
    shard_mf_gaussian_noise,
    sharded_mf_gaussian_noise,
)
from opake.dpftrl.noise import mf_gaussian_noise
from opake.dpftrl.noise.engine.layout import Layout
from opake.random import key
from opake.types import clipped

WORLD_SIZES = (2, 3)   # an even and an odd split, a middle rank; no more ranks than fit two cores


@pytest.fixture(scope="module")
def reference():
    """Single-process noisy gradients for every step (the oracle)."""
    noise_fn, state = mf_gaussian_noise(workers.template(), workers.strategy(), n_steps=workers.STEPS,
                                        noise_multiplier=workers.SIGMA, key=key(0))
    outputs, _ = workers.run_steps(noise_fn, state, range(workers.STEPS))
    return outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world_size: [results of rank 0, rank 1, ...]}; the world-3 run also gets a world-2 checkpoint."""
    results, foreign = {}, None
    for world_size in WORLD_SIZES:
        out = tmp_path_factory.mktemp(f"world{world_size}")
        spawn_ranks(workers.worker, (world_size, str(out / "init"), str(out), foreign), world_size,
                    [out / f"rank{r}.pt" for r in range(world_size)])
        results[world_size] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
        foreign = str(out / "checkpoint_rank0.pt")
    return results


def assert_trees_equal(got, expected):
    got_paths, got_leaves, got_spec = optree.tree_flatten_with_path(got)
    _, leaves, spec = optree.tree_flatten_with_path(expected)
    assert got_spec == spec
    for path, a, b in zip(got_paths, got_leaves, leaves):
        assert a.dtype == b.dtype and torch.equal(a, b), path


@pytest.mark.slow   # reads the spawned runs (2 and 3 gloo ranks, about 15 s for both)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("ownership", ["tensors", "blocks", "even"])
def test_every_rank_gets_the_single_process_noise_bit_for_bit(runs, reference, world_size, ownership):
    for rank_results in runs[world_size]:
        for got, expected in zip(rank_results[ownership], reference):
            assert_trees_equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("ownership", ["tensors", "blocks", "even"])
def test_each_rank_keeps_buffers_only_for_what_it_owns(runs, world_size, ownership):
    layout = Layout.from_template(workers.template())
    num_buffers = 3
    shapes = [r[f"{ownership}_buffers"] for r in runs[world_size]]
    owned = [sum(stop - start for _, start, stop in ranges) for ranges in ownership_map(layout, world_size, ownership)]
    assert shapes == [(num_buffers, n) for n in owned]
    assert sum(owned) == layout.size
    # Blocks balance to within one noise block of an equal share; whole tensors cannot split the
    # 2**20-element leaf, so its owner holds it and the others share the rest.
    # An even split holds ceil(d / W) on every rank but maybe the last.
    if ownership == "blocks":
        assert max(owned) <= layout.size / world_size + 2**20
    elif ownership == "even":
        assert max(owned) == -(-layout.size // world_size) and min(owned) >= layout.size - (world_size - 1) * max(owned)
    else:
        assert max(owned) == 2**20 + 3000


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_resume_from_each_ranks_checkpoint_continues_the_identical_stream(runs, reference, world_size):
    for rank_results in runs[world_size]:
        for got, continued, expected in zip(rank_results["resumed"], rank_results["continued"], reference[3:]):
            assert_trees_equal(got, expected)
            assert_trees_equal(continued, expected)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", ["tensors", "blocks", "even", "shards"])
def test_released_leaves_own_exactly_their_bytes(runs, world_size, stage):
    """Every noised leaf, in each ownership mode and from the FSDP-style stage, with float32 and
    bfloat16 leaves, owns a storage of exactly its values: torch.save of one leaf writes no
    header, padding, other rank's or uninitialized bytes, and the un-noised sentinel gradient
    (also planted in freed memory before each step) appears nowhere in it."""
    for rank_results in runs[world_size]:
        workers.assert_leaves_own_their_bytes(rank_results[f"{stage}_released"])


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(runs):
    for rank_results in runs[3]:
        name, message = rank_results["foreign"]
        assert name == "DistributedCheckpointError"
        assert re.search(r"saved with world_size=2 but this run has world_size=3", message)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case, pattern", [
    ("bad_key", r"ranks disagree on key \(ranks grouped by value"),
    ("bad_strategy", r"ranks disagree on strategy"),
    ("bad_parameters", r"ranks disagree on parameters \(paths, shapes, dtypes\)"),
    ("bad_step", r"different steps \(step by rank: \[3, 0"),
    ("bad_scale", r"different noise scales"),
])
def test_disagreeing_ranks_all_raise(runs, world_size, case, pattern):
    for rank_results in runs[world_size]:
        name, message = rank_results[case]
        assert name == "RankDisagreementError" and re.search(pattern, message), message


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_rank_whose_checks_fail_makes_every_rank_raise(runs, world_size):
    for rank, rank_results in enumerate(runs[world_size]):
        name, message = rank_results["bad_gradients"]
        if rank == 1:
            assert name == "InvalidArgumentError" and re.search(r"NaN or inf \(in '", message)
        else:
            assert name == "RankDisagreementError" and re.search(r"rank\(s\) \[1\] refused this step", message)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_shards_get_the_single_process_noise_of_their_elements(runs, reference, world_size):
    layout = Layout.from_template(workers.template())
    covered = 0
    for rank, rank_results in enumerate(runs[world_size]):
        shards = even_shards(workers.template(), rank, world_size)
        covered += rank_results["shard_buffers"][1]
        for got, expected in zip(rank_results["shards"], reference):
            assert_trees_equal(got, optree.tree_map(lambda e, s: e.reshape(-1)[s], expected, shards))
    assert covered == layout.size


def test_fsdp_shards_in_one_process_cut_blocks_anywhere(reference):
    # Ranges starting and stopping inside noise blocks, with no process group at all.
    tmpl = workers.template()
    shards = optree.tree_map(lambda leaf: slice(leaf.numel() // 3, leaf.numel() - 5), tmpl)
    shards["big"] = slice(2**20 - 7, 2**20 + 11)
    noise_fn, state = shard_mf_gaussian_noise(tmpl, workers.strategy(), shards=shards, n_steps=workers.STEPS,
                                              noise_multiplier=workers.SIGMA, key=key(0))
    for step in range(workers.STEPS):
        grads = optree.tree_map(lambda g, s: g.reshape(-1)[s], workers.gradients(step), shards)
        noisy, state = noise_fn(clipped(grads, workers.L2), state)
        assert_trees_equal(noisy.pytree, optree.tree_map(lambda e, s: e.reshape(-1)[s], reference[step], shards))


def test_world_size_one_equals_the_single_process_engine(tmp_path, reference):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        noise_fn, state = workers.build()
        outputs, _ = workers.run_steps(noise_fn, state, range(workers.STEPS))
    finally:
        dist.destroy_process_group()
    for got, expected in zip(outputs, reference):
        assert_trees_equal(got, expected)


def test_without_a_process_group_the_error_says_to_initialize_one():
    assert not dist.is_initialized()
    with pytest.raises(ProcessGroupError, match=r"call torch.distributed.init_process_group\(...\) first"):
        workers.build()


def test_bad_arguments_are_refused_before_any_collective():
    with pytest.raises(ValueError, match=r"ownership must be one of \('tensors', 'blocks', 'even'\)"):
        sharded_mf_gaussian_noise(workers.template(), workers.strategy(), n_steps=3, noise_multiplier=1.0,
                                  key=key(0), ownership="rows")
    tmpl = {"w": torch.zeros(10)}
    with pytest.raises(ValueError, match=r"shards\['w'\] = slice\(4, 11, None\) is not a range"):
        shard_mf_gaussian_noise(tmpl, workers.strategy(), shards={"w": slice(4, 11)}, n_steps=3,
                                noise_multiplier=1.0, key=key(0))
    with pytest.raises(TypeError, match=r"must be slice\(start, stop\)"):
        shard_mf_gaussian_noise(tmpl, workers.strategy(), shards={"w": "0:4"}, n_steps=3,
                                noise_multiplier=1.0, key=key(0))
    with pytest.raises(ValueError, match=r"shards must have grad_template's structure"):
        shard_mf_gaussian_noise(tmpl, workers.strategy(), shards={"w": (0, 4)}, n_steps=3,
                                noise_multiplier=1.0, key=key(0))
    noise_fn, state = shard_mf_gaussian_noise(tmpl, workers.strategy(), shards={"w": slice(2, 6)}, n_steps=3,
                                              noise_multiplier=1.0, key=key(0))
    with pytest.raises(ValueError, match=r"expected \(4,\)"):
        noise_fn(clipped({"w": torch.zeros(10)}, 1.0), state)
    with pytest.raises(DistributedCheckpointError, match=r"not saved by a distributed noise stage"):
        single_fn, single_state = mf_gaussian_noise(tmpl, workers.strategy(), n_steps=3, noise_multiplier=1.0,
                                                    key=key(0))
        noise_fn.load_state_dict(single_state.state_dict())


def test_ownership_maps_are_deterministic_and_cover_every_element():
    layout = Layout.from_template(workers.template())
    for mode in ("tensors", "blocks", "even"):
        for world_size in (1, 2, 3, 4, 8):
            ranges = ownership_map(layout, world_size, mode)
            assert ranges == ownership_map(layout, world_size, mode) and len(ranges) == world_size
            seen = {}
            for owned in ranges:
                for leaf, start, stop in owned:
                    seen.setdefault(leaf, []).append((start, stop))
            for leaf, slot in enumerate(layout.leaves):
                parts = sorted(seen[leaf])
                assert parts[0][0] == 0 and parts[-1][1] == slot.numel
                assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_fsdp_shard_checkpoint_resumes_bit_identically_and_refuses_other_shards(tmp_path, reference):
    tmpl = workers.template()
    shards = optree.tree_map(lambda leaf: slice(leaf.numel() // 4, leaf.numel() - 3), tmpl)

    def build(cut=shards):
        return shard_mf_gaussian_noise(tmpl, workers.strategy(), shards=cut, n_steps=workers.STEPS,
                                       noise_multiplier=workers.SIGMA, key=key(0))

    def step(noise_fn, state, t):
        grads = optree.tree_map(lambda g, s: g.reshape(-1)[s], workers.gradients(t), shards)
        return noise_fn(clipped(grads, workers.L2), state)

    noise_fn, state = build()
    for t in range(2):
        _, state = step(noise_fn, state, t)
    torch.save(state.state_dict(), tmp_path / "shard.pt")
    saved = torch.load(tmp_path / "shard.pt", weights_only=True)
    fresh_fn, fresh_state = build()
    state = fresh_state.load_state_dict(saved, draws="replay")
    for t in range(2, workers.STEPS):
        noisy, state = step(fresh_fn, state, t)
        assert_trees_equal(noisy.pytree, optree.tree_map(lambda e, s: e.reshape(-1)[s], reference[t], shards))
    other = optree.tree_map(lambda leaf: slice(0, leaf.numel() // 2), tmpl)
    _, other_state = build(other)
    with pytest.raises(ValueError, match="layout_fingerprint"):
        other_state.load_state_dict(saved, draws="replay")
