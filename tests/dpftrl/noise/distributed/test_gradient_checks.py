"""The distributed noise stages run the single-process engine's checks: sparse gradients are
refused before the state is touched (``engine.correlated_noise.check_dense_gradient``), and
``check_accounted_by`` refuses an accountant that priced other noise (``noise.priced``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from opake.dpftrl.accounting import AccountingMismatchError, balls_in_bins, mf_gaussian
from opake.dpftrl.noise import blt_strategy
from opake.dpftrl.noise.distributed import shard_mf_gaussian_noise, sharded_mf_gaussian_noise
from opake.random import key
from opake.types import clipped
from engine_support import hand_blt

TEMPLATE = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}


@pytest.fixture
def single_process_group(tmp_path):
    """A world of one gloo process, destroyed afterwards (other tests expect none)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _accountant(noise_multiplier, strategy=None):
    strategy = blt_strategy(max_buffers=2) if strategy is None else strategy
    return balls_in_bins(mf_gaussian(noise_multiplier, strategy), num_bins=4, n_steps=8)


def test_both_distributed_stages_check_what_the_accountant_priced(single_process_group):
    strategy = blt_strategy(max_buffers=2)
    context = dict(n_steps=8, min_sep=4, max_participations=2)   # what balls_in_bins(4 bins, 8 steps) guarantees
    gathered, _ = sharded_mf_gaussian_noise(TEMPLATE, strategy, noise_multiplier=2.0, key=key(5), **context)
    shard, _ = shard_mf_gaussian_noise(TEMPLATE, strategy, shards={"w": slice(0, 20), "b": slice(0, 5)},
                                       noise_multiplier=2.0, key=key(5), **context)
    for stage in (gathered, shard):
        stage.check_accounted_by(_accountant(2.0))
        with pytest.raises(AccountingMismatchError, match=r"noise_multiplier: accountant 4\.0, noise 2\.0"):
            stage.check_accounted_by(_accountant(4.0))
        with pytest.raises(AccountingMismatchError, match="strategy"):
            stage.check_accounted_by(_accountant(2.0, strategy=blt_strategy(max_buffers=3)))


def _sparse_cases(gradients):
    w = gradients["w"]
    return {"coo": {**gradients, "w": w.to_sparse()}, "csr": {**gradients, "w": w.to_sparse_csr()}}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_the_gathered_stage_refuses_sparse_gradients_and_stays_usable(single_process_group, layout):
    noise_fn, state = sharded_mf_gaussian_noise(TEMPLATE, hand_blt("three_buffers"), n_steps=4,
                                                noise_multiplier=1.0, key=key(5))
    dense = {"w": torch.ones(4, 5), "b": torch.ones(5)}
    spare = state.copy(draws="replay")
    with pytest.raises(TypeError, match=rf"'w' has layout torch\.sparse_{layout}.*\.to_dense\(\)"):
        noise_fn(clipped(_sparse_cases(dense)[layout], 1.0), state)
    assert state.is_current
    first, _ = noise_fn(clipped(dense, 1.0), state)
    second, _ = noise_fn(clipped(dense, 1.0), spare)
    assert torch.equal(first.pytree["w"], second.pytree["w"])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_the_shard_stage_refuses_sparse_gradients_and_stays_usable():
    shards = {"w": slice(2, 14), "b": slice(0, 5)}
    noise_fn, state = shard_mf_gaussian_noise(TEMPLATE, hand_blt("three_buffers"), shards=shards, n_steps=4,
                                              noise_multiplier=1.0, key=key(5))
    dense = {"w": torch.ones(12), "b": torch.ones(5)}
    spare = state.copy(draws="replay")
    with pytest.raises(TypeError, match=r"'w' has layout torch\.sparse_coo.*\.to_dense\(\)"):
        noise_fn(clipped({**dense, "w": dense["w"].to_sparse()}, 1.0), state)
    assert state.is_current
    first, _ = noise_fn(clipped(dense, 1.0), state)
    second, _ = noise_fn(clipped(dense, 1.0), spare)
    assert torch.equal(first.pytree["w"], second.pytree["w"])
