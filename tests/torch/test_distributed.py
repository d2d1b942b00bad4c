"""make_private under torch.distributed (2 gloo processes): each rank clips its part of every
global batch, the clipped sums are all-reduced, the sharded engine adds the noise once, and
the trained parameters equal one process on the same global batches (float64)."""

from __future__ import annotations

import torch

import torch_distributed_workers as workers
from spawn_support import spawn_ranks


def test_two_ranks_train_exactly_what_one_process_trains(tmp_path):
    spawn_ranks(workers.worker, (2, str(tmp_path / "init"), str(tmp_path)), 2,
                [tmp_path / f"rank{r}.pt" for r in range(2)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = workers.train()
    for result in ranks:
        assert result["epsilon"] == single["epsilon"]
        for name, expected in single["params"].items():
            torch.testing.assert_close(result["params"][name], expected, rtol=1e-12, atol=1e-14)
        assert "pass the plain module" in result["ddp_wrapped"]
    # The ranks split every global batch between them (each clips its own examples).
    assert [a + b for a, b in zip(ranks[0]["examples"], ranks[1]["examples"])] == single["examples"]
    assert sum(ranks[0]["examples"]) > 0 and sum(ranks[1]["examples"]) > 0
    # Each rank keeps noise buffers only for the parameters it owns.
    assert sum(result["buffers"][1] for result in ranks) == single["buffers"][1]
