"""Run by tests/transformers/test_distributed.py under the real ``accelerate launch --use_fsdp``:
the worker's DPTrainer run, with no fsdp in TrainingArguments (accelerate's environment only);
rank 0 saves what it trained to the path given as the first argument."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import transformers_distributed_workers as workers  # noqa: E402

if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    torch.set_num_threads(1)
    result = workers.train(out.parent / "launched", world_size=2)  # one output folder, as under torchrun
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)
    # Trainer leaves the process group open; gloo's threads torn down at interpreter exit can
    # abort a rank ("terminate called without an active exception"), so close it first.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
