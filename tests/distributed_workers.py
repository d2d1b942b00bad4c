"""Spawnable workers for tests/dpftrl/noise/distributed/test_distributed.py: one gloo process group,
every scenario in turn.

Each rank writes a dict of results (noisy outputs, buffer shapes, caught errors) to
``out_dir/rank{r}.pt``; the test process compares them with single-process noise.
"""

from __future__ import annotations

import io
import os
import struct

import optree
import torch
import torch.distributed as dist

from opake.dpftrl.noise.distributed import (
    even_shards,
    shard_mf_gaussian_noise,
    sharded_mf_gaussian_noise,
)
from opake.random import key
from opake.types import clipped
from engine_support import hand_blt

STEPS = 5
SIGMA = 1.3
L2 = 0.7
# A recognizable un-noised gradient value, and an L2 bound so large that noise (about
# SIGMA * LOUD_L2) never rounds a noised value back to it.
SENTINEL = 12345.678
LOUD_L2 = 1e6
SAVE_SLACK = 64


def template():
    return {
        "emb": torch.zeros(300, 7),
        "big": torch.zeros(2**20 + 3000),
        "layers": [{"w": torch.zeros(64, 33), "b": torch.zeros(33)}, {"w": torch.zeros(33, 5)}],
        "half": torch.zeros(50, dtype=torch.bfloat16),
    }


def gradients(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    tree = template()

    def fill(leaf):
        # As clipped_grad returns them: half-precision parameters get float32 sums.
        dtype = torch.float32 if leaf.dtype in (torch.bfloat16, torch.float16) else leaf.dtype
        return torch.randn(leaf.shape, generator=generator).to(dtype)

    return optree.tree_map(fill, tree)


def strategy():
    return hand_blt("three_buffers")


def build(ownership="tensors", seed=0, tmpl=None, strat=None):
    return sharded_mf_gaussian_noise(tmpl or template(), strat or strategy(), n_steps=STEPS, noise_multiplier=SIGMA,
                                     key=key(seed), ownership=ownership)


def run_steps(noise_fn, state, steps):
    outputs = []
    for step in steps:
        noisy, state = noise_fn(clipped(gradients(step), L2), state)
        outputs.append(noisy.pytree)
    return outputs, state


def sentinel_gradients():
    """Clipped sums (float32, as clipped_grad returns them) equal to SENTINEL everywhere."""
    return optree.tree_map(lambda leaf: torch.full(leaf.shape, SENTINEL), template())


def plant_freed_sentinels(nbytes: int) -> None:
    # A batch's raw values left in freed memory, which the allocator may hand out next: a
    # released tensor that carried uninitialized bytes would then show the sentinel.
    planted = torch.full((nbytes // 4,), SENTINEL)
    del planted


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    return whole.cpu().numpy().tobytes()


def _saved_size(tensor: torch.Tensor) -> int:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return len(buffer.getvalue())


def describe_released(pytree) -> dict:
    """For each leaf (by path): its bytes, its storage's bytes and what torch.save writes."""
    paths, leaves, _ = optree.tree_flatten_with_path(pytree)
    sentinel_bytes = struct.pack("<f", SENTINEL)
    facts = {}
    for path, leaf in zip(paths, leaves):
        storage = _storage_bytes(leaf)
        own = leaf.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        facts["/".join(map(str, path))] = {
            "dtype": leaf.dtype,
            "leaf_bytes": leaf.numel() * leaf.element_size(),
            "storage_bytes": leaf.untyped_storage().nbytes(),
            "storage_is_the_leaf": storage == own,
            "saved": _saved_size(leaf),
            "saved_clone": _saved_size(leaf.clone()),
            "sentinel_in_storage": sentinel_bytes in storage,
            "sentinel_values": int((leaf == torch.tensor(SENTINEL).to(leaf.dtype)).sum()),
        }
    return facts


def assert_leaves_own_their_bytes(described: list[dict]) -> None:
    """Each leaf's storage is exactly its values: torch.save of it writes nothing else."""
    dtypes = set()
    for step in described:
        for path, facts in step.items():
            dtypes.add(facts["dtype"])
            assert facts["storage_bytes"] == facts["leaf_bytes"], (path, facts)
            assert facts["storage_is_the_leaf"], path
            # torch.save adds only its metadata (a few hundred bytes) to the storage's bytes.
            assert abs(facts["saved"] - facts["saved_clone"]) <= SAVE_SLACK, (path, facts)
            assert not facts["sentinel_in_storage"] and facts["sentinel_values"] == 0, (path, facts)
    assert {torch.float32, torch.bfloat16} <= dtypes  # mixed dtypes were released


def released_steps(noise_fn, state, steps: int = 2) -> list[dict]:
    """describe_released of each step's noisy gradients, with sentinels planted in freed memory."""
    described = []
    for _ in range(steps):
        plant_freed_sentinels(8 * 2**20)
        noisy, state = noise_fn(clipped(sentinel_gradients(), LOUD_L2), state)
        described.append(describe_released(noisy.pytree))
        del noisy
    return described


def _caught(call):
    try:
        call()
    except Exception as error:  # recorded for the test process to match
        return type(error).__name__, str(error)
    return None


class ShardOfFullGradients:
    """A shard stage fed this rank's shard of full gradients (as released_steps passes them)."""

    def __init__(self, noise_fn, shards):
        self.noise_fn, self.shards = noise_fn, shards

    def __call__(self, full, state):
        pieces = optree.tree_map(lambda g, s: g.reshape(-1)[s], full.pytree, self.shards)
        return self.noise_fn(clipped(pieces, full.l2_bound, full.normalization), state)


def worker(rank: int, world_size: int, init_file: str, out_dir: str, foreign_checkpoint: str | None):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)
    results = {}
    try:
        for ownership in ("tensors", "blocks", "even"):
            noise_fn, state = build(ownership)
            results[f"{ownership}_buffers"] = tuple(state.buffers.shape)
            results[f"{ownership}_map"] = noise_fn.ownership
            outputs, _ = run_steps(noise_fn, state, range(STEPS))
            results[ownership] = outputs
            noise_fn, state = build(ownership)
            results[f"{ownership}_released"] = released_steps(noise_fn, state)

        # Checkpoint after 3 steps, continue; then resume a new stage from the file.
        noise_fn, state = build()
        _, state = run_steps(noise_fn, state, range(3))
        path = os.path.join(out_dir, f"checkpoint_rank{rank}.pt")
        torch.save(state.state_dict(), path)
        results["continued"], _ = run_steps(noise_fn, state, range(3, STEPS))
        fresh_fn, _ = build()
        resumed = fresh_fn.load_state_dict(torch.load(path, weights_only=True), draws="replay")
        results["resumed"], _ = run_steps(fresh_fn, resumed, range(3, STEPS))
        if foreign_checkpoint is not None:
            results["foreign"] = _caught(lambda: fresh_fn.load_state_dict(torch.load(foreign_checkpoint,
                                                                                     weights_only=True)))

        # Disagreements: every rank must raise, none may hang or return noise.
        results["bad_key"] = _caught(lambda: build(seed=1 if rank == 0 else 0))
        other = hand_blt("one_buffer") if rank == world_size - 1 else None
        results["bad_strategy"] = _caught(lambda: build(strat=other))
        shapes = template()
        if rank == 1:
            shapes["emb"] = torch.zeros(301, 7)
        results["bad_parameters"] = _caught(lambda: build(tmpl=shapes))
        noise_fn, state = build()
        if rank == 0:
            state = noise_fn.load_state_dict(torch.load(path, weights_only=True), draws="replay")
        results["bad_step"] = _caught(lambda: noise_fn(clipped(gradients(0), L2), state))
        noise_fn, state = build()
        grads = gradients(0)
        if rank == 1:  # NaN everywhere on rank 1 (each rank reads only the leaves it owns)
            for leaf in optree.tree_leaves(grads):
                leaf.view(-1)[0] = float("nan")
        results["bad_gradients"] = _caught(lambda: noise_fn(clipped(grads, L2), state))
        noise_fn, state = build()
        results["bad_scale"] = _caught(lambda: noise_fn(clipped(gradients(0), L2 * (1 + rank)), state))

        # FSDP-style shards: no collective per step.
        shards = even_shards(template(), rank, world_size)
        noise_fn, state = shard_mf_gaussian_noise(template(), strategy(), shards=shards, n_steps=STEPS,
                                                  noise_multiplier=SIGMA, key=key(0))
        results["shard_ranges"] = noise_fn.ranges
        results["shard_buffers"] = tuple(state.buffers.shape)
        outs = []
        for step in range(STEPS):
            full = gradients(step)
            pieces = optree.tree_map(lambda g, s: g.reshape(-1)[s], full, shards)
            noisy, state = noise_fn(clipped(pieces, L2), state)
            outs.append(noisy.pytree)
        results["shards"] = outs
        noise_fn, state = shard_mf_gaussian_noise(template(), strategy(), shards=shards, n_steps=STEPS,
                                                  noise_multiplier=SIGMA, key=key(0))
        shard_noise_fn = ShardOfFullGradients(noise_fn, shards)
        results["shards_released"] = released_steps(shard_noise_fn, state)
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
