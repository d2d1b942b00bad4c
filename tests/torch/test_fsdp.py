"""make_private on FSDP2 (fully_shard) and replicated models, two gloo processes on CPU.

Each sharded run is compared with the one-process run with the same key: the same epsilon, the
same parameters up to float summation order (tiny Llama, GPT-2 and Qwen2, full fine-tuning and
LoRA), at about half the memory per rank for parameters, optimizer state and noise state; the
clipped sums reduce-scattered bucket by bucket are the same bits as in one collective. The
negative controls: ranks that start from different weights (replaced by rank 0's), ranks holding
different data, a DistributedDataParallel wrap after planning, a partly sharded model, a model
sharded on one rank only, and a rank that refuses a step: each refused on every rank, with no hang.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.slow   # every test reads the 2 spawned ranks' runs (about 10-15 s)

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch_fsdp_workers as workers  # noqa: E402
from spawn_support import spawn_ranks  # noqa: E402

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(workers.worker, (WORLD_SIZE, str(folder / "init"), str(folder)), WORLD_SIZE,
                [folder / f"rank{rank}.pt" for rank in range(WORLD_SIZE)])
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def one_process():
    """``one_process(kind, lora, **options)``: the one-process run with the ranks' key, trained once per
    module (by the first test that asks for it) however many tests compare with it."""
    return functools.cache(lambda kind, lora, **options: workers.train_hf(kind, lora, shard=False, **options))


def _relative(got: dict, expected: dict) -> float:
    return max(float((got[name] - expected[name]).norm() / expected[name].norm()) for name in expected)


@pytest.mark.parametrize("kind, lora", workers.CONFIGS, ids=[f"{k}-{'lora' if l else 'full'}" for k, l in workers.CONFIGS])
def test_a_sharded_run_is_the_one_process_run(ranks, one_process, kind, lora):
    name = f"{kind}-{'lora' if lora else 'full'}"
    single = one_process(kind, lora)
    for result in ranks:
        assert result[name]["epsilon"] == single["epsilon"]
        assert _relative(result[name]["params"], single["params"]) < 1e-5
        for parameter, value in result[name]["params"].items():   # every rank holds the same model
            assert torch.equal(value, ranks[0][name]["params"][parameter])
    # the ranks split each batch: their examples add up to the one-process run's
    assert [sum(r[name]["examples"][step] for r in ranks) for step in range(workers.STEPS)] == single["examples"]
    # parameters + optimizer state + noise state per rank, against one process
    assert max(r[name]["bytes"] for r in ranks) <= 0.6 * single["bytes"]


def test_bf16_compute_through_fsdp_mixed_precision(ranks, one_process):
    single = one_process("llama", False, bf16=True)   # autocast bf16 in one process
    for result in ranks:
        assert result["llama-full-bf16"]["epsilon"] == single["epsilon"]
        assert _relative(result["llama-full-bf16"]["params"], single["params"]) < 2e-2  # bf16 rounding
    assert _relative(ranks[1]["llama-full-bf16"]["params"], ranks[0]["llama-full-bf16"]["params"]) == 0.0


def test_a_rank_with_an_empty_part_runs_a_placeholder_that_adds_nothing(ranks, one_process):
    # Batches of 2 over 2 ranks: a rank's part is often empty; it runs example 0 with weight 0,
    # so that FSDP's collectives see every rank, and the run equals one process skipping nothing.
    single = one_process("llama", False, batch_size=2)
    examples = [r["llama-small-batches"]["examples"] for r in ranks]
    assert any(0 in part for part in examples)  # the case occurred
    assert [a + b for a, b in zip(*examples)] == single["examples"]
    for result in ranks:
        assert _relative(result["llama-small-batches"]["params"], single["params"]) < 1e-5


def test_the_clipped_sums_reduce_bucket_by_bucket_to_the_same_bits(ranks):
    # Two ranks: each element is a + b whatever the buckets (more ranks: docs in Sharded.reduce).
    for result in ranks:
        buckets = result["buckets"]
        assert buckets["handed_over"]
        assert len(buckets["shards"]) == 3
        for shards in buckets["shards"].values():
            assert list(shards) == list(buckets["reference"])
            for name, expected in buckets["reference"].items():
                assert torch.equal(shards[name], expected), name


def test_ranks_that_disagree_are_refused_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        refusals = result["refusals"]
        assert refusals["weights"] == (2, 1)   # different before make_private, rank 0's after
        assert refusals["different_data"].startswith("RankDisagreementError: the ranks hold different data sets")
        assert refusals["ddp"].startswith("UnsupportedModuleError: the private module is being called through "
                                          "DistributedDataParallel")
        assert refusals["partly_sharded"].startswith("ShardingError: parameter '2.weight' is not sharded")
        if rank == 0:   # sharded over a one-rank mesh while the run has two ranks
            assert refusals["sharded_on_one_rank"].startswith("ShardingError: parameter '0.weight' holds 8 of its 8")
        else:           # told, in the first collective, instead of waiting in another one
            assert refusals["sharded_on_one_rank"].startswith("RankDisagreementError: rank(s) 0 (ShardingError")
        if rank == 1:
            assert refusals["failed_step"].startswith("ClipperUsageError: optimizer.step() was called without a "
                                                      "backward pass")
        else:
            assert refusals["failed_step"].startswith("RankDisagreementError: rank(s) [1] refused step")


def test_a_sharded_run_resumes_from_each_ranks_checkpoint_with_replay(ranks):
    for result in ranks:
        assert result["resume"]["steps"] == 4
        for name, value in result["resume"]["uninterrupted"].items():
            assert torch.equal(result["resume"]["resumed"][name], value), name
