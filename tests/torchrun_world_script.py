"""Run by tests/transformers/test_checkpoints.py under the real ``torchrun --nproc_per_node 2``, on CPU
without --use_cpu: each rank builds a DPTrainer and prints whether it was refused, and with what."""

import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import transformers  # noqa: E402

from transformers_support import CharDataset, collate, gpt2, sentences  # noqa: E402
from opake.transformers import DPTrainer  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    args = transformers.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, num_train_epochs=1,
                                          report_to="none", save_strategy="no", disable_tqdm=True)
    try:
        DPTrainer(model=gpt2(), args=args, train_dataset=CharDataset(sentences(32)), data_collator=collate,
                  noise_multiplier=1.0, target_delta=1e-5)
        verdict = "planned"
    except Exception as error:  # what the test reads: the refusal's class
        verdict = type(error).__name__
    print(f"rank {os.environ.get('RANK')}: {verdict}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
