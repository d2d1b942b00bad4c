"""Worker of tests/transformers/test_distributed.py: DPTrainer under torch.distributed (spawned with
torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), replicated, FSDP, and FSDP
asked for as accelerate launch --use_fsdp does (its environment variables only)."""

from __future__ import annotations

import os
import pathlib

import torch

STEPS = 6


def train(folder: pathlib.Path, world_size: int = 1, fsdp: bool = False, resume: pathlib.Path | None = None,
          save_steps: int | None = None) -> dict:
    import transformers

    import opake.random
    import transformers_support as t
    from opake.transformers import DPTrainer

    transformers.logging.set_verbosity_error()
    model, dataset = t.gpt2(), t.CharDataset(t.sentences(48))
    extra = dict(fsdp=True) if fsdp else {}
    if save_steps:
        extra.update(save_strategy="steps", save_steps=save_steps)
    if save_steps and fsdp:  # Trainer cannot checkpoint a sharded optimizer state: the weights only
        extra.update(save_only_model=True)
    args = t.arguments(folder, per_device_train_batch_size=8 // world_size, num_train_epochs=1, optim="adamw_torch",
                       learning_rate=1e-2, **extra)
    trainer = DPTrainer(model=model, args=args, train_dataset=dataset, data_collator=t.collate,
                        key=opake.random.key(3), noise_multiplier=0.8, target_delta=1e-5)
    if resume is None:
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=str(resume), draws="replay")
    if fsdp:
        trainer.save_model(str(folder / "final"))  # on every rank: it gathers the shards
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in model.named_parameters()}
    return {"params": params, "epsilon": trainer.private.epsilon, "steps": trainer.private.steps_taken,
            "sharded": all(hasattr(p, "full_tensor") for p in model.parameters()),
            "examples": trainer.private.optimizer.last_step_examples,
            "files": sorted(p.name for p in folder.glob("out/checkpoint-*/opake_private*")), "saved": folder / "final"}


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = pathlib.Path(out_dir)
    results = {  # one output folder for all ranks, as under torchrun
        "replicated": train(out / "replicated", world_size, save_steps=3),
        "fsdp": train(out / "fsdp", world_size, fsdp=True, save_steps=3),
    }
    results["resumed"] = train(out / "resumed", world_size, resume=out / "replicated" / "out" / "checkpoint-3")
    results["fsdp_resumed"] = train(out / "fsdp_resumed", world_size, fsdp=True, resume=out / "fsdp" / "out" / "checkpoint-3")
    # accelerate launch --use_fsdp: no TrainingArguments(fsdp=...), only accelerate's environment
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="GPT2Block", FSDP_RESHARD_AFTER_FORWARD="true")
    results["accelerate_fsdp"] = train(out / "accelerate_fsdp", world_size)
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.barrier()  # Trainer leaves the process group open: close it before the process exits
    torch.distributed.destroy_process_group()
