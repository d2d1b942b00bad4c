"""Opacus peer for benchmarks/distributed_finetune.py; runs in ../peer-opacus's interpreter, never imported.

    ../peer-opacus/bin/python benchmarks/peers/opacus_fsdp.py --ranks 2 --steps 4 --size '{...}'

The same tiny Llama, AdamW and batches as distributed_finetune.py's FSDP2 run, made private with
Opacus' FSDP2 ghost clipping: ``FSDP2Wrapper`` (every layer with parameters sharded, then the root)
and ``PrivacyEngine.make_private(..., grad_sample_mode="ghost_fsdp")`` with the per-token
cross-entropy as its criterion (fixed batches of the nominal size, ``poisson_sampling=False``, so
that every step does the same work as ours: a global batch of ``size['batch']``, each rank
reading its share through a ``DistributedSampler``). Each rank reports the median step time, the peak of
torch's live tensors (``LiveMemory``) and its bytes of parameters and optimizer state (Opacus keeps
no noise state); rank 0 prints one JSON line, a list with one entry per rank, or
``{"error": ...}``.
"""

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from distributed_finetune import Tokens, build_model, state_bytes, timed_steps  # noqa: E402
from finetune_step import LiveMemory  # noqa: E402


class TokenCrossEntropy(torch.nn.Module):
    """Per-token cross-entropy of shifted logits; Opacus' ghost-clipping loss averages it per example."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits, labels):
        vocab = logits.shape[-1]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                                                   reduction="none")
        losses = losses.view(labels.shape[0], -1).mean(dim=1)
        return losses.mean() if self.reduction == "mean" else losses


def run(size: dict, steps: int, device: str) -> dict:
    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with LiveMemory(device) as meter:
        model = FSDP2Wrapper(build_model(size).to(device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = Tokens(size)
        # Opacus leaves a loader without Poisson sampling as it is: each rank reads its own share of the
        # global batch through a DistributedSampler, as ours reads its part of each planned batch.
        world_size = dist.get_world_size()
        sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=size["batch"] // world_size, sampler=sampler)
        engine = PrivacyEngine()
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="ghost_fsdp", criterion=TokenCrossEntropy(), poisson_sampling=False)
        batches = (batch["input_ids"].to(device) for batch in loader)

        def one_step(ids):
            optimizer.zero_grad()
            criterion(model(input_ids=ids).logits, ids).backward()
            optimizer.step()
            sync()

        seconds = timed_steps(meter, batches, one_step, steps)
    return {"step": seconds, "peak": meter.peak, "state": state_bytes(model, optimizer.original_optimizer)}


def worker(rank, world_size, size, steps, device, init, out):
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="file://" + init, rank=rank,
                            world_size=world_size)
    try:
        try:
            result = run(size, steps, f"cuda:{rank}" if device == "cuda" else "cpu")
        except Exception as error:  # reported, not raised: the benchmark prints it
            result = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, result)
        if rank == 0:
            Path(out).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", required=True)
    args = parser.parse_args()
    size = json.loads(args.size)
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        mp.spawn(worker, args=(args.ranks, size, args.steps, args.device, os.path.join(folder, "init"), out),
                 nprocs=args.ranks)
        results = json.loads(Path(out).read_text())
    errors = [r["error"] for r in results if "error" in r]
    print(json.dumps({"error": errors[0], "trace": results[0].get("trace", "")} if errors else results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
