"""Worker of tests/torch/test_distributed.py: make_private in a gloo process group (spawned)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from opake.dpftrl.noise import blt_strategy
from opake.random import key
from opake.torch import make_private

STEPS_PER_EPOCH, EPOCHS, BATCH = 6, 2, 8


def dataset():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS_PER_EPOCH * BATCH, 5, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def model():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def train(seed_key=None, process_group_size: int = 1) -> dict:
    """Train the planned run; returns final parameters, epsilon and the examples each step saw."""
    net = model()
    private = make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.5),
                           dataset=dataset(), batch_size=BATCH, epochs=EPOCHS, noise_multiplier=1.1,
                           target_delta=1e-5, max_grad_norm=0.3, strategy=blt_strategy(max_buffers=2),
                           key=key(3) if seed_key is None else seed_key)
    seen = []
    for _epoch in range(EPOCHS):
        for x, y in private.data_loader:
            private.optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            private.optimizer.step()
            seen.append(private.optimizer.last_step_examples)
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()}, "epsilon": private.epsilon,
            "examples": seen, "buffers": tuple(private.optimizer.noise_state.buffers.shape)}


def worker(rank: int, world_size: int, init_file: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world_size)
    try:
        result = train()
        try:
            make_private(module=nn.parallel.DistributedDataParallel(model()), optimizer=torch.optim.SGD(
                model().parameters(), lr=0.1), dataset=dataset(), batch_size=BATCH, epochs=1, noise_multiplier=1.0,
                target_delta=1e-5, max_grad_norm=1.0, key=key(0))
            result["ddp_wrapped"] = None
        except TypeError as error:
            result["ddp_wrapped"] = str(error)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # every rank has saved before any tears gloo down
    finally:
        dist.destroy_process_group()
